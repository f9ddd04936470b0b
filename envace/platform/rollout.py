"""``hfcpu``: a token-in/token-out rollout server for verl 0.9.1 on CPU, with transformers.

verl 0.9.1 rollout is server based: the trainer's ``LLMServerManager`` builds one
:class:`~verl.workers.rollout.replica.RolloutReplica` per rollout group, each launching server
actors whose ``generate(prompt_ids, sampling_params, request_id, ...) -> TokenOutput`` the agent
loops call through ``LLMServerClient``; inside every trainer worker a ``BaseRollout`` adapter
pushes new weights to its server after each actor update. vLLM, SGLang and TensorRT-LLM fill
these roles on GPUs. This module fills them on CPU:

* :class:`HFCPUServer` — Ray actor holding a transformers causal LM; a decode thread runs continuous
  batching (:class:`DecodeBatch`): requests join the running left-padded decode, with its shared KV cache,
  between decode steps (up to ``max_num_seqs`` rows) and leave as they finish, so the act and rehearse turns
  of a step's agent loops, which arrive at different times, share decode passes; temperature / top-k / top-p /
  repetition-penalty sampling per request with its own seeded generator (:meth:`HFCPUServer._submit`: the
  request's ``seed`` sampling parameter, which envace's agent loop derives from the rollout's identity, so what a
  request draws does not depend on when it arrived, nor, up to float rounding, on which batch it joined); log-probs
  of the sampled tokens under ``logits / temperature`` (what verl's actor computes, so
  ``training/rollout_probs_diff_max`` measures a real agreement).
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


def model_eos_ids(model: Any) -> set[int]:
    """The ids that end a generation: the generation config's ``eos_token_id`` and the model config's (the
    ``hfcpu`` server's stop ids, and the warm start's in-process decoder's)."""
    eos: set[int] = set()
    for cfg in (getattr(model, "generation_config", None), model.config):
        ids = getattr(cfg, "eos_token_id", None)
        eos.update([ids] if isinstance(ids, int) else (ids or []))
    return eos


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
    """Decode several requests together (one :class:`DecodeBatch`); per request (token_ids, log_probs,
    finish_reason)."""
    batch = DecodeBatch(model, eos_ids)
    batch.add(list(range(len(prompts))), prompts, specs, generators)
    results: dict[Any, tuple[list[int], list[float], str]] = {}
    while batch:
        results.update(batch.step())
    return [results[i] for i in range(len(prompts))]


@dataclasses.dataclass
class _Row:
    """One request decoding in a :class:`DecodeBatch`."""

    key: Any
    spec: SamplingSpec
    generator: torch.Generator | None
    stops: set[int]
    seen: torch.Tensor | None  # [vocab] bool: the prompt's and the generated tokens (repetition penalty only)
    tokens: list[int] = dataclasses.field(default_factory=list)
    log_probs: list[float] = dataclasses.field(default_factory=list)


class DecodeBatch:
    """Requests decoding together with one KV cache (continuous batching): requests join between decode steps and
    leave as soon as they finish.

    Every row is left-padded to the cache's width (attention mask + explicit positions), so a row's tokens see
    exactly what they would see alone; each row keeps its own sampling parameters, repetition-penalty history,
    seeded generator, stop set and token budget. :meth:`add` prefills the new prompts (their own forward pass) and
    merges their cache into the batch's, left-padding whichever is narrower; :meth:`step` samples one token for
    every row, retires the finished rows and runs one decode forward pass for the others. Cache columns that are
    padding in every row (left behind by rows that left) are dropped.
    """

    def __init__(self, model: torch.nn.Module, eos_ids: set[int]):
        self.model = model
        self.eos_ids = set(eos_ids)
        self.device = next(model.parameters()).device
        self.rows: list[_Row] = []
        self.past: Any = None  # the transformers cache: [rows, kv heads, columns, head dim] per layer
        self.mask = torch.zeros((0, 0), dtype=torch.long, device=self.device)  # [rows, columns]
        self.next_pos = torch.zeros((0,), dtype=torch.long, device=self.device)  # each row's next position
        self.logits: torch.Tensor | None = None  # [rows, vocab]: each row's next-token logits
        self.steps = 0  # decode forward passes run
        self.row_steps = 0  # rows they decoded (row_steps / steps: the mean batch)

    def __len__(self) -> int:
        return len(self.rows)

    @torch.inference_mode()
    def add(self, keys: list[Any], prompts: list[list[int]], specs: list[SamplingSpec],
            generators: list[torch.Generator | None]) -> None:
        """Prefill ``prompts`` and add them as rows (``keys`` name them in :meth:`step`'s results)."""
        if not prompts:
            return
        n, width = len(prompts), max(len(p) for p in prompts)
        ids = torch.zeros((n, width), dtype=torch.long, device=self.device)
        mask = torch.zeros((n, width), dtype=torch.long, device=self.device)
        rows = []
        for i, (key, p, spec, gen) in enumerate(zip(keys, prompts, specs, generators, strict=True)):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
            seen = None
            if spec.repetition_penalty != 1.0:
                seen = torch.zeros(self.model.config.vocab_size, dtype=torch.bool)
                seen[torch.tensor(p, dtype=torch.long)] = True
            stops = set(spec.stop_token_ids) | (set() if spec.ignore_eos else self.eos_ids)
            rows.append(_Row(key, spec, gen, stops, seen))
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        # logits of the last position only: a prefill of thousands of tokens would otherwise
        # materialise a [rows, seq, vocab] tensor (151,936 columns for Qwen)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1].float()
        if not self.rows:
            self.past, self.mask, self.logits = out.past_key_values, mask, logits
            self.next_pos = mask.sum(-1)
        else:  # merged tensors first, then assigned: a failure leaves the running rows as they were
            old, new = self.mask.shape[1], width
            cols = max(old, new)
            merged = [tuple(torch.cat([_pad_left(a, cols - old, 2), _pad_left(b, cols - new, 2)])
                            for a, b in ((mine.keys, theirs.keys), (mine.values, theirs.values)))
                      for mine, theirs in zip(self.past.layers, out.past_key_values.layers, strict=True)]
            batch_mask = torch.cat([_pad_left(self.mask, cols - old, 1), _pad_left(mask, cols - new, 1)])
            for layer, (layer_keys, layer_values) in zip(self.past.layers, merged, strict=True):
                layer.keys, layer.values = layer_keys, layer_values
            self.mask = batch_mask
            self.next_pos = torch.cat([self.next_pos, mask.sum(-1)])
            self.logits = torch.cat([self.logits, logits])
        self.rows += rows

    @torch.inference_mode()
    def step(self) -> dict[Any, tuple[list[int], list[float], str]]:
        """Sample every row's next token; returns the rows that finished (key -> (token_ids, log_probs,
        finish_reason)) and decodes the others one position further."""
        done: dict[Any, tuple[list[int], list[float], str]] = {}
        keep: list[int] = []
        chosen: list[int] = []
        for i, row in enumerate(self.rows):
            row_logits = self.logits[i]
            spec = row.spec
            if row.seen is not None:
                pen = row_logits[row.seen]
                row_logits[row.seen] = torch.where(pen > 0, pen / spec.repetition_penalty,
                                                   pen * spec.repetition_penalty)
            tok, lp = _pick(row_logits, spec, row.generator)
            row.tokens.append(tok)
            row.log_probs.append(lp)
            if row.seen is not None:
                row.seen[tok] = True
            if tok in row.stops:
                done[row.key] = (row.tokens, row.log_probs, "stop")
            elif len(row.tokens) >= spec.max_tokens:
                done[row.key] = (row.tokens, row.log_probs, "length")
            else:
                keep.append(i)
                chosen.append(tok)
        if len(keep) < len(self.rows):
            self._select(keep)
        if not keep:
            return done
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(keep), 1))], dim=-1)
        out = self.model(
            input_ids=torch.tensor(chosen, dtype=torch.long, device=self.device)[:, None],
            attention_mask=self.mask,
            position_ids=self.next_pos[:, None],
            past_key_values=self.past,
            use_cache=True,
        )
        self.past, self.logits = out.past_key_values, out.logits[:, -1].float()
        self.next_pos = self.next_pos + 1
        self.steps += 1
        self.row_steps += len(keep)
        return done

    def clear(self) -> None:
        """Drop every row (the counters stay)."""
        self._select([])

    def _select(self, keep: list[int]) -> None:
        """Keep only the rows ``keep``; drop the cache columns that are padding in all of them."""
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.past, self.logits = None, None
            self.mask = self.mask[:0, :0]
            self.next_pos = self.next_pos[:0]
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.past.batch_select_indices(index)
        self.mask, self.next_pos, self.logits = self.mask[index], self.next_pos[index], self.logits[index]
        first = int(self.mask.any(0).int().argmax())  # the first column some row attends to
        if first > 0:
            self.mask = self.mask[:, first:]
            for layer in self.past.layers:
                layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]


def _pad_left(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """``t`` with ``n`` zero slices prepended along ``dim``."""
    if n == 0:
        return t
    shape = list(t.shape)
    shape[dim] = n
    return torch.cat([t.new_zeros(shape), t], dim=dim)


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
        from transformers import AutoModelForCausalLM
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
        self.eos_ids = model_eos_ids(self.model)
        self.global_steps: int | None = None
        self._lock = threading.Lock()  # held by the decode thread while its batch has rows, and by weight loads
        self._seed_lock = threading.Lock()
        self._requests = 0
        # requests waiting for the decode thread (it admits them into its running batch between decode steps)
        self._queue: queue.Queue[_Request] = queue.Queue()
        self._max_batch = max(1, int(getattr(self.config, "max_num_seqs", 0) or 64))
        self._weights_waiting = threading.Event()  # set while a weight load waits for the batch to drain
        self.batches = 0  # decode batches started (from an idle server)
        self.batched_requests = 0  # requests they served
        self._batch = DecodeBatch(self.model, self.eos_ids)  # the decode thread's running batch
        self.seed = int(self.config.seed or 0)
        threading.Thread(target=self._serve, name="hfcpu-decode", daemon=True).start()
        logger.info("hfcpu server %s loaded %s (eos=%s)", server_actor_name(replica_rank, node_rank), path, self.eos_ids)

    # -- generation --------------------------------------------------------------------------
    def _max_tokens_default(self, prompt_len: int) -> int:
        cfg = self.config
        return min(cfg.response_length, cfg.prompt_length + cfg.response_length - prompt_len)

    def _submit(self, prompt_ids: list[int], sampling_params: dict[str, Any]) -> concurrent.futures.Future:
        """Validate a request, seed its generator and queue it for the decode thread.

        A request with a ``seed`` sampling parameter (vLLM's meaning: this request's own seed) draws from a generator
        seeded with it and nothing else, so its uniforms are the same whatever arrived before it and whichever batch
        it decodes in. envace's agent loop sends one with every generation, derived from (``rollout.seed``, the
        rollout's identity, the generation's index within the rollout): :func:`envace.agents.verl_loop.request_seed`.
        Its tokens are then the same too, up to float rounding: rows of a :class:`DecodeBatch` decode as they would
        alone, but the batch's shape and left padding change the order of the sums, so a draw within that rounding of
        a token boundary of the CDF can differ (with ``max_num_seqs=1`` every request decodes alone, bit for bit).
        A request without a seed (another caller, or rows that do not name their rollout) is seeded by
        (``rollout.seed``, replica, arrival count): distinct streams for identical requests, but its draws then
        depend on the order concurrent requests arrived in.
        """
        max_model_len = self.config.max_model_len or (self.config.prompt_length + self.config.response_length)
        room = int(max_model_len) - len(prompt_ids)
        if room < 1:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens leaves no room to generate within max_model_len={max_model_len}"
            )
        spec = SamplingSpec(sampling_params, self._max_tokens_default(len(prompt_ids)))
        spec.max_tokens = max(1, min(spec.max_tokens, room))
        with self._seed_lock:  # the fallback follows arrival order (see the docstring)
            self._requests += 1
            seed = spec.seed if spec.seed is not None else hash((self.seed, self.replica_rank, self._requests))
        req = _Request(list(prompt_ids), spec, torch.Generator().manual_seed(seed & 0x7FFFFFFFFFFFFFFF))
        self._queue.put(req)
        return req.future

    @property
    def decode_steps(self) -> int:
        """Decode forward passes run so far."""
        return self._batch.steps

    @property
    def decode_rows(self) -> int:
        """Rows those passes decoded (``decode_rows / decode_steps``: the mean batch)."""
        return self._batch.row_steps

    def _serve(self) -> None:
        """The decode thread: continuous batching. Requests join the running :class:`DecodeBatch` between decode
        steps (up to ``max_num_seqs`` rows) and are answered as soon as they finish. A weight load waits until the
        batch has drained; while one waits, no request joins."""
        batch = self._batch
        requests: dict[int, _Request] = {}
        while True:
            new: list[_Request] = []
            if not batch:
                new.append(self._queue.get())  # idle: wait for a request, then briefly for company
                deadline = time.monotonic() + _BATCH_WAIT_S
                while len(new) < self._max_batch:
                    wait = deadline - time.monotonic()
                    try:
                        new.append(self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait())
                    except queue.Empty:
                        break
                self._lock.acquire()  # held while the batch has rows: weights never change under a live row
                self.batches += 1
            elif not self._weights_waiting.is_set():
                while len(batch) + len(new) < self._max_batch:
                    try:
                        new.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
            if new:
                try:
                    batch.add([id(r) for r in new], [r.prompt for r in new], [r.spec for r in new],
                              [r.generator for r in new])
                    requests.update((id(r), r) for r in new)
                    self.batched_requests += len(new)
                except Exception as exc:  # noqa: BLE001 - re-raised in the new requests' callers; the rows go on
                    for r in new:
                        r.future.set_exception(exc)
            try:
                done = batch.step() if batch else {}
            except Exception as exc:  # noqa: BLE001 - re-raised in every caller of the batch; the server lives on
                for r in requests.values():
                    r.future.set_exception(exc)
                requests.clear()
                batch.clear()
                done = {}
            steps = self.global_steps
            for key, (ids, lps, finish) in done.items():
                r = requests.pop(key)
                r.future.set_result((ids, lps if r.spec.logprobs else None, finish, steps))
            if not batch:
                self._lock.release()

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
        self._weights_waiting.set()  # no request joins the running batch; it drains, then the load goes in
        try:
            self._lock.acquire()
        finally:
            self._weights_waiting.clear()
        try:
            _missing, unexpected = self.model.load_state_dict(state_dict, strict=False)
            if unexpected:
                raise KeyError(f"hfcpu: weights not in the rollout model: {unexpected[:5]}")
            if global_steps is not None:
                self.global_steps = global_steps
        finally:
            self._lock.release()
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
