"""``hfcpu``: a token-in/token-out rollout server for verl 0.9.1 on CPU, with transformers.

verl 0.9.1 rollout is server based: the trainer's ``LLMServerManager`` builds one
:class:`~verl.workers.rollout.replica.RolloutReplica` per rollout group, each launching server
actors whose ``generate(prompt_ids, sampling_params, request_id, ...) -> TokenOutput`` the agent
loops call through ``LLMServerClient``; inside every trainer worker a ``BaseRollout`` adapter
pushes new weights to its server after each actor update. vLLM, SGLang and TensorRT-LLM fill
these roles on GPUs. This module fills them on CPU:

* :class:`HFCPUServer` — Ray actor holding a transformers causal LM; a decode thread batches the
  requests that are waiting (up to ``max_num_seqs``: the agent loops of a step arrive together) into
  one left-padded decode with a shared KV cache, rows leaving as they finish; temperature / top-k /
  top-p / repetition-penalty sampling per request with its own seeded generator; log-probs of the sampled tokens under ``logits / temperature`` (what verl's actor
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
import concurrent.futures
import dataclasses
import functools
import logging
import os
import queue
import threading
import time
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
    """One request through :func:`sample_batch`. Returns (token_ids, log_probs, finish_reason)."""
    return sample_batch(model, [prompt_ids], [spec], eos_ids, [generator])[0]


def sample_index(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One draw from a 1-D categorical distribution (``probs`` >= 0, summing to about 1), by inverting its CDF
    at a single uniform from ``generator``.

    The same distribution as ``torch.multinomial(probs, 1)``, which on CPU draws an exponential variate per
    vocabulary entry (5.5 ms for Qwen's 151,936 entries on one core, against 0.2 ms here; it was a third of
    a CPU rollout). Zero-probability entries (outside top-k / top-p) are never drawn: the search is
    right-sided, so a draw lands on an entry whose CDF step is positive.
    """
    cdf = probs.cumsum(0)
    u = torch.rand((1,), generator=generator, dtype=cdf.dtype) * cdf[-1]
    idx = int(torch.searchsorted(cdf, u, right=True))
    if idx >= len(probs) or probs[idx] <= 0:  # u rounded onto the CDF's last step
        idx = int(torch.nonzero(probs).max())
    return idx


def _pick(logits: torch.Tensor, spec: SamplingSpec, generator: torch.Generator | None) -> tuple[int, float]:
    """Sample one token from one row of (penalised) logits; its log-prob under ``logits / temperature``."""
    if spec.temperature == 0.0:
        tok = int(torch.argmax(logits))
        return tok, float(torch.log_softmax(logits, -1)[tok])
    scaled = logits / spec.temperature
    tok = sample_index(torch.softmax(_filter_logits(scaled, spec.top_k, spec.top_p), -1), generator)
    return tok, float(torch.log_softmax(scaled, -1)[tok])


def sample_batch(
    model: torch.nn.Module,
    prompts: list[list[int]],
    specs: list[SamplingSpec],
    eos_ids: set[int],
    generators: list[torch.Generator | None],
) -> list[tuple[list[int], list[float], str]]:
    """Decode several requests together with one KV cache; per request (token_ids, log_probs, finish_reason).

    Prompts are left-padded (attention mask + explicit positions, so a row's tokens see exactly what they
    would see alone); each row keeps its own sampling parameters, repetition-penalty history, seeded
    generator, stop set and token budget. Finished rows leave the batch (and the cache) at once.
    """
    device = next(model.parameters()).device
    n = len(prompts)
    width = max(len(p) for p in prompts)
    ids = torch.zeros((n, width), dtype=torch.long, device=device)
    mask = torch.zeros((n, width), dtype=torch.long, device=device)
    seen = torch.zeros((n, model.config.vocab_size), dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
        seen[i, torch.tensor(p, dtype=torch.long)] = True
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    stops = [set(s.stop_token_ids) | (set() if s.ignore_eos else eos_ids) for s in specs]
    results: list[tuple[list[int], list[float], str]] = [([], [], "length") for _ in range(n)]
    live = list(range(n))  # request index of each cache row
    next_pos = mask.sum(-1)
    with torch.inference_mode():
        # logits of the last position only: a prefill of thousands of tokens would otherwise
        # materialise a [rows, seq, vocab] tensor (151,936 columns for Qwen)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
        past = out.past_key_values
        while True:
            logits = out.logits[:, -1].float()
            keep: list[int] = []
            chosen: list[int] = []
            for row, r in enumerate(live):
                spec, row_logits = specs[r], logits[row]
                if spec.repetition_penalty != 1.0:
                    pen = row_logits[seen[r]]
                    row_logits[seen[r]] = torch.where(pen > 0, pen / spec.repetition_penalty,
                                                      pen * spec.repetition_penalty)
                tok, lp = _pick(row_logits, spec, generators[r])
                toks, lps, _ = results[r]
                toks.append(tok)
                lps.append(lp)
                seen[r, tok] = True
                if tok in stops[r]:
                    results[r] = (toks, lps, "stop")
                elif len(toks) < spec.max_tokens:
                    keep.append(row)
                    chosen.append(tok)
            if not keep:
                break
            if len(keep) < len(live):
                index = torch.tensor(keep, dtype=torch.long, device=device)
                past.batch_select_indices(index)
                mask, next_pos = mask[index], next_pos[index]
                live = [live[row] for row in keep]
            mask = torch.cat([mask, mask.new_ones((len(live), 1))], dim=-1)
            out = model(
                input_ids=torch.tensor(chosen, dtype=torch.long, device=device)[:, None],
                attention_mask=mask,
                position_ids=next_pos[:, None],
                past_key_values=past,
                use_cache=True,
            )
            past = out.past_key_values
            next_pos = next_pos + 1
    return results


_BATCH_WAIT_S = 0.005  # how long the decode thread waits for company once a lone request arrives


@dataclasses.dataclass
class _Request:
    prompt: list[int]
    spec: SamplingSpec
    generator: torch.Generator
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)


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
        attn = (self.model_config.override_config or {}).get("attn_implementation", "sdpa")
        torch.set_num_threads(max(1, int(os.environ.get("ENVACE_ROLLOUT_THREADS", "1"))))
        self.model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation=attn, trust_remote_code=False
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
        self._lock = threading.Lock()  # held by the decode thread per batch, and by weight loads
        self._seed_lock = threading.Lock()
        self._requests = 0
        # concurrent requests (the agent loops of a step arrive together) are decoded as one batch
        self._queue: queue.Queue[_Request] = queue.Queue()
        self._max_batch = max(1, int(getattr(self.config, "max_num_seqs", 0) or 64))
        self.batches = 0  # decode batches run
        self.batched_requests = 0  # requests they served
        self.seed = int(self.config.seed or 0)
        threading.Thread(target=self._serve, name="hfcpu-decode", daemon=True).start()
        logger.info("hfcpu server %s loaded %s (eos=%s)", server_actor_name(replica_rank, node_rank), path, eos)

    # -- generation --------------------------------------------------------------------------
    def _max_tokens_default(self, prompt_len: int) -> int:
        cfg = self.config
        return min(cfg.response_length, cfg.prompt_length + cfg.response_length - prompt_len)

    def _submit(self, prompt_ids: list[int], sampling_params: dict[str, Any]) -> concurrent.futures.Future:
        """Validate a request, seed its generator and queue it for the decode thread."""
        max_model_len = self.config.max_model_len or (self.config.prompt_length + self.config.response_length)
        room = int(max_model_len) - len(prompt_ids)
        if room < 1:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens leaves no room to generate within max_model_len={max_model_len}"
            )
        spec = SamplingSpec(sampling_params, self._max_tokens_default(len(prompt_ids)))
        spec.max_tokens = max(1, min(spec.max_tokens, room))
        with self._seed_lock:  # seeds follow arrival order, whatever batch a request lands in
            self._requests += 1
            seed = spec.seed if spec.seed is not None else hash((self.seed, self.replica_rank, self._requests))
        req = _Request(list(prompt_ids), spec, torch.Generator().manual_seed(seed & 0x7FFFFFFFFFFFFFFF))
        self._queue.put(req)
        return req.future

    def _serve(self) -> None:
        """The decode thread: takes every queued request (up to ``max_num_seqs``) and decodes them as one batch."""
        while True:
            batch = [self._queue.get()]
            deadline = time.monotonic() + _BATCH_WAIT_S
            while len(batch) < self._max_batch:
                wait = deadline - time.monotonic()
                try:
                    batch.append(self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                with self._lock:
                    results = sample_batch(
                        self.model, [r.prompt for r in batch], [r.spec for r in batch], self.eos_ids,
                        [r.generator for r in batch],
                    )
                    steps = self.global_steps
            except Exception as exc:  # noqa: BLE001 - re-raised in every caller of the batch; the server lives on
                for r in batch:
                    r.future.set_exception(exc)
                continue
            self.batches += 1
            self.batched_requests += len(batch)
            for r, (ids, lps, finish) in zip(batch, results):
                r.future.set_result((ids, lps if r.spec.logprobs else None, finish, steps))

    @staticmethod
    def _token_output(ids: list[int], log_probs: list[float] | None, finish: str, global_steps: int | None):
        from verl.workers.rollout.replica import TokenOutput

        return TokenOutput(
            token_ids=ids,
            log_probs=log_probs,
            stop_reason="completed",
            extra_fields={"global_steps": global_steps, "finish_reason": finish},
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
        future = self._submit(list(prompt_ids), dict(sampling_params))
        return self._token_output(*await asyncio.wrap_future(future))

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
