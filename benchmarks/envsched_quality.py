"""EnvSched selection quality on a simulated learner, next to the paper's Table 2 and Table 3(a).

    .venv/bin/python benchmarks/envsched_quality.py           # 51 envs x 50 tasks, B = 64, K = 8, 200 steps
    .venv/bin/python benchmarks/envsched_quality.py --quick   # 60 steps

Schedulers: EnvSched (rho = 0.5), random, coverage only (rho = 1), exploitation only (rho = 0).  The learner
(envsched.synthetic.SimulatedLearner) has latent difficulty by environment, structural archetype and task,
and its success probability rises on the tasks it is trained on (GRPO-like: updates scale with the
within-group reward spread).  Columns: mean / median within-task reward variance of the selected groups over
all steps, median reward, environments and tools per batch, and the learner's final mean success
probability over the whole pool (a proxy for "downstream" quality).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from envsched import EnvSchedConfig, EnvScheduler, TaskPool
from envsched.synthetic import SimulatedLearner, synthetic_records

PAPER = {  # Qwen3-4B, Table 2 and Table 3(a): mean var, median var, median reward, envs/batch, tools/batch
    "envsched": (0.04290, 0.02108, 0.592, 45.96, 478.39),
    "random": (0.03208, 0.01468, 0.595, 36.53, 413.41),
    "coverage only (rho=1)": (0.0357, None, None, 51.00, 502.10),
    "exploitation only (rho=0)": (0.0442, None, None, 33.95, 420.63),
}


def run(name: str, cfg: EnvSchedConfig, pool: TaskPool, recs: list, graph, steps: int, seed: int) -> dict:
    learner = SimulatedLearner(pool.env, np.array([r["meta"]["archetype"] for r in recs]), np.array([len(r["verifier_checks"]) for r in recs]), seed=seed)
    sched = EnvScheduler(pool, cfg, graph=graph if cfg.scheduler == "envsched" else None)
    variances, rewards, envs, tools, times = [], [], [], [], []
    for step in range(steps):
        ids = sched.select(step)
        nodes = pool.indices(ids)
        R = learner.rollout(nodes, cfg.rollouts_per_task)
        learner.train(nodes, R)
        m = sched.observe(step, {t: r.tolist() for t, r in zip(ids, R)})
        variances.extend(R.var(axis=1).tolist())
        rewards.extend(R.mean(axis=1).tolist())
        envs.append(m["envsched/envs_per_batch"])
        tools.append(m["envsched/tools_per_batch"])
        times.append(m["envsched/schedule_time_s"])
    return {
        "name": name, "mean_var": float(np.mean(variances)), "median_var": float(np.median(variances)),
        "median_reward": float(np.median(rewards)), "envs": float(np.mean(envs)), "tools": float(np.mean(tools)),
        "final_success": float(learner.success_prob().mean()), "step_s": float(np.median(times)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="60 steps instead of 200")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--seeds", type=int, default=1, help="learner seeds to average")
    args = ap.parse_args()
    steps = args.steps or (60 if args.quick else 200)
    recs = synthetic_records(51, 50, seed=0)
    pool = TaskPool.from_records(recs)
    base = EnvSchedConfig(batch_size=64, rollouts_per_task=8)
    t0 = time.perf_counter()
    graph = EnvScheduler(pool, base).graph
    print(f"static graph: {time.perf_counter() - t0:.1f}s, {graph.report()['extractors']}", flush=True)
    variants = {
        "envsched": base,
        "random": base.replace(scheduler="random"),
        "coverage only (rho=1)": base.replace(rho=1.0),
        "exploitation only (rho=0)": base.replace(rho=0.0),
    }
    results = {}
    for name, cfg in variants.items():
        runs = [run(name, cfg, pool, recs, graph, steps, seed) for seed in range(args.seeds)]
        results[name] = {k: (np.mean([r[k] for r in runs]) if k != "name" else name) for k in runs[0]}
        print(f"  done {name}", flush=True)

    def fmt(x, spec):
        return "-" if x is None else format(x, spec)

    print(f"\nSelection quality, simulated learner: 51 envs x 50 tasks, B=64, K=8, {steps} steps, {args.seeds} seed(s)")
    hdr = f"{'scheduler':<27} {'mean var':>9} {'median var':>10} {'med reward':>10} {'envs/batch':>10} {'tools/batch':>11} {'final p':>8} {'step s':>7} | {'paper mean var':>14} {'paper median':>12} {'paper envs':>10} {'paper tools':>11}"
    print(hdr)
    print("-" * len(hdr))
    for name, r in results.items():
        p = PAPER[name]
        print(f"{name:<27} {r['mean_var']:>9.5f} {r['median_var']:>10.5f} {r['median_reward']:>10.3f} {r['envs']:>10.2f} {r['tools']:>11.2f} {r['final_success']:>8.3f} {r['step_s']:>7.3f} | "
              f"{fmt(p[0], '.4f'):>14} {fmt(p[1], '.5f'):>12} {fmt(p[3], '.2f'):>10} {fmt(p[4], '.2f'):>11}")
    e, r = results["envsched"], results["random"]
    dv, de = e["mean_var"] / r["mean_var"] - 1, e["envs"] / r["envs"] - 1
    dm = e["median_var"] / r["median_var"] - 1 if r["median_var"] > 0 else float("nan")
    print(f"\nEnvSched vs random: mean variance {dv:+.0%} (paper +34%), median variance {dm:+.0%} (paper +44%), "
          f"environments per batch {de:+.0%} (paper +26%)")
    print("paper direction reproduced" if dv > 0 and de > 0 else "paper direction NOT reproduced (see README: benchmark notes)")


if __name__ == "__main__":
    main()
