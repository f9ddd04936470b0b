"""The turn engine on its own (scripted policy, tiny in-test episode), the training/evaluation parity
test (one scripted model through the verl adapter and the OpenAI adapter gives the same transcript), and
hypothesis properties of the rehearsal parser and the rehearsal prompt."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envace.agents.engine import LoopLimits, ModelError, ObservationKind, Reply, Role, StopReason, TurnEngine
from envace.agents.sources import (
    RealSource,
    RehearsalFormatError,
    RehearseSource,
    fidelity,
    parse_rehearsal,
    rehearsal_messages,
    render_rehearsal,
)
from envace.envs.base import (
    EnvironmentFault,
    EnvironmentUnavailable,
    Episode,
    TaskSpec,
    ToolCall,
    Verdict,
    get_pool,
)
from envace.toolcall import parse_tool_calls, render_tool_call

TOOLS = [{"type": "function", "function": {"name": "echo", "description": "echo",
                                           "parameters": {"type": "object", "properties": {}}}}]


class CountingEpisode(Episode):
    """Echo tool; ``turns`` user turns; records every executed call."""

    def __init__(self, turns: int = 2) -> None:
        self.spec = TaskSpec(pool="t", task_id="t0", env_id="t", category="c", split="test", system_prompt=None,
                             first_user_message="start", tools=TOOLS)
        self.turns, self.turn, self.executed = turns, 1, []

    def tools(self):
        return TOOLS

    def execute(self, call: ToolCall) -> str:
        self.executed.append(call)
        return json.dumps({"echo": call.arguments})

    def end_turn(self, text: str):
        if self.turn >= self.turns:
            return None
        self.turn += 1
        return f"turn {self.turn}"

    def verify(self) -> Verdict:
        return Verdict(reward=float(len(self.executed)), passed=True)

    def fork(self):
        raise NotImplementedError


class ScriptedPolicy:
    """Replies with the next scripted text for each role (parsed by the project's parser)."""

    def __init__(self, act: list[str], rehearse: list[str] | None = None) -> None:
        self.act, self.rehearse = list(act), list(rehearse or [])
        self.calls: list[tuple[Role, list[dict[str, Any]]]] = []

    async def respond(self, messages, tools, role):
        self.calls.append((role, json.loads(json.dumps(messages))))
        text = (self.act if role is Role.ACT else self.rehearse).pop(0) if (
            self.act if role is Role.ACT else self.rehearse) else "Done."
        p = parse_tool_calls(text)
        return Reply(text=text, content=p.content, calls=p.calls, errors=p.errors, reasoning=p.reasoning)


ECHO = render_tool_call({"name": "echo", "arguments": {"x": 1}})


def run(policy, episode=None, source=None, **limits):
    episode = episode or CountingEpisode()
    t = asyncio.run(TurnEngine(LoopLimits(**limits)).run(episode, policy, source or RealSource()))
    return t, episode


def test_turns_steps_and_calls_are_counted_exactly():
    t, ep = run(ScriptedPolicy([ECHO, "ok", "\n".join([ECHO] * 3), "bye"]), max_calls_per_message=2)
    assert t.stop_reason == "completed" and t.user_turns == 2 and len(t.steps) == 4
    assert t.tool_calls == 3 and t.skipped_calls == 1 and len(ep.executed) == 3  # no tool ran past the cap
    assert [m["role"] for m in t.messages] == ["user", "assistant", "tool", "assistant", "user", "assistant",
                                               "tool", "tool", "tool", "assistant"]
    assert [a["name"] for a in t.actions] == ["echo", "__end_turn__", "echo", "echo"]


@pytest.mark.parametrize("cap", [1, 2, 3])
def test_step_limit_counts_generate_calls(cap):
    policy = ScriptedPolicy([ECHO] * 10)
    t, ep = run(policy, max_steps_per_turn=cap)
    assert len(policy.calls) == cap and len(ep.executed) == cap and t.stop_reason == "max_steps_per_turn"
    policy = ScriptedPolicy([ECHO] * 10)
    t, ep = run(policy, CountingEpisode(turns=5), max_steps_per_turn=cap, max_user_turns=2, on_step_limit="next_turn")
    assert len(policy.calls) == 2 * cap and t.stop_reason == "max_user_turns" and t.user_turns == 2


@pytest.mark.parametrize("turns", [1, 2, 3])
def test_user_turn_limit(turns):
    policy = ScriptedPolicy(["hi"] * 10)
    t, _ = run(policy, CountingEpisode(turns=10), max_user_turns=turns)
    assert len(policy.calls) == turns and t.user_turns == turns and t.stop_reason == "max_user_turns"


def test_budget_and_model_errors_stop_without_retrying():
    class Budget(ScriptedPolicy):
        async def respond(self, messages, tools, role):
            r = await super().respond(messages, tools, role)
            r.budget_exhausted = len(self.calls) == 2
            return r

    t, ep = run(Budget([ECHO] * 5))
    assert t.stop_reason == "token_budget" and len(t.steps) == 2 and len(ep.executed) == 1  # no tool after it

    class Broken(ScriptedPolicy):
        async def respond(self, messages, tools, role):
            raise ModelError("context length exceeded")

    t, _ = run(Broken([]))
    assert t.stop_reason == "model_error" and "context length" in t.error

    class Down(ScriptedPolicy):
        async def respond(self, messages, tools, role):
            raise ConnectionError("endpoint down")

    with pytest.raises(ConnectionError):  # infrastructure: the caller retries, nothing is scored
        run(Down([]))


# -- every loop limit at its boundary: generate calls counted, no tool after a limit ---------------------------


class EndTurnEpisode(CountingEpisode):
    """CountingEpisode that also records the final text of every user turn it was handed."""

    def __init__(self, turns: int = 2) -> None:
        super().__init__(turns)
        self.ended: list[str] = []

    def end_turn(self, text: str):
        self.ended.append(text)
        return super().end_turn(text)


def echo(i: int) -> str:
    return render_tool_call({"name": "echo", "arguments": {"x": i}})


class FlaggedPolicy(ScriptedPolicy):
    """ScriptedPolicy whose ``n``-th ACT reply (1-based) is flagged: the budget is spent by it
    (``budget_exhausted``) or was already spent before it (``generated=False``: nothing was produced)."""

    def __init__(self, act: list[str], n: int, flag: str) -> None:
        super().__init__(act)
        self.n, self.flag = n, flag

    async def respond(self, messages, tools, role):
        r = await super().respond(messages, tools, role)
        if len(self.calls) == self.n:
            setattr(r, self.flag, self.flag == "budget_exhausted")
        return r


@pytest.mark.parametrize("spent_at", [1, 2, 3])
def test_no_tool_runs_once_a_reply_spends_the_budget(spent_at):
    """The reply that spends the response budget stays in the conversation, but none of its (well-formed)
    calls runs and nothing is generated after it."""
    act = ["\n".join([echo(2 * i), echo(2 * i + 1)]) for i in range(6)]
    policy = FlaggedPolicy(act, spent_at, "budget_exhausted")
    t, ep = run(policy, EndTurnEpisode(turns=1))
    assert t.stop_reason == "token_budget"
    assert len(policy.calls) == spent_at == len(t.steps)  # generate calls, counted
    ran = 2 * (spent_at - 1)
    assert [c.arguments["x"] for c in ep.executed] == list(range(ran)) and t.tool_calls == ran
    assert len(t.steps[-1].reply.calls) == 2 and t.steps[-1].observations == []
    assert t.messages[-1]["role"] == "assistant" and len(t.messages[-1]["tool_calls"]) == 2
    assert [m["role"] for m in t.messages].count("tool") == ran and ep.ended == []


@pytest.mark.parametrize("empty_at", [1, 2, 3])
def test_a_policy_with_no_budget_left_adds_nothing(empty_at):
    """``generated=False``: the policy produced nothing; the reply (even one carrying calls) is not part of
    the conversation and none of its calls runs."""
    policy = FlaggedPolicy([echo(i) for i in range(6)], empty_at, "generated")
    t, ep = run(policy, EndTurnEpisode(turns=1))
    assert t.stop_reason == "token_budget" and len(policy.calls) == empty_at
    assert len(t.steps) == empty_at - 1 and [c.arguments["x"] for c in ep.executed] == list(range(empty_at - 1))
    assert sum(m["role"] == "assistant" for m in t.messages) == empty_at - 1


@pytest.mark.parametrize(("cap", "n"), [(1, 1), (1, 2), (2, 1), (2, 2), (2, 3), (3, 3), (3, 4), (3, 6)])
def test_per_message_call_cap_boundary(cap, n):
    """Exactly the first ``cap`` calls of a message run, in order; every further call is answered with an
    error observation (one tool message per call either way)."""
    from envace.agents.engine import skipped_call_observation

    policy = ScriptedPolicy(["\n".join(echo(i) for i in range(n)), "done"])
    t, ep = run(policy, EndTurnEpisode(turns=1), max_calls_per_message=cap)
    assert t.stop_reason == "completed" and len(policy.calls) == 2
    assert [c.arguments["x"] for c in ep.executed] == list(range(min(n, cap)))
    assert t.tool_calls == min(n, cap) and t.skipped_calls == max(0, n - cap)
    tool_msgs = [m for m in t.messages if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tool_msgs] == [f"call_{i}" for i in range(n)]
    assert [m["content"] == skipped_call_observation("echo", cap) for m in tool_msgs] == [i >= cap for i in range(n)]
    assert [a["arguments"]["x"] for a in t.actions] == list(range(min(n, cap)))  # only what ran is replayable


@pytest.mark.parametrize("cap", [1, 2, 3])
@pytest.mark.parametrize("extra_turns", [0, 1, 5])
def test_user_turn_cap_boundary(cap, extra_turns):
    """``cap`` user turns run; an episode with exactly ``cap`` turns completes (it is not cut by the cap)."""
    policy = ScriptedPolicy([f"reply {i}" for i in range(20)])
    ep = EndTurnEpisode(turns=cap + extra_turns)
    t, _ = run(policy, ep, max_user_turns=cap)
    assert len(policy.calls) == cap and t.user_turns == cap and ep.ended == [f"reply {i}" for i in range(cap)]
    assert t.stop_reason == ("completed" if extra_turns == 0 else "max_user_turns")
    assert [m["role"] for m in t.messages].count("user") == cap
    assert [a["name"] for a in t.actions].count("__end_turn__") == cap - 1


@pytest.mark.parametrize("cap", [1, 2, 3])
def test_steps_per_turn_boundary(cap):
    """A final reply in the last allowed step ends the turn normally; one more tool round instead hits the
    limit: exactly ``cap`` generate calls per turn, and nothing runs after the limit."""
    policy = ScriptedPolicy([echo(i) for i in range(cap - 1)] + ["final answer"])
    t, ep = run(policy, EndTurnEpisode(turns=1), max_steps_per_turn=cap)
    assert t.stop_reason == "completed" and len(policy.calls) == cap and ep.ended == ["final answer"]
    assert len(ep.executed) == cap - 1

    policy = ScriptedPolicy([echo(i) for i in range(3 * cap + 3)])
    t, ep = run(policy, EndTurnEpisode(turns=3), max_steps_per_turn=cap)
    assert t.stop_reason == "max_steps_per_turn" and len(policy.calls) == cap and ep.ended == []
    assert [c.arguments["x"] for c in ep.executed] == list(range(cap))

    policy = ScriptedPolicy([echo(i) for i in range(3 * cap + 3)])
    t, ep = run(policy, EndTurnEpisode(turns=3), max_steps_per_turn=cap, on_step_limit="next_turn")
    assert t.stop_reason == "completed" and len(policy.calls) == 3 * cap and ep.ended == ["", "", ""]
    assert [c.arguments["x"] for c in ep.executed] == list(range(3 * cap))


def test_environment_timeout_masks_and_ends_the_rollout():
    class Slow(CountingEpisode):
        def execute(self, call):
            import time

            time.sleep(0.5)
            return "{}"

    t, _ = run(ScriptedPolicy([ECHO, ECHO]), Slow(), RealSource(timeout_s=0.05))
    assert t.masked and t.stop_reason == "timeout" and "time-out" in t.mask_reason


class RemoteEpisode(CountingEpisode):
    """A remote episode (its state in another process): calls are awaited, never run in a forked dry run."""

    remote = True

    def __init__(self, fail: BaseException | None = None, after: int = 0, delay: float = 0.0) -> None:
        super().__init__(turns=1)
        self.fail, self.after, self.delay = fail, after, delay
        self.sync_calls, self.closed = 0, 0

    def execute(self, call):  # the sync path (the fork probe would use it): must not be reached in a rollout
        self.sync_calls += 1
        return super().execute(call)

    async def aexecute(self, call):
        await asyncio.sleep(self.delay)
        if self.fail is not None and len(self.executed) >= self.after:
            raise self.fail
        self.executed.append(call)
        return json.dumps({"echo": call.arguments})

    def close(self):
        self.closed += 1


def test_remote_calls_are_awaited_without_the_forked_dry_run():
    t, ep = run(ScriptedPolicy([ECHO, ECHO, "done"]), RemoteEpisode())
    assert ep.sync_calls == 0 and len(ep.executed) == 2  # awaited once each; no probe ran execute in a child
    assert t.stop_reason == "completed" and not t.masked and t.counters()["env_unavailable"] == 0


def test_remote_episodes_overlap_their_calls_on_one_event_loop():
    """64 rollouts' calls are in flight at once on one event loop: none holds a worker thread (the default executor
    has 6 on 2 cores) while it waits on its server."""
    in_flight, peak = 0, 0

    class Tracked(RemoteEpisode):
        async def aexecute(self, call):
            nonlocal in_flight, peak
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                return await super().aexecute(call)
            finally:
                in_flight -= 1

    async def main():
        eps = [Tracked(delay=0.05) for _ in range(64)]
        engine = TurnEngine(LoopLimits())
        await asyncio.gather(*(engine.run(ep, ScriptedPolicy([ECHO] * 3 + ["done"]), RealSource()) for ep in eps))
        return eps

    eps = asyncio.run(main())
    assert all(len(ep.executed) == 3 for ep in eps) and peak == 64


@pytest.mark.parametrize(("error", "kind", "counter"), [
    (EnvironmentUnavailable("connection closed"), "env_unavailable", "env_unavailable"),
    (EnvironmentFault("content is not a list"), "env_fault", "env_faults"),
])
def test_an_environment_outage_or_fault_masks_the_rollout_and_is_counted(error, kind, counter):
    t, ep = run(ScriptedPolicy([ECHO, ECHO, ECHO]), RemoteEpisode(fail=error, after=1))
    assert len(ep.executed) == 1 and t.masked and t.stop_reason == kind and str(error) in t.mask_reason
    assert t.counters()[counter] == 1 and t.env_errors == 0  # never the model's failure
    # the same errors from an in-process episode are classified the same way
    class Local(CountingEpisode):
        def execute(self, call):
            raise error

    t, _ = run(ScriptedPolicy([ECHO]), Local())
    assert t.masked and t.stop_reason == kind and t.env_errors == 0


def test_a_rehearsed_rollout_whose_shadow_environment_is_lost_is_masked_and_named():
    """EnvACE's rehearsal reads the policy's own response; the real environment runs the call unseen (the shadow)
    for the reward. When the shadow's server is lost, the rollout cannot be scored: masked, its stop reason and
    counter name the outage (not the rehearsal's result), and no fidelity is computed against an error text."""
    ep = RemoteEpisode(fail=EnvironmentUnavailable("server gone"), after=0)
    policy = ScriptedPolicy([ECHO, "done"], [render_rehearsal('{"echo": "imagined"}')])
    t, _ = run(policy, ep, RehearseSource(policy, shadow=RealSource()))
    assert t.masked and t.stop_reason == "env_unavailable" and t.counters()["env_unavailable"] == 1
    assert "fidelity" not in t.steps[0].observations[0].meta and ep.executed == []


def test_a_remote_call_past_the_environment_timeout_masks_the_rollout():
    t, _ = run(ScriptedPolicy([ECHO, ECHO]), RemoteEpisode(delay=0.5), RealSource(timeout_s=0.05))
    assert t.masked and t.stop_reason == "timeout"


def test_rehearsal_never_touches_the_environment_without_a_shadow():
    ep = CountingEpisode(turns=1)
    policy = ScriptedPolicy([ECHO, "done"], [render_rehearsal('{"echo": "imagined"}')])
    t, _ = run(policy, ep, RehearseSource(policy))
    assert ep.executed == [] and t.tool_calls == 1
    assert t.messages[2]["content"] == '{"echo": "imagined"}'
    role, prompt = policy.calls[1]
    assert role is Role.REHEARSE and '"name": "echo"' in prompt[1]["content"]


# -- training / evaluation parity ---------------------------------------------------------------


def test_training_and_evaluation_adapters_give_the_same_transcript():
    """One scripted model, two transports: verl token in/out (VerlPolicy) and OpenAI chat (ChatPolicy)."""
    from omegaconf import OmegaConf
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap
    from verl.utils.dataset.rl_dataset import RLHFDataset
    from verl.workers.rollout.replica import TokenOutput

    from envace.agents.client import parse_assistant_output
    from envace.agents.verl_loop import EnvaceAgentLoop, VerlPolicy
    from envace.config import agent_config_from
    from envace.eval.runner import ChatPolicy, to_api_messages
    from envace.models import load_tokenizer

    pool = get_pool("bfcl_multi_turn")
    task = "multi_turn_base_0"
    script = []
    for turn in pool.gold_actions(task):
        script.append("\n".join(render_tool_call(c) for c in turn[:2]))  # two calls in one message
        script.extend(render_tool_call(c) for c in turn[2:])
        script.append('<tool_call>{"name": "cd", bad}</tool_call>')  # a malformed call, fed back
        script.append("Done.")
    tok = load_tokenizer()
    limits = {"max_steps_per_turn": 8, "max_user_turns": 8, "max_calls_per_message": 4}

    class Server:
        def __init__(self):
            self.texts = list(script)

        async def generate(self, request_id, *, prompt_ids, sampling_params, **_):
            ids = tok.encode(self.texts.pop(0), add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
            return TokenOutput(token_ids=ids, log_probs=[0.0] * len(ids), extra_fields={})

    cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": {"response_length": 8192, "prompt_length": 8192,
                                                              "multi_turn": {}, "agent": {}}},
                            "envace": {"agent": {"limits": limits}}})
    loop = EnvaceAgentLoop(trainer_config=DictConfigWrap(cfg), server_manager=Server(), tokenizer=tok, processor=None,
                           dataset_cls=RLHFDataset, data_config=DictConfigWrap(OmegaConf.create({})),
                           hf_model_type="qwen3")
    verl_policy = VerlPolicy(loop, {"logprobs": False}, agent_config_from(cfg))
    engine = TurnEngine(LoopLimits(**limits))
    train_t = loop.loop.run_until_complete(engine.run(pool.start(task), verl_policy, RealSource()))

    class Client:
        def __init__(self):
            self.texts = list(script)

        def complete(self, messages, tools=None, **_):
            return parse_assistant_output(self.texts.pop(0))

    eval_t = asyncio.run(engine.run(pool.start(task), ChatPolicy(Client()), RealSource()))  # type: ignore[arg-type]
    assert train_t.stop_reason == eval_t.stop_reason == "completed"
    assert to_api_messages(train_t.messages) == to_api_messages(eval_t.messages)
    assert train_t.actions == eval_t.actions and train_t.counters() == eval_t.counters()
    assert train_t.malformed_calls == len(pool.gold_actions(task))


# -- the rehearsal parser and prompt ---------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
containers = st.one_of(st.lists(json_values, max_size=4), st.dictionaries(st.text(max_size=8), json_values, max_size=4))


@settings(max_examples=200, deadline=None)
@given(containers, st.sampled_from(["", "<think>\nplan\n</think>\n\n", "  \n"]), st.sampled_from(["", "\n", "  "]))
def test_rehearsal_roundtrip(value, prefix, pad):
    text = json.dumps(value, ensure_ascii=False)
    parsed = parse_rehearsal(prefix + pad + render_rehearsal(text) + pad)
    assert json.loads(parsed) == value


@pytest.mark.parametrize("prefix", ["", "<think>\nplan\n</think>\n", "plan (its <think> was in the prompt)\n</think>\n"])
def test_a_think_end_inside_the_result_is_data(prefix):
    value = {"</think>": "a </think> b", "k": ["</think>"]}
    assert json.loads(parse_rehearsal(prefix + render_rehearsal(json.dumps(value)))) == value


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_rehearsal_parser_never_raises_anything_but_its_format_error(text):
    try:
        out = parse_rehearsal(text)
    except RehearsalFormatError:
        return
    assert isinstance(json.loads(out), (dict, list))


@pytest.mark.parametrize("bad", [
    '{"a": 1}',  # no tags
    "<execution_result>\n{bad}\n</execution_result>",
    "<execution_result>\n42\n</execution_result>",  # not an object / array
    "<execution_result>\n{}\n</execution_result> and some commentary",
    "<execution_result>{}</execution_result><execution_result>{}</execution_result>",
    "<think>\nnever closed <execution_result>{}</execution_result>",
    "<execution_result>\n{}\n",  # unterminated
])
def test_rehearsal_format_errors(bad):
    with pytest.raises(RehearsalFormatError):
        parse_rehearsal(bad)


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=6), st.integers() | st.text(max_size=8), max_size=4),
       st.integers(min_value=0, max_value=400))
def test_rehearsal_prompt_keeps_the_call_and_bounds_the_history(args, budget):
    from envace.agents.sources import RehearsalPrompt

    history = [{"role": "user", "content": "x" * 1000}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c0", "type": "function", "function": {"name": "echo", "arguments": args}}]}]
    msgs = rehearsal_messages(ToolCall("echo", args), history, TOOLS, cfg=RehearsalPrompt(max_history_chars=budget))
    body = msgs[1]["content"]
    assert json.dumps({"name": "echo", "arguments": args}, ensure_ascii=False) in body
    conv = body.split("# Conversation\n", 1)[1].split("\n\n# Call to answer", 1)[0]
    assert budget == 0 or len(conv) <= budget + len("...(earlier conversation omitted)...\n")


def test_fidelity_scores():
    assert fidelity('{"a": 1, "b": [1]}', '{"b": [1], "a": 1}') == {"exact": 1.0, "key_overlap": 1.0, "error_agree": 1.0}
    f = fidelity('{"a": 1, "c": 2}', '{"a": 2, "b": 2}')
    assert f["exact"] == 0.0 and f["key_overlap"] == pytest.approx(1 / 3)
    assert fidelity('{"error": "no"}', '{"a": 1}')["error_agree"] == 0.0


# -- edges found by mutation testing: limits validation, counters, truncation, what the engine records -------


def test_loop_limits_validation():
    assert LoopLimits().max_user_turns == 30
    zero = LoopLimits(max_observation_chars=0, tool_timeout_s=0, tool_memory_mb=0)  # 0: no bound
    assert (zero.max_observation_chars, zero.tool_timeout_s, zero.tool_memory_mb) == (0, 0, 0)
    LoopLimits(max_user_turns=1, max_steps_per_turn=1, max_calls_per_message=1)
    for name in ("max_user_turns", "max_steps_per_turn", "max_calls_per_message"):
        with pytest.raises(ValueError, match=f"limits.{name} must be >= 1"):
            LoopLimits(**{name: 0})
    for name in ("max_observation_chars", "tool_timeout_s", "tool_memory_mb"):
        with pytest.raises(ValueError, match=f"limits.{name} must be >= 0"):
            LoopLimits(**{name: -1})
    for name, allowed in LoopLimits.CHOICES.items():
        for value in allowed:
            assert getattr(LoopLimits(**{name: value}), name) == value
        with pytest.raises(ValueError, match=f"limits.{name} must be one of"):
            LoopLimits(**{name: "sometimes"})
    # the CLI builds LoopLimits from these names: every field, no class-level table
    assert LoopLimits.field_names() == [
        "max_user_turns", "max_steps_per_turn", "max_calls_per_message", "max_observation_chars", "on_step_limit",
        "on_malformed_call", "on_malformed_rehearsal", "tool_timeout_s", "tool_memory_mb"]


def test_transcript_counters_name_each_counter():
    from envace.agents.engine import StepRecord, Transcript

    t = Transcript(messages=[], steps=[StepRecord(turn=1, reply=Reply(text="x"))] * 2, user_turns=3, tool_calls=4,
                   malformed_calls=5, skipped_calls=6, malformed_rehearsals=7, env_errors=8, bound_hits=9,
                   env_unavailable=10, env_faults=11)
    assert t.counters() == {"user_turns": 3.0, "assistant_messages": 2.0, "tool_calls": 4.0, "malformed_calls": 5.0,
                            "skipped_calls": 6.0, "malformed_rehearsals": 7.0, "env_errors": 8.0, "bound_hits": 9.0,
                            "env_unavailable": 10.0, "env_faults": 11.0}


def test_truncate_middle_exact():
    from envace.agents.engine import truncate_middle

    text = "abcdefghij"  # 10 characters
    assert truncate_middle(text, 0) == text and truncate_middle(text, 10) == text and truncate_middle(text, 11) == text
    assert truncate_middle(text, 9) == "abcd\n...(2 characters truncated)...\nghij"
    assert truncate_middle(text, 4) == "ab\n...(6 characters truncated)...\nij"
    assert truncate_middle(text, 2) == "a\n...(8 characters truncated)...\nj"
    assert truncate_middle(text, 1) == "\n...(10 characters truncated)...\n"  # not the marker + the whole text


@settings(max_examples=100, deadline=None)
@given(st.text(min_size=1, max_size=300), st.integers(min_value=1, max_value=300))
def test_truncate_middle_keeps_both_ends_and_counts_the_cut(text, limit):
    from envace.agents.engine import truncate_middle

    out = truncate_middle(text, limit)
    if len(text) <= limit:
        assert out == text
        return
    half = limit // 2
    assert out == f"{text[:half]}\n...({len(text) - 2 * half} characters truncated)...\n{text[len(text) - half:]}"


def test_assistant_message_shape():
    from envace.agents.engine import assistant_message

    reply = Reply(text="t", content="c", calls=[ToolCall("f", {"a": 1}), ToolCall("g", {})])
    assert assistant_message(reply, ["call_3", "call_4"]) == {
        "role": "assistant", "content": "c",
        "tool_calls": [{"id": "call_3", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}},
                       {"id": "call_4", "type": "function", "function": {"name": "g", "arguments": {}}}]}
    assert assistant_message(Reply(text="t", content="only text"), []) == {"role": "assistant", "content": "only text"}
    with pytest.raises(ValueError):  # one id per call
        assistant_message(reply, ["call_3"])


class ScriptedSource:
    """Answers each call with the next scripted Observation; records the context it was given."""

    name = "scripted"

    def __init__(self, observations):
        self.observations, self.seen = list(observations), []

    async def observe(self, call, ctx):
        self.seen.append((call, ctx.call_index, json.loads(json.dumps(ctx.messages)), ctx.reply, ctx.tools,
                          ctx.limits, ctx.episode))
        return self.observations.pop(0)


def test_observations_are_counted_recorded_and_truncated():
    from envace.agents.engine import Observation

    obs = [
        Observation(text="plain"),
        Observation(text="R" * 30, real_text="real answer"),  # fidelity: the replay keeps the real text
        Observation(text="boom", kind="env_error", masked=True),  # masked without a reason: the kind is the reason
        Observation(text="stopped", kind="bound_exceeded", executed=False),
        Observation(text="bad", kind="malformed_rehearsal", masked=True, meta={"reason": "second"}),
    ]
    source = ScriptedSource(obs)
    calls = [echo(i) for i in range(5)]
    policy = ScriptedPolicy(["\n".join(calls[:2]), "\n".join(calls[2:]), "end"])
    ep = EndTurnEpisode(turns=1)
    t, _ = run(policy, ep, source, max_observation_chars=10)
    assert t.stop_reason == "completed" and t.final_text == "end" and ep.ended == ["end"]
    assert (t.tool_calls, t.env_errors, t.bound_hits, t.malformed_rehearsals) == (5, 1, 1, 1)
    assert t.masked and t.mask_reason == "env_error"  # the first masked observation decides
    assert type(t.mask_reason) is str  # plain text, whatever the kind's type
    assert [a["output"] for a in t.actions] == ["plain", "real answer", "boom", "bad"]  # no action for the stopped one
    assert [a["arguments"]["x"] for a in t.actions] == [0, 1, 2, 4]
    tool_msgs = [m for m in t.messages if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tool_msgs] == [f"call_{i}" for i in range(5)]  # ids continue across messages
    assert tool_msgs[1]["content"] == "RRRRR\n...(20 characters truncated)...\nRRRRR" and tool_msgs[0]["content"] == "plain"
    assert [o.text for s in t.steps for o in s.observations] == ["plain", "R" * 30, "boom", "stopped", "bad"]
    # each call sees the conversation before its assistant message, its position in it, the reply, tools, limits
    assert [(c.arguments["x"], i) for c, i, *_ in source.seen] == [(0, 0), (1, 1), (2, 0), (3, 1), (4, 2)]
    for call, i, before, reply, tools, limits, episode in source.seen:
        assert before[-1]["role"] == ("user" if call.arguments["x"] < 2 else "tool")
        assert reply.calls[i] == call and tools == TOOLS and limits.max_observation_chars == 10 and episode is ep
    assert len(source.seen[2][2]) == 4  # user, assistant, tool, tool


def test_a_terminating_observation_ends_the_rollout_with_its_kind():
    from envace.agents.engine import Observation

    source = ScriptedSource([Observation(text="ok"),
                             Observation(text="t/o", kind=ObservationKind.TIMEOUT, terminate=True),
                             Observation(text="never")])
    policy = ScriptedPolicy(["\n".join(echo(i) for i in range(3)), "unreached"])
    t, ep = run(policy, EndTurnEpisode(turns=1), source)
    assert t.stop_reason is StopReason.TIMEOUT and len(policy.calls) == 1 and ep.ended == []
    assert len(source.observations) == 1 and [m["role"] for m in t.messages].count("tool") == 2


def test_an_observation_that_cannot_end_a_rollout_is_refused_when_it_tries():
    """A source that sets ``terminate`` on a kind that names no stop reason (an ordinary result) is a bug in the
    source: the engine says so instead of recording a stop reason nothing counts."""
    from envace.agents.engine import Observation

    source = ScriptedSource([Observation(text="ok", kind=ObservationKind.RESULT, terminate=True)])
    with pytest.raises(ValueError, match="an observation of kind 'result' cannot end a rollout"):
        run(ScriptedPolicy([echo(0)]), EndTurnEpisode(turns=1), source)


@pytest.mark.parametrize("mode", ["feedback", "end"])
def test_malformed_calls_next_to_good_ones(mode):
    """A reply with a malformed block and a good call: the error is fed back first (a tool message without a
    call id); with on_malformed_call=end no call of that reply runs."""
    bad = '<tool_call>{"name": "echo", bad}</tool_call>'
    policy = ScriptedPolicy([bad + "\n" + echo(7) + "\n" + bad, "fin"])
    t, ep = run(policy, EndTurnEpisode(turns=1), on_malformed_call=mode)
    assert t.malformed_calls == 2
    kinds = [o.kind for o in t.steps[0].observations]
    tool_msgs = [m for m in t.messages if m["role"] == "tool"]
    assert all("tool_call_id" not in m and m["content"].startswith("Error: your tool call could not be parsed")
               for m in tool_msgs[:2])
    if mode == "end":
        assert t.stop_reason is StopReason.MALFORMED_CALL and ep.executed == [] and len(policy.calls) == 1
        assert kinds == ["malformed_call", "malformed_call"] and len(tool_msgs) == 2
    else:
        assert t.stop_reason == "completed" and [c.arguments["x"] for c in ep.executed] == [7]
        assert kinds == ["malformed_call", "malformed_call", "result"] and tool_msgs[2]["tool_call_id"] == "call_0"


def test_skipped_calls_are_observations_of_kind_skipped():
    policy = ScriptedPolicy(["\n".join(echo(i) for i in range(3)), "fin"])
    t, _ = run(policy, EndTurnEpisode(turns=1), max_calls_per_message=1)
    assert [o.kind for o in t.steps[0].observations] == [ObservationKind.RESULT, *[ObservationKind.SKIPPED] * 2]
    assert all(isinstance(o.kind, ObservationKind) for o in t.steps[0].observations)


def test_episode_done_stops_before_the_next_generation():
    class DoneAfterOne(EndTurnEpisode):
        @property
        def done(self):
            return len(self.executed) >= 1

    policy = ScriptedPolicy([echo(0), echo(1)])
    t, ep = run(policy, DoneAfterOne(turns=3))
    assert t.stop_reason is StopReason.EPISODE_DONE and len(policy.calls) == 1 and len(ep.executed) == 1


def test_user_turns_are_recorded_in_messages_and_actions():
    policy = ScriptedPolicy([echo(0), "first", "second"])
    t, ep = run(policy, EndTurnEpisode(turns=2))
    assert t.stop_reason == "completed" and t.final_text == "second" and ep.ended == ["first", "second"]
    assert [m["content"] for m in t.messages if m["role"] == "user"] == ["start", "turn 2"]
    assert t.actions[1] == {"name": "__end_turn__", "arguments": {}} and len(t.actions) == 2
    assert t.actions[0] == {"name": "echo", "arguments": {"x": 0}, "output": json.dumps({"echo": {"x": 0}})}
    assert [s.turn for s in t.steps] == [1, 1, 2]
