"""The warm start's rollouts in the real environment, under RL validation's rules: the turn engine, the token-level
policy training runs over an in-process decoder, and the one scoring path."""

from __future__ import annotations

import hashlib
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from envace.models import tokenizer as _tok
from envace.models.warmstart.config import TEMPLATE_KW
from envace.models.warmstart.sft import torch_threads


def load_model(model_dir: str | os.PathLike[str]) -> tuple[Any, Any]:
    _tok._offline_env()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True, dtype="float32").eval()
    return model, tok


def split_test(pool: Any, n: int, seed: int) -> list[str]:
    ids = list(pool.task_ids("test"))
    random.Random(f"{seed}:eval").shuffle(ids)
    return ids[:n] if n else ids


def _default_limits() -> Any:
    from envace.agents.engine import LoopLimits

    return LoopLimits(max_user_turns=2, max_steps_per_turn=4, max_calls_per_message=2, max_observation_chars=1000)


@dataclass(frozen=True)
class EvalSettings:
    """The rules the warm start is evaluated under: those of the CPU default run's RL validation
    (``configs/experiment/cpu_default.yaml``: ``envace.agent.limits`` / ``act_max_tokens`` / ``rehearse_max_tokens`` /
    ``env_timeout_s``, ``data.max_prompt_length`` / ``max_response_length``, ``rollout.max_model_len``), so the
    success printed here is the metric validation reports on the same model and tasks
    (tests/envace/models/test_eval_parity.py keeps the two equal)."""

    limits: Any = field(default_factory=_default_limits)  # envace.agents.engine.LoopLimits
    act_max_tokens: int | None = 64  # tokens one acting message may generate
    rehearse_max_tokens: int = 64  # tokens one rehearsal may generate
    response_length: int = 320  # the acting context's growth over all turns (verl's rollout.response_length)
    prompt_length: int = 1024  # prompts are cut to their last prompt_length tokens (verl's rollout.prompt_length)
    max_model_len: int = 1344  # prompt + generation (the rollout server's context window)
    env_timeout_s: float = 60.0  # one environment call or verification (then: infrastructure)


def _episode_seed(seed: int, task_id: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{task_id}".encode()).digest()[:8], "little") >> 1


def token_policy(tok: Any, generate: Any, temperature: float, settings: EvalSettings | None = None,
                 logprobs: bool = False) -> Any:
    """The token-level policy training runs (:class:`~envace.agents.token_policy.TokenPolicy`: continuous tokens,
    the response budget, per-message token caps), with ``generate`` plugged in and verl's sampling parameters at
    ``temperature`` (top-p 1, top-k off)."""
    from envace.agents.token_policy import BuilderTokenContext, TokenPolicy

    s = settings if settings is not None else EvalSettings()
    context = BuilderTokenContext(tok, hf_model_type="qwen3", chat_template_kwargs=TEMPLATE_KW,
                                  prompt_length=s.prompt_length)
    sampling = {"temperature": temperature, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": logprobs}
    return TokenPolicy(context, generate, lambda ids: tok.decode(ids, skip_special_tokens=True), sampling=sampling,
                       budget=s.response_length, act_max_tokens=s.act_max_tokens,
                       rehearse_max_tokens=s.rehearse_max_tokens)


def run_episodes(model: Any, tok: Any, pool: Any, task_ids: Sequence[str], temperature: float, seed: int = 0,
                 settings: EvalSettings | None = None, max_rows: int = 32) -> list[dict[str, Any]]:
    """Roll out ``task_ids`` against the real environment through the turn engine, as RL validation does: the
    engine (:class:`~envace.agents.engine.TurnEngine`) with ``settings.limits``, the token-level policy training
    runs (:func:`token_policy`) over an in-process decoder (:class:`~envace.models.decoder.LocalDecoder`, up to
    ``max_rows`` rollouts decoding together), the real environment's source
    (:class:`~envace.agents.sources.RealSource`: the tool bounds, errors as observations) and the one scoring
    path (:func:`envace.rewards.score.score_episode`: the verifier whatever the stop reason).

    Each rollout samples from its own generator, seeded by ``seed`` and its task id, so a task's rollout does not
    depend on which others run beside it. Per task: ``reward``, ``stop`` (the engine's stop reason), the
    transcript's counters and ``generations`` (each generation's prompt and response ids). A rollout that could not
    be judged raises :class:`~envace.rewards.llm.InfrastructureError` (nothing here retries it)."""
    import asyncio

    import torch

    from envace.agents.engine import TurnEngine
    from envace.agents.sources import RealSource
    from envace.models.decoder import LocalDecoder
    from envace.rewards.llm import InfrastructureError
    from envace.rewards.score import score_episode

    s = settings if settings is not None else EvalSettings()

    async def one(decoder: LocalDecoder, slots: asyncio.Semaphore, tid: str) -> dict[str, Any]:
        async with slots:
            episode = await asyncio.to_thread(pool.start, tid)
            generator = torch.Generator().manual_seed(_episode_seed(seed, tid))
            policy = token_policy(tok, decoder.generate_with(generator), temperature, s)
            t = await TurnEngine(s.limits).run(episode, policy, RealSource(timeout_s=s.env_timeout_s))
            score = await score_episode(episode, t, timeout_s=s.env_timeout_s)
        if score.masked:
            raise InfrastructureError(f"task {tid} could not be scored: {score.reason}")
        return {"reward": score.reward, "stop": t.stop_reason, **t.counters(),
                "generations": [(g.prompt_ids, g.response_ids) for g in policy.generations]}

    async def main() -> list[dict[str, Any]]:
        decoder = LocalDecoder(model, max_model_len=s.max_model_len, max_rows=max_rows)
        slots = asyncio.Semaphore(max(1, max_rows))
        return list(await asyncio.gather(*(one(decoder, slots, tid) for tid in task_ids)))

    return asyncio.run(main())


def heldout_success(model: Any, tok: Any, pool: Any, n_tasks: int, temperature: float, seed: int = 0,
                    verbose: bool = False, threads: int = 1, per_category: bool = False,
                    settings: EvalSettings | None = None) -> Any:
    """Mean reward of a loaded ``model`` acting on ``n_tasks`` held-out (test split) tasks of ``pool``
    (:func:`run_episodes`): :func:`~envace.models.warmstart.evaluate.evaluate_policy` on a model already in memory.
    With ``per_category`` the result is ``{"success": mean, "tasks": n, "per_category": {category: mean}}``."""
    tids = split_test(pool, n_tasks, seed)
    with torch_threads(threads):
        episodes = run_episodes(model, tok, pool, tids, temperature, seed, settings)
    rewards: list[float] = []
    by_cat: dict[str, list[float]] = {}
    for tid, r in zip(tids, episodes, strict=True):
        rewards.append(r["reward"])
        by_cat.setdefault(pool.task(tid).category, []).append(r["reward"])
        if verbose:
            print(tid, pool.task(tid).category, {k: v for k, v in r.items() if k != "generations"}, flush=True)
    mean = sum(rewards) / max(1, len(rewards))
    if per_category:
        return {"success": mean, "tasks": len(rewards),
                "per_category": {c: round(sum(v) / len(v), 4) for c, v in sorted(by_cat.items())}}
    return mean
