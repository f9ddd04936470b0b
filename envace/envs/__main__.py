"""``python -m envace.envs``: inspect environment pools, check gold replays, verify actions, build data.

Commands::

    list [POOL ...]                       pools and their task counts per category and split
    tasks POOL [--split S] [--category C ...] [--json]
    gold POOL [--category C ...] [--split S] [--limit N] [--workers N]
                                          replay every task's gold actions through the pool's official
                                          verifier; exit 1 if any task fails
    verify POOL TASK_ID ACTIONS.json      verify an action sequence; prints the verdict as JSON; exit 1 if it
                                          does not pass. Formats, detected: envace's (a JSON list of turns,
                                          each a list of {"name", "arguments"}; a flat list of calls is one
                                          turn), BFCL's native one (per turn a list of call strings such as
                                          "sort('final_report.pdf')", or per turn a list of steps of them;
                                          positional arguments mapped through the schema) and tau2's (its
                                          actions: {"name", "arguments", "requestor", ...})
    verify POOL --batch FILE              verify many tasks in one process: JSONL of {"task_id", "actions"}
                                          (or BFCL's result / possible-answer files: {"id", "result" |
                                          "ground_truth"}); every line is checked before any is verified; one
                                          JSON line per task, then {"summary": ...}; exit 1 if any fails
    build-data --pools P [P ...] --out DIR [--agent-name A] [--limit-per-pool N]
                                          verl parquet (train.parquet / val.parquet / manifest.json)
    convert-cm2 IN.jsonl OUT_DIR [--skip-invalid] [--val-fraction F]
                                          CM2 checklist data -> the same parquet layout
    serve --pool POOL --protocol openenv|mcp [--host H] [--port P] [--token-file F] [--max-sessions N]
          [--session-timeout S]           serve a pool to other frameworks: one session = one episode
                                          (:mod:`envace.envs.serve`); loopback by default, a bearer token from
                                          --token-file or ENVACE_SERVE_TOKEN; prints one line with the URL when
                                          ready and runs until interrupted

``--pool-kwargs '{"bfcl_multi_turn": {"test_fraction": 0.3}}'`` (before the command) passes constructor
options to pools. Exit codes: 0 success, 1 failed tasks / verdict, 2 bad usage or input (one line naming the
flag, file or line: :mod:`trace2env.cliargs`; never a traceback).
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

from envace.envs.base import EnvironmentPool, ToolCall, available_pools, configuration_needed, get_pool
from trace2env.cliargs import ArgumentParser, UsageError, json_object, number, read_text, run_cli

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class CLIError(UsageError):
    """A user-facing error: printed as ``python -m envace.envs: error: ...`` with exit code 2."""


def _load_pool(name: str, pool_kwargs: Mapping[str, Mapping[str, Any]]) -> EnvironmentPool:
    # Benchmark packages may print at import (tau2 prints its registry); keep stdout for our output.
    with contextlib.redirect_stdout(sys.stderr):
        try:
            return get_pool(name, **dict(pool_kwargs.get(name, {})))
        except KeyError as exc:
            raise CLIError(exc.args[0] if exc.args else str(exc)) from None
        except (TypeError, ValueError) as exc:
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
        needed = None if args.pools else configuration_needed(name)
        if needed:  # listed by name only: nothing to count without its configuration
            print(f"{name}: needs {needed}")
            continue
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


def _read_text(path: str) -> str:
    return read_text(path, CLIError)


def _has_string_call(obj: Any) -> bool:
    return isinstance(obj, str) or (isinstance(obj, list) and any(_has_string_call(x) for x in obj))


def parse_any_actions(pool: EnvironmentPool, task_id: str, obj: Any) -> tuple[list[list[ToolCall]], str]:
    """``(turns of calls, format)`` of an action sequence in any accepted format (see the module docstring):
    ``"bfcl"`` (call strings, the pool must read them), ``"tau2"`` (calls with a ``requestor``) or ``"envace"``.
    Raises :class:`~envace.envs.datasets.ActionsFormatError` (a ValueError) naming the turn and call."""
    from envace.envs.datasets import ActionsFormatError, parse_actions

    if isinstance(obj, list) and obj and _has_string_call(obj):
        reader = getattr(pool, "calls_from_strings", None)
        if reader is None:
            raise ActionsFormatError(f"call strings are BFCL's format; pool {pool.name!r} takes "
                                     '{"name", "arguments"} objects')
        try:
            return reader(task_id, obj), "bfcl"
        except ValueError as exc:
            raise ActionsFormatError(str(exc)) from None
    if isinstance(obj, list) and obj and all(isinstance(c, Mapping) and ("requestor" in c or "action_id" in c)
                                             for c in obj):
        calls = []  # tau2's own actions: one turn; the user's side named "user:<tool>" as the pool reads it
        for c, act in enumerate(obj):
            name = act.get("name")
            if not isinstance(name, str) or act.get("requestor", "assistant") not in ("assistant", "user"):
                raise ActionsFormatError(f"call {c}: a tau2 action needs a string 'name' and requestor "
                                         "'assistant' or 'user'")
            prefix = "user:" if act.get("requestor") == "user" else ""
            calls.append({"name": prefix + name, "arguments": act.get("arguments") or {}})
        return parse_actions([calls]), "tau2"
    return parse_actions(obj), "envace"


def _verdict_json(pool: EnvironmentPool, task_id: str, actions: list[list[ToolCall]], fmt: str,
                  *, details: bool = True) -> dict[str, Any]:
    try:
        verdict = pool.replay(task_id, actions)
    except Exception as exc:  # noqa: BLE001 - a crashing replay is that task's failure, reported, not a crash
        return {"pool": pool.name, "task_id": task_id, "format": fmt, "reward": 0.0, "passed": False,
                "error_type": "exception", "reason": f"{type(exc).__name__}: {exc}"}
    d = verdict.details or {}
    out = {"pool": pool.name, "task_id": task_id, "format": fmt, "reward": verdict.reward,
           "passed": verdict.passed, "error_type": d.get("error_type"), "reason": d.get("reason", "")}
    if details:
        out["details"] = d
    return out


def cmd_verify(args: argparse.Namespace) -> int:
    from envace.envs.datasets import ActionsFormatError

    if args.batch is not None:
        if args.task_id is not None:
            raise CLIError("give TASK_ID ACTIONS.json or --batch FILE, not both")
        return _verify_batch(args)
    if args.task_id is None or args.actions is None:
        raise CLIError("verify needs TASK_ID and ACTIONS.json (or --batch FILE)")
    text = _read_text(args.actions)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CLIError(f"{args.actions}: not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    pool = _load_pool(args.pool, args.pool_kwargs)
    try:
        pool.task(args.task_id)
    except KeyError as exc:
        raise CLIError(exc.args[0] if exc.args else str(exc)) from None
    try:
        actions, fmt = parse_any_actions(pool, args.task_id, obj)
    except ActionsFormatError as exc:
        raise CLIError(f"{args.actions}: {exc}") from None
    out = _verdict_json(pool, args.task_id, actions, fmt)
    print(json.dumps(out, indent=2, default=repr))
    return EXIT_OK if out["passed"] else EXIT_FAILED


_ID_KEYS, _ACTION_KEYS = ("task_id", "id"), ("actions", "result", "ground_truth")


def _batch_records(path: str, text: str) -> list[tuple[int, Any, Any]]:
    """(line, task id, actions) of a batch file: JSONL, or one JSON list of records."""
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CLIError(f"{path}: not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
        lines = [(i + 1, item) for i, item in enumerate(items)]
        where = "record"
    else:
        lines = []
        for n, line in enumerate(text.split("\n"), 1):
            if line.strip():
                try:
                    lines.append((n, json.loads(line)))
                except json.JSONDecodeError as exc:
                    raise CLIError(f"{path}:{n}: not valid JSON: {exc.msg} (column {exc.colno})") from None
        where = "line"
    if not lines:
        raise CLIError(f"{path}: holds no task")
    out = []
    for n, rec in lines:
        at = f"{path}:{n}" if where == "line" else f"{path}: record {n}"
        if not isinstance(rec, Mapping):
            raise CLIError(f"{at}: expected an object, got {type(rec).__name__}")
        tid = next((rec[k] for k in _ID_KEYS if k in rec), None)
        key = next((k for k in _ACTION_KEYS if k in rec), None)
        if not isinstance(tid, str) or key is None:
            raise CLIError(f"{at}: expected {{\"task_id\" (or \"id\"), \"actions\" (or \"result\", "
                           f"\"ground_truth\")}}, got keys {sorted(rec)}")
        out.append((n, tid, rec[key]))
    return out


def _verify_batch(args: argparse.Namespace) -> int:
    from envace.envs.datasets import ActionsFormatError

    start = time.perf_counter()
    records = _batch_records(args.batch, _read_text(args.batch))
    pool = _load_pool(args.pool, args.pool_kwargs)
    parsed = []
    seen: dict[str, int] = {}
    for n, tid, obj in records:  # every line checked before any is verified: a bad file verifies nothing
        at = f"{args.batch}:{n}"
        try:
            pool.task(tid)
        except KeyError as exc:
            raise CLIError(f"{at}: {exc.args[0] if exc.args else exc}") from None
        if tid in seen:
            raise CLIError(f"{at}: task {tid!r} again (first on line {seen[tid]})")
        seen[tid] = n
        try:
            parsed.append((tid, *parse_any_actions(pool, tid, obj)))
        except ActionsFormatError as exc:
            raise CLIError(f"{at}: {exc}") from None
    loaded = time.perf_counter()
    passed = 0
    formats: Counter[str] = Counter()
    for tid, actions, fmt in parsed:
        out = _verdict_json(pool, tid, actions, fmt, details=False)
        passed += bool(out["passed"])
        formats[fmt] += 1
        print(json.dumps(out, default=repr), flush=False)
    done = time.perf_counter()
    print(json.dumps({"summary": {"pool": args.pool, "tasks": len(parsed), "passed": passed,
                                  "failed": len(parsed) - passed, "formats": dict(formats),
                                  "seconds": round(done - start, 3), "verify_seconds": round(done - loaded, 3)}}))
    return EXIT_OK if passed == len(parsed) else EXIT_FAILED


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
# serve
# --------------------------------------------------------------------------------------------------

TOKEN_ENV = "ENVACE_SERVE_TOKEN"


def _serve_token(args: argparse.Namespace) -> str | None:
    """The bearer token: --token-file's content (stripped), else $ENVACE_SERVE_TOKEN, else None (no auth)."""
    import os

    if args.token_file is None:
        return os.environ.get(TOKEN_ENV) or None
    token = _read_text(args.token_file).strip()
    if not token or len(token.split()) != 1:
        raise CLIError(f"--token-file {args.token_file}: expected one token on one line")
    return token


def cmd_serve(args: argparse.Namespace) -> int:
    from envace.envs.serve import bind_socket, is_loopback, serve, warn

    token = _serve_token(args)
    try:  # bound before the pool loads: a port in use is a one-line mistake, not a failed server start
        sock = bind_socket(args.host, args.port)
    except OSError as exc:
        raise CLIError(f"--port {args.port}: cannot listen on {args.host}:{args.port}: "
                       f"{exc.strerror or exc}") from None
    try:
        pool = _load_pool(args.pool, args.pool_kwargs)
    except BaseException:
        sock.close()
        raise
    if token is None and not is_loopback(args.host):
        warn(f"serving {args.pool} on {args.host} without a token: anyone who reaches the port can run episodes "
             f"(give --token-file or {TOKEN_ENV})")
    serve(pool, args.protocol, sock, token=token, max_sessions=args.max_sessions,
          session_timeout_s=args.session_timeout)
    return EXIT_OK


# --------------------------------------------------------------------------------------------------
# parser
# --------------------------------------------------------------------------------------------------


def _pool_kwargs(text: str) -> dict[str, dict[str, Any]]:
    obj = json_object(text)
    if not all(isinstance(v, dict) for v in obj.values()):
        raise argparse.ArgumentTypeError('expected {"<pool>": {"<option>": value, ...}, ...}')
    return obj


_positive_int = number(int, min=1)
_fraction = number(float, min=0, max=1)


def build_parser() -> argparse.ArgumentParser:
    from envace.envs.datasets import DEFAULT_AGENT_NAME

    parser = ArgumentParser(
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

    p = sub.add_parser("verify", help="verify an action sequence for one task, or a batch of tasks")
    p.add_argument("pool")
    p.add_argument("task_id", nargs="?", default=None)
    p.add_argument("actions", metavar="ACTIONS.json", nargs="?", default=None)
    p.add_argument("--batch", metavar="FILE", default=None,
                   help="JSONL of {task_id, actions} (or a BFCL result / possible-answer file), one process")
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

    from envace.envs.serve import DEFAULT_MAX_SESSIONS, DEFAULT_SESSION_TIMEOUT_S, PROTOCOLS

    p = sub.add_parser("serve", help="serve a pool over OpenEnv or MCP (one session = one episode)")
    p.add_argument("--pool", required=True, help="pool name (or NAME:ARG, e.g. worldbook:DIR)")
    p.add_argument("--protocol", required=True, choices=PROTOCOLS)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=number(int, min=0, max=65535), default=8000, help="default 8000; 0: a free one")
    p.add_argument("--token-file", default=None, metavar="F",
                   help=f"require 'Authorization: Bearer <token>' with the token in F (default: ${TOKEN_ENV})")
    p.add_argument("--max-sessions", type=_positive_int, default=DEFAULT_MAX_SESSIONS,
                   help=f"concurrent sessions (episodes) at most (default {DEFAULT_MAX_SESSIONS})")
    p.add_argument("--session-timeout", type=number(float, min=0, min_open=True), default=DEFAULT_SESSION_TIMEOUT_S,
                   metavar="S", help=f"end a session idle for S seconds (default {DEFAULT_SESSION_TIMEOUT_S:g})")
    p.set_defaults(func=cmd_serve)
    return parser


def _main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI; usage and input mistakes exit 2 with one line (:mod:`trace2env.cliargs`)."""
    return run_cli("python -m envace.envs", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
