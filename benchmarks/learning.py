#!/usr/bin/env python
"""Held-out learning of the CPU default against its ablations, on the default's budget (issue 32).

    .venv/bin/python benchmarks/learning.py [--seeds 0,1,2] [--arms envace,grpo_real,no_rehearse_loss,control]
                                            [--out DIR] [HYDRA_OVERRIDE ...]

Each arm is ``scripts/train.sh`` (the CPU default, ``experiment=cpu_default``) with the arm's overrides, once per
seed (``data.seed``: the training tasks' order and the held-out tasks validated), one run at a time:

==================  ================================================================================================
arm                 what differs from the default
==================  ================================================================================================
envace              nothing: act + rehearse, role-wise GRPO (EnvACE §4.2)
grpo_real           the policy acts against the real environment (``observation_source=real``): GRPO on the act
                    outputs, no rehearsals (the estimator is the same; with one role it is GRPO)
no_rehearse_loss    EnvACE, but the rehearse role's outputs carry no loss (``envace.advantage.trained_roles=[act]``)
control             no update: every step generates and scores, none trains (``trainer.critic_warmup`` = steps + 1:
                    verl updates the actor at step s iff critic_warmup <= s)
==================  ================================================================================================

It prints, per arm, held-out success at every validation (``val-core/heldout/success/mean@N``, mean ± sd over the
seeds, and the mean of the runs' own standard errors), the greedy pass's first and last, the paired change from the
first validation to the last (mean ± sd over seeds), the steps that updated the actor, and the budget: rollouts
(trajectories) and tokens generated (both roles) over the run, and the wall time of the command; then draws the four
curves (``--out``/learning.png). A run whose directory already holds its result (``benchmark.json``, written when the
run finished) is read, not re-run, so an interrupted benchmark resumes. A control run that updated the actor, or
another arm's run that never did, stops the benchmark.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

ARMS: dict[str, list[str]] = {
    "envace": [],
    "grpo_real": ["envace.agent.observation_source=real"],
    "no_rehearse_loss": ["envace.advantage.trained_roles=[act]"],
    "control": [],  # trainer.critic_warmup is set past the run's last step below
}


def _steps(overrides: list[str]) -> int:
    from envace.verl.config import compose

    cfg = compose(overrides)
    return int(cfg.trainer.total_training_steps)


def run_arm(arm: str, seed: int, out: Path, overrides: list[str], steps: int) -> dict:
    from envace.metrics import load_metrics

    run_dir = out / arm / f"seed{seed}"
    done = run_dir / "benchmark.json"
    if done.exists():
        return json.loads(done.read_text())
    extra = list(ARMS[arm]) + ([f"trainer.critic_warmup={steps + 1}"] if arm == "control" else [])
    cmd = [str(REPO / "scripts" / "train.sh"), *overrides, *extra, f"data.seed={seed}",
           f"trainer.default_local_dir={run_dir}", "trainer.save_freq=-1", f"trainer.experiment_name=learning_{arm}"]
    print("$", " ".join(cmd), flush=True)
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    t0 = time.perf_counter()
    log = out / arm / f"seed{seed}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as fh:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        print(log.read_text()[-4000:], file=sys.stderr)
        raise SystemExit(f"{arm} seed {seed}: scripts/train.sh exited {proc.returncode} (log: {log})")
    series = load_metrics(run_dir)
    # the steps that updated the actor (verl reports actor/* metrics only from an update)
    updates = len(series.get("actor/pg_loss", {}))
    if (arm == "control") != (updates == 0):
        raise SystemExit(f"{arm} seed {seed}: the actor was updated at {updates} of {steps} steps ({run_dir})")
    key = next(k for k in series if k.startswith("val-core/heldout/success/mean@"))
    greedy = next((k for k in series if k.startswith("val-core/heldout_greedy/success/mean@")), None)
    result = {
        "arm": arm, "seed": seed, "wall_s": wall,
        "heldout": {str(s): v for s, v in sorted(series[key].items())},
        "heldout_sem": {str(s): v for s, v in sorted(series[key.replace("/mean@", "/sem@")].items())},
        "greedy": {str(s): v for s, v in sorted(series[greedy].items())} if greedy else {},
        "change": _last(series.get("val-aux/heldout/success/change", {})),
        "change_sem": _last(series.get("val-aux/heldout/success/change_sem", {})),
        "updates": updates,
        "rollouts": sum(series.get("envace/trajectories", {}).values()),
        "tokens": sum(series.get("envace/act/tokens", {}).values()) + sum(
            series.get("envace/rehearse/tokens", {}).values()),
    }
    done.write_text(json.dumps(result, indent=1))
    return result


def _last(values: dict[int, float]) -> float | None:
    return values[max(values)] if values else None


def _ms(values: list[float], digits: int = 3) -> str:
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return "-"
    if len(values) == 1:  # one seed: no spread to show
        return f"{values[0]:.{digits}f}"
    return f"{statistics.fmean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def report(results: dict[str, list[dict]], out: Path) -> None:
    steps = sorted({int(s) for rs in results.values() for r in rs for s in r["heldout"]})
    print(f"\nheld-out success per validation step, mean ± sd over seeds (seeds: "
          f"{', '.join(str(r['seed']) for r in next(iter(results.values())))})")
    print(f"{'arm':<18}" + "".join(f"{'step ' + str(s):>18}" for s in steps) + f"{'run s.e. (mean)':>17}")
    for arm, rs in results.items():
        cells = "".join(f"{_ms([r['heldout'].get(str(s)) for r in rs]):>18}" for s in steps)
        sem = statistics.fmean(v for r in rs for v in r["heldout_sem"].values())
        print(f"{arm:<18}{cells}{sem:>17.3f}")
    print(f"\n{'arm':<18}{'change first->last':>20}{'change s.e. (run)':>19}{'greedy first':>16}{'greedy last':>16}"
          f"{'updates':>9}{'rollouts':>10}{'tokens':>12}{'wall s':>18}")
    for arm, rs in results.items():
        greedy_first = [r["greedy"][min(r["greedy"], key=int)] for r in rs if r["greedy"]]
        greedy_last = [r["greedy"][max(r["greedy"], key=int)] for r in rs if r["greedy"]]
        sems = [r["change_sem"] for r in rs if r["change_sem"] is not None]
        print(f"{arm:<18}{_ms([r['change'] for r in rs]):>20}"
              f"{(statistics.fmean(sems) if sems else float('nan')):>19.3f}{_ms(greedy_first):>16}"
              f"{_ms(greedy_last):>16}{statistics.fmean(r.get('updates', math.nan) for r in rs):>9.0f}"
              f"{statistics.fmean(r['rollouts'] for r in rs):>10.0f}"
              f"{statistics.fmean(r['tokens'] for r in rs):>12.0f}{_ms([r['wall_s'] for r in rs], 0):>18}")
    plot(results, steps, out / "learning.png")
    print(f"\nplot: {out / 'learning.png'}")


def plot(results: dict[str, list[dict]], steps: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for arm, rs in results.items():
        xs = [s for s in steps if all(str(s) in r["heldout"] for r in rs)]
        means = [statistics.fmean(r["heldout"][str(s)] for r in rs) for s in xs]
        sds = [statistics.stdev([r["heldout"][str(s)] for r in rs]) if len(rs) > 1 else 0.0 for s in xs]
        ax.errorbar(xs, means, yerr=sds, marker="o", markersize=4, capsize=3, label=arm)
    ax.set_xlabel("step")
    ax.set_ylabel("held-out success (sampled)")
    ax.set_title("held-out success, mean ± sd over seeds", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "benchmarks" / "learning")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides applied to every arm")
    args = parser.parse_args()
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        parser.error(f"--arms: unknown arm(s) {', '.join(unknown)} (known: {', '.join(ARMS)})")
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        parser.error(f"--seeds: a comma-separated list of integers, got {args.seeds!r}")
    steps = _steps(args.overrides)
    results = {arm: [run_arm(arm, seed, args.out, args.overrides, steps) for seed in seeds] for arm in arms}
    report(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
