"""hfcpu's seeding, in-process (no Ray): a request that carries a ``seed`` draws the same tokens whatever arrived
before it and whichever batch it decodes in (what makes two runs of one config and seed sample alike, with the agent
loop's per-rollout seeds); requests without one fall back to arrival-order seeds."""

from __future__ import annotations

import asyncio

import pytest
from omegaconf import OmegaConf

from envace.envs.base import get_pool
from envace.models import ensure_tiny_model, load_tokenizer
from envace.platform.rollout import HFCPUServer


def _server(path, prompt_length: int, rows: int) -> HFCPUServer:
    rollout = OmegaConf.create({"_target_": "verl.workers.config.RolloutConfig", "name": "hfcpu",
                                "prompt_length": prompt_length, "response_length": 32, "max_num_seqs": rows})
    model = OmegaConf.create({"_target_": "verl.workers.config.HFModelConfig", "path": str(path)})
    return HFCPUServer(rollout, model, replica_rank=0)


@pytest.fixture(scope="module")
def warm():
    """The warm start behind a server of 3 rows: 6 concurrent requests join and leave its running batch."""
    from envace.models.warmstart import ensure_warm_model

    return _server(ensure_warm_model(), 1024, rows=3)


@pytest.fixture(scope="module")
def solo():
    """The untrained tiny Qwen3 behind a server of 1 row: every request decodes alone, in the order it arrived."""
    return _server(ensure_tiny_model(), 64, rows=1)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """The first turns of six synthetic tasks (the CPU default's pool) in the real tokenizer's chat template."""
    tok = load_tokenizer()
    pool = get_pool("synthetic", shapes=["act", "query", "lookup_act", "lookup_query"], renamings=False)
    out = []
    for tid in pool.task_ids()[:6]:
        spec = pool.task(tid)
        text = tok.apply_chat_template(spec.initial_messages(), tools=spec.tools, add_generation_prompt=True,
                                       tokenize=False, enable_thinking=False)
        out.append(tok(text, add_special_tokens=False)["input_ids"])
    return out


SEEDS = [11, 2**62 + 7, 0, 123456789, 5, 12]
# different lengths: rows leave the running batch at different decode steps and waiting requests take their place
MAX_TOKENS = [12, 5, 9, 14, 7, 10]


def _params(i: int) -> dict:
    """Training's sampling (temperature 1, no top-k / top-p) under request ``i``'s seed."""
    return {"temperature": 1.0, "max_tokens": MAX_TOKENS[i], "ignore_eos": True, "seed": SEEDS[i]}


async def _together(server, prompts, order) -> dict[int, list[int]]:
    """Every request at once, submitted in ``order``."""
    outs = await asyncio.gather(*[server.generate(prompts[i], _params(i), f"r{i}") for i in order])
    return {i: o.token_ids for i, o in zip(order, outs, strict=True)}


async def _one_by_one(server, prompts, order) -> dict[int, list[int]]:
    """Each request alone, the next once the last has finished."""
    return {i: (await server.generate(prompts[i], _params(i), f"r{i}")).token_ids for i in order}


def test_a_seeded_request_draws_the_same_tokens_in_any_arrival_order(solo):
    """Six seeded requests sent together in one order and in another: each request's tokens are the same (they would
    not be if its seed followed its arrival). The server decodes one row at a time, so a request meets the same float
    operations in either order; the model is the untrained one, whose near-uniform draws follow any change of seed."""
    prompts = [[9707, 11, 1879 + i, 0, 151644, 77091, 198][: 7 - i % 3] for i in range(6)]
    forward = asyncio.run(_together(solo, prompts, [0, 1, 2, 3, 4, 5]))
    shuffled = asyncio.run(_together(solo, prompts, [4, 2, 0, 5, 3, 1]))
    assert forward == shuffled
    assert [len(forward[i]) for i in range(6)] == MAX_TOKENS


@pytest.mark.warm_start
def test_a_seeded_request_draws_the_same_tokens_in_any_batching(warm, prompts):
    """The same six seeded requests in three arrangements (all at once in order and in reverse, which fill and refill
    the 3-row batch with different companions; one at a time, alone): each request's tokens are the same in all.

    Rows of a batch decode as they would alone up to float rounding (left padding and the batch's shape change the
    order of the sums, not what is summed), so a draw that lands within that rounding of a token boundary of the
    CDF can differ. The warm start, the policy the CPU default trains, puts its mass on few tokens; the untrained
    tiny Qwen3 spreads it nearly evenly over the whole vocabulary, boundaries everywhere, and is not used here."""
    batches = warm.batches
    forward = asyncio.run(_together(warm, prompts, [0, 1, 2, 3, 4, 5]))
    backward = asyncio.run(_together(warm, prompts, [5, 4, 3, 2, 1, 0]))
    assert warm.batches - batches == 2  # each arrangement decoded in one continuously refilled batch
    alone = asyncio.run(_one_by_one(warm, prompts, [3, 1, 5, 0, 4, 2]))
    assert forward == backward == alone
    assert [len(alone[i]) for i in range(6)] == MAX_TOKENS


def test_the_seed_decides_the_draws_and_unseeded_requests_fall_back_to_distinct_streams(solo):
    """One prompt under two seeds draws two token sequences, under one seed twice the same; without a seed a request
    is seeded by its arrival, so two identical unseeded requests in flight together draw different tokens (the K
    rollouts of a prompt from a caller that names no seed do not collapse into one)."""
    prompt = [9707, 11, 1879, 0, 151644, 77091, 198]
    params = {"temperature": 1.0, "max_tokens": 12, "ignore_eos": True}

    async def twice(seeds):
        sent = [{**params, "seed": s} if s is not None else params for s in seeds]
        outs = await asyncio.gather(*[solo.generate(prompt, p, f"u{i}") for i, p in enumerate(sent)])
        return [o.token_ids for o in outs]

    a, b = asyncio.run(twice([7, 8]))
    assert len(a) == len(b) == 12 and a != b
    assert asyncio.run(twice([7, 7])) == [a, a]
    a, b = asyncio.run(twice([None, None]))
    assert len(a) == len(b) == 12 and a != b


def test_pinned_verl_vllm_server_hands_the_seed_to_vllm():
    """The agent loop sends the same per-generation ``seed`` to vLLM (``envace.agents.verl_loop.SEEDED_ROLLOUTS``):
    verl's vLLM server builds ``SamplingParams`` from the parameters it is sent, keeping a seed it is given over its
    own ``full_determinism`` default, and vLLM takes a 63-bit seed as that request's own."""
    import inspect

    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer
    from vllm import SamplingParams
    from vllm.sampling_params import SamplingType

    src = inspect.getsource(vLLMHttpServer.generate)
    assert 'sampling_params.setdefault("seed", self.replica_rank + self.config.seed)' in src
    assert "sampling_params = SamplingParams(max_tokens=max_tokens, **sampling_params)" in src
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=2**63 - 1)
    assert params.seed == 2**63 - 1 and params.sampling_type == SamplingType.RANDOM_SEED
