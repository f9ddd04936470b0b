#!/usr/bin/env python
"""Two runs of the same config and seed, one training step each: do they generate and score the same rollouts?

    .venv/bin/python benchmarks/reproducibility.py [--out DIR] [--steps 1] [HYDRA_OVERRIDE ...]
    .venv/bin/python benchmarks/reproducibility.py --compare RUN_A RUN_B [--steps 1]

Each run is ``scripts/train.sh experiment=cpu_default`` plus the overrides given, without validation or
checkpoints, into ``--out/a`` and ``--out/b``. The rollout server seeds every generation by the rollout's identity
and its index within the rollout (:func:`envace.agents.verl_loop.request_seed`), not by arrival order; pass
``actor_rollout_ref.rollout.max_num_seqs=1`` to decode every request alone, which also takes batch-shape-dependent
float rounding out of the comparison.

Printed, per step: the step's metrics that differ between the runs (``critic/score/*``, ``critic/rewards/*``,
``envace/*``; timings left out), and how many rollout-dump rows are identical (input, output, score, advantage),
keyed by task, rollout, output index and role: verl's prompt uids are fresh uuids every run, and the rows verl adds
as padding (``pad`` uids, copies of a row it picks) are left out. Exit 0 when everything compared is identical.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PREFIXES = ("critic/score/", "critic/rewards/", "envace/")


def step_metrics(run: Path, step: int) -> dict[str, float]:
    """The step's compared metrics of a run (its ``metrics/*.jsonl``)."""
    for path in sorted((run / "metrics").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record.get("step") == step:
                return {k: v for k, v in record["data"].items() if k.startswith(PREFIXES) and "time" not in k}
    raise SystemExit(f"{run}: no step {step} in metrics/*.jsonl")


def dump_rows(run: Path, step: int) -> dict[tuple, tuple]:
    """The step's rollout-dump rows, keyed without verl's per-run uid; padding rows left out."""
    path = run / "rollouts" / f"{step}.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path}: no rollout dump (trainer.rollout_data_dir unset?)")
    out = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        uid, session, index = row["uid"].rsplit("_", 2)
        if not uid.startswith("pad"):
            key = (row["task_id"], int(session), int(index), row["role"])
            out[key] = (row["input"], row["output"], row["score"], row.get("advantage"))
    return out


def compare(a: Path, b: Path, steps: int) -> bool:
    same = True
    for step in range(1, steps + 1):
        ma, mb = step_metrics(a, step), step_metrics(b, step)
        differing = sorted(k for k in set(ma) | set(mb) if ma.get(k) != mb.get(k))
        ra, rb = dump_rows(a, step), dump_rows(b, step)
        identical = sum(ra[k] == rb.get(k) for k in ra)
        print(f"step {step}: critic/score/mean {ma.get('critic/score/mean')} vs {mb.get('critic/score/mean')}; "
              f"{len(set(ma) | set(mb))} metrics compared, {len(differing)} differ{': ' if differing else ''}"
              f"{', '.join(differing)}; rollout rows {len(ra)} vs {len(rb)}, {identical} identical")
        same &= not differing and identical == len(ra) == len(rb)
    return same


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "benchmarks" / "reproducibility")
    parser.add_argument("--steps", type=int, default=1, help="training steps of each run (all are compared)")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("RUN_A", "RUN_B"), help="only compare two runs")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides applied to both runs")
    args = parser.parse_args(argv)
    if args.compare:
        return 0 if compare(*args.compare, args.steps) else 1
    for name in ("a", "b"):
        cmd = [str(REPO / "scripts" / "train.sh"), "experiment=cpu_default", *args.overrides,
               f"trainer.total_training_steps={args.steps}", "trainer.val_before_train=false", "trainer.test_freq=-1",
               "trainer.save_freq=-1", "trainer.resume_mode=disable", f"trainer.experiment_name=repro_{name}",
               f"trainer.default_local_dir={args.out / name}"]
        print("$", " ".join(cmd), flush=True)
        if subprocess.run(cmd, cwd=REPO, check=False).returncode != 0:
            print(f"run {name} failed", file=sys.stderr)
            return 1
    return 0 if compare(args.out / "a", args.out / "b", args.steps) else 1


if __name__ == "__main__":
    sys.exit(main())
