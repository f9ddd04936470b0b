"""The vLLM CPU weight sync (``envace/platform/vllm_cpu.py``, :class:`CPUWorkerExtension`) run for real: vLLM's CPU
engine serving the tiny Qwen3 with the extension as its worker extension (as ``configs/platform/cpu.yaml`` sets it),
and verl's own sender (``BucketedWeightSender``, shared memory, as verl's ``ServerAdapter.update_weights`` drives it
on CPU) pushing new weights the way the trainer does after an update.

What the engine computes after each sync is compared with what the new weights should give: the prompt log-probs
of a Hugging Face forward pass over the same weights. A sync that skips a step of the layer-wise reload fails here
in about a minute instead of only in the slow end-to-end run: without ``finalize_layerwise_reload`` the layers that
receive no checkpoint tensor (attention, the rotary cache, the tied LM head) stay on the meta device; without
``initialize_layerwise_reload`` the second load finds no ``weight_loader`` on the repacked CPU weights; without the
copy out of the bucket, a layer whose tensors span two buckets is built from the next bucket's bytes. Two syncs in
a row, as two training steps, because the reload keeps per-layer state from one sync to the next.

Not faked: the engine (in its own process, as verl's server runs it), the worker extension, vLLM's reload, verl's
sender and receiver. Left out: Ray, the trainer and verl's HTTP server around the engine (the end-to-end test runs
them).
"""

from __future__ import annotations

import asyncio
import math
import os
import threading

import pytest
import torch

from envace.models import ensure_tiny_model

#: a prompt of ordinary and chat-template tokens (as in test_hfcpu_sampling.py)
PROMPT = [9707, 11, 1879, 0, 151644, 77091, 198, 9707, 1879, 11, 0, 151645, 198]
#: two training steps' worth of new weights: each step adds noise of this size to every tensor
STEP_NOISE = 0.05
#: float32 on both sides: vLLM's CPU kernels and torch's agree far closer than this
ATOL = 1e-3
SYNC_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def engine():
    """vLLM's CPU engine on the tiny Qwen3 with envace's worker extension, in its own processes (engine core and
    worker). The environment is restored afterwards: vLLM's CPU platform sets variables for its workers
    (``LD_PRELOAD``, ``VLLM_WORKER_MULTIPROC_METHOD``, ...) in the process that starts it, which would reach every
    later subprocess of this test worker."""
    from vllm import LLM

    saved = os.environ.copy()
    # the extension's socket path carries this id (verl's _get_zmq_handle): not the one of a trainer running beside
    os.environ["VERL_RAY_JOB_ID"] = f"envace-test-{os.getpid()}"
    try:
        llm = LLM(model=str(ensure_tiny_model()), dtype="float32", enforce_eager=True, max_model_len=64,
                  max_num_seqs=1, enable_chunked_prefill=False, enable_prefix_caching=False,
                  kv_cache_memory_bytes=32 * 2**20, seed=0, disable_log_stats=True,
                  worker_extension_cls="envace.platform.vllm_cpu.CPUWorkerExtension")
        yield llm
        llm.llm_engine.engine_core.shutdown()
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture
def reference():
    """The same checkpoint in transformers: the weights to send, and what they should compute."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ensure_tiny_model(), dtype=torch.float32).eval()


def engine_logprobs(llm) -> torch.Tensor:
    """The engine's log-prob of each prompt token after the first (a prefill of the whole model)."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    [out] = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], params, use_tqdm=False)
    return torch.tensor([pos[tok].logprob for pos, tok in zip(out.prompt_logprobs[1:], PROMPT[1:], strict=True)])


def reference_logprobs(model) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0, :-1]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0]


def train_step(model, seed: int) -> None:
    """Stand-in for an actor update: every parameter moves (the tied embedding and LM head together)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * STEP_NOISE)


def split_layer_order(state: dict[str, torch.Tensor]) -> tuple[list[tuple[str, torch.Tensor]], int]:
    """The trainer's state dict (the tied ``lm_head.weight`` included, as verl's FSDP engine sends it) in an order
    that splits layer 0's attention projection over two buckets, and the bucket size (MiB) that does it: the first
    bucket holds the embedding and ``q_proj``, the 37 MiB LM head does not fit beside them and opens the second,
    which carries ``k_proj`` and ``v_proj``. vLLM loads q, k and v into one fused layer and processes it only when
    all three arrived, so ``q_proj`` must outlive its bucket."""
    first = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "lm_head.weight"]
    order = [(name, state[name]) for name in first] + [(n, t) for n, t in state.items() if n not in first]
    embed, q_proj, lm_head = (state[name].nbytes for name in first)
    bucket_mb = math.ceil(max(embed, lm_head) / 2**20)
    assert embed + q_proj <= bucket_mb * 2**20 < embed + q_proj + lm_head  # the split this order is for
    return order, bucket_mb


def sync(llm, weights: list[tuple[str, torch.Tensor]], bucket_mb: int) -> None:
    """One weight update as verl's ServerAdapter makes it: the workers' ``update_weights_from_ipc`` receiving while
    verl's sender streams the buckets through shared memory (CPU has no CUDA IPC)."""
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender

    [handle] = llm.collective_rpc("_get_zmq_handle")
    sender = BucketedWeightSender(zmq_handle=handle, bucket_size_mb=bucket_mb, use_shm=True)
    failed: list[BaseException] = []

    def send() -> None:
        try:
            asyncio.run(sender.async_send_weights(iter(weights)))
        except BaseException as exc:  # noqa: BLE001 (re-raised in the test's thread below)
            failed.append(exc)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    llm.collective_rpc("update_weights_from_ipc", timeout=SYNC_TIMEOUT_S,
                       kwargs={"peft_config": None, "base_sync_done": True, "use_shm": True})
    thread.join(SYNC_TIMEOUT_S)
    assert not thread.is_alive(), "the sender is still waiting for the worker"
    if failed:
        raise failed[0]


def test_two_weight_syncs_reach_the_running_engine(engine, reference):
    from vllm.v1.engine.exceptions import EngineDeadError

    before = reference_logprobs(reference)
    torch.testing.assert_close(engine_logprobs(engine), before, atol=ATOL, rtol=0)  # the comparison holds at load
    for step in (1, 2):
        train_step(reference, seed=step)
        expected = reference_logprobs(reference)
        assert (expected - before).abs().max() > 100 * ATOL  # the step is visible in what the model computes
        weights, bucket_mb = split_layer_order(reference.state_dict())
        sync(engine, weights, bucket_mb)
        try:
            got = engine_logprobs(engine)
        except EngineDeadError as exc:
            pytest.fail(f"after sync {step} the engine died in a forward pass (the worker's error is in the captured "
                        f"log): {exc}")
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0, msg=lambda m, step=step: f"after sync {step}: {m}")
        before = expected
