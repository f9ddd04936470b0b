"""Running verl's trainer: the Ray runtime environment it needs and its V1 TaskRunner with envace's registrations.

verl looks the trainer class up by ``trainer.v1.trainer_mode`` inside its TaskRunner actor, so envace's trainer
subclasses and the ``grpo_rolewise`` estimator are registered there (:func:`task_runner_class`; ``run_ppo`` takes
a TaskRunner class for exactly this kind of extension). :func:`run` hands a validated config to verl's own
``run_ppo`` — the real verl trainer, unmodified — on the Ray cluster :func:`envace.train.init_ray` joined or
started with :func:`ray_runtime_env`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

__all__ = ["ray_runtime_env", "run", "run_env", "task_runner_class"]


def run_env(cfg: DictConfig) -> dict[str, str]:
    """Environment variables every Ray process of this run gets (trackers' output paths)."""
    run_dir = Path(cfg.trainer.default_local_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return {
        "TENSORBOARD_DIR": str(run_dir / "tensorboard"),
        # verl's file logger truncates its file on open: one file per launch keeps resumed runs whole
        "VERL_FILE_LOGGER_PATH": str(run_dir / "metrics" / f"metrics-{stamp}.jsonl"),
        "TOKENIZERS_PARALLELISM": "false",
        # verl warns once per process about optional engines (megatron, torchtitan, ...) it lacks
        "PYTHONWARNINGS": "ignore::UserWarning:verl.workers.engine",
    }


def ray_runtime_env(cfg: DictConfig, env_vars: Mapping[str, str] | None = None) -> dict[str, Any]:
    """verl's PPO runtime environment merged with ``ray_kwargs.ray_init.runtime_env``; its ``env_vars`` gain
    ``env_vars`` (e.g. the network-interface variables), :func:`run_env` and, with TransferQueue,
    ``TRANSFER_QUEUE_ENABLE``."""
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    runtime_env = OmegaConf.to_container(
        OmegaConf.merge(get_ppo_ray_runtime_env(cfg), cfg.ray_kwargs.ray_init.get("runtime_env", {}) or {}),
        resolve=True,
    )
    merged = dict(runtime_env.get("env_vars") or {})
    merged.update(env_vars or {})
    merged.update(run_env(cfg))
    if cfg.transfer_queue.enable:
        merged["TRANSFER_QUEUE_ENABLE"] = "1"
    runtime_env["env_vars"] = merged
    return runtime_env


def task_runner_class():
    """verl's V1 TaskRunner, plus registration of envace's trainers and estimator in its process."""
    import ray
    from verl.trainer.main_ppo import TaskRunnerV1

    class EnvaceTaskRunner(TaskRunnerV1.__ray_actor_class__):
        def run(self, config: DictConfig):
            from envace.verl.extensions import register_trainer_extensions

            register_trainer_extensions()
            return super().run(config)

    return ray.remote(EnvaceTaskRunner)


def run(cfg: DictConfig) -> None:
    """verl's ``run_ppo`` on the current Ray cluster: the V1 TaskRunner above by default, verl's V0 one with
    ``trainer.use_v1=false``."""
    from verl.trainer.main_ppo import run_ppo

    if cfg.trainer.use_v1:
        run_ppo(cfg, task_runner_class=task_runner_class())
    else:
        from verl.trainer.main_ppo_v0 import TaskRunner

        run_ppo(cfg, task_runner_class=TaskRunner)
