"""The CPU platform plugin: detection, the device shim, and the pinned verl lines it works around."""

from __future__ import annotations

import inspect
import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import verl

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU platform is inactive where CUDA exists")


def test_verl_version_is_the_one_the_plugin_targets():
    # envace.platform works around verl 0.9.1 specifics (see the comments in envace/platform/cpu.py).
    assert verl.__version__ == "0.9.1"


def test_cpu_platform_is_auto_detected_in_a_fresh_process():
    code = "from verl.plugin.platform import get_platform; p = get_platform(); print(p.device_name, p.communication_backend_name(), p.current_device())"
    env = {k: v for k, v in os.environ.items() if k != "VERL_PLATFORM"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split()[-3:] == ["cpu", "gloo", "cpu"]


def test_hfcpu_rollout_is_registered_with_verl():
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import RolloutReplicaRegistry, get_rollout_replica_class

    from envace.platform.rollout import HFCPUServerAdapter

    assert get_rollout_class("hfcpu", "async") is HFCPUServerAdapter
    assert "hfcpu" in RolloutReplicaRegistry._registry
    assert get_rollout_replica_class("hfcpu").__name__ == "HFCPUReplica"


def test_device_module_has_every_attribute_verl_calls():
    """Scan verl's sources for get_torch_device().X and check the shim provides each X."""
    from envace.platform.cpu import cpu_device_module

    root = Path(verl.__file__).parent
    used: set[str] = set()
    for path in root.rglob("*.py"):
        used.update(re.findall(r"get_torch_device\(\)\.([A-Za-z_]+)", path.read_text(errors="ignore")))
    assert used, "verl no longer calls get_torch_device(); revisit envace/platform/cpu.py"
    missing = sorted(a for a in used if not hasattr(cpu_device_module, a))
    assert not missing, f"verl calls get_torch_device().{missing} which the CPU device module lacks"


def test_pinned_verl_line_duplicate_backend_still_exists():
    """envace/platform/cpu.py rewrites verl 0.9.1's 'cpu:gloo,{device}:{backend}' backend string."""
    from verl.utils import distributed

    src = inspect.getsource(distributed.initialize_global_process_group_ray)
    assert 'f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"' in src


def test_fsdp_engine_for_the_cpu_device_is_envaces():
    """verl registers its FSDP engines for cuda/npu only; envace registers its CPU engine for "cpu" (no override)."""
    import verl.workers.engine  # noqa: F401  (registers verl's engines)
    from verl.workers.engine.base import EngineRegistry

    from envace.platform.engine import CPUFSDPEngineWithLMHead

    registry = EngineRegistry._engines["language_model"]["fsdp2"]
    assert {"cuda", "npu"} <= {k if isinstance(k, str) else k[0] for k in registry}
    assert registry["cpu"] is CPUFSDPEngineWithLMHead
    assert "VERL_ENGINE_DEVICE" not in os.environ
    assert EngineRegistry.get_engine_cls("language_model", "fsdp2") is CPUFSDPEngineWithLMHead


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_verl_process_group_initialises_over_gloo_and_all_reduces():
    code = textwrap.dedent(
        """
        import torch, torch.distributed as dist
        import verl
        from verl.utils.distributed import initialize_global_process_group_ray
        initialize_global_process_group_ray(timeout_second=60)
        t = torch.ones(3)
        dist.all_reduce(t)
        print(dist.get_backend(), t.tolist())
        dist.destroy_process_group()
        """
    )
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "gloo [1.0, 1.0, 1.0]"
