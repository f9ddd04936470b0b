"""envace's verl agent loops (one turn engine, three observation sources) with the real BFCL pool and the
real Qwen tokenizer, driven by a scripted ``generate`` in place of the rollout server (verl's own
agent-loop tests use the same fake-server pattern; the real server path runs in the slow trainer runs:
``tests/envace/learning``, ``test_async_e2e.py``, ``test_multinode.py``)."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from omegaconf import OmegaConf
from verl.experimental.agent_loop.agent_loop import DictConfigWrap
from verl.utils.dataset.rl_dataset import RLHFDataset
from verl.workers.rollout.replica import TokenOutput

from envace.agents.engine import malformed_call_observation
from envace.agents.sources import render_rehearsal
from envace.agents.verl_loop import EnvaceAgentLoop
from envace.envs.base import END_TURN, flatten_turns, get_pool, split_turns
from envace.models import load_tokenizer
from envace.toolcall import render_tool_call

TASK = "multi_turn_base_0"
REHEARSAL_MARK = "You are the environment behind a set of tools"


class ScriptedServer:
    """Answers generate calls with scripted texts: acting replies and rehearsals from separate queues."""

    def __init__(self, tokenizer, act: list[str], rehearse: list[str] | None = None):
        self.tokenizer, self.act, self.rehearse = tokenizer, list(act), list(rehearse or [])
        self.calls: list[tuple[str, list[int], dict[str, Any]]] = []
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **_):
        role = "rehearse" if REHEARSAL_MARK in self.tokenizer.decode(prompt_ids[:200]) else "act"
        self.calls.append((role, list(prompt_ids), dict(sampling_params)))
        queue = self.rehearse if role == "rehearse" else self.act
        text = queue.pop(0) if queue else "Done."
        ids = self.tokenizer.encode(text, add_special_tokens=False)[: sampling_params.get("max_tokens", 10**9)]
        ids = ids + [self.im_end] if len(ids) < sampling_params.get("max_tokens", 10**9) else ids
        return TokenOutput(token_ids=ids, log_probs=[-0.5] * len(ids), stop_reason="completed",
                           extra_fields={"global_steps": 7, "min_global_steps": 7, "max_global_steps": 7})


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def make_loop(tokenizer, act, rehearse=None, *, source="real", response_length=4096, layout="message",
              rollout=None, agent=None, **limits):
    cfg = OmegaConf.create({
        "actor_rollout_ref": {"rollout": {"response_length": response_length, "prompt_length": 8192,
                                          "multi_turn": {}, "agent": {}, **(rollout or {})}},
        "envace": {"agent": {"act_layout": layout, "limits": {"max_steps_per_turn": 6, "max_user_turns": 8,
                                                                "max_calls_per_message": 4, **limits},
                             **(agent or {})}},
    })
    data_cfg = OmegaConf.create({"apply_chat_template_kwargs": {"enable_thinking": False}})
    server = ScriptedServer(tokenizer, act, rehearse)
    loop = EnvaceAgentLoop(trainer_config=DictConfigWrap(cfg), server_manager=server, tokenizer=tokenizer,
                           processor=None, dataset_cls=RLHFDataset, data_config=DictConfigWrap(data_cfg),
                           hf_model_type="qwen3", observation_source=source)
    return loop, server


def run(loop, task_id=TASK):
    kwargs = {"extra_info": {"pool": "bfcl_multi_turn", "task_id": task_id}, "uid": "u1", "session_id": 2}
    return loop.loop.run_until_complete(loop.run({"temperature": 1.0, "logprobs": True}, **kwargs))


def gold_replies(task_id=TASK) -> list[str]:
    replies = []
    for turn in get_pool("bfcl_multi_turn").gold_actions(task_id):
        replies.extend(render_tool_call(call) for call in turn)
        replies.append("Done.")
    return replies


def gold_observations(task_id=TASK) -> list[str]:
    """What the real environment answers to each gold call, in order."""
    ep = get_pool("bfcl_multi_turn").start(task_id)
    outs = []
    for turn in get_pool("bfcl_multi_turn").gold_actions(task_id):
        outs.extend(ep.execute(call) for call in turn)
        ep.end_turn("Done.")
    return outs


def test_real_source_gold_policy_scores_one_with_one_output_per_message(tokenizer):
    loop, server = make_loop(tokenizer, gold_replies())
    outs = run(loop)
    pool = get_pool("bfcl_multi_turn")
    gold = pool.gold_actions(TASK)
    n_calls, n_turns = sum(len(t) for t in gold), len(gold)
    assert len(outs) == len(server.calls) == n_calls + n_turns  # one output per generation
    assert all(o.reward_score == 1.0 for o in outs)
    assert {o.extra_fields["role"] for o in outs} == {"act"}
    info = outs[-1].extra_fields["reward_extra_info"]
    assert info["verify_failed"] == 0.0 and info["malformed_calls"] == 0.0 and info["user_turns"] == n_turns
    assert info["tool_calls"] == n_calls and info["act_outputs"] == len(outs) and info["rehearse_outputs"] == 0
    for out, (_role, prompt, _sp) in zip(outs, server.calls, strict=True):
        # the output's prompt is exactly what the server saw; its response only model tokens, with log-probs
        assert out.prompt_ids == prompt
        assert set(out.response_mask) == {1} and out.response_logprobs == [-0.5] * len(out.response_ids)
        assert out.extra_fields["trajectory_id"] == "u1_2" and out.extra_fields["min_global_steps"] == 7
    # token in / token out: every prompt extends the previous prompt plus its generated tokens
    for a, b in itertools.pairwise(outs):
        assert b.prompt_ids[: len(a.prompt_ids) + len(a.response_ids)] == a.prompt_ids + a.response_ids
    actions = json.loads(outs[-1].extra_fields["actions"])
    assert [{k: a[k] for k in ("name", "arguments")} for a in actions] == flatten_turns(gold)
    assert all("output" in a for a in actions if a["name"] != END_TURN)
    assert pool.replay(TASK, split_turns(actions)).reward == 1.0


def test_trajectory_layout_is_one_masked_sequence(tokenizer):
    loop, server = make_loop(tokenizer, gold_replies(), layout="trajectory")
    (out,) = run(loop)
    assert out.reward_score == 1.0 and set(out.response_mask) == {0, 1}
    assert len(out.response_ids) == len(out.response_mask) == len(out.response_logprobs)
    assert all(lp == -0.5 for lp, m in zip(out.response_logprobs, out.response_mask) if m == 1)
    assert out.prompt_ids == server.calls[0][1]
    text = tokenizer.decode(out.prompt_ids + out.response_ids)
    assert text.count("<tool_response>") == sum(len(t) for t in get_pool("bfcl_multi_turn").gold_actions(TASK))


def test_rehearse_source_feeds_rehearsals_to_the_actor_and_scores_the_real_replay(tokenizer):
    gold_obs = gold_observations()
    rehearsals = [render_rehearsal(o if o.strip().startswith(("{", "[")) else json.dumps({"result": o}))
                  for o in gold_obs]
    loop, server = make_loop(tokenizer, gold_replies(), rehearsals, source="rehearse")
    outs = run(loop)
    roles = [o.extra_fields["role"] for o in outs]
    assert roles.count("rehearse") == len(gold_obs) and roles.count("act") == len(gold_obs) + len(
        get_pool("bfcl_multi_turn").gold_actions(TASK))
    assert all(o.reward_score == 1.0 for o in outs)  # the actor's calls replayed in the real env pass
    # each rehearsal output: its own prompt (the rehearsal prompt), response = the rehearsal text
    reh = [o for o in outs if o.extra_fields["role"] == "rehearse"]
    for o, text in zip(reh, rehearsals, strict=True):
        assert REHEARSAL_MARK in tokenizer.decode(o.prompt_ids)
        assert tokenizer.decode(o.response_ids, skip_special_tokens=True) == text
        assert o.extra_fields["format_error"] == 0.0
    # the actor read the rehearsed responses, not the real ones
    act_prompts = [p for r, p, _ in server.calls if r == "act"]
    last = tokenizer.decode(act_prompts[-1])
    assert json.loads(rehearsals[0].split("\n")[1]) is not None and rehearsals[0].split("\n")[1] in last
    fid = json.loads(outs[-1].extra_fields["fidelity"])
    assert len(fid) == len(gold_obs) and all(f["error_agree"] == 1.0 for f in fid)


def test_malformed_rehearsal_ends_the_rollout_or_is_fed_back(tokenizer):
    act = [render_tool_call({"name": "ls", "arguments": {}}), "Done."]
    loop, _ = make_loop(tokenizer, act, ["the directory has two files"], source="rehearse", max_user_turns=1)
    outs = run(loop)
    assert outs[-1].extra_fields["stop_reason"] == "malformed_rehearsal"
    assert [o.extra_fields["role"] for o in outs] == ["act", "rehearse"]
    assert outs[-1].extra_fields["format_error"] == 1.0
    assert outs[-1].extra_fields["reward_extra_info"]["malformed_rehearsals"] == 1.0

    loop, server = make_loop(tokenizer, act, ["not the format"], source="rehearse", max_user_turns=1,
                             on_malformed_rehearsal="feedback")
    outs = run(loop)
    assert [o.extra_fields["role"] for o in outs] == ["act", "rehearse", "act"]
    assert "MALFORMED_REHEARSAL" in tokenizer.decode(server.calls[-1][1])


def test_malformed_and_unknown_calls_become_error_observations(tokenizer):
    act = ['<tool_call>\n{"name": "cd", "arguments": {bad json}\n</tool_call>',
           '<tool_call>\n{"name": "no_such_tool", "arguments": {}}\n</tool_call>', "Done."]
    loop, server = make_loop(tokenizer, act, max_user_turns=1)
    outs = run(loop)
    assert outs[-1].reward_score == 0.0
    assert outs[-1].extra_fields["reward_extra_info"]["malformed_calls"] == 1.0
    assert [o.extra_fields["format_error"] for o in outs] == [1.0, 0.0, 0.0]
    text = tokenizer.decode(server.calls[-1][1])
    assert malformed_call_observation("x").split("(")[0] in text and "no_such_tool" in text

    loop, server = make_loop(tokenizer, act, max_user_turns=1, on_malformed_call="end")
    outs = run(loop)
    assert len(outs) == 1 and outs[0].extra_fields["stop_reason"] == "malformed_call"


def test_calls_inside_think_are_not_executed(tokenizer):
    act = ['<think>\n<tool_call>\n{"name": "rm", "arguments": {"file_name": "x"}}\n</tool_call>\n</think>\n\nDone.']
    loop, server = make_loop(tokenizer, act, max_user_turns=1)
    outs = run(loop)
    assert len(server.calls) == 1 and outs[0].extra_fields["reward_extra_info"]["tool_calls"] == 0.0
    assert json.loads(outs[0].extra_fields["actions"]) == []


def test_limits_count_generate_calls(tokenizer):
    call = render_tool_call({"name": "ls", "arguments": {}})
    # steps per turn: 3 generations, then the episode ends (no tool ran after the cap)
    loop, server = make_loop(tokenizer, [call] * 10, max_steps_per_turn=3, max_user_turns=5)
    outs = run(loop)
    assert len(server.calls) == 3 and outs[-1].extra_fields["stop_reason"] == "max_steps_per_turn"
    assert outs[-1].extra_fields["reward_extra_info"]["tool_calls"] == 3.0
    # next_turn: the turn ends, the next user message comes
    loop, server = make_loop(tokenizer, [call] * 10, max_steps_per_turn=2, max_user_turns=2, on_step_limit="next_turn")
    outs = run(loop)
    assert len(server.calls) == 4 and outs[-1].extra_fields["stop_reason"] == "max_user_turns"
    assert outs[-1].extra_fields["reward_extra_info"]["user_turns"] == 2.0
    # calls per message: the third call of a message gets an error observation and is not executed
    three = "\n".join([call] * 3)
    loop, server = make_loop(tokenizer, [three, "Done."], max_calls_per_message=2, max_user_turns=1)
    outs = run(loop)
    info = outs[-1].extra_fields["reward_extra_info"]
    assert info["tool_calls"] == 2.0 and info["skipped_calls"] == 1.0
    assert "at most 2 tool calls" in tokenizer.decode(server.calls[-1][1])


def test_response_budget_stops_the_episode_and_caps_each_generation(tokenizer):
    """The budget (rollout.response_length) is the acting context's growth over all turns. Each generation
    may use what is left of it; the one that uses the last token ends the rollout, and its truncated call
    is neither run nor fed back. (The old form of this test checked only ``len(response) <= budget``, which
    the final slice of the output guarantees whatever the loop does.)"""
    budget = 60
    loop, server = make_loop(tokenizer, gold_replies(), response_length=budget)
    outs = run(loop)
    assert outs[-1].extra_fields["stop_reason"] == "token_budget"
    first = len(server.calls[0][1])
    budget_left = [budget - (len(p) - first) for _, p, _ in server.calls]
    assert [sp["max_tokens"] for _, _, sp in server.calls] == budget_left and min(budget_left) > 0
    assert len(server.calls) == len(outs) >= 2  # generate calls, counted: one output each
    # the last generation was cut by the budget: it used exactly what was left, and the context grew by the budget
    assert len(outs[-1].response_ids) == budget_left[-1]
    assert len(server.calls[-1][1]) - first + len(outs[-1].response_ids) == budget
    # every earlier generation was one complete call, which ran; the cut one did not run and got no feedback
    info = outs[-1].extra_fields["reward_extra_info"]
    assert info["tool_calls"] == len(server.calls) - 1 and info["malformed_calls"] == 0.0
    assert len(json.loads(outs[-1].extra_fields["actions"])) == len(server.calls) - 1


LS = render_tool_call({"name": "ls", "arguments": {}})


def test_a_message_that_spends_the_budget_exactly_runs_none_of_its_calls(tokenizer):
    """A complete, well-formed call in the message that uses the last token of the budget never runs: the
    model could never read its result."""
    n = len(tokenizer.encode(LS, add_special_tokens=False))
    for budget in (n, n + 1):  # the call alone, or the call and <|im_end|>, fill the budget
        loop, server = make_loop(tokenizer, [LS] * 5, response_length=budget)
        outs = run(loop)
        assert len(server.calls) == 1 and server.calls[0][2]["max_tokens"] == budget
        assert len(outs[0].response_ids) == budget
        assert tokenizer.decode(outs[0].response_ids, skip_special_tokens=True) == LS  # complete and parseable
        info = outs[-1].extra_fields["reward_extra_info"]
        assert outs[-1].extra_fields["stop_reason"] == "token_budget"
        assert info["tool_calls"] == 0.0 and info["malformed_calls"] == 0.0
        assert json.loads(outs[-1].extra_fields["actions"]) == []


def test_a_budget_spent_by_a_tool_response_generates_nothing_more(tokenizer):
    """The tool response (context, loss mask 0) also grows the acting context: once it reaches the budget no
    further generation is requested (not even one with max_tokens <= 0); one token short of it, exactly one
    more generation may use that last token."""
    loop, server = make_loop(tokenizer, [LS, "Done."], max_user_turns=1)
    run(loop)
    grown = len(server.calls[1][1]) - len(server.calls[0][1])  # the call, <|im_end|> and the tool response
    n = len(tokenizer.encode(LS, add_special_tokens=False))
    assert grown > n + 2
    for budget in (n + 2, grown - 1, grown):  # the response overshoots the budget ... fills it exactly
        loop, server = make_loop(tokenizer, [LS] * 5, response_length=budget)
        outs = run(loop)
        assert len(server.calls) == 1, (budget, [sp["max_tokens"] for _, _, sp in server.calls])
        info = outs[-1].extra_fields["reward_extra_info"]
        assert outs[-1].extra_fields["stop_reason"] == "token_budget" and info["tool_calls"] == 1.0
        assert [a["name"] for a in json.loads(outs[-1].extra_fields["actions"])] == ["ls"]  # within the budget: ran
    loop, server = make_loop(tokenizer, [LS] * 5, response_length=grown + 1)
    outs = run(loop)
    assert [sp["max_tokens"] for _, _, sp in server.calls] == [grown + 1, 1]
    assert outs[-1].extra_fields["stop_reason"] == "token_budget"
    assert outs[-1].extra_fields["reward_extra_info"]["tool_calls"] == 1.0  # the second (1-token) message runs nothing


def test_verifier_crash_masks_every_output_instead_of_scoring_it(tokenizer, monkeypatch):
    def boom(self):
        raise RuntimeError("checker exploded")

    episode_cls = type(get_pool("bfcl_multi_turn").start(TASK))
    monkeypatch.setattr(episode_cls, "verify", boom)
    loop, _ = make_loop(tokenizer, [render_tool_call({"name": "ls", "arguments": {}}), "Done."], max_user_turns=1)
    outs = run(loop)
    assert all(o.extra_fields["reward_extra_info"]["verify_failed"] == 1.0 for o in outs)
    assert all(set(o.response_mask) == {0} for o in outs)
    assert "checker exploded" in outs[-1].extra_fields["mask_reason"]


def test_environment_exception_is_an_error_observation(tokenizer, monkeypatch):
    episode_cls = type(get_pool("bfcl_multi_turn").start(TASK))
    monkeypatch.setattr(episode_cls, "execute", lambda self, call: (_ for _ in ()).throw(ValueError("too many digits")))
    loop, server = make_loop(tokenizer, [render_tool_call({"name": "ls", "arguments": {}}), "Done."], max_user_turns=1)
    outs = run(loop)
    assert outs[-1].extra_fields["reward_extra_info"]["env_errors"] == 1.0
    assert "the environment failed on 'ls': ValueError: too many digits" in tokenizer.decode(server.calls[-1][1])


def test_rows_without_task_reference_are_a_clear_error(tokenizer):
    loop, _ = make_loop(tokenizer, [])
    with pytest.raises(ValueError, match="extra_info.pool and extra_info.task_id"):
        loop.loop.run_until_complete(loop.run({}, extra_info={}))


# -- checklist-scored rows (CM2): rehearsal + the checklist judge over a real local endpoint ----------


def _cm2_row(tmp_path):
    """One converted CM2 row, as verl's dataset hands it to the agent loop."""
    import pyarrow.parquet as pq

    from envace.data.cm2 import convert_cm2

    tool = {"type": "function", "function": {"name": "get_order", "description": "Look an order up.",
            "parameters": {"type": "object", "properties": {"order_id": {"type": "integer"}},
                           "required": ["order_id"]}}}
    item = {"id": "i0", "question": "Did the agent look the order up?", "focus_on": "assistant.tool_calls",
            "pass_condition": "get_order called with order_id 3", "weight": 1.0}
    record = {
        "id": "r0",
        "messages": [
            {"role": "user", "content": "Where is order 3?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_order", "arguments": '{"order_id": 3}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": '{"status": "shipped"}'},
            {"role": "assistant", "content": "It has shipped."},
            {"role": "user", "content": "Thanks."},
            {"role": "assistant", "content": "You are welcome."},
        ],
        "tools": [tool],
        "checklist_list": [[[item], [dict(item, id="i1", question="Was the agent polite?", focus_on="assistant.content")]]],
    }
    src = tmp_path / "cm2.jsonl"
    src.write_text(json.dumps(record) + "\n")
    convert_cm2(src, tmp_path / "out", val_fraction=0.0)
    row = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()[0]
    return row


def make_cm2_loop(tokenizer, act, rehearse, judge_url, weight=1.0):
    cfg = OmegaConf.create({
        "actor_rollout_ref": {"rollout": {"response_length": 2048, "prompt_length": 4096, "multi_turn": {}, "agent": {}}},
        "envace": {"agent": {"limits": {"max_steps_per_turn": 4, "max_user_turns": 4}},
                   "reward": {"checklist_weight": weight,
                              "judge": {"base_urls": [judge_url], "model": "judge", "timeout_s": 2.0,
                                        "max_retries": 1, "backoff_base_s": 0.01}}},
    })
    server = ScriptedServer(tokenizer, act, rehearse)
    loop = EnvaceAgentLoop(trainer_config=DictConfigWrap(cfg), server_manager=server, tokenizer=tokenizer,
                           processor=None, dataset_cls=RLHFDataset,
                           data_config=DictConfigWrap(OmegaConf.create({"apply_chat_template_kwargs": {
                               "enable_thinking": False}})), hf_model_type="qwen3", observation_source="rehearse")
    return loop, server


def test_checklist_row_is_rehearsed_and_scored_by_the_judge(tokenizer, tmp_path, fake_openai, replies):
    row = _cm2_row(tmp_path)
    judge = fake_openai(lambda body, n: replies.verdict("order_id" in json.dumps(body)))
    act = [render_tool_call({"name": "get_order", "arguments": {"order_id": 3}}), "It shipped.", "Bye."]
    loop, _server = make_cm2_loop(tokenizer, act, [render_rehearsal('{"status": "shipped"}')], judge.base_url)
    outs = loop.loop.run_until_complete(loop.run({"temperature": 1.0, "logprobs": True}, **row, uid="u", session_id=0))
    assert [o.extra_fields["role"] for o in outs] == ["act", "rehearse", "act", "act"]
    assert judge.n_requests >= 2  # one judge call per (item, step)
    info = outs[-1].extra_fields["reward_extra_info"]
    assert info["verify_failed"] == 0.0 and 0.0 <= outs[-1].reward_score <= 1.0
    assert json.loads(outs[-1].extra_fields["fidelity"]) == []  # no real environment to compare with


def test_checklist_judge_failure_masks_the_rollout(tokenizer, tmp_path, fake_openai, replies):
    row = _cm2_row(tmp_path)
    judge = fake_openai(lambda body, n: replies.chat("not json at all"))
    loop, _ = make_cm2_loop(tokenizer, ["Hello."], [], judge.base_url)
    outs = loop.loop.run_until_complete(loop.run({"temperature": 1.0, "logprobs": True}, **row, uid="u", session_id=0))
    assert all(o.extra_fields["reward_extra_info"]["verify_failed"] == 1.0 for o in outs)
    assert all(set(o.response_mask) == {0} for o in outs)  # never a silent 0 in the loss
    assert "checklist" in outs[-1].extra_fields["mask_reason"]


def test_rows_without_an_environment_cannot_train_against_the_real_source(tokenizer, tmp_path):
    row = _cm2_row(tmp_path)
    loop, _ = make_loop(tokenizer, ["hi"])
    with pytest.raises(ValueError, match="no executable environment"):
        loop.loop.run_until_complete(loop.run({"temperature": 1.0}, **row))


def test_a_conversation_that_does_not_extend_the_tokenised_context_is_refused(tokenizer):
    from envace.agents.engine import Role
    from envace.agents.verl_loop import PrefixError, VerlPolicy

    loop, _ = make_loop(tokenizer, ["Done.", "Done."])
    policy = VerlPolicy(loop, {"logprobs": True}, loop.agent_cfg)
    messages = [{"role": "user", "content": "hi"}]
    loop.loop.run_until_complete(policy.respond(messages, None, Role.ACT))
    edited = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "Done."}]
    with pytest.raises(PrefixError):  # an earlier turn changed: it would have to be re-encoded
        loop.loop.run_until_complete(policy.respond(edited, None, Role.ACT))


# -- limits, bounds and odd model output in the training loop ------------------------------------------


def _run_task(loop, pool: str, task_id: str):
    kwargs = {"extra_info": {"pool": pool, "task_id": task_id}, "uid": "u1", "session_id": 0}
    return loop.loop.run_until_complete(loop.run({"temperature": 1.0, "logprobs": True}, **kwargs))


def test_per_message_call_cap_runs_and_counts_only_the_capped_calls(tokenizer):
    """50 calls in one message with max_calls_per_message=4: 4 run, 46 get an error observation."""
    many = "\n".join([render_tool_call({"name": "ls", "arguments": {}})] * 50)
    loop, server = make_loop(tokenizer, [many, "Done."], max_calls_per_message=4, max_user_turns=1)
    outs = run(loop)
    info = outs[-1].extra_fields["reward_extra_info"]
    assert info["tool_calls"] == 4.0 and info["skipped_calls"] == 46.0
    assert len(json.loads(outs[-1].extra_fields["actions"])) == 4  # only the 4 that ran are replayable
    assert tokenizer.decode(server.calls[-1][1]).count("at most 4 tool calls are answered per message") == 46


def test_long_observations_are_truncated_in_the_middle(tokenizer, monkeypatch):
    episode_cls = type(get_pool("bfcl_multi_turn").start(TASK))
    monkeypatch.setattr(episode_cls, "execute", lambda self, call: "HEAD" + "x" * 5000 + "TAIL")
    loop, server = make_loop(tokenizer, [render_tool_call({"name": "ls", "arguments": {}}), "Done."],
                             max_user_turns=1, max_observation_chars=200)
    run(loop)
    seen = tokenizer.decode(server.calls[-1][1])
    assert "HEAD" in seen and "TAIL" in seen and "characters truncated" in seen and "x" * 300 not in seen


def test_max_user_turns_stops_the_episode(tokenizer):
    loop, server = make_loop(tokenizer, ["Done."] * 10, max_user_turns=2)
    outs = run(loop)  # the task has 4 user turns
    assert len(server.calls) == 2 and outs[-1].extra_fields["stop_reason"] == "max_user_turns"
    assert outs[-1].extra_fields["reward_extra_info"]["user_turns"] == 2.0


def test_miss_func_reveals_the_withheld_tool_to_the_model(tokenizer):
    """BFCL miss_func adds a function at a later turn. Old behaviour: the token-in/token-out context kept the
    system prompt it had tokenised first, so the model never saw the revealed function's schema in training
    (evaluation re-sends the tool list with every request and did show it)."""
    tid = "multi_turn_miss_func_0"  # ``sort`` is withheld until user turn 4 (index 3)
    loop, server = make_loop(tokenizer, ["Done."] * 10, max_user_turns=8)
    _run_task(loop, "bfcl_multi_turn", tid)
    schema = '"name": "sort"'
    counts = [tokenizer.decode(prompt).count(schema) for _, prompt, _ in server.calls]
    assert counts == [0, 0, 0, 1, 1], counts  # announced once, at the reveal turn, and kept in the context


def test_lone_surrogates_never_reach_the_actions(tokenizer):
    """A ``\\ud800`` escape in the model's tool-call JSON decodes to a lone surrogate. Old behaviour: it went into
    the call's arguments, the ``actions`` field and the rollout dump (UnicodeEncodeError when written as UTF-8)."""
    call = '<tool_call>\n{"name": "cd", "arguments": {"folder": "doc\\ud800s"}}\n</tool_call>'
    loop, _ = make_loop(tokenizer, [call, "Done."], max_user_turns=1)
    outs = run(loop)
    actions = json.loads(outs[-1].extra_fields["actions"])
    assert actions[0]["arguments"] == {"folder": "doc\ufffds"}
    for out in outs:
        json.dumps(out.extra_fields, ensure_ascii=False).encode("utf-8")  # raised UnicodeEncodeError before


def test_a_compute_heavy_tool_call_is_stopped_and_the_model_told(tokenizer):
    """``power(base=10, exponent=10**7)`` computes for ~10 s inside one C call that holds the GIL (10**9 would
    hold the rollout worker for hours). Old behaviour: the thread-based time-out could not fire until the
    computation ended. Now the call runs first in a forked copy of the episode, is killed at
    limits.tool_timeout_s, never runs for real, and the model reads an error observation."""
    import time

    call = render_tool_call({"name": "power", "arguments": {"base": 10, "exponent": 10**7}})
    loop, server = make_loop(tokenizer, [call, "Done."], max_user_turns=1, tool_timeout_s=1.0)
    started = time.monotonic()
    outs = _run_task(loop, "bfcl_multi_turn", "multi_turn_base_15")  # involves MathAPI
    assert time.monotonic() - started < 8
    info = outs[-1].extra_fields["reward_extra_info"]
    assert info["bound_hits"] == 1.0 and info["tool_calls"] == 1.0 and info["verify_failed"] == 0.0
    assert "exceeded the time limit (1s)" in tokenizer.decode(server.calls[-1][1])
    assert json.loads(outs[-1].extra_fields["actions"]) == []  # never executed, never replayed


TELECOM0 = "telecom/[mobile_data_issue]airplane_mode_on|user_abroad_roaming_enabled_off[PERSONA:None]"


def test_tau2_in_the_training_loop_with_a_simulated_user(tokenizer, fake_openai, replies):
    """A τ² telecom task through envace's verl agent loop: the simulated user answers over a real local
    OpenAI-compatible endpoint (envace.agent.pool_kwargs.tau2.user), acts on their own phone, and τ²'s
    official evaluator scores the episode."""
    user = fake_openai(replies.script(
        replies.chat("My phone has no data."),
        replies.chat('<tool_call>{"name": "toggle_airplane_mode", "arguments": {}}</tool_call>'),
        replies.chat("I turned airplane mode off."),
        replies.chat('<tool_call>{"name": "toggle_roaming", "arguments": {}}</tool_call>'),
        replies.chat("Roaming is on and data works."),
        replies.chat("###STOP###"),
    ))
    act = [render_tool_call({"name": "get_customer_by_phone", "arguments": {"phone_number": "555-123-2002"}}),
           "Please turn off airplane mode.", "Now please turn on data roaming.", "Glad it works!"]
    cfg = OmegaConf.create({
        "actor_rollout_ref": {"rollout": {"response_length": 4096, "prompt_length": 16384, "multi_turn": {},
                                          "agent": {}}},
        "envace": {"agent": {"limits": {"max_steps_per_turn": 4, "max_user_turns": 8},
                             "pool_kwargs": {"tau2": {"domains": ["telecom"],
                                                      "user": {"base_urls": [user.base_url], "model": "user"}}}}},
    })
    server = ScriptedServer(tokenizer, act)
    loop = EnvaceAgentLoop(trainer_config=DictConfigWrap(cfg), server_manager=server, tokenizer=tokenizer,
                           processor=None, dataset_cls=RLHFDataset,
                           data_config=DictConfigWrap(OmegaConf.create({"apply_chat_template_kwargs": {
                               "enable_thinking": False}})), hf_model_type="qwen3")
    outs = _run_task(loop, "tau2", TELECOM0)
    assert [o.extra_fields["role"] for o in outs] == ["act"] * 4
    assert all(o.reward_score == 1.0 for o in outs), json.loads(outs[-1].extra_fields["verdict"])
    assert outs[-1].extra_fields["stop_reason"] == "completed"  # the user ended it (###STOP###)
    assert outs[-1].extra_fields["reward_extra_info"]["tool_calls"] == 1.0
    assert "My phone has no data." in tokenizer.decode(server.calls[0][1])


def test_an_aborted_generation_is_an_infrastructure_failure_not_an_empty_reply(tokenizer):
    """vLLM (on GPUs, under aborts from verl's partial-rollout and weight-update paths) returns an aborted request
    as an output with ``stop_reason="aborted"`` and possibly no tokens; hfcpu and the sync CPU run never do. The loop
    refuses it instead of scoring an empty ACT message as the model's reply."""
    from envace.agents.verl_loop import RolloutAbortedError

    loop, server = make_loop(tokenizer, ["Done."])
    completed = server.generate

    async def aborted(request_id, *, prompt_ids, sampling_params, **kw):
        out = await completed(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kw)
        return TokenOutput(token_ids=[], log_probs=[], stop_reason="aborted", extra_fields=out.extra_fields)

    server.generate = aborted
    with pytest.raises(RolloutAbortedError, match="aborted request .* after 0 token"):
        run(loop)


def test_a_rollouts_generations_never_overlap_under_its_request_id(tokenizer):
    """Every generation of a rollout (its act turns and its rehearsals) goes out under one request id, which verl's
    server manager uses for sticky routing; vLLM refuses a request whose id is already running, so each must finish
    before the next is sent. The server below yields to the event loop inside every call and fails on an overlap."""
    import asyncio

    loop, server = make_loop(tokenizer, gold_replies(), source="rehearse",
                             rehearse=['<execution_result>{"ok": true}</execution_result>'] * 20)
    scripted, running, ids = server.generate, set(), set()

    async def exclusive(request_id, *, prompt_ids, sampling_params, **kw):
        assert request_id not in running, f"request {request_id} sent while running"
        running.add(request_id)
        ids.add(request_id)
        try:
            await asyncio.sleep(0.001)
            return await scripted(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kw)
        finally:
            running.discard(request_id)

    server.generate = exclusive
    run(loop)
    roles = {role for role, _, _ in server.calls}
    assert roles == {"act", "rehearse"} and len(ids) == 1 and len(server.calls) > 2


# -- seeding: by the rollout's identity and the generation's index ----------------------------------------------

SEEDED_ROW = {"extra_info": {"pool": "bfcl_multi_turn", "task_id": TASK, "split": "train", "index": 5},
              "uid": "u1", "session_id": 0, "global_steps": 1}


def _sent(tokenizer, row, rollout=None, act=("Done.",), agent=None):
    """The (role, sampling parameters) and the request ids of the generations one rehearse-source rollout of ``row``
    sends: scripted acting replies (by default a final answer to every user turn) and rehearsals, the same
    generations whatever the seed."""
    loop, server = make_loop(tokenizer, list(act), ['<execution_result>{"ok": true}</execution_result>'] * 20,
                             source="rehearse", rollout={"name": "hfcpu", "seed": 42, **(rollout or {})},
                             agent=agent)
    ids = []
    generate = server.generate

    async def recording(request_id, **kw):
        ids.append(request_id)
        return await generate(request_id, **kw)

    server.generate = recording
    loop.loop.run_until_complete(loop.run({"temperature": 1.0, "logprobs": True}, **row))
    return [(role, sp) for role, _, sp in server.calls], ids


def test_each_generation_is_seeded_by_its_rollout_and_its_index(tokenizer):
    """Every generation carries ``seed`` = request_seed(rollout.seed, the rollout's identity, its index within the
    rollout): the same in a second run of the row (whose verl uid and request id are new), different for every
    generation of the rollout, and different when any part of the identity changes."""
    from envace.agents.contract import GREEDY_FIELD
    from envace.agents.verl_loop import request_seed, rollout_identity

    calls, ids = _sent(tokenizer, SEEDED_ROW, act=gold_replies())
    seeds = [sp["seed"] for _, sp in calls]
    assert {role for role, _ in calls} == {"act", "rehearse"} and len(set(ids)) == 1  # one request id: sticky
    assert seeds == [request_seed(42, rollout_identity(SEEDED_ROW), i) for i in range(len(calls))]
    assert seeds[0] == 7953218577009922051  # a pure function of its inputs: the same in every process and run
    assert len(set(seeds)) == len(seeds) and all(0 <= s < 2**63 for s in seeds)
    again, again_ids = _sent(tokenizer, {**SEEDED_ROW, "uid": "another-uuid"})  # other generations, same indices
    assert [sp["seed"] for _, sp in again] == seeds[: len(again)] and set(again_ids).isdisjoint(ids)
    vllm, _ = _sent(tokenizer, SEEDED_ROW, {"name": "vllm"})  # vLLM takes the same per-request seed
    assert [sp["seed"] for _, sp in vllm] == seeds[: len(vllm)]
    info = SEEDED_ROW["extra_info"]
    for other, rollout in [({"session_id": 1}, None), ({"global_steps": 2}, None),
                           ({"extra_info": {**info, "split": "test"}}, None),
                           ({"extra_info": {**info, "index": 6}}, None), ({GREEDY_FIELD: True}, None),
                           ({}, {"seed": 43})]:
        changed, _ = _sent(tokenizer, {**SEEDED_ROW, **other}, rollout)
        assert {sp["seed"] for _, sp in changed}.isdisjoint(seeds), (other, rollout)


def test_no_seed_goes_to_a_server_that_does_not_read_one_or_for_a_row_that_names_no_rollout(tokenizer):
    """SGLang's and TensorRT-LLM's servers are sent no ``seed``; nor is any server for a row without
    ``global_steps`` / ``session_id`` (verl's older agent-loop worker), which the server then seeds by arrival, nor
    any server with ``envace.agent.seed_requests=false``."""
    calls, _ = _sent(tokenizer, SEEDED_ROW, {"name": "vllm"}, agent={"seed_requests": False})
    assert calls and not any("seed" in sp for _, sp in calls)
    calls, _ = _sent(tokenizer, SEEDED_ROW, {"name": "sglang"})
    assert calls and not any("seed" in sp for _, sp in calls)
    calls, _ = _sent(tokenizer, {k: v for k, v in SEEDED_ROW.items() if k != "global_steps"})
    assert calls and not any("seed" in sp for _, sp in calls)


# -- the training adapter's token sequences, pinned ------------------------------------------------------------


def _token_digest(outs) -> str:
    import hashlib

    rows = [[o.prompt_ids, o.response_ids, o.response_mask, o.reward_score, o.extra_fields["role"],
             o.extra_fields["stop_reason"]] for o in outs]
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


@pytest.mark.parametrize(("source", "layout", "digest"), [
    ("real", "message", "79373ff6be927b0b"),
    ("real", "trajectory", "c49fb71604d4ea9e"),
    ("rehearse", "message", "b52af5ce2d0a99b4"),
])
def test_the_training_adapters_token_sequences_are_pinned(tokenizer, source, layout, digest):
    """A fixed episode of the synthetic learning pool (a two-call lookup chain: a malformed call, a message with a
    call over the cap, the gold calls and the gold answer) through the verl adapter with the CPU default run's
    limits. The digest covers every output's prompt ids, response ids, loss mask, reward, role and stop reason, so
    any change to how training builds its token sequences or scores them fails here (the digests were taken before
    the continuous-token bookkeeping moved into :mod:`envace.agents.token_policy`)."""
    pool = get_pool("synthetic", shapes=["act", "query", "lookup_act", "lookup_query"], renamings=False)
    tid = "syn-bank-00/t19"
    (calls,), (answer,) = pool.gold_actions(tid), pool.gold_replies(tid)
    act = ['<tool_call>\n{"name": "find_account", "arguments": {oops}\n</tool_call>',
           render_tool_call(calls[0]) + "\n" + render_tool_call(calls[0]) + "\n" + render_tool_call(calls[0]),
           render_tool_call(calls[1]), answer]
    cfg = OmegaConf.create({
        "actor_rollout_ref": {"rollout": {"response_length": 640, "prompt_length": 1024, "multi_turn": {},
                                          "agent": {}}},
        "envace": {"agent": {"act_layout": layout, "act_max_tokens": 96, "rehearse_max_tokens": 64,
                             "limits": {"max_user_turns": 2, "max_steps_per_turn": 4, "max_calls_per_message": 2,
                                        "max_observation_chars": 1000},
                             "pool_kwargs": {"synthetic": {"shapes": ["act", "query", "lookup_act", "lookup_query"],
                                                           "renamings": False}}}},
    })
    rehearse = [render_rehearsal('{"account_id": "A80", "owner": "Raj Patel"}')] * 3 + [
        render_rehearsal('{"account_id": "A80", "status": "open"}')]
    server = ScriptedServer(tokenizer, act, rehearse)
    loop = EnvaceAgentLoop(trainer_config=DictConfigWrap(cfg), server_manager=server, tokenizer=tokenizer,
                           processor=None, dataset_cls=RLHFDataset,
                           data_config=DictConfigWrap(OmegaConf.create({"apply_chat_template_kwargs": {
                               "enable_thinking": False}})), hf_model_type="qwen3", observation_source=source)
    outs = _run_task(loop, "synthetic", tid)
    info = outs[-1].extra_fields["reward_extra_info"]
    assert outs[-1].reward_score == 1.0, [(o.extra_fields["stop_reason"], tokenizer.decode(o.response_ids)) for o in outs]
    assert (info["malformed_calls"], info["skipped_calls"]) == (1.0, 1.0), (info["malformed_calls"], info["skipped_calls"])
    assert _token_digest(outs) == digest
