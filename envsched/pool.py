"""Task pool: the environment–task pairs EnvSched schedules (EnvSched §2.1).

A pool is built from plain Python records (``TaskPool.from_records``) or from a JSONL file
(``TaskPool.from_jsonl``).  One JSON object per line; blank lines are skipped.

JSONL record format
-------------------
Required keys:

``task_id`` (str)
    Unique id of the environment–task pair across the whole pool.
``env_id`` (str)
    Id of the executable environment the task runs in (tools, transition rules, verifier).
``instruction`` (str)
    The user request the agent must fulfil.

Optional keys (defaults in brackets):

``initial_state`` (str or JSON value) [""]
    Summary of the task's initial state; JSON values are serialised with sorted keys.
``tools`` (list) [[]]
    Tool descriptions of the environment, each either a string (the tool name) or an object
    ``{"name": str, "description": str, "parameters": <JSON schema object>}`` (OpenAI function format;
    ``{"type": "function", "function": {...}}`` wrappers are unwrapped).
``verifier_checks`` (list of str, or str) [[]]
    Natural-language text of the verifier's checks (one string per check).
``verifier_code`` (str) [""]
    Source code of the verifier (Python is parsed structurally; other languages are tokenised).
``gold_actions`` (list) [[]]
    Ground-truth tool-call sequence, each ``{"name": str, "arguments": object}``; used by the
    deterministic operation extractor and by the identifier filter's notion of permitted context.
``meta`` (object) [{}]
    Free-form metadata, kept but not used by EnvSched.

Unknown top-level keys are an error (so typos such as ``"verifer_code"`` do not silently vanish).
Example line::

    {"task_id": "bank-17", "env_id": "bank", "instruction": "Freeze card 4411 of Ana Ruiz.",
     "tools": [{"name": "get_user_by_name", "description": "...", "parameters": {...}}],
     "verifier_checks": ["card 4411 is frozen"], "verifier_code": "assert db.cards['4411'].frozen",
     "gold_actions": [{"name": "get_user_by_name", "arguments": {"name": "Ana Ruiz"}}]}
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

_REQUIRED = ("task_id", "env_id", "instruction")
_OPTIONAL = ("initial_state", "tools", "verifier_checks", "verifier_code", "gold_actions", "meta")


class PoolFormatError(ValueError):
    """A pool record is malformed; the message names the source, the line (JSONL) and the reason."""

    def __init__(self, reason: str, *, source: str | None = None, line: int | None = None):
        self.reason, self.source, self.line = reason, source, line
        where = f"{source or '<records>'}" + (f":{line}" if line is not None else "")
        super().__init__(f"{where}: {reason}")


@dataclass(frozen=True)
class Tool:
    """One tool of an environment (OpenAI function format)."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=dict)

    def param_names(self) -> list[str]:
        props = self.parameters.get("properties", {}) if isinstance(self.parameters, Mapping) else {}
        return list(props) if isinstance(props, Mapping) else []

    def text(self) -> str:
        return " ".join([self.name, self.description, " ".join(self.param_names())]).strip()


@dataclass(frozen=True)
class Action:
    """One tool call of a fixed action sequence (ground truth or a saved trajectory)."""

    name: str
    arguments: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Task:
    """One environment–task pair."""

    task_id: str
    env_id: str
    instruction: str
    initial_state: str = ""
    tools: tuple[Tool, ...] = ()
    verifier_checks: tuple[str, ...] = ()
    verifier_code: str = ""
    gold_actions: tuple[Action, ...] = ()
    meta: Mapping[str, Any] = field(default_factory=dict)

    def to_record(self) -> dict[str, Any]:
        return {
            "task_id": self.task_id,
            "env_id": self.env_id,
            "instruction": self.instruction,
            "initial_state": self.initial_state,
            "tools": [{"name": t.name, "description": t.description, "parameters": dict(t.parameters)} for t in self.tools],
            "verifier_checks": list(self.verifier_checks),
            "verifier_code": self.verifier_code,
            "gold_actions": [{"name": a.name, "arguments": dict(a.arguments)} for a in self.gold_actions],
            "meta": dict(self.meta),
        }


def _text(value: Any, key: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, sort_keys=True, ensure_ascii=False)
    except TypeError as exc:
        raise PoolFormatError(f"'{key}' is not JSON-serialisable: {exc}") from None


def _tool(value: Any, i: int) -> Tool:
    if isinstance(value, str):
        if not value:
            raise PoolFormatError(f"tools[{i}] is an empty string")
        return Tool(name=value)
    if isinstance(value, Tool):
        return value
    if not isinstance(value, Mapping):
        raise PoolFormatError(f"tools[{i}] must be a string or an object, got {type(value).__name__}")
    if "function" in value and isinstance(value["function"], Mapping):
        value = value["function"]
    name = value.get("name")
    if not isinstance(name, str) or not name:
        raise PoolFormatError(f"tools[{i}] has no string 'name'")
    params = value.get("parameters") or {}
    if not isinstance(params, Mapping):
        raise PoolFormatError(f"tools[{i}].parameters must be an object")
    return Tool(name=name, description=str(value.get("description") or ""), parameters=dict(params))


def _action(value: Any, i: int) -> Action:
    if isinstance(value, Action):
        return value
    if not isinstance(value, Mapping):
        raise PoolFormatError(f"gold_actions[{i}] must be an object, got {type(value).__name__}")
    name = value.get("name")
    if not isinstance(name, str) or not name:
        raise PoolFormatError(f"gold_actions[{i}] has no string 'name'")
    args = value.get("arguments") or {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as exc:
            raise PoolFormatError(f"gold_actions[{i}].arguments is not valid JSON: {exc.msg}") from None
    if not isinstance(args, Mapping):
        raise PoolFormatError(f"gold_actions[{i}].arguments must be an object")
    return Action(name=name, arguments=dict(args))


def task_from_record(record: Mapping[str, Any] | Task) -> Task:
    """Validate one plain record (see the module docstring) and build a Task."""
    if isinstance(record, Task):
        return record
    if not isinstance(record, Mapping):
        raise PoolFormatError(f"record must be a JSON object, got {type(record).__name__}")
    unknown = sorted(set(record) - set(_REQUIRED) - set(_OPTIONAL))
    if unknown:
        raise PoolFormatError(f"unknown key(s) {unknown}; allowed: {list(_REQUIRED + _OPTIONAL)}")
    for key in _REQUIRED:
        if key not in record:
            raise PoolFormatError(f"missing required key '{key}'")
        if not isinstance(record[key], str) or not record[key].strip():
            raise PoolFormatError(f"'{key}' must be a non-empty string")
    tools = record.get("tools") or []
    if not isinstance(tools, list):
        raise PoolFormatError("'tools' must be a list")
    checks = record.get("verifier_checks") or []
    if isinstance(checks, str):
        checks = [checks]
    if not isinstance(checks, list) or not all(isinstance(c, str) for c in checks):
        raise PoolFormatError("'verifier_checks' must be a list of strings")
    code = record.get("verifier_code") or ""
    if not isinstance(code, str):
        raise PoolFormatError("'verifier_code' must be a string")
    gold = record.get("gold_actions") or []
    if not isinstance(gold, list):
        raise PoolFormatError("'gold_actions' must be a list")
    meta = record.get("meta") or {}
    if not isinstance(meta, Mapping):
        raise PoolFormatError("'meta' must be an object")
    return Task(
        task_id=record["task_id"],
        env_id=record["env_id"],
        instruction=record["instruction"],
        initial_state=_text(record.get("initial_state"), "initial_state"),
        tools=tuple(_tool(t, i) for i, t in enumerate(tools)),
        verifier_checks=tuple(checks),
        verifier_code=code,
        gold_actions=tuple(_action(a, i) for i, a in enumerate(gold)),
        meta=dict(meta),
    )


class TaskPool:
    """An ordered, immutable collection of tasks with integer indices and environment codes."""

    def __init__(self, tasks: Sequence[Task]):
        if not tasks:
            raise PoolFormatError("the task pool is empty")
        self.tasks: tuple[Task, ...] = tuple(tasks)
        self.task_ids: list[str] = [t.task_id for t in self.tasks]
        self.index: dict[str, int] = {}
        for i, tid in enumerate(self.task_ids):
            if tid in self.index:
                raise PoolFormatError(f"duplicate task_id '{tid}' (records {self.index[tid]} and {i})")
            self.index[tid] = i
        self.env_names, env = np.unique([t.env_id for t in self.tasks], return_inverse=True)
        self.env_names = [str(e) for e in self.env_names]
        self.env: np.ndarray = env.astype(np.int64)  # environment code of every task
        self.n_envs = len(self.env_names)

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def from_records(cls, records: Iterable[Mapping[str, Any] | Task]) -> TaskPool:
        tasks = []
        for i, rec in enumerate(records):
            try:
                tasks.append(task_from_record(rec))
            except PoolFormatError as exc:
                raise PoolFormatError(f"record {i}: {exc.reason}") from None
        return cls(tasks)

    @classmethod
    def from_jsonl(cls, path: str | Path) -> TaskPool:
        """Read a pool in the JSONL format of the module docstring; errors name file, line and reason."""
        path = Path(path)
        tasks: list[Task] = []
        seen: dict[str, int] = {}
        with path.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise PoolFormatError(f"invalid JSON ({exc.msg} at column {exc.colno})", source=str(path), line=lineno) from None
                try:
                    task = task_from_record(rec)
                except PoolFormatError as exc:
                    raise PoolFormatError(exc.reason, source=str(path), line=lineno) from None
                if task.task_id in seen:
                    raise PoolFormatError(
                        f"duplicate task_id '{task.task_id}' (first on line {seen[task.task_id]})", source=str(path), line=lineno
                    )
                seen[task.task_id] = lineno
                tasks.append(task)
        if not tasks:
            raise PoolFormatError("no records", source=str(path))
        return cls(tasks)

    def to_jsonl(self, path: str | Path) -> None:
        with Path(path).open("w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(t.to_record(), ensure_ascii=False) + "\n" for t in self.tasks)

    # ---- access --------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.tasks)

    def __getitem__(self, i: int) -> Task:
        return self.tasks[i]

    def indices(self, task_ids: Iterable[str]) -> np.ndarray:
        try:
            return np.fromiter((self.index[t] for t in task_ids), dtype=np.int64)
        except KeyError as exc:
            raise KeyError(f"unknown task_id {exc.args[0]!r}") from None

    def fingerprint(self) -> str:
        """Hash of the ordered (task_id, env_id) list; a saved scheduler state only loads into the same pool."""
        h = hashlib.sha256()
        for t in self.tasks:
            h.update(t.task_id.encode())
            h.update(b"\x1f")
            h.update(t.env_id.encode())
            h.update(b"\x1e")
        return h.hexdigest()
