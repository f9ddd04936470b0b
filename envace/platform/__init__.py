"""CPU platform plugin for verl: the ``cpu`` platform and the ``hfcpu`` rollout.

:func:`register_cpu_platform` is called from envace's ``verl.plugins`` entry point
(:mod:`envace.verl.plugin`) in every process that imports verl. It does nothing where a CUDA
device exists, so GPU clusters run verl's own NVIDIA platform and vLLM untouched.
"""

from __future__ import annotations

import warnings

__all__ = ["ROLLOUT_NAME", "register_cpu_platform"]

ROLLOUT_NAME = "hfcpu"
_registered = False


def register_cpu_platform(force: bool = False) -> bool:
    """Register the CPU platform and the ``hfcpu`` rollout with verl's registries.

    Returns True when the CPU path is active in this process.
    """
    global _registered
    from envace.platform.cpu import cpu_platform_active, install_gloo_backend_fix

    if not (force or cpu_platform_active()):
        return False
    if _registered:
        return True
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from envace.platform.rollout import _load_replica_class

    _ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = "envace.platform.rollout.HFCPUServerAdapter"
    RolloutReplicaRegistry.register(ROLLOUT_NAME, _load_replica_class)
    install_gloo_backend_fix()
    # verl registers its FSDP engines for "cuda"/"npu" only; this registers the CPU one
    # (response-only vocabulary projection, envace/platform/engine.py) under verl's EngineRegistry.
    with warnings.catch_warnings():  # verl.workers.engine warns about every optional backend it lacks
        warnings.simplefilter("ignore", UserWarning)
        import envace.platform.engine  # noqa: F401
    _registered = True
    return True
