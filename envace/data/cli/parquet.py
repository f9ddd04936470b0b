"""``build`` and ``convert-cm2``: verl parquet (``train.parquet`` / ``val.parquet``) from environment pools
(:mod:`envace.data.datasets`, with ``manifest.json``) or from CM2 checklist JSONL (:mod:`envace.data.cm2`)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from envace.data.cm2 import CM2ValidationError, convert_cm2
from envace.data.datasets import DEFAULT_AGENT_NAME, DatasetBuildError, build_parquet
from envace.envs.cli.common import EXIT_OK, CLIError, positive_int
from trace2env.cliargs import number


def cmd_build(args: argparse.Namespace) -> int:
    with contextlib.redirect_stdout(sys.stderr):  # benchmark packages print at import
        try:
            train, val = build_parquet(
                args.pools,
                args.out,
                args.agent_name,
                splits=(args.train_split, args.val_split),
                limit_per_pool=args.limit_per_pool,
                pool_kwargs=args.pool_kwargs,
                seed=args.seed,
            )
        except (DatasetBuildError, KeyError) as exc:
            raise CLIError(exc.args[0] if exc.args else str(exc)) from None
    manifest = json.loads((train.parent / "manifest.json").read_text())
    print(
        f"wrote {train} ({manifest['rows'][args.train_split]} rows) and {val} ({manifest['rows'][args.val_split]} rows)"
    )
    for pool, splits in manifest["pools"].items():
        for split, cats in splits.items():
            print(f"  {pool} {split}: " + ", ".join(f"{c}={n}" for c, n in cats.items()))
    return EXIT_OK


def cmd_convert_cm2(args: argparse.Namespace) -> int:
    try:
        report = convert_cm2(
            args.input,
            args.out_dir,
            agent_name=args.agent_name,
            val_fraction=args.val_fraction,
            seed=args.seed,
            skip_invalid=args.skip_invalid,
        )
    except (CM2ValidationError, FileNotFoundError, ValueError) as exc:
        raise CLIError(str(exc)) from None
    print(report.summary())
    print(f"wrote {report.train_path} and {report.val_path}")
    return EXIT_OK


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("build", help="verl parquet from pools")
    p.add_argument("--pools", nargs="+", required=True)
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--agent-name", default=DEFAULT_AGENT_NAME)
    p.add_argument("--limit-per-pool", type=positive_int, default=None)
    p.add_argument("--train-split", default="train")
    p.add_argument("--val-split", default="test")
    p.add_argument("--seed", default="0", help="seed of the --limit-per-pool selection")
    p.set_defaults(func=cmd_build)

    p = sub.add_parser("convert-cm2", help="CM2 checklist JSONL -> verl parquet")
    p.add_argument("input", metavar="IN.jsonl")
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument("--skip-invalid", action="store_true", help="write invalid records to OUT_DIR/rejects.jsonl")
    p.add_argument("--val-fraction", type=number(float, min=0, max=1), default=0.1)
    p.add_argument("--agent-name", default=DEFAULT_AGENT_NAME)
    p.add_argument("--seed", default="0")
    p.set_defaults(func=cmd_convert_cm2)
