"""The JSON forms both served protocols share: verdicts, task specs, action lists, the gold actions."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from envace.envs.base import EnvironmentPool, TaskSpec, ToolCall, ToolCallError, Verdict

__all__ = ["gold_turns", "header", "jsonable", "parse_turns", "pool_version", "task_dict", "verdict_dict"]


def jsonable(value: Any) -> Any:
    """``value`` as plain JSON data: what JSON cannot hold (a τ² model object in a verdict's details) as its
    ``str``."""
    return json.loads(json.dumps(value, default=str))


def verdict_dict(verdict: Verdict) -> dict[str, Any]:
    """The wire form of a verdict: ``{"reward", "passed", "details"}``."""
    return {"reward": float(verdict.reward), "passed": bool(verdict.passed), "details": jsonable(verdict.details)}


def task_dict(spec: TaskSpec) -> dict[str, Any]:
    """The wire form of a task: ``dataclasses.asdict`` of its :class:`~envace.envs.base.TaskSpec`."""
    return jsonable(dataclasses.asdict(spec))


def parse_turns(actions: Any) -> list[list[ToolCall]]:
    """``[[{"name", "arguments"}, ...], ...]`` (one list per user turn) as tool calls. Raises ``ValueError`` naming
    the turn and call of the first malformed one."""
    if not isinstance(actions, list) or not all(isinstance(t, list) for t in actions):
        raise ValueError('replay actions must be a list of turns, each a list of {"name", "arguments"}')
    turns = []
    for t, turn in enumerate(actions):
        calls = []
        for c, call in enumerate(turn):
            try:
                calls.append(ToolCall.from_dict(call))
            except ToolCallError as exc:
                raise ValueError(f"replay actions: turn {t}, call {c}: {exc}") from None
        turns.append(calls)
    return turns


def gold_turns(pool: EnvironmentPool, task_id: str) -> list[list[dict[str, Any]]] | None:
    """The task's gold actions as turns of ``{"name", "arguments"}``, or ``None`` when the pool has none."""
    try:
        gold = pool.gold_actions(task_id)
    except (NotImplementedError, LookupError):
        return None
    return jsonable([[c.to_dict() for c in turn] for turn in gold]) if gold else None


def pool_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("envace")
    except PackageNotFoundError:
        return "0"


def header(scope: Mapping[str, Any], name: bytes) -> str | None:
    """The value of header ``name`` (lower case) in an ASGI scope, or ``None``."""
    for key, value in scope.get("headers") or ():
        if key.lower() == name:
            return value.decode("latin-1")
    return None
