"""``hfcpu``: a token-in/token-out rollout server for verl 0.9.1 on CPU, with transformers.

verl 0.9.1 rollout is server based: the trainer's ``LLMServerManager`` builds one
:class:`~verl.workers.rollout.replica.RolloutReplica` per rollout group, each launching server
actors whose ``generate(prompt_ids, sampling_params, request_id, ...) -> TokenOutput`` the agent
loops call through ``LLMServerClient``; inside every trainer worker a ``BaseRollout`` adapter
pushes new weights to its server after each actor update. vLLM, SGLang and TensorRT-LLM fill
these roles on GPUs. This module fills them on CPU:

* :class:`HFCPUServer` — Ray actor holding a transformers causal LM; incremental decoding with a
  KV cache, temperature / top-k / top-p / repetition-penalty sampling with a per-request seeded
  generator, log-probs of the sampled tokens under ``logits / temperature`` (what verl's actor
  computes, so ``training/rollout_probs_diff_max`` measures a real agreement).
* :class:`HFCPUReplica` — registered in ``RolloutReplicaRegistry`` as ``hfcpu``; places one
  server on the node of its replica's first worker.
* :class:`HFCPUServerAdapter` — registered in ``_ROLLOUT_REGISTRY[("hfcpu", "async")]``; drains
  the FSDP weight generator on every rank (the full-tensor gather is collective) and ships the
  state dict from the replica's rank 0 to its server.

Agent loops see exactly the interface they see on vLLM, so the same loop code runs on both.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
from collections.abc import Generator
from typing import Any

import ray
import torch

logger = logging.getLogger(__name__)

SERVER_NAME_PREFIX = "hfcpu_server_"


def server_actor_name(replica_rank: int, node_rank: int = 0) -> str:
    return f"{SERVER_NAME_PREFIX}{replica_rank}_{node_rank}"


class SamplingSpec:
    """The sampling parameters ``generate`` honours (vLLM names), validated once per request."""

    __slots__ = (
        "ignore_eos",
        "logprobs",
        "max_tokens",
        "repetition_penalty",
        "seed",
        "stop_token_ids",
        "temperature",
        "top_k",
        "top_p",
    )

    def __init__(self, params: dict[str, Any], default_max_tokens: int):
        params = dict(params)
        self.temperature = float(params.pop("temperature", 1.0) or 0.0)
        self.top_p = float(params.pop("top_p", 1.0) if params.get("top_p") is not None else 1.0)
        top_k = params.pop("top_k", -1)
        self.top_k = int(top_k) if top_k is not None else -1
        self.repetition_penalty = float(params.pop("repetition_penalty", 1.0) or 1.0)
        max_tokens = params.pop("max_tokens", params.pop("max_new_tokens", None))
        self.max_tokens = int(max_tokens) if max_tokens is not None else int(default_max_tokens)
        self.logprobs = bool(params.pop("logprobs", False))
        seed = params.pop("seed", None)
        self.seed = int(seed) if seed is not None else None
        self.ignore_eos = bool(params.pop("ignore_eos", False))
        self.stop_token_ids = [int(t) for t in (params.pop("stop_token_ids", None) or [])]
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        # Unknown keys (e.g. vLLM-only knobs such as min_p) are ignored, but never silently: log once.
        if params:
            logger.debug("hfcpu ignores sampling params %s", sorted(params))


def _filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask logits outside the top-k set and the top-p nucleus (vLLM semantics: k <= 0 means off)."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the first token is always kept)
        drop = probs.cumsum(-1) - probs > top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    return logits


def sample_tokens(
    model: torch.nn.Module,
    prompt_ids: list[int],
    spec: SamplingSpec,
    eos_ids: set[int],
    generator: torch.Generator | None = None,
) -> tuple[list[int], list[float], str]:
    """Autoregressive decoding with a KV cache. Returns (token_ids, log_probs, finish_reason)."""
    device = next(model.parameters()).device
    cur = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    past = None
    out_ids: list[int] = []
    out_lp: list[float] = []
    seen = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    seen[torch.tensor(prompt_ids, dtype=torch.long)] = True
    stop = set(spec.stop_token_ids) | (set() if spec.ignore_eos else eos_ids)
    finish = "length"
    with torch.inference_mode():
        for _ in range(spec.max_tokens):
            # logits of the last position only: a prefill of thousands of tokens would otherwise
            # materialise a [seq, vocab] matrix (151,936 columns for Qwen)
            out = model(input_ids=cur, past_key_values=past, use_cache=True, logits_to_keep=1)
            past = out.past_key_values
            logits = out.logits[0, -1].float()
            if spec.repetition_penalty != 1.0:
                pen = logits[seen]
                logits[seen] = torch.where(pen > 0, pen / spec.repetition_penalty, pen * spec.repetition_penalty)
            if spec.temperature == 0.0:
                tok = int(torch.argmax(logits))
                lp = float(torch.log_softmax(logits, -1)[tok])
            else:
                scaled = logits / spec.temperature
                logp = torch.log_softmax(scaled, -1)
                probs = torch.softmax(_filter_logits(scaled, spec.top_k, spec.top_p), -1)
                tok = int(torch.multinomial(probs, 1, generator=generator))
                lp = float(logp[tok])
            out_ids.append(tok)
            out_lp.append(lp)
            seen[tok] = True
            if tok in stop:
                finish = "stop"
                break
            cur = torch.tensor([[tok]], dtype=torch.long, device=device)
    return out_ids, out_lp, finish


class HFCPUServer:
    """Rollout server actor: transformers model on CPU, token in / token out."""

    def __init__(self, config: Any, model_config: Any, replica_rank: int, node_rank: int = 0):
        from transformers import AutoModelForCausalLM, GenerationConfig
        from verl.utils.config import omega_conf_to_dataclass

        self.config = omega_conf_to_dataclass(config)  # RolloutConfig
        self.model_config = omega_conf_to_dataclass(model_config)  # HFModelConfig
        self.replica_rank = replica_rank
        self.node_rank = node_rank
        path = self.model_config.local_path or self.model_config.path
        attn = (self.model_config.override_config or {}).get("attn_implementation", "eager")
        torch.set_num_threads(max(1, int(os.environ.get("ENVACE_ROLLOUT_THREADS", "1"))))
        self.model = AutoModelForCausalLM.from_pretrained(
            path, torch_dtype=torch.float32, attn_implementation=attn, trust_remote_code=False
        )
        self.model.eval()
        eos: set[int] = set()
        try:
            gen_cfg = GenerationConfig.from_pretrained(path)
            ids = gen_cfg.eos_token_id
            eos.update([ids] if isinstance(ids, int) else (ids or []))
        except OSError:
            pass
        if isinstance(self.model.config.eos_token_id, int):
            eos.add(self.model.config.eos_token_id)
        self.eos_ids = eos
        self.global_steps: int | None = None
        self._lock = threading.Lock()  # one decode at a time: 2-core machines gain nothing from more
        self._requests = 0
        self.seed = int(self.config.seed or 0)
        logger.info("hfcpu server %s loaded %s (eos=%s)", server_actor_name(replica_rank, node_rank), path, eos)

    # -- generation --------------------------------------------------------------------------
    def _max_tokens_default(self, prompt_len: int) -> int:
        cfg = self.config
        return min(cfg.response_length, cfg.prompt_length + cfg.response_length - prompt_len)

    def _generate_sync(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str):
        from verl.workers.rollout.replica import TokenOutput

        max_model_len = self.config.max_model_len or (self.config.prompt_length + self.config.response_length)
        room = int(max_model_len) - len(prompt_ids)
        if room < 1:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens leaves no room to generate within max_model_len={max_model_len}"
            )
        spec = SamplingSpec(sampling_params, self._max_tokens_default(len(prompt_ids)))
        spec.max_tokens = max(1, min(spec.max_tokens, room))
        with self._lock:
            self._requests += 1
            seed = spec.seed if spec.seed is not None else hash((self.seed, self.replica_rank, self._requests))
            gen = torch.Generator().manual_seed(seed & 0x7FFFFFFFFFFFFFFF)
            ids, lps, finish = sample_tokens(self.model, list(prompt_ids), spec, self.eos_ids, gen)
        return TokenOutput(
            token_ids=ids,
            log_probs=lps if spec.logprobs else None,
            stop_reason="completed",
            extra_fields={"global_steps": self.global_steps, "finish_reason": finish},
        )

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: list[Any] | None = None,
        video_data: list[Any] | None = None,
        audio_data: list[Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        priority: int = 0,
        **kwargs: Any,
    ):
        if image_data or video_data or audio_data:
            raise NotImplementedError("hfcpu rollout serves text-only models")
        return await asyncio.to_thread(self._generate_sync, list(prompt_ids), dict(sampling_params), request_id)

    # -- weights -----------------------------------------------------------------------------
    def load_weights(self, state_dict: dict[str, torch.Tensor], global_steps: int | None = None) -> int:
        """Load (a subset of) the policy's weights; returns the number of tensors loaded."""
        with self._lock:
            _missing, unexpected = self.model.load_state_dict(state_dict, strict=False)
            if unexpected:
                raise KeyError(f"hfcpu: weights not in the rollout model: {unexpected[:5]}")
            if global_steps is not None:
                self.global_steps = global_steps
        return len(state_dict)

    def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    def state_checksum(self) -> float:
        """Sum of all parameters (tests use it to see a weight sync happen)."""
        with torch.no_grad():
            return float(sum(p.double().sum() for p in self.model.parameters()))

    # -- lifecycle hooks verl calls on every rollout server; nothing to free on CPU ----------
    async def wake_up(self, tags: list[str] | None = None) -> None: ...
    async def sleep(self) -> None: ...
    async def clear_kv_cache(self) -> None: ...
    async def release_kv_cache(self) -> None: ...
    async def resume_kv_cache(self) -> None: ...
    async def wait_for_requests_to_drain(self) -> None: ...
    async def resume_generation(self) -> None: ...
    async def start_profile(self, **kwargs: Any) -> None: ...
    async def stop_profile(self) -> None: ...

    async def abort_all_requests(self, reject_request: bool = False, **kwargs: Any) -> dict[str, Any]:
        return {"aborted_count": 0, "request_ids": []}

    async def abort_request(self, request_id: str, **kwargs: Any) -> dict[str, Any]:
        return {"aborted": False, "request_id": request_id}

    def get_server_address(self) -> tuple[str, int]:
        return ray.util.get_node_ip_address(), 0


@functools.cache
def _load_replica_class():
    from verl.workers.rollout.replica import RolloutReplica

    class HFCPUReplica(RolloutReplica):
        """One hfcpu server per replica, on the node of the replica's first worker."""

        async def launch_servers(self) -> None:
            if not self.workers:
                raise RuntimeError("hfcpu replica has no workers (hybrid mode is the only supported mode)")
            node_id = await self.workers[0].__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())
            name = server_actor_name(self.replica_rank)
            server_cls = ray.remote(HFCPUServer)
            server = server_cls.options(
                name=name,
                num_cpus=0,
                max_concurrency=self.max_concurrency,
                scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                    node_id=node_id, soft=False
                ),
            ).remote(config=self.config, model_config=self.model_config, replica_rank=self.replica_rank)
            ip, _ = await server.get_server_address.remote()
            self.servers = [server]
            self._server_handle = server
            # unique per replica; names the node so logs show where each server runs
            self._server_address = f"hfcpu://{ip}/{node_id[:12]}/{name}"

    return HFCPUReplica


def _base_rollout():
    from verl.workers.rollout.base import BaseRollout

    return BaseRollout


class HFCPUServerAdapter(_base_rollout()):  # type: ignore[misc]
    """Trainer-side rollout handle: forwards weight updates to this rank's hfcpu server."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any, replica_rank: int = -1, **kwargs: Any):
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", "0"))
        world = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        self.replica_rank = rank // world if replica_rank == -1 else replica_rank
        self.rollout_rank = rank % world
        self._server = None

    def _server_handle(self):
        if self._server is None:
            self._server = ray.get_actor(server_actor_name(self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]) -> None:
        return None

    async def release(self) -> None:
        return None

    @torch.no_grad()
    async def update_weights(
        self,
        weights: Generator[tuple[str, torch.Tensor], None, None],
        wire_format: str = "named_tensors",
        global_steps: int | None = None,
        **kwargs: Any,
    ) -> None:
        if wire_format != "named_tensors":
            raise NotImplementedError(f"hfcpu rollout supports wire_format='named_tensors', got {wire_format!r}")
        if kwargs.get("peft_config") is not None:
            raise NotImplementedError("hfcpu rollout does not load LoRA adapters; set model.lora.merge=True")
        # Every rank must consume the generator: each tensor is gathered collectively across FSDP ranks.
        state: dict[str, torch.Tensor] = {}
        for name, tensor in weights:
            if self.rollout_rank == 0:
                state[name] = tensor.detach().to("cpu", dtype=torch.float32).clone()
        if self.rollout_rank == 0:
            await self._server_handle().load_weights.remote(state, global_steps)
