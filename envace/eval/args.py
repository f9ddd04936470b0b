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

import yaml

from envace.agents.engine import LoopLimits
from envace.eval.benchmarks import Benchmark
from envace.loop_config import TTSConfig, TTSValueError
from trace2env.cliargs import UsageError, json_object, number, one_line

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
    "runner_name",
    "slug",
    "tts_flags_given",
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
    """``--tts-config FILE`` and one flag per :class:`~envace.loop_config.TTSConfig` field, named in its metadata
    (``mode`` → ``--tts``). A flag left out takes the file's value, else the field's default: the dataclass is the
    one source of defaults (``envace.tts`` in Hydra has the same fields)."""
    from envace.loop_config import TTS_MODES

    group.add_argument("--tts-config", default=None, metavar="FILE",
                       help="YAML whose envace.tts sets the rehearsal settings the flags below leave out (an "
                       "experiment file of configs/experiment/, or a run's composed config)")
    hints = typing.get_type_hints(TTSConfig)
    for f in dataclasses.fields(TTSConfig):
        flag, dest = f.metadata["flag"], "tts_" + f.name
        base = next((a for a in typing.get_args(hints[f.name]) if a is not type(None)), hints[f.name])
        given: dict[str, Any] = {"dest": dest, "default": argparse.SUPPRESS}  # left out: the file's, or the default
        if f.name == "mode":
            group.add_argument(flag, choices=TTS_MODES, help="none: plain evaluation; parallel / sequential rehearsal "
                               f"before acting (default: {f.default})", **given)
        elif base is bool:
            group.add_argument(flag, action="store_true", help=f"default: {f.default}", **given)
        else:
            group.add_argument(flag, type=number(base) if base in (int, float) else base, help=f"default: {f.default}",
                               **given)


def tts_flags_given(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`~envace.loop_config.TTSConfig` fields set by a flag on the command line."""
    dests = {f.name: "tts_" + f.name for f in dataclasses.fields(TTSConfig)}
    return {name: getattr(args, dest) for name, dest in dests.items() if hasattr(args, dest)}


def tts_from_args(args: argparse.Namespace) -> TTSConfig:
    """The :class:`~envace.loop_config.TTSConfig` of parsed arguments: the flags given, over ``--tts-config``'s
    ``envace.tts``, over the defaults. A value out of range raises ValueError with one line naming its flag (or the
    file's key)."""
    from envace.config import ConfigError, tts_config_from

    base: dict[str, Any] = {}
    if getattr(args, "tts_config", None):
        path = Path(args.tts_config)
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            raise ValueError(f"--tts-config {path}: not a readable YAML file ({one_line(str(exc))})") from None
        if not isinstance(raw, dict):
            raise ValueError(f"--tts-config {path}: not a YAML mapping (an experiment file with envace: {{tts: ...}})")
        try:
            base = dataclasses.asdict(tts_config_from(raw, f"--tts-config {path}"))
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
    try:
        return TTSConfig(**{**base, **tts_flags_given(args)})
    except TTSValueError as exc:
        raise ValueError(f"{TTSConfig.flags()[exc.field]} {exc.reason}") from None


def runner_name(args: argparse.Namespace) -> str:
    """The task runner of a run: ``tts`` with ``--tts parallel|sequential`` (or its file), else ``--runner``."""
    return "tts" if tts_from_args(args).mode != "none" else args.runner


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
        "envace.loop_config.TTSConfig, the keys of envace.tts in Hydra)"
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
        unused = [TTSConfig.flags()[name] for name in tts_flags_given(args) if name != "mode"]
        unused += ["--tts-config"] if args.tts_config else []
        if unused:
            parser.error(f"{', '.join(unused)} {'has' if len(unused) == 1 else 'have'} no effect without "
                         "--tts parallel|sequential")
    elif args.runner != "agent_loop" or args.runner_arg:  # --tts X is the runner "tts", set by the typed config
        parser.error("--tts parallel/sequential is a runner of its own; drop --runner / --runner-arg")
    elif tts.memory != "verbatim" and "max_memory_chars" in tts_flags_given(args):  # read by the verbatim memory only
        parser.error(f"{TTSConfig.flags()['max_memory_chars']} has no effect without "
                     f"{TTSConfig.flags()['memory']} verbatim")
    if args.checkpoint:
        from envace.eval.server import server_command

        server_command(args.server, args.checkpoint, "127.0.0.1", 0)  # fails early if the server is missing


#: what a ``run.json`` written before a key existed counts as holding there (:meth:`ResultStore.check_run_config`):
#: test-time rehearsal runs recorded no prompt versions while v1 was the only one, so they resume under v1
LEGACY_IDENTITY: dict[str, Any] = {"prompts": {"rehearsal": "v1", "tts": "v1"}}


def run_identity(args: argparse.Namespace, bench: Benchmark, model: str) -> dict[str, Any]:
    """Settings that change per-task results (a resumed run must match them): the common flags, the benchmark's own
    (:meth:`Benchmark.identity`) and, for test-time rehearsal, the versions of the prompt files the policy reads."""
    tts = tts_from_args(args)
    ident: dict[str, Any] = {
        "benchmark": bench.name,
        "model": args.checkpoint or model,
        "split": args.split,
        "runner": runner_name(args),
        "runner_options": _redacted(_tts_options(tts) if tts.mode != "none" else parse_runner_options(args.runner_arg)),
        "temperature": args.temperature,
        "top_p": args.top_p,
        "max_tokens": args.max_tokens,
        "seed": args.seed,
        "chat_template_kwargs": args.chat_template_kwargs,
        "limits": dataclasses.asdict(limits_from_args(args)),
    }
    if tts.mode != "none":
        from envace.eval.tts import prompt_versions

        ident["prompts"] = prompt_versions(tts)
    ident.update(bench.identity(args))
    return ident


def _tts_options(tts: TTSConfig) -> dict[str, str]:
    """The rehearsal settings as ``run.json`` records them (:meth:`TTSConfig.recorded`): each value JSON-encoded, the
    form runs have recorded since test-time rehearsal existed (so theirs resume, and :mod:`envace.eval.sweep` reads
    either)."""
    return {k: json.dumps(v) for k, v in tts.recorded().items()}


def _redacted(options: dict[str, str]) -> dict[str, str]:
    return {k: ("<redacted>" if "api_key" in k and v != "null" else v) for k, v in options.items()}  # no secrets


def read_summary(path: Path) -> dict[str, Any]:
    """A run's summary.json; unreadable or malformed: a one-line error naming the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"{path}: not a readable summary.json ({exc})") from None
    if not isinstance(data, dict) or not {"label", "benchmark", "summary"} <= set(data):
        raise UsageError(f"{path}: not an envace.eval summary.json (needs label, benchmark, summary)")
    return data
