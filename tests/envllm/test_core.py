"""The shared LLM-client core (envllm.core): the taxonomy's shape, the status classification, the backoff
formula with hand-computed delays, and the repair loop driven by hand (no endpoint)."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from envllm import core
from envllm.core import (
    ConfigurationError,
    InfrastructureError,
    JudgeFormatError,
    LLMError,
    ModelOutputError,
    RepairLoop,
    backoff_delay,
    is_context_too_long,
    is_retryable_status,
    not_found_hint,
    retry_after_s,
    validation_reason,
)


class Pair(BaseModel):
    a: int
    b: str


def _prompt(reason: str) -> str:
    return f"fix: {reason}"


def test_one_hierarchy_and_its_attributes():
    for cls in (InfrastructureError, ConfigurationError, ModelOutputError, JudgeFormatError):
        assert issubclass(cls, LLMError) and not issubclass(cls, RuntimeError)
    assert issubclass(JudgeFormatError, ModelOutputError)
    e = InfrastructureError("x", attempts=3, timed_out=True)
    assert (e.attempts, e.timed_out, str(e)) == (3, True, "x")
    c = ConfigurationError("y", status_code=404, base_url="http://h/v1")
    assert (c.status_code, c.base_url) == (404, "http://h/v1")
    m = JudgeFormatError("z", text="t", rounds=3)
    assert (m.text, m.rounds) == ("t", 3)


@pytest.mark.parametrize(("status", "retry"), [(400, False), (401, False), (404, False), (422, False), (408, True),
                                                (409, True), (425, True), (429, True), (499, False), (500, True),
                                                (503, True)])
def test_retryable_statuses(status, retry):
    assert is_retryable_status(status) is retry


def test_context_too_long_and_hint():
    assert is_context_too_long(400, "This model's maximum context length is 4096 tokens")
    assert not is_context_too_long(404, "maximum context length")  # wrong status: a configuration error
    assert not is_context_too_long(400, "unknown parameter 'foo'")
    assert "base URL end in /v1" in not_found_hint(404) and not_found_hint(400) == ""


def test_backoff_delay_by_hand():
    # base 0.5 s, retry 2: 0.5 * 4 = 2.0, times (0.5 + 0.25) = 1.5
    assert backoff_delay(2, 0.5, 30.0, 0.25) == pytest.approx(1.5)
    # capped: 0.5 * 2**10 = 512 -> 30, times (0.5 + 0.5) = 30
    assert backoff_delay(10, 0.5, 30.0, 0.5) == pytest.approx(30.0)
    # a server's Retry-After of 7 s wins over 1.5 s; one of 100 s is capped at 30
    assert backoff_delay(2, 0.5, 30.0, 0.25, retry_after=7.0) == pytest.approx(7.0)
    assert backoff_delay(2, 0.5, 30.0, 0.25, retry_after=100.0) == pytest.approx(30.0)


def test_retry_after_header():
    class R:
        def __init__(self, headers):
            self.response = type("Resp", (), {"headers": headers})()

    assert retry_after_s(R({"retry-after": "2.5"})) == 2.5
    assert retry_after_s(R({})) is None and retry_after_s(R({"retry-after": "soon"})) is None
    assert retry_after_s(object()) is None  # no response at all


def test_repair_loop_valid_first_reply():
    loop = RepairLoop([{"role": "user", "content": "q"}], Pair, 2, repair_prompt=_prompt)
    assert loop.pending and loop.rounds == 0
    out = loop.feed('<think>x</think>```json\n{"a": 1, "b": "z"}\n```', "stop")
    assert out == Pair(a=1, b="z") and loop.value is out and not loop.pending and loop.rounds == 1
    with pytest.raises(RuntimeError):
        loop.feed("{}", "stop")


def test_repair_loop_repairs_then_gives_up():
    first = [{"role": "user", "content": "q"}]
    loop = RepairLoop(first, Pair, 1, repair_prompt=_prompt)
    assert loop.feed('{"a": "not a number", "b": "z"}', "stop") is None
    assert loop.pending and loop.rounds == 1
    assert loop.reason == "a: Input should be a valid integer, unable to parse string as an integer"
    assert loop.messages == [*first, {"role": "assistant", "content": '{"a": "not a number", "b": "z"}'},
                             {"role": "user", "content": f"fix: {loop.reason}"}]
    assert first == [{"role": "user", "content": "q"}]  # the caller's chat is not modified
    assert loop.feed("no json here", "stop") is None
    assert not loop.pending and loop.rounds == 2 and loop.text == "no json here"
    assert loop.reason.startswith("no JSON object found in the reply (invalid JSON: Expecting value at char 0)")
    assert len(loop.messages) == 3  # no repair request is prepared after the last round


def test_repair_loop_doubles_a_truncated_budget_up_to_the_cap():
    loop = RepairLoop([{"role": "user", "content": "q"}], Pair, 3, repair_prompt=_prompt, max_tokens=100,
                      max_tokens_cap=300)
    budgets, reasons = [], []
    while loop.pending:
        budgets.append(loop.max_tokens)
        loop.feed('{"a": 1, "b"', "length")
        reasons.append(loop.reason)
    assert budgets == [100, 200, 300, 300]  # 100 -> 200 -> min(300, 400) -> min(300, 600)
    assert [r.rsplit("(", 1)[1] for r in reasons] == [f"the reply was cut off at {n} tokens)" for n in budgets]


def test_repair_loop_without_a_budget_names_max_tokens_and_keeps_none():
    loop = RepairLoop([], Pair, 1, repair_prompt=_prompt)
    loop.feed('{"a": 1', "length")
    assert loop.max_tokens is None and loop.reason.endswith(" (the reply was cut off at max_tokens)")
    loop = RepairLoop([], Pair, 0, repair_prompt=_prompt)
    loop.feed('{"a": 1', "stop")
    assert "cut off" not in loop.reason and not loop.pending


def test_repair_loop_refuses_negative_rounds():
    with pytest.raises(ValueError, match="repair_rounds must be >= 0"):
        RepairLoop([], Pair, -1, repair_prompt=_prompt)


def test_validation_reason_lists_locations():
    try:
        Pair.model_validate({"b": 3})
    except ValueError as e:
        assert validation_reason(e) == "a: Field required; b: Input should be a valid string"
    assert validation_reason(ValueError("plain")) == "plain"


def test_short_escapes_newlines_and_cuts():
    assert core.short(None) == "<none>"
    assert core.short("a\nb") == "a\\nb"
    assert core.short("x" * 10, limit=6) == "xxx..."


def test_clip_middle_keeps_both_ends_and_counts_the_cut():
    text = "abcdefghij"  # 10 characters
    assert core.clip_middle(text, 0) == text and core.clip_middle(text, 10) == text
    assert core.clip_middle(text, 4) == "ab\n...(6 characters omitted)...\nij"
    assert core.clip_middle(text, 9) == "abcd\n...(2 characters omitted)...\nghij"
    assert core.clip_middle(text, 1) == "\n...(10 characters omitted)...\n"  # not the marker + the whole text
