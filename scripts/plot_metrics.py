#!/usr/bin/env python
"""Plot a run's logged metrics as PNG curves.

    python scripts/plot_metrics.py RUN_DIR [--keys REGEX] [--out DIR]

RUN_DIR is a training run directory (``outputs/<project>/<experiment>``); its ``metrics/*.jsonl``
files (verl's file logger, one per launch, so resumed runs are whole) are merged by step, later
launches winning for repeated steps. One PNG per metric group (the part before the first ``/``), or with
``--reward-curve`` one PNG of the training reward and the validation success (what ``scripts/train.sh`` ends with).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from envace.metrics import load_metrics, plot, reward_curve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--keys", default=None, help="only metrics whose name matches this regex")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: RUN_DIR/plots)")
    parser.add_argument("--reward-curve", action="store_true",
                        help="draw only the reward curve (training reward + validation success) as reward_curve.png")
    args = parser.parse_args(argv)
    series = load_metrics(args.run_dir)
    if args.reward_curve:
        print(reward_curve(series, (args.out or args.run_dir / "plots") / "reward_curve.png"))
        return 0
    written = plot(series, args.out or args.run_dir / "plots", args.keys)
    print(f"wrote {len(written)} plot(s) of {len(series)} metric(s) to {(args.out or args.run_dir / 'plots')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
