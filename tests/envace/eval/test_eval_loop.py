"""The evaluation agent loop with scripted (fake) chat clients, against the real BFCL and τ² pools and
a tiny in-test pool for the edge cases. The real-server end-to-end run is in test_eval_server_e2e.py."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest

from envace.agents.client import ChatReply, parse_assistant_output
from envace.agents.engine import ModelError
from envace.envs.base import EnvironmentPool, Episode, TaskSpec, ToolCall, Verdict, get_pool
from envace.eval.runner import (
    AgentLoopRunner,
    LoopLimits,
    RunContext,
    available_runners,
    build_runner,
    register_runner,
)
from envace.rewards.llm import InfrastructureError

Policy = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], ChatReply]


class FakeClient:
    """Duck-types ChatClient: answers with ``policy(messages, tools)`` and keeps every request."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.requests: list[list[dict[str, Any]]] = []

    def complete(self, messages: Any, tools: Any = None, **_: Any) -> ChatReply:
        self.requests.append(json.loads(json.dumps(list(messages))))
        reply = self.policy(list(messages), tools)
        reply.usage = {"prompt_tokens": 10, "completion_tokens": 2}
        return reply


def say(text: str) -> ChatReply:
    return parse_assistant_output(text)


def calls(*items: tuple[str, dict[str, Any]]) -> ChatReply:
    return ChatReply(content="", tool_calls=[ToolCall(n, a, id=f"c{i}_{n}") for i, (n, a) in enumerate(items)])


# -- real pools ----------------------------------------------------------------------------------


def test_bfcl_gold_policy_scores_one() -> None:
    pool = get_pool("bfcl_multi_turn", categories=("multi_turn_base",))
    tid = "multi_turn_base_0"
    gold = pool.gold_actions(tid)

    def policy(messages: list[dict[str, Any]], tools: Any) -> ChatReply:
        turn = sum(m["role"] == "user" for m in messages) - 1
        if messages[-1]["role"] == "user":  # start of a turn: make that turn's gold calls
            return ChatReply(
                content="",
                tool_calls=[ToolCall(c.name, c.arguments, id=f"t{turn}_{i}") for i, c in enumerate(gold[turn])],
            )
        return say("Done.")

    client = FakeClient(policy)
    rec = AgentLoopRunner(client)(pool, tid)  # type: ignore[arg-type]
    assert rec.reward == 1.0 and rec.passed, rec.reason
    assert rec.turns == len(gold) and rec.tool_calls == sum(map(len, gold))
    assert rec.stop_reason == "completed" and rec.malformed_tool_calls == 0
    assert rec.prompt_tokens == 10 * rec.completions
    tool_msgs = [m for m in rec.messages if m["role"] == "tool"]
    assert len(tool_msgs) == rec.tool_calls and all(m["tool_call_id"].startswith("call_") for m in tool_msgs)


TELECOM0 = "telecom/[mobile_data_issue]airplane_mode_on|user_abroad_roaming_enabled_off[PERSONA:None]"


def test_tau2_conversation_with_simulated_user_scores_one() -> None:
    pool = get_pool("tau2", domains=("telecom",))

    def agent(messages: list[dict[str, Any]], tools: Any) -> ChatReply:
        last = messages[-1]
        if last["role"] == "user" and "no data" in last["content"]:
            return calls(("get_customer_by_phone", {"phone_number": "555-123-2002"}))
        if last["role"] == "tool":
            return say("Please turn off airplane mode.")
        if "airplane" in last["content"]:
            return say("Now please turn on data roaming.")
        return say("Glad it works!")

    user_script = iter(
        [
            say("My phone has no data."),
            parse_assistant_output('<tool_call>{"name": "toggle_airplane_mode", "arguments": {}}</tool_call>'),
            say("I turned airplane mode off."),
            parse_assistant_output('<tool_call>{"name": "toggle_roaming", "arguments": {}}</tool_call>'),
            say("Roaming is on and data works."),
            say("###STOP###"),
        ]
    )
    user = FakeClient(lambda m, t: next(user_script))
    rec = AgentLoopRunner(FakeClient(agent), start_kwargs={"user": user})(pool, TELECOM0)  # type: ignore[arg-type]
    assert rec.reward == 1.0 and rec.passed, rec.reason
    assert rec.details["termination_reason"] == "user_stop" and rec.tool_calls == 1
    roles = [m["role"] for m in rec.messages]
    assert roles[:3] == ["system", "assistant", "user"] and roles.count("user") == 3
    # the agent saw only the user's words, never the user's own tool calls
    assert all("toggle" not in (m.get("content") or "") for m in rec.messages if m["role"] == "user")


def test_tau2_without_user_model_raises_a_configuration_error() -> None:
    from envace.envs.tau2 import UserSimulatorRequired

    pool = get_pool("tau2", domains=("telecom",))
    with pytest.raises(UserSimulatorRequired):
        AgentLoopRunner(FakeClient(lambda m, t: say("Hello")))(pool, TELECOM0)  # type: ignore[arg-type]


# -- a tiny pool for the edge cases ---------------------------------------------------------------


class EchoEpisode(Episode):
    def __init__(self, spec: TaskSpec, turns: int) -> None:
        self.spec = spec
        self.turns_left = turns
        self.executed: list[ToolCall] = []
        self.ended = False

    def tools(self) -> list[dict[str, Any]]:
        return self.spec.tools

    def execute(self, call: ToolCall) -> str:
        self.executed.append(call)
        return f"echo {call.arguments}"

    def end_turn(self, assistant_text: str) -> str | None:
        self.turns_left -= 1
        if self.turns_left <= 0:
            self.ended = True
            return None
        return f"question {self.turns_left}"

    def verify(self) -> Verdict:
        ok = self.ended and bool(self.executed)
        return Verdict(reward=float(ok), passed=ok, details={"reason": "ok" if ok else "nothing executed"})

    def fork(self) -> Episode:
        raise NotImplementedError

    @property
    def done(self) -> bool:
        return self.ended


class EchoPool(EnvironmentPool):
    name = "echo"

    def __init__(self, n: int = 3, turns: int = 2, category: str = "base") -> None:
        self.n, self.turns, self.category = n, turns, category
        self.started: list[str] = []

    def task_ids(self, split: str | None = None) -> list[str]:
        return [f"echo_{i}" for i in range(self.n)]

    def task(self, task_id: str) -> TaskSpec:
        tool = {"type": "function", "function": {"name": "echo", "parameters": {"type": "object", "properties": {}}}}
        return TaskSpec(
            pool="echo",
            task_id=task_id,
            env_id="echo",
            category=self.category,
            split="test",
            system_prompt="sys",
            first_user_message="go",
            tools=[tool],
        )

    def start(self, task_id: str, **kwargs: Any) -> Episode:
        self.started.append(task_id)
        return EchoEpisode(self.task(task_id), self.turns)

    def gold_actions(self, task_id: str) -> list[list[ToolCall]]:
        return []


def test_malformed_calls_are_fed_back_and_counted() -> None:
    def policy(messages: list[dict[str, Any]], tools: Any) -> ChatReply:
        if messages[-1]["role"] == "user":
            return parse_assistant_output(
                '<tool_call>{"name": "echo", "arguments": {oops}</tool_call>'
                '<tool_call>{"name": "echo", "arguments": {"x": 1}}</tool_call>'
            )
        return say("ok")

    rec = AgentLoopRunner(FakeClient(policy))(EchoPool(), "echo_0")  # type: ignore[arg-type]
    assert rec.malformed_tool_calls == 2 and rec.tool_calls == 2 and rec.passed
    errors = [m for m in rec.messages if m["role"] == "tool" and m["content"].startswith("Error")]
    assert len(errors) == 2 and "invalid JSON" in errors[0]["content"]


def test_step_and_turn_limits_stop_the_episode() -> None:
    always_call = FakeClient(lambda m, t: calls(("echo", {"i": len(m)})))
    rec = AgentLoopRunner(always_call, LoopLimits(max_user_turns=5, max_steps_per_turn=3))(EchoPool(), "echo_0")  # type: ignore[arg-type]
    assert rec.stop_reason == "max_steps_per_turn" and rec.completions == 3 and rec.turns == 1
    assert not rec.passed  # verified anyway: the episode never ended

    talker = FakeClient(lambda m, t: say("hi") if sum(x["role"] == "tool" for x in m) else calls(("echo", {})))
    rec = AgentLoopRunner(talker, LoopLimits(max_user_turns=1))(EchoPool(turns=3), "echo_0")  # type: ignore[arg-type]
    assert rec.stop_reason == "max_user_turns" and rec.turns == 1


def test_model_errors() -> None:
    def too_long(m: Any, t: Any) -> ChatReply:
        raise ModelError("context length exceeded")

    rec = AgentLoopRunner(FakeClient(too_long))(EchoPool(), "echo_0")  # type: ignore[arg-type]
    assert rec.stop_reason == "model_error" and "context length" in rec.error and rec.reward == 0.0

    def down(m: Any, t: Any) -> ChatReply:
        raise InfrastructureError("connection refused")

    with pytest.raises(InfrastructureError):  # infrastructure: the driver logs and retries it later
        AgentLoopRunner(FakeClient(down))(EchoPool(), "echo_0")  # type: ignore[arg-type]


def test_runner_registry_is_the_hook_for_other_strategies() -> None:
    assert "agent_loop" in available_runners()
    ctx = RunContext(
        client=FakeClient(lambda m, t: say("x")),
        limits=LoopLimits(),
        start_kwargs={},  # type: ignore[arg-type]
        keep_transcript=False,
        options={"n": "2"},
    )

    @register_runner("test_twice")
    def _twice(ctx: RunContext) -> Any:
        inner = AgentLoopRunner(ctx.client, ctx.limits, keep_transcript=ctx.keep_transcript)

        def run(pool: EnvironmentPool, task_id: str) -> Any:
            records = [inner(pool, task_id) for _ in range(int(ctx.options["n"]))]
            best = max(records, key=lambda r: r.reward)
            best.extra["attempts"] = len(records)
            return best

        return run

    rec = build_runner("test_twice", ctx)(EchoPool(), "echo_0")
    assert rec.extra == {"attempts": 2} and rec.messages is None
    with pytest.raises(KeyError, match="unknown task runner"):
        build_runner("nope", ctx)
    with pytest.raises(ValueError, match="takes no --runner-arg"):
        build_runner("agent_loop", ctx)


def test_a_verifier_failure_is_retried_not_scored() -> None:
    """The rule of envace.rewards.score.score_episode, shared with training (which masks the sample instead,
    tests/envace/agents/test_verl_loop.py): a verifier that crashes or hangs leaves the task unscored, and the
    runner raises InfrastructureError so the driver retries it on the next run; a verifier that reports a
    configuration error aborts."""
    from envace.rewards.llm import ConfigurationError

    def failing(exc: BaseException | None, hang: bool = False) -> EchoPool:
        class Pool(EchoPool):
            def start(self, task_id: str, **kwargs: Any) -> Episode:
                episode = super().start(task_id, **kwargs)

                def verify() -> Verdict:
                    if hang:
                        time.sleep(5)
                    raise exc  # type: ignore[misc]

                episode.verify = verify  # type: ignore[method-assign]
                return episode

        return Pool(turns=1)

    ok = FakeClient(lambda m, t: say("ok"))
    with pytest.raises(InfrastructureError, match="could not be scored: .*RuntimeError: checker exploded"):
        AgentLoopRunner(ok)(failing(RuntimeError("checker exploded")), "echo_0")  # type: ignore[arg-type]
    started = time.monotonic()
    with pytest.raises(InfrastructureError, match="did not finish within 0.3s"):
        AgentLoopRunner(ok, env_timeout_s=0.3)(failing(None, hang=True), "echo_0")  # type: ignore[arg-type]
    assert time.monotonic() - started < 4
    with pytest.raises(ConfigurationError, match="bad key"):
        AgentLoopRunner(ok)(failing(ConfigurationError("bad key")), "echo_0")  # type: ignore[arg-type]
