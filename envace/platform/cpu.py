"""A ``cpu`` platform for verl 0.9.1, registered through verl's ``PlatformRegistry``.

verl ships platforms for NVIDIA, Ascend and ROCm only; with none of them present it falls back
to ``nvidia`` and fails at the first NCCL call. This platform lets verl's real trainer (FSDP2
over gloo, TransferQueue, agent loop, checkpointing) run on machines without an accelerator.

Design points, each tied to the verl 0.9.1 code that needs it:

* ``current_device()`` returns the *string* ``"cpu"``: verl moves tensors with
  ``tensor.to(get_device_id())`` (``workers/engine/fsdp/transformer_impl.py:730,1552``,
  ``utils/fsdp_utils.py:59``), and an int would mean ``cuda:N``.
* ``device_module`` is :data:`cpu_device_module`, ``torch.cpu`` plus the memory/RNG functions
  verl calls through ``get_torch_device()`` that ``torch.cpu`` lacks.
* ``ray_resource_name()`` is ``"GPU"``: Ray hands out *logical* GPU slots (``ray start
  --num-gpus=N``), one per trainer rank, so verl's placement logic runs unchanged.
* Detection: verl probes registered platforms in order; NVIDIA/Ascend/ROCm report unavailable on
  a CPU machine, so this one is chosen exactly when ``torch.cuda.is_available()`` is false.
"""

from __future__ import annotations

import os
import sys
import types
from contextlib import contextmanager
from typing import Any

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

__all__ = ["PlatformCPU", "cpu_device_module", "install_gloo_backend_fix"]


def _mem_get_info(device: Any = None) -> tuple[int, int]:
    import psutil

    vm = psutil.virtual_memory()
    return int(vm.available), int(vm.total)


def _zero(*_args: Any, **_kwargs: Any) -> int:
    return 0


def _noop(*_args: Any, **_kwargs: Any) -> None:
    return None


def _build_device_module() -> types.ModuleType:
    mod = types.ModuleType("envace_cpu_device", "torch.cpu plus the device-module API verl expects")
    for name in dir(torch.cpu):
        if not name.startswith("_"):
            setattr(mod, name, getattr(torch.cpu, name))
    mod.is_available = lambda: True
    mod.device_count = lambda: 1
    mod.current_device = lambda: "cpu"
    mod.set_device = _noop
    mod.empty_cache = _noop
    mod.ipc_collect = _noop
    mod.reset_peak_memory_stats = _noop
    mod.set_per_process_memory_fraction = _noop
    mod.mem_get_info = _mem_get_info
    mod.memory_allocated = _zero
    mod.memory_reserved = _zero
    mod.max_memory_allocated = _zero
    mod.max_memory_reserved = _zero
    mod.get_device_name = lambda *_a, **_k: "cpu"
    mod.manual_seed = torch.manual_seed
    mod.manual_seed_all = torch.manual_seed
    mod.get_rng_state = lambda *_a, **_k: torch.get_rng_state()
    mod.set_rng_state = lambda state, *_a, **_k: torch.set_rng_state(state)
    return mod


cpu_device_module = _build_device_module()


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    """verl platform for CPU-only machines (gloo collectives, logical Ray GPU slots)."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return cpu_device_module

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return not torch.cuda.is_available()

    def current_device(self) -> str:  # type: ignore[override]
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


# The backend string verl 0.9.1 builds in verl/utils/distributed.py:89 (initialize_global_process_group_ray):
#     backend = backend or f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"
# On this platform it reads "cpu:gloo,cpu:gloo", which torch rejects ("Duplicate device type cpu in
# backend string"). The fix below rewrites exactly that string to "gloo" and nothing else.
# tests/envace/platform/test_cpu_platform.py pins the verl line and fails if it changes.
VERL_DUPLICATE_BACKEND = "cpu:gloo,cpu:gloo"


def _normalise_backend(backend: Any) -> Any:
    return "gloo" if backend == VERL_DUPLICATE_BACKEND else backend


def install_gloo_backend_fix() -> None:
    """Wrap ``torch.distributed.init_process_group`` once so verl's duplicate CPU backend works."""
    import torch.distributed as dist

    current = dist.init_process_group
    if getattr(current, "_envace_gloo_fix", False):
        return

    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        if "backend" in kwargs:
            kwargs["backend"] = _normalise_backend(kwargs["backend"])
        elif args:
            args = (_normalise_backend(args[0]), *args[1:])
        return current(*args, **kwargs)

    init_process_group._envace_gloo_fix = True  # type: ignore[attr-defined]
    init_process_group.__wrapped__ = current  # type: ignore[attr-defined]
    init_process_group.__doc__ = current.__doc__
    dist.init_process_group = init_process_group
    # `from torch.distributed import init_process_group` copies made before this point.
    for mod_name in ("torch.distributed.distributed_c10d",):
        mod = sys.modules.get(mod_name)
        if mod is not None and getattr(mod, "init_process_group", None) is current:
            mod.init_process_group = init_process_group


def cpu_platform_active() -> bool:
    """True where verl will pick this platform: no CUDA device, or VERL_PLATFORM=cpu."""
    forced = os.environ.get("VERL_PLATFORM", "").strip().lower()
    if forced:
        return forced == "cpu"
    return not torch.cuda.is_available()
