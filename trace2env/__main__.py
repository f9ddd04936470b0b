"""Command line: ``python -m trace2env check|build|eval``.

``check WORLDBOOK_DIR`` verifies a package (paper §4.1: the worldbook is an immutable package): the manifest's
own digest, every file's sha256 against it, then that every artifact parses and validates; ``check BOOKS_DIR``
(a folder of packages, as the simulator accepts) checks every book. Exit 0 when all verify; 1 with one line per
problem, each starting with the offending file (``BOOK/FILE`` in a folder).

Exit 2 with one line (``python -m trace2env: error: ...``) for a usage or input mistake: a missing, empty or
malformed traces file (named with its line), an existing ``--out``, traces of several pools under one book, a
path that is not a worldbook, an out-of-range number (:mod:`trace2env.cliargs`). ``eval`` warns on stderr when
the traces come from another pool than the book's.

``build TRACES... --out DIR`` runs construction (:func:`trace2env.build.build_worldbook`) over JSON/JSONL
trace files: the deterministic path, plus the model stages with ``--base-url URL --model NAME`` (an
OpenAI-compatible endpoint; LLM calls, tokens and cost per stage are printed to stderr).

``eval WORLDBOOK TRACES... [--split-manifest M --split test] [--mode rules|evidence|agent]`` measures
next-observation agreement with held-out recorded traces (:mod:`trace2env.evaluate`) and prints the
summary as JSON (``--out FILE`` also writes every step; strict JSON: an undefined mean is ``null``, never
``NaN``). ``--mode agent`` needs ``--base-url/--model``.
``eval ... --systems evidence,direct,trace_rag,worldbook_prompt,harness_only`` evaluates several systems
(:mod:`trace2env.baselines`) on the same traces and prints one table (mean and 95 % interval per metric)
and the paired differences against the first system (trajectories resampled, ``--n-boot``). The model
systems use ``--base-url/--model``; ``--judge-base-url/--judge-model`` adds the LLM judge's 0–100 score
(:mod:`trace2env.judge`; failed judgements are masked and counted).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError

from .build import build_worldbook
from .cliargs import ArgumentParser, UsageError, number, one_line, run_cli, strict_json
from .ingest import TraceFormatError, load_traces
from .models import SplitManifest
from .package import WorldbookIntegrityError, check_worldbook, load_worldbook


def _endpoint_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", help="OpenAI-compatible endpoint (…/v1) for the model stages")
    p.add_argument("--model", help="served model name")
    p.add_argument("--api-key-env", default=None, help="environment variable holding the API key")
    p.add_argument("--cache-dir", default=None, help="content-addressed cache of model answers")
    p.add_argument("--usd-per-m-prompt", type=number(float, min=0), default=0.0)
    p.add_argument("--usd-per-m-completion", type=number(float, min=0), default=0.0)
    p.add_argument("--max-tokens", type=number(int, min=1), default=None,
                   help="completion-token budget of one request, and its cap (no doubling on truncation)")
    p.add_argument("--repair-rounds", type=number(int, min=0), default=None,
                   help="follow-ups showing the model its invalid reply")
    p.add_argument("--max-payload-chars", type=number(int, min=1), default=None, help="characters of JSON payload sent")


def _limits(args: argparse.Namespace) -> dict[str, int]:
    """OpenAIProviderConfig fields set on the command line (the same for every provider of one run)."""
    out = {}
    if args.max_tokens is not None:
        out["max_tokens"] = out["max_tokens_cap"] = args.max_tokens
    if args.repair_rounds is not None:
        out["repair_rounds"] = args.repair_rounds
    if args.max_payload_chars is not None:
        out["max_payload_chars"] = args.max_payload_chars
    return out


def _provider(args: argparse.Namespace):
    if not args.base_url and not args.model:
        return None
    if not (args.base_url and args.model):
        raise UsageError("--base-url and --model go together")
    from .llm import OpenAIProvider, OpenAIProviderConfig

    return OpenAIProvider(OpenAIProviderConfig(base_urls=args.base_url, model=args.model, api_key_env=args.api_key_env,
                                               cache_dir=args.cache_dir, usd_per_m_prompt=args.usd_per_m_prompt,
                                               usd_per_m_completion=args.usd_per_m_completion, **_limits(args)))


def _report_usage(provider, prefix: str = "") -> None:
    if provider is None or not hasattr(provider, "usage_table"):
        return
    for row in provider.usage_table():
        print(prefix + "usage " + strict_json(row), file=sys.stderr)


def _judge_provider(args: argparse.Namespace):
    if not args.judge_base_url and not args.judge_model:
        return None
    if not (args.judge_base_url and args.judge_model):
        raise UsageError("--judge-base-url and --judge-model go together")
    from .llm import OpenAIProvider, OpenAIProviderConfig

    return OpenAIProvider(OpenAIProviderConfig(base_urls=args.judge_base_url, model=args.judge_model,
                                               api_key_env=args.judge_api_key_env, cache_dir=args.cache_dir,
                                               **_limits(args)))


def _eval(args: argparse.Namespace, split: SplitManifest | None, provider, judge_provider) -> int:
    from .agent import WorldModelAgent
    from .evaluate import evaluate, evaluate_systems, format_table
    from .judge import LLMJudge

    if args.systems and args.mode:
        raise UsageError("give --mode or --systems, not both")
    wb = _worldbook(args.worldbook)
    traces = load_traces(args.traces)
    if split is not None:
        keep = set(split.ids(args.split))
        traces = [t for t in traces if t.trace_id in keep]
    if not traces:
        raise UsageError(f"no traces to evaluate in split {args.split!r} of {args.split_manifest}")
    pools = sorted({str(t.metadata.get("pool")) for t in traces} - {str(wb.manifest.source_pool)})
    if wb.manifest.source_pool is not None and pools:
        print(f"python -m trace2env: warning: {args.worldbook} was built from traces of pool "
              f"{wb.manifest.source_pool!r}, but these traces come from {', '.join(pools)}: agreement with "
              "another pool's recordings measures nothing", file=sys.stderr)
    judge = LLMJudge(judge_provider, prompt_version=args.judge_prompt) if judge_provider is not None else None
    proposer = WorldModelAgent(provider) if provider is not None else None
    try:
        if args.systems:
            systems = [s.strip() for s in args.systems.split(",") if s.strip()]
            report = evaluate_systems(wb, traces, systems, provider=provider, proposer=proposer, judge=judge,
                                      environment=args.environment, n_boot=args.n_boot, seed=args.seed)
            print(format_table(report))
            out: dict = {k: report[k] for k in ("systems", "paired", "baseline")}
            out["steps"] = {k: v["steps"] for k, v in report["results"].items()}
        else:
            out = evaluate(wb, traces, mode=args.mode or "evidence", proposer=proposer, judge=judge,
                           environment=args.environment, n_boot=args.n_boot, seed=args.seed)
            print(strict_json(out["summary"], indent=1))
    except ValueError as e:
        raise UsageError(f"eval: {e}") from None
    if args.out:
        Path(args.out).write_text(strict_json(out), encoding="utf-8")
    _report_usage(provider)
    _report_usage(judge_provider, "judge ")
    return 0


def _worldbook(path: str):
    try:
        return load_worldbook(path)
    except WorldbookIntegrityError as e:
        if e.path == ".":
            raise UsageError(e.reason) from None
        if e.path == "manifest.json" and e.reason == "missing":
            raise UsageError(f"{path}: not a worldbook package (no manifest.json)") from None
        raise UsageError(f"{path}/{e}") from None


def _split_manifest(path: str) -> SplitManifest:
    try:
        return SplitManifest.model_validate_json(Path(path).read_bytes())
    except OSError as e:
        raise UsageError(f"--split-manifest {path}: cannot read: {e.strerror or e}") from None
    except ValidationError as e:
        raise UsageError(f"--split-manifest {path}: not a split manifest: {one_line(e.errors()[0]['msg'])}") from None


def build_parser() -> ArgumentParser:
    ap = ArgumentParser(prog="python -m trace2env")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="verify a worldbook package, or every package of a folder")
    c.add_argument("worldbook")
    b = sub.add_parser("build", help="build a worldbook from traces (deterministic path)")
    b.add_argument("traces", nargs="+")
    b.add_argument("--out", required=True)
    b.add_argument("--split-manifest")
    b.add_argument("--environment-id")
    _endpoint_args(b)
    e = sub.add_parser("eval", help="next-observation agreement with held-out traces")
    e.add_argument("worldbook")
    e.add_argument("traces", nargs="+")
    e.add_argument("--split-manifest", help="evaluate only the traces of --split in this manifest")
    e.add_argument("--split", default="test")
    e.add_argument("--mode", default=None, choices=["rules", "evidence", "agent"],
                   help="one simulator mode, summary printed as JSON (default evidence)")
    e.add_argument("--systems", default=None,
                   help="comma-separated systems compared in one table, the first is the reference of the paired "
                        "differences: rules, evidence, agent, direct, trace_rag, worldbook_prompt, harness_only")
    e.add_argument("--out", help="JSON file with the summary and every step")
    e.add_argument("--n-boot", type=number(int, min=1), default=10000, help="bootstrap resamples of trajectories")
    e.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    e.add_argument("--environment", default="", help="environment description sent to every model system and the judge")
    _endpoint_args(e)
    e.add_argument("--judge-base-url", help="OpenAI-compatible endpoint (…/v1) of the LLM judge")
    e.add_argument("--judge-model", help="served name of the judge model")
    e.add_argument("--judge-api-key-env", default=None, help="environment variable holding the judge's API key")
    e.add_argument("--judge-prompt", default="judge_v1", help="judge rubric version")
    return ap


def _main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "check":
        if not Path(args.worldbook).is_dir():
            raise UsageError(f"{args.worldbook}: " + ("not a directory" if Path(args.worldbook).exists()
                                                       else "does not exist"))
        problems = check_worldbook(args.worldbook)
        for p in problems:
            print(p, file=sys.stderr)
        if not problems:
            print(f"ok: {args.worldbook}")
        return 1 if problems else 0
    split = _split_manifest(args.split_manifest) if args.split_manifest else None
    if args.cmd == "eval":
        if args.out and Path(args.out).is_dir():
            raise UsageError(f"--out {args.out}: a directory, expected a JSON file")
        return _eval(args, split, _provider(args), _judge_provider(args))
    if Path(args.out).exists():
        raise UsageError(f"--out {args.out} exists; worldbooks are immutable, build into a new directory")
    traces = load_traces(args.traces)
    provider = _provider(args)
    try:
        out = build_worldbook(traces, args.out, split=split, environment_id=args.environment_id, provider=provider)
    except (ValueError, FileExistsError) as e:
        raise UsageError(f"build: {e}") from None
    _report_usage(provider)
    print(out)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI; user mistakes exit 2 with one line (:mod:`trace2env.cliargs`)."""
    return run_cli("python -m trace2env", _main, argv, user_errors=(TraceFormatError,))


if __name__ == "__main__":
    raise SystemExit(main())
