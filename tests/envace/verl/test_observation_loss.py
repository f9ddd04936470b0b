"""ECHO's observation loss (envace/verl/observation_loss.py): on a real trajectory-layout sample (envace's agent loop,
``observation_source=real``, the real BFCL environment and the real Qwen tokenizer, a scripted rollout server whose
generated tokens are recorded) with the tiny Qwen3's log-probabilities, through the loss function the trainer
installs on verl's actor (``set_loss_fn``) and verl's own ``ppo_loss`` inside it: the policy gradient never reaches
an observation token, and the auxiliary term reaches exactly the observation tokens, never an action token, a
prompt token, padding or a masked rollout. Then the same on random batches (hypothesis), the installation, and the
pre-flight's refusals."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf
from verl.experimental.agent_loop.agent_loop import DictConfigWrap
from verl.utils import tensordict_utils as tu
from verl.utils.dataset.rl_dataset import RLHFDataset
from verl.workers.rollout.replica import TokenOutput

from envace.agents.verl_loop import EnvaceAgentLoop
from envace.config import validate_envace_config
from envace.envs.base import get_pool
from envace.models import ensure_tiny_model, load_tokenizer
from envace.toolcall import render_tool_call
from envace.train import main
from envace.verl.config import compose
from envace.verl.observation_loss import NLL_METRIC, TOKENS_METRIC, ObservationLossMixin, install

TASK = "multi_turn_base_0"
COEF = 0.01


class ScriptedServer:
    """The rollout server, scripted with TASK's gold calls and a closing reply per user turn; records every call's
    prompt and the tokens it generated (the action tokens, known independently of any mask)."""

    def __init__(self, tokenizer, replies: list[str]):
        self.tokenizer, self.replies = tokenizer, list(replies)
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.calls: list[tuple[list[int], list[int]]] = []

    async def generate(self, request_id, *, prompt_ids, sampling_params, **_):
        text = self.replies.pop(0) if self.replies else "Done."
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.im_end]
        self.calls.append((list(prompt_ids), ids))
        return TokenOutput(token_ids=ids, log_probs=[-0.5] * len(ids), stop_reason="completed")


class WorkerGroup:
    """verl's actor worker group, as far as the installation reaches it."""

    def __init__(self):
        self.loss_fns = []

    def set_loss_fn(self, loss_fn):
        self.loss_fns.append(loss_fn)


@pytest.fixture(scope="module")
def loss_fn():
    """The loss function the trainer installs for ``experiment=echo_cpu`` (coefficient COEF)."""
    cfg = compose(["experiment=echo_cpu"])
    assert cfg.envace.loss.observation_nll_coef == COEF
    wg = WorkerGroup()
    assert install(wg, cfg, COEF)
    (fn,) = wg.loss_fns
    return fn


@pytest.fixture(scope="module")
def trajectory():
    """A real trajectory-layout sample of TASK and, per response position, whether the policy generated it."""
    tokenizer = load_tokenizer()
    replies = []
    for turn in get_pool("bfcl_multi_turn").gold_actions(TASK):
        replies += [render_tool_call(call) for call in turn] + ["Done."]
    cfg = OmegaConf.create({
        "actor_rollout_ref": {"rollout": {"response_length": 4096, "prompt_length": 8192, "multi_turn": {},
                                          "agent": {}}},
        "envace": {"agent": {"observation_source": "real", "act_layout": "trajectory",
                             "limits": {"max_steps_per_turn": 6, "max_user_turns": 8, "max_calls_per_message": 4}}},
    })
    server = ScriptedServer(tokenizer, replies)
    loop = EnvaceAgentLoop(trainer_config=DictConfigWrap(cfg), server_manager=server, tokenizer=tokenizer,
                           processor=None, dataset_cls=RLHFDataset,
                           data_config=DictConfigWrap(OmegaConf.create({"apply_chat_template_kwargs":
                                                                        {"enable_thinking": False}})),
                           hf_model_type="qwen3", observation_source="real")
    kwargs = {"extra_info": {"pool": "bfcl_multi_turn", "task_id": TASK}, "uid": "u", "session_id": 0}
    (out,) = loop.loop.run_until_complete(loop.run({"temperature": 1.0, "logprobs": True}, **kwargs))
    assert out.reward_score == 1.0
    prompt, response = out.prompt_ids, out.response_ids
    action = [False] * len(response)
    for call_prompt, generated in server.calls:  # token in / token out: each generation lands after its prompt
        start = len(call_prompt) - len(prompt)
        assert response[start:start + len(generated)] == generated
        action[start:start + len(generated)] = [True] * len(generated)
    assert 0 < sum(action) < len(response)
    return prompt, response, out.response_mask, action, server.calls[0][1]


@pytest.fixture(scope="module")
def logprobs(trajectory):
    """The tiny Qwen3's log-probability of every token of the sample given the ones before it, at position t for
    token t + 1 (verl's layout of ``model_output["log_probs"]``; the last position predicts nothing: 0)."""
    from transformers import AutoModelForCausalLM

    prompt, response, *_ = trajectory
    model = AutoModelForCausalLM.from_pretrained(str(ensure_tiny_model()), torch_dtype=torch.float32)
    ids = torch.tensor(prompt + response)
    with torch.no_grad():
        logits = model(ids[None]).logits[0]
    lp = torch.log_softmax(logits[:-1].float(), dim=-1).gather(-1, ids[1:, None])[:, 0]
    return torch.cat([lp, torch.zeros(1)])


def micro_batch(rows):
    """A micro-batch as verl's engine hands the actor's loss function: jagged tensors per row (prompt, response,
    response mask, old log-probs, advantages), the global batch info, and ``model_output["log_probs"]`` over whole
    sequences from one leaf tensor of per-position log-probs. ``rows``: (prompt, response, mask, advantage,
    log-probs over prompt + response). Returns (data, model_output, leaf)."""
    def jagged(values, dtype):
        return torch.nested.as_nested_tensor([torch.tensor(v, dtype=dtype) for v in values], layout=torch.jagged)

    prompts, responses, masks, advantages, lps = zip(*rows, strict=True)
    lps = [torch.as_tensor(lp, dtype=torch.float32) for lp in lps]
    old = [lp[len(p) - 1:len(p) - 1 + len(r)].tolist() for p, r, lp in zip(prompts, responses, lps, strict=True)]
    data = tu.get_tensordict({
        "prompts": jagged(prompts, torch.int64),
        "responses": jagged(responses, torch.int64),
        "response_mask": jagged(masks, torch.int64),
        "old_log_probs": jagged(old, torch.float32),
        "advantages": jagged([[a] * len(r) for a, r in zip(advantages, responses, strict=True)], torch.float32),
    })
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=int(sum(sum(m) for m in masks)),
                         global_batch_size=len(rows))
    leaf = torch.cat(lps).requires_grad_(True)
    offsets = torch.tensor([0] + [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]).cumsum(0)
    return data, {"log_probs": torch.nested.nested_tensor_from_jagged(leaf, offsets)}, leaf


def gradients(fn, rows, coef):
    """(d loss / d log-prob of every token position, metrics) of the installed loss at ``coef``."""
    data, model_output, leaf = micro_batch(rows)
    loss, metrics = fn(model_output=model_output, data=data, dp_group=None, coef=coef)
    loss.backward()
    return leaf.grad, metrics


def positions(rows):
    """Per row, the index in the leaf of the log-prob of each response token (position t holds token t + 1's)."""
    out, start = [], 0
    for prompt, response, *_ in rows:
        out.append([start + len(prompt) - 1 + j for j in range(len(response))])
        start += len(prompt) + len(response)
    return out, start


def test_the_policy_gradient_skips_observations_and_the_observation_loss_covers_exactly_them(loss_fn, trajectory,
                                                                                             logprobs):
    prompt, response, mask, action, first = trajectory
    # the agent loop masks out of the policy gradient exactly what the policy did not generate
    assert [m == 1 for m in mask] == action
    rows = [
        (prompt, response, mask, 1.0, logprobs),  # the trajectory sample
        (prompt, first, [1] * len(first), -0.5, logprobs[:len(prompt) + len(first)]),  # a `message`-layout row
        (prompt, response, [0] * len(response), 0.7, logprobs),  # the same rollout, masked (its reward failed)
    ]
    pg, _ = gradients(loss_fn, rows, coef=0.0)
    full, metrics = gradients(loss_fn, rows, coef=COEF)
    aux = full - pg  # the auxiliary term's gradient (the policy-gradient part is computed identically)
    (traj, message, masked), total = positions(rows)
    obs = torch.zeros(total, dtype=torch.bool)
    obs[[p for p, a in zip(traj, action, strict=True) if not a]] = True
    act = torch.zeros(total, dtype=torch.bool)
    act[[p for p, a in zip(traj, action, strict=True) if a] + message] = True

    assert not pg[obs].any(), f"the policy gradient reaches {int((pg[obs] != 0).sum())} observation tokens"
    assert (pg[act] != 0).all() and not pg[~act].any()  # every action token, and nothing else (prompts, masked row)
    assert not aux[act].any(), f"the auxiliary loss reaches {int((aux[act] != 0).sum())} of {int(act.sum())} action tokens"
    assert not aux[masked].any(), "the auxiliary loss reaches the masked rollout"
    assert not aux[~obs & ~act].any(), "the auxiliary loss reaches prompt tokens"
    assert (aux[obs] != 0).all(), f"the auxiliary loss misses {int((aux[obs] == 0).sum())} observation tokens"
    # its value: the trajectory's mean observation NLL over the mini-batch's 3 samples; the tokens it covers
    obs_lp = logprobs[torch.tensor(traj)[~torch.tensor(action)]]
    assert metrics[TOKENS_METRIC].aggregate() == len(obs_lp) == sum(1 for a in action if not a)
    assert metrics[NLL_METRIC].aggregate() == pytest.approx(float(-obs_lp.mean()) / 3, rel=1e-5)


@st.composite
def batches(draw):
    """Rows of random prompt and response lengths and response masks (all-1 rows: `message` layout; all-0: masked
    rollouts), random log-probs."""
    rows = []
    for _ in range(draw(st.integers(1, 4))):
        p, r = draw(st.integers(1, 4)), draw(st.integers(1, 7))
        mask = draw(st.lists(st.integers(0, 1), min_size=r, max_size=r))
        lp = draw(st.lists(st.floats(-8.0, -0.01), min_size=p + r, max_size=p + r))
        rows.append((list(range(3, 3 + p)), list(range(10, 10 + r)), mask, draw(st.sampled_from([-1.0, 0.5])), lp))
    return rows


@settings(max_examples=60, deadline=None)
@given(rows=batches())
def test_the_observation_loss_reaches_the_masked_response_tokens_of_trained_rows_only(loss_fn, rows):
    assume(any(any(mask) for _, _, mask, _, _ in rows))  # verl's token mean divides by the batch's trained tokens
    pg, _ = gradients(loss_fn, rows, coef=0.0)
    full, metrics = gradients(loss_fn, rows, coef=COEF)
    where, total = positions(rows)
    obs = torch.zeros(total, dtype=torch.bool)
    for (_, _, mask, _, _), idx in zip(rows, where, strict=True):
        if any(mask):
            obs[[i for i, m in zip(idx, mask, strict=True) if m == 0]] = True
    assert ((full - pg) != 0).tolist() == obs.tolist()
    assert metrics[TOKENS_METRIC].aggregate() == int(obs.sum())


def test_the_loss_is_installed_only_with_a_coefficient_and_travels_to_the_workers():
    cfg = compose(["experiment=echo_cpu"])
    off = WorkerGroup()
    assert not install(off, compose([]), 0.0) and off.loss_fns == []
    wg = WorkerGroup()
    assert install(wg, cfg, COEF)
    (fn,) = wg.loss_fns
    copy = pickle.loads(pickle.dumps(fn))  # Ray pickles it to every worker
    assert copy.keywords["coef"] == COEF and copy.keywords["config"].loss_agg_mode == "token-mean"

    class VerlTrainer:
        def init(self):
            self.actor_rollout_wg = WorkerGroup()

    class Trainer(ObservationLossMixin, VerlTrainer):
        pass

    for overrides, installed in ((["experiment=echo_cpu"], 1), ([], 0)):
        trainer = Trainer()
        trainer.config = compose(overrides)
        trainer.envace_config = validate_envace_config(trainer.config)
        trainer.init()
        assert len(trainer.actor_rollout_wg.loss_fns) == installed


#: configs the pre-flight refuses with the option on, and what its one line names
REFUSED = [
    (["envace.loss.observation_nll_coef=0.1"],
     "envace.loss.observation_nll_coef=0.1 trains on the real environment's observation tokens"),
    (["experiment=echo_cpu", "envace.agent.act_layout=message"], "act_layout=message"),
    (["experiment=echo_cpu", "envace.agent.observation_source=rehearse"], "observation_source=rehearse"),
    (["experiment=echo_cpu", "envace.agent.simulated_envs=[syn-bank-*]", "envace.agent.worldbook=auto"],
     "simulated_envs"),
    (["experiment=echo_cpu", "envace.loss.observation_nll_coef=-1"], "envace.loss.observation_nll_coef must be >= 0"),
    (["experiment=echo_cpu", "trainer.v1.trainer_mode=sync"], "trainer.v1.trainer_mode=sync"),
]


@pytest.mark.parametrize(("overrides", "says"), REFUSED, ids=[o[-1] for o, _ in REFUSED])
def test_the_preflight_refuses_the_option_where_no_observation_token_is_trained(tmp_path, capsys, overrides, says):
    assert main(["--preflight-only", *overrides, f"trainer.default_local_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("envace: config error: ") and says in err[0], err
    assert not Path(tmp_path / "run").exists()
