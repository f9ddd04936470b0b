"""EnvSched at scale: pool, one-time graph build, peak memory and the step, at N tasks (issue 34, item 1).

    prlimit --as=14000000000 nice -n 10 .venv/bin/python benchmarks/envsched_scale.py --tasks 1000000 --cache DIR
    .venv/bin/python benchmarks/envsched_scale.py --tasks 10000 --cache /tmp/envsched_graphs   # run twice: miss, hit

Pool: ``envsched.synthetic.iter_synthetic_records`` (``--per-env`` tasks per environment, default 500, so
1,000,000 tasks are 2,000 environments x 500; ~27 tools per environment, gold call sequences, verifier checks
and code), streamed into ``TaskPool.from_records`` (no list of a million dicts).  Rewards come from
``SimulatedLearner`` (partial credit over the verifier checks).  Printed:

* pool: generation + validation time, RSS after it;
* build: wall / CPU seconds of ``EnvScheduler(pool, config)`` (operation extraction, the seven TF-IDF views of
  Eq. 1, cold-start representatives), the CPU seconds of its worker processes (``--build-workers``, config
  ``build_workers``; default: the config's, the usable CPUs) and, for a graph built here (not a cache hit), the
  wall seconds of each build phase; with ``--cache DIR`` the graph goes through ``graph_cache_dir`` (the
  first run stores it, a second run of the same command loads it: the "cache hit" figure includes the pool's
  content hash);
* step: median (and max) wall / CPU seconds of ``select(step) + observe(step, rewards)`` over ``--steps``
  steps (default 20) at B = 64, K = 8, after the cold-start step;
* peak RSS of the process (``ru_maxrss``), and the peak of the whole build's memory: the process's resident set
  plus its worker processes' private pages (the resident set sampled every 0.2 s, the workers' pages every 2 s; a
  forked worker shares the parent's pages until it writes to them, so its own resident set would count the pool
  twice); and the peak of the anonymous part (the resident set less its file-backed and shared pages, plus the
  workers'): the step reads S_full's rows from the memory-mapped files, and a kernel that keeps the page cache in
  large folios maps a whole folio per fault, so those clean file pages (dropped every few thousand rows, and
  reclaimable) can add gigabytes to the resident set between two drops;
* ``--predictor paper`` scores the tasks with the paper's Eq. 3-13 instead of the default learned predictor
  (``envsched/predictor.py``), whose fit is refitted at every step from all the groups observed so far;
* with ``relation_weights: measured`` (the paper predictor's default; ``--relation-weights paper`` for the paper's fixed weights),
  the relations' weights after the last step: while a relation is faded, the tasks without an own history share
  one prediction, and Eq. 5 must compare the similarity penalties of all the tied candidates it may pick.

A watchdog thread reads that total and exits the process (code 3) above ``--max-rss-gib``
(default 8), printing every thread's stack (where the memory went), so a run that would not fit stops itself on a
shared machine; run it under ``prlimit --as`` too, with room for the memory-mapped S_full matrix, which counts in
the address space but not in the resident set beyond the pages a step reads (4.6 GB of files at 1,000,000 tasks:
an address-space cap of 9 GB would refuse the mapping, hence 14 GB next to the 8 GiB resident-set watchdog).
"""

from __future__ import annotations

import argparse
import cProfile
import faulthandler
import os
import pstats
import resource
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from envsched import EnvSchedConfig, EnvScheduler, TaskPool
from envsched.synthetic import SimulatedLearner, iter_synthetic_records

GIB = 2**30


def _statm_bytes() -> tuple[int, int]:
    """(resident, resident less its file-backed and shared pages) of this process, in bytes (/proc/self/statm)."""
    with open("/proc/self/statm") as fh:
        resident, shared = (int(f) for f in fh.read().split()[1:3])
    page = os.sysconf("SC_PAGE_SIZE")
    return resident * page, (resident - shared) * page


def rss_bytes() -> int:
    return _statm_bytes()[0]


def children_cpu() -> float:
    """CPU seconds of this process's children that have exited (the build's forked workers)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB


def children_private_bytes() -> int:
    """Private resident bytes (Private_Clean + Private_Dirty of smaps_rollup) of this process's children: what the
    build's forked workers add to the memory they share with this process."""
    try:
        pids = Path(f"/proc/self/task/{os.getpid()}/children").read_text().split()
    except OSError:
        return 0
    total = 0
    for pid in pids:
        try:
            lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
        except OSError:  # the worker has just exited
            continue
        total += sum(int(line.split()[1]) * 1024 for line in lines if line.startswith(("Private_Clean:", "Private_Dirty:")))
    return total


PEAK_TOTAL = [0]  # peak of rss_bytes() + children_private_bytes(), sampled by the watchdog
PEAK_ANON = [0]  # peak of the anonymous resident set (_statm_bytes()[1]) + children_private_bytes()


def watchdog(limit_gib: float) -> None:
    def run() -> None:
        children, tick = 0, 0
        while True:
            if tick % 10 == 0:  # every 2 s: reading a worker's smaps_rollup walks its page tables (CPU charged here)
                children = children_private_bytes()
            tick += 1
            resident, anon = _statm_bytes()
            total = resident + children
            PEAK_TOTAL[0] = max(PEAK_TOTAL[0], total)
            PEAK_ANON[0] = max(PEAK_ANON[0], anon + children)
            if total > limit_gib * GIB:
                print(f"ABORT: resident set with the build workers' private pages {total / GIB:.2f} GiB above --max-rss-gib "
                      f"{limit_gib}; where it was:", flush=True)
                faulthandler.dump_traceback(sys.stdout, all_threads=True)  # the allocation that crossed the limit
                os._exit(3)
            time.sleep(0.2)

    threading.Thread(target=run, daemon=True).start()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=1_000_000, help="pool size N (rounded down to whole environments)")
    ap.add_argument("--per-env", type=int, default=500, help="tasks per environment")
    ap.add_argument("--steps", type=int, default=20, help="measured steps (after the cold-start step)")
    ap.add_argument("--cache", default=None, help="graph_cache_dir (run twice: the second run is a cache hit)")
    ap.add_argument("--max-rss-gib", type=float, default=8.0, help="abort above this resident set")
    ap.add_argument("--cprofile", type=int, default=0, metavar="K", help="print the K most expensive functions of the steps")
    ap.add_argument("--predictor", choices=("additive_logit", "paper"), default=EnvSchedConfig.model_fields["predictor"].default,
                    help="the task scores: the learned predictor (the default) or the paper's Eq. 3-13")
    ap.add_argument("--relation-weights", choices=("measured", "paper"), default=EnvSchedConfig.model_fields["relation_weights"].default,
                    help="EnvSchedConfig.relation_weights (default: the config's)")
    ap.add_argument("--build-workers", type=int, default=EnvSchedConfig.model_fields["build_workers"].default,
                    help="EnvSchedConfig.build_workers: processes of the graph build (1: in this process; default: the config's)")
    args = ap.parse_args()
    watchdog(args.max_rss_gib)
    n_envs = max(1, args.tasks // args.per_env)
    per = min(args.per_env, args.tasks)
    load = Path("/proc/loadavg").read_text().split()[0]
    print(f"N = {n_envs * per:,} tasks ({n_envs:,} environments x {per}), B = 64, K = 8; {os.cpu_count()} CPUs, "
          f"relation_weights {args.relation_weights}, load average {load}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)

    t0, c0 = time.perf_counter(), time.process_time()
    pool = TaskPool.from_records(iter_synthetic_records(n_envs, per, seed=0))
    print(f"pool   {time.perf_counter() - t0:7.1f} s wall / {time.process_time() - c0:7.1f} s CPU   "
          f"RSS {rss_bytes() / GIB:.2f} GiB", flush=True)
    archetype = np.fromiter((t.meta["archetype"] for t in pool.tasks), dtype=np.int64, count=len(pool))
    n_checks = np.fromiter((len(t.verifier_checks) for t in pool.tasks), dtype=np.int64, count=len(pool))
    learner = SimulatedLearner(pool.env, archetype, n_checks)

    cfg = EnvSchedConfig(batch_size=64, rollouts_per_task=8, graph_cache_dir=args.cache,
                         relation_weights=args.relation_weights, build_workers=args.build_workers,
                         predictor=args.predictor)
    t0, c0, k0 = time.perf_counter(), time.process_time(), children_cpu()
    sched = EnvScheduler(pool, cfg)
    build_wall, build_cpu, workers_cpu = time.perf_counter() - t0, time.process_time() - c0, children_cpu() - k0
    rep = sched.graph_report()
    load_after = Path("/proc/loadavg").read_text().split()[0]
    print(f"build  {build_wall:7.1f} s wall / {build_cpu:7.1f} s CPU + {workers_cpu:.1f} s CPU in workers ({rep['build_workers']} "
          f"build workers)   cache={rep['cache']}   RSS {rss_bytes() / GIB:.2f} GiB (peak so far {peak_rss_gib():.2f}, with the "
          f"workers' private pages {PEAK_TOTAL[0] / GIB:.2f}, anonymous {PEAK_ANON[0] / GIB:.2f})   nnz_full {rep['nnz_full']:,}   load average after {load_after}", flush=True)
    if rep["build_breakdown"]:
        print("build phases (s wall / CPU here + CPU in workers): "
              + ", ".join(f"{k} {v['wall']:.1f} / {v['cpu']:.1f} + {v['workers_cpu']:.1f}" for k, v in rep["build_breakdown"].items()), flush=True)

    def step(s: int) -> tuple[float, float]:
        w, c = time.perf_counter(), time.process_time()
        ids = sched.select(s)
        w1, c1 = time.perf_counter() - w, time.process_time() - c
        nodes = pool.indices(ids)
        rewards = learner.rollout(nodes, 8)
        learner.train(nodes, rewards)
        w, c = time.perf_counter(), time.process_time()
        sched.observe(s, {t: r.tolist() for t, r in zip(ids, rewards)})
        return w1 + time.perf_counter() - w, c1 + time.process_time() - c

    w0, _ = step(0)
    print(f"cold-start step {w0:.2f} s wall   RSS {rss_bytes() / GIB:.2f} GiB", flush=True)
    walls, cpus = [], []
    prof = cProfile.Profile() if args.cprofile else None
    for s in range(1, args.steps + 1):
        if prof:
            prof.enable()
        w, c = step(s)
        if prof:
            prof.disable()
        walls.append(w), cpus.append(c)
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.cprofile)
    if sched.relation_weights is not None:  # the relations' weights after the last step (0: faded, 1: the paper's)
        rw = sched.relation_weights.weights()
        print("relation weights after step " + str(args.steps) + ": "
              + ", ".join(f"{y} in {w['in']:g} / cross {w['cross']:g}" for y, w in rw.items()), flush=True)
    slowest = sorted(range(len(walls)), key=lambda i: -walls[i])[:3]
    print(f"step   median {np.median(walls):.3f} s wall / {np.median(cpus):.3f} s CPU, max {max(walls):.3f} s wall "
          f"over steps 1..{args.steps}, last {walls[-1]:.3f} s wall   RSS {rss_bytes() / GIB:.2f} GiB; slowest: "
          + ", ".join(f"step {i + 1} {walls[i]:.2f} s" for i in slowest), flush=True)
    print(f"RESULT N={len(pool)} build_wall_s={build_wall:.1f} build_workers={rep['build_workers']} cache={rep['cache']} "
          f"peak_rss_gib={peak_rss_gib():.2f} peak_total_gib={PEAK_TOTAL[0] / GIB:.2f} peak_anon_gib={PEAK_ANON[0] / GIB:.2f} "
          f"step_median_s={np.median(walls):.3f} step_cpu_median_s={np.median(cpus):.3f} step_last_s={walls[-1]:.3f} "
          f"predictor={args.predictor} load={load}", flush=True)


if __name__ == "__main__":
    main()
