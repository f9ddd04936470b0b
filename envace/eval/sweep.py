"""Test-time rehearsal reports: the paper's Table 3 rows and the rehearsal-budget sweep (Figure 6 / Figure 9).

``python -m envace.eval tts-table RUN...`` prints the Table-3 layout from finished runs: one row per
(mode, rehearsal model): ``Non-TTS``, ``Par. (rehearsal: M)``, ``Seq. (rehearsal: M)``, with the τ² domains,
the BFCL multi-turn categories, the group averages and Overall (:func:`envace.eval.report.format_table`).

``python -m envace.eval sweep {bfcl,tau2,synthetic} --out DIR [--modes parallel sequential] [--budgets 1 2 3 4 5]
[--baseline] -- EVAL_ARGS...`` runs the evaluation once per (mode, N) into ``DIR/<mode>-n<N>`` (each run is
resumable on its own, so rerunning the sweep finishes what is missing), then writes ``DIR/sweep.json``,
``DIR/sweep.md`` and ``DIR/sweep.png`` (average score against N per mode; matplotlib). The sweep exits 3 when a
run exited 3 (an endpoint outage: rerunning the sweep resumes), else 1 when a run did not finish.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from envace.eval.args import read_summary, validate_args
from envace.eval.report import format_table
from trace2env.cliargs import EXIT_INFRA, UsageError, strict_json

__all__ = ["plot_sweep", "run_sweep", "tts_row_label", "tts_table"]

_MODE_LABEL = {"none": "Non-TTS", "parallel": "Par.", "sequential": "Seq."}


def _tts_identity(summary: dict[str, Any]) -> tuple[str, str | None, int | None, str]:
    ident = summary.get("identity", {})
    if ident.get("runner") != "tts":
        return "none", None, None, "summary"
    opts = {k: json.loads(v) if isinstance(v, str) else v for k, v in ident.get("runner_options", {}).items()}
    model = opts.get("rehearsal_model") or "policy"
    return str(opts.get("mode", "none")), str(model), opts.get("rehearsals"), str(opts.get("memory", "summary"))


def tts_row_label(summary: dict[str, Any]) -> str:
    """``Non-TTS`` / ``Par. (rehearsal: M, N=2)`` / ``Seq. (...)`` for one run's summary.json (``, verbatim memory``
    added for ``--tts-memory verbatim``)."""
    mode, model, n, memory = _tts_identity(summary)
    if mode == "none":
        return "Non-TTS"
    return f"{_MODE_LABEL[mode]} (rehearsal: {model}, N={n}" + (", verbatim memory)" if memory == "verbatim" else ")")


def tts_table(runs: Sequence[str | Path], *, markdown: bool = False) -> str:
    """The Table-3 layout over run directories (τ² and BFCL runs of one configuration share a row)."""
    rows: dict[str, dict[str, Any]] = {}
    for run in runs:
        path = Path(run) / "summary.json"
        if not path.exists():
            raise UsageError(f"{path} not found (is {run} an envace.eval output directory?)")
        data = read_summary(path)
        rows.setdefault(tts_row_label(data), {})[data["benchmark"]] = data["summary"]
    order = sorted(rows, key=lambda r: (0 if r == "Non-TTS" else 1 if r.startswith("Par.") else 2, r))
    return format_table([(r, rows[r]) for r in order], markdown=markdown)


def run_sweep(bench: str, out: Path, modes: Sequence[str], budgets: Sequence[int], eval_args: Sequence[str],
              *, parser: argparse.ArgumentParser, run_eval: Callable[[list[str]], int],
              baseline: bool = False) -> dict[str, Any]:
    """Run every (mode, N) evaluation (resumable), then collect, tabulate and plot the averages.

    ``parser`` is the evaluation CLI's parser (pre-flight: EVAL_ARGS as the first run will get them, before
    anything is written) and ``run_eval(argv)`` runs one evaluation with the CLI's arguments and exit status
    (:func:`envace.eval.cli.main`); the CLI passes both, so this module does not import it.
    """
    if any("--tts" == a or "--rehearsals" == a or a == "--out" for a in eval_args):
        raise UsageError("sweep sets --tts, --rehearsals and --out itself; drop them from EVAL_ARGS")
    if any(n < 1 for n in budgets):  # the CLI's parser refuses them first
        raise UsageError("--budgets must be >= 1")
    first = ["--tts", modes[0], "--rehearsals", str(budgets[0])] if modes and budgets else []
    validate_args(parser.parse_args([bench, *eval_args, "--out", str(out / "preflight"), *first]), parser)
    out.mkdir(parents=True, exist_ok=True)
    plan: list[tuple[str, int, Path]] = [(m, n, out / f"{m}-n{n}") for m in modes for n in budgets]
    if baseline:
        plan.insert(0, ("none", 0, out / "non-tts"))
    failed, outages = [], []
    for mode, n, run_dir in plan:
        argv = [bench, *eval_args, "--out", str(run_dir)]
        if mode != "none":
            argv += ["--tts", mode, "--rehearsals", str(n)]
        print(f"[envace.eval sweep] {mode} N={n} -> {run_dir}", flush=True)
        code = run_eval(argv)
        if code != 0:
            failed.append(str(run_dir))
        if code == EXIT_INFRA:  # an outage, not the sweep's arguments: the sweep exits 3 too, and a rerun resumes
            outages.append(str(run_dir))
    points: list[dict[str, Any]] = []
    for mode, n, run_dir in plan:
        path = run_dir / "summary.json"
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        summ = data["summary"]
        points.append({"mode": mode, "rehearsals": n, "average": summ["average"], "complete": summ["complete"],
                       "categories": {c: v["score"] for c, v in summ["categories"].items()},
                       "cost": data.get("tts_cost", {}).get("total"), "run": str(run_dir)})
    result = {"benchmark": bench, "points": points, "incomplete_runs": failed, "infrastructure_runs": outages}
    (out / "sweep.json").write_text(strict_json(result, indent=2))
    (out / "sweep.md").write_text(tts_table([p["run"] for p in points], markdown=True) + "\n")
    plot_sweep(points, out / "sweep.png", title=f"{bench}: average score vs rehearsal budget")
    print(tts_table([p["run"] for p in points]))
    print(f"[envace.eval sweep] {out / 'sweep.png'}, {out / 'sweep.json'}")
    return result


def plot_sweep(points: Sequence[dict[str, Any]], path: Path, *, title: str = "") -> Path:
    """Average score (%) against the rehearsal budget N, one line per mode; Non-TTS as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for mode in ("parallel", "sequential"):
        pts = sorted((p["rehearsals"], p["average"]) for p in points if p["mode"] == mode and p["average"] is not None)
        if pts:
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=_MODE_LABEL[mode])
    base = [p["average"] for p in points if p["mode"] == "none" and p["average"] is not None]
    if base:
        ax.axhline(base[0], linestyle="--", color="grey", label="Non-TTS")
    ax.set_xlabel("rehearsal budget N")
    ax.set_ylabel("average score (%)")
    if title:
        ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
