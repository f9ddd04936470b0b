"""Per-category summaries and the results table in the EnvACE paper's layout (the benchmarks themselves:
:mod:`envace.eval.benchmarks`).

The table has one row per model and the column groups of the paper's τ²/Multi-Turn results
(Tables 1 and 3): τ²-bench Airline | Retail | Telecom | Avg., BFCL Multi-Turn Base | Miss Func. |
Miss Param. | Long Ctx. | Avg., and Overall. Scores are mean rewards in percent; a group's Avg. is the
unweighted mean of its categories (as in the paper: 31.4 = mean(38.0, 42.3, 14.0)); Overall is the
mean of the two group averages. Cells without results show "–", as in the paper. A benchmark outside the paper's
table (``synthetic``) adds its own column group after them, outside Overall; a table of such runs alone has only
their groups.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from envace.eval.benchmarks import BENCHMARKS, PAPER_TABLE, Benchmark
from envace.eval.runner import TaskRecord

__all__ = ["BENCHMARKS", "Benchmark", "format_grid", "format_table", "summarize"]


#: the paper table's column groups, left to right (Overall is their mean)
TABLE_ORDER = PAPER_TABLE


def summarize(benchmark: Benchmark, records: Iterable[TaskRecord], expected: Mapping[str, str]) -> dict[str, Any]:
    """Summary of ``records`` restricted to the ``expected`` task ids (id → category).

    Per category: tasks expected, finished, mean reward (%) over finished tasks, passed, unjudged,
    malformed tool calls, model-side errors. ``complete`` is False while tasks are missing.
    """
    by_id = {r.task_id: r for r in records if r.task_id in expected}
    cats: dict[str, dict[str, Any]] = {}
    order = [c for c in benchmark.categories if c in set(expected.values())]
    order += sorted(set(expected.values()) - set(order))
    for cat in order:
        ids = [t for t, c in expected.items() if c == cat]
        done = [by_id[t] for t in ids if t in by_id]
        cats[cat] = {
            "label": benchmark.label(cat),
            "expected": len(ids),
            "finished": len(done),
            "score": (100.0 * sum(r.reward for r in done) / len(done)) if done else None,
            "passed": sum(1 for r in done if r.passed),
            "unjudged": sum(1 for r in done if r.unjudged),
            "malformed_tool_calls": sum(r.malformed_tool_calls for r in done),
            "model_errors": sum(1 for r in done if r.error),
            "stop_reasons": _count(r.stop_reason for r in done),
        }
    scores = [c["score"] for c in cats.values() if c["score"] is not None]
    finished = sum(c["finished"] for c in cats.values())
    return {
        "benchmark": benchmark.name,
        "categories": cats,
        "average": (sum(scores) / len(scores)) if scores else None,
        "expected": len(expected),
        "finished": finished,
        "complete": finished == len(expected),
    }


def _count(items: Iterable[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return out


def _cell(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def table_rows(
    rows: Sequence[tuple[str, Mapping[str, Mapping[str, Any]]]],
) -> tuple[list[str], list[str], list[list[str]]]:
    """(group header, column header, body) of the paper-layout table.

    ``rows``: (model label, {benchmark name: summary}) pairs.
    """
    present = {name for _, summaries in rows for name in summaries}
    others = [name for name in BENCHMARKS if name not in TABLE_ORDER and name in present]
    paper = bool(present & set(TABLE_ORDER)) or not others  # the paper's groups and Overall, unless only others
    groups = [*(TABLE_ORDER if paper else ()), *others]
    group = ["Model"]
    header = [""]
    for name in groups:
        bench = BENCHMARKS[name]
        group += [bench.title] + [""] * len(bench.categories)
        header += list(bench.labels) + ["Avg."]
    if paper:
        group.append("Overall (%)")
        header.append("")
    body: list[list[str]] = []
    for model, summaries in rows:
        line = [model]
        averages: list[float | None] = []
        for name in groups:
            summary = summaries.get(name)
            cats = summary["categories"] if summary else {}
            for cat in BENCHMARKS[name].categories:
                line.append(_cell(cats.get(cat, {}).get("score")))
            avg = summary["average"] if summary else None
            # The group average is only meaningful when every category has results.
            if summary and any(cats.get(c, {}).get("score") is None for c in BENCHMARKS[name].categories):
                avg = None
            if name in TABLE_ORDER:
                averages.append(avg)
            line.append(_cell(avg))
        if paper:
            overall = sum(averages) / len(averages) if all(a is not None for a in averages) else None  # type: ignore[arg-type]
            line.append(_cell(overall))
        body.append(line)
    return group, header, body


def format_grid(header: Sequence[str], rows: Sequence[Sequence[str]], *, markdown: bool = False) -> str:
    """``header`` over ``rows`` (cells already formatted): a Markdown table, or aligned text with the first
    column left-aligned and the others right-aligned."""
    lines = [header, *rows]
    if markdown:
        return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
                          *("| " + " | ".join(r) + " |" for r in rows)])
    widths = [max(len(r[i]) for r in lines) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
                     for r in lines)


def format_table(rows: Sequence[tuple[str, Mapping[str, Mapping[str, Any]]]], *, markdown: bool = False) -> str:
    group, header, body = table_rows(rows)
    if markdown:
        return format_grid(group, [header, *body], markdown=True)
    widths = [max(len(r[i]) for r in [group, header, *body]) for i in range(len(header))]

    def fmt(r: list[str]) -> str:
        return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))

    return "\n".join([fmt(group), fmt(header), "  ".join("-" * w for w in widths), *map(fmt, body)])


def describe(summary: Mapping[str, Any]) -> str:
    """A short per-category line block: finished/expected, passed, unjudged, malformed calls."""
    lines = []
    for c in summary["categories"].values():
        extra = []
        if c["unjudged"]:
            extra.append(f"{c['unjudged']} unjudged (no NL judge; score covers the other checks)")
        if c["malformed_tool_calls"]:
            extra.append(f"{c['malformed_tool_calls']} malformed tool calls")
        if c["model_errors"]:
            extra.append(f"{c['model_errors']} model request errors")
        lines.append(
            f"  {c['label']:<12} {c['finished']}/{c['expected']} tasks, {c['passed']} passed, "
            f"score {_cell(c['score'])}" + (f" ({'; '.join(extra)})" if extra else "")
        )
    if not summary["complete"]:
        lines.append(
            f"  INCOMPLETE: {summary['expected'] - summary['finished']} task(s) without a result; rerun to finish"
        )
    return "\n".join(lines)
