"""The envace_env agent loop with the real BFCL pool and the real Qwen tokenizer, driven by a scripted
policy in place of the rollout server (verl's own agent-loop tests use the same fake-server pattern;
the real server path runs in tests/envace/test_train_e2e.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from omegaconf import OmegaConf

from verl.experimental.agent_loop.agent_loop import DictConfigWrap
from verl.utils.dataset.rl_dataset import RLHFDataset
from verl.workers.rollout.replica import TokenOutput

from envace.agents.env_loop import EnvAgentLoop, truncate_middle
from envace.envs.base import END_TURN, flatten_turns, get_pool, split_turns
from envace.models import load_tokenizer
from envace.toolcall import render_tool_call

TASK = "multi_turn_base_0"


class ScriptedServer:
    """Answers each generate call with the next scripted assistant text (tokenized), with log-probs."""

    def __init__(self, tokenizer, replies: list[str]):
        self.tokenizer, self.replies, self.prompts = tokenizer, list(replies), []

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **_):
        self.prompts.append(list(prompt_ids))
        text = self.replies.pop(0) if self.replies else "Done."
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.convert_tokens_to_ids("<|im_end|>")]
        return TokenOutput(token_ids=ids, log_probs=[-0.5] * len(ids), stop_reason="completed",
                           extra_fields={"global_steps": 7, "min_global_steps": 7, "max_global_steps": 7})


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def make_loop(tokenizer, replies, response_length=4096, **agent):
    cfg = OmegaConf.create({
        "actor_rollout_ref": {"rollout": {"response_length": response_length, "prompt_length": 8192,
                                          "multi_turn": {}, "agent": {}}},
        "envace": {"agent": {"max_steps_per_turn": 4, "max_user_turns": 8, "max_calls_per_step": 4,
                             "max_observation_chars": 2000, "pool_kwargs": {}, **agent}},
    })
    data_cfg = OmegaConf.create({"apply_chat_template_kwargs": {"enable_thinking": False}})
    server = ScriptedServer(tokenizer, replies)
    loop = EnvAgentLoop(trainer_config=DictConfigWrap(cfg), server_manager=server, tokenizer=tokenizer,
                        processor=None, dataset_cls=RLHFDataset, data_config=DictConfigWrap(data_cfg),
                        hf_model_type="qwen3")
    return loop, server


def run(loop, task_id=TASK):
    kwargs = {"extra_info": {"pool": "bfcl_multi_turn", "task_id": task_id}}
    return loop.loop.run_until_complete(loop.run({"temperature": 1.0, "logprobs": True}, **kwargs))


def gold_replies(task_id=TASK) -> list[str]:
    replies = []
    for turn in get_pool("bfcl_multi_turn").gold_actions(task_id):
        replies.extend(render_tool_call(call) for call in turn)
        replies.append("Done.")
    return replies


def test_a_policy_that_emits_the_gold_calls_scores_one(tokenizer):
    loop, server = make_loop(tokenizer, gold_replies())
    out = run(loop)
    assert out.reward_score == 1.0
    info = out.extra_fields["reward_extra_info"]
    assert info["verify_failed"] == 0.0 and info["tool_call_parse_errors"] == 0.0
    n_turns = len(get_pool("bfcl_multi_turn").gold_actions(TASK))
    assert info["user_turns"] == n_turns
    assert len(out.response_ids) == len(out.response_mask) == len(out.response_logprobs)
    # model tokens carry mask 1 and their log-probs; environment/user tokens mask 0 and log-prob 0
    assert set(out.response_mask) == {0, 1}
    assert all(lp == -0.5 for lp, m in zip(out.response_logprobs, out.response_mask) if m == 1)
    assert all(lp == 0.0 for lp, m in zip(out.response_logprobs, out.response_mask) if m == 0)
    # every generate call continued the same token stream (no re-rendering drift)
    for a, b in zip(server.prompts, server.prompts[1:]):
        assert b[: len(a)] == a
    text = tokenizer.decode(out.prompt_ids + out.response_ids)
    n_calls = sum(len(t) for t in get_pool("bfcl_multi_turn").gold_actions(TASK))
    assert text.count("<tool_response>") == n_calls and info["tool_calls"] == n_calls
    assert out.extra_fields["min_global_steps"] == 7 and out.extra_fields["task_id"] == TASK
    # the recorded action sequence replays to the same verdict through the pool
    pool = get_pool("bfcl_multi_turn")
    actions = json.loads(out.extra_fields["actions"])
    assert [{k: a[k] for k in ("name", "arguments")} for a in actions] == flatten_turns(pool.gold_actions(TASK))
    assert all("output" in a for a in actions if a["name"] != END_TURN)
    assert pool.replay(TASK, split_turns(actions)).reward == 1.0


def test_malformed_and_unknown_calls_become_error_observations(tokenizer):
    replies = ['<tool_call>\n{"name": "cd", "arguments": {bad json}\n</tool_call>',
               '<tool_call>\n{"name": "no_such_tool", "arguments": {}}\n</tool_call>', "Done."]
    loop, _ = make_loop(tokenizer, replies, max_user_turns=1)
    out = run(loop)
    assert out.reward_score == 0.0
    assert out.extra_fields["reward_extra_info"]["tool_call_parse_errors"] == 1.0
    text = tokenizer.decode(out.response_ids)
    assert "Error: malformed tool call" in text and "no_such_tool" in text


def test_response_budget_stops_the_episode(tokenizer):
    loop, _ = make_loop(tokenizer, gold_replies(), response_length=40)
    out = run(loop)
    assert len(out.response_ids) <= 40 and len(out.response_mask) <= 40


def test_verifier_crash_masks_the_sample_instead_of_scoring_it(tokenizer, monkeypatch):
    def boom(self):
        raise RuntimeError("checker exploded")

    episode_cls = type(get_pool("bfcl_multi_turn").start(TASK))
    monkeypatch.setattr(episode_cls, "verify", boom)
    loop, _ = make_loop(tokenizer, ["Done."], max_user_turns=1)
    out = run(loop)
    assert out.extra_fields["reward_extra_info"]["verify_failed"] == 1.0
    assert set(out.response_mask) == {0}
    assert "checker exploded" in out.extra_fields["verdict"]


def test_rows_without_task_reference_are_a_clear_error(tokenizer):
    loop, _ = make_loop(tokenizer, [])
    with pytest.raises(ValueError, match="extra_info.pool and extra_info.task_id"):
        loop.loop.run_until_complete(loop.run({}, extra_info={}))


def test_truncate_middle():
    assert truncate_middle("abc", 10) == "abc"
    t = truncate_middle("x" * 50 + "y" * 50, 20)
    assert t.startswith("x" * 10) and t.endswith("y" * 10) and "80 characters truncated" in t
