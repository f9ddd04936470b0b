"""What every verb of ``python -m envace.envs`` and ``python -m envace.data`` shares: the dispatcher, the exit codes,
the user-facing error, the global ``--pool-kwargs`` option and loading a pool with it, selecting tasks.

A usage or input mistake raises :class:`CLIError` (a :class:`trace2env.cliargs.UsageError`): ``run_cli`` prints it as
``<prog>: error: <one line>`` and exits 2, never with a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

from envace.envs.base import EnvironmentPool, get_pool
from trace2env.cliargs import ArgumentParser, UsageError, json_object, number, read_text, run_cli

__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_USAGE", "CLIError", "add_pool_kwargs", "load_pool", "positive_int",
           "read_file", "task_ids", "verb_cli"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

positive_int = number(int, min=1)


class CLIError(UsageError):
    """A user-facing error: printed as ``<prog>: error: ...`` with exit code 2."""


def _pool_kwargs(text: str) -> dict[str, dict[str, Any]]:
    obj = json_object(text)
    if not all(isinstance(v, dict) for v in obj.values()):
        raise argparse.ArgumentTypeError('expected {"<pool>": {"<option>": value, ...}, ...}')
    return obj


def add_pool_kwargs(parser: argparse.ArgumentParser) -> None:
    """The global ``--pool-kwargs JSON`` (before the verb): constructor options per pool name."""
    parser.add_argument(
        "--pool-kwargs",
        type=_pool_kwargs,
        default={},
        metavar="JSON",
        help='constructor options per pool, e.g. \'{"bfcl_multi_turn": {"test_fraction": 0.3}}\'',
    )


def load_pool(name: str, pool_kwargs: Mapping[str, Mapping[str, Any]]) -> EnvironmentPool:
    """Pool ``name`` built with its ``--pool-kwargs``; an unknown pool or a bad option is a :class:`CLIError`."""
    # Benchmark packages may print at import (tau2 prints its registry); keep stdout for our output.
    with contextlib.redirect_stdout(sys.stderr):
        try:
            return get_pool(name, **dict(pool_kwargs.get(name, {})))
        except KeyError as exc:
            raise CLIError(exc.args[0] if exc.args else str(exc)) from None
        except (TypeError, ValueError) as exc:
            raise CLIError(f"bad --pool-kwargs for {name!r}: {exc}") from None


def task_ids(pool: EnvironmentPool, split: str | None, categories: Sequence[str] | None) -> list[str]:
    """The task ids of ``split`` (all splits: None) in ``categories`` (all: None); an unknown category is refused."""
    ids = pool.task_ids(split)
    if categories:
        known = {pool.task(t).category for t in pool.task_ids()}
        unknown = sorted(set(categories) - known)
        if unknown:
            raise CLIError(
                f"unknown categor{'y' if len(unknown) == 1 else 'ies'} {unknown} for pool "
                f"{pool.name!r}; known: {sorted(known)}"
            )
        ids = [t for t in ids if pool.task(t).category in categories]
    return ids


def read_file(path: str) -> str:
    """The text of ``path``; a missing, unreadable or non-UTF-8 file is a :class:`CLIError` naming it."""
    return read_text(path, CLIError)


def verb_cli(prog: str, description: str, groups: Sequence[ModuleType]) -> Callable[[Sequence[str] | None], int]:
    """The ``main`` of a command line made of verb groups: each module's ``add_parsers(sub)`` adds its verbs, each
    setting ``func(args)``; ``--pool-kwargs`` comes before the verb. Usage and input mistakes exit 2 with one line
    (:mod:`trace2env.cliargs`), never a traceback."""

    def run(argv: Sequence[str] | None) -> int:
        parser = ArgumentParser(prog=prog, description=description)
        add_pool_kwargs(parser)
        sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
        for group in groups:
            group.add_parsers(sub)
        args = parser.parse_args(argv)
        return args.func(args)

    def main(argv: Sequence[str] | None = None) -> int:
        return run_cli(prog, run, argv)

    return main
