"""Command line: ``python -m trace2env check WORLDBOOK_DIR`` and ``python -m trace2env build``.

``check`` verifies a package (paper §4.1: the worldbook is an immutable package): every file's sha256
against the manifest, then that every artifact parses. Exit 0 when it verifies; 1 with one line per
problem, each starting with the offending file. ``build`` runs the deterministic construction path
(:func:`trace2env.build.build_worldbook` without a provider) over JSON/JSONL trace files.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from .build import build_worldbook
from .ingest import load_traces
from .models import SplitManifest
from .package import check_worldbook


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
    out = build_worldbook(load_traces(args.traces), args.out, split=split, environment_id=args.environment_id)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
