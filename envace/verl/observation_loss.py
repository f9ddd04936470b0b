"""ECHO's observation loss: a negative log-likelihood on the real environment's observation tokens, added to verl's
policy loss (``envace.loss.observation_nll_coef``; 0 leaves verl's loss as it is).

**The loss.** ECHO (arXiv 2605.24517) trains the policy with GRPO and, on the same rollouts, with a supervised loss
that makes it predict what the real environment answered. For a mini-batch B of training samples, sample i holding
the observation positions O_i (the tokens of its response the environment wrote, not the policy)::

    L(θ) = L_PG(θ) + λ · L_obs(θ),      L_obs(θ) = (1 / |B|) Σ_{i ∈ B} (1 / |O_i|) Σ_{t ∈ O_i} −log π_θ(x_{i,t} | x_{i,<t})

L_PG is verl's policy loss exactly as configured (its clipping, its KL and entropy terms), over the policy's own
tokens only (the response mask); L_obs only over O_i; λ is ``envace.loss.observation_nll_coef``. A sample without an
observation token adds 0 to the sum and counts in |B|. The average over samples of each sample's mean is verl's
``seq-mean-token-mean`` aggregation (``agg_loss``) with the mini-batch's global sample count, which verl hands every
micro-batch; it keeps the loss the same however the mini-batch is split into micro-batches or over data-parallel
ranks (verl hands no global count of observation tokens, which a token mean over the mini-batch would need). The
log-probabilities are verl's, of the logits divided by ``actor_rollout_ref.rollout.temperature``: at 1.0 the model's
own distribution.

**Where the observation tokens are.** Only ``envace.agent.observation_source=real`` with
``envace.agent.act_layout=trajectory`` puts them in a sample (pre-flight refuses the option otherwise): the agent
loop (``envace/agents/verl_loop.py``) then makes one sample per rollout whose response is the whole acting context
after the prompt: the policy's messages (response mask 1) interleaved with what it did not write (mask 0): the tool
responses, a later user turn, and the chat template's tokens that frame each. So O_i is every response position with
mask 0, in a sample that has some mask 1: a rollout masked because its reward could not be judged has mask 0
everywhere and is left out of both terms. Padding is told apart by the response's own length. A sample of the
``message`` layout has no mask 0 inside its response, so its O_i is empty.

**The seam.** verl 0.9.1 calls a registered policy loss (``register_policy_loss``) with the old and new log-probs,
the advantages and ``response_mask`` only, and that mask is 0 on observation and on padding positions alike: nothing
in the call tells them apart, so a registered policy loss cannot find O_i. The next seam up is the actor's loss
function: verl's actor worker builds ``partial(ppo_loss, config=actor_config)`` and exposes ``set_loss_fn``, the
worker method verl's own trainer uses to install the critic's loss; a loss function receives the micro-batch (the
``responses`` and ``response_mask``, whose lengths tell observation from padding) and the model's log-probs over
whole sequences. :func:`observation_ppo_loss` calls verl's ``ppo_loss`` unchanged and adds λ·L_obs; nothing of verl
is patched. :class:`ObservationLossMixin` installs it once verl has built the workers (after ``PPOTrainer.init``,
before ``fit``); the pieces of verl it relies on are pinned in ``tests/envace/verl/test_verl_pins.py``.

**Metrics** (verl prefixes a worker's loss metrics with ``actor/``): ``actor/observation_nll``, L_obs of each update
(aggregated as verl aggregates ``actor/pg_loss``), and ``actor/observation_tokens``, the observation tokens of each
update's mini-batch over all ranks; a step logs their mean over its updates.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from omegaconf import DictConfig
from tensordict import TensorDict
from verl.trainer.ppo.core_algos import agg_loss
from verl.utils.metric import AggregationType, Metric
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import no_padding_2_padding

from envace.config import ConfigError

__all__ = ["AGGREGATION", "NLL_METRIC", "TOKENS_METRIC", "ObservationLossMixin", "check_config", "install",
           "observation_mask", "observation_nll", "observation_ppo_loss"]

#: verl's aggregation of L_obs (``agg_loss``): the mean over samples of each sample's mean over its observations
AGGREGATION = "seq-mean-token-mean"
NLL_METRIC = "actor/observation_nll"
TOKENS_METRIC = "actor/observation_tokens"


def _response_lengths(data: TensorDict) -> torch.Tensor:
    """Each row's response length without padding, read as verl's ``no_padding_2_padding`` reads it."""
    responses = data["responses"]
    if responses.is_nested:
        return responses.offsets().diff()
    return data["attention_mask"][:, data["prompts"].shape[1]:].sum(dim=1)


def observation_mask(data: TensorDict, width: int) -> torch.Tensor:
    """(rows, ``width``) booleans, the padded response positions of the observation tokens O_i: inside the response,
    response mask 0, in a row with some response mask 1 (see the module docstring)."""
    mask = data["response_mask"]
    mask = mask.to_padded_tensor(0) if mask.is_nested else mask
    mask = torch.nn.functional.pad(mask, (0, width - mask.shape[1]))
    inside = torch.arange(width, device=mask.device) < _response_lengths(data).to(mask.device)[:, None]
    trained_row = (mask != 0).any(dim=1, keepdim=True)
    return inside & (mask == 0) & trained_row


def observation_nll(log_prob: torch.Tensor, mask: torch.Tensor, data: TensorDict) -> torch.Tensor:
    """L_obs of one micro-batch, normalised over the global mini-batch as verl normalises its policy loss."""
    return agg_loss(loss_mat=-log_prob, loss_mask=mask.to(log_prob.dtype), loss_agg_mode=AGGREGATION,
                    dp_size=data["dp_size"], global_batch_size=data["global_batch_size"])


def observation_ppo_loss(config: Any, model_output: dict[str, Any], data: TensorDict, dp_group: Any = None, *,
                         coef: float) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's ``ppo_loss`` plus ``coef`` · L_obs, with its metrics; called by verl's engine as the actor's loss
    function (``loss_function(model_output=..., data=..., dp_group=...)``)."""
    loss, metrics = ppo_loss(config, model_output, data, dp_group)
    log_prob = no_padding_2_padding(model_output["log_probs"], data)
    mask = observation_mask(data, log_prob.shape[1])
    nll = observation_nll(log_prob, mask, data)
    metrics[NLL_METRIC] = Metric(value=nll.detach(), aggregation=metrics["actor/pg_loss"].aggregation)
    # verl averages a summed metric over the ranks: dp_size x each rank's count is the mini-batch's total
    metrics[TOKENS_METRIC] = Metric(value=float(mask.sum()) * data["dp_size"], aggregation=AggregationType.SUM)
    return loss + coef * nll, metrics


def install(worker_group: Any, config: DictConfig, coef: float) -> bool:
    """Make :func:`observation_ppo_loss` the actor's loss function on every worker of ``worker_group`` (verl's
    ``set_loss_fn``), with the actor config verl's worker builds its own ``ppo_loss`` from; with ``coef`` 0 nothing
    changes. Returns whether it installed."""
    if not coef:
        return False
    from verl.utils.config import omega_conf_to_dataclass

    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    worker_group.set_loss_fn(partial(observation_ppo_loss, config=actor, coef=float(coef)))
    return True


class ObservationLossMixin:
    """Installs the observation loss (:func:`install`) once verl's ``init`` has built the workers; placed before one
    of verl's V1 trainers, on a trainer that carries the typed ``envace`` group as ``envace_config``."""

    def init(self) -> None:
        super().init()
        install(self.actor_rollout_wg, self.config, self.envace_config.loss.observation_nll_coef)


def check_config(cfg: DictConfig, coef: float) -> None:
    """Pre-flight: with ``coef`` > 0 the configured trainer must install the loss (an envace V1 trainer, which is an
    :class:`ObservationLossMixin`) and verl's actor loss must be ``ppo_loss`` (distillation replaces it). The agent
    keys are checked with the typed config (``envace.config.EnvAceConfig``). Raises ConfigError naming the keys."""
    if not coef:
        return
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

    key = f"envace.loss.observation_nll_coef={coef:g}"
    mode = str(cfg.trainer.v1.trainer_mode)
    if not cfg.trainer.use_v1 or not issubclass(TRAINER_REGISTRY.get(mode, object), ObservationLossMixin):
        raise ConfigError(f"{key} is added to the actor's loss by envace's V1 trainers (envace_*, envsched_*), not by "
                          f"trainer.use_v1={cfg.trainer.use_v1} trainer.v1.trainer_mode={mode}")
    if (cfg.get("distillation") or {}).get("enabled"):
        raise ConfigError(f"{key} adds to verl's PPO loss, which distillation.enabled=true replaces with its "
                          "distillation loss: set one of them")
