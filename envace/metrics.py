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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["HELDOUT", "HELDOUT_GREEDY", "HeldoutEstimate", "heldout_change", "heldout_estimate", "learning_line", "learning_summary",
           "load_metrics", "plot", "reward_curve", "validation_keys", "validation_success"]

#: the data-source names of envace's own held-out validation metrics (``val-core/heldout/success/mean@N`` and
#: ``.../sem@N``; the greedy pass under ``heldout_greedy``), written by ``envace.verl.trainer``
HELDOUT = "heldout"
HELDOUT_GREEDY = "heldout_greedy"


@dataclass(frozen=True)
class HeldoutEstimate:
    """Mean success over held-out tasks and its standard error."""

    mean: float
    sem: float  # standard error of ``mean``; nan with fewer than 2 tasks
    tasks: int
    samples: int  # episodes behind ``mean`` (tasks x samples per task)


def heldout_estimate(per_task: Mapping[str, Sequence[float]]) -> HeldoutEstimate:
    """Held-out success as the mean over tasks of each task's mean score, with the standard error of that mean.

    The tasks are a sample of the held-out distribution and each is sampled a few times, so the episodes are
    clustered by task: the error is the sample standard deviation of the per-task means over sqrt(tasks) (the
    cluster-robust error of the mean for equal samples per task). It counts both the sampling noise of each task's
    episodes and the spread of success between tasks; treating the episodes as independent would understate it
    whenever a task's samples agree with each other.
    """
    from scipy import stats

    means = [sum(v) / len(v) for v in per_task.values() if len(v)]
    if not means:
        raise ValueError("held-out estimate of no task")
    sem = float(stats.sem(means)) if len(means) > 1 else float("nan")
    return HeldoutEstimate(sum(means) / len(means), sem, len(means), sum(len(v) for v in per_task.values()))


def heldout_change(first: Mapping[str, Sequence[float]], last: Mapping[str, Sequence[float]]) -> HeldoutEstimate:
    """The change of held-out success from ``first`` to ``last`` on the tasks both scored, paired by task.

    Each task's difference of means is one observation, so the error of the change is the standard error of those
    differences: the tasks' own difficulty cancels, which two independent errors would count twice. A change of at
    least three such errors is the criterion the default run is held to (docs/results/learning.md).
    """
    common = sorted(set(first) & set(last))
    if not common:
        raise ValueError("the two validations share no task")
    diffs = {t: [sum(last[t]) / len(last[t]) - sum(first[t]) / len(first[t])] for t in common}
    est = heldout_estimate(diffs)
    return HeldoutEstimate(est.mean, est.sem, est.tasks, sum(len(first[t]) + len(last[t]) for t in common))


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


def validation_keys(series: dict[str, dict[int, float]], source: str | None = None) -> list[str]:
    """verl's core validation means (``val-core/<data source>/<var>/mean@N``): with ``source``, those of that data
    source alone; without, one per pool category (``synthetic/act``, ...), envace's own held-out aggregates
    (:data:`HELDOUT`, :data:`HELDOUT_GREEDY`) and the greedy pass's categories (``greedy/...``) left out."""
    keys = sorted(k for k in series if k.startswith("val-core/") and re.search(r"/mean@\d+$", k))
    if source is not None:
        return [k for k in keys if k.startswith(f"val-core/{source}/")]
    skip = (f"val-core/{HELDOUT}/", f"val-core/{HELDOUT_GREEDY}/", "val-core/greedy/")
    return [k for k in keys if not k.startswith(skip)]


def validation_success(series: dict[str, dict[int, float]], source: str = HELDOUT) -> dict[int, float]:
    """Held-out success per validation step: envace's ``val-core/heldout/success/mean@N`` (``source``:
    :data:`HELDOUT_GREEDY` for the greedy pass). A run logged without it (verl's trainers, older runs) falls back to
    the mean over data sources of verl's ``val-core/.../mean@N``: envace names a row's data source after its pool and
    category (``synthetic/act``, ``bfcl_multi_turn/base``), so that is the macro average over categories.
    """
    own = validation_keys(series, source)
    if own:  # one key per samples-per-task N: a validation that sampled fewer (a task's rows cut) logs another N
        return {step: value for key in own for step, value in series[key].items()}
    if source != HELDOUT:
        return {}
    keys = validation_keys(series)
    steps = sorted({s for k in keys for s in series[k]})
    return {s: sum(series[k][s] for k in keys if s in series[k]) / sum(s in series[k] for k in keys) for s in steps}


def _sem(series: dict[str, dict[int, float]], source: str, step: int) -> float | None:
    keys = [k.replace("/mean@", "/sem@") for k in validation_keys(series, source)]
    return next((series[k][step] for k in keys if step in series.get(k, {})), None)


def learning_summary(series: dict[str, dict[int, float]], window: int = 5) -> dict[str, Any] | None:
    """First and last held-out success (:func:`validation_success`) with their standard errors where logged, the
    greedy pass's first and last, the paired change from the first validation to the last with its error
    (``val-aux/heldout/success/change`` and ``.../change_sem`` of the last step), and the training reward's mean
    over the first and over the last ``window`` steps (at most a quarter of the run each): one step's reward is the
    mean of a few groups on the step's own tasks, far noisier than a trend."""
    val = validation_success(series)
    if not val:
        return None
    first, last = min(val), max(val)
    out: dict[str, Any] = {"first_step": first, "first": val[first], "last_step": last, "last": val[last],
                           "first_sem": _sem(series, HELDOUT, first), "last_sem": _sem(series, HELDOUT, last),
                           "sources": len(validation_keys(series))}
    greedy = validation_success(series, HELDOUT_GREEDY)
    if greedy:
        out["greedy_first"], out["greedy_last"] = greedy[min(greedy)], greedy[max(greedy)]
    change = series.get(f"val-aux/{HELDOUT}/success/change", {})
    if last in change and last != first:
        out["change"] = change[last]
        out["change_sem"] = series.get(f"val-aux/{HELDOUT}/success/change_sem", {}).get(last)
    score = series.get("critic/score/mean", {})
    if score:
        steps = sorted(score)
        w = max(1, min(window, len(steps) // 4))
        out["train_reward_first"] = sum(score[s] for s in steps[:w]) / w
        out["train_steps_first"] = (steps[0], steps[w - 1])
        out["train_reward_last"] = sum(score[s] for s in steps[-w:]) / w
        out["train_steps_last"] = (steps[-w], steps[-1])
    return out


def learning_line(summary: dict[str, Any]) -> str:
    """The closing line: held-out success first -> last (± standard error where logged), the paired change with
    its error and how many errors it spans, the greedy pass, and the training reward's first and last means."""

    def val(x: float, sem: float | None) -> str:
        return f"{x:.3f} ± {sem:.3f}" if sem is not None and not math.isnan(sem) else f"{x:.3f}"

    line = (f"envace: held-out success {val(summary['first'], summary.get('first_sem'))} (step "
            f"{summary['first_step']}) -> {val(summary['last'], summary.get('last_sem'))} (step {summary['last_step']})")
    change, sem = summary.get("change"), summary.get("change_sem")
    if change is not None:
        line += f", change {change:+.3f}"
        if sem is not None and sem > 0:  # NaN fails the comparison
            line += f" ± {sem:.3f} ({change / sem:+.1f} s.e., paired by task)"
    if "greedy_first" in summary:
        line += f"; greedy {summary['greedy_first']:.3f} -> {summary['greedy_last']:.3f}"
    if "train_reward_first" in summary:
        (a, b), (c, d) = summary["train_steps_first"], summary["train_steps_last"]
        line += (f"; training reward {summary['train_reward_first']:.3f} (mean of steps {a}-{b}) -> "
                 f"{summary['train_reward_last']:.3f} (steps {c}-{d})")
    return line



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
    for source, label, marker in ((HELDOUT, "held-out success (validation)", "s"),
                                  (HELDOUT_GREEDY, "held-out success, greedy", "^")):
        val = validation_success(series, source)
        if not val:
            continue
        steps = sorted(val)
        sems = [_sem(series, source, s) for s in steps]
        if all(e is not None and math.isfinite(e) for e in sems):
            ax.errorbar(steps, [val[s] for s in steps], yerr=sems, marker=marker, markersize=4, capsize=3,
                        label=f"{label} ± 1 s.e.")
        else:
            ax.plot(steps, [val[s] for s in steps], marker=marker, markersize=4, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("reward / success")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
