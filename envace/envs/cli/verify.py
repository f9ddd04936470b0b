"""``verify``: an action sequence for one task, or a batch of tasks in one process, through the pool's official
verifier. The formats it reads are detected: envace's (:mod:`envace.envs.actions`), BFCL's call strings and τ²'s
actions (:func:`parse_any_actions`)."""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

from envace.envs.actions import ActionsFormatError, parse_actions
from envace.envs.base import EnvironmentPool, ToolCall
from envace.envs.cli.common import EXIT_FAILED, EXIT_OK, CLIError, load_pool, read_file


def _has_string_call(obj: Any) -> bool:
    return isinstance(obj, str) or (isinstance(obj, list) and any(_has_string_call(x) for x in obj))


def parse_any_actions(pool: EnvironmentPool, task_id: str, obj: Any) -> tuple[list[list[ToolCall]], str]:
    """``(turns of calls, format)`` of an action sequence in any accepted format (see the module docstring):
    ``"bfcl"`` (call strings, the pool must read them), ``"tau2"`` (calls with a ``requestor``) or ``"envace"``.
    Raises :class:`~envace.envs.actions.ActionsFormatError` (a ValueError) naming the turn and call."""
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
    if args.batch is not None:
        if args.task_id is not None:
            raise CLIError("give TASK_ID ACTIONS.json or --batch FILE, not both")
        return _verify_batch(args)
    if args.task_id is None or args.actions is None:
        raise CLIError("verify needs TASK_ID and ACTIONS.json (or --batch FILE)")
    text = read_file(args.actions)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CLIError(f"{args.actions}: not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    pool = load_pool(args.pool, args.pool_kwargs)
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
    start = time.perf_counter()
    records = _batch_records(args.batch, read_file(args.batch))
    pool = load_pool(args.pool, args.pool_kwargs)
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


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="verify an action sequence for one task, or a batch of tasks")
    p.add_argument("pool")
    p.add_argument("task_id", nargs="?", default=None)
    p.add_argument("actions", metavar="ACTIONS.json", nargs="?", default=None)
    p.add_argument("--batch", metavar="FILE", default=None,
                   help="JSONL of {task_id, actions} (or a BFCL result / possible-answer file), one process")
    p.set_defaults(func=cmd_verify)
