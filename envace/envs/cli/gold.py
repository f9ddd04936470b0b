"""``gold``: replay every selected task's gold actions through the pool's official verifier, in worker processes
if asked; exit 1 if any task fails."""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import sys
import time
from collections import Counter
from collections.abc import Mapping
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from envace.envs.base import EnvironmentPool, get_pool
from envace.envs.cli.common import EXIT_FAILED, EXIT_OK, CLIError, load_pool, positive_int, task_ids

_WORKER_POOL: EnvironmentPool | None = None


def _init_worker(name: str, kwargs: Mapping[str, Any]) -> None:
    global _WORKER_POOL
    with contextlib.redirect_stdout(sys.stderr):
        _WORKER_POOL = get_pool(name, **dict(kwargs))


def _replay_gold(task_id: str, pool: EnvironmentPool | None = None) -> tuple[str, str, bool, str, str]:
    """(task_id, category, passed, error_type, reason); exceptions become failures, not crashes."""
    pool = pool or _WORKER_POOL
    assert pool is not None
    category = pool.task(task_id).category
    try:
        verdict = pool.replay(task_id, pool.gold_actions(task_id))
    except Exception as exc:  # noqa: BLE001 - a crashing task is a failed task, reported with the others
        return task_id, category, False, "exception", f"{type(exc).__name__}: {exc}"
    details = verdict.details or {}
    return (
        task_id,
        category,
        bool(verdict.passed),
        str(details.get("error_type") or ""),
        str(details.get("reason") or ""),
    )


def cmd_gold(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    pool = load_pool(args.pool, args.pool_kwargs)
    ids = task_ids(pool, args.split, args.category)
    if args.limit is not None:
        ids = ids[: args.limit]
    if not ids:
        raise CLIError("no tasks selected")
    start = time.perf_counter()
    bar = tqdm(total=len(ids), desc=f"gold {args.pool}", unit="task", file=sys.stderr, disable=args.no_progress)
    results: list[tuple[str, str, bool, str, str]] = []
    if args.workers <= 1:
        for tid in ids:
            results.append(_replay_gold(tid, pool))
            bar.update()
    else:
        # spawn, not fork: pools hold locks and handles (bfcl_eval's file locks refuse to cross a fork).
        with ProcessPoolExecutor(
            max_workers=args.workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker,
            initargs=(args.pool, dict(args.pool_kwargs.get(args.pool, {}))),
        ) as ex:
            for res in ex.map(_replay_gold, ids, chunksize=max(1, len(ids) // (args.workers * 8))):
                results.append(res)
                bar.update()
    bar.close()
    elapsed = time.perf_counter() - start

    passed: Counter[str] = Counter()
    total: Counter[str] = Counter()
    failures = []
    for tid, category, ok, error_type, reason in results:
        total[category] += 1
        passed[category] += ok
        if not ok:
            failures.append((tid, error_type, reason))
    width = max([len("category"), len("all")] + [len(c) for c in total])
    print(f"gold replay of {args.pool}: {len(results)} task(s) in {elapsed:.1f}s")
    print("category".ljust(width) + f"{'passed':>8}{'total':>8}")
    for category in sorted(total):
        print(category.ljust(width) + f"{passed[category]:>8}{total[category]:>8}")
    print("all".ljust(width) + f"{sum(passed.values()):>8}{sum(total.values()):>8}")
    for tid, error_type, reason in failures:
        print(f"FAIL {tid}: {error_type}: {reason}")
    return EXIT_FAILED if failures else EXIT_OK


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gold", help="replay gold actions through the official verifier")
    p.add_argument("pool")
    p.add_argument("--category", nargs="+", default=None)
    p.add_argument("--split", default=None)
    p.add_argument("--limit", type=positive_int, default=None, help="first N selected tasks")
    p.add_argument("--workers", type=positive_int, default=1, help="worker processes (default 1)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_gold)
