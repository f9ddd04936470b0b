"""The warm start's recipe: the model size, the pool it learns on and the training options (all of them enter
the recipe hash)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from envace.models import tiny as _tiny

WARM_NAME = "tiny-qwen3-warm"
WARM_RECIPE_VERSION = 5

#: the warm-started model's size (the default tiny spec, 64 wide × 2 layers, learns too little)
WARM_SPEC = _tiny.TinyQwen3Spec(
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=384,
    rope_theta=10_000.0,  # sharper relative positions at a ~500-token context (copying needs previous-token heads)
)

#: the ``synthetic`` pool options of the learning setup: the warm start trains (and is scored) on
#: these tasks, and the default RL run draws its train/validation tasks from the same pool. One-call
#: tasks (``act``: a write with ids/values given in the instruction, ``query``: a ``get`` then the
#: answer) and two-call lookup chains (``find`` by name, then a write / ``get`` on the returned id),
#: where copying values from the instruction and the observations into arguments is the main skill.
LEARNING_POOL_KWARGS: tuple[tuple[str, Any], ...] = (
    ("shapes", ("act", "query", "lookup_act", "lookup_query")),
    # each domain's canonical tool and parameter names: with per-environment renamings the 20M-parameter
    # policy picks the wrong tool name on most held-out tasks (greedy success 0.17 after the same budget)
    ("renamings", False),
)
TEMPLATE_KW = {"enable_thinking": False}


@dataclass(frozen=True)
class WarmStartConfig:
    """The training recipe (everything here enters the recipe hash)."""

    spec: _tiny.TinyQwen3Spec = WARM_SPEC
    pool: str = "synthetic"
    pool_kwargs: tuple[tuple[str, Any], ...] = LEARNING_POOL_KWARGS
    max_train_tasks: int = 0  # 0: every train task
    rehearse_per_task: int = 1  # rehearsal examples kept per task (random gold calls; 0: none)
    rehearse_every: int = 1  # rehearsal examples only for every k-th train task (more ACT tokens per step)
    drill_steps: int = 5000  # phase 1: at most this many optimizer steps on copy drills alone (the copying circuit)
    drill_lr: float = 1.2e-2  # phase 1 learning rate (constant after warm-up, until the anneal)
    drill_target_loss: float = 0.03  # phase 1 ends once the drill loss averaged over drill_window steps is this low
    drill_window: int = 50  # steps averaged for drill_target_loss
    # the last drill_anneal_steps of drill_steps anneal the drill rate linearly to 5 %: a run whose drill loss has not
    # reached drill_target_loss by then (it plateaus at 0.06-0.07 on some CPUs' kernels) settles below it (0: none)
    drill_anneal_steps: int = 1000
    copy_drills: int = 2000  # copy drills mixed into the phase-2 data (phase 1 draws its own, 30,000)
    max_history_chars: int = 1500
    epochs: int = 1
    max_steps: int = 1200  # phase 2 (task data): stop after this many optimizer steps (0: run every epoch)
    # phase 2 runs again (a fresh schedule, seed + 7·k for the k-th repeat), at most phase2_repeats times, while its
    # final loss (the mean of a pass's last tenth of steps) is above phase2_target_loss. One pass ends at 0.205-0.223
    # on the AVX-512 and AVX2 kernel paths (held-out success 0.08-0.10, no repeat); on the scalar path, where the
    # drill forms late, at 0.281 (held-out 0.0), and a second pass reaches 0.155 (0.146)
    phase2_target_loss: float = 0.25
    phase2_repeats: int = 1
    batch_tokens: int = 2048  # padded tokens per phase-2 batch
    # padded tokens per phase-1 batch: the circuit forms after about as many steps at 1,024 as at 2,048, at 0.1 s a
    # step instead of 0.125 (512 and 768 take more steps)
    drill_batch_tokens: int = 1024
    lr: float = 6e-3
    warmup_steps: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    negatives: int = 2048  # sampled other-vocabulary ids in the softmax
    seed: int = 0
    # torch CPU threads (fixed, so the build is the same on every machine; two build faster than one on a 2-core
    # machine: docs/results/cpu_default.md)
    threads: int = 2
    eval_tasks: int = 48  # held-out test tasks scored at the end of the build (T=1.0)

    def recipe(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["spec"] = dataclasses.asdict(self.spec)
        d["pool_kwargs"] = [[k, list(v) if isinstance(v, (tuple, list)) else v] for k, v in self.pool_kwargs]
        d.pop("eval_tasks")
        return d


DEFAULT_CONFIG = WarmStartConfig()


def learning_pool(cfg: WarmStartConfig | None = None) -> Any:
    """The pool the warm start trains on (``cfg.pool`` with ``cfg.pool_kwargs``; default: ``LEARNING_POOL_KWARGS``)."""
    from envace.envs.base import get_pool

    cfg = cfg if cfg is not None else DEFAULT_CONFIG
    return get_pool(cfg.pool, **dict(cfg.pool_kwargs))
