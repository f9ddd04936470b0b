"""Command-line pieces the evaluation commands share (``python -m envace.eval``'s benchmarks, ``w2r`` and ``sweep``).

The flags every benchmark takes (:func:`add_common_arguments`: endpoint, sampling, loop limits, test-time
rehearsal, run directory), their parsed values (:func:`limits_from_args`, :func:`tts_from_args`), the pre-flight
checks on them (:func:`validate_args`), the agent's endpoint (:func:`agent_endpoint`, launching ``--checkpoint`` when
there is work), a run's identity and label, and a run directory's ``summary.json`` (:func:`read_summary`).
:mod:`envace.eval.cli` builds the parser and dispatches; :mod:`envace.eval.w2r` and :mod:`envace.eval.sweep` use
these without importing the CLI.
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
from envace.eval.report import Benchmark
from trace2env.cliargs import UsageError, json_object, number

if typing.TYPE_CHECKING:
    from envace.agents.client import EndpointConfig

__all__ = [
    "add_common_arguments",
    "add_limit_arguments",
    "add_tts_arguments",
    "agent_endpoint",
    "api_key_from_args",
    "default_label",
    "extra_body_from_args",
    "limits_from_args",
    "parse_runner_options",
    "read_summary",
    "run_identity",
    "slug",
    "tts_from_args",
    "validate_args",
]


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


def add_common_arguments(p: argparse.ArgumentParser, bench: Benchmark) -> None:
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


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text.strip("/")).strip("_")[-80:] or "model"


def parse_runner_options(pairs: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs:
        if "=" not in pair:
            raise UsageError(f"--runner-arg expects KEY=VALUE, got {pair!r}")
        key, value = pair.split("=", 1)
        out[key.strip()] = value
    return out


def api_key_from_args(args: argparse.Namespace) -> str:
    return args.api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"


def extra_body_from_args(args: argparse.Namespace) -> dict[str, Any]:
    return {"chat_template_kwargs": args.chat_template_kwargs} if args.chat_template_kwargs else {}


def agent_endpoint(args: argparse.Namespace, stack: contextlib.ExitStack, out_dir: Path, *, serve: bool,
                   ) -> EndpointConfig:
    """The agent's endpoint from the common flags. With ``serve`` (there is work to do), ``--checkpoint`` is
    launched for the life of ``stack``; without, nothing starts and the names come from the flags."""
    from envace.agents.client import EndpointConfig

    if serve:
        base_url, model = stack.enter_context(_endpoint(args, out_dir))
    else:
        # nothing to run, so nothing is called: without --base-url the address is a placeholder
        base_url, model = args.base_url or "http://unused.invalid/v1", args.model or args.checkpoint or ""
    return EndpointConfig(base_urls=base_url, model=model, api_key=api_key_from_args(args),
                          temperature=args.temperature,
                          top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed,
                          timeout_s=args.request_timeout, extra_body=extra_body_from_args(args))


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


def default_label(args: argparse.Namespace) -> str:
    name = args.checkpoint or args.model
    return Path(name).name if (args.checkpoint or Path(name).exists()) else name


def validate_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
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


def run_identity(args: argparse.Namespace, bench: Benchmark, model: str) -> dict[str, Any]:
    """Settings that change per-task results (a resumed run must match them)."""
    ident: dict[str, Any] = {
        "benchmark": bench.name,
        "model": args.checkpoint or model,
        "split": args.split,
        "runner": args.runner,
        "runner_options": {k: ("<redacted>" if "api_key" in k and v != "null" else v)  # no secrets in run.json
                           for k, v in parse_runner_options(args.runner_arg).items()},
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


def read_summary(path: Path) -> dict[str, Any]:
    """A run's summary.json; unreadable or malformed: a one-line error naming the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"{path}: not a readable summary.json ({exc})") from None
    if not isinstance(data, dict) or not {"label", "benchmark", "summary"} <= set(data):
        raise UsageError(f"{path}: not an envace.eval summary.json (needs label, benchmark, summary)")
    return data
