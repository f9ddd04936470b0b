#!/usr/bin/env python
"""Plot a run's logged metrics as PNG curves.

    python scripts/plot_metrics.py RUN_DIR [--keys REGEX] [--out DIR]

RUN_DIR is a training run directory (``outputs/<project>/<experiment>``); its ``metrics/*.jsonl``
files (verl's file logger, one per launch, so resumed runs are whole) are merged by step, later
launches winning for repeated steps. One PNG per metric group (the part before the first ``/``).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections import defaultdict
from pathlib import Path


def load_metrics(run_dir: Path) -> dict[str, dict[int, float]]:
    """{metric: {step: value}} from every metrics JSONL file under ``run_dir/metrics``."""
    files = sorted((run_dir / "metrics").glob("*.jsonl"))
    if not files:
        raise SystemExit(f"no metrics/*.jsonl under {run_dir} (train with trainer.logger including 'file')")
    series: dict[str, dict[int, float]] = defaultdict(dict)
    for path in files:
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                print(f"warning: {path}:{lineno}: skipped unreadable line ({exc})", file=sys.stderr)
                continue
            step, data = rec.get("step"), rec.get("data", {})
            for key, value in data.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                    series[key][int(step)] = float(value)
    return series


def plot(series: dict[str, dict[int, float]], out_dir: Path, pattern: str | None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted(k for k in series if pattern is None or re.search(pattern, k))
    groups: dict[str, list[str]] = defaultdict(list)
    for key in keys:
        groups[key.split("/", 1)[0]].append(key)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for group, members in sorted(groups.items()):
        cols = min(3, len(members))
        rows = math.ceil(len(members) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3 * rows), squeeze=False)
        for ax, key in zip(axes.flat, members):
            steps = sorted(series[key])
            ax.plot(steps, [series[key][s] for s in steps], marker="o", markersize=3)
            ax.set_title(key, fontsize=8)
            ax.set_xlabel("step", fontsize=7)
            ax.tick_params(labelsize=7)
        for ax in list(axes.flat)[len(members):]:
            ax.axis("off")
        fig.tight_layout()
        path = out_dir / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', group)}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--keys", default=None, help="only metrics whose name matches this regex")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: RUN_DIR/plots)")
    args = parser.parse_args(argv)
    series = load_metrics(args.run_dir)
    written = plot(series, args.out or args.run_dir / "plots", args.keys)
    print(f"wrote {len(written)} plot(s) of {len(series)} metric(s) to {(args.out or args.run_dir / 'plots')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
