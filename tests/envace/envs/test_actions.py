"""The action-sequence format ``verify`` reads (envace/envs/actions.py): any JSON value parses or fails naming the
spot, a tool call round-trips through its dict form, an actions file's mistakes name the file."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envace.envs.actions import ActionsFormatError, load_actions, parse_actions
from envace.envs.base import ToolCall, ToolCallError

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=10,
)
_call = st.fixed_dictionaries(
    {"name": st.text(min_size=1, max_size=10), "arguments": st.dictionaries(st.text(max_size=5), _json, max_size=3)}
)
_call_like = st.one_of(
    _call,
    _call.map(lambda c: {"function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}, "id": "x"}),
    st.dictionaries(st.sampled_from(["name", "arguments", "function", "id"]), _json, max_size=4),
)


@settings(max_examples=300, deadline=None)
@given(obj=_json | st.lists(_call_like, max_size=3) | st.lists(st.lists(_call_like, max_size=3), max_size=3))
def test_parse_actions_total(obj):
    """Any JSON value either parses into turns of ToolCalls or raises ActionsFormatError — nothing else."""
    try:
        turns = parse_actions(obj)
    except ActionsFormatError as exc:
        assert str(exc)
        return
    assert isinstance(turns, list)
    for turn in turns:
        for call in turn:
            assert isinstance(call, ToolCall) and isinstance(call.name, str) and call.name
            assert isinstance(call.arguments, dict)


@settings(max_examples=300, deadline=None)
@given(obj=_json | _call_like)
def test_tool_call_from_dict_total(obj):
    try:
        call = ToolCall.from_dict(obj)
    except ToolCallError as exc:
        assert str(exc)
        return
    assert isinstance(call.name, str) and call.name and isinstance(call.arguments, dict)
    assert ToolCall.from_dict(call.to_dict()) == ToolCall(call.name, call.arguments)


@settings(max_examples=100, deadline=None)
@given(turns=st.lists(st.lists(_call, max_size=3), max_size=4))
def test_parse_actions_round_trip(turns):
    expected = [[ToolCall(c["name"], c["arguments"]) for c in turn] for turn in turns]
    assert parse_actions(turns) == expected  # [[], []] is two empty turns
    if len(turns) == 1 and turns[0]:
        assert parse_actions(turns[0]) == expected  # flat list = one turn


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "not valid JSON"),
        ('{"name": "cd"}', "must be a JSON list"),
        ('[{"name": "cd"}, [{"name": "ls"}]]', "got a mix of"),
        ('[[{"name": "cd"}], [{"arguments": {}}]]', "turn 1, call 0: tool call has no string 'name'"),
        ('[[{"name": "cd"}], ["ls()"]]', "turn 1, call 0: a call must be an object"),
        ('[{"name": "cd", "arguments": "{bad"}]', "call 0: arguments of 'cd' are not valid JSON"),
        ('[{"name": "cd", "arguments": [1]}]', "call 0: arguments of 'cd' must be a JSON object"),
    ],
)
def test_load_actions_errors_name_the_problem(tmp_path, text, message):
    path = tmp_path / "actions.json"
    path.write_text(text)
    with pytest.raises(ActionsFormatError, match=str(path).replace(".", r"\.")) as info:
        load_actions(path)
    assert message in str(info.value)


def test_load_actions_missing_file(tmp_path):
    with pytest.raises(ActionsFormatError, match="cannot read actions file"):
        load_actions(tmp_path / "absent.json")
