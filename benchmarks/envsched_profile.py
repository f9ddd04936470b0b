"""Profile helper: per-phase CPU time of the EnvSched step (select / observe, their main parts).

    .venv/bin/python benchmarks/envsched_profile.py --envs 51 --warmup 10 --steps 5 [--cprofile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from envsched import EnvSchedConfig, EnvScheduler, TaskPool
from envsched.synthetic import SimulatedLearner, synthetic_records


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--envs", type=int, default=51)
    ap.add_argument("--per", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("sort", nargs="?", default="cumulative")
    args = ap.parse_args()
    recs = synthetic_records(args.envs, args.per, seed=0)
    pool = TaskPool.from_records(recs)
    learner = SimulatedLearner(pool.env, np.array([r["meta"]["archetype"] for r in recs]), np.array([len(r["verifier_checks"]) for r in recs]))
    c0 = time.process_time()
    sched = EnvScheduler(pool, EnvSchedConfig(batch_size=64, rollouts_per_task=8))
    print(f"build cpu {time.process_time() - c0:.1f}s", flush=True)
    sel_t, obs_t = [], []

    def step(s: int) -> None:
        c = time.process_time()
        ids = sched.select(s)
        c1 = time.process_time()
        nodes = pool.indices(ids)
        rewards = learner.rollout(nodes, 8)
        learner.train(nodes, rewards)
        c2 = time.process_time()
        sched.observe(s, {t: r.tolist() for t, r in zip(ids, rewards)})
        c3 = time.process_time()
        sel_t.append(c1 - c), obs_t.append(c3 - c2)

    for s in range(args.warmup):
        step(s)
    sel_t.clear(), obs_t.clear()
    prof = cProfile.Profile() if args.cprofile else None
    if prof:
        prof.enable()
    for s in range(args.warmup, args.warmup + args.steps):
        step(s)
    if prof:
        prof.disable()
        pstats.Stats(prof).sort_stats(sys.argv[-1] if sys.argv[-1] in ("tottime", "cumulative") else "cumulative").print_stats(35)
    print(f"N={len(pool)} select cpu median {np.median(sel_t):.4f}s  observe cpu median {np.median(obs_t):.4f}s  total {np.median(np.add(sel_t, obs_t)):.4f}s")
    print("selections hash", hash(tuple(tuple(sched.selections[s].tolist()) for s in sorted(sched.selections))))


if __name__ == "__main__":
    main()
