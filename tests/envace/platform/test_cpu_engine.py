"""The CPU FSDP engine (envace/platform/engine.py): response-only logits give verl's own numbers.

The engine overrides two methods of verl's ``FSDPEngineWithLMHead``; these tests run both classes on the same
micro-batch and model and compare what verl's loss reads (``no_padding_2_padding``), values and
gradients, and pin the verl version and the verl lines the override mirrors.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
import verl
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.utils.padding import no_padding_2_padding

from envace.platform.engine import (
    VERL_VERSION,
    CPUFSDPEngineWithLMHead,
    inert_rows,
    length_order,
    response_logit_positions,
    trainer_threads,
)


def test_pins_the_verl_release_and_the_lines_it_mirrors():
    assert verl.__version__ == VERL_VERSION, "re-check envace/platform/engine.py against this verl release"
    outputs = inspect.getsource(FSDPEngineWithLMHead.prepare_model_outputs)
    # the padded path the override replaces: full logits, temperature scaling, log-probs of the rolled ids
    assert "logits = output.logits  # (bsz, response_length, vocab_size)" in outputs
    assert "log_probs = logprobs_from_logits(logits=logits_rmpad, labels=input_ids_rmpad_rolled)" in outputs
    assert 'model_output["log_probs"] = log_probs' in outputs
    inputs = inspect.getsource(FSDPEngineWithLMHead.prepare_model_inputs)
    assert "input_ids_rmpad_rolled = torch.roll(input_ids.values(), shifts=-1, dims=0)" in inputs
    # what the loss reads of the packed outputs: the positions response_logit_positions keeps
    assert "left-shift model output by one token" in inspect.getsource(no_padding_2_padding)
    # the sorted training pass relies on: fixed micro-batches cut in row order, each loss normalised by the whole
    # mini-batch's token count (so the order of rows does not change the gradient)
    from verl.workers.engine.utils import prepare_micro_batches

    assert "micro_batches = tu.chunk_tensordict(data, " in inspect.getsource(prepare_micro_batches)
    loop = inspect.getsource(FSDPEngineWithLMHead.forward_backward_batch)
    assert "tu.assign_non_tensor(data, batch_num_tokens=batch_num_tokens.item())" in loop
    assert list(inspect.signature(FSDPEngineWithLMHead.forward_backward_batch).parameters) == [
        "self", "data", "loss_function", "forward_only"]
    # the skipped micro-batches: verl calls forward_step per micro-batch, backpropagates the loss it returns and
    # collects the metrics it reports; the actor's loss is ppo_loss bound to the actor config (nothing else)
    assert "loss, meta_info = self.forward_step(micro_batch, loss_function=loss_function, forward_only=forward_only)" \
        in loop
    assert "loss.backward()" in loop
    from verl.workers import engine_workers

    assert "self.loss_fn = partial(ppo_loss, config=actor_config)" in inspect.getsource(engine_workers)


def test_registered_for_the_cpu_device(monkeypatch):
    monkeypatch.delenv("VERL_ENGINE_DEVICE", raising=False)
    monkeypatch.setattr("verl.workers.engine.base.get_device_name", lambda: "cpu")
    for backend in ("fsdp", "fsdp2"):
        assert EngineRegistry.get_engine_cls("language_model", backend) is CPUFSDPEngineWithLMHead


def test_response_positions():
    keep = response_logit_positions(torch.tensor([3, 2]), torch.tensor([2, 4]))
    # sequence 0 = positions 0..4 (prompt 0..2), sequence 1 = 5..10 (prompt 5..6)
    assert keep.tolist() == [2, 3, 6, 7, 8, 9]


def _engine(cls, model, entropy_checkpointing=False):
    from verl.utils import torch_functional as verl_F

    eng = object.__new__(cls)
    eng.module = model
    eng.pad_to_length = False
    eng.pad_to_length_bucket = 0
    eng.use_ulysses_sp = False
    eng.engine_config = SimpleNamespace(entropy_checkpointing=entropy_checkpointing,
                                        entropy_from_logits_with_chunking=False)
    eng.compute_entropy_from_logits = verl_F.entropy_from_logits
    return eng


def _micro_batch(prompts, responses, temperature):
    seqs = [p + r for p, r in zip(prompts, responses, strict=True)]
    def nested(rows):
        return torch.nested.as_nested_tensor([torch.tensor(r) for r in rows], layout=torch.jagged)

    td = TensorDict(
        {
            "input_ids": nested(seqs),
            "position_ids": nested([list(range(len(s))) for s in seqs]),
            "prompts": nested(prompts),
            "responses": nested(responses),
            "temperature": torch.tensor([temperature] * len(seqs)),
        },
        batch_size=[len(seqs)],
    )
    tu.assign_non_tensor(td, use_remove_padding=False, calculate_entropy=True, pad_token_id=0)
    return td


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def model(request):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=997, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True,
                      attn_implementation=request.param)
    return Qwen3ForCausalLM(cfg).float()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_same_log_probs_entropy_and_gradients_as_verl(model, temperature):
    g = torch.Generator().manual_seed(1)
    lens = [(5, 3), (9, 6), (4, 1)]
    prompts = [torch.randint(0, 997, (p,), generator=g).tolist() for p, _ in lens]
    responses = [torch.randint(0, 997, (r,), generator=g).tolist() for _, r in lens]
    results = {}
    for cls in (FSDPEngineWithLMHead, CPUFSDPEngineWithLMHead):
        mb = _micro_batch(prompts, responses, temperature)
        eng = _engine(cls, model)
        model.zero_grad()
        inputs, args = eng.prepare_model_inputs(mb)
        raw = model(**inputs, use_cache=False)
        # envace's engine projects the Σ R_i real response positions only (no padding columns)
        if cls is CPUFSDPEngineWithLMHead:
            assert raw.logits.shape == (sum(r for _, r in lens), 997)
        out = eng.prepare_model_outputs(raw, args, mb, None)
        lp = no_padding_2_padding(out["log_probs"], mb)
        ent = no_padding_2_padding(out["entropy"], mb)
        (lp.sum() + 0.1 * ent.sum()).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        results[cls] = (lp.detach(), ent.detach(), grads, inputs)
    lp0, ent0, g0, in0 = results[FSDPEngineWithLMHead]
    lp1, ent1, g1, in1 = results[CPUFSDPEngineWithLMHead]
    assert "logits_to_keep" not in in0 and in1["logits_to_keep"].numel() == max(r for _, r in lens)
    torch.testing.assert_close(lp1, lp0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent1, ent0, rtol=1e-5, atol=1e-5)
    for a, b in zip(g1, g0, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_right_aligned_prompts_give_each_sequence_its_own_log_probs(model):
    """Rows of very different prompt lengths, each scored alone without padding, match the batched engine."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 997, (n,), generator=g).tolist() for n in (11, 3, 7)]
    responses = [torch.randint(1, 997, (n,), generator=g).tolist() for n in (2, 6, 4)]
    eng = _engine(CPUFSDPEngineWithLMHead, model)
    mb = _micro_batch(prompts, responses, 1.0)
    with torch.no_grad():
        inputs, args = eng.prepare_model_inputs(mb)
        assert inputs["input_ids"].shape == (3, 11 + 6) and inputs["logits_to_keep"].tolist() == list(range(10, 16))
        batched = no_padding_2_padding(eng.prepare_model_outputs(model(**inputs, use_cache=False), args, mb, None)["log_probs"], mb)
        for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
            logits = model(input_ids=torch.tensor([p + r]), use_cache=False).logits[0, len(p) - 1 : -1]
            alone = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r)[:, None])[:, 0]
            torch.testing.assert_close(batched[i, : len(r)], alone, rtol=1e-5, atol=1e-5)


def test_falls_back_to_verl_outside_the_padded_path(model):
    for flags in ({"use_remove_padding": True}, {"calculate_sum_pi_squared": True}, {"use_fused_kernels": True}):
        mb = _micro_batch([[1, 2, 3]], [[4, 5]], 1.0)
        tu.assign_non_tensor(mb, **flags)
        assert not _engine(CPUFSDPEngineWithLMHead, model)._response_only(mb), flags


def test_text_only_multi_modal_field_keeps_the_response_only_path():
    """verl's batches carry an (empty) multi_modal_inputs entry per row; text-only rows still take the fast path."""
    from tensordict.tensorclass import NonTensorStack

    mb = _micro_batch([[1, 2, 3], [4, 5]], [[6], [7, 8]], 1.0)
    mb["multi_modal_inputs"] = NonTensorStack({}, {})
    assert _engine(CPUFSDPEngineWithLMHead, None)._fallback_reason(mb) is None


def test_trainer_threads_share_the_machine_between_local_ranks_unless_set():
    # Ray gives an actor that asks for no CPUs OMP_NUM_THREADS=1; the engine sizes torch's pool itself
    assert trainer_threads({}, cpus=2) == 2
    assert trainer_threads({"RAY_LOCAL_WORLD_SIZE": "2"}, cpus=8) == 4
    assert trainer_threads({"RAY_LOCAL_WORLD_SIZE": "4"}, cpus=2) == 1
    assert trainer_threads({"ENVACE_TRAINER_THREADS": "3", "RAY_LOCAL_WORLD_SIZE": "4"}, cpus=2) == 3
    with pytest.raises(ValueError, match="ENVACE_TRAINER_THREADS"):
        trainer_threads({"ENVACE_TRAINER_THREADS": "0"}, cpus=2)


def _mini_batch(lens, seed=3, **flags):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 997, (p,), generator=g).tolist() for p, _ in lens]
    responses = [torch.randint(1, 997, (r,), generator=g).tolist() for _, r in lens]
    mb = _micro_batch(prompts, responses, 1.0)
    mb["temperature"] = torch.arange(1, len(lens) + 1, dtype=torch.float32)  # per-row: must follow its row
    tu.assign_non_tensor(mb, **{"use_dynamic_bsz": False, **flags})
    return mb


def _rows(td, key="input_ids"):
    return [t.tolist() for t in td[key].unbind()]


def test_a_training_pass_hands_verl_the_rows_sorted_by_length(monkeypatch):
    """Only a training pass on the padded path with fixed micro-batches is reordered; log-prob passes, verl's
    length balancer, forced groups and returned outputs keep verl's row order."""
    seen = []
    monkeypatch.setattr(FSDPEngineWithLMHead, "forward_backward_batch",
                        lambda self, data, loss_function, forward_only=False: seen.append(data) or "out")
    eng = _engine(CPUFSDPEngineWithLMHead, None)
    lens = [(5, 1), (2, 4), (9, 2), (3, 2)]  # lengths 6, 6, 11, 5 -> order 3, 0, 1, 2 (stable for the two 6s)
    mb = _mini_batch(lens)
    assert eng.forward_backward_batch(mb, None) == "out"
    assert _rows(seen[-1]) == [_rows(mb)[i] for i in (3, 0, 1, 2)]
    assert seen[-1]["temperature"].tolist() == [4.0, 1.0, 2.0, 3.0]
    assert _rows(seen[-1], "responses") == [_rows(mb, "responses")[i] for i in (3, 0, 1, 2)]
    eng.forward_backward_batch(mb, None, forward_only=True)
    assert seen[-1] is mb
    for flags in ({"use_dynamic_bsz": True}, {"force_group_size": 2}, {"return_model_output": True},
                  {"use_remove_padding": True}):
        other = _mini_batch(lens, **flags)
        eng.forward_backward_batch(other, None)
        assert seen[-1] is other, flags


def test_sorted_micro_batches_give_the_same_gradient_in_fewer_padded_cells(model):
    """The gradient of a mini-batch's token-mean loss accumulated over fixed micro-batches does not depend on
    which rows share a micro-batch (verl normalises by the mini-batch's token count); sorting by length only
    shrinks the padded grid the model runs on."""
    lens = [(12, 2), (3, 5), (11, 1), (2, 2), (10, 3), (4, 1)]
    mb = _mini_batch(lens, seed=4)
    tokens = sum(r for _, r in lens)
    eng = _engine(CPUFSDPEngineWithLMHead, model)

    def accumulate(order):
        model.zero_grad()
        cells = 0
        for k in range(0, len(order), 2):
            micro = tu.index_select_tensor_dict(mb, order[k:k + 2])
            inputs, args = eng.prepare_model_inputs(micro)
            cells += inputs["input_ids"].numel()
            out = eng.prepare_model_outputs(model(**inputs, use_cache=False), args, micro, None)
            (-out["log_probs"].values().sum() / tokens).backward()
        return cells, [p.grad.clone() for p in model.parameters()]

    seq = torch.tensor([p + r for p, r in lens])
    cells_sorted, g_sorted = accumulate(length_order(seq).tolist())
    cells_verl, g_verl = accumulate(list(range(len(lens))))
    # verl's order pairs (12+2, 3+5), (11+1, 2+2), (10+3, 4+1): 2 x (12+5) + 2 x (11+2) + 2 x (10+3) = 86 cells;
    # sorted by length 4, 5, 8, 12, 13, 14 -> (2+2, 4+1), (3+5, 11+1), (10+3, 12+2):
    # 2 x (4+2) + 2 x (11+5) + 2 x (12+3) = 74
    assert (cells_verl, cells_sorted) == (86, 74)
    for a, b in zip(g_sorted, g_verl, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_length_order_puts_the_marked_rows_first_each_part_by_length():
    lens = torch.tensor([7, 3, 5, 3, 9, 1])
    assert length_order(lens).tolist() == [5, 1, 3, 2, 0, 4]
    first = torch.tensor([False, True, False, False, True, False])
    assert length_order(lens, first=first).tolist() == [1, 4, 5, 3, 2, 0]


def _nested(rows, dtype=torch.float32):
    return torch.nested.as_nested_tensor([torch.tensor(r, dtype=dtype) for r in rows], layout=torch.jagged)


def test_inert_rows_have_zero_advantage_at_every_counted_token():
    td = TensorDict({"advantages": _nested([[0.0, 0.0], [0.0, 0.5, 0.0], [1.0], [0.0, -0.3]]),
                     "response_mask": _nested([[1, 1], [1, 1, 1], [0], [1, 1]], torch.long)}, batch_size=[4])
    # row 2's only advantage sits on a token the loss does not count (mask 0)
    assert inert_rows(td).tolist() == [True, False, True, False]
    dense = TensorDict({"advantages": torch.tensor([[0.0, 0.0], [0.0, 2.0]]),
                        "response_mask": torch.tensor([[1, 1], [1, 0]])}, batch_size=[2])
    assert inert_rows(dense).tolist() == [True, True]


def _actor_config(**kw):
    from verl.workers.config import FSDPActorConfig

    return FSDPActorConfig(strategy="fsdp2", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, rollout_n=1, **kw)


def test_only_a_policy_loss_that_vanishes_with_the_advantage_skips_rows():
    from functools import partial

    from verl.workers.utils.losses import ppo_loss

    from envace.platform.engine import _loss_is_linear_in_advantages

    td = TensorDict({"advantages": _nested([[0.0]]), "response_mask": _nested([[1]], torch.long)}, batch_size=[1])
    assert _loss_is_linear_in_advantages(partial(ppo_loss, config=_actor_config()), td)
    for cfg in (_actor_config(use_kl_loss=True), _actor_config(entropy_coeff=0.01),
                _actor_config(policy_loss={"loss_mode": "gspo"})):
        assert not _loss_is_linear_in_advantages(partial(ppo_loss, config=cfg), td)
    assert _loss_is_linear_in_advantages(partial(ppo_loss, config=_actor_config(
        policy_loss={"loss_mode": "bypass_mode", "rollout_correction": {"loss_type": "reinforce"}})), td)
    assert not _loss_is_linear_in_advantages(lambda **kw: ppo_loss(config=_actor_config(), **kw), td)
    tu.assign_non_tensor(td, calculate_entropy=True)  # the entropy metric reads every row
    assert not _loss_is_linear_in_advantages(partial(ppo_loss, config=_actor_config()), td)


@pytest.fixture
def gloo():
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        yield
        dist.destroy_process_group()
    else:
        yield


@pytest.mark.parametrize("zero, forwards", [
    ({0, 2, 3, 5, 6, 7}, 1),  # six inert rows: three micro-batches of two skipped; rows 1 and 4 carry the gradient
    (set(range(8)), 0),  # every row inert: nothing runs, and the optimizer still gets (zero) gradients
])
def test_micro_batches_of_zero_advantage_rows_are_not_run_and_the_gradient_is_verls(model, gloo, zero, forwards):
    """verl's own micro-batch loop and ``ppo_loss``, once with envace's skip and once with a loss it does not
    recognise (so every micro-batch runs): the same gradient and summed loss, fewer forward passes."""
    from functools import partial

    from verl.workers.utils.losses import ppo_loss

    lens = [(6, 2), (3, 4), (8, 1), (2, 3), (5, 5), (7, 2), (4, 2), (3, 3)]
    cfg = _actor_config()

    def mini_batch():
        mb = _mini_batch(lens, seed=5, micro_batch_size_per_gpu=2, calculate_entropy=False)
        g = torch.Generator().manual_seed(6)
        mb["advantages"] = _nested([[0.0] * r if i in zero else torch.randn(r, generator=g).tolist()
                                    for i, (_, r) in enumerate(lens)])
        mb["response_mask"] = _nested([[1] * r for _, r in lens], torch.long)
        mb["loss_mask"] = mb["response_mask"]
        mb["old_log_probs"] = _nested([(-torch.rand(r, generator=g)).tolist() for _, r in lens])
        tu.assign_non_tensor(mb, global_batch_size=len(lens))
        return mb

    eng = _engine(CPUFSDPEngineWithLMHead, model)
    eng.engine_config.use_no_sync_for_gradient_accumulation = True
    eng.ulysses_sequence_parallel_size = 1
    eng._autocast_dtype = torch.float32
    eng.get_data_parallel_group = lambda: None
    eng.get_data_parallel_size = lambda: 1
    seen = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].shape[0]), with_kwargs=True)
    try:
        runs = {}
        for name, loss in (("skip", partial(ppo_loss, config=cfg)),
                           ("verl", lambda **kw: ppo_loss(config=cfg, **kw))):
            model.zero_grad(set_to_none=True)
            seen.clear()
            out = eng.forward_backward_batch(mini_batch(), loss)
            runs[name] = (len(seen), sum(out["loss"]), [p.grad.clone() for p in model.parameters()],
                          float(sum(out["metrics"]["actor/pg_loss"].values)))
    finally:
        hook.remove()
    assert (runs["skip"][0], runs["verl"][0]) == (forwards, 4)
    assert eng._skips_left == 0
    torch.testing.assert_close(runs["skip"][1], runs["verl"][1], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(runs["skip"][3], runs["verl"][3], rtol=1e-5, atol=1e-7)
    assert any(g.abs().sum() > 0 for g in runs["skip"][2]) == (len(zero) < len(lens))
    for a, b in zip(runs["skip"][2], runs["verl"][2], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
