"""hfcpu's decoding loop: log-probs agree with a full forward pass; sampling controls behave."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from envace.models import ensure_tiny_model
from envace.platform.rollout import (
    DecodeBatch,
    SamplingSpec,
    _filter_logits,
    sample_batch,
    sample_index,
    sample_tokens,
)


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def model(request):
    """The tiny Qwen3 with the CPU platform's attention kernel (sdpa) and with eager attention."""
    m = AutoModelForCausalLM.from_pretrained(ensure_tiny_model(), dtype=torch.float32, attn_implementation=request.param)
    return m.eval()


PROMPT = [9707, 11, 1879, 0, 151644, 77091, 198]


def full_forward_logprobs(model, prompt, tokens, temperature):
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_rollout_logprobs_match_a_full_forward(model, temperature):
    spec = SamplingSpec({"temperature": temperature, "max_tokens": 12, "logprobs": True}, 99)
    toks, lps, _ = sample_tokens(model, PROMPT, spec, eos_ids=set(), generator=torch.Generator().manual_seed(1))
    assert len(toks) == len(lps) == 12
    ref = full_forward_logprobs(model, PROMPT, toks, temperature)
    assert torch.allclose(torch.tensor(lps), ref, atol=1e-4), (lps, ref.tolist())


def test_same_seed_same_tokens_and_greedy_equals_top_k_1(model):
    spec = SamplingSpec({"temperature": 1.0, "max_tokens": 8}, 99)
    a = sample_tokens(model, PROMPT, spec, set(), torch.Generator().manual_seed(7))[0]
    b = sample_tokens(model, PROMPT, spec, set(), torch.Generator().manual_seed(7))[0]
    assert a == b
    greedy = sample_tokens(model, PROMPT, SamplingSpec({"temperature": 0, "max_tokens": 8}, 99), set())[0]
    top1 = sample_tokens(model, PROMPT, SamplingSpec({"temperature": 1.0, "top_k": 1, "max_tokens": 8}, 99), set(),
                         torch.Generator().manual_seed(3))[0]
    assert greedy == top1


def test_stops_at_eos_and_respects_max_tokens(model):
    greedy = SamplingSpec({"temperature": 0, "max_tokens": 8}, 99)
    toks, _, finish = sample_tokens(model, PROMPT, greedy, set())
    assert finish == "length" and len(toks) == 8
    stop_at = toks[2]
    toks2, _, finish2 = sample_tokens(model, PROMPT, greedy, {stop_at})
    assert finish2 == "stop" and toks2 == toks[: toks.index(stop_at) + 1]
    assert sample_tokens(model, PROMPT, SamplingSpec({"temperature": 0, "max_tokens": 8, "ignore_eos": True}, 99),
                         {stop_at})[0] == toks


def test_filter_logits_top_k_and_top_p():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    assert torch.isinf(_filter_logits(logits, 2, 1.0)[2:]).all()
    probs = torch.softmax(logits, -1)  # [0.64, 0.24, 0.09, 0.03]
    kept = ~torch.isinf(_filter_logits(logits, -1, 0.7))
    assert kept.tolist() == [True, True, False, False]
    assert probs[0] < 0.7 < probs[:2].sum()


def test_sample_index_draws_from_the_distribution_and_never_a_zero_probability_entry(monkeypatch):
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    g = torch.Generator().manual_seed(0)
    n = 20_000
    counts = torch.bincount(torch.tensor([sample_index(probs, g) for _ in range(n)]), minlength=len(probs))
    assert counts[probs == 0].sum() == 0
    # within 5 standard errors of each entry's expected count
    expected = probs * n
    assert ((counts - expected).abs() <= 5 * (expected * (1 - probs)).sqrt() + 1).all(), counts.tolist()
    # seeded: the same generator state, the same draw
    draws = {sample_index(probs, torch.Generator().manual_seed(5)) for _ in range(3)}
    assert len(draws) == 1
    # the uniform's extremes: 0 lands on the first positive entry; a value that rounds onto the CDF's top
    # lands on the last positive entry, not past the end nor on a trailing zero
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.zeros(1))
    assert sample_index(torch.tensor([0.0, 0.5, 0.5])) == 1
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.ones(1))
    assert sample_index(torch.tensor([0.25, 0.75, 0.0])) == 1


def test_bad_sampling_params_are_rejected():
    with pytest.raises(ValueError, match="top_p"):
        SamplingSpec({"top_p": 0}, 10)
    with pytest.raises(ValueError, match="temperature"):
        SamplingSpec({"temperature": -1}, 10)


PROMPTS = [PROMPT, [151644, 872, 198, 9707, 0, 151645, 198, 151644, 77091, 198], [872, 198]]


def test_a_batch_decodes_each_request_as_it_would_alone(model):
    """Left padding, per-row positions and rows leaving the cache change nothing a request sees."""
    specs = [
        SamplingSpec({"temperature": 0, "max_tokens": 12}, 99),
        SamplingSpec({"temperature": 0.8, "max_tokens": 5, "repetition_penalty": 1.3}, 99),  # leaves early
        SamplingSpec({"temperature": 1.0, "top_p": 0.9, "max_tokens": 9}, 99),
    ]
    alone = [sample_tokens(model, p, s, set(), torch.Generator().manual_seed(i)) for i, (p, s) in
             enumerate(zip(PROMPTS, specs))]
    together = sample_batch(model, PROMPTS, specs, set(), [torch.Generator().manual_seed(i) for i in range(3)])
    assert [len(t[0]) for t in together] == [12, 5, 9]
    for (a_ids, a_lp, a_fin), (b_ids, b_lp, b_fin) in zip(alone, together):
        assert a_ids == b_ids and a_fin == b_fin
        assert torch.allclose(torch.tensor(a_lp), torch.tensor(b_lp), atol=1e-4)
    # and each row's log-probs are the full forward's of its own tokens
    for p, s, (ids, lps, _) in zip(PROMPTS, specs, together):
        ref = full_forward_logprobs(model, p, ids, s.temperature)
        assert torch.allclose(torch.tensor(lps), ref, atol=1e-4)


def test_rows_that_join_a_running_batch_decode_as_they_would_alone(model):
    """Continuous batching: rows added between decode steps (a longer prompt than the batch's cache, a shorter
    one) sample what they would alone, and once the rows that held the oldest cache columns leave, the columns
    that are padding in every remaining row are dropped."""
    specs = [
        SamplingSpec({"temperature": 0.8, "max_tokens": 4, "ignore_eos": True}, 99),  # leaves first
        SamplingSpec({"temperature": 1.0, "max_tokens": 9, "ignore_eos": True, "repetition_penalty": 1.3}, 99),
        SamplingSpec({"temperature": 0, "max_tokens": 14, "ignore_eos": True}, 99),  # outlives the others
    ]
    prompts = [PROMPTS[1][-5:], PROMPTS[0], PROMPTS[2]]  # 5, 7 and 2 tokens
    alone = [sample_tokens(model, p, s, set(), torch.Generator().manual_seed(i))
             for i, (p, s) in enumerate(zip(prompts, specs))]
    batch = DecodeBatch(model, set())
    batch.add([0], prompts[:1], specs[:1], [torch.Generator().manual_seed(0)])
    results = batch.step()
    batch.add([1], prompts[1:2], specs[1:2], [torch.Generator().manual_seed(1)])  # 7 > 6 columns: cache padded
    results |= batch.step()
    batch.add([2], prompts[2:], specs[2:], [torch.Generator().manual_seed(2)])  # 2 < 8 columns: this row padded
    widths = []
    while batch:
        results |= batch.step()
        widths.append(batch.mask.shape[1])
    assert [results[i][0] for i in range(3)] == [a[0] for a in alone]
    for i in range(3):
        assert results[i][2] == "length"
        torch.testing.assert_close(torch.tensor(results[i][1]), torch.tensor(alone[i][1]), atol=1e-4, rtol=0)
    # alone at the end, row 2 attends to its 2 prompt tokens and the 13 it fed back: its left padding is gone
    assert widths[-2] == 2 + 13
    assert batch.steps == 15 and batch.row_steps == 3 + 8 + 13


def test_a_row_that_stops_leaves_the_others_running(model):
    greedy = SamplingSpec({"temperature": 0, "max_tokens": 10}, 99)
    first = sample_tokens(model, PROMPTS[0], greedy, set())[0]
    stop_at = first[2]
    out = sample_batch(model, PROMPTS[:2], [greedy, greedy], {stop_at}, [None, None])
    assert out[0][0] == first[: first.index(stop_at) + 1] and out[0][2] == "stop"
    assert out[1][0] == sample_tokens(model, PROMPTS[1], greedy, {stop_at})[0]


class ConstantLogits(torch.nn.Module):
    """A stand-in decoder whose next-token logits are always ``logits``, whatever the context (no KV cache)."""

    def __init__(self, logits: list[float]):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1), requires_grad=False)  # sample_batch reads the device
        self.fixed = torch.tensor(logits)
        self.config = SimpleNamespace(vocab_size=len(logits))

    def forward(self, input_ids, **_):
        return SimpleNamespace(logits=self.fixed.repeat(input_ids.shape[0], 1, 1), past_key_values=None)


@pytest.mark.parametrize(
    "logits",
    [
        # positive logits are divided by p = 2: step 1, seen {0}: [1, 1.5, -1] -> 1; step 2, seen {0, 1}:
        # [1, 0.75, -1] -> 0; step 3: the same -> 0 (inverted, [4, 1.5, -1]: token 0 at every step)
        [2.0, 1.5, -1.0],
        # negative logits are multiplied by p = 2: step 1, seen {0}: [-2, -1.5, -3] -> 1; step 2, seen {0, 1}:
        # [-2, -3, -3] -> 0; step 3: the same -> 0 (inverted, [-0.5, -1.5, -3]: token 0 at every step)
        [-1.0, -1.5, -3.0],
    ],
)
def test_repetition_penalty_pushes_greedy_decoding_off_the_tokens_already_seen(logits):
    """HF/vLLM convention: a seen token's logit l becomes l / p when l > 0 and l * p otherwise (p > 1 always lowers
    it); "seen" is the prompt and every token generated so far. Greedy over fixed logits whose best token is in the
    prompt: [1, 0, 0] with p = 2, token 0 at every step without the penalty."""
    model = ConstantLogits(logits)
    greedy = {"temperature": 0, "max_tokens": 3}
    assert sample_tokens(model, [0], SamplingSpec(greedy, 99), set())[0] == [0, 0, 0]
    ids, _, finish = sample_tokens(model, [0], SamplingSpec({**greedy, "repetition_penalty": 2.0}, 99), set())
    assert ids == [1, 0, 0] and finish == "length"
