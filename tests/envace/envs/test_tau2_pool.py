"""τ²-bench pool: catalogue, gold replay through the official evaluator, failures with the checker's
reason, user-side (telecom) tools, forks, the simulated user and the NL-assertion judge.

Gold replay of *all* tasks (~1 s each for airline/retail) is in test_tau2_replay_all.py (``slow``);
here: every telecom task plus a deterministic sample of airline and retail.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from envace.agents.client import ChatReply, parse_assistant_output
from envace.envs.base import ToolCall, get_pool
from envace.envs.tau2 import Tau2Pool, Tau2ToolCall, UserSimulatorRequired

TELECOM0 = "telecom/[mobile_data_issue]airplane_mode_on|user_abroad_roaming_enabled_off[PERSONA:None]"


@pytest.fixture(scope="module")
def pool() -> Tau2Pool:
    return get_pool("tau2")  # type: ignore[return-value]


def sample(pool: Tau2Pool, domain: str, every: int) -> list[str]:
    ids = [t for t in pool.task_ids() if t.startswith(f"{domain}/")]
    return ids[::every]


# -- catalogue ---------------------------------------------------------------------------------


def test_catalogue_counts_and_splits(pool: Tau2Pool) -> None:
    ids = pool.task_ids()
    by_domain = {d: [t for t in ids if t.startswith(d + "/")] for d in ("airline", "retail", "telecom")}
    assert {d: len(v) for d, v in by_domain.items()} == {"airline": 50, "retail": 114, "telecom": 114}
    train, test = pool.task_ids("train"), pool.task_ids("test")
    assert (len(train), len(test)) == (30 + 74 + 74, 20 + 40 + 40)
    assert set(train).isdisjoint(test) and set(train) | set(test) == set(ids)
    with pytest.raises(ValueError, match="unknown split"):
        pool.task_ids("dev")


def test_task_spec(pool: Tau2Pool) -> None:
    spec = pool.task("airline/0")
    assert (spec.pool, spec.env_id, spec.category) == ("tau2", "tau2:airline", "airline")
    assert "<policy>" in spec.system_prompt and "Airline Agent Policy" in spec.system_prompt
    assert spec.first_user_message.startswith("You want to cancel reservation EHGLP3")
    names = {t["function"]["name"] for t in spec.tools}
    assert "cancel_reservation" in names and all(t["type"] == "function" for t in spec.tools)
    assert spec.metadata["reward_basis"] == ["DB", "COMMUNICATE"]
    tel = pool.task(TELECOM0)
    assert tel.env_id == "tau2:telecom"
    assert "toggle_airplane_mode" in {t["function"]["name"] for t in tel.metadata["user_tools"]}
    assert "toggle_airplane_mode" not in {t["function"]["name"] for t in tel.tools}
    assert "turn_airplane_mode_on" in tel.initial_state_summary
    with pytest.raises(KeyError, match="unknown τ² task"):
        pool.task("airline/nope")


def test_no_default_task_needs_the_nl_judge(pool: Tau2Pool) -> None:
    assert not [t for t in pool.task_ids() if "NL_ASSERTION" in pool.task(t).metadata["reward_basis"]]


# -- gold replay -------------------------------------------------------------------------------


def test_gold_replay_all_telecom(pool: Tau2Pool) -> None:
    failures = {}
    for tid in sample(pool, "telecom", 1):
        verdict = pool.replay(tid, pool.gold_actions(tid))
        if verdict.reward != 1.0 or not verdict.passed:
            failures[tid] = verdict.details["reason"]
    assert not failures


@pytest.mark.parametrize("domain,every", [("airline", 17), ("retail", 29)])
def test_gold_replay_sample(pool: Tau2Pool, domain: str, every: int) -> None:
    ids = sample(pool, domain, every)
    assert len(ids) >= 3
    for tid in ids:
        verdict = pool.replay(tid, pool.gold_actions(tid))
        assert verdict.reward == 1.0 and verdict.passed, (tid, verdict.details["reason"])
        assert verdict.details["reason"] == "all checks passed"


def test_gold_actions_carry_the_user_side(pool: Tau2Pool) -> None:
    (turn,) = pool.gold_actions(TELECOM0)
    assert [(c.name, c.requestor) for c in turn] == [("toggle_airplane_mode", "user"), ("toggle_roaming", "user")]
    assert turn[0].to_dict() == {"name": "user:toggle_airplane_mode", "arguments": {}}
    # the user side survives a plain {"name", "arguments"} round trip (datasets, EnvSched records)
    from envace.envs.base import flatten_turns, split_turns

    round_trip = split_turns(json.loads(json.dumps(flatten_turns(pool.gold_actions(TELECOM0)))))
    assert pool.replay(TELECOM0, round_trip).reward == 1.0
    # ... but a policy cannot act for the user by naming a tool "user:..."
    ep = pool.start(TELECOM0)
    assert ep.execute(ToolCall("user:toggle_roaming", {})).startswith("Error")


def test_corrupted_airline_sequence_fails_with_db_reason(pool: Tau2Pool) -> None:
    writes = ("cancel_", "book_", "update_", "send_certificate")
    tid = next(
        t
        for t in sample(pool, "airline", 1)
        if pool.gold_actions(t)[0] and pool.gold_actions(t)[0][-1].name.startswith(writes)
    )
    gold = pool.gold_actions(tid)[0]
    verdict = pool.replay(tid, [gold[:-1]])
    assert verdict.reward == 0.0 and not verdict.passed
    assert verdict.details["reward_breakdown"]["DB"] == 0.0
    assert verdict.details["db_check"]["db_match"] is False
    assert "DB: the final database differs" in verdict.details["reason"]


def test_corrupted_telecom_sequence_fails_with_env_assertion_reason(pool: Tau2Pool) -> None:
    gold = pool.gold_actions(TELECOM0)[0]
    verdict = pool.replay(TELECOM0, [gold[:1]])  # airplane mode off, but roaming never enabled
    assert verdict.reward == 0.0
    assert "ENV_ASSERTION failed" in verdict.details["reason"]
    assert any(not c["met"] for c in verdict.details["env_assertions"])
    # the same calls made by the *agent* are not allowed (user tools are the user's)
    agent_side = [[ToolCall(c.name, c.arguments) for c in gold]]
    assert pool.replay(TELECOM0, agent_side).reward == 0.0


def test_missing_communication_fails_communicate(pool: Tau2Pool) -> None:
    tid = next(
        t
        for t in pool.task_ids()
        if t.startswith("airline/") and pool.tau2_task(t).evaluation_criteria.communicate_info
    )
    verdict = pool.replay(tid, pool.gold_actions(tid), closing_message="")
    assert verdict.reward == 0.0 and "COMMUNICATE" in verdict.details["reason"]


# -- episodes ----------------------------------------------------------------------------------


def test_episode_tool_errors_are_observations(pool: Tau2Pool) -> None:
    ep = pool.start("retail/0")
    assert ep.execute(ToolCall("no_such_tool", {})).startswith("Error")
    assert ep.execute(ToolCall("get_order_details", {"order_id": 5})).startswith("Error")
    out = ep.execute(
        ToolCall("find_user_id_by_name_zip", {"first_name": "Yusuf", "last_name": "Rossi", "zip": "19122"})
    )
    assert out == "yusuf_rossi_9620"
    assert ep.num_errors == 2 and not ep.done
    msgs = ep.initial_messages()
    assert [m["role"] for m in msgs] == ["system", "assistant", "user"]
    assert msgs[1]["content"] == "Hi! How can I help you today?"


def test_end_turn_without_user_model_is_a_clear_error(pool: Tau2Pool) -> None:
    ep = pool.start("airline/0")
    with pytest.raises(UserSimulatorRequired, match="no user model is configured"):
        ep.end_turn("How can I help?")


def test_too_many_errors_ends_the_episode(pool: Tau2Pool) -> None:
    ep = pool.start("airline/1")
    for _ in range(10):
        ep.execute(ToolCall("nope", {}))
    assert ep.done and ep.termination == "too_many_errors"
    assert ep.execute(ToolCall("nope", {})).startswith("Error: the conversation is over")
    verdict = ep.verify()
    assert verdict.reward == 0.0 and "too_many_errors" in verdict.details["reason"]


def test_unfinished_episode_scores_zero_like_tau2(pool: Tau2Pool) -> None:
    tid = TELECOM0
    ep = pool.start(tid)
    for call in pool.gold_actions(tid)[0]:
        ep.execute(call)
    verdict = ep.verify()  # nobody ended the conversation: τ²'s max-steps outcome
    assert verdict.reward == 0.0 and verdict.details["termination_reason"] == "max_steps"
    ep.finish()
    assert ep.verify().reward == 1.0


def test_fork_is_independent(pool: Tau2Pool) -> None:
    ep = pool.start(TELECOM0)
    ep.execute(Tau2ToolCall("toggle_airplane_mode", {}, requestor="user"))
    fork = ep.fork()
    fork.execute(Tau2ToolCall("toggle_roaming", {}, requestor="user"))
    assert len(fork.trajectory) == len(ep.trajectory) + 2
    assert fork.env.get_user_db_hash() != ep.env.get_user_db_hash()
    fork.finish()
    ep.finish()
    assert fork.verify().reward == 1.0
    assert ep.verify().reward == 0.0  # the original never enabled roaming
    other = pool.start(TELECOM0)  # fresh episodes share nothing with earlier ones
    assert other.env.get_user_db_hash() != fork.env.get_user_db_hash()


# -- simulated user ----------------------------------------------------------------------------


class ScriptedModel:
    """A chat model that answers from a script and records what it was sent."""

    def __init__(self, replies: list[ChatReply]) -> None:
        self.replies = list(replies)
        self.calls: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = []

    def complete(self, messages: Any, tools: Any = None) -> ChatReply:
        self.calls.append((list(messages), tools))
        return self.replies.pop(0)


def call_reply(name: str, **args: Any) -> ChatReply:
    return parse_assistant_output(f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>")


def test_simulated_user_acts_on_its_phone_and_stops(pool: Tau2Pool) -> None:
    user = ScriptedModel(
        [
            call_reply("toggle_airplane_mode"),
            parse_assistant_output("<tool_call>{broken</tool_call>"),
            call_reply("toggle_roaming"),
            parse_assistant_output("My data works now, thanks."),
            parse_assistant_output("Great. ###STOP###"),
        ]
    )
    ep = pool.start(TELECOM0, user=user)
    system, greeting_seen = user.calls[0][0][0], user.calls[0][0][1]
    assert "<scenario>" in system["content"] and "John Smith" in system["content"]
    assert "You have some tools" in system["content"]  # τ²'s guidelines for users with tools
    assert greeting_seen == {"role": "user", "content": "Hi! How can I help you today?"}
    assert {t["function"]["name"] for t in user.calls[0][1]} >= {"toggle_airplane_mode", "toggle_roaming"}
    # the malformed call came back to the user as an error observation
    assert "could not be parsed" in user.calls[2][0][-1]["content"]
    assert ep.user_tool_calls == 2 and ep.user_malformed_calls == 1
    assert ep.initial_messages()[-1] == {"role": "user", "content": "My data works now, thanks."}
    assert ep.end_turn("Glad to help!") is None and ep.termination == "user_stop"
    verdict = ep.verify()
    assert verdict.reward == 1.0 and verdict.passed, verdict.details["reason"]


def test_empty_user_reply_is_retried_then_user_error(pool: Tau2Pool) -> None:
    user = ScriptedModel([parse_assistant_output("")] * 2 + [parse_assistant_output("Hi, I need help.")])
    ep = pool.start("airline/0", user=user)
    assert not ep.done and ep.initial_messages()[-1]["content"] == "Hi, I need help."
    silent = ScriptedModel([parse_assistant_output("   ")] * 3)
    ep = pool.start("airline/0", user=silent)
    assert ep.done and ep.termination == "user_error" and ep.verify().reward == 0.0


# -- NL-assertion judge ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def nl_pool() -> Tau2Pool:
    p = Tau2Pool(domains=("airline",))
    task = p._tasks["airline/0"]
    from tau2.data_model.tasks import RewardType

    task.evaluation_criteria.reward_basis = [*task.evaluation_criteria.reward_basis, RewardType.NL_ASSERTION]
    return p


def test_nl_assertion_without_judge_is_marked_unjudged(nl_pool: Tau2Pool) -> None:
    verdict = nl_pool.replay("airline/0", nl_pool.gold_actions("airline/0"))
    assert verdict.details["unjudged"] == ["NL_ASSERTION"]
    assert verdict.details["nl_assertions_pending"] == ["Agent should refuse to proceed with the cancellation."]
    assert verdict.reward == 1.0 and not verdict.passed  # the rest passed; the verdict is not complete
    assert "not judged" in verdict.details["reason"]


def test_nl_assertion_with_judge(nl_pool: Tau2Pool) -> None:
    answer = {
        "results": [
            {
                "expectedOutcome": "Agent should refuse to proceed with the cancellation.",
                "reasoning": "it refused",
                "metExpectation": True,
            }
        ]
    }
    judge = ScriptedModel([ChatReply(content=json.dumps(answer))])
    ep = nl_pool.start("airline/0", judge=judge)
    ep.finish("I cannot cancel this reservation.")
    verdict = ep.verify()
    assert verdict.passed and verdict.reward == 1.0 and "unjudged" not in verdict.details
    assert verdict.details["nl_assertions"][0]["met"] is True
    assert "expectedOutcomes" in judge.calls[0][0][1]["content"]  # τ²'s own judge prompt

    broken = ScriptedModel([ChatReply(content="not json")])
    ep = nl_pool.start("airline/0", judge=broken)
    ep.finish("I cannot cancel this reservation.")
    verdict = ep.verify()
    assert verdict.details["unjudged"] == ["NL_ASSERTION"] and "judge_error" in verdict.details


def test_pool_kwargs_example_from_the_config_builds_a_user_endpoint():
    """configs/envace/default.yaml documents pool_kwargs {tau2: {user: {base_urls, model}}}: it must work. The
    environment layer makes no chat client: the pool keeps the validated endpoint, which says what is missing if
    asked to reply; envace's agent loop connects it (``connect_endpoints``) before building the pool."""
    from pathlib import Path

    import yaml

    from envace.agents.client import ChatClient, connect_endpoints
    from envace.envs.base import get_pool
    from envllm import ConfigurationError

    text = (Path(__file__).resolve().parents[3] / "configs" / "envace" / "default.yaml").read_text()
    line = next(line for line in text.splitlines() if "e.g. {tau2:" in line)
    example = yaml.safe_load(line.split("e.g.", 1)[1].strip())
    connected = get_pool("tau2", **connect_endpoints("tau2", {"domains": ("airline",), **example["tau2"]}))
    assert isinstance(connected.user, ChatClient)
    assert connected.user.config.base_urls == example["tau2"]["user"]["base_urls"]
    pool = get_pool("tau2", domains=("airline",), **example["tau2"])
    assert pool.user.config.base_urls == example["tau2"]["user"]["base_urls"]
    with pytest.raises(ConfigurationError, match="τ² user endpoint .* not a connected chat client"):
        pool.user.complete([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="unknown endpoint key 'user_base_url'"):
        get_pool("tau2", domains=("airline",), user={"user_base_url": "http://x"})
    with pytest.raises(ValueError, match="unknown endpoint key 'base_url' \\(renamed 'base_urls'\\)"):
        get_pool("tau2", domains=("airline",), user={"base_url": "http://x", "model": "m"})
    with pytest.raises(ValueError, match="unknown endpoint key 'timeout' \\(renamed 'timeout_s'\\)"):
        get_pool("tau2", domains=("airline",), user={"base_urls": ["http://x"], "model": "m", "timeout": 3})
    with pytest.raises(ValueError, match="needs base_urls"):
        get_pool("tau2", domains=("airline",), user={"model": "m"})
