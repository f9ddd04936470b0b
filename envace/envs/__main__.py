"""``python -m envace.envs``: inspect environment pools, check gold replays, verify actions, build data.

Commands::

    list [POOL ...]                       pools and their task counts per category and split
    tasks POOL [--split S] [--category C ...] [--json]
    gold POOL [--category C ...] [--split S] [--limit N] [--workers N]
                                          replay every task's gold actions through the pool's official
                                          verifier; exit 1 if any task fails
    verify POOL TASK_ID ACTIONS.json      verify an action sequence (a JSON list of turns, each a list of
                                          {"name", "arguments"}; a flat list of calls is one turn);
                                          prints the verdict as JSON; exit 1 if it does not pass
    build-data --pools P [P ...] --out DIR [--agent-name A] [--limit-per-pool N]
                                          verl parquet (train.parquet / val.parquet / manifest.json)
    convert-cm2 IN.jsonl OUT_DIR [--skip-invalid] [--val-fraction F]
                                          CM2 checklist data -> the same parquet layout

``--pool-kwargs '{"bfcl_multi_turn": {"test_fraction": 0.3}}'`` (before the command) passes constructor
options to pools. Exit codes: 0 success, 1 failed tasks / verdict, 2 bad usage or input.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import multiprocessing
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from envace.envs.base import EnvironmentPool, available_pools, get_pool

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class CLIError(Exception):
    """A user-facing error: printed as ``envace.envs: error: ...`` with exit code 2."""


def _load_pool(name: str, pool_kwargs: Mapping[str, Mapping[str, Any]]) -> EnvironmentPool:
    # Benchmark packages may print at import (tau2 prints its registry); keep stdout for our output.
    with contextlib.redirect_stdout(sys.stderr):
        try:
            return get_pool(name, **dict(pool_kwargs.get(name, {})))
        except KeyError as exc:
            raise CLIError(exc.args[0] if exc.args else str(exc)) from None
        except TypeError as exc:
            raise CLIError(f"bad --pool-kwargs for {name!r}: {exc}") from None


def _task_ids(pool: EnvironmentPool, split: str | None, categories: Sequence[str] | None) -> list[str]:
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


# --------------------------------------------------------------------------------------------------
# list / tasks
# --------------------------------------------------------------------------------------------------


def cmd_list(args: argparse.Namespace) -> int:
    with contextlib.redirect_stdout(sys.stderr):
        names = args.pools or available_pools()
    status = EXIT_OK
    for name in names:
        try:
            pool = _load_pool(name, args.pool_kwargs)
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
    pool = _load_pool(args.pool, args.pool_kwargs)
    for tid in _task_ids(pool, args.split, args.category):
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


# --------------------------------------------------------------------------------------------------
# gold
# --------------------------------------------------------------------------------------------------

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

    pool = _load_pool(args.pool, args.pool_kwargs)
    ids = _task_ids(pool, args.split, args.category)
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
        # Workers need the functions under an importable name, not "__main__" (run with -m).
        worker = importlib.import_module("envace.envs.__main__")
        with ProcessPoolExecutor(
            max_workers=args.workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=worker._init_worker,
            initargs=(args.pool, dict(args.pool_kwargs.get(args.pool, {}))),
        ) as ex:
            for res in ex.map(worker._replay_gold, ids, chunksize=max(1, len(ids) // (args.workers * 8))):
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


# --------------------------------------------------------------------------------------------------
# verify
# --------------------------------------------------------------------------------------------------


def cmd_verify(args: argparse.Namespace) -> int:
    from envace.envs.datasets import ActionsFormatError, load_actions

    try:
        actions = load_actions(args.actions)
    except ActionsFormatError as exc:
        raise CLIError(str(exc)) from None
    pool = _load_pool(args.pool, args.pool_kwargs)
    try:
        pool.task(args.task_id)
    except KeyError as exc:
        raise CLIError(exc.args[0] if exc.args else str(exc)) from None
    verdict = pool.replay(args.task_id, actions)
    details = verdict.details or {}
    out = {
        "pool": args.pool,
        "task_id": args.task_id,
        "reward": verdict.reward,
        "passed": verdict.passed,
        "error_type": details.get("error_type"),
        "reason": details.get("reason", ""),
        "details": details,
    }
    print(json.dumps(out, indent=2, default=repr))
    return EXIT_OK if verdict.passed else EXIT_FAILED


# --------------------------------------------------------------------------------------------------
# build-data / convert-cm2
# --------------------------------------------------------------------------------------------------


def cmd_build_data(args: argparse.Namespace) -> int:
    from envace.envs.datasets import DatasetBuildError, build_parquet

    with contextlib.redirect_stdout(sys.stderr):
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
    from envace.envs.cm2 import CM2ValidationError, convert_cm2

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


# --------------------------------------------------------------------------------------------------
# parser
# --------------------------------------------------------------------------------------------------


def _pool_kwargs(text: str) -> dict[str, dict[str, Any]]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc.msg}") from None
    if not isinstance(obj, dict) or not all(isinstance(v, dict) for v in obj.values()):
        raise argparse.ArgumentTypeError('expected {"<pool>": {"<option>": value, ...}, ...}')
    return obj


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from envace.envs.datasets import DEFAULT_AGENT_NAME

    parser = argparse.ArgumentParser(
        prog="python -m envace.envs", description="Environment pools: inspect, check gold replays, verify, build data."
    )
    parser.add_argument(
        "--pool-kwargs",
        type=_pool_kwargs,
        default={},
        metavar="JSON",
        help='constructor options per pool, e.g. \'{"bfcl_multi_turn": {"test_fraction": 0.3}}\'',
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("list", help="pools and task counts per category and split")
    p.add_argument("pools", nargs="*", metavar="POOL", help="pools to list (default: all registered)")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("tasks", help="task ids of a pool")
    p.add_argument("pool")
    p.add_argument("--split", default=None, help="train / test (default: all)")
    p.add_argument("--category", nargs="+", default=None)
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.set_defaults(func=cmd_tasks)

    p = sub.add_parser("gold", help="replay gold actions through the official verifier")
    p.add_argument("pool")
    p.add_argument("--category", nargs="+", default=None)
    p.add_argument("--split", default=None)
    p.add_argument("--limit", type=_positive_int, default=None, help="first N selected tasks")
    p.add_argument("--workers", type=_positive_int, default=1, help="worker processes (default 1)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_gold)

    p = sub.add_parser("verify", help="verify an action sequence for one task")
    p.add_argument("pool")
    p.add_argument("task_id")
    p.add_argument("actions", metavar="ACTIONS.json")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("build-data", help="verl parquet from pools")
    p.add_argument("--pools", nargs="+", required=True)
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--agent-name", default=DEFAULT_AGENT_NAME)
    p.add_argument("--limit-per-pool", type=_positive_int, default=None)
    p.add_argument("--train-split", default="train")
    p.add_argument("--val-split", default="test")
    p.add_argument("--seed", default="0", help="seed of the --limit-per-pool selection")
    p.set_defaults(func=cmd_build_data)

    p = sub.add_parser("convert-cm2", help="CM2 checklist JSONL -> verl parquet")
    p.add_argument("input", metavar="IN.jsonl")
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument("--skip-invalid", action="store_true", help="write invalid records to OUT_DIR/rejects.jsonl")
    p.add_argument("--val-fraction", type=_fraction, default=0.1)
    p.add_argument("--agent-name", default=DEFAULT_AGENT_NAME)
    p.add_argument("--seed", default="0")
    p.set_defaults(func=cmd_convert_cm2)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except CLIError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
