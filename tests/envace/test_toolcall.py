"""Qwen3 / Hermes tool-call parsing: examples, template agreement, and hypothesis properties."""

from __future__ import annotations

import json
import os
import signal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envace.envs.base import ToolCall
from envace.toolcall import ParseResult, parse_tool_calls, render_assistant_text, render_tool_call

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TAGS = ("<tool_call>", "</tool_call>", "<think>", "</think>")

# CPU seconds any test here may use: the slowest property test needs under 10 (more under coverage tracing);
# a parser that never stops (a position that does not advance) fails the test instead of hanging the suite.
CPU_LIMIT_S = 120.0


class ParserHang(BaseException):
    """Not an ``Exception``: neither the parser's own ``except Exception`` nor hypothesis may swallow it."""


@pytest.fixture(autouse=True)
def _parser_terminates():
    def hang(signum, frame):
        raise ParserHang(f"test used more than {CPU_LIMIT_S:.0f} s of CPU: the parser does not terminate")

    old = signal.signal(signal.SIGPROF, hang)
    signal.setitimer(signal.ITIMER_PROF, CPU_LIMIT_S, 1.0)  # then again every second until the test ends
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, old)


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


# ------------------------------------------------------------------------ exact messages and renderings


def test_to_message_exact_dict():
    text = (
        "<think>\nr\n</think>\n\nSure.\n"
        '<tool_call>\n{"name": "f", "arguments": {"x": 1}, "id": "c1"}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
    )
    assert parse_tool_calls(text).to_message() == {
        "role": "assistant",
        "content": "Sure.",
        "reasoning_content": "r",
        "tool_calls": [
            {"type": "function", "id": "c1", "function": {"name": "f", "arguments": {"x": 1}}},
            {"type": "function", "function": {"name": "g", "arguments": {}}},  # no id: no "id" key
        ],
    }
    # no reasoning, no calls: neither key
    assert parse_tool_calls("hi").to_message() == {"role": "assistant", "content": "hi"}


@pytest.mark.parametrize(
    "body,message",
    [
        # json.loads("\n{bad json}\n") fails at char 2 (after the newline and "{") with this stdlib message
        (
            "{bad json}",
            "tool call 1: invalid JSON (Expecting property name enclosed in double quotes at char 2): '{bad json}'",
        ),
        ('{"arguments": {}}', "tool call 1: missing or non-string 'name' (keys: ['arguments'])"),
        ('{"name": 3, "z": 1, "a": 2}', "tool call 1: missing or non-string 'name' (keys: ['a', 'name', 'z'])"),
        ('["f", {}]', "tool call 1: body must be a JSON object, got list"),
        ('{"name": "f", "arguments": [1]}', "tool call 1 ('f'): arguments of 'f' must be a JSON object, got list"),
    ],
)
def test_error_messages_exact(body, message):
    r = parse_tool_calls(f"<tool_call>\n{body}\n</tool_call>")
    assert r.errors == [message] and r.calls == [] and r.content == ""


def test_error_messages_exact_structure():
    assert parse_tool_calls("a </tool_call> b").errors == ["stray </tool_call> without an opening <tool_call>"]
    assert parse_tool_calls('x <tool_call>\n {"name": "f"} ').errors == [
        'tool call 1: unterminated <tool_call> block (no </tool_call>): \'{"name": "f"}\''
    ]
    assert parse_tool_calls("<think>\nhm").errors == [
        "unterminated <think> block: reasoning has no </think> (truncated output?)"
    ]
    # the block number counts every opened block, good or bad
    ok = '<tool_call>{"name": "f"}</tool_call>'
    assert parse_tool_calls(ok + ok + "<tool_call>[1]</tool_call>").errors == [
        "tool call 3: body must be a JSON object, got list"
    ]
    assert parse_tool_calls(3).errors == ["expected text, got int"]  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [79, 80, 81, 200])
def test_error_snippet_is_cut_after_80_characters(n):
    body = "{" + "a" * (n - 1)  # n characters of invalid JSON
    r = parse_tool_calls(f"<tool_call>  {body}  </tool_call>")
    shown = body if n <= 80 else body[:80] + "..."
    assert len(r.errors) == 1 and r.errors[0].endswith(": " + repr(shown))


def test_render_assistant_text_whitespace_matches_template():
    from envace.models import render_chat

    prompt = [{"role": "user", "content": "q"}]
    head = render_chat(prompt) + "<|im_start|>assistant\n"
    for content, reasoning in (("\n\n ok \n", " r \n"), ("\nXML parsed", "\n\n r\n"), ("ok", "")):
        msg = {"role": "assistant", "content": content, "reasoning_content": reasoning}
        body = render_chat(prompt + [msg])[len(head) : -len("<|im_end|>\n")]
        assert render_assistant_text(content, (), reasoning) == body
    # by hand: reasoning keeps its spaces (only newlines are stripped), content loses leading newlines only
    assert render_assistant_text("\n\n ok \n", (), " r \n") == "<think>\n r \n</think>\n\n ok \n"
    assert render_assistant_text("\nXML parsed", (), "\n\n r\n") == "<think>\n r\n</think>\n\nXML parsed"
    # defaults: no content, no reasoning -> the calls alone, "\n"-joined, no leading newline
    f, g = ToolCall("f", {}), ToolCall("g", {"a": 1})
    assert render_assistant_text(calls=[f, g]) == render_tool_call(f) + "\n" + render_tool_call(g)
    assert render_assistant_text() == ""
    assert render_assistant_text("c", [f]) == "c\n" + render_tool_call(f)


def test_stray_closing_tags_at_the_edges_and_adjacent_text():
    # a stray tag at position 0 is still an error, and the text right after it is kept whole
    r = parse_tool_calls("</tool_call>xy")
    assert r.content == "xy" and r.errors == ["stray </tool_call> without an opening <tool_call>"]
    r = parse_tool_calls("a</tool_call>bc</tool_call>")
    assert r.content == "a\nbc" and len(r.errors) == 2
    # a good block followed directly by text: the text starts right after the closing tag
    r = parse_tool_calls('<tool_call>{"name": "f"}</tool_call>xy')
    assert r.content == "xy" and r.calls == [ToolCall("f", {})]
    r = parse_tool_calls('<tool_call>{bad}</tool_call>xy<tool_call>\n\t{"name": "g"}\r\n </tool_call>z')
    assert r.content == "xy\nz" and r.calls == [ToolCall("g", {})] and len(r.errors) == 1


def test_reasoning_after_leading_whitespace():
    r = parse_tool_calls('  \n<think>\nr\n</think>\n\nok<tool_call>{"name": "f"}</tool_call>')
    assert r.reasoning == "r" and r.content == "ok" and r.calls == [ToolCall("f", {})] and r.ok
    r = parse_tool_calls("  <think>\n still\n")
    assert r.reasoning == " still" and r.content == "" and len(r.errors) == 1
    # a </think> inside a call's JSON, no <think> at all: no reasoning, the call is parsed
    r = parse_tool_calls('x <tool_call>{"name": "f", "arguments": {"s": "</think>"}}</tool_call>')
    assert r.reasoning is None and r.content == "x" and r.calls == [ToolCall("f", {"s": "</think>"})]
    # a </think> before the first call without <think> (thinking-mode output): everything before it is reasoning
    r = parse_tool_calls('plan</think>ok<tool_call>{"name": "f"}</tool_call>')
    assert r.reasoning == "plan" and r.content == "ok" and r.calls == [ToolCall("f", {})]


def test_absurd_nesting_is_an_error_not_a_crash():
    deep = "[" * 100_000 + "]" * 100_000
    r = parse_tool_calls(f"<tool_call>{deep}</tool_call>after")
    assert r.calls == [] and r.content == "after"
    assert len(r.errors) == 1 and r.errors[0].startswith("tool call 1: invalid JSON (RecursionError): '[[[")


def test_decode_keeps_only_name_arguments_and_id():
    keys = {c: 0 for c in "jihgfedcba"}  # ten keys, no name: the message lists the first eight, sorted
    r = parse_tool_calls(f"<tool_call>{json.dumps(keys)}</tool_call>")
    assert r.errors == ["tool call 1: missing or non-string 'name' (keys: ['a', 'b', 'c', 'd', 'e', 'f', 'g', 'h'])"]
    r = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"a": 1}, "id": "c9", "extra": [1]}</tool_call>')
    assert r.calls == [ToolCall("f", {"a": 1}, id="c9")] and r.calls[0].id == "c9" and r.ok


def test_render_tool_call_dict_forms_and_non_ascii_name():
    assert render_tool_call({"name": "f"}) == '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    assert render_tool_call({"name": "f", "arguments": {"a": "é"}}) == (
        '<tool_call>\n{"name": "f", "arguments": {"a": "é"}}\n</tool_call>'
    )
    assert render_tool_call({"function": {"name": "météo"}}) == (
        '<tool_call>\n{"name": "météo", "arguments": {}}\n</tool_call>'
    )
    with pytest.raises(TypeError, match="expected ToolCall or dict, got int"):
        render_tool_call(3)  # type: ignore[arg-type]


def test_reasoning_ends_at_the_first_think_end():
    # a later </think> (here inside a call's JSON string) belongs to the content, not to the reasoning
    r = parse_tool_calls(
        '<think>\nr\n</think>\n\nok<tool_call>{"name": "f", "arguments": {"s": "</think>"}}</tool_call>'
    )
    assert r.reasoning == "r" and r.content == "ok" and r.calls == [ToolCall("f", {"s": "</think>"})]
    # no <think>: a </think> inside the first call is not a reasoning end, even if another call follows
    first = '<tool_call>{"name": "f", "arguments": {"s": "</think>"}}</tool_call>'
    r = parse_tool_calls("a" + first + '<tool_call>{"name": "g"}</tool_call>')
    assert r.reasoning is None and r.content == "a" and r.calls == [ToolCall("f", {"s": "</think>"}), ToolCall("g", {})]
    # thinking-mode output whose reasoning is empty: "</think>" at position 0
    r = parse_tool_calls("</think>\n\nok")
    assert r.reasoning == "" and r.content == "ok" and r.ok
    # the reasoning is the whole <think> block: a "<think>" written inside it is kept, spaces are kept
    r = parse_tool_calls("<think>\n  a <think> b  \n</think>\n\nok")
    assert r.reasoning == "  a <think> b  " and r.content == "ok"
    assert parse_tool_calls("<think>\nXML X\n</think>\n\nok").reasoning == "XML X"  # only newlines are stripped


# ------------------------------------------------------------------------ edges found by mutation testing


def test_unterminated_think_strips_only_newlines():
    # the reasoning of a truncated <think> block keeps its text, spaces and letters at both ends
    r = parse_tool_calls("<think>\nXML notes X \n\n")
    assert r.reasoning == "XML notes X " and r.content == "" and r.calls == [] and len(r.errors) == 1


def test_arguments_nested_too_deep_are_an_error_not_a_crash():
    # the string arguments decode (in ToolCall.from_dict) to absurdly nested JSON: RecursionError, not a crash
    deep = "[" * 100_000 + "]" * 100_000
    bad = '<tool_call>{"name": "f", "arguments": "' + deep + '"}</tool_call>'
    r = parse_tool_calls(bad + ' mid <tool_call>{"name": "g"}</tool_call>')
    assert r.calls == [ToolCall("g", {})] and r.content == "mid"
    assert len(r.errors) == 1 and r.errors[0].startswith("tool call 1 ('f'): RecursionError")


@pytest.mark.parametrize("tail", ["", " ", "\n\t ", '{"name": "f"}', '\n{"name": "f"}\n'])
def test_text_ending_inside_an_opened_block(tail):
    # the output stops right after the opening tag (or after a complete JSON object): an error, never an IndexError
    r = parse_tool_calls("ok <tool_call>" + tail)
    assert r.calls == [] and r.content == "ok"
    assert len(r.errors) == 1 and r.errors[0].startswith("tool call 1: unterminated <tool_call> block")


@pytest.mark.parametrize("value,kind", [(b"<tool_call>", "bytes"), (3, "int"), (["x"], "list")])
def test_non_text_is_one_error_with_empty_content(value, kind):
    # content is always a str (callers build the assistant message from it), even for input that is not text
    assert parse_tool_calls(value) == ParseResult(content="", errors=[f"expected text, got {kind}"])


def test_call_at_position_zero_with_a_think_end_inside_its_json():
    # no <think>, the text starts with the call: the "</think>" inside its arguments is not a reasoning end
    first = '<tool_call>{"name": "f", "arguments": {"s": "</think>"}}</tool_call>'
    r = parse_tool_calls(first + " after")
    assert r.reasoning is None and r.calls == [ToolCall("f", {"s": "</think>"})] and r.content == "after" and r.ok


def test_stray_closing_tag_then_a_malformed_block():
    # the malformed block is judged on its own body, not on the stray tag that came before it
    r = parse_tool_calls("a\n</tool_call>\n<tool_call>{bad}</tool_call> b")
    assert r.calls == [] and r.content == "a\nb" and len(r.errors) == 2
    assert r.errors[0].startswith("stray </tool_call>") and r.errors[1].startswith("tool call 1: invalid JSON")


BAD_BLOCKS = (
    "<tool_call>{bad}</tool_call>",
    "<tool_call>[1]</tool_call>",
    '<tool_call>\n{"arguments": {}}\n</tool_call>',
    '<tool_call>{"name": 3}</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": {}} trailing\n</tool_call>',
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
)
pieces = st.lists(
    st.one_of(
        plain_text.map(lambda s: ("text", s)),
        st.tuples(identifier_names, json_objects).map(lambda c: ("call", ToolCall(*c))),
        st.sampled_from(BAD_BLOCKS).map(lambda b: ("bad", b)),
        st.just(("stray", "</tool_call>")),
    ),
    max_size=10,
)


@settings(max_examples=200, deadline=None)
@given(pieces=pieces, sep=st.sampled_from(["\n", " ", "\n\n"]))
def test_mixed_text_calls_and_malformed_blocks(pieces, sep):
    """Text, good calls, malformed blocks and stray closing tags in any order: the content is the text between
    the blocks, the good calls come back in order, and every bad block is one error numbered by its position
    among the opened blocks."""
    text = sep.join(render_tool_call(p) if kind == "call" else p for kind, p in pieces)
    segments, current, calls, errors, opened = [], [], [], [], 0
    for kind, p in pieces:
        if kind == "text":
            current.append(p)
            continue
        segments.append(sep.join(current))
        current = []
        if kind == "stray":
            errors.append("stray </tool_call>")
        else:
            opened += 1
            if kind == "call":
                calls.append(p)
            else:
                errors.append(f"tool call {opened}")
    segments.append(sep.join(current))
    r = parse_tool_calls(text)
    assert r.reasoning is None and r.calls == calls
    assert r.content == "\n".join(s.strip() for s in segments if s.strip())
    assert len(r.errors) == len(errors)
    for got, want in zip(r.errors, errors, strict=True):
        assert got.startswith(want) and got[len(want)] in ": ", (got, want)  # "tool call 1:" is not "tool call 10:"
