"""``python -m envace.eval {bfcl,tau2,synthetic,w2r,table} ...``: benchmark evaluation against an OpenAI-compatible
endpoint or a checkpoint served on the fly.

Examples::

    # a running server (vLLM, transformers serve, any OpenAI-compatible API)
    python -m envace.eval tau2 --base-url http://127.0.0.1:8000/v1 --model Qwen/Qwen3-8B --out runs/q8b-tau2
    # a checkpoint: starts `vllm serve` (GPU) or `transformers serve` (CPU), evaluates, stops it
    python -m envace.eval bfcl --checkpoint ckpt/step_470 --server vllm --concurrency 32
    # test-time rehearsal (EnvACE §4.3): 2 private rehearsals, self-evaluation, memory, one committed execution
    python -m envace.eval bfcl --base-url http://127.0.0.1:8000/v1 --model ckpt --tts parallel --rehearsals 2
    # Trace2Env W2R: the same held-out tasks in the real environment and in the simulator (Real / WM / W2R / CR)
    python -m envace.eval w2r --pool synthetic --worldbook runs/wb-syn/books --base-url URL --model NAME
    # one table from several runs (rows grouped by --label / model)
    python -m envace.eval table runs/q8b-tau2 runs/q8b-bfcl

Runs are resumable: every finished task is appended to ``OUT/results.jsonl`` at once and a rerun with
the same ``--out`` skips those tasks. Nothing is written before pre-flight passes (flags, pool, task selection,
a previous run's settings, the endpoint serving the model): a refused command leaves ``--out`` as it was.
Usage and input mistakes exit 2 with one line (:mod:`trace2env.cliargs`: numbers range-checked at parse
time, flags without effect in the chosen mode refused). An endpoint that does not answer (5xx, connection refused,
time-out) at pre-flight, or fails tasks so that the run stops (10 in a row) or ends without every result, exits 3
with one line: infrastructure, not the command; the same command reruns the missing tasks. Outputs: ``results.jsonl`` (per-task records with transcripts),
``summary.json``, ``report.json`` (summary + records without transcripts), ``table.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from envace.eval.args import (
    LEGACY_IDENTITY,
    add_common_arguments,
    agent_endpoint,
    default_label,
    limits_from_args,
    parse_runner_options,
    read_summary,
    run_identity,
    runner_name,
    slug,
    tts_from_args,
    validate_args,
)
from envace.eval.benchmarks import BENCHMARKS, Benchmark
from envace.eval.report import describe, format_table
from trace2env.cliargs import (
    EXIT_INFRA,
    ArgumentParser,
    InfrastructureFailure,
    UsageError,
    number,
    one_line,
    run_cli,
)

if TYPE_CHECKING:
    from envace.eval.driver import EvalOutcome
    from envace.eval.runner import TaskRunner
    from envace.eval.store import ResultStore

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m envace.eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    for bench in BENCHMARKS.values():  # each benchmark adds its own flags to the common ones
        cmd = sub.add_parser(bench.name, help=bench.help)
        add_common_arguments(cmd, bench)
        bench.add_arguments(cmd)

    w2r = sub.add_parser("w2r", help="Trace2Env W2R (Table 2): the same tasks in the real environment and in the "
                         "simulator over a worldbook; Real / WM / W2R / CR (envace/eval/w2r.py)")
    add_common_arguments(w2r, Benchmark("w2r", "", "", (), ()))  # its own columns are the pool's (envace/eval/w2r.py)
    from envace.eval.w2r import add_w2r_arguments

    add_w2r_arguments(w2r)

    table = sub.add_parser("table", help="print one table from the summary.json of several runs")
    table.add_argument("runs", nargs="+", help="output directories of previous runs")
    table.add_argument("--markdown", action="store_true")

    tts_table = sub.add_parser("tts-table", help="the paper's Table 3 layout (Non-TTS / Par. / Seq. rows) from runs")
    tts_table.add_argument("runs", nargs="+", help="output directories of previous runs (τ² and BFCL)")
    tts_table.add_argument("--markdown", action="store_true")

    sweep = sub.add_parser("sweep", help="rehearsal-budget sweep: one run per (mode, N), a table and a plot; "
                           "usage: sweep BENCH --out DIR [--modes ...] [--budgets ...] -- EVAL_ARGS")
    sweep.add_argument("benchmark", choices=sorted(BENCHMARKS))
    sweep.add_argument("--out", required=True, help="sweep directory (runs go to OUT/<mode>-n<N>)")
    sweep.add_argument("--modes", nargs="+", choices=("parallel", "sequential"), default=["parallel", "sequential"])
    sweep.add_argument("--budgets", nargs="+", type=number(int, min=1), default=[1, 2, 3, 4, 5], metavar="N")
    sweep.add_argument("--baseline", action="store_true", help="also run Non-TTS (OUT/non-tts)")
    sweep.set_defaults(eval_args=[])  # everything after "--": the evaluation arguments (endpoint, limits, ...)
    return parser


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------


def run_benchmark(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """One benchmark subcommand: pre-flight (flags, pool, task selection, a previous run's settings, the endpoints),
    then the tasks without a result, then the outputs. What differs per benchmark is its :class:`Benchmark`'s."""
    from envace.eval.driver import evaluate, failing, select_tasks
    from envace.eval.store import ResultStore

    bench = BENCHMARKS[args.command]
    validate_args(args, parser)
    label = args.label or default_label(args)
    out_dir = Path(args.out or Path("results") / "eval" / bench.name / slug(label))
    store = ResultStore(out_dir, create=False)  # nothing is written before pre-flight passes
    pool = bench.build_pool(args)
    selected = select_tasks(pool, bench, split=args.split, categories=bench.wanted(args), limit=args.limit)
    identity = run_identity(args, bench, args.model or "")
    store.check_run_config(identity, force=args.force_resume, record=False, legacy=LEGACY_IDENTITY)  # writes nothing
    todo = [t for t in selected if t not in store.completed()]
    print(f"[envace.eval] {bench.name}: {len(selected)} task(s) selected, {len(selected) - len(todo)} already "
          f"done in {store.results_path}", file=sys.stderr)
    with contextlib.ExitStack() as stack:
        runner = _start_runner(args, bench, stack, out_dir, serve=bool(todo))
        store.check_run_config(identity, force=args.force_resume, legacy=LEGACY_IDENTITY)  # the run starts here
        outcome = evaluate(pool, bench, selected, runner, store, concurrency=args.concurrency,
                           progress=not args.no_progress)
    _write_outputs(args, store, label, bench, identity, outcome)
    if outcome.errors:  # the tasks without a result failed on the endpoint or the environment, not on the model
        raise InfrastructureFailure(failing(f"{outcome.errors} of {len(todo)} task(s) failed", outcome.last_error,
                                            store))
    return 0 if outcome.summary["complete"] else 1


def _start_runner(args: argparse.Namespace, bench: Benchmark, stack: contextlib.ExitStack, out_dir: Path, *,
                  serve: bool) -> TaskRunner:
    """The task runner over the agent's endpoint (``--checkpoint`` served for the life of ``stack`` when ``serve``)
    and the benchmark's own clients; with work to do, every endpoint is checked to serve its model first."""
    from envace.agents.client import ChatClient, check_model_served
    from envace.eval.runner import RunContext, build_runner

    if serve and args.checkpoint:
        out_dir.mkdir(parents=True, exist_ok=True)  # the server's log; run.json is written only once it serves
    agent = agent_endpoint(args, stack, out_dir, serve=serve)
    clients = bench.clients(args, agent)
    ctx = RunContext(client=ChatClient(agent), limits=limits_from_args(args), start_kwargs=clients,
                     keep_transcript=not args.no_transcripts, options=parse_runner_options(args.runner_arg),
                     env_timeout_s=args.env_timeout, tts=tts_from_args(args))
    runner = build_runner(runner_name(args), ctx)
    if serve:  # a wrong --model / --base-url fails here, before any task runs
        launched = agent.base_url if args.checkpoint else None  # serves exactly what we launched it with
        checked = [(name, c) for name, c in (("agent", ctx.client), *clients.items())
                   if c is not None and c.config.base_url != launched]
        rehearsal = getattr(runner, "rehearsal_client", None)  # --tts with another rehearsal endpoint or model
        if rehearsal is not None and rehearsal is not ctx.client:
            checked.append(("rehearsal", rehearsal))
        for name, client in checked:
            print(f"[envace.eval] checking the {name} endpoint {client.config.base_url} "
                  f"(model {client.config.model!r})", file=sys.stderr)
            check_model_served(client.config)
    return runner


def _write_outputs(args: argparse.Namespace, store: ResultStore, label: str, bench: Benchmark,
                   identity: dict[str, Any], outcome: EvalOutcome) -> None:
    """``summary.json`` (with the run's identity: its settings and prompt versions), ``report.json``, ``table.md``
    and, for test-time rehearsal, ``cost.md``; the table and the per-category lines on stdout."""
    from envace.eval.tts import cost_summary, format_cost_table

    summary = outcome.summary
    tts_cost = cost_summary(outcome.records) if runner_name(args) == "tts" else None
    store.write_json("summary.json", {"label": label, "benchmark": bench.name, "identity": identity,
                                      "summary": summary, **({"tts_cost": tts_cost} if tts_cost is not None else {})})
    if tts_cost is not None:
        store.write_text("cost.md", format_cost_table(tts_cost, markdown=True) + "\n")
    store.write_json("report.json", {"label": label, "summary": summary,
                                     "records": [{**r.to_json(), "messages": None} for r in outcome.records]})
    store.write_text("table.md", format_table([(label, {bench.name: summary})], markdown=True) + "\n")
    print(format_table([(label, {bench.name: summary})]))
    print(describe(summary))
    if tts_cost is not None:
        print("test-time rehearsal cost per role:")
        print(format_cost_table(tts_cost))
    print(f"[envace.eval] ran {outcome.ran}, skipped {outcome.skipped} (already done), "
          f"{outcome.errors} infrastructure error(s); results in {store.dir}", file=sys.stderr)


def run_table(args: argparse.Namespace) -> int:
    rows: dict[str, dict[str, Any]] = {}
    for run in args.runs:
        path = Path(run) / "summary.json"
        if not path.exists():
            raise UsageError(f"{path} not found (is {run} an envace.eval output directory?)")
        data = read_summary(path)
        rows.setdefault(data["label"], {})[data["benchmark"]] = data["summary"]
    print(format_table(list(rows.items()), markdown=args.markdown))
    return 0


def _main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    eval_args: list[str] = []
    if argv[:1] == ["sweep"] and "--" in argv:  # sweep ... -- EVAL_ARGS: the evaluation's own arguments
        cut = argv.index("--")
        argv, eval_args = argv[:cut], argv[cut + 1 :]
    args = parser.parse_args(argv)
    if args.command == "table":
        return run_table(args)
    if args.command == "tts-table":
        from envace.eval.sweep import tts_table

        print(tts_table(args.runs, markdown=args.markdown))
        return 0
    if args.command == "sweep":
        from envace.eval.sweep import run_sweep

        result = run_sweep(args.benchmark, Path(args.out), args.modes, args.budgets, eval_args,
                           parser=build_parser(), run_eval=main, baseline=args.baseline)
        return EXIT_INFRA if result["infrastructure_runs"] else 1 if result["incomplete_runs"] else 0
    from envace.eval.driver import EvalAborted
    from envace.eval.server import ServerLaunchError, terminate_on_sigterm
    from envace.eval.store import RunConfigMismatch
    from envace.rewards.llm import ConfigurationError, InfrastructureError

    try:
        with terminate_on_sigterm():  # SIGTERM unwinds like Ctrl-C: a launched model server is stopped
            if args.command == "w2r":
                from envace.eval.w2r import run_w2r

                return run_w2r(args, parser)
            return run_benchmark(args, parser)
    except ConfigurationError as exc:
        if os.environ.get("ENVACE_DEBUG"):
            raise
        print(f"envace.eval: configuration error: {one_line(exc)}", file=sys.stderr)
        return 2
    except InfrastructureError as exc:  # an endpoint down at pre-flight: exit 3 (run_cli)
        raise InfrastructureFailure(f"the endpoint is failing: {exc} (rerun the same command once it answers; "
                                    "finished tasks are kept)") from exc
    except (EvalAborted, ServerLaunchError, RunConfigMismatch, ValueError, KeyError) as exc:
        if os.environ.get("ENVACE_DEBUG"):
            raise
        print(f"envace.eval: error: {one_line(exc.args[0] if isinstance(exc, KeyError) and exc.args else exc)}",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nenvace.eval: interrupted; finished tasks are saved, rerun the same command to resume", file=sys.stderr)
        return 130


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI; usage and input mistakes exit 2 with one line (:mod:`trace2env.cliargs`)."""
    return run_cli("python -m envace.eval", _main, argv)
