"""Qwen3 / Hermes tool-call parsing: examples, template agreement, and hypothesis properties."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envace.envs.base import ToolCall
from envace.toolcall import ParseResult, parse_tool_calls, render_assistant_text, render_tool_call

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TAGS = ("<tool_call>", "</tool_call>", "<think>", "</think>")


def test_single_call_with_content():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    r = parse_tool_calls(text)
    assert r == ParseResult(content="Let me check.", calls=[ToolCall("get_weather", {"city": "Paris"})], errors=[])
    assert r.ok and r.reasoning is None


def test_no_calls():
    r = parse_tool_calls("  Just an answer.\n")
    assert r.content == "Just an answer." and r.calls == [] and r.errors == []


def test_multiple_calls_string_arguments_and_reasoning():
    text = (
        "<think>\nTwo cities.\n</think>\n\n"
        '<tool_call>\n{"name": "w", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "w", "arguments": "{\\"city\\": \\"Tōkyō\\"}"}\n</tool_call>'
        "<|im_end|>"
    )
    r = parse_tool_calls(text)
    assert r.reasoning == "Two cities."
    assert r.calls == [ToolCall("w", {"city": "Paris"}), ToolCall("w", {"city": "Tōkyō"})]
    assert r.content == "<|im_end|>" and r.errors == []


def test_thinking_mode_output_without_opening_tag():
    # the generation prompt ended with "<think>\n", so the output starts inside the reasoning
    r = parse_tool_calls('plan it\n</think>\n\nok\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>')
    assert r.reasoning == "plan it" and r.content == "ok" and r.calls == [ToolCall("f", {})]


def test_calls_inside_reasoning_are_not_executed():
    r = parse_tool_calls('<think>\nmaybe <tool_call>{"name": "f", "arguments": {}}</tool_call>?\n</think>\n\ndone')
    assert r.calls == [] and r.content == "done" and "<tool_call>" in r.reasoning


def test_unterminated_think():
    r = parse_tool_calls("<think>\nstill thinking")
    assert r.reasoning == "still thinking" and r.content == "" and r.calls == []
    assert len(r.errors) == 1 and "unterminated <think>" in r.errors[0]


def test_tags_inside_json_strings():
    args = {"code": "print('</tool_call>')", "note": "<tool_call> </think> <think>"}
    text = render_tool_call(ToolCall("run", args))
    assert parse_tool_calls(text) == ParseResult(content="", calls=[ToolCall("run", args)], errors=[])


@pytest.mark.parametrize(
    "body,needle",
    [
        ("{bad json}", "invalid JSON"),
        ('{"arguments": {}}', "missing or non-string 'name'"),
        ('{"name": 3, "arguments": {}}', "missing or non-string 'name'"),
        ('{"name": "", "arguments": {}}', "missing or non-string 'name'"),
        ('["f", {}]', "must be a JSON object"),
        ('{"name": "f", "arguments": [1]}', "must be a JSON object"),
        ('{"name": "f", "arguments": "{not json"}', "not valid JSON"),
        ('{"name": "f", "arguments": {}} trailing', "invalid JSON"),
        ("", "invalid JSON"),
    ],
)
def test_malformed_blocks_give_errors(body, needle):
    text = f'before <tool_call>\n{body}\n</tool_call> middle <tool_call>{{"name": "ok", "arguments": {{}}}}</tool_call> after'
    r = parse_tool_calls(text)
    assert r.calls == [ToolCall("ok", {})]
    assert len(r.errors) == 1 and needle in r.errors[0] and r.errors[0].startswith("tool call 1")
    assert r.content == "before\nmiddle\nafter"


def test_unterminated_block():
    r = parse_tool_calls('x <tool_call>\n{"name": "f", "arguments": {}}')
    assert r.calls == [] and r.content == "x"
    assert len(r.errors) == 1 and "unterminated <tool_call>" in r.errors[0]


def test_unterminated_block_followed_by_good_block():
    r = parse_tool_calls('<tool_call>{"name": "f", <tool_call>{"name": "g", "arguments": {"a": 1}}</tool_call>')
    assert r.calls == [ToolCall("g", {"a": 1})]
    assert len(r.errors) == 1 and "tool call 1: unterminated" in r.errors[0]


def test_stray_closing_tag():
    r = parse_tool_calls("a </tool_call> b")
    assert r.calls == [] and r.content == "a\nb" and "stray </tool_call>" in r.errors[0]


def test_missing_arguments_default_to_empty_and_id_kept():
    r = parse_tool_calls(
        '<tool_call>{"name": "f"}</tool_call><tool_call>{"name": "g", "arguments": null, "id": "c7"}</tool_call>'
    )
    assert r.calls == [ToolCall("f", {}), ToolCall("g", {}, id="c7")] and r.ok


def test_none_and_non_text_never_raise():
    assert parse_tool_calls(None) == ParseResult(content="")
    assert parse_tool_calls(b"bytes").errors  # type: ignore[arg-type]


def test_render_tool_call_format():
    assert render_tool_call(ToolCall("get_weather", {"city": "Tōkyō", "n": [1, 2.5, None, True]})) == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tōkyō", "n": [1, 2.5, null, true]}}\n</tool_call>'
    )
    # OpenAI-style dicts and string arguments (inserted verbatim, like the template)
    assert render_tool_call({"type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}) == (
        '<tool_call>\n{"name": "f", "arguments": {"a":1}}\n</tool_call>'
    )


def test_parse_result_to_message_renders_back_through_template():
    from envace.models import render_chat

    text = (
        "<think>\nr\n</think>\n\nSure.\n"
        '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
    )
    msg = parse_tool_calls(text).to_message()
    prompt = [{"role": "user", "content": "q"}]
    rendered = render_chat(prompt + [msg])
    assert rendered == render_chat(prompt) + "<|im_start|>assistant\n" + text + "<|im_end|>\n"


# ---------------------------------------------------------------------------------------------- properties

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
json_objects = st.dictionaries(st.text(max_size=10), json_values, max_size=5)
names = st.text(min_size=1, max_size=20)
identifier_names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.\-]{0,30}", fullmatch=True)
plain_text = st.text(max_size=40).filter(lambda s: not any(t in s for t in TAGS)).map(str.strip)


@settings(max_examples=200, deadline=None)
@given(calls=st.lists(st.tuples(names, json_objects), max_size=4), content=plain_text)
def test_round_trip_render_parse(calls, content):
    tool_calls = [ToolCall(n, a) for n, a in calls]
    text = render_assistant_text(content, tool_calls)
    r = parse_tool_calls(text)
    assert r.errors == []
    assert r.calls == tool_calls
    # content round-trips up to whitespace at its ends (the template inserts "\n" before the calls)
    assert r.content == content
    # JSON equality (floats etc.) is exact because json.dumps/json.loads round-trip
    assert [json.dumps(c.arguments, sort_keys=True) for c in r.calls] == [
        json.dumps(a, sort_keys=True) for _, a in calls
    ]


@settings(max_examples=100, deadline=None)
@given(
    calls=st.lists(st.tuples(identifier_names, json_objects), min_size=1, max_size=3),
    content=plain_text,
    reasoning=st.none() | plain_text,
)
def test_render_matches_chat_template(calls, content, reasoning):
    from envace.models import render_chat

    tool_calls = [ToolCall(n, a) for n, a in calls]
    msg = {
        "role": "assistant",
        "content": content,
        "tool_calls": [{"type": "function", "function": c.to_dict()} for c in tool_calls],
    }
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    prompt = [{"role": "user", "content": "q"}]
    rendered = render_chat(prompt + [msg])
    body = rendered[len(render_chat(prompt)) + len("<|im_start|>assistant\n") : -len("<|im_end|>\n")]
    # the final assistant turn always carries a think block in Qwen3's template
    assert body == render_assistant_text(content, tool_calls, reasoning or "")
    r = parse_tool_calls(body)
    assert r.calls == tool_calls and r.errors == [] and r.reasoning == (reasoning or "").strip("\n")


tagged_text = st.lists(
    st.sampled_from(TAGS + ("{", "}", '"', '{"name": "f", "arguments": {}}', "\n", "\\", "[", "null", ":", ","))
    | st.text(max_size=6),
    max_size=25,
).map("".join)


@settings(max_examples=400, deadline=None)
@given(text=st.text(max_size=200) | tagged_text)
def test_arbitrary_text_never_raises(text):
    r = parse_tool_calls(text)
    assert isinstance(r.content, str) and isinstance(r.errors, list)
    assert all(isinstance(c, ToolCall) and isinstance(c.arguments, dict) for c in r.calls)
    assert all(isinstance(e, str) and e for e in r.errors)
    # every opened block is accounted for: a call or an error
    if r.reasoning is None:
        assert len(r.calls) + sum(e.startswith("tool call") for e in r.errors) == text.count("<tool_call>")


@settings(max_examples=200, deadline=None)
@given(
    good=st.lists(st.tuples(identifier_names, json_objects), max_size=3),
    junk=st.text(max_size=30).filter(lambda s: "<tool_call>" not in s and "</tool_call>" not in s),
)
def test_malformed_block_is_an_error_not_an_exception(good, junk):
    body = junk if not junk.strip().startswith("{") else junk + "}}}"
    try:
        obj = json.loads(body)
        valid = isinstance(obj, dict) and isinstance(obj.get("name"), str) and obj["name"]
    except Exception:  # noqa: BLE001
        valid = False
    if valid:
        return
    text = f"<tool_call>{body}</tool_call>\n" + "\n".join(render_tool_call(ToolCall(n, a)) for n, a in good)
    r = parse_tool_calls(text)
    assert r.calls == [ToolCall(n, a) for n, a in good]
    assert len(r.errors) == 1 and r.errors[0].startswith("tool call 1")
