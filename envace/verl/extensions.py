"""The one place that registers envace's pieces with verl's registries.

* :func:`register_extensions` — called by the verl plugin (:mod:`envace.verl.plugin`) on ``import verl``
  in every process: the CPU platform and ``hfcpu`` rollout (only where no CUDA device exists).
* :func:`register_trainer_extensions` — called in verl's TaskRunner process (:mod:`envace.verl.runner`) before it
  looks up the trainer: the ``grpo_rolewise`` advantage estimator (:func:`register_rolewise_estimator`, verl's
  ``register_adv_est``) and the V1 trainers of :mod:`envace.verl.trainers` (``envace_sync``, ``envsched_sync`` and
  their async kinds; ``register_trainer``). They import verl's trainer modules, which must not happen while
  ``verl/__init__`` is still loading plugins.
* Agent loops are registered through verl's agent-loop config file: ``envace/agents/agent_loops.yaml``
  (``actor_rollout_ref.rollout.agent.agent_loop_config_path``, filled in by :mod:`envace.train`).
"""

from __future__ import annotations


def register_extensions() -> None:
    """Register what verl needs in every process. Idempotent."""
    from envace.platform import register_cpu_platform

    register_cpu_platform()


def register_rolewise_estimator() -> None:
    """Register :func:`envace.advantage.rolewise_adv_estimator` as verl's ``grpo_rolewise``. Idempotent.

    verl's ``register_adv_est`` raises when a name is registered again with a different function;
    a previous registration of envace's estimator (e.g. before an ``importlib.reload`` of
    :mod:`envace.advantage`: another function object of the same module and name) is replaced,
    while another module's estimator of the same name still raises.
    """
    from verl.trainer.ppo import core_algos

    from envace.advantage import ESTIMATOR_NAME, rolewise_adv_estimator

    current = core_algos.ADV_ESTIMATOR_REGISTRY.get(ESTIMATOR_NAME)
    if current is rolewise_adv_estimator:
        return
    if current is not None and (
        getattr(current, "__module__", None) == rolewise_adv_estimator.__module__
        and getattr(current, "__qualname__", None) == rolewise_adv_estimator.__qualname__
    ):
        del core_algos.ADV_ESTIMATOR_REGISTRY[ESTIMATOR_NAME]
    core_algos.register_adv_est(ESTIMATOR_NAME)(rolewise_adv_estimator)


def register_trainer_extensions() -> None:
    """Register the advantage estimator and the trainers (in the TaskRunner process). Idempotent."""
    import envace.verl.trainers  # noqa: F401 - registers the trainers on first import

    register_rolewise_estimator()
