"""CM2 checklist converter: schema, cross-field rules, error reporting, rejects, parquet layout."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from jsonschema import Draft202012Validator

from envace.data.cm2 import CM2_RECORD_SCHEMA, CM2ValidationError, convert_cm2, validate_record
from envace.data.datasets import ROW_SCHEMA


def _record(rid: Any = "r0") -> dict[str, Any]:
    item = lambda i, **kw: {
        "id": i,
        "question": f"q {i}?",
        "focus_on": "assistant.tool_calls",
        "pass_condition": "ok",
        "weight": 1.0,
        **kw,
    }
    return {
        "id": rid,
        "data_source": "cm2-demo",
        "messages": [
            {"role": "system", "content": "You are a shop assistant."},
            {"role": "user", "content": "Where is order 3?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_order", "arguments": '{"order_id": 3}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": '{"status": "shipped"}'},
            {"role": "assistant", "content": "It has shipped."},
            {"role": "user", "content": "Thanks, cancel it then."},
            {"role": "assistant", "content": "Shipped orders cannot be cancelled."},
        ],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "get_order",
                    "description": "Look an order up.",
                    "parameters": {
                        "type": "object",
                        "properties": {"order_id": {"type": "integer"}},
                        "required": ["order_id"],
                    },
                },
            }
        ],
        "checklist_list": [
            [
                [item("t0_a", evidence=[{"turn": 0, "step": 1, "from": "assistant", "snippet": "get_order"}])],
                [
                    item(
                        "t1_a",
                        dependence="t0_a",
                        required_for_next_turn=True,
                        failure_examples=["cancelled anyway"],
                        extra_field="kept",
                    )
                ],
            ]
        ],
        "annotator": "someone",
    }


def _write(path: Path, records: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_schema_is_valid_draft_2020_12():
    Draft202012Validator.check_schema(CM2_RECORD_SCHEMA)
    assert validate_record(_record(), 0) == []


def test_conversion_layout(tmp_path):
    records = [_record(f"r{i}") for i in range(20)]
    report = convert_cm2(_write(tmp_path / "in.jsonl", records), tmp_path / "out", val_fraction=0.3, agent_name="ag")
    assert report.records == report.converted == 20 and report.rejected == 0 and report.rejects_path is None
    assert report.train_rows + report.val_rows == 20 and report.train_rows and report.val_rows
    train = pq.read_table(report.train_path)
    val = pq.read_table(report.val_path)
    assert train.schema.equals(ROW_SCHEMA) and val.schema.equals(ROW_SCHEMA)
    tr, va = train.to_pylist(), val.to_pylist()
    assert not {r["extra_info"]["task_id"] for r in tr} & {r["extra_info"]["task_id"] for r in va}
    row = tr[0]
    assert row["prompt"] == records[0]["messages"][:2]
    assert row["reward_model"]["style"] == "checklist"
    assert json.loads(row["reward_model"]["ground_truth"]) == records[0]["checklist_list"]
    assert json.loads(row["tools"]) == records[0]["tools"]
    assert row["data_source"] == "cm2/cm2-demo" and row["agent_name"] == "ag"
    meta = json.loads(row["extra_info"]["metadata"])
    assert meta["reference_messages"] == records[0]["messages"]
    assert meta["extra_fields"] == {"annotator": "someone"} and meta["num_user_turns"] == 2
    # deterministic split
    again = convert_cm2(tmp_path / "in.jsonl", tmp_path / "out2", val_fraction=0.3)
    assert again.val_rows == report.val_rows


def _bad(mutate) -> dict[str, Any]:
    rec = _record()
    mutate(rec)
    return rec


@pytest.mark.parametrize(
    "record, path, reason",
    [
        (_bad(lambda r: r.pop("tools")), "$", "'tools' is a required property"),
        (
            _bad(lambda r: r["checklist_list"][0][1][0].__setitem__("weight", -1)),
            "$.checklist_list[0][1][0].weight",
            "less than the minimum of 0",
        ),
        (
            _bad(lambda r: r["checklist_list"][0][0][0].pop("pass_condition")),
            "$.checklist_list[0][0][0]",
            "'pass_condition' is a required property",
        ),
        (_bad(lambda r: r["messages"][1].__setitem__("role", "human")), "$.messages[1].role", "is not one of"),
        (
            _bad(lambda r: r["checklist_list"][0].pop()),
            "$.checklist_list[0]",
            "has 1 turn(s) of items but the dialogue has 2 user turn(s)",
        ),
        (
            _bad(lambda r: r["messages"][2]["tool_calls"][0]["function"].__setitem__("name", "drop_db")),
            "$.messages[2].tool_calls[0].function.name",
            "undeclared tool 'drop_db'",
        ),
        (
            _bad(lambda r: r["messages"][2]["tool_calls"][0]["function"].__setitem__("arguments", "{oops")),
            "$.messages[2].tool_calls[0].function.arguments",
            "not valid JSON",
        ),
        (
            _bad(lambda r: r["messages"][3].__setitem__("tool_call_id", "c9")),
            "$.messages[3].tool_call_id",
            "answers no earlier assistant tool call",
        ),
        (
            _bad(lambda r: r["checklist_list"][0][1][0].__setitem__("dependence", ["nope"])),
            "$.checklist_list[0][1][0].dependence",
            "unknown item id 'nope'",
        ),
        (
            _bad(lambda r: r["checklist_list"][0][0][0]["evidence"][0].__setitem__("turn", 5)),
            "$.checklist_list[0][0][0].evidence[0].turn",
            "out of range",
        ),
        (
            _bad(lambda r: r["checklist_list"][0][0].append(copy.deepcopy(r["checklist_list"][0][0][0]))),
            "$.checklist_list[0][0][1].id",
            "duplicate item id 't0_a'",
        ),
        (
            _bad(lambda r: r["tools"][0]["function"]["parameters"].__setitem__("type", "dict")),
            "$.tools[0].function.parameters.type",
            "not valid JSON Schema",
        ),
        (
            _bad(lambda r: r.__setitem__("messages", [{"role": "assistant", "content": "hi"}])),
            "$.messages[0]",
            "first non-system message must be from the user",
        ),
        (_bad(lambda r: r.__setitem__("tools", "[not json")), "$.tools", "not valid JSON"),
    ],
)
def test_invalid_records_report_index_path_reason(tmp_path, record, path, reason):
    src = _write(tmp_path / "in.jsonl", [_record("ok0"), record])
    with pytest.raises(CM2ValidationError) as info:
        convert_cm2(src, tmp_path / "out")
    errors = info.value.errors
    assert any(e.index == 1 and e.path == path and reason in e.reason for e in errors), errors
    assert all(e.index == 1 for e in errors)
    assert f"record 1 at {path}" in str(info.value)
    assert not (tmp_path / "out").exists()  # nothing written on failure


def test_skip_invalid_writes_rejects_and_keeps_the_rest(tmp_path):
    src = _write(
        tmp_path / "in.jsonl",
        [_record("a"), "{broken json", _bad(lambda r: r.pop("messages")), _record("b"), _record("a")],
    )
    report = convert_cm2(src, tmp_path / "out", skip_invalid=True, val_fraction=0.0)
    assert (report.records, report.converted, report.rejected) == (5, 2, 3)
    assert report.train_rows == 2 and report.val_rows == 0
    rejects = [json.loads(line) for line in report.rejects_path.read_text().splitlines()]
    assert [r["index"] for r in rejects] == [1, 2, 4]
    assert "line 2 is not valid JSON" in rejects[0]["errors"][0]["reason"]
    assert rejects[1]["errors"][0] == {"path": "$", "reason": "'messages' is a required property"}
    assert "duplicate id 'a'" in rejects[2]["errors"][0]["reason"]
    assert rejects[0]["line"] == "{broken json"
    assert "3 rejected" in report.summary()


def test_all_invalid_fails_even_with_skip(tmp_path):
    src = _write(tmp_path / "in.jsonl", ["[1, 2]"])
    with pytest.raises(CM2ValidationError, match=r"record 0 at \$: \[1, 2\] is not of type 'object'"):
        convert_cm2(src, tmp_path / "out", skip_invalid=True)
    assert (tmp_path / "out" / "rejects.jsonl").exists()
