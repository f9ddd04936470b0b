"""EnvSched cost benchmark: static build time, incremental step time and peak memory.

    .venv/bin/python benchmarks/envsched_cost.py            # N = 2,550 (51 x 50) and N = 20,000 (400 x 50)
    .venv/bin/python benchmarks/envsched_cost.py --quick    # the same sizes, fewer steps

Larger pools (10,000 to 1,000,000 tasks: build, peak RSS, step) are measured by benchmarks/envsched_scale.py.

Each size: B = 64, K = 8, synthetic pool (envsched.synthetic), simulated learner rewards.  A step is
select(step) + observe(step, rewards) after a warm-up of history; wall and CPU seconds per step are the
median over the measured steps.  Peak memory: tracemalloc peak during one extra step (Python + numpy
allocations) and the process's max RSS.  The paper reports 34.93 s per step at 2,550 tasks (§3.3.2).
"""

from __future__ import annotations

import argparse
import gc
import resource
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from envsched import EnvSchedConfig, EnvScheduler, TaskPool
from envsched.synthetic import SimulatedLearner, synthetic_records


def run_size(n_envs: int, per_env: int, warmup: int, measure: int, batch: int = 64, k: int = 8) -> dict:
    recs = synthetic_records(n_envs, per_env, seed=0)
    pool = TaskPool.from_records(recs)
    learner = SimulatedLearner(pool.env, np.array([r["meta"]["archetype"] for r in recs]), np.array([len(r["verifier_checks"]) for r in recs]))
    del recs
    gc.collect()
    t0, c0 = time.perf_counter(), time.process_time()
    sched = EnvScheduler(pool, EnvSchedConfig(batch_size=batch, rollouts_per_task=k))
    build_wall, build_cpu = time.perf_counter() - t0, time.process_time() - c0
    g = sched.graph
    static_mib = (g.x_full.data.nbytes + g.x_full.indices.nbytes + g.x_full.indptr.nbytes + g.x_abs.data.nbytes + g.x_abs.indices.nbytes + g.x_abs.indptr.nbytes) / 2**20

    def step(s: int) -> tuple[float, float]:
        w, c = time.perf_counter(), time.process_time()
        ids = sched.select(s)
        w1, c1 = time.perf_counter() - w, time.process_time() - c
        nodes = pool.indices(ids)
        rewards = learner.rollout(nodes, k)
        learner.train(nodes, rewards)
        w, c = time.perf_counter(), time.process_time()
        sched.observe(s, {t: r.tolist() for t, r in zip(ids, rewards)})
        return w1 + time.perf_counter() - w, c1 + time.process_time() - c

    for s in range(warmup):
        step(s)
    walls, cpus = zip(*(step(s) for s in range(warmup, warmup + measure)))
    gc.collect()
    tracemalloc.start()
    step(warmup + measure)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    nb = sched.neighbors
    state_mib = sum(a.nbytes for a in (*nb.idx.values(), *nb.sim.values())) / 2**20
    return {
        "N": len(pool), "envs": n_envs, "build_wall_s": build_wall, "build_cpu_s": build_cpu,
        "step_wall_s": float(np.median(walls)), "step_cpu_s": float(np.median(cpus)), "step_wall_max_s": float(np.max(walls)),
        "step_peak_mib": peak / 2**20, "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "static_mib": static_mib, "neighbor_state_mib": state_mib, "extractor": g.report()["extractors"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer steps (a few minutes on 2 cores)")
    ap.add_argument("--warmup", type=int, default=None, help="steps of history before measuring")
    ap.add_argument("--steps", type=int, default=None, help="measured steps per size")
    args = ap.parse_args()
    sizes = [(51, 50), (400, 50)]
    warmup = args.warmup if args.warmup is not None else (10 if args.quick else 30)
    steps = args.steps if args.steps is not None else (5 if args.quick else 10)
    rows = []
    for n_envs, per in sizes:
        r = run_size(n_envs, per, warmup, steps)
        rows.append(r)
        print(f"  done N={r['N']}: step {r['step_wall_s']:.3f}s wall / {r['step_cpu_s']:.3f}s cpu, build {r['build_wall_s']:.1f}s", flush=True)
    load = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?"
    print(f"\nEnvSched cost (B=64, K=8, warm-up {warmup} steps, median of {steps} measured steps; load average {load})")
    hdr = f"{'N':>8} {'envs':>5} {'build s':>8} {'step wall s':>11} {'step cpu s':>10} {'max step s':>10} {'step peak MiB':>13} {'static MiB':>10} {'nbr MiB':>8} {'RSS MiB':>8} {'target s':>8}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        target = 0.05 if r["N"] <= 2550 else 2.0
        print(f"{r['N']:>8,} {r['envs']:>5} {r['build_wall_s']:>8.1f} {r['step_wall_s']:>11.3f} {r['step_cpu_s']:>10.3f} {r['step_wall_max_s']:>10.3f} {r['step_peak_mib']:>13.1f} {r['static_mib']:>10.1f} {r['neighbor_state_mib']:>8.2f} {r['max_rss_mib']:>8.0f} {target:>8}")
    print(f"{'paper':>8} {51:>5} {'-':>8} {34.93:>11.2f} {'-':>10} {'-':>10} {'-':>13} {85.87:>10.2f} {1.24:>8.2f} {'-':>8}   (2,550 tasks, §3.3.2)")
    if len(rows) == 2:
        a, b = rows
        print(f"\nscaling N x{b['N'] / a['N']:.1f}: step cpu x{b['step_cpu_s'] / a['step_cpu_s']:.1f} (linear would be x{b['N'] / a['N']:.1f}); "
              f"per-task step cpu {1e6 * a['step_cpu_s'] / a['N']:.1f} us -> {1e6 * b['step_cpu_s'] / b['N']:.1f} us")
    print(f"operation extractor: {rows[0]['extractor']}")


if __name__ == "__main__":
    main()
