"""``list`` and ``tasks``: the pools, their task counts per category and split, and their task ids."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections import Counter, defaultdict

from envace.envs.base import available_pools, configuration_needed
from envace.envs.cli.common import EXIT_FAILED, EXIT_OK, load_pool, task_ids


def cmd_list(args: argparse.Namespace) -> int:
    with contextlib.redirect_stdout(sys.stderr):
        names = args.pools or available_pools()
    status = EXIT_OK
    for name in names:
        needed = None if args.pools else configuration_needed(name)
        if needed:  # listed by name only: nothing to count without its configuration
            print(f"{name}: needs {needed}")
            continue
        try:
            pool = load_pool(name, args.pool_kwargs)
        except Exception as exc:  # noqa: BLE001 - one broken pool must not hide the others
            print(f"{name}: unavailable: {type(exc).__name__}: {exc}", file=sys.stderr)
            status = EXIT_FAILED
            continue
        counts: dict[str, Counter[str]] = defaultdict(Counter)
        for spec in pool.tasks():
            counts[spec.category][spec.split] += 1
        splits = sorted({s for c in counts.values() for s in c})
        total = sum(sum(c.values()) for c in counts.values())
        print(f"{name}: {total} tasks")
        width = max([len("category")] + [len(c) for c in counts])
        print("  " + "category".ljust(width) + "".join(f"{s:>8}" for s in splits) + f"{'total':>8}")
        for category in sorted(counts):
            row = counts[category]
            print("  " + category.ljust(width) + "".join(f"{row[s]:>8}" for s in splits) + f"{sum(row.values()):>8}")
    return status


def cmd_tasks(args: argparse.Namespace) -> int:
    pool = load_pool(args.pool, args.pool_kwargs)
    for tid in task_ids(pool, args.split, args.category):
        spec = pool.task(tid)
        if args.json:
            print(
                json.dumps(
                    {
                        "task_id": tid,
                        "category": spec.category,
                        "split": spec.split,
                        "env_id": spec.env_id,
                        "num_tools": len(spec.tools),
                    }
                )
            )
        else:
            print(f"{tid}\t{spec.category}\t{spec.split}\t{spec.env_id}")
    return EXIT_OK


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("list", help="pools and task counts per category and split")
    p.add_argument("pools", nargs="*", metavar="POOL", help="pools to list (default: all registered)")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("tasks", help="task ids of a pool")
    p.add_argument("pool")
    p.add_argument("--split", default=None, help="train / test (default: all)")
    p.add_argument("--category", nargs="+", default=None)
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.set_defaults(func=cmd_tasks)
