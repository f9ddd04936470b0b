"""``envace`` console script: one entry point for the project's command-line tools.

    envace train [experiment=NAME] [key=value ...]   # = scripts/train.sh without the venv/Ray set-up
    envace eval {bfcl,tau2,table} ...                # = python -m envace.eval
    envace envs {list,tasks,gold,verify,serve} ...   # = python -m envace.envs
    envace data {build,convert-cm2,record-traces} ...  # = python -m envace.data
    envace models {build,path} ...
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

COMMANDS = {
    "train": ("envace.train", "training through verl's trainer (Hydra overrides)"),
    "eval": ("envace.eval.cli", "benchmark evaluation against an OpenAI-compatible endpoint or a checkpoint"),
    "envs": ("envace.envs.__main__", "environment pools: list, tasks, gold replay, verify, serve"),
    "data": ("envace.data.__main__", "training data: parquet from pools, CM2 conversion, gold-replay traces"),
    "models": ("envace.models.__main__", "the embedded tiny models: build, path"),
}


def usage() -> str:
    lines = ["usage: envace COMMAND [ARGS ...]", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        print(f"envace: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
