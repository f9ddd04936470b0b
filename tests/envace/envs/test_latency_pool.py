"""The ``latency:POOL`` wrapper (envace/envs/latency.py): the distributions' statistics, the draw as a function of
(seed, task, call index) alone, observations and scores identical to the inner pool's, concurrent calls that wait
together (shown with a barrier, not a clock), the counters, the rows that route rollouts back through the wrapper,
and the refusals."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from envace.envs import latency
from envace.envs.base import ToolCall, get_pool
from envace.envs.latency import LatencyEpisode, LatencyModel, LatencyPool, collect_stats

INNER_KW = {"n_envs": 3, "tasks_per_env": 10}  # a small synthetic pool: 30 tasks over 3 domains


def _pool(**kwargs) -> LatencyPool:
    return get_pool("latency:synthetic", pool_kwargs=INNER_KW, **kwargs)


def _inner():
    return get_pool("synthetic", **INNER_KW)


@pytest.fixture
def no_wait(monkeypatch):
    """Both waits replaced by recorders: the delays each call asked for, without sleeping."""
    asked: list[float] = []

    async def asleep(delay: float) -> None:
        asked.append(delay)

    monkeypatch.setattr(latency, "_sleep", asked.append)
    monkeypatch.setattr(latency, "_asleep", asleep)
    return asked


# -- the distributions ---------------------------------------------------------------------------------------------
def test_fixed_latency_is_exactly_ms_and_a_slow_tasks_calls_take_the_factor():
    model = LatencyModel(dist="fixed", ms=200, factor=7, slow_tasks=frozenset({"slow/t0"}))
    draws = [model.draw(f"env/t{t}", i) for t in range(50) for i in range(20)]
    assert draws == [(False, 0.2)] * 1000
    assert {model.draw("slow/t0", i) for i in range(20)} == {(True, 0.2 * 7)}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_longtail_share_of_slow_calls_is_within_its_binomial_bound(seed):
    """n draws at p = 0.1: the slow count is Binomial(n, p) if the draws are independent with probability p. The
    bound is the central interval of probability 1 - 0.01/3 (computed here), so the three seeds together fail by
    chance with probability <= 1%; a slow call takes exactly ms x factor, a fast one ms."""
    n, p, alpha = 6000, 0.1, 0.01 / 3
    model = LatencyModel(dist="longtail", ms=150, p=p, factor=10, seed=seed)
    draws = [model.draw(f"syn-env-{t:02d}/t{t % 7}", i) for t in range(300) for i in range(20)]
    slow = sum(s for s, _ in draws)
    lo, hi = stats.binom.ppf(alpha / 2, n, p), stats.binom.isf(alpha / 2, n, p)
    assert lo <= slow <= hi, (slow, lo, hi)
    assert {d for s, d in draws if s} == {1.5} and {d for s, d in draws if not s} == {0.15}


def test_a_slow_task_is_slow_under_longtail_too_and_other_tasks_keep_their_draws():
    plain = LatencyModel(dist="longtail", ms=100, p=0.2, seed=3)
    marked = LatencyModel(dist="longtail", ms=100, p=0.2, seed=3, slow_tasks=frozenset({"a/t1"}))
    assert all(marked.draw("a/t1", i) == (True, 1.0) for i in range(30))
    assert [marked.draw("b/t2", i) for i in range(50)] == [plain.draw("b/t2", i) for i in range(50)]


# -- determinism ---------------------------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**31), task=st.text(min_size=1, max_size=30),
       indices=st.lists(st.integers(0, 10_000), min_size=1, max_size=20))
def test_a_draw_depends_on_seed_task_and_index_only(seed, task, indices):
    a = LatencyModel(dist="longtail", ms=10, p=0.3, seed=seed)
    b = LatencyModel(dist="longtail", ms=10, p=0.3, seed=seed)
    b.draw("another task", 5)  # what else was drawn before does not matter
    assert [a.draw(task, i) for i in indices] == [b.draw(task, i) for i in reversed(indices)][::-1]


def test_seeds_change_the_draws():
    draws = {seed: [LatencyModel(dist="longtail", p=0.5, seed=seed).slow("x/t1", i) for i in range(200)]
             for seed in (0, 1)}
    assert draws[0] != draws[1]


def test_draws_are_the_same_in_every_process():
    """Ray workers and separate runs must meet the same slow calls: no salted hash in the draw."""
    code = ("from envace.envs.latency import LatencyModel;"
            "m = LatencyModel(dist='longtail', ms=1, p=0.5, seed=4);"
            "print([int(m.slow(f'syn-bank-00/t{t}', i)) for t in range(5) for i in range(8)])")
    outs = {subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": h}, check=True,
                           capture_output=True, text=True).stdout for h in ("1", "2")}
    model = LatencyModel(dist="longtail", ms=1, p=0.5, seed=4)
    assert outs == {str([int(model.slow(f"syn-bank-00/t{t}", i)) for t in range(5) for i in range(8)]) + "\n"}


def test_an_episode_counts_its_calls_and_a_fork_continues_the_count(no_wait):
    pool = _pool(dist="longtail", ms=100, p=0.5, seed=1)
    tid = pool.task_ids()[0]
    call = pool.gold_actions(tid)[0][0]
    ep = pool.start(tid)
    for _ in range(3):
        ep.execute(call)
    fork = ep.fork()
    fork.execute(call)
    ep.execute(call)
    expected = [pool.model.draw(tid, i)[1] for i in range(4)]
    assert no_wait == [*expected[:3], expected[3], expected[3]]  # the fork's and the original's 4th call


# -- identical to the inner pool -----------------------------------------------------------------------------------
def _actions(inner, tid: str) -> list[list[ToolCall]]:
    """The gold calls, then a wrong one (a mangled argument) and an unknown tool in the last turn."""
    turns = [list(t) for t in inner.gold_actions(tid)]
    first = turns[0][0]
    turns[-1] += [ToolCall(first.name, {k: "?" for k in first.arguments}), ToolCall("no_such_tool", {})]
    return turns


def _play_sync(ep, turns):
    seen = [ep.initial_messages(), ep.tools()]
    for turn in turns:
        seen.append([ep.execute(c) for c in turn])
        seen.append(ep.end_turn("\n".join(seen[-1])))
    verdict = ep.verify()
    return seen, (verdict.reward, verdict.passed, verdict.details), ep.done


async def _play_async(ep, turns):
    seen = [ep.initial_messages(), ep.tools()]
    for turn in turns:
        seen.append([await ep.aexecute(c) for c in turn])
        seen.append(ep.end_turn("\n".join(seen[-1])))
    verdict = await ep.averify()
    await ep.aclose()
    return seen, (verdict.reward, verdict.passed, verdict.details), ep.done


def test_observations_scores_and_views_are_the_inner_pools(no_wait):
    inner, pool = _inner(), _pool(dist="longtail", ms=200, p=0.3, seed=0)
    assert pool.name == "latency:synthetic"
    for split in (None, "train", "test"):
        assert pool.task_ids(split) == inner.task_ids(split)
    assert pool.environments() == inner.environments()  # the inner pool's extras
    for tid in inner.task_ids():
        spec = pool.task(tid)
        assert spec.pool == "latency:synthetic"
        assert {**vars(spec), "pool": "synthetic"} == vars(inner.task(tid))
        assert pool.gold_actions(tid) == inner.gold_actions(tid)
        turns = _actions(inner, tid)
        expected = _play_sync(inner.start(tid), turns)
        assert _play_sync(pool.start(tid), turns) == expected
        assert asyncio.run(_play_async(asyncio.run(pool.astart(tid)), turns)) == expected
        forked = pool.start(tid)
        assert _play_sync(forked.fork(), turns) == expected
        assert pool.replay(tid, turns) == inner.replay(tid, turns)
        assert pool.replay(tid, turns, ["wrong"]) == inner.replay(tid, turns, ["wrong"])
    assert no_wait and any(d == 2.0 for d in no_wait)  # the calls did wait, some of them slow


def test_verification_on_the_rollout_path_is_the_inner_verdict(no_wait):
    from envace.rewards.score import run_verifier

    inner, pool = _inner(), _pool(ms=50)
    tid = inner.task_ids()[3]
    ep, ref = pool.start(tid), inner.start(tid)
    for turn in inner.gold_actions(tid):
        for call in turn:
            ep.execute(call)
            ref.execute(call)
        ep.end_turn("")
        ref.end_turn("")
    assert ep.remote and not ref.remote  # the wrapper's verdict is awaited (averify), the inner's runs in a thread
    assert asyncio.run(run_verifier(ep, 10.0)) == ref.verify()


# -- concurrent calls wait together --------------------------------------------------------------------------------
def _barrier_sleep(monkeypatch, parties: int) -> list[float]:
    """``_asleep`` replaced by a wait on a barrier of ``parties``: it returns only once every party is inside it at
    the same time, so calls awaited one after another (or run in a bounded thread pool) never get through."""
    asked: list[float] = []
    barrier: list[asyncio.Barrier] = []

    async def asleep(delay: float) -> None:
        asked.append(delay)
        if not barrier:
            barrier.append(asyncio.Barrier(parties))
        await barrier[0].wait()

    monkeypatch.setattr(latency, "_asleep", asleep)
    return asked


def test_concurrent_calls_wait_their_latency_at_the_same_time(monkeypatch):
    n = 24  # more than the default executor's threads on a small machine
    pool = _pool(dist="longtail", ms=200, p=0.5, seed=2)
    asked = _barrier_sleep(monkeypatch, n)
    tids = pool.task_ids()[:n]
    episodes = [pool.start(t) for t in tids]

    async def run_all():
        calls = [ep.aexecute(pool.gold_actions(t)[0][0]) for ep, t in zip(episodes, tids, strict=True)]
        return await asyncio.wait_for(asyncio.gather(*calls), 20)  # a deadlock guard, not a timing assertion

    assert len(asyncio.run(run_all())) == n
    assert sorted(asked) == sorted(pool.model.draw(t, 0)[1] for t in tids)


def test_the_rollout_path_awaits_the_wrapped_calls_concurrently_and_skips_the_forked_probe(monkeypatch):
    """RealSource (the rollout's real environment) on wrapped episodes: every call inside its wait at once, and no
    bounded dry run in a forked process (a remote episode's calls are awaited, not probed)."""
    from envace.agents import sources
    from envace.agents.engine import CallContext, Reply

    def no_probe(*args, **kwargs):
        raise AssertionError("the forked probe ran for a remote episode")

    monkeypatch.setattr(sources, "run_bounded", no_probe)
    n = 12
    pool = _pool(ms=300)
    asked = _barrier_sleep(monkeypatch, n)
    tids = pool.task_ids()[:n]

    async def run_all():
        source = sources.RealSource(timeout_s=60.0)
        observations = []
        for tid in tids:
            ep = pool.start(tid)
            call = pool.gold_actions(tid)[0][0]
            ctx = CallContext(messages=[], tools=ep.tools(), reply=Reply(text="", calls=[call]), call_index=0, episode=ep)
            observations.append(source.execute(call, ctx))
        return await asyncio.gather(*observations)

    observations = asyncio.run(run_all())
    inner = _inner()
    expected = [inner.start(t).execute(inner.gold_actions(t)[0][0]) for t in tids]
    assert [o.text for o in observations] == expected and {o.kind for o in observations} == {"result"}
    assert asked == [0.3] * n


# -- counters ------------------------------------------------------------------------------------------------------
def test_the_pool_counts_calls_slow_calls_and_injected_seconds_across_processes_files(no_wait, tmp_path):
    pools = [_pool(dist="longtail", ms=100, p=0.4, seed=5, stats_dir=str(tmp_path)) for _ in range(2)]
    made = []
    for k, pool in enumerate(pools):
        before = len(no_wait)
        for tid in pool.task_ids()[: 5 + k]:
            ep = pool.start(tid)
            for turn in pool.gold_actions(tid):
                for call in turn:
                    ep.execute(call)
        made.append(len(no_wait) - before)
    assert [p.stats.calls for p in pools] == made and min(made) > 0
    total = collect_stats(tmp_path)
    assert total["calls"] == len(no_wait) == sum(p.stats.calls for p in pools)
    assert total["slow_calls"] == sum(d == 1.0 for d in no_wait)
    assert total["injected_s"] == pytest.approx(sum(no_wait))
    assert len(list(tmp_path.glob("latency-*.json"))) == 2
    assert json.loads(next(tmp_path.glob("latency-*.json")).read_text()).keys() == {"calls", "slow_calls", "injected_s"}
    assert collect_stats(tmp_path / "none") == {"calls": 0, "slow_calls": 0, "injected_s": 0.0}


# -- configuration -------------------------------------------------------------------------------------------------
def test_rows_built_from_the_wrapper_route_their_rollouts_back_through_it(tmp_path):
    import pyarrow.parquet as pq

    from envace.data.datasets import build_parquet

    kwargs = {"latency:synthetic": {"pool_kwargs": INNER_KW, "dist": "fixed", "ms": 200}}
    train, val = build_parquet(["latency:synthetic"], tmp_path, pool_kwargs=kwargs)
    for path in (train, val):
        rows = pq.read_table(path).to_pylist()
        assert rows and {r["extra_info"]["pool"] for r in rows} == {"latency:synthetic"}
    name = rows[0]["extra_info"]["pool"]
    pool = get_pool(name, **kwargs[name])  # what the agent loop does with a row
    assert isinstance(pool, LatencyPool) and pool.model.ms == 200
    assert isinstance(pool.start(rows[0]["extra_info"]["task_id"]), LatencyEpisode)


def test_the_documented_hydra_override_sets_the_wrappers_kwargs():
    """Hydra's dotted keys cannot hold a colon, its dict keys can, escaped: the form docs/environments.md gives."""
    from envace.config import validate_envace_config
    from envace.verl.config import compose

    override = (r"++envace.agent.pool_kwargs={latency\:synthetic: {dist: longtail, ms: 200, p: 0.05, seed: 0,"
                r" pool_kwargs: {tasks_per_env: 65}}}")
    cfg = compose(["experiment=cpu_default", "envace.data.pools=[latency:synthetic]", override])
    kwargs = validate_envace_config(cfg).agent.pool_kwargs
    assert kwargs["latency:synthetic"] == {"dist": "longtail", "ms": 200, "p": 0.05, "seed": 0,
                                           "pool_kwargs": {"tasks_per_env": 65}}
    assert "synthetic" in kwargs  # the inner pool's own entry is kept


@pytest.mark.parametrize(("kwargs", "key"), [
    ({"latency_ms": 5}, "latency_ms"),
    ({"dist": "gaussian"}, "dist"),
    ({"ms": -1}, "ms"),
    ({"ms": "200"}, "ms"),
    ({"ms": float("inf")}, "ms"),
    ({"dist": "longtail"}, "p"),
    ({"dist": "longtail", "p": 0}, "p"),
    ({"dist": "longtail", "p": 1.5}, "p"),
    ({"dist": "fixed", "p": 0.1}, "p"),
    ({"factor": 0.5}, "factor"),
    ({"seed": "zero"}, "seed"),
    ({"seed": True}, "seed"),
    ({"slow_tasks": ["syn-bank-00/t00", "nope/t1"]}, "slow_tasks"),
    ({"slow_tasks": "syn-bank-00/t00"}, "slow_tasks"),
    ({"pool_kwargs": [1]}, "pool_kwargs"),
])
def test_a_bad_key_is_refused_in_one_line_naming_it(kwargs, key):
    kwargs = {"pool_kwargs": INNER_KW, **kwargs}
    with pytest.raises(ValueError, match=f"'{key}'") as exc:
        get_pool("latency:synthetic", **kwargs)
    assert "\n" not in str(exc.value)


def test_an_inner_chat_model_argument_is_refused_since_the_wrapper_would_not_connect_it():
    from envace.envs.base import chat_model_args

    if "user" not in chat_model_args("tau2"):
        pytest.skip("the tau2 pool is not installed")
    with pytest.raises(ValueError, match="'pool_kwargs'.*'user'") as exc:
        get_pool("latency:tau2", pool_kwargs={"user": {"base_urls": ["http://127.0.0.1:1/v1"], "model": "m"}})
    assert "\n" not in str(exc.value)


def test_the_inner_pool_must_be_named():
    with pytest.raises(ValueError, match="'pool'.*latency:synthetic") as exc:
        get_pool("latency")
    assert "\n" not in str(exc.value)
