"""Next-observation prediction on held-out recorded traces: metrics, the LLM judge, paired comparisons.

Paper §5 (next-observation prediction on held-out traces; §5.1 scoring and statistics). Each held-out
trace is replayed *teacher-forced* through a :class:`~trace2env.baselines.StepPredictor` — the simulator
(modes ``rules``, ``evidence``, ``agent``: a fresh :class:`~trace2env.runtime.Session` per trace, started
from the trace's ``initial_state`` / ``initial_state_id`` and fed the recorded actions in order) or one of the
paper's baselines (``direct``, ``trace_rag``, ``worldbook_prompt``, ``harness_only``; see
:mod:`trace2env.baselines`). At every unambiguous step the predicted observation is compared with the
recorded one:

* ``exact`` — equal after JSON normalisation (key order, ``1`` vs ``1.0``, whitespace), or equal text;
* ``key_overlap`` — Jaccard overlap of the JSON key paths (1.0 when neither has keys and ``exact``);
* ``answered`` — the predictor produced an observation of its own (an error observation of the simulator
  or a failed model reply counts as 0 on ``exact`` and ``key_overlap``);
* ``judge`` (with an :class:`~trace2env.judge.LLMJudge`) — Format, Factuality, Consistency, Realism,
  Quality, each 1–5 mapped to 0–100, and their mean; a failed judgement is masked (``None``), counted in
  ``judge_failures`` and excluded from the judge means (never scored 0). Every prediction is judged, the
  simulator's error observations included: they are what an agent would have seen.

Means are over steps; the 95 % interval is a percentile bootstrap over trajectories (steps of one trace are
not independent). Two systems evaluated on the same traces are compared by :func:`paired_bootstrap`: the
mean paired difference per metric (over the steps both scored) with a 95 % percentile interval from
resampling trajectories (10,000 resamples by default, as in the paper), numpy-vectorised.
:func:`evaluate_systems` runs several systems and :func:`format_table` prints them with the paired
differences against the first. W2R replay is not computed here.
"""

from __future__ import annotations

import json
import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .baselines import SimulatorPredictor, StepPredictor, make_predictor, step_input
from .engine import normalise
from .ingest import align
from .judge import DIMENSIONS, LLMJudge
from .models import Trace
from .package import Worldbook
from .providers import Provider
from .runtime import Proposer

__all__ = ["METRICS", "bootstrap_ci", "compare", "evaluate", "evaluate_systems", "format_table", "paired_bootstrap", "resampled_ratios"]

#: the model-free metrics (fractions in [0, 1])
METRICS: tuple[str, ...] = ("exact", "key_overlap", "answered")
#: the judge metrics (0–100): the total and the five dimensions
JUDGE_METRICS: tuple[str, ...] = ("judge", *(f"judge_{d}" for d in DIMENSIONS))


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


def resampled_ratios(sums: np.ndarray, ns: np.ndarray, n_boot: int, seed: int, chunk: int = 1000) -> np.ndarray:
    """``n_boot`` ratios sum(sums[idx]) / sum(ns[idx]) for trajectory indices ``idx`` drawn with replacement
    (nan where a resample has no step); chunked so memory stays ``chunk * len(sums)``."""
    rng = np.random.default_rng(seed)
    k = len(sums)
    out = np.empty(n_boot)
    for lo in range(0, n_boot, chunk):
        m = min(chunk, n_boot - lo)
        idx = rng.integers(0, k, size=(m, k))
        den = ns[idx].sum(axis=1)
        out[lo: lo + m] = np.divide(sums[idx].sum(axis=1), den, out=np.full(m, np.nan), where=den > 0)
    return out


def bootstrap_ci(per_trace: Sequence[tuple[float, int]], *, n_boot: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95 % percentile interval of a step-weighted mean, resampling trajectories ``(sum, n_steps)``."""
    if not per_trace or sum(n for _, n in per_trace) == 0:
        return (float("nan"), float("nan"))
    sums = np.array([s for s, _ in per_trace], dtype=float)
    ns = np.array([n for _, n in per_trace], dtype=float)
    means = resampled_ratios(sums, ns, n_boot, seed)
    lo, hi = np.nanpercentile(means, [2.5, 97.5])
    return float(lo), float(hi)


def _valid(v: Any) -> bool:
    return v is not None and not (isinstance(v, float) and np.isnan(v))


def paired_bootstrap(steps: Sequence[Mapping[str, Any]], baseline_steps: Sequence[Mapping[str, Any]], metric: str,
                     *, n_boot: int = 10000, seed: int = 0) -> dict[str, Any]:
    """Mean paired difference ``system - baseline`` of ``metric`` with a 95 % percentile interval.

    Steps are paired by ``(trace_id, transition_id)``; a pair where either value is missing (a masked
    judgement) is dropped. The statistic is the mean difference over pairs; each resample draws
    trajectories with replacement (all pairs of a drawn trajectory come along) and recomputes it.
    Returns ``{"metric", "diff", "ci95", "pairs", "traces"}`` (nan without any pair)."""
    base = {(s["trace_id"], s["transition_id"]): s.get(metric) for s in baseline_steps}
    traces, diffs = [], []
    for s in steps:
        b = base.get((s["trace_id"], s["transition_id"]))
        a = s.get(metric)
        if _valid(a) and _valid(b):
            traces.append(s["trace_id"])
            diffs.append(float(a) - float(b))
    if not diffs:
        return {"metric": metric, "diff": float("nan"), "ci95": (float("nan"), float("nan")), "pairs": 0, "traces": 0}
    _, codes = np.unique(np.array(traces), return_inverse=True)
    d = np.bincount(codes, weights=np.array(diffs))
    n = np.bincount(codes).astype(float)
    means = resampled_ratios(d, n, n_boot, seed)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return {"metric": metric, "diff": float(d.sum() / n.sum()), "ci95": (float(lo), float(hi)),
            "pairs": len(diffs), "traces": len(d)}


def _summarise(steps: Sequence[Mapping[str, Any]], trace_ids: Sequence[str], metrics: Sequence[str], *,
               n_boot: int, seed: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k in metrics:
        acc = {t: [0.0, 0] for t in trace_ids}
        for s in steps:
            v = s.get(k)
            if _valid(v):
                a = acc.setdefault(s["trace_id"], [0.0, 0])
                a[0] += float(v)
                a[1] += 1
        tot = sum(a[1] for a in acc.values())
        out[k] = sum(a[0] for a in acc.values()) / tot if tot else float("nan")
        out[f"{k}_ci95"] = bootstrap_ci([(a[0], a[1]) for a in acc.values()], n_boot=n_boot, seed=seed)
    return out


def evaluate(worldbook: Worldbook, traces: Sequence[Trace], *, mode: str = "evidence",
             proposer: Proposer | None = None, min_rule_confidence: float = 0.9,
             predictor: StepPredictor | None = None, system: str | None = None, provider: Provider | None = None,
             judge: LLMJudge | None = None, environment: str = "", n_boot: int = 2000, seed: int = 0) -> dict[str, Any]:
    """Teacher-forced replay of ``traces``; returns the summary and the per-step records.

    The predictor is ``predictor`` when given, else the system named ``system``
    (:func:`~trace2env.baselines.make_predictor` with ``provider``/``proposer``), else the simulator in
    ``mode``. With ``judge`` every step's prediction is also judged against the recorded observation."""
    if predictor is None:
        predictor = (make_predictor(system, provider=provider, proposer=proposer, min_rule_confidence=min_rule_confidence,
                                    environment=environment) if system is not None
                     else SimulatorPredictor(mode, proposer, min_rule_confidence))
    elif system is not None:
        raise ValueError("give predictor or system, not both")
    steps: list[dict[str, Any]] = []
    for tr in traces:
        predictor.begin(worldbook, tr)
        pos = {e.id: i for i, e in enumerate(tr.events)}
        for t in align(tr):
            if t.observation is None or t.alignment == "ambiguous":
                continue
            inp = step_input(tr, t, pos)
            pred = predictor.predict(inp)
            scores = compare(pred.observation, t.observation) if pred.accepted else {"exact": 0.0, "key_overlap": 0.0}
            row: dict[str, Any] = {"trace_id": tr.trace_id, "transition_id": t.id, "action": t.action.name,
                                   "route": pred.route, "answered": float(pred.accepted), **scores,
                                   "predicted": pred.observation}
            if judge is not None:
                res = judge.score(action=t.action, predicted=pred.observation, reference=t.observation,
                                  history=inp.history, environment=environment)
                row["judge"] = None if res is None else res.total
                for d in DIMENSIONS:
                    row[f"judge_{d}"] = None if res is None else res.scores[d]
            steps.append(row)
    n = len(steps)
    ids = [tr.trace_id for tr in traces]
    # trace ids are content hashes: an evaluated trace with the id of one the worldbook was built from is that
    # same recording (e.g. two tasks with identical gold replays), so its agreement is not held-out
    built_from = {s.get("source_id") for s in worldbook.sources} | {t.trace_id for t in worldbook.transitions}
    seen = sorted(set(ids) & built_from)
    if seen:
        warnings.warn(f"{len(seen)} of {len(set(ids))} evaluated trace(s) are recordings the worldbook was built "
                      f"from (same content hash, e.g. {seen[0]}); their steps are not held-out", stacklevel=2)
    summary: dict[str, Any] = {"system": predictor.name,
                               "mode": predictor.mode if isinstance(predictor, SimulatorPredictor) else None,
                               "prompt_version": getattr(predictor, "prompt_version", None),
                               "traces": len(traces), "steps": n, "routes": dict(Counter(s["route"] for s in steps)),
                               "traces_in_worldbook": len(seen)}
    summary.update(_summarise(steps, ids, METRICS, n_boot=n_boot, seed=seed))
    answered = [s for s in steps if s["answered"]]
    summary["exact_when_answered"] = sum(s["exact"] for s in answered) / len(answered) if answered else float("nan")
    if judge is not None:
        summary.update(_summarise(steps, ids, JUDGE_METRICS, n_boot=n_boot, seed=seed))
        summary["judged"] = sum(s["judge"] is not None for s in steps)
        summary["judge_failures"] = n - summary["judged"]
        summary["judge_prompt_version"] = judge.prompt_version
    return {"summary": summary, "steps": steps}


def evaluate_systems(worldbook: Worldbook, traces: Sequence[Trace], systems: Sequence[str | StepPredictor], *,
                     provider: Provider | None = None, proposer: Proposer | None = None, judge: LLMJudge | None = None,
                     environment: str = "", min_rule_confidence: float = 0.9, n_boot: int = 10000,
                     seed: int = 0) -> dict[str, Any]:
    """Every system on the same traces, and paired differences of each against the first.

    Returns ``{"systems": [summary, ...], "results": {name: evaluate() result}, "paired": {name: {metric:
    paired_bootstrap() result}}, "baseline": name of the first}``."""
    if not systems:
        raise ValueError("no systems to evaluate")
    preds = [make_predictor(s, provider=provider, proposer=proposer, min_rule_confidence=min_rule_confidence,
                            environment=environment) if isinstance(s, str) else s for s in systems]
    names = [p.name for p in preds]
    if len(set(names)) != len(names):
        raise ValueError(f"system names must be distinct, got {names}")
    results = {p.name: evaluate(worldbook, traces, predictor=p, judge=judge, environment=environment, n_boot=n_boot,
                                seed=seed) for p in preds}
    metrics = METRICS + (JUDGE_METRICS if judge is not None else ())
    first = results[names[0]]["steps"]
    paired = {name: {m: paired_bootstrap(results[name]["steps"], first, m, n_boot=n_boot, seed=seed) for m in metrics}
              for name in names[1:]}
    return {"systems": [results[n]["summary"] for n in names], "results": results, "paired": paired,
            "baseline": names[0]}


def _cell(v: float, ci: Sequence[float], scale: float, digits: int, sign: bool = False) -> str:
    if not _valid(v):
        return "n/a"
    f = f"{{:{'+' if sign else ''}.{digits}f}}"
    return f"{f.format(v * scale)} [{f.format(ci[0] * scale)}, {f.format(ci[1] * scale)}]"


def format_table(report: Mapping[str, Any]) -> str:
    """A plain-text table of :func:`evaluate_systems`: one row per system (mean [95 % CI]), then the paired
    differences ``system - first`` (mean [95 % CI], trajectories resampled). Fractions are shown as
    percentages, the judge on its 0–100 scale."""
    summaries = report["systems"]
    judged = any("judge" in s for s in summaries)
    cols: list[tuple[str, str, float]] = [("exact", "exact %", 100.0), ("key_overlap", "key_overlap %", 100.0),
                                          ("answered", "answered %", 100.0)]
    if judged:
        cols.append(("judge", "judge 0-100", 1.0))
    width = 23
    head = f"{'system':<18} {'steps':>6} " + " ".join(f"{c[1]:>{width}}" for c in cols)
    if judged:
        head += f" {'judge_fail':>10}"
    lines = [head, "-" * len(head)]
    for s in summaries:
        row = f"{s['system']:<18} {s['steps']:>6} " + " ".join(
            f"{_cell(s[k], s[f'{k}_ci95'], sc, 1):>{width}}" for k, _, sc in cols)
        if judged:
            row += f" {s.get('judge_failures', 0):>10}"
        lines.append(row)
    if report.get("paired"):
        title = (f"paired difference vs {report['baseline']} (system - {report['baseline']}; mean [95 % CI], "
                 "trajectories resampled)")
        lines += ["", title, head.split(" judge_fail")[0].replace("steps", "pairs"), "-" * len(head)]
        for name, per in report["paired"].items():
            lines.append(f"{name:<18} {per['exact']['pairs']:>6} " + " ".join(
                f"{_cell(per[k]['diff'], per[k]['ci95'], sc, 1, sign=True):>{width}}" for k, _, sc in cols))
    return "\n".join(lines)
