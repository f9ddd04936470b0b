"""Checklist judge: hand-computed aggregation, prompts, masking; judge calls go to a real local HTTP server."""

from __future__ import annotations

import json
import re

import pytest

from envace.data import cm2
from envace.rewards import (
    ChecklistItem,
    ChecklistJudge,
    ChecklistJudgeConfig,
    ConfigurationError,
    LLMEndpointConfig,
    LLMPool,
    aggregate_checklist,
    default_is_tool_error,
    mix_rewards,
    parse_checklists,
)
from envace.rewards.checklist import render_messages, split_turns

pytestmark = pytest.mark.timeout(30)


def item(id_: str, weight: float = 1.0, focus: str = "assistant.content", passes: str = "", **kw) -> dict:
    """A raw checklist item; ``passes`` lists the steps at which the scripted judge says true."""
    return {
        "id": id_,
        "question": f"Criterion {id_}? [pass-steps: {passes}]",
        "focus_on": focus,
        "pass_condition": f"condition of {id_}",
        "weight": weight,
        **kw,
    }


def _marker_responder(replies):
    """Scripted judge: true iff the graded step is listed in the item's [pass-steps: ...] marker."""

    def respond(body, n):
        prompt = body["messages"][0]["content"]
        steps = re.search(r"\[pass-steps: ([\d,]*)\]", prompt).group(1)
        step = re.search(r"up to and including step (\d+)", prompt).group(1)
        return replies.verdict(step in steps.split(","), f"step {step} vs {steps}")

    return respond


def pool_for(*urls: str, **kw) -> LLMPool:
    base = {"model": "judge", "timeout_s": 2.0, "max_retries": 1, "backoff_base_s": 0.01, "backoff_max_s": 0.02}
    base.update(kw)
    return LLMPool(LLMEndpointConfig(base_urls=list(urls), **base))


# A two-turn trajectory; turn 1 has a tool error.
TRAJECTORY = [
    {"role": "system", "content": "You are a shop assistant."},
    {"role": "user", "content": "Where is order 3?"},
    {
        "role": "assistant",
        "content": "<think>look it up</think>Let me check.",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_order", "arguments": '{"order_id": 3}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": '{"status": "shipped"}'},
    {"role": "assistant", "content": "Order 3 has shipped."},
    {"role": "user", "content": "Cancel it."},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "c2", "type": "function", "function": {"name": "cancel", "arguments": {"id": 3}}}],
    },
    {"role": "tool", "tool_call_id": "c2", "content": "Error: order 3 has already shipped"},
    {"role": "assistant", "content": "Sorry, it already shipped."},
]

# 2 checklists x 3 turns (the trajectory reaches only 2).
CHECKLISTS = [
    [
        [item("a", 1, passes="1"), item("b", 3, "assistant.tool_calls", "0"), item("c", 1, passes="")],
        [item("d", 1, "assistant.tool_calls", "0,1"), item("e", 1, passes="1")],
        [item("f", 1, passes="0")],
    ],
    [
        [item("g", 2, passes="0,1")],
        [item("h", 0, passes="0"), item("i", 0, passes="")],
        [item("j", 1, passes="0")],
    ],
]


# -- data model -------------------------------------------------------------------------------------------
def test_item_model_mirrors_cm2_item_schema() -> None:
    # the converter's JSON Schema of an item; the pydantic model must not drift from it
    schema = cm2.CM2_RECORD_SCHEMA["properties"]["checklist_list"]["items"]["items"]["items"]
    fields = ChecklistItem.model_fields
    required = {name for name, f in fields.items() if f.is_required()}
    assert required == set(schema["required"])
    assert set(fields) == set(schema["properties"])


def test_parse_checklists_accepts_json_string_and_rejects_bad_items() -> None:
    raw = [[[item("x", evidence=[{"turn": 0, "step": 1, "from": "assistant", "snippet": "s"}], extra_key=1)]]]
    parsed = parse_checklists(json.dumps(raw))
    assert parsed[0][0][0].evidence[0].from_ == "assistant"
    assert parsed[0][0][0].model_extra == {"extra_key": 1}
    with pytest.raises(ValueError, match=r"\$\[0\]\[0\]\[0\]\[weight\]"):
        parse_checklists([[[{**item("x"), "weight": -1}]]])
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_checklists("[[[")
    with pytest.raises(ValueError, match="at least one checklist"):
        parse_checklists([])


def test_tool_error_detection() -> None:
    assert default_is_tool_error({"role": "tool", "content": "Error: no such order"})
    assert default_is_tool_error({"role": "tool", "content": "Error during execution: boom"})
    assert default_is_tool_error({"role": "tool", "content": '{"error_tool_call": "bad args"}'})
    assert default_is_tool_error({"role": "tool", "content": '{"error": "not found"}'})
    assert default_is_tool_error({"role": "tool", "content": "ok", "is_error": True})
    assert default_is_tool_error({"role": "tool", "content": "Traceback (most recent call last):\n ..."})
    assert not default_is_tool_error({"role": "tool", "content": '{"error": null, "status": "ok"}'})
    assert not default_is_tool_error({"role": "tool", "content": "error_count: 0"})
    assert not default_is_tool_error({"role": "tool", "content": "The order has no errors."})


def test_split_turns_and_render() -> None:
    turns = split_turns(TRAJECTORY)
    assert [(t.start, [(s.index, s.end, s.tool_error) for s in t.steps]) for t in turns] == [
        (1, [(2, 4, False), (4, 5, False)]),
        (5, [(6, 8, True), (8, 9, False)]),
    ]
    assert [t.tool_error for t in turns] == [False, True]
    text = render_messages(TRAJECTORY)
    assert "ASSISTANT (turn 0, step 0):\n[private reasoning]\nlook it up\n[reply to the user]\nLet me check." in text[2]
    assert '- get_order({"order_id": 3})' in text[2]
    assert text[3] == 'TOOL RESULT (get_order):\n{"status": "shipped"}'
    assert '- cancel({"id": 3})' in text[6]
    assert "private reasoning" not in render_messages(TRAJECTORY, include_reasoning=False)[2]


# -- aggregation, hand-computed ---------------------------------------------------------------------------
def test_aggregate_hand_computed() -> None:
    checklists = parse_checklists(CHECKLISTS)
    step_passes = {
        (0, 0, 0): [False, True],  # a passes once (step 1) -> passes the turn
        (0, 0, 1): [True, False],  # b
        (0, 0, 2): [False, False],  # c
        (0, 1, 0): [True, True],  # d: forced to 0 below (tool error)
        (0, 1, 1): [False, True],  # e
        (1, 0, 0): [True, True],  # g
        (1, 1, 0): [True, False],  # h (weights 0 + 0 -> equal weights)
        (1, 1, 1): [False, False],  # i
        # turn 2 never reached: no verdicts
    }
    reward, per_turn, per_item = aggregate_checklist(checklists, step_passes, {(0, 1, 0)})
    # checklist 0: turn 0 = (1+3)/5 = 0.8; turn 1 = e (0.5); turn 2 = 0
    # checklist 1: turn 0 = 1.0; turn 1 = h (0.5); turn 2 = 0
    assert reward == pytest.approx((0.8 + 0.5 + 0 + 1.0 + 0.5 + 0) / (2 * 3))
    assert per_turn == pytest.approx([0.9, 0.5, 0.0])
    assert per_item["c0/t0/a"] == {
        "passed": True,
        "weight": pytest.approx(0.2),
        "steps": [False, True],
        "tool_error": False,
        "focus_on": "assistant.content",
    }
    assert per_item["c0/t0/b"]["weight"] == pytest.approx(0.6)
    assert per_item["c0/t1/d"]["passed"] is False and per_item["c0/t1/d"]["tool_error"] is True
    assert per_item["c1/t1/h"]["weight"] == per_item["c1/t1/i"]["weight"] == 0.5
    assert per_item["c0/t2/f"] == {
        "passed": False,
        "weight": 1.0,
        "steps": [],
        "tool_error": False,
        "focus_on": "assistant.content",
    }


def test_aggregate_perfect_and_empty_turn() -> None:
    checklists = parse_checklists([[[item("a")], []]])
    reward, per_turn, _ = aggregate_checklist(checklists, {(0, 0, 0): [True]})
    assert (reward, per_turn) == (0.5, [1.0, 0.0])  # a turn without items scores 0, as in the reference


# -- the judge against the local server -------------------------------------------------------------------
async def test_judge_end_to_end_hand_computed(fake_openai, replies) -> None:
    srv = fake_openai(_marker_responder(replies))
    async with pool_for(srv.base_url, concurrency=4) as pool:
        result = await ChecklistJudge(pool).judge(TRAJECTORY, json.dumps(CHECKLISTS))
    assert not result.masked and result.reason == ""
    assert result.reward == pytest.approx(2.8 / 6)
    assert result.per_turn == pytest.approx([0.9, 0.5, 0.0])
    # turn 0: 4 items x 2 steps; turn 1: e, h, i x 2 steps (d is zeroed by the tool error, not judged)
    assert result.n_calls == srv.n_requests == 14
    assert (result.n_failures, result.n_tool_error_items) == (0, 1)
    assert result.per_item["c0/t0/a"]["steps"] == [False, True]
    assert result.per_item["c0/t0/a"]["reasoning"] == ["step 0 vs 1", "step 1 vs 1"]
    assert result.per_item["c0/t1/d"]["reasoning"] == ["tool error in this turn"]
    assert pool.counters()["max_in_flight"] <= 4


async def test_judge_step_scope_tool_error(fake_openai, replies) -> None:
    srv = fake_openai(_marker_responder(replies))
    async with pool_for(srv.base_url) as pool:
        judge = ChecklistJudge(pool, ChecklistJudgeConfig(tool_error_scope="step"))
        result = await judge.judge(TRAJECTORY, CHECKLISTS)
    # d: step 0 (followed by the error) fails without a call, step 1 is judged and passes -> turn 1 of checklist 0 = 1
    assert result.per_item["c0/t1/d"]["steps"] == [False, True]
    assert result.reward == pytest.approx((0.8 + 1.0 + 0 + 1.0 + 0.5 + 0) / 6)
    assert result.n_calls == 15 and result.n_tool_error_items == 0


async def test_judge_prompt_contents(fake_openai, replies) -> None:
    srv = fake_openai(replies.script(replies.verdict(True)))
    checklists = [
        [
            [],
            [
                item(
                    "z",
                    focus="assistant.content",
                    failure_examples=["Claims it was cancelled"],
                    evidence=[{"turn": 1, "step": 1, "from": "assistant", "snippet": "already shipped"}],
                )
            ],
        ]
    ]
    async with pool_for(srv.base_url) as pool:
        result = await ChecklistJudge(pool).judge(TRAJECTORY, checklists)
    assert result.reward == pytest.approx(0.5) and result.n_calls == 2
    prompts = [b["messages"][0]["content"] for b in srv.bodies]
    step0 = next(p for p in prompts if "up to and including step 0" in p)
    step1 = next(p for p in prompts if "up to and including step 1" in p)
    for p in (step0, step1):
        assert "Criterion z?" in p and "assistant.content" in p and "condition of z" in p
        assert "- Claims it was cancelled" in p and "(turn 1, step 1, assistant): already shipped" in p
        history, current = p.split("## Current turn")[0], p.split("## Current turn")[1]
        assert "Where is order 3?" in history and "Order 3 has shipped." in history
        assert "Cancel it." in current and "Error: order 3 has already shipped" in current
    assert "Sorry, it already shipped." not in step0.split("## How to decide")[0]
    assert "Sorry, it already shipped." in step1
    assert srv.bodies[0]["messages"][0]["role"] == "user" and len(srv.bodies[0]["messages"]) == 1


async def test_judge_invalid_json_then_repaired(fake_openai, replies) -> None:
    def respond(body, n):
        if len(body["messages"]) == 1:
            return replies.chat('answer: {"reasoning": "r", "answer": "true"}')  # a string, rejected (strict)
        return replies.verdict(True)

    srv = fake_openai(respond)
    async with pool_for(srv.base_url) as pool:
        result = await ChecklistJudge(pool).judge(TRAJECTORY, [[[item("a")], [item("e")]]])
    assert not result.masked and result.reward == 1.0
    assert result.n_calls == 4 and srv.n_requests == 8
    assert pool.counters()["repairs"] == 4


async def test_judge_permanent_garbage_is_masked(fake_openai, replies) -> None:
    srv = fake_openai(replies.script(replies.chat("Yes, it passes.")))
    async with pool_for(srv.base_url) as pool:
        result = await ChecklistJudge(pool, ChecklistJudgeConfig(repair_rounds=1)).judge(
            TRAJECTORY, [[[item("a")], [item("e")]]]
        )
    assert result.masked and result.reward is None
    assert "4 of 4 judge call(s) failed" in result.reason and "JudgeFormatError" in result.reason
    assert (result.n_calls, result.n_failures) == (4, 4) and srv.n_requests == 8
    assert result.per_turn == [] and len(result.failures) == 4


async def test_judge_one_failure_masks_the_whole_trajectory(fake_openai, replies) -> None:
    def respond(body, n):
        if "Criterion e?" in body["messages"][0]["content"]:
            return replies.error(503)
        return replies.verdict(True)

    srv = fake_openai(respond)
    async with pool_for(srv.base_url) as pool:
        result = await ChecklistJudge(pool).judge(TRAJECTORY, [[[item("a")], [item("e")]]])
    assert result.masked and result.reward is None and result.n_failures == 2
    assert "InfrastructureError" in result.reason and "HTTP 503" in result.reason


async def test_judge_timeout_is_masked(fake_openai, replies) -> None:
    slow = replies.verdict(True)
    slow.delay = 1.0
    srv = fake_openai(replies.script(slow))
    async with pool_for(srv.base_url, timeout_s=0.2, max_retries=1) as pool:
        result = await ChecklistJudge(pool).judge(TRAJECTORY[:5], [[[item("a")]]])
    assert result.masked and result.reward is None
    assert "no reply within 0.2s" in result.reason
    assert (result.n_calls, result.n_failures) == (2, 2)
    assert pool.counters()["timeouts"] == 4 and pool.counters()["retries"] == 2


async def test_judge_configuration_error_raises(fake_openai, replies) -> None:
    srv = fake_openai(replies.script(replies.error(404, "The model `judge` does not exist.")))
    async with pool_for(srv.base_url, max_retries=3) as pool:
        with pytest.raises(ConfigurationError, match="does not exist"):
            await ChecklistJudge(pool).judge(TRAJECTORY, [[[item("a")], [item("e")]]])
    assert srv.n_requests == 4  # one per distinct call, none retried


async def test_identical_prompts_are_asked_once(fake_openai, replies) -> None:
    srv = fake_openai(replies.script(replies.verdict(True)))
    same = [[item("a")], [item("e")]]
    async with pool_for(srv.base_url) as pool:
        result = await ChecklistJudge(pool).judge(TRAJECTORY, [same, same])
    assert result.reward == 1.0 and result.n_calls == srv.n_requests == 4


async def test_judged_reward_mixed_with_verifiable(fake_openai, replies) -> None:
    srv = fake_openai(replies.script(replies.chat("garbage")))
    async with pool_for(srv.base_url) as pool:
        result = await ChecklistJudge(pool, ChecklistJudgeConfig(repair_rounds=0)).judge(TRAJECTORY, [[[item("a")]]])
    reward, details = mix_rewards(
        {"verifiable": 1.0, "checklist": result.reward},
        {"verifiable": 0.5, "checklist": 0.5},
        reasons={"checklist": result.reason},
    )
    assert reward is None and details["masked"]
    assert "checklist" in details["reason"] and "JudgeFormatError" in details["reason"]
