"""One scoring path for every rollout: training (:mod:`envace.agents.verl_loop`), evaluation
(:mod:`envace.eval.runner`) and the warm start's evaluation (:mod:`envace.models.warmstart`).

:func:`score_episode` turns a finished rollout (the :class:`~envace.envs.base.Episode` the actor's calls ran in,
and the engine's :class:`~envace.agents.engine.Transcript`) into a :class:`Score`: the weighted mix
(:func:`~envace.rewards.mix.mix_rewards`, normalised) of the components the row has — the pool's official verifier
when the episode is executable, the checklist judge when the row carries checklists.

The masking rule, one for every caller, follows the project's error taxonomy:

* **model** — whatever the model caused is scored as the model's failure. The verifier runs whatever the stop
  reason (``completed``, ``max_steps_per_turn``, ``token_budget``, ``malformed_call``, ``model_error`` ...): an
  episode the model left unfinished is judged on the state it left, as RL validation and evaluation judge it.
* **infrastructure** — the rollout could not be judged: the environment timed out during the rollout
  (``transcript.masked``), the verifier raised or did not finish within ``timeout_s``, the checklist judge's calls
  failed. The score is *masked* (``masked=True`` with the reason, ``reward`` 0.0 and never to be used), never a 0:
  a 0 would train the policy away from what it did, or report a failure it did not make. The caller retries what
  it can: evaluation raises :class:`~envace.rewards.llm.InfrastructureError` and the task is retried on the next
  run; training drops the sample (loss mask 0, left out of every baseline), since a verl step cannot re-run one
  rollout, and aborting the step would throw away every other rollout for one transient failure.
* **configuration** — a :class:`~envllm.ConfigurationError` from the verifier or the judge (a wrong
  judge model, a bad key) and a row no weighted component applies to (:class:`ValueError`) are raised: masking
  them would quietly drop every sample of the run; they abort it with the reason.

The verifier runs in a daemon thread waited for at most ``timeout_s``: a stuck verifier cannot hold the caller's
event loop (or ``asyncio.run``'s executor shutdown) after its time-out.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from envace.rewards.mix import mix_rewards
from envllm import ConfigurationError

__all__ = ["Score", "run_verifier", "score_episode"]

logger = logging.getLogger(__name__)

#: ``await judge(messages, checklists)`` -> a :class:`~envace.rewards.checklist.JudgeResult`
Judge = Callable[[list[dict[str, Any]], Any], Awaitable[Any]]


@dataclass
class Score:
    """The reward of one rollout, or why it has none."""

    reward: float  # the mixed reward; 0.0 when masked (never to be used)
    masked: bool = False  # the rollout could not be judged (infrastructure): retry it or leave it out
    reason: str = ""  # why it is masked
    details: dict[str, Any] = field(default_factory=dict)  # "verifier", "checklist", "mix"
    verdict: Any = None  # the verifier's Verdict, when it ran


async def run_verifier(episode: Any, timeout_s: float | None) -> Any:
    """``episode.verify()`` in a daemon thread, waited for at most ``timeout_s`` seconds (None or 0: no limit);
    a remote episode's ``averify()`` awaited under the same limit. Raises what the verifier raised, or
    :class:`TimeoutError` naming the limit."""
    if getattr(episode, "remote", False):
        try:
            return await asyncio.wait_for(episode.averify(), timeout_s or None)
        except TimeoutError:
            raise TimeoutError(f"the verifier did not finish within {timeout_s:g}s") from None
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not done.done():
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(result)

    def target() -> None:
        try:
            result, error = episode.verify(), None
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            result, error = None, exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the caller's loop is gone (it gave up and finished): nobody waits
            pass

    threading.Thread(target=target, name="envace-verify", daemon=True).start()
    if not timeout_s:
        return await done
    try:
        return await asyncio.wait_for(done, timeout_s)
    except TimeoutError:
        raise TimeoutError(f"the verifier did not finish within {timeout_s:g}s") from None


async def score_episode(episode: Any, transcript: Any, *, verifiable_weight: float = 1.0,
                        checklist_weight: float = 0.0, checklists: Any = None, judge: Judge | None = None,
                        timeout_s: float | None = None) -> Score:
    """The score of one finished rollout (see the module docstring for the masking rule).

    ``checklists`` (the row's ``reward_model.ground_truth`` when its style is ``checklist``) adds the checklist
    component, judged by ``judge`` when ``checklist_weight`` > 0. Components with weight 0 are left out.
    """
    if transcript.masked:
        return Score(0.0, True, transcript.mask_reason)
    components: dict[str, float | None] = {}
    reasons: dict[str, str] = {}
    details: dict[str, Any] = {}
    weights: dict[str, float] = {}
    verdict = None
    if episode.executable:
        weights["verifiable"] = verifiable_weight
        try:
            verdict = await run_verifier(episode, timeout_s)
            components["verifiable"] = float(verdict.reward)
            details["verifier"] = dict(verdict.details)
        except ConfigurationError:
            raise
        except Exception as exc:  # noqa: BLE001  (verifier crash or time-out: infrastructure, unscored, never 0)
            logger.warning("verifier failed for %s/%s: %s", episode.spec.pool, episode.spec.task_id, exc)
            components["verifiable"], reasons["verifiable"] = None, f"{type(exc).__name__}: {exc}"
    if checklists is not None:
        weights["checklist"] = checklist_weight
        if checklist_weight > 0:
            if judge is None:
                raise ValueError("checklist rows need a judge")
            result = await judge(transcript.messages, checklists)
            components["checklist"] = result.reward
            details["checklist"] = {"per_turn": result.per_turn, "n_calls": result.n_calls,
                                    "n_failures": result.n_failures}
            if result.masked:
                reasons["checklist"] = result.reason
    weights = {k: w for k, w in weights.items() if w > 0}
    if not weights:
        raise ValueError(f"no reward component with a positive weight applies to {episode.spec.task_id}")
    reward, mix = mix_rewards(components, weights, normalize=True, reasons=reasons)
    details["mix"] = mix
    if reward is None:
        return Score(0.0, True, str(mix.get("reason", "masked reward")), details, verdict)
    return Score(float(reward), False, "", details, verdict)
