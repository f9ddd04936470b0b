"""The one place that registers envace's pieces with verl's registries.

* :func:`register_extensions` — called by the verl plugin (:mod:`envace.verl_plugin`) on ``import verl``
  in every process: the CPU platform and ``hfcpu`` rollout (only where no CUDA device exists).
* :func:`register_trainer_extensions` — called in verl's TaskRunner process before it looks up the
  trainer: the ``grpo_rolewise`` advantage estimator (``register_adv_est``) and the V1 trainers
  ``envace_sync`` and ``envsched_sync`` (``register_trainer``). They import verl's trainer modules,
  which must not happen while ``verl/__init__`` is still loading plugins.
* Agent loops are registered through verl's agent-loop config file: ``envace/agents/agent_loops.yaml``
  (``actor_rollout_ref.rollout.agent.agent_loop_config_path``, filled in by :mod:`envace.train`).
"""

from __future__ import annotations


def register_extensions() -> None:
    """Register what verl needs in every process. Idempotent."""
    from envace.platform import register_cpu_platform

    register_cpu_platform()


def register_trainer_extensions() -> None:
    """Register the advantage estimator and the trainers (in the TaskRunner process). Idempotent."""
    from envace.advantage import register_rolewise_estimator
    from envace.sched import register_envsched_trainer
    from envace.trainer import envace_trainer_class

    register_rolewise_estimator()
    envace_trainer_class()
    register_envsched_trainer()
