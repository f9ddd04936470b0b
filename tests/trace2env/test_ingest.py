"""Ingestion: three formats, content-hash ids, splits, alignment flags, observations kept verbatim."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from t2e_kvenv import record

from trace2env.__main__ import main
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


def _chat(seed: int = 2) -> dict:
    return record(seed, fmt="messages")


def _with_message(raw: dict, i: int, **changes) -> dict:
    msgs = list(raw["messages"])
    msgs[i] = {**msgs[i], **changes}
    return {**raw, "messages": msgs}


# issue 43 finding 7: misshapen chat records, each refused with the path of the offending value and what is wrong
MISSHAPEN = [
    (lambda r: {**r, "messages": {"0": r["messages"][0]}}, "messages: expected an array, got an object"),
    (lambda r: {**r, "messages": [r["messages"][0], "hello", *r["messages"][1:]]},
     "messages[1]: expected an object, got a string"),
    (lambda r: _with_message(r, 1, tool_calls=r["messages"][1]["tool_calls"][0]),
     "messages[1].tool_calls: expected an array or null, got an object"),
    (lambda r: _with_message(r, 1, tool_calls=[{**r["messages"][1]["tool_calls"][0], "function": None}]),
     "messages[1].tool_calls[0].function: expected an object, got null"),
    (lambda r: {**r, "metadata": "g1"}, "metadata: expected an object or null, got a string"),
    (lambda r: _with_message(r, 2, role="developer"), 'messages[2].role: expected one of "assistant", "tool"'),
    (lambda r: _with_message(r, 1, tool_calls=[{"id": 7, "function": {"name": "get"}}]),
     "messages[1].tool_calls[0].id: expected a string or null, got a number"),
    (lambda r: {"events": [{"kind": "action", "content": "put"}]}, "events[0].content: expected an object"),
    (lambda r: {"steps": [{"action": "[1]"}]}, "steps[0].action: the JSON text of an array, not an object"),
]


@pytest.mark.parametrize(("mangle", "reason"), MISSHAPEN)
def test_a_misshapen_record_is_refused_with_the_path_of_the_problem(tmp_path, capsys, mangle, reason):
    with pytest.raises(TraceFormatError) as exc:
        parse_trace(mangle(_chat()))
    assert str(exc.value).startswith(reason)
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps(_chat(1)) + "\n\n" + json.dumps(mangle(_chat())) + "\n")
    with pytest.raises(TraceFormatError) as exc:
        load_traces([p])
    assert str(exc.value).startswith(f"{p}:3: {reason}")  # the file's line, blank lines counted
    assert main(["build", str(p), "--out", str(tmp_path / "book")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"python -m trace2env: error: {p}:3: {reason}") and len(err.splitlines()) == 1
    assert not (tmp_path / "book").exists()


_KEYS = ["events", "messages", "steps", "pairs", "metadata", "episode_id", "role", "content", "tool_calls", "id",
         "type", "function", "name", "arguments", "tool_call_id", "call_id", "kind", "actor", "action", "observation"]


_SCALARS = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4)
            | st.sampled_from(["assistant", "tool", "user", "action", "observation", "message", "agent", "f", "{}"]))


_JSON = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.sampled_from(_KEYS), inner, max_size=5), max_leaves=30)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from(_KEYS[:6]), _JSON, min_size=1) | _JSON)
def test_any_record_parses_or_is_refused_as_a_trace_format_error(raw):
    """Whatever the shape, the parser answers with a trace or a TraceFormatError (one line), never another error."""
    try:
        parse_trace(raw)
    except TraceFormatError as e:
        assert str(e) and "\n" not in str(e)
