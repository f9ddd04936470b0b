"""Task pool: the environment–task pairs EnvSched schedules (EnvSched §2.1).

A pool is built from plain Python records (``TaskPool.from_records``) or from a JSONL file
(``TaskPool.from_jsonl``).  One JSON object per line; blank lines are skipped.  A file holds task records
and, optionally, environment records that store what all tasks of one environment share (its tools and
metadata) once instead of on every task line.  Files with task records only (the original format, every
line carrying its environment's tools) load unchanged.

Task record format
------------------
Required keys:

``task_id`` (str)
    Unique id of the environment–task pair across the whole pool.
``env_id`` (str)
    Id of the executable environment the task runs in (tools, transition rules, verifier).
``instruction`` (str)
    The user request the agent must fulfil.

Optional keys (defaults in brackets):

``record_type`` (str) ["task"]
    Must be ``"task"`` when given.
``initial_state`` (str or JSON value) [""]
    Summary of the task's initial state; JSON values are serialised with sorted keys.
``tools`` (list) [the environment record's tools, else []]
    Tool descriptions of the environment, each either a string (the tool name) or an object
    ``{"name": str, "description": str, "parameters": <JSON schema object>}`` (OpenAI function format;
    ``{"type": "function", "function": {...}}`` wrappers are unwrapped).  A task line that has the key
    uses its own list (also ``[]``), whatever its environment record says.
``verifier_checks`` (list of str, or str) [[]]
    Natural-language text of the verifier's checks (one string per check).
``verifier_code`` (str) [""]
    Source code of the verifier (Python is parsed structurally; other languages are tokenised).
``gold_actions`` (list) [[]]
    Ground-truth tool-call sequence, each ``{"name": str, "arguments": object}``; used by the
    deterministic operation extractor and by the identifier filter's notion of permitted context.
``meta`` (object) [{}]
    Free-form metadata, kept but not used by EnvSched.  The task's metadata is its environment record's
    ``meta`` updated with this object.

Environment record format
-------------------------
``{"record_type": "environment", "env_id": str, "tools": [...], "meta": {...}}`` (``tools`` and ``meta``
optional, same formats as above).  At most one per ``env_id``; it may come before or after the tasks of
its environment (``TaskPool.to_jsonl`` writes it just before the environment's first task).

Unknown top-level keys are an error (so typos such as ``"verifer_code"`` do not silently vanish).
Example lines::

    {"record_type": "environment", "env_id": "bank", "tools": [{"name": "get_user_by_name", "description": "...", "parameters": {...}}]}
    {"task_id": "bank-17", "env_id": "bank", "instruction": "Freeze card 4411 of Ana Ruiz.",
     "verifier_checks": ["card 4411 is frozen"], "verifier_code": "assert db.cards['4411'].frozen",
     "gold_actions": [{"name": "get_user_by_name", "arguments": {"name": "Ana Ruiz"}}]}

In memory, tasks with equal tool lists share one tuple of ``Tool`` objects (whichever format they were read
from), and tasks without metadata of their own share their environment's ``meta`` object.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

_REQUIRED = ("task_id", "env_id", "instruction")
_OPTIONAL = ("record_type", "initial_state", "tools", "verifier_checks", "verifier_code", "gold_actions", "meta")
_ENV_KEYS = ("record_type", "env_id", "tools", "meta")
TASK_RECORD, ENV_RECORD = "task", "environment"  # values of "record_type"


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


@dataclass(frozen=True)
class Environment:
    """What the tasks of one environment share, read from an environment record."""

    env_id: str
    tools: tuple[Tool, ...] = ()
    meta: Mapping[str, Any] = field(default_factory=dict)


class _Interner:
    """One tuple of ``Tool`` objects per distinct tool list (keyed by the list's JSON text).

    Every task line of the original format repeats its environment's tools; sharing the parsed tuple keeps
    one copy per environment in memory and skips re-validating the repeats.  Lists that are not JSON
    serialisable (``Tool`` objects from Python) are parsed without sharing.
    """

    def __init__(self) -> None:
        self._tools: dict[str, tuple[Tool, ...]] = {}

    def tools(self, value: list) -> tuple[Tool, ...]:
        if not value:
            return ()
        try:
            key = json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError):
            return tuple(_tool(t, i) for i, t in enumerate(value))
        hit = self._tools.get(key)
        if hit is None:
            hit = self._tools[key] = tuple(_tool(t, i) for i, t in enumerate(value))
        return hit


def _record_type(record: Mapping[str, Any]) -> str:
    kind = record.get("record_type", TASK_RECORD)
    if kind not in (TASK_RECORD, ENV_RECORD):
        raise PoolFormatError(f"'record_type' must be {TASK_RECORD!r} or {ENV_RECORD!r}, got {kind!r}")
    return kind


def environment_from_record(record: Mapping[str, Any], interner: _Interner | None = None) -> Environment:
    """Validate one environment record (see the module docstring)."""
    unknown = sorted(set(record) - set(_ENV_KEYS))
    if unknown:
        raise PoolFormatError(f"unknown key(s) {unknown} in an environment record; allowed: {list(_ENV_KEYS)}")
    env_id = record.get("env_id")
    if not isinstance(env_id, str) or not env_id.strip():
        raise PoolFormatError("environment record: 'env_id' must be a non-empty string")
    tools = record.get("tools") or []
    if not isinstance(tools, list):
        raise PoolFormatError(f"environment {env_id!r}: 'tools' must be a list")
    meta = record.get("meta") or {}
    if not isinstance(meta, Mapping):
        raise PoolFormatError(f"environment {env_id!r}: 'meta' must be an object")
    try:
        parsed = (interner or _Interner()).tools(tools)
    except PoolFormatError as exc:
        raise PoolFormatError(f"environment {env_id!r}: {exc.reason}") from None
    return Environment(env_id=env_id, tools=parsed, meta=dict(meta))


def task_from_record(record: Mapping[str, Any] | Task, env: Environment | None = None, interner: _Interner | None = None) -> Task:
    """Validate one plain task record (see the module docstring) and build a Task.

    ``env`` (the record's environment record, if any) supplies the tools when the record has no ``tools``
    key and the metadata the record's own ``meta`` updates.
    """
    if isinstance(record, Task):
        return record
    if not isinstance(record, Mapping):
        raise PoolFormatError(f"record must be a JSON object, got {type(record).__name__}")
    unknown = sorted(set(record) - set(_REQUIRED) - set(_OPTIONAL))
    if unknown:
        raise PoolFormatError(f"unknown key(s) {unknown}; allowed: {list(_REQUIRED + _OPTIONAL)}")
    if _record_type(record) != TASK_RECORD:
        raise PoolFormatError("expected a task record")
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
    if env is not None and "tools" not in record:
        parsed_tools = env.tools
    else:
        parsed_tools = interner.tools(tools) if interner is not None else tuple(_tool(t, i) for i, t in enumerate(tools))
    if env is not None and env.meta:
        merged: Mapping[str, Any] = {**env.meta, **meta} if meta else env.meta
    else:
        merged = dict(meta)
    return Task(
        task_id=record["task_id"],
        env_id=record["env_id"],
        instruction=record["instruction"],
        initial_state=_text(record.get("initial_state"), "initial_state"),
        tools=parsed_tools,
        verifier_checks=tuple(checks),
        verifier_code=code,
        gold_actions=tuple(_action(a, i) for i, a in enumerate(gold)),
        meta=merged,
    )


class _PoolReader:
    """Streams task and environment records into Tasks (both file formats; environment records may follow
    their tasks, which are then completed in ``finish``)."""

    def __init__(self, source: str | None):
        self.source = source
        self.tasks: list[Task] = []
        self.seen: dict[str, Any] = {}  # task_id -> where first seen
        self.envs: dict[str, Environment] = {}
        self.env_seen: dict[str, Any] = {}
        # env_id -> (position, has own "tools", own "meta") of tasks read before their environment record
        self.pending: dict[str, list[tuple[int, bool, Mapping[str, Any] | None]]] = {}
        self.interner = _Interner()

    def _fail(self, reason: str, where: Any) -> PoolFormatError:
        if self.source is None:
            return PoolFormatError(f"record {where}: {reason}")
        return PoolFormatError(reason, source=self.source, line=where)

    def _at(self, where: Any) -> str:
        return f"line {where}" if self.source is not None else f"record {where}"

    def add(self, record: Any, where: Any) -> None:
        try:
            kind = _record_type(record) if isinstance(record, Mapping) else TASK_RECORD
            if kind == ENV_RECORD:
                env = environment_from_record(record, self.interner)
                if env.env_id in self.env_seen:
                    raise PoolFormatError(f"duplicate environment record '{env.env_id}' (first on {self._at(self.env_seen[env.env_id])})")
                self.env_seen[env.env_id] = where
                self.envs[env.env_id] = env
                return
            env = self.envs.get(record["env_id"]) if isinstance(record, Mapping) and isinstance(record.get("env_id"), str) else None
            task = task_from_record(record, env, self.interner)
        except PoolFormatError as exc:
            raise self._fail(exc.reason, where) from None
        if task.task_id in self.seen:
            raise self._fail(f"duplicate task_id '{task.task_id}' (first on {self._at(self.seen[task.task_id])})", where)
        self.seen[task.task_id] = where
        if env is None and isinstance(record, Mapping):  # its environment record may still come
            self.pending.setdefault(task.env_id, []).append((len(self.tasks), "tools" in record, record.get("meta") or None))
        self.tasks.append(task)

    def finish(self) -> list[Task]:
        """Apply environment records that came after their tasks; returns the tasks in input order."""
        for env_id, items in self.pending.items():
            env = self.envs.get(env_id)
            if env is None:
                continue
            for k, own_tools, own_meta in items:
                t = self.tasks[k]
                meta = {**env.meta, **own_meta} if own_meta else env.meta
                self.tasks[k] = dataclasses.replace(t, tools=t.tools if own_tools else env.tools, meta=meta)
        self.pending = {}
        return self.tasks


# ---------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------


def _tools_payload(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    return [{"name": t.name, "description": t.description, "parameters": dict(t.parameters)} for t in tools]


def write_pool_jsonl(records: Iterable[Mapping[str, Any] | Task], path: str | Path, *, env_level: bool = True) -> int:
    """Write task records (plain records or ``Task`` objects) as pool JSONL; returns the number of tasks.

    ``env_level=True``: one environment record per environment, written just before the environment's first
    task, holds the tool list most of its tasks share and the metadata items all of them share; task lines
    keep everything else (a task whose tools differ keeps its own ``tools``).  Reading the file back gives
    the same tasks.  ``env_level=False``: the original format, every task line self-contained.  Task order is
    kept (it is the pool's node order).
    """
    recs = list(records)
    if any(isinstance(r, Mapping) and r.get("record_type") == ENV_RECORD for r in recs):  # resolve them first
        reader = _PoolReader(None)
        for i, r in enumerate(recs):
            reader.add(r, i)
        recs = reader.finish()
    path = Path(path)
    with path.open("w", encoding="utf-8") as fh:
        if not env_level:
            fh.writelines(json.dumps(r.to_record() if isinstance(r, Task) else r, ensure_ascii=False) + "\n" for r in recs)
            return len(recs)
        tool_json: dict[int, str | None] = {}  # id(tools object) -> its JSON text (None: no "tools" key)

        def tools_text(r: Mapping[str, Any] | Task) -> str | None:
            obj = r.tools if isinstance(r, Task) else r.get("tools", None)
            if obj is None and not isinstance(r, Task) and "tools" not in r:
                return None
            key = id(obj)
            if key not in tool_json:
                payload = _tools_payload(obj) if isinstance(r, Task) else list(obj or [])
                tool_json[key] = json.dumps(payload, ensure_ascii=False)
            return tool_json[key]

        def meta_of(r: Mapping[str, Any] | Task) -> Mapping[str, Any]:
            return r.meta if isinstance(r, Task) else (r.get("meta") or {})

        # pass 1: per environment, the most common tool list and the metadata items every task shares
        counts: dict[str, dict[str, int]] = {}
        shared: dict[str, dict[str, str]] = {}  # env -> {meta key: JSON of the shared value}
        for r in recs:
            env_id = r.env_id if isinstance(r, Task) else r["env_id"]
            text = tools_text(r)
            c = counts.setdefault(env_id, {})
            c[text or "[]"] = c.get(text or "[]", 0) + 1
            items = {k: json.dumps(v, sort_keys=True, ensure_ascii=False) for k, v in meta_of(r).items()}
            if env_id not in shared:
                shared[env_id] = items
            else:
                prev = shared[env_id]
                shared[env_id] = {k: v for k, v in prev.items() if items.get(k) == v}
        env_tools = {e: max(c, key=c.__getitem__) for e, c in counts.items()}  # ties: first seen
        # pass 2: environment record before each environment's first task, then the slimmed task line
        written: set[str] = set()
        for r in recs:
            rec = r.to_record() if isinstance(r, Task) else dict(r)
            env_id = rec["env_id"]
            if env_id not in written:
                written.add(env_id)
                env_rec: dict[str, Any] = {"record_type": ENV_RECORD, "env_id": env_id, "tools": json.loads(env_tools[env_id])}
                env_meta = {k: (meta_of(r) or {})[k] for k in shared[env_id]}
                if env_meta:
                    env_rec["meta"] = env_meta
                fh.write(json.dumps(env_rec, ensure_ascii=False) + "\n")
            text = tools_text(r)
            if (text or "[]") == env_tools[env_id]:
                rec.pop("tools", None)
            elif text is None:
                rec["tools"] = []  # no tools of its own, but the environment record has some
            own = {k: v for k, v in (rec.get("meta") or {}).items() if k not in shared[env_id]}
            rec.pop("meta", None)
            if own:
                rec["meta"] = own
            fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
        return len(recs)


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
        self._content_hash: str | None = None

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def from_records(cls, records: Iterable[Mapping[str, Any] | Task]) -> TaskPool:
        """Task records (and optionally environment records) or Task objects, in pool order."""
        reader = _PoolReader(None)
        for i, rec in enumerate(records):
            reader.add(rec, i)
        return cls(reader.finish())

    @classmethod
    def from_jsonl(cls, path: str | Path) -> TaskPool:
        """Read a pool in the JSONL format of the module docstring (either layout); errors name file, line
        and reason."""
        path = Path(path)
        reader = _PoolReader(str(path))
        with path.open("rb") as fh:  # decoded line by line, so a non-UTF-8 byte is reported with its line
            for lineno, raw in enumerate(fh, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise PoolFormatError(f"not UTF-8 text (byte {exc.start} of the line)", source=str(path),
                                          line=lineno) from None
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise PoolFormatError(f"invalid JSON ({exc.msg} at column {exc.colno})", source=str(path), line=lineno) from None
                reader.add(rec, lineno)
        tasks = reader.finish()
        if not tasks:
            raise PoolFormatError("no records" if not reader.envs else "no task records", source=str(path))
        return cls(tasks)

    def to_jsonl(self, path: str | Path, *, env_level: bool = True) -> None:
        """Write the pool as JSONL: environment-level tools and metadata once per environment (default) or,
        with ``env_level=False``, every task line self-contained (the original format)."""
        write_pool_jsonl(self.tasks, path, env_level=env_level)

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

    def content_hash(self) -> str:
        """SHA-256 of the ordered pool content (every field of every task; the key of the graph cache).

        Each distinct tool tuple is serialised once (tasks of one environment share it), so this costs
        about one JSON dump of the per-task fields.  Computed once per pool object.
        """
        if self._content_hash is None:
            h = hashlib.sha256(b"envsched-pool-v1\x1e")
            tool_digest: dict[int, str] = {}
            for t in self.tasks:
                d = tool_digest.get(id(t.tools))
                if d is None:
                    d = tool_digest[id(t.tools)] = hashlib.sha256(json.dumps(_tools_payload(t.tools), sort_keys=True, ensure_ascii=False, default=str).encode()).hexdigest()
                row = [t.task_id, t.env_id, t.instruction, t.initial_state, d, list(t.verifier_checks), t.verifier_code,
                       [[a.name, a.arguments] for a in t.gold_actions], t.meta]
                h.update(json.dumps(row, sort_keys=True, ensure_ascii=False, default=str).encode())
                h.update(b"\x1e")
            self._content_hash = h.hexdigest()
        return self._content_hash
