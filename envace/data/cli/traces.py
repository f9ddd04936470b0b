"""``record-traces``: the gold replays of a pool's tasks, recorded as Trace2Env traces (:mod:`envace.data.traces`)
into one JSONL file, and with ``--by-env DIR`` also one file per environment (one worldbook per environment).

Every argument is checked before anything is written (an unknown pool, split or ``--env-id``, bad ``--pool-kwargs``,
``--max-tasks`` below 1, an ``--out`` that is a directory: exit 2 with one line, see :mod:`trace2env.cliargs`); a
selection with no task is refused rather than written as an empty file. Exit 1 when no selected task's replay could
be recorded.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from pathlib import Path

from envace.data.traces import record_pool, write_traces
from envace.envs.base import EnvironmentPool, available_pools, get_pool
from envace.envs.cli.common import EXIT_FAILED, EXIT_OK, CLIError, positive_int

SPLITS = ("train", "test", "all")


def _pool(args: argparse.Namespace) -> EnvironmentPool:
    with contextlib.redirect_stdout(sys.stderr):  # benchmark packages print at import
        known = available_pools()
        if args.pool not in known:
            raise CLIError(f"--pool {args.pool!r}: unknown pool; known: {', '.join(known)}")
        try:
            return get_pool(args.pool, **args.pool_kwargs.get(args.pool, {}))
        except (TypeError, ValueError, KeyError) as exc:
            raise CLIError(f"--pool-kwargs for {args.pool!r}: {exc}") from None


def _select(args: argparse.Namespace) -> tuple[EnvironmentPool, list[str]]:
    """The pool and the task ids the arguments select; CLIError for anything that selects nothing."""
    if args.split not in SPLITS:
        raise CLIError(f"--split {args.split!r}: expected train, test or all")
    pool = _pool(args)
    ids = pool.task_ids(None if args.split == "all" else args.split)
    if args.env_id:
        envs = {pool.task(t).env_id for t in ids}
        unknown = sorted(set(args.env_id) - envs)
        if unknown:
            have = sorted(envs)
            raise CLIError(f"--env-id {', '.join(unknown)}: no {args.split}-split task of pool {args.pool!r} "
                           f"has it (it has {len(have)}: {', '.join(have[:6])}{' ...' if len(have) > 6 else ''})")
        ids = [t for t in ids if pool.task(t).env_id in set(args.env_id)]
    if args.max_tasks is not None:
        ids = ids[: args.max_tasks]
    if not ids:
        raise CLIError(f"no {args.split}-split task in pool {args.pool!r}")
    return pool, ids


def cmd_record_traces(args: argparse.Namespace) -> int:
    if Path(args.out).is_dir():
        raise CLIError(f"--out {args.out}: a directory, expected a JSONL file")
    if args.by_env and Path(args.by_env).exists() and not Path(args.by_env).is_dir():
        raise CLIError(f"--by-env {args.by_env}: a file, expected a directory")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    pool, ids = _select(args)
    traces = record_pool(pool, ids)
    write_traces(traces, args.out, args.by_env)
    print(f"{len(traces)} of {len(ids)} task(s) recorded -> {args.out}")
    return EXIT_OK if traces else EXIT_FAILED


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("record-traces", help="gold replays of a pool's tasks as Trace2Env traces (JSONL)")
    p.add_argument("--pool", required=True, help="pool name (python -m envace.envs list)")
    p.add_argument("--split", default="train", help="train | test | all")
    p.add_argument("--max-tasks", type=positive_int, default=None, help="first N task ids of the split")
    p.add_argument("--env-id", action="append", default=None, help="only tasks of these env_ids (repeatable)")
    p.add_argument("--out", required=True, help="JSONL file of traces")
    p.add_argument("--by-env", default=None, help="also write one JSONL per env_id into this directory")
    p.set_defaults(func=cmd_record_traces)
