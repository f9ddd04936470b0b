"""World-to-real (W2R) consistency: does the behaviour a simulator induces transfer back to the real environment?

Paper §5 (Table 2; the reference follows Word2World's ``cal_wm2real.py``): a task agent runs each held-out
task

* **Real** — in the real environment: the success rate (%) of its own run;
* **WM** — inside the world model: the success rate (%) by the simulator's own verdict on the simulated
  episode (a state predicate, :class:`trace2env.runtime.StatePredicateVerifier`, or a judge);
* **W2R** — the actions it chose inside the world model, replayed in the real environment and scored by the
  real verifier: the success rate (%). envace's simulator source executes every call in the task's real
  environment unseen by the agent (the shadow), so its verifier's reward of a simulated rollout *is* the
  W2R outcome of that task;
* **CR** = W2R / Real (a ratio, not a percentage).

A high WM with a low W2R is a simulator that lets the agent "succeed" in a fictitious state; the
``wm_only`` count (WM success, W2R failure) names those tasks. A task succeeds when its reward is at least
``success_at`` (default 1: success = done with full reward).

:func:`w2r_consistency` is a pure function of per-task outcomes. Real and W2R are computed over the same
tasks (those with both outcomes), so CR compares like with like; WM over those of them that have a
verdict. CR's 95 % interval is a percentile bootstrap over tasks (the task is the independent unit):
each resample draws tasks with replacement and recomputes sum(W2R successes) / sum(Real successes).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .evaluate import resampled_ratios

__all__ = ["TaskOutcome", "w2r_consistency"]


@dataclass(frozen=True)
class TaskOutcome:
    """One task's three outcomes (rewards; None where that run was not scored)."""

    task_id: str
    real: float | None  # the agent's own run in the real environment
    wm: float | None  # the simulated run, by the simulator's verdict (None: the simulator gave none)
    w2r: float | None  # the simulated run's actions replayed in the real environment

    @classmethod
    def from_mapping(cls, row: Mapping[str, Any]) -> TaskOutcome:
        return cls(str(row["task_id"]), row.get("real"), row.get("wm"), row.get("w2r"))


def _known(v: float | None) -> bool:
    return v is not None and not math.isnan(float(v))


def w2r_consistency(outcomes: Iterable[TaskOutcome | Mapping[str, Any]], *, success_at: float = 1.0,
                    n_boot: int = 2000, seed: int = 0) -> dict[str, Any]:
    """Real / WM / W2R (percentages), CR = W2R / Real with a 95 % bootstrap interval, and counts.

    Returns ``{"tasks", "real", "wm", "wm_tasks", "w2r", "cr", "cr_ci95", "wm_only", "w2r_only",
    "dropped"}``: ``tasks`` is the number of tasks with both a Real and a W2R outcome; ``dropped`` the ids
    of the others; ``wm_only`` / ``w2r_only`` count tasks (with a WM verdict) that succeed in the world model
    but not on replay / on replay but not in the world model. Percentages and CR are nan without tasks; CR
    is nan when no Real run succeeds. Raises :class:`ValueError` on a repeated task id or a negative
    ``n_boot``.
    """
    if n_boot < 0:
        raise ValueError(f"n_boot must be >= 0, got {n_boot}")
    rows = [o if isinstance(o, TaskOutcome) else TaskOutcome.from_mapping(o) for o in outcomes]
    ids = [r.task_id for r in rows]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise ValueError(f"task ids repeat: {dup[:5]}")
    kept = [r for r in rows if _known(r.real) and _known(r.w2r)]
    dropped = [r.task_id for r in rows if not (_known(r.real) and _known(r.w2r))]
    n = len(kept)
    real = np.array([float(r.real) >= success_at for r in kept], dtype=float)  # type: ignore[arg-type]
    w2r = np.array([float(r.w2r) >= success_at for r in kept], dtype=float)  # type: ignore[arg-type]
    has_wm = np.array([_known(r.wm) for r in kept], dtype=bool)
    wm = np.array([_known(r.wm) and float(r.wm) >= success_at for r in kept], dtype=float)  # type: ignore[arg-type]
    nan = float("nan")
    real_pct = 100.0 * real.mean() if n else nan
    w2r_pct = 100.0 * w2r.mean() if n else nan
    wm_pct = 100.0 * wm[has_wm].mean() if has_wm.any() else nan
    cr = float(w2r.sum() / real.sum()) if real.sum() > 0 else nan
    lo = hi = nan
    if n and n_boot and real.sum() > 0:
        ratios = resampled_ratios(w2r, real, n_boot, seed)
        lo, hi = (float(v) for v in np.nanpercentile(ratios, [2.5, 97.5]))
    return {
        "tasks": n,
        "real": float(real_pct),
        "wm": float(wm_pct),
        "wm_tasks": int(has_wm.sum()),
        "w2r": float(w2r_pct),
        "cr": cr,
        "cr_ci95": (lo, hi),
        "wm_only": int(((wm == 1) & (w2r == 0) & has_wm).sum()),
        "w2r_only": int(((wm == 0) & (w2r == 1) & has_wm).sum()),
        "dropped": dropped,
    }
