"""Command line: ``python -m trace2env check|build|eval``.

``check WORLDBOOK_DIR`` verifies a package (paper §4.1: the worldbook is an immutable package): every
file's sha256 against the manifest, then that every artifact parses. Exit 0 when it verifies; 1 with one
line per problem, each starting with the offending file.

``build TRACES... --out DIR`` runs construction (:func:`trace2env.build.build_worldbook`) over JSON/JSONL
trace files: the deterministic path, plus the model stages with ``--base-url URL --model NAME`` (an
OpenAI-compatible endpoint; LLM calls, tokens and cost per stage are printed to stderr).

``eval WORLDBOOK TRACES... [--split-manifest M --split test] [--mode rules|evidence|agent]`` measures
next-observation agreement with held-out recorded traces (:mod:`trace2env.evaluate`) and prints the
summary as JSON (``--out FILE`` also writes every step). ``--mode agent`` needs ``--base-url/--model``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from .build import build_worldbook
from .ingest import load_traces
from .models import SplitManifest
from .package import check_worldbook, load_worldbook


def _endpoint_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", help="OpenAI-compatible endpoint (…/v1) for the model stages")
    p.add_argument("--model", help="served model name")
    p.add_argument("--api-key-env", default=None, help="environment variable holding the API key")
    p.add_argument("--cache-dir", default=None, help="content-addressed cache of model answers")
    p.add_argument("--usd-per-m-prompt", type=float, default=0.0)
    p.add_argument("--usd-per-m-completion", type=float, default=0.0)


def _provider(args: argparse.Namespace):
    if not args.base_url and not args.model:
        return None
    if not (args.base_url and args.model):
        raise SystemExit("--base-url and --model go together")
    from .llm import OpenAIProvider, OpenAIProviderConfig

    return OpenAIProvider(OpenAIProviderConfig(base_url=args.base_url, model=args.model, api_key_env=args.api_key_env,
                                               cache_dir=args.cache_dir, usd_per_m_prompt=args.usd_per_m_prompt,
                                               usd_per_m_completion=args.usd_per_m_completion))


def _report_usage(provider) -> None:
    if provider is None:
        return
    for row in provider.usage_table():
        print("usage " + json.dumps(row), file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trace2env")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="verify a worldbook package")
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
    e.add_argument("--mode", default="evidence", choices=["rules", "evidence", "agent"])
    e.add_argument("--out", help="JSON file with the summary and every step")
    _endpoint_args(e)
    args = ap.parse_args(argv)
    if args.cmd == "check":
        problems = check_worldbook(args.worldbook)
        for p in problems:
            print(p, file=sys.stderr)
        if not problems:
            print(f"ok: {args.worldbook}")
        return 1 if problems else 0
    split = None
    if args.split_manifest:
        with open(args.split_manifest, encoding="utf-8") as f:
            split = SplitManifest.model_validate(json.load(f))
    provider = _provider(args)
    if args.cmd == "eval":
        from .agent import WorldModelAgent
        from .evaluate import evaluate

        traces = load_traces(args.traces)
        if split is not None:
            keep = set(split.ids(args.split))
            traces = [t for t in traces if t.trace_id in keep]
        result = evaluate(load_worldbook(args.worldbook), traces, mode=args.mode,
                          proposer=WorldModelAgent(provider) if provider is not None else None)
        print(json.dumps(result["summary"], indent=1))
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump(result, f)
        _report_usage(provider)
        return 0
    out = build_worldbook(load_traces(args.traces), args.out, split=split, environment_id=args.environment_id,
                          provider=provider)
    _report_usage(provider)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
