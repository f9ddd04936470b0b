"""The warm start's evaluation and RL validation score a model alike: one turn engine, one token-level policy, one
scoring path.

A tiny Qwen3 (real Qwen tokenizer) is fine-tuned for a few seconds on the gold trajectories of eight ``synthetic``
tasks, so that it emits tool calls — well-formed, malformed, right and wrong — and both paths then run it greedily
on those tasks: the warm start's :func:`~envace.models.warmstart.run_episodes` (in-process decoder) and verl's
validation loop (:class:`~envace.agents.verl_loop.EnvaceAgentLoop` with the real source) over a ``server_manager``
backed by the same decoder. Every generation's prompt and response ids, each stop reason and each reward must be
equal; a path that builds its prompts, applies a limit or scores differently fails here.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from envace.models import warmstart as W

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tok(qwen_tokenizer_hf):
    return qwen_tokenizer_hf


@pytest.fixture(scope="module")
def tasks():
    p = W.learning_pool()
    out = []
    for shape in dict(W.LEARNING_POOL_KWARGS)["shapes"]:
        out += [t for t in p.task_ids("train") if p.task(t).category == shape][:2]
    return out


@pytest.fixture(scope="module")
def model(tok, tasks):
    """The tiny Qwen3, trained on the tasks' ACT streams (deterministic: fixed init and seed)."""
    import torch
    from transformers import Qwen3ForCausalLM

    from envace.models.tiny import TinyQwen3Spec

    examples = [W.act_examples(W.learning_pool(), t, tok)[0] for t in tasks]
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(TinyQwen3Spec().qwen3_config()).eval()
    with W.torch_threads(1):
        W.train_sft(model, examples, max_steps=60, batch_tokens=4096, lr=1e-2, warmup_steps=5, negatives=256, seed=0)
    return model


class DecoderServer:
    """verl's ``server_manager`` over the in-process decoder (what the hfcpu server does, in the test's loop)."""

    def __init__(self, decoder):
        self.decoder = decoder

    async def generate(self, request_id, *, prompt_ids, sampling_params, **_):
        from verl.workers.rollout.replica import TokenOutput

        ids, log_probs = await self.decoder.generate(prompt_ids, sampling_params)
        return TokenOutput(token_ids=ids, log_probs=log_probs, stop_reason="completed", extra_fields={})


def _validation_loop(tok, model, settings: W.EvalSettings):
    """envace's validation agent loop (real source) configured with ``settings``, on ``model``."""
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from envace.agents.verl_loop import EnvaceAgentLoop
    from envace.models.decoder import LocalDecoder

    pool_kwargs = {k: list(v) if isinstance(v, tuple) else v for k, v in W.LEARNING_POOL_KWARGS}
    cfg = OmegaConf.create({
        "actor_rollout_ref": {"rollout": {"response_length": settings.response_length,
                                          "prompt_length": settings.prompt_length, "multi_turn": {}, "agent": {}}},
        "envace": {"agent": {"act_max_tokens": settings.act_max_tokens,
                             "rehearse_max_tokens": settings.rehearse_max_tokens,
                             "env_timeout_s": settings.env_timeout_s,
                             "limits": dataclasses.asdict(settings.limits),
                             "pool_kwargs": {"synthetic": pool_kwargs}}},
    })
    data_cfg = OmegaConf.create({"apply_chat_template_kwargs": {"enable_thinking": False}})
    server = DecoderServer(LocalDecoder(model, max_model_len=settings.max_model_len))
    return EnvaceAgentLoop(trainer_config=DictConfigWrap(cfg), server_manager=server, tokenizer=tok, processor=None,
                           dataset_cls=RLHFDataset, data_config=DictConfigWrap(data_cfg), hf_model_type="qwen3",
                           observation_source="real")


def _tight() -> W.EvalSettings:
    """Limits that bind on these tasks: one call answered per message, observations cut, short messages and
    budget, two steps per turn."""
    from envace.agents.engine import LoopLimits

    limits = LoopLimits(max_user_turns=1, max_steps_per_turn=2, max_calls_per_message=1, max_observation_chars=40)
    return W.EvalSettings(limits=limits, act_max_tokens=24, response_length=100)


@pytest.mark.parametrize("settings", [W.EvalSettings(), _tight()], ids=["cpu_default", "tight"])
def test_warm_start_evaluation_and_rl_validation_score_alike(tok, model, tasks, settings):
    with W.torch_threads(1):
        warm = W.run_episodes(model, tok, W.learning_pool(), tasks, temperature=0.0, seed=0, settings=settings)
        loop = _validation_loop(tok, model, settings)
        greedy = {"temperature": 0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": False}
        val = [loop.loop.run_until_complete(loop.run(dict(greedy), extra_info={"pool": "synthetic", "task_id": t},
                                                     uid=t, session_id=0)) for t in tasks]
    for t, w, outs in zip(tasks, warm, val, strict=True):
        assert [(o.prompt_ids, o.response_ids) for o in outs] == w["generations"], t
        assert outs[-1].extra_fields["stop_reason"] == w["stop"], t
        assert outs[-1].reward_score == w["reward"], t
        info = outs[-1].extra_fields["reward_extra_info"]
        assert (info["tool_calls"], info["malformed_calls"]) == (w["tool_calls"], w["malformed_calls"]), t
    # the comparison covers what differed between the old warm-start loop and the engine: calls run and
    # malformed ones fed back, and both outcomes scored
    assert sum(w["tool_calls"] for w in warm) > 0 and sum(w["malformed_calls"] for w in warm) > 0
    if settings == W.EvalSettings():
        assert {w["reward"] for w in warm} == {0.0, 1.0}
    else:  # the limits ended episodes, which were scored on the state they left
        assert {"token_budget", "max_steps_per_turn"} <= {w["stop"] for w in warm}


def test_eval_settings_are_the_cpu_default_runs_validation():
    """:class:`~envace.models.warmstart.EvalSettings` restates what RL validation runs under in the CPU default run;
    this keeps the two equal (a drift in either fails here)."""
    from envace.agents.engine import LoopLimits
    from envace.config import AgentConfig

    exp = OmegaConf.load(ROOT / "configs" / "experiment" / "cpu_default.yaml")
    agent = exp.envace.agent
    s = W.EvalSettings()
    val = exp.actor_rollout_ref.rollout.val_kwargs
    # validation samples at the training temperature (its greedy pass: envace.validation.greedy)
    assert agent.val_observation_source == "real" and val.do_sample is True
    assert OmegaConf.is_interpolation(val, "temperature") and val.temperature == exp.actor_rollout_ref.rollout.temperature
    assert exp.envace.validation.greedy is True
    assert s.limits == LoopLimits(**OmegaConf.to_container(agent.limits))
    assert (s.act_max_tokens, s.rehearse_max_tokens) == (agent.act_max_tokens, agent.rehearse_max_tokens)
    assert s.env_timeout_s == agent.get("env_timeout_s", AgentConfig().env_timeout_s)
    assert (s.prompt_length, s.response_length) == (exp.data.max_prompt_length, exp.data.max_response_length)
    assert s.max_model_len == exp.actor_rollout_ref.rollout.max_model_len
