"""``python -m envace.eval {bfcl,tau2,w2r,table} ...``: benchmark evaluation against an OpenAI-compatible
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
time, flags without effect in the chosen mode refused). Outputs: ``results.jsonl`` (per-task records with transcripts),
``summary.json``, ``report.json`` (summary + records without transcripts), ``table.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import sys
import typing
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from envace.agents.engine import LoopLimits
from envace.eval.report import BENCHMARKS, Benchmark, describe, format_table
from trace2env.cliargs import ArgumentParser, UsageError, json_object, number, one_line, run_cli

if typing.TYPE_CHECKING:
    from envace.eval.client import EndpointConfig

__all__ = ["add_limit_arguments", "add_tts_arguments", "build_parser", "limits_from_args", "main", "tts_from_args"]


def add_limit_arguments(group: Any) -> None:
    """One flag per :class:`LoopLimits` field (``max_user_turns`` → ``--max-user-turns``), same defaults."""
    hints = typing.get_type_hints(LoopLimits)
    for f in dataclasses.fields(LoopLimits):
        flag = "--" + f.name.replace("_", "-")
        choices = LoopLimits.CHOICES.get(f.name)
        if choices:
            group.add_argument(flag, choices=choices, default=f.default, help=f"default: {f.default}")
        else:
            kind = hints[f.name]
            group.add_argument(flag, type=number(kind) if kind in (int, float) else kind, default=f.default,
                               help=f"default: {f.default}")


def add_tts_arguments(group: Any) -> None:
    """One flag per :class:`~envace.eval.tts.TTSConfig` field (``mode`` → ``--tts``), same defaults."""
    from envace.eval.tts import MODES, TTSConfig

    hints = typing.get_type_hints(TTSConfig)
    for flag, f in TTSConfig.flag_fields():
        dest = "tts_" + f.name
        base = next((a for a in typing.get_args(hints[f.name]) if a is not type(None)), hints[f.name])
        if f.name == "mode":
            group.add_argument(flag, dest=dest, choices=MODES, default=f.default,
                               help="none: plain evaluation; parallel / sequential rehearsal before acting")
        elif base is bool:
            group.add_argument(flag, dest=dest, action="store_true", help=f"default: {f.default}")
        else:
            group.add_argument(flag, dest=dest, type=number(base) if base in (int, float) else base,
                               default=f.default, help=f"default: {f.default}")


def tts_from_args(args: argparse.Namespace) -> Any:
    """The :class:`~envace.eval.tts.TTSConfig` of parsed arguments (raises ValueError for bad values)."""
    from envace.eval.tts import TTSConfig

    return TTSConfig(**{f.name: getattr(args, "tts_" + f.name) for _, f in TTSConfig.flag_fields()})


def limits_from_args(args: argparse.Namespace) -> LoopLimits:
    """The :class:`LoopLimits` of parsed arguments (raises ValueError for out-of-range values)."""
    return LoopLimits(**{name: getattr(args, name) for name in LoopLimits.field_names()})


# --------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------


def _add_common(p: argparse.ArgumentParser, bench: Benchmark) -> None:
    ep = p.add_argument_group("model endpoint (one of --base-url/--model or --checkpoint)")
    ep.add_argument("--base-url", help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1")
    ep.add_argument("--model", help="model name to request (default with --checkpoint: the checkpoint path)")
    ep.add_argument("--api-key", default=None, help="API key (default: $OPENAI_API_KEY or 'EMPTY')")
    ep.add_argument("--checkpoint", help="serve this checkpoint for the run (see --server)")
    ep.add_argument(
        "--server",
        choices=("vllm", "transformers"),
        default="vllm",
        help="server for --checkpoint: vLLM (GPU) or `transformers serve` (CPU)",
    )
    ep.add_argument("--server-port", type=number(int, min=1, max=65535), default=None,
                    help="port for --checkpoint (default: a free one)")
    ep.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for the server command (repeatable), e.g. --server-arg=--tensor-parallel-size=2",
    )
    ep.add_argument("--server-timeout", type=number(float, min=0, min_open=True), default=900.0,
                    help="seconds to wait for the server to come up")
    ep.add_argument("--request-timeout", type=number(float, min=0, min_open=True), default=600.0,
                    help="seconds per chat request")

    gen = p.add_argument_group("generation (defaults: the paper's acting temperature 0.6, top-p 0.95)")
    gen.add_argument("--temperature", type=number(float, min=0), default=0.6)
    gen.add_argument("--top-p", type=number(float, min=0, max=1, min_open=True), default=0.95)
    gen.add_argument("--max-tokens", type=number(int, min=1), default=None,
                     help="max new tokens per completion (server default)")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument(
        "--chat-template-kwargs",
        type=json_object,
        default=None,
        metavar="JSON",
        help="forwarded to the chat template, e.g. '{\"enable_thinking\": false}'",
    )

    loop = p.add_argument_group("agent loop (the training loop's limits: envace.agents.engine.LoopLimits)")
    add_limit_arguments(loop)
    loop.add_argument(
        "--env-timeout", type=number(float, min=0, min_open=True), default=60.0,
        help="seconds one real tool execution or the verification may take before the task counts as an "
        "infrastructure failure (retried on the next run); compute-heavy calls hit --tool-timeout-s first",
    )
    loop.add_argument(
        "--runner", default="agent_loop", help="per-task strategy registered with envace.eval.runner.register_runner"
    )
    loop.add_argument("--runner-arg", action="append", default=[], metavar="KEY=VALUE", help="option for --runner")
    add_tts_arguments(p.add_argument_group(
        "test-time rehearsal (EnvACE §4.3: N private rehearsals, self-evaluation, memory, one committed execution; "
        "envace.eval.tts.TTSConfig)"
    ))

    sel = p.add_argument_group("task selection")
    sel.add_argument("--split", choices=("train", "test"), default=None, help="only this split (default: all tasks)")
    sel.add_argument("--limit", type=number(int, min=1), default=None,
                     help="at most N tasks per category (the first N)")

    run = p.add_argument_group("run")
    run.add_argument("--out", default=None, help=f"output directory (default: results/eval/{bench.name}/<label>)")
    run.add_argument("--label", default=None, help="row label in the table (default: the model name)")
    run.add_argument("--concurrency", type=number(int, min=1), default=1, help="tasks in flight at once")
    run.add_argument("--no-transcripts", action="store_true", help="do not store conversations in results.jsonl")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument("--force-resume", action="store_true", help="resume even if OUT/run.json differs")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m envace.eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    bfcl = sub.add_parser("bfcl", help="BFCL multi-turn (base, miss_func, miss_param, long_context)")
    _add_common(bfcl, BENCHMARKS["bfcl"])
    bfcl.add_argument(
        "--categories",
        nargs="+",
        default=None,
        metavar="CAT",
        help="subset of: base miss_func miss_param long_context (multi_turn_ prefix optional)",
    )

    tau2 = sub.add_parser("tau2", help="τ²-bench (airline, retail, telecom)")
    _add_common(tau2, BENCHMARKS["tau2"])
    tau2.add_argument("--domains", nargs="+", default=None, metavar="DOMAIN", help="subset of: airline retail telecom")
    us = tau2.add_argument_group("simulated user (default: the agent's endpoint)")
    us.add_argument("--user-base-url", default=None)
    us.add_argument("--user-model", default=None)
    us.add_argument("--user-api-key", default=None)
    us.add_argument("--user-temperature", type=number(float, min=0), default=0.0, help="τ²'s default is 0.0")
    us.add_argument("--user-max-tokens", type=number(int, min=1), default=None)
    jg = tau2.add_argument_group("NL-assertion judge (only tasks whose reward basis has NL_ASSERTION need one)")
    jg.add_argument("--judge-base-url", default=None)
    jg.add_argument("--judge-model", default=None)
    jg.add_argument("--judge-api-key", default=None)
    tl = tau2.add_argument_group("τ² orchestrator limits")
    tl.add_argument("--tau2-max-steps", type=number(int, min=1), default=200, help="τ²'s max_steps (messages)")
    tl.add_argument("--tau2-max-errors", type=number(int, min=1), default=10,
                    help="τ²'s max_errors (failed tool calls)")

    w2r = sub.add_parser("w2r", help="Trace2Env W2R (Table 2): the same tasks in the real environment and in the "
                         "simulator over a worldbook; Real / WM / W2R / CR (envace/eval/w2r.py)")
    _add_common(w2r, Benchmark("w2r", "", "", (), ()))
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


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text.strip("/")).strip("_")[-80:] or "model"


def _runner_options(pairs: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs:
        if "=" not in pair:
            raise UsageError(f"--runner-arg expects KEY=VALUE, got {pair!r}")
        key, value = pair.split("=", 1)
        out[key.strip()] = value
    return out


def _api_key(args: argparse.Namespace) -> str:
    return args.api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"


def _extra_body(args: argparse.Namespace) -> dict[str, Any]:
    return {"chat_template_kwargs": args.chat_template_kwargs} if args.chat_template_kwargs else {}


def agent_endpoint(args: argparse.Namespace, stack: contextlib.ExitStack, out_dir: Path, *, serve: bool,
                   ) -> EndpointConfig:
    """The agent's endpoint from the common flags. With ``serve`` (there is work to do), ``--checkpoint`` is
    launched for the life of ``stack``; without, nothing starts and the names come from the flags."""
    from envace.eval.client import EndpointConfig

    if serve:
        base_url, model = stack.enter_context(_endpoint(args, out_dir))
    else:
        # nothing to run, so nothing is called: without --base-url the address is a placeholder
        base_url, model = args.base_url or "http://unused.invalid/v1", args.model or args.checkpoint or ""
    return EndpointConfig(base_urls=base_url, model=model, api_key=_api_key(args), temperature=args.temperature,
                          top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed,
                          timeout_s=args.request_timeout, extra_body=_extra_body(args))


@contextlib.contextmanager
def _endpoint(args: argparse.Namespace, out_dir: Path) -> Iterator[tuple[str, str]]:
    """Yield (base_url, model): the given endpoint, or a server launched for --checkpoint."""
    if args.checkpoint:
        from envace.eval.server import launch_server

        print(
            f"[envace.eval] starting {args.server} server for {args.checkpoint} (log: {out_dir / 'server.log'})",
            file=sys.stderr,
        )
        with launch_server(
            args.checkpoint,
            args.server,
            port=args.server_port,
            startup_timeout=args.server_timeout,
            extra_args=args.server_arg,
            log_path=out_dir / "server.log",
        ) as server:
            print(f"[envace.eval] server ready at {server.base_url}", file=sys.stderr)
            yield server.base_url, args.model or server.model
    else:
        yield args.base_url, args.model


def _default_label(args: argparse.Namespace) -> str:
    name = args.checkpoint or args.model
    return Path(name).name if (args.checkpoint or Path(name).exists()) else name


def _validate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.checkpoint and args.base_url:
        parser.error("give either --checkpoint or --base-url, not both")
    if not args.checkpoint and not (args.base_url and args.model):
        parser.error("give --base-url and --model (an OpenAI-compatible endpoint), or --checkpoint PATH")
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        parser.error(f"--out {args.out} is a file, not an output directory")
    try:
        limits_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        tts = tts_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    if tts.mode == "none":  # a rehearsal setting without rehearsals would be silently ignored
        from envace.eval.tts import TTSConfig

        unused = [flag for flag, f in TTSConfig.flag_fields()
                  if f.name != "mode" and getattr(args, "tts_" + f.name) != f.default]
        if unused:
            parser.error(f"{', '.join(unused)} {'has' if len(unused) == 1 else 'have'} no effect without "
                         "--tts parallel|sequential")
    if tts.mode != "none":  # --tts X --rehearsals N ... is --runner tts with the config as its options
        if args.runner != "agent_loop" or args.runner_arg:
            parser.error("--tts parallel/sequential is a runner of its own; drop --runner / --runner-arg")
        args.runner = "tts"
        args.runner_arg = [f"{k}={v}" for k, v in tts.to_options().items()]
    if args.checkpoint:
        from envace.eval.server import server_command

        server_command(args.server, args.checkpoint, "127.0.0.1", 0)  # fails early if the server is missing


def _identity(args: argparse.Namespace, bench: Benchmark, model: str) -> dict[str, Any]:
    """Settings that change per-task results (a resumed run must match them)."""
    ident: dict[str, Any] = {
        "benchmark": bench.name,
        "model": args.checkpoint or model,
        "split": args.split,
        "runner": args.runner,
        "runner_options": {k: ("<redacted>" if "api_key" in k and v != "null" else v)  # no secrets in run.json
                           for k, v in _runner_options(args.runner_arg).items()},
        "temperature": args.temperature,
        "top_p": args.top_p,
        "max_tokens": args.max_tokens,
        "seed": args.seed,
        "chat_template_kwargs": args.chat_template_kwargs,
        "limits": dataclasses.asdict(limits_from_args(args)),
    }
    if bench.name == "tau2":
        ident.update(
            user_model=args.user_model or "<agent model>",
            user_temperature=args.user_temperature,
            user_max_tokens=args.user_max_tokens,
            judge_model=args.judge_model,
            tau2_max_steps=args.tau2_max_steps,
            tau2_max_errors=args.tau2_max_errors,
        )
    return ident


def run_benchmark(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from envace.envs.base import get_pool
    from envace.eval.client import ChatClient, EndpointConfig
    from envace.eval.driver import evaluate, select_tasks
    from envace.eval.runner import RunContext, build_runner
    from envace.eval.store import ResultStore
    from envace.eval.tts import cost_summary, format_cost_table

    bench = BENCHMARKS[args.command]
    _validate(args, parser)
    label = args.label or _default_label(args)
    out_dir = Path(args.out or Path("results") / "eval" / bench.name / _slug(label))
    store = ResultStore(out_dir, create=False)  # nothing is written before pre-flight passes
    api_key, extra_body = _api_key(args), _extra_body(args)

    if bench.name == "tau2":
        pool = get_pool(
            "tau2",
            domains=tuple(args.domains or bench.categories),
            max_steps=args.tau2_max_steps,
            max_errors=args.tau2_max_errors,
        )
        categories = args.domains
    else:
        pool = get_pool(bench.pool)
        categories = args.categories
    selected = select_tasks(pool, bench, split=args.split, categories=categories, limit=args.limit)
    identity = _identity(args, bench, args.model or "")
    store.check_run_config(identity, force=args.force_resume, record=False)  # refuses a mismatch, writes nothing
    todo = [t for t in selected if t not in store.completed()]
    print(
        f"[envace.eval] {bench.name}: {len(selected)} task(s) selected, {len(selected) - len(todo)} already "
        f"done in {store.results_path}",
        file=sys.stderr,
    )

    outcome = None
    with contextlib.ExitStack() as stack:
        if todo and args.checkpoint:
            out_dir.mkdir(parents=True, exist_ok=True)  # the server's log; run.json is written only once it serves
        agent_cfg = agent_endpoint(args, stack, out_dir, serve=bool(todo))
        base_url, model = agent_cfg.base_url, agent_cfg.model
        start_kwargs: dict[str, Any] = {}
        if bench.name == "tau2":
            start_kwargs["user"] = EndpointConfig(
                base_urls=args.user_base_url or base_url,
                model=args.user_model or model,
                api_key=args.user_api_key or api_key,
                temperature=args.user_temperature,
                max_tokens=args.user_max_tokens,
                seed=args.seed,
                timeout_s=args.request_timeout,
                extra_body=extra_body,
            )
            start_kwargs["judge"] = (
                EndpointConfig(
                    base_urls=args.judge_base_url or base_url,
                    model=args.judge_model,
                    api_key=args.judge_api_key or api_key,
                    temperature=0.0,
                    max_tokens=None,
                    timeout_s=args.request_timeout,
                )
                if args.judge_model
                else None
            )
            # One client per endpoint, shared by all episodes (thread-safe).
            start_kwargs = {k: (ChatClient(v) if v is not None else None) for k, v in start_kwargs.items()}
        ctx = RunContext(
            client=ChatClient(agent_cfg),
            limits=limits_from_args(args),
            start_kwargs=start_kwargs,
            keep_transcript=not args.no_transcripts,
            options=_runner_options(args.runner_arg),
            env_timeout_s=args.env_timeout,
        )
        from envace.eval.client import check_model_served

        if todo:  # a wrong --model / --base-url fails here, before any task runs
            launched = base_url if args.checkpoint else None  # serves exactly what we launched it with
            for name, client in (("agent", ctx.client), *start_kwargs.items()):
                if client is not None and client.config.base_url != launched:
                    print(f"[envace.eval] checking the {name} endpoint {client.config.base_url} "
                          f"(model {client.config.model!r})", file=sys.stderr)
                    check_model_served(client.config)
        runner = build_runner(args.runner, ctx)
        rehearsal_client = getattr(runner, "rehearsal_client", None)  # --tts with another rehearsal endpoint
        if todo and rehearsal_client is not None and rehearsal_client is not ctx.client:
            print(f"[envace.eval] checking the rehearsal endpoint {rehearsal_client.config.base_url} "
                  f"(model {rehearsal_client.config.model!r})", file=sys.stderr)
            check_model_served(rehearsal_client.config)
        store.check_run_config(identity, force=args.force_resume)  # pre-flight passed: the run starts here
        store.repair()
        outcome = evaluate(
            pool, bench, selected, runner, store, concurrency=args.concurrency, progress=not args.no_progress
        )

    summary = outcome.summary
    table = format_table([(label, {bench.name: summary})])
    tts_cost = cost_summary(outcome.records) if args.runner == "tts" else None
    store.write_json(
        "summary.json",
        {
            "label": label,
            "benchmark": bench.name,
            "identity": _identity(args, bench, args.model or ""),
            "summary": summary,
            **({"tts_cost": tts_cost} if tts_cost is not None else {}),
        },
    )
    if tts_cost is not None:
        store.write_text("cost.md", format_cost_table(tts_cost, markdown=True) + "\n")
    store.write_json(
        "report.json",
        {"label": label, "summary": summary, "records": [{**r.to_json(), "messages": None} for r in outcome.records]},
    )
    store.write_text("table.md", format_table([(label, {bench.name: summary})], markdown=True) + "\n")
    print(table)
    print(describe(summary))
    if tts_cost is not None:
        print("test-time rehearsal cost per role:")
        print(format_cost_table(tts_cost))
    print(
        f"[envace.eval] ran {outcome.ran}, skipped {outcome.skipped} (already done), "
        f"{outcome.errors} infrastructure error(s); results in {out_dir}",
        file=sys.stderr,
    )
    return 0 if summary["complete"] else 1


def _read_summary(path: Path) -> dict[str, Any]:
    """A run's summary.json; unreadable or malformed: a one-line error naming the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"{path}: not a readable summary.json ({exc})") from None
    if not isinstance(data, dict) or not {"label", "benchmark", "summary"} <= set(data):
        raise UsageError(f"{path}: not an envace.eval summary.json (needs label, benchmark, summary)")
    return data


def run_table(args: argparse.Namespace) -> int:
    rows: dict[str, dict[str, Any]] = {}
    for run in args.runs:
        path = Path(run) / "summary.json"
        if not path.exists():
            raise UsageError(f"{path} not found (is {run} an envace.eval output directory?)")
        data = _read_summary(path)
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
                           baseline=args.baseline)
        return 1 if result["incomplete_runs"] else 0
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
    except (EvalAborted, ServerLaunchError, RunConfigMismatch, InfrastructureError, ValueError, KeyError) as exc:
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
