#!/usr/bin/env python
"""Per-phase time of CPU training steps, through the real path (``scripts/train.sh``).

    .venv/bin/python benchmarks/cpu_step.py [--steps N] [HYDRA_OVERRIDE ...]

Runs N steps (default 2; the first includes warm-up) of the default CPU run (or the experiment and
overrides given), then prints, per step, verl's own phase timers: generation (``gen``, the agent loops with
rehearsals), old log-prob, reference log-prob, advantage, actor update, weight sync to the rollout server,
checkpoint, validation, and the whole step; plus the rows trained (outputs of both roles) so the cost can be
read per row. Figures come from the run's ``metrics/*.jsonl`` (verl's file logger).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PHASES = ["gen", "old_log_prob", "ref", "adv", "update_actor", "update_weights", "save_checkpoint", "testing", "step"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for scripts/train.sh")
    args = parser.parse_args()
    from envace.metrics import load_metrics

    with tempfile.TemporaryDirectory(prefix="envace-cpu-step-") as tmp:
        cmd = [str(REPO / "scripts" / "train.sh"), *args.overrides, f"trainer.total_training_steps={args.steps}",
               f"trainer.default_local_dir={tmp}", "trainer.logger=[console,file]", "trainer.save_freq=-1",
               "trainer.test_freq=-1"]
        print("$", " ".join(cmd), flush=True)
        t0 = time.perf_counter()
        env = dict(os.environ)
        env.pop("RAY_ADDRESS", None)
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            print((proc.stdout + proc.stderr)[-6000:], file=sys.stderr)
            return proc.returncode
        series = load_metrics(Path(tmp))
    steps = sorted(series.get("timing_s/step", {}))
    head = f"{'phase':<16}" + "".join(f"{'step ' + str(s):>10}" for s in steps)
    print(f"\nwall time of the whole command (start-up, Ray, model load included): {wall:.1f} s")
    print(head)
    for phase in PHASES:
        vals = series.get(f"timing_s/{phase}", {})
        if vals:
            print(f"{phase:<16}" + "".join(f"{vals.get(s, float('nan')):>10.2f}" for s in steps))
    for key in ("envace/act/outputs", "envace/rehearse/outputs", "envace/act/tokens", "envace/rehearse/tokens",
                "response_length/mean", "prompt_length/mean"):
        vals = series.get(key, {})
        if vals:
            print(f"{key:<32}" + "".join(f"{vals.get(s, float('nan')):>10.1f}" for s in steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
