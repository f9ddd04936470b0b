"""The hfcpu server actor's own logic, in-process (no Ray): request batching, seeding, weight loading."""

from __future__ import annotations

import asyncio

import pytest
import torch
from omegaconf import OmegaConf

from envace.models import ensure_tiny_model
from envace.platform.rollout import HFCPUServer, SamplingSpec, sample_tokens


@pytest.fixture(scope="module")
def server():
    rollout = OmegaConf.create({"_target_": "verl.workers.config.RolloutConfig", "name": "hfcpu",
                                "prompt_length": 64, "response_length": 32, "max_num_seqs": 4})
    model = OmegaConf.create({"_target_": "verl.workers.config.HFModelConfig", "path": str(ensure_tiny_model())})
    return HFCPUServer(rollout, model, replica_rank=0)


PROMPTS = [[9707, 11, 1879 + i, 0, 151644, 77091, 198][: 7 - i % 3] for i in range(6)]


async def _generate_all(server, params):
    return await asyncio.gather(*[server.generate(p, params, f"r{i}") for i, p in enumerate(PROMPTS)])


def test_concurrent_requests_share_batches_and_get_their_own_answers(server):
    greedy = {"temperature": 0, "max_tokens": 6, "logprobs": True}
    batches, served = server.batches, server.batched_requests
    outs = asyncio.run(_generate_all(server, greedy))
    assert server.batched_requests - served == 6
    # 6 concurrent requests with max_num_seqs=4: two batches (a third would mean no batching happened)
    assert server.batches - batches == 2
    for p, o in zip(PROMPTS, outs):
        ids, lps, _ = sample_tokens(server.model, p, SamplingSpec(greedy, 99), server.eos_ids)
        assert o.token_ids == ids and torch.allclose(torch.tensor(o.log_probs), torch.tensor(lps), atol=1e-4)
        assert o.extra_fields["finish_reason"] == "length"
    no_lp = asyncio.run(server.generate(PROMPTS[0], {"temperature": 0, "max_tokens": 2}, "x"))
    assert no_lp.log_probs is None


def test_an_explicit_seed_reproduces_a_sample_and_the_budget_is_the_context_window(server):
    params = {"temperature": 1.0, "max_tokens": 8, "seed": 123}
    a = asyncio.run(server.generate(PROMPTS[0], params, "a")).token_ids
    b = asyncio.run(server.generate(PROMPTS[0], params, "b")).token_ids
    assert a == b and len(a) == 8
    with pytest.raises(ValueError, match="no room to generate"):
        asyncio.run(server.generate(list(range(1, 97)), {"max_tokens": 4}, "long"))
    # max_tokens beyond the window is cut to what fits: 96 - 90 = 6 tokens
    assert len(asyncio.run(server.generate(list(range(1, 91)), {"temperature": 0, "max_tokens": 50}, "c")).token_ids) == 6


def test_load_weights_changes_what_is_generated_and_rejects_foreign_tensors(server):
    state = {k: v.clone() for k, v in server.model.state_dict().items()}
    before = asyncio.run(server.generate(PROMPTS[0], {"temperature": 0, "max_tokens": 6}, "b")).token_ids
    checksum = server.state_checksum()
    norm = "model.norm.weight"
    try:
        # a negated final norm negates every logit: the greedy token becomes the least likely one
        assert server.load_weights({norm: -state[norm]}, global_steps=3) == 1
        assert server.state_checksum() != checksum
        after = asyncio.run(server.generate(PROMPTS[0], {"temperature": 0, "max_tokens": 6}, "a"))
        assert after.token_ids[0] != before[0] and after.extra_fields["global_steps"] == 3
        with pytest.raises(KeyError, match="not in the rollout model"):
            server.load_weights({"no.such.weight": torch.zeros(1)})
    finally:
        server.load_weights(state)
    assert server.state_checksum() == pytest.approx(checksum)
    assert asyncio.run(server.generate(PROMPTS[0], {"temperature": 0, "max_tokens": 6}, "c")).token_ids == before


def _in_thread(fn):
    """Run ``fn`` in a thread; returns a zero-argument function that joins it and returns its result."""
    import concurrent.futures

    pool = concurrent.futures.ThreadPoolExecutor(1)
    future = pool.submit(fn)
    pool.shutdown(wait=False)
    return lambda: future.result(timeout=120)


def _wait_for_decoding(server, steps_before):
    import time

    deadline = time.monotonic() + 60
    while server.decode_steps <= steps_before:
        assert time.monotonic() < deadline, "the decode thread never started"
        time.sleep(0.001)


def test_a_request_joins_the_running_batch_and_gets_its_own_answer(server):
    """Continuous batching: a request that arrives while another decodes joins that batch (no new batch starts)
    and both get what they would get alone, a longer prompt (the batch's cache is left-padded) and a shorter one."""
    long_run = {"temperature": 0, "max_tokens": 30, "ignore_eos": True, "logprobs": True}
    alone = {i: sample_tokens(server.model, PROMPTS[i], SamplingSpec(long_run, 99), set()) for i in (1, 2, 3)}
    first = [9707, 11, 1879]  # shorter than PROMPTS[1], longer than PROMPTS[2]
    first_alone = sample_tokens(server.model, first, SamplingSpec(long_run, 99), set())
    batches, steps = server.batches, server.decode_steps
    running = _in_thread(lambda: asyncio.run(server.generate(first, long_run, "first")))
    _wait_for_decoding(server, steps)
    joined = asyncio.run(_gather(server, [PROMPTS[1], PROMPTS[2]], long_run))
    assert server.batches - batches == 1
    out = running()
    assert out.token_ids == first_alone[0]
    assert torch.allclose(torch.tensor(out.log_probs), torch.tensor(first_alone[1]), atol=1e-4)
    for i, o in zip((1, 2), joined):
        assert o.token_ids == alone[i][0]
        assert torch.allclose(torch.tensor(o.log_probs), torch.tensor(alone[i][1]), atol=1e-4)
    # the two joined rows decoded beside the first: fewer decode passes than three requests one after another
    assert server.decode_steps - steps < 3 * 29


async def _gather(server, prompts, params):
    return await asyncio.gather(*[server.generate(p, params, f"j{i}") for i, p in enumerate(prompts)])


def test_a_weight_load_waits_for_the_running_batch_to_drain(server):
    """Weights never change under a live row: the load waits, the running request finishes on the old weights."""
    params = {"temperature": 0, "max_tokens": 30, "ignore_eos": True}
    state = {k: v.clone() for k, v in server.model.state_dict().items()}
    before = asyncio.run(server.generate(PROMPTS[0], params, "before")).token_ids
    norm = "model.norm.weight"
    steps = server.decode_steps
    try:
        running = _in_thread(lambda: asyncio.run(server.generate(PROMPTS[0], params, "running")))
        _wait_for_decoding(server, steps)
        assert server.load_weights({norm: -state[norm]}) == 1
        assert running().token_ids == before
        assert asyncio.run(server.generate(PROMPTS[0], params, "after")).token_ids[0] != before[0]
    finally:
        server.load_weights(state)


def test_a_request_that_fails_to_join_loses_nothing_of_the_running_batch(server):
    """A prompt the model cannot embed fails its own caller; the request already decoding finishes unharmed."""
    params = {"temperature": 0, "max_tokens": 30, "ignore_eos": True}
    alone = sample_tokens(server.model, PROMPTS[0], SamplingSpec(params, 99), set())[0]
    steps = server.decode_steps
    running = _in_thread(lambda: asyncio.run(server.generate(PROMPTS[0], params, "running")))
    _wait_for_decoding(server, steps)
    with pytest.raises(IndexError):
        asyncio.run(server.generate([9707, 10**9], params, "bad"))
    assert running().token_ids == alone
