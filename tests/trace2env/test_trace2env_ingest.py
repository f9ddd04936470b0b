"""Ingestion: three formats, content-hash ids, splits, alignment flags, observations kept verbatim."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

sys.path.insert(0, str(Path(__file__).parent))
from t2e_kvenv import record

from trace2env.ingest import TraceFormatError, align, dedupe, load_traces, make_split_manifest, parse_trace


def test_three_formats_give_the_same_transitions_and_the_same_id():
    traces = [parse_trace(record(3, fmt=f)) for f in ("events", "messages", "steps")]
    seqs = [[(t.action.name, t.action.arguments, t.observation) for t in align(tr)] for tr in traces]
    assert seqs[0] == seqs[2] and len(seqs[0]) == 25
    assert seqs[1] == seqs[0]  # chat with tool calls: same pairs, correlated by call id
    assert all(t.alignment == "correlated" for t in align(traces[1]))
    assert all(t.alignment == "sequential" and not t.ambiguities for t in align(traces[2]))
    # events and steps differ only by the user message, so their hashes differ; identical input, identical id
    assert parse_trace(record(3)).trace_id == traces[0].trace_id
    assert traces[0].trace_id.startswith("src_") and traces[0].trace_id != parse_trace(record(4)).trace_id


def test_observation_text_is_never_rewritten():
    odd = '{"b":1,  "a": "é\\u00e9"}  '  # odd spacing, key order, escapes: kept byte for byte
    tr = parse_trace({"steps": [{"action": {"name": "f", "arguments": {}}, "observation": odd},
                                {"action": {"name": "g", "arguments": {}}, "observation": {"z": 1, "a": [1]}}]})
    t0, t1 = align(tr)
    assert t0.observation == odd
    assert t1.observation == '{"z":1,"a":[1]}' and t1.observation_content == {"z": 1, "a": [1]}
    with pytest.raises(ValidationError):
        t0.observation = "x"  # frozen


def test_alignment_by_call_id_out_of_order_and_ambiguity_flags():
    msgs = [{"role": "assistant", "tool_calls": [
        {"id": "1", "function": {"name": "f", "arguments": "{\"x\": 1}"}},
        {"id": "2", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "2", "content": "G"},
        {"role": "tool", "tool_call_id": "1", "content": "F"}]
    f, g = align(parse_trace({"messages": msgs}))
    assert (f.observation, g.observation) == ("F", "G") and f.alignment == g.alignment == "correlated"

    ev = {"events": [
        {"kind": "action", "content": {"type": "f", "arguments": {}}},
        {"kind": "action", "content": {"type": "g", "arguments": {}}},
        {"kind": "observation", "content": "?"},
        {"kind": "action", "content": {"type": "h", "arguments": {}}},
    ]}
    a, b, c = align(parse_trace(ev))
    assert a.alignment == "ambiguous" and "concurrent_pending_actions" in a.ambiguities
    assert "concurrent_pending_actions" in b.ambiguities and b.observation is None
    assert c.observation is None and "no_observation" in c.ambiguities

    dup = {"events": [
        {"kind": "action", "call_id": "k", "content": {"name": "f", "arguments": {}}},
        {"kind": "action", "call_id": "k", "content": {"name": "f", "arguments": {}}},
        {"kind": "observation", "call_id": "k", "content": "1"},
        {"kind": "observation", "call_id": "k", "content": "2"}]}
    assert all("duplicate_call_id" in t.ambiguities and t.alignment == "ambiguous" for t in align(parse_trace(dup)))


def test_bad_traces_are_refused_with_a_reason(tmp_path):
    with pytest.raises(TraceFormatError, match="unknown trace format"):
        parse_trace({"foo": []})
    with pytest.raises(TraceFormatError, match="not JSON"):
        parse_trace({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]})
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps(record(1)) + "\n" + json.dumps(record(1)) + "\n" + json.dumps({"bad": 1}) + "\n")
    with pytest.raises(TraceFormatError, match="t.jsonl:3: unknown trace format"):  # the file's line number
        load_traces([p])


def test_load_dedupes_and_split_is_deterministic_and_group_preserving(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(json.dumps(record(s)) for s in [1, 1, 2, 3]) + "\n")
    assert len(load_traces([p])) == 3
    traces = [parse_trace(record(s)) for s in range(40)]
    # two traces share a trajectory group: they must land in the same split
    twin = parse_trace({**record(100), "metadata": {"trajectory_group": "g7"}})
    m1 = make_split_manifest([*traces, twin], train=0.5)
    m2 = make_split_manifest(list(reversed([*traces, twin])), train=0.5)
    assert m1 == m2
    assert m1.assignments[twin.trace_id].split == m1.assignments[traces[7].trace_id].split
    n_train = len(m1.ids("train"))
    assert 5 < n_train < 36 and n_train + len(m1.ids("test")) == 41
    assert dedupe([traces[0], traces[0]]) == [traces[0]]
