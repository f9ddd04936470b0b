"""Schema-validated converter: CM2-format checklist data (JSONL) → verl parquet.

CM2 data are multi-turn tool-use dialogues whose reward is a *checklist*: for every user turn, a list of
weighted criteria a judge checks against the agent's behaviour. There is no public spec of the raw
format, so this module defines the accepted input explicitly (:data:`CM2_RECORD_SCHEMA`, JSON Schema
Draft 2020-12) plus the cross-field rules JSON Schema cannot express (:func:`semantic_errors`).

Accepted record (one JSON object per line)::

    {
      "id": "abc" | 17,                       # optional; default: the record's 0-based line index
      "data_source": "cm2-retail",            # optional; default "cm2"; becomes the category
      "messages": [                           # the full reference dialogue, >= 1 user message
        {"role": "system", "content": "..."},
        {"role": "user", "content": "..."},
        {"role": "assistant", "content": "...",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "get_order", "arguments": "{\\"order_id\\": 3}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "..."},
        ...
      ],
      "tools": [{"type": "function",          # OpenAI function schemas (or a JSON string of the list)
                 "function": {"name": "get_order", "description": "...",
                              "parameters": {"type": "object", "properties": {...}}}}],
      "checklist_list": [                     # [n_checklists][n_user_turns][items]
        [
          [ {"id": "t0_1", "question": "Did the agent look the order up?",
             "focus_on": "assistant.tool_calls", "pass_condition": "get_order called with order_id 3",
             "weight": 1.0,
             "failure_examples": ["..."],                                    # optional
             "evidence": [{"turn": 0, "step": 1, "from": "assistant", "snippet": "..."}],  # optional
             "required_for_next_turn": false,                                # optional
             "dependence": null | "t0_0" | ["t0_0"]} ],                      # optional
          ...  # one list per user turn
        ]
      ]
    }

Cross-field rules: the first non-system message is from the user; every checklist has exactly one
item list per user message; item ids are unique within a turn and every ``dependence`` names an item of
the same checklist; ``evidence.turn`` is a valid user-turn index; tool names are unique; every assistant
tool call names a declared tool and its ``arguments`` are a JSON object; every ``tool`` message's
``tool_call_id`` answers an earlier call; tool ``parameters`` are valid JSON Schema; record ids are
unique.

Unknown extra keys are allowed and preserved (item extras stay in the checklist; top-level extras go to
``metadata.extra_fields``). Every error names the record index, a JSON path and the reason. Nothing is
dropped silently: by default one invalid record fails the conversion; with ``skip_invalid=True`` the
invalid records are written, with their errors, to ``rejects.jsonl`` and counted in the report.

Output: ``train.parquet`` / ``val.parquet`` in the layout of :mod:`envace.data.datasets` with
``reward_model = {"style": "checklist", "ground_truth": json(checklist_list)}``, the initial
messages (system prompt + first user message) as ``prompt`` and the full reference dialogue in
``extra_info.metadata.reference_messages``. The val split is a stable hash of the record id.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from envace.data.datasets import DEFAULT_AGENT_NAME, task_row, write_rows
from envace.envs.checklist_dialogue import POOL

__all__ = [
    "CM2_RECORD_SCHEMA",
    "CM2Error",
    "CM2ValidationError",
    "ConversionReport",
    "convert_cm2",
    "semantic_errors",
    "validate_record",
]


_STR = {"type": "string"}
_ITEM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["id", "question", "focus_on", "pass_condition", "weight"],
    "properties": {
        "id": {"type": "string", "minLength": 1},
        "question": {"type": "string", "minLength": 1},
        "focus_on": {"type": "string", "minLength": 1},
        "pass_condition": {"type": "string", "minLength": 1},
        "weight": {"type": "number", "minimum": 0},
        "failure_examples": {"type": "array", "items": _STR},
        "evidence": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["turn", "step", "from", "snippet"],
                "properties": {
                    "turn": {"type": "integer", "minimum": 0},
                    "step": {"type": "integer", "minimum": 0},
                    "from": _STR,
                    "snippet": _STR,
                },
            },
        },
        "required_for_next_turn": {"type": "boolean"},
        "dependence": {"anyOf": [{"type": "null"}, _STR, {"type": "array", "items": _STR}]},
    },
}
_TOOL_CALL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["function"],
    "properties": {
        "id": _STR,
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name", "arguments"],
            "properties": {"name": {"type": "string", "minLength": 1}, "arguments": {"type": ["string", "object"]}},
        },
    },
}
_TOOL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": "^[A-Za-z0-9_.:-]{1,128}$"},
                "description": _STR,
                "parameters": {"type": "object"},
            },
        },
    },
}
#: JSON Schema (Draft 2020-12) of one accepted CM2 record; see the module docstring for an example.
CM2_RECORD_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "envace CM2 checklist record",
    "type": "object",
    "required": ["messages", "tools", "checklist_list"],
    "properties": {
        "id": {"type": ["string", "integer"]},
        "data_source": {"type": "string", "minLength": 1},
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["role"],
                "properties": {
                    "role": {"enum": ["system", "user", "assistant", "tool"]},
                    "content": {"type": ["string", "null"]},
                    "tool_calls": {"type": "array", "items": _TOOL_CALL_SCHEMA},
                    "tool_call_id": _STR,
                    "name": _STR,
                },
                "allOf": [
                    {
                        "if": {"properties": {"role": {"enum": ["system", "user", "tool"]}}},
                        "then": {"required": ["content"], "properties": {"content": _STR}},
                    }
                ],
            },
        },
        "tools": {"type": ["array", "string"], "items": _TOOL_SCHEMA},
        "checklist_list": {
            "type": "array",
            "minItems": 1,
            "items": {"type": "array", "minItems": 1, "items": {"type": "array", "items": _ITEM_SCHEMA}},
        },
    },
}
_KNOWN_TOP_LEVEL = frozenset(CM2_RECORD_SCHEMA["properties"])
_VALIDATOR = Draft202012Validator(CM2_RECORD_SCHEMA)
_TOOLS_VALIDATOR = Draft202012Validator({"type": "array", "items": _TOOL_SCHEMA})


@dataclass(frozen=True)
class CM2Error:
    """One problem with one input record."""

    index: int  # 0-based record (line) index in the input file
    path: str  # JSON path inside the record, "$" for the record itself
    reason: str

    def __str__(self) -> str:
        return f"record {self.index} at {self.path}: {self.reason}"


class CM2ValidationError(ValueError):
    """Conversion refused: some records are invalid (``errors`` lists them all)."""

    def __init__(self, errors: list[CM2Error], shown: int = 20) -> None:
        self.errors = errors
        records = len({e.index for e in errors})
        lines = [str(e) for e in errors[:shown]]
        if len(errors) > shown:
            lines.append(f"... and {len(errors) - shown} more")
        super().__init__(
            f"{records} invalid CM2 record(s), {len(errors)} error(s) (pass skip_invalid / --skip-invalid to "
            "write them to rejects.jsonl and convert the rest):\n  " + "\n  ".join(lines)
        )


@dataclass
class ConversionReport:
    """What :func:`convert_cm2` did."""

    records: int = 0
    converted: int = 0
    rejected: int = 0
    train_rows: int = 0
    val_rows: int = 0
    train_path: Path | None = None
    val_path: Path | None = None
    rejects_path: Path | None = None
    errors: list[CM2Error] = field(default_factory=list)

    def summary(self) -> str:
        text = (
            f"{self.records} record(s): {self.converted} converted ({self.train_rows} train, {self.val_rows} val), "
            f"{self.rejected} rejected"
        )
        if self.rejects_path is not None:
            text += f" -> {self.rejects_path}"
        return text


def _json_path(parts: Any) -> str:
    out = "$"
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else f".{p}"
    return out


def _decoded_tools(record: Mapping[str, Any]) -> tuple[list[Any] | None, list[tuple[str, str]]]:
    tools = record.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as exc:
            return None, [("$.tools", f"tools is a string but not valid JSON: {exc.msg}")]
        errs = [
            (_json_path(["tools", *e.absolute_path]), e.message)
            for e in sorted(_TOOLS_VALIDATOR.iter_errors(tools), key=lambda e: list(map(str, e.absolute_path)))
        ]
        if errs:
            return None, errs
    return (tools if isinstance(tools, list) else None), []


def semantic_errors(record: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Cross-field problems of a schema-valid record, as (JSON path, reason) pairs."""
    errs: list[tuple[str, str]] = []
    messages = record["messages"]
    non_system = [(i, m) for i, m in enumerate(messages) if m["role"] != "system"]
    if not non_system or non_system[0][1]["role"] != "user":
        where = _json_path(["messages", non_system[0][0]]) if non_system else "$.messages"
        errs.append((where, "the first non-system message must be from the user"))
    n_turns = sum(1 for m in messages if m["role"] == "user")

    tools, tool_errs = _decoded_tools(record)
    errs.extend(tool_errs)
    names: set[str] = set()
    for i, tool in enumerate(tools or []):
        fn = tool["function"]
        if fn["name"] in names:
            errs.append((_json_path(["tools", i, "function", "name"]), f"duplicate tool name {fn['name']!r}"))
        names.add(fn["name"])
        if "parameters" in fn:
            try:
                Draft202012Validator.check_schema(fn["parameters"])
            except SchemaError as exc:
                path = _json_path(["tools", i, "function", "parameters", *exc.absolute_path])
                errs.append((path, f"parameters is not valid JSON Schema: {exc.message}"))

    call_ids: set[str] = set()
    for i, msg in enumerate(messages):
        for j, call in enumerate(msg.get("tool_calls") or []):
            if msg["role"] != "assistant":
                errs.append((_json_path(["messages", i, "tool_calls"]), "only assistant messages may have tool_calls"))
                break
            fn = call["function"]
            if tools is not None and fn["name"] not in names:
                errs.append(
                    (
                        _json_path(["messages", i, "tool_calls", j, "function", "name"]),
                        f"calls undeclared tool {fn['name']!r}",
                    )
                )
            args = fn["arguments"]
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError as exc:
                    errs.append(
                        (
                            _json_path(["messages", i, "tool_calls", j, "function", "arguments"]),
                            f"arguments are not valid JSON: {exc.msg}",
                        )
                    )
                    continue
            if not isinstance(args, dict):
                errs.append(
                    (
                        _json_path(["messages", i, "tool_calls", j, "function", "arguments"]),
                        f"arguments must be a JSON object, got {type(args).__name__}",
                    )
                )
            if "id" in call:
                call_ids.add(call["id"])
        if msg["role"] == "tool" and "tool_call_id" in msg and msg["tool_call_id"] not in call_ids:
            errs.append(
                (
                    _json_path(["messages", i, "tool_call_id"]),
                    f"tool_call_id {msg['tool_call_id']!r} answers no earlier assistant tool call",
                )
            )

    for c, checklist in enumerate(record["checklist_list"]):
        if len(checklist) != n_turns:
            errs.append(
                (
                    _json_path(["checklist_list", c]),
                    f"has {len(checklist)} turn(s) of items but the dialogue has {n_turns} user turn(s)",
                )
            )
        all_ids = {item["id"] for turn in checklist for item in turn}
        for t, turn in enumerate(checklist):
            seen: set[str] = set()
            for k, item in enumerate(turn):
                path = ["checklist_list", c, t, k]
                if item["id"] in seen:
                    errs.append((_json_path([*path, "id"]), f"duplicate item id {item['id']!r} in this turn"))
                seen.add(item["id"])
                dep = item.get("dependence")
                deps = [dep] if isinstance(dep, str) else list(dep or [])
                for d in deps:
                    if d not in all_ids:
                        errs.append((_json_path([*path, "dependence"]), f"depends on unknown item id {d!r}"))
                for e, ev in enumerate(item.get("evidence") or []):
                    if ev["turn"] >= n_turns:
                        errs.append(
                            (
                                _json_path([*path, "evidence", e, "turn"]),
                                f"turn {ev['turn']} is out of range ({n_turns} user turn(s))",
                            )
                        )
    return errs


def validate_record(record: Any, index: int) -> list[CM2Error]:
    """All problems of one decoded record (schema first; cross-field rules only on schema-valid records)."""
    schema_errors = sorted(_VALIDATOR.iter_errors(record), key=lambda e: [str(p) for p in e.absolute_path])
    if schema_errors:
        return [CM2Error(index, _json_path(e.absolute_path), e.message) for e in schema_errors]
    return [CM2Error(index, path, reason) for path, reason in semantic_errors(record)]


def _read_records(path: Path) -> Iterator[tuple[int, str, Any, CM2Error | None]]:
    """(index, raw line, decoded record or None, decode error) for every non-blank line."""
    with path.open(encoding="utf-8") as f:
        index = 0
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield index, line, json.loads(line), None
            except json.JSONDecodeError as exc:
                yield index, line, None, CM2Error(index, "$", f"line {lineno} is not valid JSON: {exc.msg}")
            index += 1


def _split_of(record_id: str, val_fraction: float, seed: int | str) -> str:
    h = int.from_bytes(hashlib.sha256(f"{seed}:cm2:{record_id}".encode()).digest()[:8], "big") / 2**64
    return "test" if h < val_fraction else "train"


def _row(record: Mapping[str, Any], record_id: str, split: str, agent_name: str) -> dict[str, Any]:
    messages = record["messages"]
    first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
    prompt = [{"role": m["role"], "content": m["content"]} for m in messages[: first_user + 1]]
    tools, _ = _decoded_tools(record)
    tool_names = sorted(t["function"]["name"] for t in tools or [])
    category = record.get("data_source", POOL)
    extras = {k: v for k, v in record.items() if k not in _KNOWN_TOP_LEVEL}
    return task_row(
        pool=POOL,
        task_id=record_id,
        env_id="cm2:" + hashlib.sha256("\n".join(tool_names).encode()).hexdigest()[:12],
        category=category,
        split=split,
        prompt=prompt,
        tools=tools or [],
        agent_name=agent_name,
        ground_truth=record["checklist_list"],
        reward_style="checklist",
        metadata={
            "reference_messages": messages,
            "num_user_turns": sum(1 for m in messages if m["role"] == "user"),
            "num_checklists": len(record["checklist_list"]),
            "tool_names": tool_names,
            "extra_fields": extras,
        },
    )


def convert_cm2(
    in_path: str | Path,
    out_dir: str | Path,
    *,
    agent_name: str = DEFAULT_AGENT_NAME,
    val_fraction: float = 0.1,
    seed: int | str = 0,
    skip_invalid: bool = False,
) -> ConversionReport:
    """Validate every record of ``in_path`` (JSONL) and write ``train.parquet`` / ``val.parquet``.

    Raises :class:`CM2ValidationError` (listing every error) if any record is invalid and
    ``skip_invalid`` is false; nothing is written then. With ``skip_invalid`` the invalid records go to
    ``out_dir/rejects.jsonl`` as ``{"index", "errors": [{"path", "reason"}], "line"}``.
    """
    if not 0.0 <= val_fraction <= 1.0:
        raise ValueError(f"val_fraction must be in [0, 1], got {val_fraction}")
    in_path, out = Path(in_path), Path(out_dir)
    if not in_path.is_file():
        raise FileNotFoundError(f"CM2 input {in_path} does not exist")
    report = ConversionReport()
    rows: dict[str, list[dict[str, Any]]] = {"train": [], "test": []}
    rejects: list[dict[str, Any]] = []
    seen_ids: dict[str, int] = {}
    try:
        records = list(_read_records(in_path))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{in_path} is not UTF-8 text: {exc}") from None
    for index, line, record, decode_error in records:
        report.records += 1
        errors = [decode_error] if decode_error else validate_record(record, index)
        record_id = None
        if not errors:
            record_id = str(record.get("id", index))
            if record_id in seen_ids:
                errors = [
                    CM2Error(index, "$.id", f"duplicate id {record_id!r} (first used by record {seen_ids[record_id]})")
                ]
        if errors:
            report.errors.extend(errors)
            report.rejected += 1
            rejects.append(
                {
                    "index": index,
                    "errors": [{"path": e.path, "reason": e.reason} for e in errors],
                    "line": line.rstrip("\n"),
                }
            )
            continue
        assert record_id is not None
        seen_ids[record_id] = index
        split = _split_of(record_id, val_fraction, seed)
        rows[split].append(_row(record, record_id, split, agent_name))
        report.converted += 1
    if report.errors and not skip_invalid:
        raise CM2ValidationError(report.errors)
    if rejects:
        out.mkdir(parents=True, exist_ok=True)
        report.rejects_path = out / "rejects.jsonl"
        with report.rejects_path.open("w", encoding="utf-8") as f:
            for rej in rejects:
                f.write(json.dumps(rej, ensure_ascii=False) + "\n")
    if report.converted == 0:
        if report.errors:
            raise CM2ValidationError(report.errors)
        raise ValueError(f"{in_path} holds no records")
    report.train_path = write_rows(rows["train"], out / "train.parquet")
    report.val_path = write_rows(rows["test"], out / "val.parquet")
    report.train_rows, report.val_rows = len(rows["train"]), len(rows["test"])
    return report
