"""EnvSched pool files: the two JSONL layouts' size, load time and pool memory at N tasks (issue 12, item 5).

    nice -n 19 .venv/bin/python benchmarks/envsched_pool_scale.py                 # N = 100,000 (2,000 x 50)
    nice -n 19 .venv/bin/python benchmarks/envsched_pool_scale.py --tasks 5000    # quicker

The pool is ``envsched.synthetic.synthetic_records`` (50 tasks per environment, ~27 tools per environment,
gold call sequences), written to JSONL in a temporary folder and read back with ``TaskPool.from_jsonl``:

* ``per-task`` file: every task line repeats its environment's tools (the original format);
* ``env-level`` file: each environment's tools and metadata stored once (``TaskPool.to_jsonl(...,
  env_level=True)``), where the installed envsched supports it.

Pool memory is what ``tracemalloc`` sees retained by the loaded ``TaskPool`` (Python + numpy allocations;
the parse peak is printed beside it); load time is measured in a separate load without tracemalloc.
Times are wall and process CPU seconds (CPU is the steadier figure on a shared machine).  The graph build, the
graph cache, peak memory and the step at up to 1,000,000 tasks are measured by ``benchmarks/envsched_scale.py``.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import os
import resource
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from envsched import TaskPool
from envsched.synthetic import synthetic_records

MIB = 2**20


def _load(path: Path) -> tuple[TaskPool, float, float, float, float]:
    """Load ``path`` twice: timed without tracemalloc (which slows allocation-heavy code several-fold), then
    measured with it.  Returns (pool, retained MiB, peak MiB, wall s, CPU s)."""
    gc.collect()
    t0, c0 = time.perf_counter(), time.process_time()
    pool = TaskPool.from_jsonl(path)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    del pool
    gc.collect()
    tracemalloc.start()
    pool = TaskPool.from_jsonl(path)
    gc.collect()
    cur, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return pool, cur / MIB, peak / MIB, wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=100_000, help="pool size N (rounded down to whole environments)")
    ap.add_argument("--per-env", type=int, default=50, help="tasks per environment")
    args = ap.parse_args()
    n_envs = max(1, args.tasks // args.per_env)
    n = n_envs * args.per_env
    import envsched

    print(f"N = {n:,} tasks ({n_envs:,} environments x {args.per_env}); envsched from {Path(envsched.__file__).parent}", flush=True)
    t0 = time.perf_counter()
    records = synthetic_records(n_envs, args.per_env, seed=0)
    print(f"generate records        {time.perf_counter() - t0:8.1f} s", flush=True)
    env_level = "env_level" in inspect.signature(TaskPool.to_jsonl).parameters
    with tempfile.TemporaryDirectory(prefix="envsched_pool_scale_") as tmp:
        old_path = Path(tmp) / "pool_per_task.jsonl"
        pool = TaskPool.from_records(records)
        pool.to_jsonl(old_path, env_level=False) if env_level else pool.to_jsonl(old_path)
        del records
        files = [("per-task", old_path)]
        if env_level:
            new_path = Path(tmp) / "pool_env_level.jsonl"
            TaskPool.from_jsonl(old_path).to_jsonl(new_path, env_level=True)
            files.append(("env-level", new_path))
        del pool
        for name, path in files:
            gc.collect()
            _, cur, peak, wall, cpu = _load(path)
            print(f"pool [{name:9s}] file {path.stat().st_size / MIB:8.1f} MiB | loaded in {wall:6.1f} s wall / {cpu:6.1f} s CPU | "
                  f"memory {cur:8.1f} MiB retained ({cur / 1024:.2f} GiB), parse peak {peak:8.1f} MiB", flush=True)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"process max RSS {rss:8.1f} MiB  (pid {os.getpid()})", flush=True)


if __name__ == "__main__":
    main()
