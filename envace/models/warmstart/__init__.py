"""A supervised warm start of the tiny Qwen3 on gold trajectories of the ``synthetic`` pool.

A random-init tiny model never emits a tool call, so every RL reward is 0 and GRPO has nothing to
learn from. :func:`build_warm_start` fine-tunes the tiny Qwen3 (a larger :data:`WARM_SPEC`) on the
TRAIN split of the procedurally generated pool, with two kinds of examples:

ACT
    One token stream per task, laid out exactly as verl's agent loop builds it (continuous tokens,
    ``QwenContinuousTokenBuilder``): the initial render with the task's tools and the generation
    prompt (``enable_thinking=False``, so ``<think>\\n\\n</think>\\n\\n``), then per gold call the
    generated tokens ``render_tool_call(call) + <|im_end|>`` (loss), the boundary ``\\n`` and the
    tool-response delta with the next generation prompt (no loss), and after each user turn's calls
    the gold final reply (``pool.gold_replies``: ``"Done."`` or the answer the verifier checks) +
    ``<|im_end|>`` (loss), then the next user message's delta.
REHEARSE
    Per gold call, the rehearsal prompt (:func:`envace.agents.sources.rehearsal_messages`, no tools,
    generation prompt) with target ``render_rehearsal(real observation) + <|im_end|>``.

DRILL
    Short copy drills (:func:`copy_drill_examples`): a user message names a tool and argument values,
    the target is the call with exactly those values. Many copy targets per token of context.

Training runs in two phases. Phase 1 trains on drills alone, at a constant (higher) learning rate, until the
drill loss averaged over ``drill_window`` steps falls to ``drill_target_loss`` (at most ``drill_steps`` steps):
copying multi-token values (``"F84"`` is three Qwen tokens) needs an induction-style attention circuit, which
forms after one to a few thousand steps, and when exactly depends on the CPU's kernels (torch's, oneDNN's and MKL's
choice by instruction set: the same seed gives other floats on AVX2 than on AVX-512). A fixed budget with a decaying
learning rate was fragile: on some machines the rate had decayed before the circuit formed, and the model then
guessed argument values. So phase 1 stops on the loss at a constant rate (the manifest records the steps it took and
the kernel path). The target is 0.03, not 0.1: where the loss falls slowly rather than abruptly, stopping at 0.1 left
the circuit half-formed and the held-out success far lower. On AVX2 kernels the loss levels off above the target at
that rate (docs/results/cpu_default.md, "CPU kernel paths"), so the budget's last ``drill_anneal_steps`` steps anneal
it (a run that reached the target before them is untouched): there it then clears 0.03. Trained on task data from
the start, the same budget leaves the model guessing values.
Phase 2 (``max_steps``) trains on ACT and REHEARSE examples with some drills mixed in, with a decaying rate.

Phase 1 runs on batches of ``drill_batch_tokens`` = 1,024 padded tokens, half of phase 2's: the circuit forms after
about as many steps as at 2,048 tokens, with the same phase-2 loss, and a step costs less. Smaller batches
(512, 768 tokens) and higher drill rates (2e-2, 3e-2) were tried and not taken: the circuit formed later, or phase
2 then learned less.

The measurements behind these choices (machines, steps, losses, held-out successes) are in
``docs/results/cpu_default.md`` ("The warm start's recipe: the measurements behind it").

The tasks are the train split of :data:`LEARNING_POOL_KWARGS` (the ``synthetic`` pool restricted to
one-call tasks and two-call lookup chains, canonical names), the pool the default RL run also draws its tasks
from.

Training is a plain AdamW loop. For speed on CPU the softmax runs over a compact vocabulary: the
token ids that occur in the training sequences (a few thousand) plus a fixed uniform sample of the
other ids, whose log-sum-exp is rescaled to stand for all of them (sampled softmax). The other rows
of the (tied) embedding stay at their random init. The hidden states go through the head only at
target positions.

The result is cached like the tiny model (``$ENVACE_CACHE/models/tiny-qwen3-warm``, atomic directory
build, ``envace_manifest.json`` written last with the recipe hash; the evaluation is not part of the recipe).

The held-out success (:func:`evaluate_policy`, printed by a build and kept in its manifest) is RL validation's
metric: the rollouts run through the turn engine (:class:`~envace.agents.engine.TurnEngine`) with the token-level
policy training runs, over an in-process decoder, under the CPU default run's validation limits
(:class:`EvalSettings`), scored by :func:`envace.rewards.score.score_episode`; there is no second turn loop here.

Modules: ``config`` (the recipe: :class:`WarmStartConfig`, :data:`LEARNING_POOL_KWARGS`), ``examples`` (ACT,
REHEARSE and drill examples), ``sft`` (the training loop), ``rollout`` (rollouts in the real environment under RL
validation's rules, on a loaded model), ``build`` (the cached build) and ``evaluate`` (evaluation entry points on a
model directory, the warm start by default).
"""

from __future__ import annotations

from envace.models.warmstart.build import (
    build_warm_start,
    default_warm_dir,
    ensure_warm_model,
    is_warm_complete,
    warm_recipe,
    warm_recipe_hash,
)
from envace.models.warmstart.config import (
    DEFAULT_CONFIG,
    LEARNING_POOL_KWARGS,
    WARM_NAME,
    WARM_RECIPE_VERSION,
    WARM_SPEC,
    WarmStartConfig,
    learning_pool,
)
from envace.models.warmstart.evaluate import evaluate_policy, evaluate_rehearsal, task_success
from envace.models.warmstart.examples import (
    SFTExample,
    act_examples,
    build_examples,
    copy_drill_examples,
    rehearse_example,
    rehearse_examples,
    tool_delta,
    user_delta,
)
from envace.models.warmstart.rollout import EvalSettings, heldout_success, run_episodes, token_policy
from envace.models.warmstart.sft import torch_threads, train_sft

__all__ = [
    "DEFAULT_CONFIG",
    "LEARNING_POOL_KWARGS",
    "WARM_NAME",
    "WARM_RECIPE_VERSION",
    "WARM_SPEC",
    "EvalSettings",
    "SFTExample",
    "WarmStartConfig",
    "act_examples",
    "build_examples",
    "build_warm_start",
    "copy_drill_examples",
    "default_warm_dir",
    "ensure_warm_model",
    "evaluate_policy",
    "evaluate_rehearsal",
    "heldout_success",
    "is_warm_complete",
    "learning_pool",
    "rehearse_example",
    "rehearse_examples",
    "run_episodes",
    "task_success",
    "token_policy",
    "tool_delta",
    "torch_threads",
    "train_sft",
    "user_delta",
    "warm_recipe",
    "warm_recipe_hash",
]
