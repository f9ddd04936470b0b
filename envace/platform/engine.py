"""verl's FSDP language-model engine for the ``cpu`` device, with the vocabulary projection on response tokens only.

verl registers its FSDP engines for the ``cuda`` and ``npu`` devices (``EngineRegistry``). This module
registers one for ``cpu``: :class:`CPUFSDPEngineWithLMHead`, verl's ``FSDPEngineWithLMHead`` with one change.

verl projects every position of every sequence onto the vocabulary and takes log-probabilities of all of them,
prompt positions included, although only response tokens enter any loss or metric
(``verl.workers.utils.padding.no_padding_2_padding`` keeps ``values[off - resp_len - 1 : off - 1]`` of each
sequence). With Qwen3's 151,936-entry vocabulary that projection is the bulk of a CPU step
(docs/results/cpu_default.md).
verl has no option that limits it (``use_fused_kernels`` computes the same positions, chunked, and its torch
backend is slower on CPU), and its packed layout (``use_remove_padding``) needs flash-attention's varlen kernels
to stay linear in the micro-batch: with torch's attention kernels the packed sequence costs ``(Σ lengths)²``.

So on the padded path (``use_remove_padding: false``, what ``configs/platform/cpu.yaml`` sets) this engine lays
each micro-batch out with the prompts right-aligned, ``[pad… prompt_i response_i pad…]``, so that every row's
response occupies the same columns, passes those columns to the model as transformers' ``logits_to_keep`` (a
1-D index tensor is part of the ``*ForCausalLM.forward`` API), and scatters the log-probabilities (and
entropies) back into verl's nested layout. Prompt positions hold 0, which nothing reads; response positions
hold the values verl computes (``tests/envace/platform/test_cpu_engine.py`` compares values and gradients).

On CPU the engine also sizes torch's thread pool (:func:`trainer_threads`): Ray starts an actor that asks for no
CPUs with ``OMP_NUM_THREADS=1``, so verl's trainer rank would otherwise compute on one core of an idle machine
while the rollout server, which computes only between updates, waits.

A training pass also hands verl the mini-batch's rows sorted by length before verl cuts its fixed micro-batches
(:meth:`CPUFSDPEngineWithLMHead.forward_backward_batch`), so that rows of similar width share a micro-batch, and
does not run the micro-batches whose rows all have zero advantage (GRPO groups whose rollouts scored alike,
verl's padding rows) when the loss is a policy loss that is 0, with its gradient, at zero advantage.

Anything else (packed inputs, sequence parallelism, fused kernels, distillation, Σπ², position ids with
more than one row per token) falls through to verl unchanged. The class overrides two methods of verl's (and
wraps ``initialize``, ``forward_backward_batch`` and ``forward_step``), so the test also pins the verl version it
was written against.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, ClassVar

import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils import torch_functional as verl_F
from verl.utils.dataset.dataset_utils import DatasetPadMode
from verl.utils.model import extract_multi_modal_inputs
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

__all__ = ["VERL_VERSION", "CPUFSDPEngineWithLMHead", "inert_rows", "length_order", "response_logit_positions",
           "trainer_threads"]

#: the verl release whose ``FSDPEngineWithLMHead.prepare_model_inputs/outputs`` this engine follows
VERL_VERSION = "0.9.1"

_KEPT = "envace_logits_kept"
logger = logging.getLogger(__name__)


def response_logit_positions(prompt_lens: torch.Tensor, response_lens: torch.Tensor) -> torch.Tensor:
    """Packed positions whose next-token logits score a response token.

    Sequence ``i`` occupies ``[start_i, start_i + P_i + R_i)``; its response tokens are predicted at
    ``start_i + P_i - 1 … start_i + P_i + R_i - 2``.
    """
    seq = prompt_lens + response_lens
    starts = torch.cumsum(seq, 0) - seq
    first = starts + prompt_lens - 1
    counts = response_lens
    idx = torch.repeat_interleave(first - torch.cumsum(counts, 0) + counts, counts)
    return idx + torch.arange(int(counts.sum()), device=idx.device)


def length_order(seq_lens: torch.Tensor, first: torch.Tensor | None = None) -> torch.Tensor:
    """Row order by sequence length (stable: equal lengths keep their order); with ``first`` (a boolean per row),
    the rows it marks come first, each part sorted by length."""
    order = torch.argsort(seq_lens, stable=True)
    if first is None:
        return order
    return order[torch.argsort((~first[order]).to(torch.int8), stable=True)]


def inert_rows(data: TensorDict) -> torch.Tensor:
    """Rows whose advantage is 0 at every response token the loss counts (``response_mask``): groups whose
    rollouts all scored the same, and the padding rows verl adds to fill whole micro-batches. Under a policy
    loss linear in the advantage (:func:`_loss_is_linear_in_advantages`) such a row adds 0 to the loss and to its
    gradient; the loss is still normalised by the whole mini-batch's token count (``batch_num_tokens``, counted
    by verl before the micro-batches are cut)."""
    adv, mask = data["advantages"], data["response_mask"]
    if not adv.is_nested:  # [rows, response columns]
        return ((adv != 0) & (mask != 0)).sum(-1) == 0
    live = (adv.values() != 0) & (mask.values() != 0)
    lens = adv.offsets().diff()
    row = torch.repeat_interleave(torch.arange(len(lens)), lens)
    return torch.zeros(len(lens), dtype=torch.long).index_add_(0, row, live.long()) == 0


_LINEAR_LOSS_MODES = {"vanilla"}  # verl policy losses that are -A x (clipped) ratio per token
_LINEAR_BYPASS_TYPES = {"ppo_clip", "reinforce"}  # loss_mode "bypass_mode": vanilla, or -A x IS weight x log-prob


def _loss_is_linear_in_advantages(loss_function: Any, data: TensorDict) -> bool:
    """Whether ``loss_function`` is verl's ``ppo_loss`` with nothing but a policy loss that vanishes, with its
    gradient, where the advantage is 0: a whitelisted loss mode, no KL loss, no entropy term or metric."""
    from verl.workers.utils.losses import ppo_loss

    if not (isinstance(loss_function, functools.partial) and loss_function.func is ppo_loss
            and set(loss_function.keywords) == {"config"} and not loss_function.args):
        return False
    cfg = loss_function.keywords["config"]
    if cfg.use_kl_loss or cfg.entropy_coeff != 0 or _flag(data, "calculate_entropy", False):
        return False
    if not {"advantages", "response_mask"} <= set(data.keys()):
        return False
    mode = cfg.policy_loss.get("loss_mode", "vanilla")
    if mode == "bypass_mode":
        corr = cfg.policy_loss.get("rollout_correction", None) or {}
        return corr.get("loss_type", "ppo_clip") in _LINEAR_BYPASS_TYPES
    return mode in _LINEAR_LOSS_MODES


def trainer_threads(env: dict[str, str] | None = None, cpus: int | None = None) -> int:
    """torch threads of one CPU trainer rank: ``ENVACE_TRAINER_THREADS`` if set, else this machine's CPUs shared
    evenly by the trainer ranks verl places on it (``RAY_LOCAL_WORLD_SIZE``), at least 1."""
    env = os.environ if env is None else env
    if env.get("ENVACE_TRAINER_THREADS"):
        threads = int(env["ENVACE_TRAINER_THREADS"])
        if threads < 1:
            raise ValueError(f"ENVACE_TRAINER_THREADS must be >= 1, got {threads}")
        return threads
    cpus = len(os.sched_getaffinity(0)) if cpus is None else cpus
    return max(1, cpus // max(1, int(env.get("RAY_LOCAL_WORLD_SIZE", "1"))))


def _flag(micro_batch: TensorDict, key: str, default: Any) -> Any:
    return tu.get_non_tensor_data(data=micro_batch, key=key, default=default)


@EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device="cpu")
class CPUFSDPEngineWithLMHead(FSDPEngineWithLMHead):
    """verl's FSDP actor/ref engine; logits are computed for response positions only (see the module doc)."""

    def initialize(self):
        torch.set_num_threads(trainer_threads())
        logger.info("envace CPU engine: %d torch threads", torch.get_num_threads())
        return super().initialize()

    def _response_only(self, micro_batch: TensorDict) -> bool:
        reason = self._fallback_reason(micro_batch)
        if reason is not None and reason not in self._reported:
            self._reported.add(reason)
            logger.warning("envace CPU engine: full-vocabulary logits over every position (%s)", reason)
        return reason is None

    _reported: ClassVar[set[str]] = set()  # fallback reasons already logged in this process

    def _fallback_reason(self, micro_batch: TensorDict) -> str | None:
        if _flag(micro_batch, "use_remove_padding", True):
            return "use_remove_padding is on"
        if self.use_ulysses_sp:
            return "Ulysses sequence parallelism"
        if _flag(micro_batch, "pad_mode", DatasetPadMode.NO_PADDING) != DatasetPadMode.NO_PADDING:
            return "pad_mode is not no_padding"
        for key in ("use_fused_kernels", "distillation_use_topk", "distillation_only", "calculate_sum_pi_squared"):
            if _flag(micro_batch, key, False):
                return key
        if extract_multi_modal_inputs(micro_batch.get("multi_modal_inputs", [])):
            return "multi-modal inputs"
        missing = {"prompts", "responses", "input_ids", "position_ids"} - set(micro_batch.keys())
        if missing:
            return f"micro-batch lacks {sorted(missing)}"
        if not all(micro_batch[k].is_nested for k in ("prompts", "responses", "input_ids", "position_ids")):
            return "not nested tensors"
        if micro_batch["position_ids"].dim() != 2:
            return "multi-row position ids"
        return None

    _rows: torch.Tensor | None = None  # [batch, response columns] mask the lm_head pre-hook gathers by
    _hooked: Any = None  # the lm_head module the pre-hook is registered on

    def _gather_rows(self, module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """``lm_head`` pre-hook: only the real (non-padding) response positions reach the vocabulary projection."""
        rows, self._rows = self._rows, None
        if rows is None:
            return None
        return (args[0][rows], *args[1:])

    def _project_rows(self, valid: torch.Tensor) -> None:
        head = self.module.get_output_embeddings()
        if self._hooked is not head:
            head.register_forward_pre_hook(self._gather_rows)
            self._hooked = head
        self._rows = valid

    def forward_backward_batch(self, data: TensorDict, loss_function: Any, forward_only: bool = False) -> Any:
        """verl's loop over the mini-batch's micro-batches; a training pass gets the rows sorted by length.

        verl cuts fixed micro-batches (``use_dynamic_bsz: false``) in row order, and on the padded path a
        micro-batch costs its row count times its longest prompt plus its longest response, so one long
        rollout makes every row beside it pay its width. Sorted, rows of similar length share micro-batches.
        The gradient is the same sum in another order: verl normalises each micro-batch's loss by the whole
        mini-batch's token count (``batch_num_tokens``, ``dp_size``), and a training pass returns metrics only.
        Forward-only passes (log-probs, whose outputs map back to rows) and anything off the padded path keep
        verl's order.

        Under a policy loss that vanishes with the advantage (:func:`_loss_is_linear_in_advantages`) the inert
        rows (:func:`inert_rows`: zero advantage everywhere) go first, and the micro-batches made of them alone are
        not run (:meth:`forward_step`): the same gradient, without the forward and backward passes of rows that
        add nothing to it.
        """
        if forward_only or not self._sorts_rows(data):
            return super().forward_backward_batch(data, loss_function, forward_only=forward_only)
        inert = inert_rows(data) if _loss_is_linear_in_advantages(loss_function, data) else None
        data = tu.index_select_tensor_dict(data, length_order(data["input_ids"].offsets().diff(), first=inert))
        skips, micro = 0, int(_flag(data, "micro_batch_size_per_gpu", 0))
        if inert is not None and micro > 0:
            # the leading micro-batches made of inert rows alone; every data-parallel rank skips as many (a forward
            # all-gathers the parameters, a collective)
            count = torch.tensor(int(inert.sum()) // micro)
            if torch.distributed.is_initialized():
                torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MIN,
                                             group=self.get_data_parallel_group())
            skips = int(count)
        self._skips_left = skips
        try:
            output = super().forward_backward_batch(data, loss_function, forward_only=forward_only)
        finally:
            self._skips_left = 0
        if skips and skips * micro >= len(data):
            # no micro-batch ran: verl's optimizer step still gets the mini-batch's gradient, zeros (Adam's moments
            # move on zero gradients too)
            for param in self.module.parameters():
                if param.requires_grad and param.grad is None:
                    param.grad = torch.zeros_like(param)
        return output

    _skips_left = 0  # leading inert micro-batches of the current training pass still to skip

    def forward_step(self, micro_batch: TensorDict, loss_function: Any, forward_only: bool) -> Any:
        """verl's forward step, except for a training pass's leading micro-batches of inert rows (see
        :func:`inert_rows`): their loss and its gradient are 0, so they are not run. They report ``actor/pg_loss``
        (0, summed like verl's) and no per-micro-batch means, so ``actor/pg_clipfrac`` and ``actor/ppo_kl`` average
        over the micro-batches that ran."""
        if not forward_only and self._skips_left > 0 and bool(inert_rows(micro_batch).all()):
            from verl.utils.metric import AggregationType, Metric

            self._skips_left -= 1
            return torch.zeros((), requires_grad=True), {
                "loss": 0.0, "metrics": {"actor/pg_loss": Metric(value=0.0, aggregation=AggregationType.SUM)}}
        return super().forward_step(micro_batch, loss_function, forward_only)

    def _sorts_rows(self, data: TensorDict) -> bool:
        return (
            self._fallback_reason(data) is None
            and not _flag(data, "use_dynamic_bsz", True)  # verl's balancer rearranges the rows itself
            and int(_flag(data, "force_group_size", 1)) == 1  # consecutive rows that must stay together
            and not _flag(data, "return_model_output", False)  # outputs returned row by row
        )

    def prepare_model_inputs(self, micro_batch: TensorDict):
        self._rows = None
        if not self._response_only(micro_batch):
            return super().prepare_model_inputs(micro_batch)
        input_ids, position_ids = micro_batch["input_ids"], micro_batch["position_ids"]
        prompt_lens = micro_batch["prompts"].offsets().diff()
        response_lens = micro_batch["responses"].offsets().diff()
        seq_lens = input_ids.offsets().diff()
        if not torch.equal(prompt_lens + response_lens, seq_lens):
            raise ValueError("micro-batch prompts + responses do not add up to its input_ids")
        batch, width_p, width_r = len(seq_lens), int(prompt_lens.max()), int(response_lens.max())
        # token j of sequence i goes to column (width_p - P_i) + j: prompts end, and responses start, together
        row = torch.repeat_interleave(torch.arange(batch), seq_lens)
        col = torch.arange(int(seq_lens.sum())) - torch.repeat_interleave(input_ids.offsets()[:-1], seq_lens)
        col = col + torch.repeat_interleave(width_p - prompt_lens, seq_lens)
        pad_token_id = _flag(micro_batch, "pad_token_id", 0)
        ids = torch.full((batch, width_p + width_r), pad_token_id, dtype=input_ids.dtype)
        pos = torch.zeros((batch, width_p + width_r), dtype=position_ids.dtype)
        mask = torch.zeros((batch, width_p + width_r), dtype=torch.long)
        ids[row, col] = input_ids.values()
        pos[row, col] = position_ids.values()
        mask[row, col] = 1
        temperature = micro_batch["temperature"]
        if not isinstance(temperature, torch.Tensor):
            temperature = torch.full((batch,), float(temperature))
        output_args = {
            _KEPT: True,
            "labels": ids[:, width_p : width_p + width_r],  # response token t of row i is predicted at width_p - 1 + t
            "valid": torch.arange(width_r).unsqueeze(0) < response_lens.unsqueeze(1),
            "temperature": temperature.to(torch.float32),
            "packed_positions": response_logit_positions(prompt_lens, response_lens),
        }
        model_inputs = {"input_ids": ids, "attention_mask": mask, "position_ids": pos,
                        "logits_to_keep": torch.arange(width_p - 1, width_p - 1 + width_r)}
        # rows shorter than the longest response leave padding columns: those never reach the vocabulary either
        self._project_rows(output_args["valid"])
        return model_inputs, output_args

    def prepare_model_outputs(self, output, output_args, micro_batch: TensorDict, logits_processor_func):
        if not output_args.get(_KEPT):
            return super().prepare_model_outputs(output, output_args, micro_batch, logits_processor_func)
        valid = output_args["valid"]
        self._rows = None
        # (Σ R_i, vocab), sequence by sequence: the lm_head pre-hook already gathered the valid positions
        logits = output.logits if output.logits.dim() == 2 else output.logits[valid]
        temperature = output_args["temperature"]
        if not bool((temperature == 1.0).all()):
            logits = logits / temperature.unsqueeze(1).expand_as(valid)[valid].unsqueeze(-1)
        labels = output_args["labels"][valid]
        keep = output_args["packed_positions"]
        total = int(micro_batch["input_ids"].offsets()[-1])
        cu_seqlens = micro_batch["input_ids"].offsets()

        def packed(values: torch.Tensor) -> torch.Tensor:
            full = torch.zeros(total, dtype=values.dtype, device=values.device).index_put((keep,), values)
            return torch.nested.nested_tensor_from_jagged(full, cu_seqlens)

        model_output: dict[str, torch.Tensor] = {}
        if _flag(micro_batch, "calculate_entropy", False):
            # as verl's padded path: the plain function (its torch.compile'd one is for the packed path)
            if self.engine_config.entropy_checkpointing:
                entropy = torch.utils.checkpoint.checkpoint(verl_F.entropy_from_logits, logits)
            else:
                entropy = verl_F.entropy_from_logits(logits)
            model_output["entropy"] = packed(entropy)
        model_output["log_probs"] = packed(verl_F.logprobs_from_logits(logits=logits, labels=labels, inplace_backward=False))
        return model_output
