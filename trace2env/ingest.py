"""Trace ingestion: several recorded formats → one typed :class:`~trace2env.models.Trace`, then alignment.

Paper §3 defines the construction input ``D_build = {h^(i)}`` as recorded interaction sequences, and §4.1 /
Appendix C.2 start construction by aligning each action with its result. This module is that first stage:

* **Formats** (:func:`parse_trace`): an event list ``{"events": [...]}``; chat ``{"messages": [...]}`` with
  OpenAI-style ``tool_calls`` and ``tool`` messages (``tool_call_id``); action/observation pairs
  ``{"steps": [{"action": ..., "observation": ...}]}``. All become the same event list. The record's shape is
  checked first against one JSON Schema (:data:`TRACE_SCHEMA`), so a misshapen record (``messages`` an object,
  a message a string, ``tool_calls`` one object, ``function`` null, ``metadata`` a string) is refused with the
  path of the first offending value (``messages[2].tool_calls``) instead of failing somewhere inside.
* **Content-hash ids**: ``trace_id = "src_" + sha256(canonical events)``; identical traces deduplicate.
* **Split manifests** (:func:`make_split_manifest`): deterministic, by hash, never splitting a trajectory
  group across splits.
* **Alignment** (:func:`align`): pair by call id, else sequentially; duplicate call ids, several pending
  actions without ids, orphan observations and missing observations are *flagged*, never guessed.

Recorded observations are never rewritten: a string observation is kept byte for byte; a structured one is
serialised once here (compact, key order kept) and its original value kept alongside.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError, best_match

from .cliargs import read_text
from .models import ActionCall, Event, SplitAssignment, SplitManifest, Trace, Transition

__all__ = [
    "TRACE_SCHEMA",
    "TraceFormatError",
    "align",
    "canonical_json",
    "check_shape",
    "content_hash",
    "dedupe",
    "load_traces",
    "make_split_manifest",
    "observation_text",
    "parse_trace",
]


class TraceFormatError(ValueError):
    """A trace that matches none of the accepted formats, or is malformed inside one."""


_ID = {"type": ["string", "null"]}
# an action: a name (``type`` in some event lists) and arguments, an object or its JSON text; ``properties``
# constrain objects only, so a step's action may also be the JSON text of one
_ACTION = {"name": {"type": "string"}, "type": {"type": "string"}, "arguments": {"type": ["object", "string", "null"]}}
_EVENT = {
    "type": "object",
    "required": ["kind"],
    "properties": {"kind": {"enum": ["action", "observation", "message"]},
                   "actor": {"enum": ["agent", "environment", "user", "system", None]},
                   "call_id": _ID, "tool_call_id": _ID},
    "if": {"properties": {"kind": {"const": "action"}}},
    "then": {"required": ["content"], "properties": {"content": {"type": "object", "properties": _ACTION}}},
}
_TOOL_CALL = {  # OpenAI's {"id", "type": "function", "function": {"name", "arguments"}}, or the call itself
    "type": "object",
    "properties": {**_ACTION, "id": _ID, "call_id": _ID, "function": {"type": "object", "properties": _ACTION}},
}
_MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {"role": {"enum": ["assistant", "tool", "function", "user", "system"]},
                   "tool_calls": {"type": ["array", "null"], "items": _TOOL_CALL},
                   "tool_call_id": _ID, "call_id": _ID},
}
_STEPS = {"type": "array", "items": {"type": "object", "required": ["action"],
                                     "properties": {"action": {"type": ["object", "string"], "properties": _ACTION}}}}
#: The shape of one trace record, in any of the three formats (values the parser reads; other keys are kept
#: or ignored). Content and observations are free: they are recorded verbatim.
TRACE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "events": {"type": "array", "items": _EVENT},
        "messages": {"type": "array", "items": _MESSAGE},
        "steps": _STEPS,
        "pairs": _STEPS,
        "metadata": {"type": ["object", "null"]},
        "episode_id": {"type": ["string", "integer", "null"]},
    },
}
_VALIDATOR = Draft202012Validator(TRACE_SCHEMA)
_JSON_TYPE = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
              float: "a number", type(None): "null"}


def check_shape(obj: Any) -> None:
    """Raise :class:`TraceFormatError` naming the path and the problem of ``obj``'s first misshapen value
    (:data:`TRACE_SCHEMA`)."""
    error = best_match(_VALIDATOR.iter_errors(obj))
    if error is not None:
        raise TraceFormatError(_describe(error))


def _describe(error: ValidationError) -> str:
    """``messages[2].tool_calls: expected an array or null, got an object``: the path, then what is wrong."""
    where = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in error.absolute_path).lstrip(".")
    got = error.instance
    if error.validator == "type":
        want = error.validator_value if isinstance(error.validator_value, list) else [error.validator_value]
        names = ("null" if w == "null" else ("an " if w[0] in "aeio" else "a ") + w for w in want)
        what = f"expected {' or '.join(names)}, got {_JSON_TYPE.get(type(got), type(got).__name__)}"
    elif error.validator == "enum":
        what = f"expected one of {', '.join(map(json.dumps, error.validator_value))}, got {json.dumps(got)[:60]}"
    elif error.validator == "required":
        what = f"missing {next(k for k in error.validator_value if k not in got)!r}"
    else:
        what = error.message[:120]
    return f"{where or 'the trace'}: {what}"


def canonical_json(value: Any) -> str:
    """Sorted-key, compact JSON; the basis of every content hash."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def content_hash(value: Any) -> str:
    return hashlib.sha256(canonical_json(value).encode("utf-8")).hexdigest()


def observation_text(content: Any) -> str:
    """The observation as text: strings verbatim, anything else serialised once (compact JSON)."""
    if isinstance(content, str):
        return content
    return json.dumps(content, ensure_ascii=False, separators=(",", ":"))


def _action_content(name: Any, arguments: Any, raw: Any = None) -> dict[str, Any]:
    if not isinstance(name, str) or not name:
        raise TraceFormatError(f"action without a name: {name!r}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise TraceFormatError(f"action {name!r}: arguments are not JSON: {arguments[:80]!r}") from e
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, Mapping):
        raise TraceFormatError(f"action {name!r}: arguments must be an object, got {type(arguments).__name__}")
    out: dict[str, Any] = {"name": name, "arguments": dict(arguments)}
    if raw is not None:
        out["raw"] = raw
    return out


def _events_from_event_list(items: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for ev in items:
        kind = ev["kind"]
        actor = ev.get("actor") or ("agent" if kind == "action" else "environment" if kind == "observation" else "user")
        content = ev.get("content")
        if kind == "action":
            content = _action_content(content.get("name") or content.get("type"), content.get("arguments"), content.get("raw"))
        out.append({"actor": actor, "kind": kind, "content": content,
                    "call_id": ev.get("call_id") or ev.get("tool_call_id")})
    return out


def _events_from_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m["role"]
        if role == "assistant":
            if m.get("content"):
                out.append({"actor": "agent", "kind": "message", "content": m["content"], "call_id": None})
            for call in m.get("tool_calls") or ():
                fn = call.get("function", call)
                out.append({"actor": "agent", "kind": "action", "call_id": call.get("id") or call.get("call_id"),
                            "content": _action_content(fn.get("name"), fn.get("arguments"))})
        elif role in ("tool", "function"):
            out.append({"actor": "environment", "kind": "observation", "content": m.get("content"),
                        "call_id": m.get("tool_call_id") or m.get("call_id")})
        else:  # user, system
            out.append({"actor": role, "kind": "message", "content": m.get("content"), "call_id": None})
    return out


def _events_from_steps(steps: Sequence[Mapping[str, Any]], key: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, s in enumerate(steps):
        a = s["action"]
        if isinstance(a, str):
            try:
                a = json.loads(a)
            except json.JSONDecodeError as e:
                raise TraceFormatError(f"{key}[{i}].action: a string that is not JSON") from e
            if not isinstance(a, Mapping):
                raise TraceFormatError(f"{key}[{i}].action: the JSON text of {_JSON_TYPE[type(a)]}, not an object")
        out.append({"actor": "agent", "kind": "action", "call_id": None,
                    "content": _action_content(a.get("name") or a.get("type"), a.get("arguments"))})
        if "observation" in s:
            out.append({"actor": "environment", "kind": "observation", "content": s["observation"], "call_id": None})
    return out


def parse_trace(obj: Mapping[str, Any]) -> Trace:
    """One raw trace (any accepted format) → :class:`Trace` with a content-hash id.

    ``episode_id`` defaults to the hash; ``metadata`` (e.g. ``initial_state``, ``trajectory_group``) is kept.
    Raises :class:`TraceFormatError` for a record of no accepted format or shape (:func:`check_shape`).
    """
    check_shape(obj)
    if "events" in obj:
        raw_events = _events_from_event_list(obj["events"])
    elif "messages" in obj:
        raw_events = _events_from_messages(obj["messages"])
    elif "steps" in obj or "pairs" in obj:
        key = "steps" if "steps" in obj else "pairs"
        raw_events = _events_from_steps(obj[key], key)
    else:
        raise TraceFormatError("unknown trace format: expected 'events', 'messages' or 'steps'")
    digest = content_hash(raw_events)
    trace_id = f"src_{digest[:32]}"
    events = tuple(Event(id=f"{trace_id}:{i}", **e) for i, e in enumerate(raw_events))
    return Trace(trace_id=trace_id, episode_id=str(obj.get("episode_id") or trace_id), events=events,
                 metadata=dict(obj.get("metadata") or {}))


def load_traces(paths: Iterable[str | Path]) -> list[Trace]:
    """Read ``.json`` (one trace or a list) and ``.jsonl`` (one trace a line) files; deduplicated.

    Raises :class:`TraceFormatError` naming the file (and the line of a JSONL file) for an unreadable,
    non-UTF-8, malformed or empty file: a file that holds no trace is a mistake, not an empty contribution."""
    out: list[Trace] = []
    for p in paths:
        p = Path(p)
        text = read_text(p, TraceFormatError, "traces file")
        if p.suffix == ".jsonl":
            items, where = [], []
            for n, line in enumerate(text.split("\n"), 1):
                if line.strip():
                    try:
                        items.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise TraceFormatError(f"{p}:{n}: not valid JSON: {e.msg} (column {e.colno})") from None
                    where.append(f"{p}:{n}")
        else:
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise TraceFormatError(f"{p}: not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None
            items = data if isinstance(data, list) else [data]
            where = [f"{p}: trace {i}" for i in range(len(items))]
        if not items:
            raise TraceFormatError(f"{p}: holds no trace")
        for at, item in zip(where, items):
            try:
                out.append(parse_trace(item))
            except TraceFormatError as e:
                raise TraceFormatError(f"{at}: {e}") from e
    return dedupe(out)


def dedupe(traces: Iterable[Trace]) -> list[Trace]:
    """Drop traces whose content hash was already seen (first occurrence wins, order kept)."""
    seen: set[str] = set()
    out = []
    for t in traces:
        if t.trace_id not in seen:
            seen.add(t.trace_id)
            out.append(t)
    return out


def make_split_manifest(traces: Sequence[Trace], *, train: float = 0.8, dev: float = 0.0,
                        salt: str = "") -> SplitManifest:
    """Deterministic split by hash of the trajectory group (``metadata["trajectory_group"]``, else the
    episode id): every trace of a group lands in the same split, and the result does not depend on order."""
    if not 0.0 <= train <= 1.0 or not 0.0 <= dev <= 1.0 - train:
        raise ValueError("need 0 <= train, dev and train + dev <= 1")
    assignments = {}
    for t in traces:
        group = str(t.metadata.get("trajectory_group") or t.episode_id)
        u = int(hashlib.sha256(f"{salt}:{group}".encode()).hexdigest()[:12], 16) / 16**12
        split = "train" if u < train else "dev" if u < train + dev else "test"
        assignments[t.trace_id] = SplitAssignment(split=split, trajectory_group=group)
    return SplitManifest(assignments=assignments)


def align(trace: Trace) -> list[Transition]:
    """Pair every action event with its observation(s).

    * An observation with a ``call_id`` goes to the action with that id (``correlated``); a duplicate id
      among actions makes both ``ambiguous``.
    * An observation without an id goes to the single pending action (``sequential``); when several
      actions are pending it goes to the oldest and every pending action is flagged ``ambiguous``.
    * An observation with no pending action is ignored for alignment (it stays in the trace).
    * An action that never gets an observation keeps ``observation=None`` and the flag ``no_observation``.
    * Several observations for one action are concatenated (newline) and flagged ``multiple_observations``.
    """
    actions: list[dict[str, Any]] = []
    by_call: dict[str, list[int]] = {}
    pending: list[int] = []
    for ev in trace.events:
        if ev.kind == "action":
            idx = len(actions)
            actions.append({"event": ev, "obs": [], "flags": set(), "mode": None})
            pending.append(idx)
            if ev.call_id:
                by_call.setdefault(ev.call_id, []).append(idx)
        elif ev.kind == "observation":
            target: int | None = None
            if ev.call_id and ev.call_id in by_call:
                ids = by_call[ev.call_id]
                if len(ids) > 1:
                    for j in ids:
                        actions[j]["flags"].add("duplicate_call_id")
                target = next((j for j in ids if j in pending), ids[0])
                mode = "correlated"
            elif pending:
                if len(pending) > 1:
                    for j in pending:
                        actions[j]["flags"].add("concurrent_pending_actions")
                target = pending[0]
                mode = "sequential"
            if target is None:
                continue
            a = actions[target]
            a["obs"].append(ev)
            a["mode"] = a["mode"] or mode
            if target in pending:
                pending.remove(target)
        else:  # a message closes nothing but separates turns; pending actions stay pending
            continue
    out = []
    for i, a in enumerate(actions):
        ev: Event = a["event"]
        flags = set(a["flags"])
        if not a["obs"]:
            flags.add("no_observation")
        if len(a["obs"]) > 1:
            flags.add("multiple_observations")
        if len(a["obs"]) == 1:
            content = a["obs"][0].content
            text: str | None = observation_text(content)
        elif a["obs"]:
            content = [o.content for o in a["obs"]]
            text = "\n".join(observation_text(o.content) for o in a["obs"])
        else:
            content, text = None, None
        ambiguous = bool(flags & {"duplicate_call_id", "concurrent_pending_actions", "multiple_observations"})
        alignment = "ambiguous" if ambiguous else (a["mode"] or "sequential")
        out.append(Transition(
            id=f"{trace.trace_id}:t{i}", trace_id=trace.trace_id, episode_id=trace.episode_id, index=i,
            action=ActionCall(name=ev.content["name"], arguments=ev.content["arguments"], call_id=ev.call_id),
            action_event_id=ev.id, observation=text, observation_content=content,
            observation_event_ids=tuple(o.id for o in a["obs"]), alignment=alignment,
            ambiguities=tuple(sorted(flags))))
    return out
