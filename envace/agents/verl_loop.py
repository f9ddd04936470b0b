"""verl adapter of the turn engine: envace's agent loops, token in / token out.

Three loops are registered with verl's agent-loop registry (``agent_loops.yaml``); they differ only in
the observation source (``envace.agent.observation_source`` picks the training rows' loop,
``envace.agent.val_observation_source`` the validation rows'):

=====================  ===========  =============================================================
loop                   source       what answers the agent's tool calls
=====================  ===========  =============================================================
``envace_env``         ``real``     the task's environment (standard GRPO baseline)
``envace_act_rehearse`` ``rehearse`` the policy itself, REHEARSE role (EnvACE world rehearsal)
``envace_simulator``   ``simulator`` an external OpenAI-compatible LLM (the paper's Simulator baseline), or
                                   with ``envace.agent.worldbook`` the Trace2Env simulator
                                   (:mod:`envace.agents.worldbook`)
=====================  ===========  =============================================================

Only ``server_manager.generate`` touches the model, so the loops run unchanged on vLLM (GPU) and on
the ``hfcpu`` rollout (CPU). The policy is :class:`VerlPolicy`: the token-level policy of
:mod:`envace.agents.token_policy` (one growing acting context in verl's continuous tokens, the response budget)
with ``server_manager.generate`` plugged in; the warm start's evaluation runs the same policy over an in-process
decoder.

Training samples (``envace.agent.act_layout``):

* ``message`` (EnvACE's per-output samples): one verl output per generation — each ACT message (prompt
  = the acting context so far, response = that message) and each REHEARSE response (prompt = its
  rehearsal prompt) — so role-wise GRPO sees every output y_{i,m} of the paper;
* ``trajectory``: all ACT messages of a rollout in one output (context tokens masked out), plus one
  output per REHEARSE response; cheaper when the prompt is long (one prompt forward per rollout).

Every output carries its :class:`~envace.agents.contract.RolloutFields` as ``extra_fields`` (the rollout
contract: role ``act`` / ``rehearse``, ``trajectory_id``, the trajectory's reward, stop reason...); only model
tokens have loss mask 1. The reward is the pool's official verifier
run on the real environment the actor's calls were executed in (directly with ``real``; as a shadow
execution with ``rehearse`` / ``simulator``: the same calls in the same order, i.e. a replay), scored by
:func:`envace.rewards.score.score_episode` as evaluation scores it. A rollout that could not be judged (a
verifier crash or time-out, an environment time-out) masks the sample (loss mask 0, ``verify_failed=1``, left out
of every baseline) instead of scoring it 0.

Sampling is seeded per rollout (:func:`rollout_identity`, :func:`request_seed`): every generation carries a ``seed``
sampling parameter derived from ``rollout.seed``, the rollout's identity (step, task row, which of its group's
rollouts) and the generation's index within the rollout, so two runs of one config and seed draw the same tokens
wherever the rollout server batches them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import json
import logging
import threading
from collections.abc import Mapping
from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput

from envace.agents import LOOP_NAMES
from envace.agents.client import connect_endpoints
from envace.agents.contract import GREEDY_FIELD, RolloutFields
from envace.agents.engine import Role, Transcript, TurnEngine
from envace.agents.sources import RealSource, RehearseSource, SimulatorSource
from envace.agents.token_policy import (  # noqa: F401  (PrefixError, Generation, announce_tools: re-exported)
    Generation,
    LoopTokenContext,
    PrefixError,
    TokenPolicy,
    announce_tools,
)
from envace.config import AgentConfig, envace_config_from
from envace.envs import checklist_dialogue
from envace.envs.base import EnvironmentPool, Episode, get_pool
from envace.rewards.score import score_episode

logger = logging.getLogger(__name__)


_POOLS: dict[str, EnvironmentPool] = {}
_POOLS_LOCK = threading.Lock()


def shared_pool(name: str, kwargs: dict[str, Any] | None = None) -> EnvironmentPool:
    """One pool object per process and name (pools are read-only; episodes hold the state)."""
    key = f"{name}:{json.dumps(kwargs or {}, sort_keys=True)}"
    with _POOLS_LOCK:
        if key not in _POOLS:
            _POOLS[key] = get_pool(name, **connect_endpoints(name, kwargs or {}))
        return _POOLS[key]


def task_ref(kwargs: dict[str, Any]) -> tuple[str, str]:
    """(pool, task_id) of a dataset row; raises a clear error when the row lacks them."""
    info = kwargs.get("extra_info") or {}
    pool, task_id = info.get("pool"), info.get("task_id")
    if not pool or not task_id:
        raise ValueError(
            "envace agent loops need extra_info.pool and extra_info.task_id in every row "
            "(build datasets with `python -m envace.data build`)"
        )
    return str(pool), str(task_id)


#: rollout servers that read a per-request ``seed`` sampling parameter (hfcpu's ``SamplingSpec``; vLLM's
#: ``SamplingParams``, which verl's vLLM server builds from the parameters it is sent); the others are sent none. On
#: GPUs vLLM samples seeded requests with its PyTorch top-k / top-p path, not FlashInfer's (which takes no per-request
#: generators): a recipe with top-k or top-p filters pays that kernel's difference
SEEDED_ROLLOUTS = frozenset({"hfcpu", "vllm"})


def rollout_identity(row: Mapping[str, Any]) -> dict[str, Any] | None:
    """What names one rollout alike in every run of a config and seed, from the keyword arguments verl's V1
    agent-loop worker hands :meth:`EnvaceAgentLoop.run` (``AgentLoopWorkerTQ._run_prompt`` in
    verl/trainer/ppo/v1/agent_loop_tq.py, under the sync and the colocate_async trainers alike); None when the row
    lacks them.

    * ``global_steps``: the step that dispatched the prompt (the trainer stamps it on every batch, training and
      validation alike), so a row drawn again in a later step is another rollout;
    * ``session_id``: which of the prompt's ``rollout.n`` rollouts (0..n-1), so the K rollouts of a prompt differ;
    * the row's task reference (``extra_info``: pool, task id, split, index in its parquet file): the dataloader
      (``data.seed``) or EnvSched (``envsched.seed``) puts the same rows in the same steps in every run. A training
      and a validation rollout of one step differ here: envace's data build puts no task in both the train and the
      val split (``envace/data/datasets.py``) and the split is part of the identity (verl drops its own
      ``validate`` flag before the rows reach the agent loop);
    * the greedy validation pass's flag (:data:`~envace.agents.contract.GREEDY_FIELD`).

    verl's prompt ``uid`` is a fresh uuid4 in every run and the request id (:class:`VerlPolicy`) one per rollout, so
    neither can serve. verl's older agent-loop worker passes neither ``global_steps`` nor ``session_id``: its rows
    get None, and their generations go unseeded.
    """
    if "global_steps" not in row or "session_id" not in row:
        return None
    info = row.get("extra_info") or {}
    index = info.get("index", row.get("index"))
    return {
        "step": int(row["global_steps"]),
        "session": int(row["session_id"]),
        "pool": str(info.get("pool")),
        "task_id": str(info.get("task_id")),
        "split": str(info.get("split")),
        "index": int(index) if index is not None else None,
        "greedy": bool(row.get(GREEDY_FIELD, False)),
    }


def request_seed(server_seed: int, identity: Mapping[str, Any], generation: int) -> int:
    """The ``seed`` of a rollout's ``generation``-th ``generate`` call (0-based; act and rehearse turns counted
    together, in the order the engine makes them, one after another): 63 bits of BLAKE2b over (``rollout.seed``,
    :func:`rollout_identity`, ``generation``). A hash of canonical JSON, not Python's ``hash``, which salts strings
    per process."""
    text = json.dumps([int(server_seed), dict(identity), int(generation)], sort_keys=True)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 1


class RolloutAbortedError(RuntimeError):
    """The rollout server aborted a generation (verl's ``stop_reason="aborted"``): an infrastructure failure, never
    a reply of the model's."""


class VerlPolicy(TokenPolicy):
    """The token-level policy (:class:`~envace.agents.token_policy.TokenPolicy`) over ``server_manager.generate``,
    with the agent loop's own continuous-token bookkeeping. Every generation of a rollout goes out under one
    request id (verl's sticky routing), one after another. With a ``seed`` (``rollout.seed`` and the rollout's
    identity, :func:`rollout_identity`) each carries its own :func:`request_seed`; without one, none."""

    def __init__(self, loop: AgentLoopBase, sampling_params: dict[str, Any], cfg: AgentConfig,
                 seed: tuple[int, dict[str, Any]] | None = None) -> None:
        super().__init__(
            LoopTokenContext(loop), self._server_generate,
            lambda ids: loop.tokenizer.decode(ids, skip_special_tokens=True),
            sampling=sampling_params, budget=int(loop.rollout_config.response_length),
            act_max_tokens=cfg.act_max_tokens, rehearse_max_tokens=cfg.rehearse_max_tokens,
            rehearse_temperature=cfg.rehearse_temperature, tools_added_version=cfg.tools_added_version,
        )
        self.loop = loop
        self.cfg = cfg
        self.request_id = uuid4().hex
        self.global_steps: dict[str, Any] = {}
        self.seed = seed
        self.calls = 0  # generate calls made so far: the next one's index within the rollout

    async def _server_generate(self, prompt_ids: list[int], params: dict[str, Any],
                               role: Role) -> tuple[list[int], list[float] | None]:
        if self.seed is not None:
            params = {**params, "seed": request_seed(*self.seed, self.calls)}
        self.calls += 1
        out = await self.loop.server_manager.generate(
            request_id=self.request_id, prompt_ids=list(prompt_ids), sampling_params=params
        )
        if out.stop_reason == "aborted":
            # vLLM answers an aborted request with whatever it had generated, possibly nothing, and no finish
            # reason: taking that as the policy's message would train on a reply the model never finished
            raise RolloutAbortedError(f"the rollout server aborted request {self.request_id} after "
                                      f"{len(out.token_ids)} token(s) (role {role.value})")
        fields = out.extra_fields or {}
        if "min_global_steps" in fields:
            self.global_steps.setdefault("min_global_steps", fields["min_global_steps"])
        self.global_steps.update({k: fields[k] for k in ("max_global_steps", "global_steps") if k in fields})
        return list(out.token_ids), out.log_probs


class EnvaceAgentLoop(AgentLoopBase):
    """One rollout of one task through :class:`~envace.agents.engine.TurnEngine` (see module docstring)."""

    def __init__(self, *args: Any, observation_source: str = "real", name: str | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if observation_source not in LOOP_NAMES:
            raise ValueError(f"unknown observation_source {observation_source!r}; choose from {sorted(LOOP_NAMES)}")
        self.observation_source = observation_source
        self.envace_cfg = envace_config_from(self.config)
        self.agent_cfg = self.envace_cfg.agent

    def _source(self, policy: VerlPolicy, episode: Episode):
        cfg = self.agent_cfg
        real = RealSource(timeout_s=cfg.env_timeout_s) if episode.executable else None
        if self.observation_source == "real":
            if real is None:
                raise ValueError(
                    f"task {episode.spec.pool}/{episode.spec.task_id} has no executable environment: train it "
                    "with envace.agent.observation_source=rehearse or simulator"
                )
            return real
        spec_examples = list(episode.spec.metadata.get("tool_examples", []) or [])
        examples = (lambda ctx: spec_examples) if spec_examples else None
        on_bad = cfg.limits.on_malformed_rehearsal
        if self.observation_source == "rehearse":
            return RehearseSource(policy, cfg.rehearsal, on_bad, shadow=real, examples=examples)
        if cfg.worldbook:  # the Trace2Env simulator (envace/agents/worldbook.py)
            from envace.agents.worldbook import WorldbookSource, world_model_from_endpoint

            return WorldbookSource.for_episode(cfg.worldbook, episode, shadow=real,
                                               proposer=world_model_from_endpoint(cfg.simulator))
        pool = _llm_pool("simulator", cfg.simulator)
        return SimulatorSource(pool.complete_text, cfg.rehearsal, on_bad, shadow=real, examples=examples)

    async def _episode(self, kwargs: dict[str, Any]) -> Episode:
        pool_name, task_id = task_ref(kwargs)
        if pool_name == checklist_dialogue.POOL:  # checklist-scored dialogue: built from the row itself
            return await asyncio.to_thread(checklist_dialogue.episode_from_row, kwargs)
        pool = await asyncio.to_thread(shared_pool, pool_name,
                                       dict(self.agent_cfg.pool_kwargs.get(pool_name, {}) or {}))
        return await pool.astart(task_id)  # a remote pool awaits its server instead of holding a thread

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> list[AgentLoopOutput]:
        cfg = self.agent_cfg
        pool_name, task_id = task_ref(kwargs)
        episode = await self._episode(kwargs)
        if kwargs.get(GREEDY_FIELD):  # the trainer's greedy validation pass (envace.verl.trainer)
            sampling_params = {**sampling_params, "temperature": 0.0, "top_p": 1.0, "top_k": -1}
        policy = VerlPolicy(self, sampling_params, cfg, seed=self._seed(kwargs))
        try:
            source = self._source(policy, episode)
            transcript = await TurnEngine(cfg.limits).run(episode, policy, source)
            reward, masked, reason, details = await self._score(episode, transcript, kwargs)
        finally:  # a remote episode's session (or server, or workspace) ends with its rollout
            await episode.aclose()
        trajectory_id = f"{kwargs.get('uid', '')}_{kwargs.get('session_id', 0)}"
        return self._outputs(policy, transcript, reward, masked, reason, details,
                             pool_name, task_id, episode.spec.env_id, trajectory_id)

    def _seed(self, row: dict[str, Any]) -> tuple[int, dict[str, Any]] | None:
        """(``rollout.seed``, the rollout's identity) when the rollout server reads a per-request seed
        (:data:`SEEDED_ROLLOUTS`), ``envace.agent.seed_requests`` is on and the row names its rollout
        (:func:`rollout_identity`); else None."""
        rollout = self.rollout_config
        if not self.agent_cfg.seed_requests or rollout.get("name") not in SEEDED_ROLLOUTS:
            return None
        identity = rollout_identity(row)
        if identity is None:
            _warn_unseeded()
            return None
        return int(rollout.get("seed") or 0), identity

    async def _score(self, episode: Episode, t: Transcript, row: dict[str, Any]) -> tuple[float, bool, str, dict]:
        """The trajectory reward (:func:`envace.rewards.score.score_episode`: the verifier and, on checklist rows,
        the checklist judge). Returns (reward, masked, reason, details); a masked reward is never used (loss
        mask 0, ``verify_failed=1``): the rollout could not be judged, and a verl step cannot re-run it."""
        rcfg = self.envace_cfg.reward
        reward_model = row.get("reward_model") or {}
        checklists = reward_model.get("ground_truth") if reward_model.get("style") == "checklist" else None
        score = await score_episode(episode, t, verifiable_weight=rcfg.verifiable_weight,
                                    checklist_weight=rcfg.checklist_weight, checklists=checklists,
                                    judge=self._judge, timeout_s=self.agent_cfg.env_timeout_s)
        return score.reward, score.masked, score.reason, score.details

    async def _judge(self, messages: list[dict[str, Any]], checklists: Any):
        from envace.rewards.checklist import ChecklistJudge

        rcfg = self.envace_cfg.reward
        if not rcfg.judge:
            raise ValueError("checklist rows need a judge endpoint: set envace.reward.judge (base_urls, model)")
        judge = ChecklistJudge(_llm_pool("judge", rcfg.judge), rcfg.checklist)
        return await judge.judge(messages, checklists)

    # -- training samples ---------------------------------------------------------------------------
    def _outputs(
        self,
        policy: VerlPolicy,
        t: Transcript,
        reward: float,
        verify_failed: bool,
        reason: str,
        details: dict[str, Any],
        pool_name: str,
        task_id: str,
        env_id: str,
        trajectory_id: str,
    ) -> list[AgentLoopOutput]:
        gens = policy.generations
        n_act = sum(g.role is Role.ACT for g in gens)
        n_reh = len(gens) - n_act
        fid = [o.meta["fidelity"] for s in t.steps for o in s.observations if "fidelity" in o.meta]
        # calls the Trace2Env simulator answered (WorldbookSource tags each with its route: rule, evidence, proposer
        # or error), so a run serving some environments with worldbooks shows which rollouts ran in one
        simulated = sum("route" in o.meta for s in t.steps for o in s.observations)
        # what every output of this rollout shares (the rollout contract, envace/agents/contract.py)
        shared = RolloutFields(
            trajectory_id=trajectory_id,
            task_id=task_id,
            pool=pool_name,
            env_id=env_id,
            observation_source=self.observation_source,
            stop_reason=t.stop_reason,
            mask_reason=reason,
            reward=reward,
            verify_failed=verify_failed,
            counters={**t.counters(), "act_outputs": float(n_act), "rehearse_outputs": float(n_reh),
                      "simulated_calls": float(simulated)},
            fidelity=tuple(fid),
            verdict=RolloutFields.verdict_text(details),
            actions=tuple(t.actions),
            weight_versions=dict(policy.global_steps),
        )
        samples: list[tuple[Generation | None, list[int], list[int], list[int], list[float] | None]] = []
        if self.agent_cfg.act_layout == "trajectory":
            for g in gens:
                if g.role is Role.REHEARSE:
                    samples.append((g, g.prompt_ids, g.response_ids, [1] * len(g.response_ids), g.logprobs))
            st = policy.act
            if st is not None and st.mask:
                rl = self.rollout_config.response_length
                resp = st.ids[st.prompt_len :][:rl]
                samples.append((None, st.ids[: st.prompt_len], resp, st.mask[:rl],
                                st.logprobs[:rl] if st.logprobs is not None else None))
        else:
            for g in gens:
                samples.append((g, g.prompt_ids, g.response_ids, [1] * len(g.response_ids), g.logprobs))
        if not samples:  # the engine always generates at least once (the budget is positive)
            raise RuntimeError(f"rollout of {pool_name}/{task_id} produced no generation")
        outputs = []
        for i, (g, prompt, resp, mask, logprobs) in enumerate(samples):
            fields = dataclasses.replace(
                shared,
                role=g.role if g is not None else Role.ACT,
                output_index=i,
                empty=(not g.text.strip()) if g is not None else not resp,
                format_error=g.format_error if g is not None else t.malformed_calls > 0,
                num_tokens=sum(mask),
            )
            outputs.append(
                AgentLoopOutput(
                    prompt_ids=list(prompt),
                    response_ids=list(resp),
                    response_mask=[0] * len(mask) if verify_failed else list(mask),
                    response_logprobs=list(logprobs) if logprobs is not None else None,
                    reward_score=reward,
                    num_turns=len(t.messages),
                    metrics=AgentLoopMetrics(),
                    extra_fields=fields.to_extra_fields(),
                )
            )
        return outputs


@functools.cache
def _warn_unseeded() -> None:
    logger.warning("agent-loop rows carry no global_steps / session_id (not verl's V1 agent-loop worker): "
                   "generations go unseeded, and the rollout server seeds them by arrival")


_LLM_POOLS: dict[str, Any] = {}


def _llm_pool(purpose: str, endpoint: dict[str, Any]):
    """One LLM client pool per process, purpose and endpoint (simulator, judge)."""
    from envace.rewards.llm import LLMEndpointConfig, LLMPool

    if not endpoint:
        raise ValueError(f"the {purpose} needs an endpoint (envace.agent.simulator / envace.reward.judge)")
    key = purpose + json.dumps(endpoint, sort_keys=True, default=str)
    if key not in _LLM_POOLS:
        _LLM_POOLS[key] = LLMPool(LLMEndpointConfig.from_mapping(endpoint, purpose))
    return _LLM_POOLS[key]
