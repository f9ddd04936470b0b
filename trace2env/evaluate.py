"""Model-free fidelity measurement: next-observation agreement with held-out recorded traces.

Paper §5 (next-observation prediction on held-out traces). Each held-out trace is replayed *teacher-forced*
through a fresh :class:`~trace2env.runtime.Session` (the recorded actions in order, the session starting
from the trace's ``initial_state`` and ``initial_state_id`` when recorded): at every unambiguous step the
simulator's observation is compared with the recorded one by

* ``exact`` — equal after JSON normalisation (key order, ``1`` vs ``1.0``, whitespace), or equal text;
* ``key_overlap`` — Jaccard overlap of the JSON key paths (1.0 when neither has keys and ``exact``);
* ``answered`` — the simulator accepted the step (an error observation of the simulator itself counts as 0
  on ``exact`` and ``key_overlap``).

Modes: ``rules`` (the deterministic fast path only), ``evidence`` (plus supporting recorded evidence) and
``agent`` (plus the world-model agent, given a proposer). Means are over steps; the 95 % interval is a
percentile bootstrap over trajectories (steps of one trace are not independent), with numpy.
The LLM-judged scores (Format, Factuality, ...) and W2R replay are not computed here.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from .engine import normalise
from .ingest import align
from .models import Trace
from .package import Worldbook
from .runtime import Proposer, Session

__all__ = ["bootstrap_ci", "compare", "evaluate"]


def _key_paths(value: Any, prefix: str = "") -> set[str]:
    out: set[str] = set()
    if isinstance(value, dict):
        for k, v in value.items():
            out.add(f"{prefix}.{k}")
            out |= _key_paths(v, f"{prefix}.{k}")
    elif isinstance(value, list):
        for v in value:
            out |= _key_paths(v, prefix + "[]")
    return out


def compare(predicted: str, recorded: str) -> dict[str, float]:
    """``exact`` and ``key_overlap`` of one predicted observation against the recorded one."""
    try:
        a, b = json.loads(predicted), json.loads(recorded)
    except (json.JSONDecodeError, TypeError):
        exact = float(predicted.strip() == recorded.strip())
        return {"exact": exact, "key_overlap": exact}
    exact = float(normalise(a) == normalise(b))
    ka, kb = _key_paths(a), _key_paths(b)
    return {"exact": exact, "key_overlap": len(ka & kb) / len(ka | kb) if (ka or kb) else exact}


def bootstrap_ci(per_trace: Sequence[tuple[float, int]], *, n_boot: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95 % percentile interval of a step-weighted mean, resampling trajectories ``(sum, n_steps)``."""
    if not per_trace:
        return (float("nan"), float("nan"))
    sums = np.array([s for s, _ in per_trace], dtype=float)
    ns = np.array([n for _, n in per_trace], dtype=float)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(sums), size=(n_boot, len(sums)))
    den = ns[idx].sum(axis=1)
    means = np.divide(sums[idx].sum(axis=1), den, out=np.full(n_boot, np.nan), where=den > 0)
    lo, hi = np.nanpercentile(means, [2.5, 97.5])
    return float(lo), float(hi)


def evaluate(worldbook: Worldbook, traces: Sequence[Trace], *, mode: str = "evidence",
             proposer: Proposer | None = None, min_rule_confidence: float = 0.9) -> dict[str, Any]:
    """Teacher-forced replay of ``traces``; returns the summary and the per-step records."""
    if mode not in ("rules", "evidence", "agent"):
        raise ValueError(f"mode must be rules, evidence or agent, got {mode!r}")
    if mode == "agent" and proposer is None:
        raise ValueError("mode 'agent' needs a proposer (the world-model agent)")
    steps: list[dict[str, Any]] = []
    per_trace: dict[str, list[tuple[float, int]]] = {"exact": [], "key_overlap": [], "answered": []}
    for tr in traces:
        session = Session.start(worldbook, tr.metadata.get("initial_state"), context=tr.metadata.get("initial_state_id"),
                                proposer=proposer if mode == "agent" else None, use_evidence=mode != "rules",
                                min_rule_confidence=min_rule_confidence)
        rows = []
        for t in align(tr):
            if t.observation is None or t.alignment == "ambiguous":
                continue
            r = session.step({"name": t.action.name, "arguments": t.action.arguments})
            scores = compare(r.observation, t.observation) if r.accepted else {"exact": 0.0, "key_overlap": 0.0}
            rows.append({"trace_id": tr.trace_id, "transition_id": t.id, "action": t.action.name, "route": r.route,
                         "answered": float(r.accepted), **scores})
        steps += rows
        for k, acc in per_trace.items():
            acc.append((sum(x[k] for x in rows), len(rows)))
    n = len(steps)
    summary: dict[str, Any] = {"mode": mode, "traces": len(traces), "steps": n,
                               "routes": dict(Counter(s["route"] for s in steps))}
    for k in ("exact", "key_overlap", "answered"):
        summary[k] = sum(s[k] for s in steps) / n if n else float("nan")
        summary[f"{k}_ci95"] = bootstrap_ci(per_trace[k])
    answered = [s for s in steps if s["answered"]]
    summary["exact_when_answered"] = sum(s["exact"] for s in answered) / len(answered) if answered else float("nan")
    return {"summary": summary, "steps": steps}
