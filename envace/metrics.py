"""A run's logged metrics: read verl's file-logger JSONL, draw PNG curves, summarise the learning.

``scripts/plot_metrics.py`` is the command line for :func:`load_metrics` and :func:`plot`; ``envace.train`` ends
every run with :func:`learning_summary` and a reward-curve PNG.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

__all__ = ["learning_summary", "load_metrics", "plot", "reward_curve", "validation_keys", "validation_success"]


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


def validation_keys(series: dict[str, dict[int, float]]) -> list[str]:
    """verl's core validation metrics, one per data source (``val-core/<data source>/<var>/mean@N``)."""
    return sorted(k for k in series if k.startswith("val-core/") and re.search(r"/mean@\d+$", k))


def validation_success(series: dict[str, dict[int, float]]) -> dict[int, float]:
    """Held-out success per validation step: the mean over data sources of verl's ``val-core/.../mean@N``.

    envace names a row's data source after its pool and category (``synthetic/act``, ``bfcl_multi_turn/base``),
    so this is the macro average over categories, each category weighted alike.
    """
    keys = validation_keys(series)
    steps = sorted({s for k in keys for s in series[k]})
    return {s: sum(series[k][s] for k in keys if s in series[k]) / sum(s in series[k] for k in keys) for s in steps}


def learning_summary(series: dict[str, dict[int, float]], window: int = 5) -> dict[str, Any] | None:
    """First and last held-out success (:func:`validation_success`), and the training reward's mean over the
    first and over the last ``window`` steps (at most a quarter of the run each): one step's reward is the mean
    of a few groups on the step's own tasks, far noisier than a trend."""
    val = validation_success(series)
    if not val:
        return None
    first, last = min(val), max(val)
    out: dict[str, Any] = {"first_step": first, "first": val[first], "last_step": last, "last": val[last],
                           "sources": len(validation_keys(series))}
    score = series.get("critic/score/mean", {})
    if score:
        steps = sorted(score)
        w = max(1, min(window, len(steps) // 4))
        out["train_reward_first"] = sum(score[s] for s in steps[:w]) / w
        out["train_steps_first"] = (steps[0], steps[w - 1])
        out["train_reward_last"] = sum(score[s] for s in steps[-w:]) / w
        out["train_steps_last"] = (steps[-w], steps[-1])
    return out


def reward_curve(series: dict[str, dict[int, float]], path: Path) -> Path:
    """One PNG: the training reward per step and the validation success at each validation step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    score = series.get("critic/score/mean", {})
    if score:
        steps = sorted(score)
        ax.plot(steps, [score[s] for s in steps], marker="o", markersize=3, label="train reward (critic/score/mean)")
    val = validation_success(series)
    if val:
        steps = sorted(val)
        ax.plot(steps, [val[s] for s in steps], marker="s", markersize=4, label="held-out success (validation)")
    ax.set_xlabel("step")
    ax.set_ylabel("reward / success")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
