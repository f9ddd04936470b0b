"""The scheduler (``envsched/scheduler.py``): select / observe / predict and their metrics, counted by hand; the
boundaries of the scheduling rules (EnvSched §2.4, App. C: the C3 rolling window, the exposure factor omega); the
identifier filter inside the schedule; cold start; the guards on every input; state round trips and resumes."""

from __future__ import annotations

import copy
import logging
import pickle
import time

import numpy as np
import pytest

from envsched import (
    ConfigError,
    DeterministicExtractor,
    EnvSchedConfig,
    EnvScheduler,
    ObservationError,
    TaskPool,
    UnknownTaskError,
)
from envsched.select import BatchBuilder
from envsched.synthetic import SimulatedLearner, synthetic_records


@pytest.fixture(scope="module")
def records_8x10():
    return synthetic_records(8, 10, seed=5)


@pytest.fixture(scope="module")
def graph_8x10(records_8x10):
    return EnvScheduler(TaskPool.from_records(records_8x10), EnvSchedConfig(batch_size=12)).graph


# ---- scheduler ----------------------------------------------------------------------------------------
def _learner(records_8x10, pool):
    arch = np.array([r["meta"]["archetype"] for r in records_8x10])
    return SimulatedLearner(pool.env, arch, np.array([len(r["verifier_checks"]) for r in records_8x10]), seed=1)


def _run(s, learner, pool, steps, trace):
    for step in steps:
        ids = s.select(step)
        trace.append(ids)
        nodes = pool.indices(ids)
        R = learner.rollout(nodes, 8)
        learner.train(nodes, R)
        s.observe(step, {t: r.tolist() for t, r in zip(ids, R)})


def test_select_observe_predict_and_metrics(records_8x10, graph_8x10):
    pool = TaskPool.from_records(records_8x10)
    s = EnvScheduler(pool, EnvSchedConfig(batch_size=12), graph=graph_8x10)
    learner = _learner(records_8x10, pool)
    trace = []
    _run(s, learner, pool, range(6), trace)
    for ids in trace:
        assert len(ids) == len(set(ids)) == 12
    assert s.select(5) == trace[5] and s.select(2) == trace[2]  # idempotent for selected steps
    with pytest.raises(ValueError, match="backwards"):
        s.select(-1)
    m = s.metrics()
    for key in ("realized_var_mean", "realized_var_median", "predicted_var_mean", "envs_per_batch", "tools_per_batch", "coverage_count",
                "exploitation_count", "progress_filtered", "identifier_filtered", "select_time_s", "schedule_time_s"):
        assert isinstance(m[f"envsched/{key}"], float), key
    assert m["envsched/coverage_count"] == 6 and m["envsched/exploitation_count"] == 6
    assert all(k.startswith("envsched/") for k in m)
    p = s.predict()
    assert p.v.shape == p.m.shape == p.d.shape == p.q.shape == (len(pool),)
    assert 0 < p.q.min() and p.q.max() < 1 and np.all(p.v >= 0) and np.all(p.v <= 0.25)
    assert set(p.as_dict()[pool.task_ids[0]]) == {"v", "m", "d", "q"}
    s.select(6)
    with pytest.raises(KeyError, match="unknown task_id 'nope'"):
        s.observe(6, {"nope": [1.0]})


@pytest.mark.parametrize("mode", ["envsched", "random"])
def test_state_dict_round_trip_matches_uninterrupted_run(records_8x10, graph_8x10, mode):
    pool = TaskPool.from_records(records_8x10)
    cfg = EnvSchedConfig(batch_size=12, scheduler=mode, seed=7)
    a = EnvScheduler(pool, cfg, graph=graph_8x10)
    la = _learner(records_8x10, pool)
    head = []
    _run(a, la, pool, range(5), head)
    state = pickle.loads(pickle.dumps(a.state_dict()))
    lb = copy.deepcopy(la)
    tail_a = []
    _run(a, la, pool, range(5, 10), tail_a)

    b = EnvScheduler(pool, cfg, graph=graph_8x10)
    b.load_state_dict(state)
    tail_b = []
    _run(b, lb, pool, range(5, 10), tail_b)
    assert tail_a == tail_b
    assert np.allclose(a.predict().q, b.predict().q)


def test_state_from_other_pool_is_rejected(records_8x10, graph_8x10):
    pool = TaskPool.from_records(records_8x10)
    s = EnvScheduler(pool, EnvSchedConfig(batch_size=12), graph=graph_8x10)
    other = EnvScheduler(TaskPool.from_records(records_8x10[:-1]), EnvSchedConfig(batch_size=12, scheduler="random"))
    with pytest.raises(ValueError, match="different task pool"):
        other.load_state_dict(s.state_dict())


def test_random_mode_is_seeded_and_builds_no_graph(records_8x10):
    pool = TaskPool.from_records(records_8x10)
    a = EnvScheduler(pool, {"batch_size": 12, "scheduler": "random", "seed": 3})
    b = EnvScheduler(pool, {"batch_size": 12, "scheduler": "random", "seed": 3})
    assert a.select(0) == b.select(0)
    assert a._graph is None


def test_batch_larger_than_pool_is_a_config_error(records_8x10):
    with pytest.raises(ConfigError, match="batch_size"):
        EnvScheduler(TaskPool.from_records(records_8x10[:5]), {"batch_size": 6, "scheduler": "random"})


def test_tiny_pool_relaxes_caps_instead_of_short_batches():
    recs = synthetic_records(1, 10, seed=0)  # one environment: C1 = 4 cannot fill a batch of 8
    pool = TaskPool.from_records(recs)
    s = EnvScheduler(pool, EnvSchedConfig(batch_size=8))
    for step in range(4):
        ids = s.select(step)
        assert len(set(ids)) == 8
        s.observe(step, {t: [1.0, 0.0, 0.5] for t in ids})
    assert s.metrics(3)["envsched/cap_relaxations"] > 0


# -- construction, selection and observation by hand, guards, the identifier filter, state ----------------------------

K = 4


@pytest.fixture(scope="module")
def pool() -> TaskPool:
    return TaskPool.from_records(synthetic_records(3, 4, seed=0))  # 12 tasks, 3 environments


@pytest.fixture(scope="module")
def graph(pool):
    return EnvScheduler(pool, EnvSchedConfig(batch_size=4, rollouts_per_task=K)).graph


def sched(pool, graph=None, **cfg) -> EnvScheduler:
    cfg = {"batch_size": 4, "rollouts_per_task": K, **cfg}
    return EnvScheduler(pool, EnvSchedConfig(**cfg), graph=graph)


def rewards_for(ids, seed):
    rng = np.random.default_rng(seed)
    return {t: rng.choice([0.0, 0.5, 1.0], size=K).tolist() for t in ids}


def tiny_pool() -> TaskPool:
    """Two environments; gold action names repeat across environments; the last task has no gold actions."""
    return TaskPool.from_records(
        [
            {"task_id": "t1", "env_id": "e1", "instruction": "x", "gold_actions": [{"name": "get_a", "arguments": {}}, {"name": "set_b", "arguments": {}}]},
            {"task_id": "t2", "env_id": "e1", "instruction": "y", "gold_actions": [{"name": "get_a", "arguments": {}}]},
            {"task_id": "t3", "env_id": "e2", "instruction": "z", "gold_actions": [{"name": "get_a", "arguments": {}}]},
            {"task_id": "t4", "env_id": "e2", "instruction": "w", "tools": [{"name": "x"}, {"name": "y"}, {"name": "z"}]},
        ]
    )


# ---- construction -------------------------------------------------------------------------------------------
def test_constructor_inputs(pool, graph):
    """Plain records become a TaskPool; a TaskPool, a graph and an extractor are used as given; no config means
    the defaults (batch_size 64, hence a 64-task pool); the counters start as int64 zeros (the state format)."""
    records = synthetic_records(8, 8)
    s = EnvScheduler(records)
    assert s.cfg == EnvSchedConfig() and isinstance(s.pool, TaskPool)
    assert s.pool.task_ids == [r["task_id"] for r in records] and s.pool.fingerprint() == TaskPool.from_records(records).fingerprint()
    s = sched(pool, graph)
    assert s.pool is pool and s.graph is graph
    state = s.state_dict()
    for name in ("obs_count", "sel_count"):
        assert getattr(s, name).dtype == np.int64 and state[name].dtype == np.int64 and state[name].tolist() == [0] * len(pool)

    class NamedExtractor(DeterministicExtractor):
        name = "named"

    s = EnvScheduler(records[:4], {"batch_size": 2, "scheduler": "random"}, extractor=NamedExtractor())
    assert s.graph_report()["extractors"] == {"named": 4}


# ---- selection metrics ------------------------------------------------------------------------------------
def test_selection_metrics_count_environments_tools_and_phases_by_hand():
    s = EnvScheduler(tiny_pool(), {"batch_size": 4, "scheduler": "random", "seed": 1})
    assert s.metrics() == {}  # nothing selected yet
    assert sorted(s.select(3)) == ["t1", "t2", "t3", "t4"]
    m = s.metrics(3)
    # tools: (e1, get_a), (e1, set_b), (e2, get_a), and t4's own tools (e2, x|y|z) as it has no gold actions
    assert (m["envsched/step"], m["envsched/batch_size"], m["envsched/envs_per_batch"], m["envsched/tools_per_batch"]) == (3.0, 4.0, 2.0, 6.0)
    assert (m["envsched/random_count"], m["envsched/cold_start_count"], m["envsched/coverage_count"], m["envsched/exploitation_count"]) == (4.0, 0.0, 0.0, 0.0)
    assert m["envsched/identifier_filtered"] == 0.0 and m["envsched/select_time_s"] >= 0.0
    assert not any(k.startswith(("envsched/selected_", "envsched/predicted_")) for k in m)  # random mode: no predictions
    assert s.metrics() == m and s.metrics(4) == {}  # default: the latest step; a step without metrics: empty
    assert all(type(v) is float for v in m.values())


def test_envsched_selection_metrics_are_the_prediction_at_selection(pool, graph):
    s = sched(pool, graph)
    s.observe(0, rewards_for(s.select(0), 0))
    ids = s.select(1)
    nodes = pool.indices(ids)
    pred = s.predict(1)
    m = s.metrics(1)
    assert m["envsched/predicted_var_mean"] == pytest.approx(float(pred.v[nodes].mean()))
    assert m["envsched/predicted_q_mean"] == pytest.approx(float(pred.q[nodes].mean()))
    assert m["envsched/step"] == 1.0 and m["envsched/batch_size"] == 4.0
    assert m["envsched/envs_per_batch"] == float(len(set(pool.env[nodes].tolist())))
    rec = s.selection_predictions[1]
    assert np.array_equal(rec["q"], pred.q[nodes]) and np.array_equal(rec["v"], pred.v[nodes])
    assert m["envsched/coverage_count"] + m["envsched/exploitation_count"] == 4.0 and m["envsched/cold_start_count"] == 0.0


def test_select_again_returns_the_batch_without_counting_it_twice_and_backwards_is_refused(pool, graph):
    s = sched(pool, graph)
    ids = s.select(2)  # steps may start anywhere and skip
    assert s.select(2) == ids and int(s.sel_count.sum()) == 4
    assert s.select(np.int64(2)) == ids
    s.select(5)
    with pytest.raises(ValueError, match=r"^select\(3\) after select\(5\): steps must not go backwards$"):
        s.select(3)
    assert sorted(s.selections) == [2, 5] and int(s.sel_count.sum()) == 8
    assert s.selection_phases[2] == ["cold_start"] * 4


def test_a_second_selection_before_any_observation_is_an_envsched_step(pool, graph):
    """Only the very first selection is a cold start: select(1) with nothing observed yet fills floor(rho * B)
    coverage slots and exploits the rest from the prior prediction."""
    s = sched(pool, graph, rho=0.5)
    s.select(0)
    s.select(1)
    assert s.selection_phases[1] == ["coverage"] * 2 + ["exploitation"] * 2  # floor(0.5 * 4) = 2
    assert s.metrics(1)["envsched/cold_start_count"] == 0.0


def test_cold_start_modes_draw_from_the_rng_only_when_random(pool, graph):
    """cold_start = "random" is the seeded uniform draw of the random baseline (the same generator call on the
    same seed); the structural cold start takes one representative per environment and leaves the rng alone."""
    fresh = np.random.Generator(np.random.PCG64(4)).bit_generator.state
    rnd = sched(pool, graph, cold_start="random", seed=4)
    baseline = EnvScheduler(pool, {"batch_size": 4, "rollouts_per_task": K, "scheduler": "random", "seed": 4})
    assert rnd.select(0) == baseline.select(0)
    assert rnd.rng.bit_generator.state == baseline.rng.bit_generator.state != fresh
    structural = sched(pool, graph, seed=4)
    nodes = pool.indices(structural.select(0))
    assert structural.rng.bit_generator.state == fresh
    assert sorted(set(pool.env[nodes[:3]].tolist())) == [0, 1, 2]  # the 3 representatives come first


def test_select_scores_with_the_prediction_of_its_own_step(pool, graph):
    """A step that skips ahead is scored with predict(step), not with the prediction for the step after the
    last one (the half-life weights, Eq. 10, depend on t; with the paper's relation weights every task's prior
    moves with them, so q differs between the two steps)."""
    s = sched(pool, graph, relation_weights="paper")
    s.observe(0, rewards_for(s.select(0), 0))
    assert not np.array_equal(s.predict(30).q, s.predict(1).q)
    seen = []
    fill = s._fill
    s._fill = lambda builder, step, q, *size: (seen.append(q.copy()), fill(builder, step, q, *size))[1]
    s.select(30)
    assert len(seen) == 1 and np.array_equal(seen[0], s.predict(30).q)


@pytest.mark.parametrize("mode", ["random", "envsched"])
def test_a_filtered_task_is_never_selected_again(mode):
    """Random mode and random cold start draw from the available tasks only; a batch as large as the pool
    shrinks by the removed task instead of failing."""
    pool = tiny_pool()
    s = EnvScheduler(pool, {"batch_size": 3, "scheduler": mode, "cold_start": "random", "seed": 2})
    s.available[pool.index["t2"]] = False
    for step in range(6):
        ids = s.select(step)
        assert "t2" not in ids and len(set(ids)) == 3
        assert s.selection_phases[step] == (["random"] * 3 if mode == "random" else ["cold_start"] * 3)
        if mode == "envsched":
            break  # later envsched steps need observations; the cold start is what is checked here
    full = EnvScheduler(pool, {"batch_size": 4, "scheduler": "random", "seed": 2})
    full.available[pool.index["t4"]] = False
    assert sorted(full.select(0)) == ["t1", "t2", "t3"]
    assert full.metrics(0)["envsched/batch_size"] == 3.0
    full.available[:] = False  # every task removed: an empty batch, nothing counted
    assert full.select(1) == [] and full.sel_count.tolist() == [1, 1, 1, 0]
    m = full.metrics(1)
    assert (m["envsched/batch_size"], m["envsched/envs_per_batch"], m["envsched/tools_per_batch"], m["envsched/random_count"]) == (0.0, 0.0, 0.0, 0.0)


def test_random_cold_start_is_seeded(pool, graph):
    a = sched(pool, graph, cold_start="random", seed=4)
    b = sched(pool, graph, cold_start="random", seed=4)
    assert a.select(0) == b.select(0)
    assert a.metrics(0)["envsched/cold_start_count"] == 4.0 and a.metrics(0)["envsched/selected_cold"] == 4.0


# ---- C4 and the coverage share -------------------------------------------------------------------------
def test_c4_blocks_exactly_the_tasks_selected_in_each_of_the_last_n_steps(pool, graph):
    s = sched(pool, graph, cap_task_consecutive=2)
    s.selections = {3: np.array([0, 1, 2]), 4: np.array([1, 2, 5]), 6: np.array([2, 7])}
    assert np.flatnonzero(s._cap_state(5).blocked_tasks).tolist() == [1, 2]  # in both 3 and 4
    assert np.flatnonzero(s._cap_state(6).blocked_tasks).tolist() == []  # step 5 was not selected
    assert np.flatnonzero(s._cap_state(7).blocked_tasks).tolist() == []  # 5 missing, only 6
    s.cfg = EnvSchedConfig(batch_size=4, rollouts_per_task=K, cap_task_consecutive=1)
    assert np.flatnonzero(s._cap_state(5).blocked_tasks).tolist() == [1, 2, 5]  # just the previous step
    assert np.flatnonzero(s._cap_state(7).blocked_tasks).tolist() == [2, 7]


@pytest.mark.parametrize("batch, rho, coverage", [(5, 0.5, 2), (4, 0.3, 1), (6, 0.5, 3), (4, 0.0, 0)])
def test_coverage_takes_floor_rho_times_b_slots(pool, graph, batch, rho, coverage):
    s = sched(pool, graph, batch_size=batch, rho=rho, progress_filter=False)
    s.observe(0, rewards_for(s.select(0), 0))
    s.select(1)
    m = s.metrics(1)
    assert s.selection_phases[1].count("coverage") == coverage and m["envsched/coverage_count"] == coverage
    assert m["envsched/exploitation_count"] == batch - coverage
    assert (m["envsched/progress_filtered"], m["envsched/progress_filter_ignored"]) == (0.0, 0.0)
    assert m["envsched/cap_relaxations"] >= 0.0


# ---- observe: metrics by hand --------------------------------------------------------------------------
def test_observe_metrics_by_hand(pool, graph):
    s = sched(pool, graph, batch_size=5)
    ids = s.select(0)
    # groups (m, v): (0.5, 0.25) | (1, 0) | (0.125, 0.046875) | (1, 0) from 1 of K = 4 rewards; ids[4] unobserved
    m = s.observe(0, {ids[0]: [1.0, 0.0, 1.0, 0.0], ids[1]: [1.0, 1.0, 1.0, 1.0], ids[2]: [0.0, 0.0, 0.0, 0.5], ids[3]: [1.0]})
    assert m["envsched/realized_var_mean"] == pytest.approx((0.25 + 0.046875) / 4)
    assert m["envsched/realized_var_median"] == pytest.approx(0.046875 / 2)
    assert m["envsched/realized_reward_mean"] == pytest.approx((0.5 + 1.0 + 0.125 + 1.0) / 4)
    assert m["envsched/realized_reward_median"] == pytest.approx(0.75)
    assert m["envsched/zero_var_fraction"] == 0.5
    assert (m["envsched/observed_groups"], m["envsched/unobserved_selected"], m["envsched/short_groups"], m["envsched/missing_rewards"]) == (4.0, 1.0, 1.0, 3.0)
    assert (m["envsched/identifier_filtered"], m["envsched/identifier_checked"], m["envsched/replay_mismatch"]) == (0.0, 0.0, 0.0)
    assert m["envsched/schedule_time_s"] == pytest.approx(m["envsched/select_time_s"] + m["envsched/observe_time_s"])
    assert "envsched/tools_used_per_batch" not in m  # no trajectories
    assert m["envsched/step"] == 0.0 and m["envsched/batch_size"] == 5.0  # the selection metrics of the step are kept
    assert s.observed_steps == {0} and s.obs_count[pool.indices(ids[:4])].tolist() == [1, 1, 1, 1] and int(s.obs_count.sum()) == 4
    log = s.log.arrays()
    assert log["node"].tolist() == pool.indices(ids[:4]).tolist() and log["step"].tolist() == [0, 0, 0, 0]
    assert log["m"].tolist() == [0.5, 1.0, 0.125, 1.0] and log["v"].tolist() == pytest.approx([0.25, 0.0, 0.046875, 0.0])


def test_observe_uses_the_configured_dispersion_floor(pool, graph):
    """d = clip(v / max(m(1 - m), dispersion_floor)) (Eq. 9) with the configured floor, not the default 0.01."""
    s = sched(pool, graph, dispersion_floor=0.5)
    ids = s.select(0)
    s.observe(0, {ids[0]: [1.0, 0.0, 1.0, 0.0], ids[1]: [1.0, 1.0, 1.0, 0.5]})
    # ids[0]: m = 0.5, v = 0.25, d = 0.25 / max(0.25, 0.5) = 0.5 (1.0 under the default floor)
    # ids[1]: m = 0.875, v = (3 * 0.125^2 + 0.375^2) / 4 = 0.046875, d = 0.046875 / max(0.109375, 0.5) = 0.09375
    assert s.log.arrays()["d"].tolist() == pytest.approx([0.5, 0.09375])


def test_timing_metrics_lie_within_the_calls_and_add_up(pool, graph):
    """select_time_s and observe_time_s are non-negative durations no longer than the calls measured from
    outside; schedule_time_s is their sum."""
    s = sched(pool, graph)
    for step in range(2):  # the cold start and an envsched step
        t0 = time.perf_counter()
        ids = s.select(step)
        t1 = time.perf_counter()
        m = s.observe(step, rewards_for(ids, step))
        t2 = time.perf_counter()
        select_s, observe_s = m["envsched/select_time_s"], m["envsched/observe_time_s"]
        assert 0.0 <= select_s <= t1 - t0 and 0.0 <= observe_s <= t2 - t1
        assert m["envsched/schedule_time_s"] == select_s + observe_s


def test_zero_variance_means_at_most_1e_12(pool, graph):
    """zero_var_fraction counts the groups whose variance is <= 1e-12, the boundary included."""
    s = sched(pool, graph)
    ids = s.select(0)
    # v([0, 2e-6]) = (1e-6)^2 = 1e-12 exactly in float64: zero; v([0, 4e-6]) = (2e-6)^2 = 4e-12: not zero
    m = s.observe(0, {ids[0]: [0.0, 2e-6], ids[1]: [0.0, 4e-6]})
    assert s.log.arrays()["v"].tolist() == [1e-12, 4e-12]
    assert m["envsched/zero_var_fraction"] == 0.5


def test_observe_returns_the_metrics_of_the_observed_step(pool, graph):
    """observe(t) answers with step t's metrics even when a later step has already been selected."""
    s = sched(pool, graph, scheduler="random")
    s.select(0)
    s.select(1)
    m = s.observe(0, rewards_for(s.select(0), 0))
    assert m["envsched/step"] == 0.0 and m["envsched/observed_groups"] == 4.0
    assert m == s.metrics(0) and "envsched/observed_groups" not in s.metrics(1)


def test_observe_after_a_resume_without_metrics(pool, graph):
    """A state whose metrics were dropped (they are diagnostics, not needed by select) still resumes: observing a
    step selected before the checkpoint then reports schedule_time_s = observe_time_s (no select time known)."""
    s = sched(pool, graph)
    ids = s.select(0)
    state = copy.deepcopy(s.state_dict())
    state["metrics"] = {}
    r = sched(pool, graph)
    r.load_state_dict(state)
    m = r.observe(0, rewards_for(ids, 0))
    assert "envsched/select_time_s" not in m and "envsched/step" not in m
    assert m["envsched/schedule_time_s"] == m["envsched/observe_time_s"] and m["envsched/observed_groups"] == 4.0


def test_tools_used_per_batch_counts_distinct_environment_tool_pairs(pool, graph):
    s = sched(pool, graph, identifier_filter=False)
    ids = s.select(0)
    a, b = ids[0], next(t for t in ids if pool.env[pool.index[t]] != pool.env[pool.index[ids[0]]])
    trajs = {a: [[{"name": "get_x"}, {"name": "set_y"}], [{"name": "get_x"}]], b: [[{"name": "get_x"}]]}
    m = s.observe(0, {a: [1.0, 0.0], b: [1.0]}, trajectories=trajs)
    assert m["envsched/tools_used_per_batch"] == 3.0  # (env a, get_x), (env a, set_y), (env b, get_x)


def test_rewards_exactly_at_the_tolerance_are_clipped_and_the_first_bad_one_is_named(pool, graph):
    s = sched(pool, graph)
    ids = s.select(0)
    with pytest.raises(ObservationError, match=r"reward -0\.5 outside reward_range \[0\.0, 1\.0\] \(tolerance 1e-06\)"):
        s.observe(0, {ids[0]: [0.5, -0.5, 2.0]})
    with pytest.raises(ObservationError, match=r"reward 2\.0 outside"):
        s.observe(0, {ids[0]: [0.5, 2.0, -0.5]})
    # values inside the range or exactly at lo - tol / hi + tol are not the offending one, whatever their position
    for edge, bad in (([0.0, 1.0], 2.0), ([0.0 - 1e-6, 1.0 + 1e-6], 2.0), ([1.0, 0.0], -0.5), ([1.0 + 1e-6, 0.0 - 1e-6], -0.5)):
        with pytest.raises(ObservationError, match=rf"task {ids[2]!r}: reward {bad!r} outside") as exc:
            s.observe(0, {ids[0]: [0.5], ids[2]: [*edge, bad]})
        assert (exc.value.task_id, exc.value.step) == (ids[2], 0)
    s.observe(0, {ids[0]: (1.0 + 1e-6, 1.0), ids[1]: np.array([0.0 - 1e-6, 0.0, 0.0, 0.0])})  # tuple and array groups
    assert s.log.arrays()["m"].tolist() == [1.0, 0.0] and s.log.arrays()["v"].tolist() == [0.0, 0.0]


def test_exactly_k_rewards_are_accepted_and_the_first_offending_task_is_named(pool, graph):
    s = sched(pool, graph)
    ids = s.select(0)
    with pytest.raises(ObservationError) as exc:
        s.observe(0, {ids[0]: [1.0] * K, ids[1]: [1.0] * (K + 1), ids[2]: []})
    assert exc.value.task_id == ids[1] and exc.value.step == 0 and f"{K + 1} rewards, more than K = rollouts_per_task = {K}" in str(exc.value)
    m = s.observe(0, {ids[0]: [1.0] * K})
    assert m["envsched/short_groups"] == 0.0 and m["envsched/missing_rewards"] == 0.0


# ---- observe: guards ---------------------------------------------------------------------------------------
def test_step_guards_accept_numpy_integers_and_refuse_bools(pool, graph):
    s = sched(pool, graph)
    ids = s.select(0)
    with pytest.raises(ObservationError, match=r"^observe\(\): step must be an integer, got False$") as exc:
        s.observe(False, rewards_for(ids, 0))
    assert exc.value.step is None and exc.value.task_id is None
    with pytest.raises(ObservationError, match=r"^observe\(step=0\): rewards must be a mapping \{task_id: \[r_1, \.\.\., r_K\]\}, got list$") as exc:
        s.observe(0, [1.0])
    assert exc.value.step == 0 and exc.value.task_id is None
    with pytest.raises(ObservationError, match=r"^observe\(step=0\): needs at least one task's rewards$") as exc:
        s.observe(0, {})
    assert exc.value.step == 0 and exc.value.task_id is None
    m = s.observe(np.int64(0), rewards_for(ids, 0))
    assert m["envsched/observed_groups"] == 4.0 and s.observed_steps == {0}


def test_never_selected_step_previews_three_task_ids(pool, graph):
    s = sched(pool, graph, batch_size=5)
    ids = s.select(0)
    with pytest.raises(ObservationError) as exc:
        s.observe(1, rewards_for(ids, 0))
    assert str(exc.value) == (
        f"observe(step=1): step 1 was never selected (call select(1) first); rewards given for {ids[0]!r}, {ids[1]!r}, {ids[2]!r}, ... (5 tasks)"
    )
    assert exc.value.task_id == ids[0] and exc.value.step == 1
    with pytest.raises(ObservationError) as exc:
        s.observe(1, rewards_for(ids[:3], 0))
    assert str(exc.value).endswith(f"rewards given for {ids[0]!r}, {ids[1]!r}, {ids[2]!r}")
    s.observe(0, rewards_for(ids[:2], 0))
    s.observe(0, rewards_for(ids[3:], 0))  # the rest of the batch, in pieces
    with pytest.raises(ObservationError) as exc:
        s.observe(0, rewards_for(ids[2:], 0))
    assert str(exc.value) == f"observe(step=0): task {ids[3]!r} of step 0 was already observed; each (step, task) is observed once"
    assert exc.value.task_id == ids[3] and exc.value.step == 0


def test_non_string_task_id_is_an_unknown_task(pool, graph):
    s = sched(pool, graph)
    ids = s.select(0)
    with pytest.raises(UnknownTaskError) as exc:
        s.observe(0, {ids[0]: [1.0], 0: [1.0]})
    assert exc.value.task_id == 0 and exc.value.step == 0 and str(exc.value) == "observe(step=0): unknown task_id 0 (not in the pool)"
    assert len(s.log) == 0


@pytest.mark.parametrize(
    "group, fragment",
    [({"a": 1.0}, "got a dict"), (b"1", "got a bytes"), (None, "got a NoneType (None)"), (np.float32(0.5), "got a scalar"), (1, "got a scalar (1)")],
)
def test_group_type_guard_names_the_kind(pool, graph, group, fragment):
    s = sched(pool, graph)
    ids = s.select(0)
    with pytest.raises(ObservationError, match=f"task {ids[1]!r}: rewards must be a list of 1..{K} numbers") as exc:
        s.observe(0, {ids[0]: [1.0], ids[1]: group})
    assert fragment in str(exc.value) and exc.value.task_id == ids[1]


def test_trajectory_guards_name_the_task(pool, graph):
    s = sched(pool, graph)
    ids = s.select(0)
    r = rewards_for(ids, 0)
    with pytest.raises(ObservationError, match=r"^observe\(step=0\): trajectories must be a mapping \{task_id: \[actions, \.\.\.\]\}, got list$") as exc:
        s.observe(0, r, trajectories=[[{"name": "x"}]])
    assert exc.value.task_id is None and exc.value.step == 0
    for bad in ("get_x", {"a": 1}, 3):
        with pytest.raises(ObservationError, match=f"task {ids[1]!r}: trajectories must be a list of action sequences") as exc:
            s.observe(0, r, trajectories={ids[0]: [[{"name": "x"}]], ids[1]: bad})
        assert (exc.value.task_id, exc.value.step) == (ids[1], 0)
    for bad in ({"name": "x"}, [{"name": "x"}, "y"], 5):
        with pytest.raises(ObservationError, match=f"task {ids[0]!r}: trajectory 1 must be a list of action objects") as exc:
            s.observe(0, r, trajectories={ids[0]: [[{"name": "x"}], bad]})
        assert (exc.value.task_id, exc.value.step) == (ids[0], 0)
    with pytest.raises(ObservationError, match=f"trajectories given for task {ids[2]!r}, which has no rewards in this call") as exc:
        s.observe(0, {ids[0]: [1.0]}, trajectories={ids[0]: [], ids[2]: []})
    assert (exc.value.task_id, exc.value.step) == (ids[2], 0)
    assert len(s.log) == 0 and s.observed_steps == set()
    s.observe(0, r, trajectories={ids[0]: [[], ({"name": "x"},)]})  # an empty and a tuple sequence are fine


# ---- identifier filter bookkeeping (App. C) ----------------------------------------------------------------
def detector(task, actions):
    return [k for k, a in enumerate(actions) if a.get("sus")]


def replay(task_id, actions):
    """Reward = sum of the actions' "val"; the identifier filter replays once with and once without the
    suspicious action (no arguments, so no dependent edits)."""
    if any(a.get("boom") for a in actions):
        raise RuntimeError("replay broke")
    return float(sum(a.get("val", 0.0) for a in actions))


def traj(kind: str, reward: float) -> list[dict]:
    return {
        "filtered": [{"name": "get_a", "sus": True, "val": reward / 2}, {"name": "get_b", "val": reward / 2}],  # reduced reward drops
        "kept": [{"name": "get_a", "sus": True, "val": 0.0}, {"name": "get_b", "val": reward}],  # reduced reward equal
        "mismatch": [{"name": "get_a", "sus": True, "val": reward - 0.2}],
        "error": [{"name": "get_a", "sus": True, "boom": True}],
        "clean": [{"name": "get_b", "val": reward}],
    }[kind]


def id_sched(pool, graph, **cfg):
    cfg = {"batch_size": 4, "rollouts_per_task": K, "scheduler": "random", **cfg}
    return EnvScheduler(pool, EnvSchedConfig(**cfg), graph=graph, replay=replay, identifier_detector=detector)


@pytest.mark.parametrize(
    "max_checks, rewards, kinds, checked, filtered",
    [
        (1, [0.0, 1.0, 0.75], ["filtered", "kept", "filtered"], 1, 0),  # highest reward first; one check, kept
        (2, [0.0, 1.0, 0.75], ["filtered", "kept", "filtered"], 2, 1),  # the second check filters
        (1, [1.0, 0.75], ["clean", "filtered"], 1, 1),  # a clean trajectory is not a check
        (3, [1.0, 0.75, 0.5], ["filtered", "kept", "kept"], 1, 1),  # a filtered one ends the task's checks
        (3, [0.25, 0.0], ["filtered", "filtered"], 0, 0),  # below identifier_min_reward = 0.5: never replayed
        (3, [0.5], ["filtered"], 1, 1),  # exactly at the minimum: replayed
        (3, [1.0], ["filtered", "filtered"], 1, 1),  # more trajectories than rewards: the extra one ignored
    ],
)
def test_identifier_checks_order_limits_and_counts(pool, max_checks, rewards, kinds, checked, filtered):
    s = id_sched(pool, None, identifier_max_checks_per_task=max_checks)
    ids = s.select(0)
    t = ids[0]
    trajs = [traj(k, r) for k, r in zip(kinds, rewards + [1.0] * (len(kinds) - len(rewards)))]
    m = s.observe(0, {t: rewards, ids[1]: [1.0]}, trajectories={t: trajs})
    assert (m["envsched/identifier_checked"], m["envsched/identifier_filtered"]) == (checked, filtered)
    assert s.counters["identifier_checked"] == checked and s.counters["identifier_filtered"] == filtered
    assert s.available[pool.index[t]] == (not filtered) and int(s.available.sum()) == len(pool) - filtered
    assert s.select(1) and s.metrics(1)["envsched/identifier_filtered"] == filtered


def test_identifier_filter_logs_the_removed_task(pool, caplog):
    s = id_sched(pool, None)
    ids = s.select(0)
    with caplog.at_level(logging.INFO, logger="envsched.scheduler"):
        s.observe(0, {ids[0]: [1.0]}, trajectories={ids[0]: [traj("filtered", 1.0)]})
    msgs = [r.getMessage() for r in caplog.records if r.name == "envsched.scheduler"]
    assert msgs == [f"envsched: identifier filter removed {ids[0]} (replay 1.0000 -> 0.5000)"]
    assert s.available.dtype == bool and not s.available[pool.index[ids[0]]]


def test_identifier_counters_replay_mismatch_and_error_and_skip_removed_tasks(pool):
    s = id_sched(pool, None)
    ids = s.select(0)
    m = s.observe(0, {ids[0]: [1.0], ids[1]: [1.0], ids[2]: [1.0]}, trajectories={ids[0]: [traj("mismatch", 1.0)], ids[1]: [traj("error", 1.0)], ids[2]: [traj("kept", 1.0)]})
    assert s.counters == {"identifier_checked": 3, "identifier_filtered": 0, "replay_mismatch": 1, "replay_error": 1}
    assert (m["envsched/identifier_checked"], m["envsched/replay_mismatch"], m["envsched/identifier_filtered"]) == (3.0, 1.0, 0.0)
    assert s.available.all()
    # a task already removed is not replayed again; the counters accumulate over steps
    ids = s.select(1)
    s.available[pool.index[ids[0]]] = False
    m = s.observe(1, {ids[0]: [1.0], ids[1]: [1.0]}, trajectories={ids[0]: [traj("filtered", 1.0)], ids[1]: [traj("filtered", 1.0)]})
    assert s.counters == {"identifier_checked": 4, "identifier_filtered": 1, "replay_mismatch": 1, "replay_error": 1}
    assert (m["envsched/identifier_checked"], m["envsched/identifier_filtered"], m["envsched/replay_mismatch"]) == (4.0, 1.0, 1.0)


def test_identifier_counters_add_up_within_one_step(pool):
    """Each outcome counter adds one per check, also for several checks of one kind in the same step."""
    s = id_sched(pool, None, batch_size=6)
    ids = s.select(0)
    kinds = ["filtered", "filtered", "mismatch", "mismatch", "error", "error"]
    m = s.observe(0, {t: [1.0] for t in ids}, trajectories={t: [traj(k, 1.0)] for t, k in zip(ids, kinds)})
    assert s.counters == {"identifier_checked": 6, "identifier_filtered": 2, "replay_mismatch": 2, "replay_error": 2}
    assert (m["envsched/identifier_checked"], m["envsched/identifier_filtered"], m["envsched/replay_mismatch"]) == (6.0, 2.0, 2.0)
    assert np.flatnonzero(~s.available).tolist() == sorted(pool.indices(ids[:2]).tolist())


def test_identifier_checks_per_task_stop_at_the_limit(pool):
    """With identifier_max_checks_per_task = 2, three kept (non-clean, not filtered) trajectories give two checks."""
    s = id_sched(pool, None, identifier_max_checks_per_task=2)
    ids = s.select(0)
    s.observe(0, {ids[0]: [1.0, 0.75, 0.5]}, trajectories={ids[0]: [traj("kept", r) for r in (1.0, 0.75, 0.5)]})
    assert s.counters == {"identifier_checked": 2, "identifier_filtered": 0, "replay_mismatch": 0, "replay_error": 0}
    assert s.available.all()


def test_identifier_filter_off_or_no_trajectories_checks_nothing(pool):
    s = id_sched(pool, None, identifier_filter=False)
    ids = s.select(0)
    s.observe(0, {ids[0]: [1.0]}, trajectories={ids[0]: [traj("filtered", 1.0)]})
    assert s.counters["identifier_checked"] == 0 and s.available.all()
    s = id_sched(pool, None)
    ids = s.select(0)
    m = s.observe(0, {ids[0]: [1.0]}, trajectories={})
    assert s.counters["identifier_checked"] == 0 and "envsched/tools_used_per_batch" not in m


# ---- predict ---------------------------------------------------------------------------------------------
def test_predict_defaults_to_the_next_step_and_caches_per_log_length(pool, graph):
    s = sched(pool, graph)
    assert s.predict() is s.predict(0)  # nothing selected or observed: step 0
    s.observe(0, rewards_for(s.select(0), 0))
    assert s.predict() is s.predict(1)  # the step after the last observed one
    s.select(1)
    s.select(3)
    assert s.predict() is s.predict(4)  # the step after the last selected one
    before = s.predict(4)
    s.observe(1, rewards_for(s.select(1), 1))
    after = s.predict(4)
    assert after is not before and not np.array_equal(after.q, before.q)


@pytest.mark.parametrize("cross_reference", ["global", "environment"])
def test_predict_of_a_past_step_ignores_later_observations(pool, graph, cross_reference):
    """predict(t) for an observed step t uses only observations of steps < t and the neighbours observed
    before t (with the configured minimum similarity): it equals the prediction of a twin that stopped at t - 1."""
    cfg = {"cross_reference": cross_reference, "min_neighbor_similarity": 0.3, "k_within": 2, "k_cross": 3}
    full = sched(pool, graph, **cfg)
    twins = {2: sched(pool, graph, **cfg), 4: sched(pool, graph, **cfg)}  # observed steps 0..1 and 0..3
    for step in range(4):
        r = rewards_for(full.select(step), step)
        full.observe(step, r)
        for upto, twin in twins.items():
            if step < upto:
                assert twin.select(step) == full.select(step)
                twin.observe(step, r)
    for t in (2, 3):
        past, same = full.predict(t), (twins[2] if t == 2 else _upto(pool, graph, cfg, full, 3)).predict(t)
        for name in ("v", "m", "d", "q"):
            assert np.allclose(getattr(past, name), getattr(same, name)), (t, name)
    assert not np.allclose(full.predict(4).q, twins[2].predict(4).q)
    assert np.allclose(full.predict(4).q, twins[4].predict(4).q)


def test_predict_of_the_last_observed_step_uses_the_neighbours_observed_before_it(pool, graph):
    """predict(t) at the latest observed step t also rebuilds N_t from the nodes observed before t: with
    k_within = k_cross = 1 a node first observed at t would otherwise displace an earlier neighbour."""
    cfg = {"k_within": 1, "k_cross": 1}
    full = sched(pool, graph, **cfg)
    for step in range(2):
        full.observe(step, rewards_for(full.select(step), step))
    before = _upto(pool, graph, cfg, full, 1)  # observed step 0 only
    for name in ("v", "m", "d", "q"):
        assert np.allclose(getattr(full.predict(1), name), getattr(before.predict(1), name)), name


def _upto(pool, graph, cfg, full, steps):
    """A twin of ``full`` that observed only its first ``steps`` steps (the same batches and rewards)."""
    twin = sched(pool, graph, **cfg)
    for step in range(steps):
        assert twin.select(step) == full.select(step)
        twin.observe(step, rewards_for(full.select(step), step))
    return twin


# ---- state_dict ----------------------------------------------------------------------------------------------
def test_state_dict_is_a_snapshot_and_round_trips_exactly(pool, graph):
    s = sched(pool, graph)
    for step in range(3):
        s.observe(step, rewards_for(s.select(step), step))
    s.select(3)  # selected, not observed: its selection record travels
    state = s.state_dict()
    assert state["version"] == 2 and state["selection_steps"].tolist() == [0, 1, 2, 3] and sorted(state["selection_predictions"]) == [3]
    snap = copy.deepcopy(state)
    s.observe(3, rewards_for(s.select(3), 3))
    s.select(4)
    assert state["obs_count"].tolist() == snap["obs_count"].tolist() and state["sel_count"].tolist() == snap["sel_count"].tolist()
    assert len(state["selections"]) == 4 and sorted(state["metrics"]) == [0, 1, 2, 3] and sorted(state["selection_predictions"]) == [3]

    r = sched(pool, graph)
    r.load_state_dict(snap)
    assert r.observed_steps == {0, 1, 2} and sorted(r.selections) == [0, 1, 2, 3]
    assert r.selection_phases == {k: v for k, v in s.selection_phases.items() if k < 4}
    assert r.counters == snap["counters"] and r.counters is not snap["counters"]
    assert r.metrics(2) == pytest.approx({k: v for k, v in s.metrics(2).items()})
    assert r.rng.bit_generator.state == snap["rng"]
    assert r.obs_count.dtype == np.int64 and r.sel_count.dtype == np.int64 and r.available.dtype == bool
    assert r.select(3) == s.select(3)
    m_r = r.observe(3, rewards_for(r.select(3), 3))
    assert "envsched/scored_all" in m_r  # the selection record of step 3 came back
    assert r.select(4) == s.select(4)
    assert np.array_equal(r.predict(5).q, s.predict(5).q)


def test_state_without_neighbours_rebuilds_them_from_the_observed_set(pool, graph):
    s = sched(pool, graph)
    for step in range(3):
        s.observe(step, rewards_for(s.select(step), step))
    state = copy.deepcopy(s.state_dict())
    state["neighbors"] = None
    r = sched(pool, graph)
    r.load_state_dict(state)
    assert r._neighbors is None
    assert np.array_equal(r.predict(3).q, s.predict(3).q)
    assert r.select(3) == s.select(3)


def test_random_mode_state_has_no_neighbours_and_resumes(pool):
    a = EnvScheduler(pool, {"batch_size": 4, "scheduler": "random", "seed": 9})
    for step in range(2):
        a.observe(step, rewards_for(a.select(step), step))
    state = a.state_dict()
    assert state["neighbors"] is None and state["selection_predictions"] == {}
    b = EnvScheduler(pool, {"batch_size": 4, "scheduler": "random", "seed": 1})  # another seed: the state's rng wins
    b.load_state_dict(copy.deepcopy(state))
    assert b._graph is None and b._neighbors is None
    assert [b.select(s) for s in range(2, 5)] == [a.select(s) for s in range(2, 5)]


def test_load_state_dict_refuses_other_versions_and_warns_about_config_changes(pool, graph, caplog):
    s = sched(pool, graph)
    s.observe(0, rewards_for(s.select(0), 0))
    state = s.state_dict()
    for version in (3, None):
        bad = {**state, "version": version}
        with pytest.raises(ValueError, match=rf"^unsupported envsched state version {version!r}$"):
            sched(pool, graph).load_state_dict(bad)
    with pytest.raises(ValueError, match="unsupported envsched state version None"):
        sched(pool, graph).load_state_dict({k: v for k, v in state.items() if k != "version"})
    with caplog.at_level(logging.WARNING, logger="envsched.scheduler"):
        sched(pool, graph).load_state_dict(copy.deepcopy(state))
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger="envsched.scheduler"):
        other = sched(pool, graph, rho=0.25, seed=3)
        other.load_state_dict(copy.deepcopy(state))
    assert [r.getMessage() for r in caplog.records] == ["envsched: loading state saved with different config values for ['rho', 'seed']"]
    assert other.cfg.rho == 0.25  # the running config stays
    old = copy.deepcopy(state)
    del old["selection_predictions"]  # states saved before the diagnostics
    r = sched(pool, graph)
    r.load_state_dict(old)
    assert r.selection_predictions == {} and r.observed_steps == {0}


def test_resume_keeps_the_minimum_neighbour_similarity(pool, graph):
    """A restored neighbour index keeps admitting only neighbours above ``min_neighbor_similarity``."""
    cfg = {"min_neighbor_similarity": 0.3, "k_within": 2, "k_cross": 3}
    a = sched(pool, graph, **cfg)
    a.observe(0, rewards_for(a.select(0), 0))
    b = sched(pool, graph, **cfg)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    for step in range(1, 4):
        r = rewards_for(a.select(step), step)
        assert b.select(step) == a.select(step)
        a.observe(step, r)
        b.observe(step, r)
    for rel in ("in", "cross"):
        assert np.array_equal(a.neighbors.idx[rel], b.neighbors.idx[rel]), rel
        assert np.array_equal(a.neighbors.sim[rel], b.neighbors.sim[rel]), rel
    assert b.neighbors.min_sim == 0.3


def test_resume_under_other_neighbour_counts_rebuilds_the_neighbours(pool, graph):
    """A state saved with k_within = k_cross = 1 resumed under 3 and 3: the saved one-column neighbour lists are not
    loaded (they crashed the next observe() with a shape mismatch); the index is rebuilt from the observed set under
    the running config, exactly what a scheduler with that config holds after observing the same tasks."""
    from envsched.neighbors import NeighborIndex

    a = sched(pool, graph, k_within=1, k_cross=1)
    a.observe(0, rewards_for(a.select(0), 0))
    b = sched(pool, graph, k_within=3, k_cross=3)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    want = NeighborIndex(graph, 3, 3, b.cfg.min_neighbor_similarity)
    want.add_observed(np.flatnonzero(a.obs_count > 0))
    for rel in ("in", "cross"):
        assert b.neighbors.idx[rel].shape == (len(pool), 3), rel
        assert np.array_equal(b.neighbors.idx[rel], want.idx[rel]) and np.array_equal(b.neighbors.sim[rel], want.sim[rel]), rel
    b.observe(1, rewards_for(b.select(1), 1))
    assert b.observed_steps == {0, 1}


def test_fresh_state_round_trips(pool, graph):
    s = sched(pool, graph)
    state = s.state_dict()
    assert state["selection_steps"].dtype == np.int64 and state["selection_steps"].shape == (0,)
    assert state["neighbors"] is not None  # envsched mode builds the neighbour index up front; it travels
    r = sched(pool, graph)
    r.load_state_dict(copy.deepcopy(state))
    assert r.select(0) == s.select(0)


def test_state_of_another_pool_is_refused_with_the_reason(pool, graph):
    other = TaskPool.from_records(synthetic_records(3, 4, seed=0)[:-1])
    state = EnvScheduler(other, {"batch_size": 4, "scheduler": "random"}).state_dict()
    with pytest.raises(ValueError, match=r"^envsched state was saved for a different task pool \(task ids / environments differ\)$"):
        sched(pool, graph).load_state_dict(state)


# ---- the coverage phase inside _fill ------------------------------------------------------------------------
def eye_graph(p: TaskPool):
    """Orthogonal tasks: no similarity penalty between distinct tasks (Eq. 5)."""
    import scipy.sparse as sp

    from envsched.graph import StaticGraph

    x = sp.csr_matrix(np.eye(len(p)))
    members = [np.flatnonzero(p.env == e) for e in range(p.n_envs)]
    return StaticGraph(x_full=x, x_abs=x, env=p.env, env_members=members, descriptions=[], extractor_counts={})


def fill(s: EnvScheduler, q, step=10):
    from envsched.select import BatchBuilder

    b = BatchBuilder(s.graph, s.cfg, s._cap_state(step), s.available.copy())
    try:
        return s._fill(b, step, np.asarray(q, dtype=np.float64))
    finally:
        b.close()


def test_coverage_prefers_the_environment_selected_least_often():
    p = TaskPool.from_records(synthetic_records(2, 2))  # tasks 0, 1 in env 0; 2, 3 in env 1
    s = EnvScheduler(p, EnvSchedConfig(batch_size=1, rho=1.0, progress_filter=False), graph=eye_graph(p))
    s.sel_count = np.array([3, 0, 1, 1], dtype=np.int64)  # env 0 selected 3 times, env 1 twice
    selected, phases, _ = fill(s, [0.9, 0.8, 0.2, 0.1])
    assert (selected, phases) == ([2], ["coverage"])  # env 1, then the higher q
    s.sel_count = np.array([1, 0, 2, 1], dtype=np.int64)  # env 0 once, env 1 three times
    assert fill(s, [0.1, 0.2, 0.9, 0.8])[0] == [1]


def test_fill_stops_when_no_task_is_left():
    p = TaskPool.from_records(synthetic_records(2, 2))
    s = EnvScheduler(p, EnvSchedConfig(batch_size=3, rho=1.0, progress_filter=False), graph=eye_graph(p))
    s.available[[0, 1, 3]] = False
    selected, phases, metrics = fill(s, [0.5, 0.5, 0.5, 0.5])
    assert (selected, phases) == ([2], ["coverage"])
    assert metrics == {"progress_filtered": 0.0, "progress_filter_ignored": 0.0, "cap_relaxations": 0.0}


class StubProgress:
    """Stands in for the progress filter: blocks a fixed mask and records what it was asked with."""

    def __init__(self, mask):
        self.mask, self.calls = np.asarray(mask, dtype=bool), []

    def blocked(self, nbr_idx):
        self.calls.append(nbr_idx)
        return self.mask.copy()


def test_exploitation_skips_progress_blocked_tasks_until_none_is_left():
    p = TaskPool.from_records(synthetic_records(2, 2))
    s = EnvScheduler(p, EnvSchedConfig(batch_size=4, rho=0.0, cap_env_round=4, cap_task_consecutive=5), graph=eye_graph(p))
    s.progress = StubProgress([True, True, False, False])
    selected, phases, metrics = fill(s, [0.9, 0.8, 0.2, 0.1])
    assert selected == [2, 3, 0, 1] and phases == ["exploitation"] * 4  # unblocked first, then the filter is ignored
    assert metrics == {"progress_filtered": 2.0, "progress_filter_ignored": 2.0, "cap_relaxations": 0.0}
    (nbr,) = s.progress.calls  # the within- and cross-environment neighbour arrays (App. C references)
    assert len(nbr) == 2 and nbr[0] is s.neighbors.idx["in"] and nbr[1] is s.neighbors.idx["cross"]
    s.progress = StubProgress([False, False, False, False])
    assert fill(s, [0.9, 0.8, 0.2, 0.1])[2]["progress_filter_ignored"] == 0.0


# -- boundaries of the scheduling rules (C3 window, omega) and a resume after the identifier filter -------------------

@pytest.mark.parametrize("window_steps", [3, 4])
def test_c3_window_counts_exactly_the_previous_window_minus_one_steps(window_steps):
    pool = TaskPool.from_records(synthetic_records(3, 6))
    s = EnvScheduler(pool, EnvSchedConfig(batch_size=4, cap_env_window_steps=window_steps))
    env = pool.env
    e0, e1, e2 = (np.flatnonzero(env == e) for e in range(3))
    # one step per environment, so each step's contribution is visible on its own:
    # step 1 -> env 2 (x3), step 2 -> env 0 (x2), step 3 -> env 1 (x1), step 4 -> env 0 (x1), step 5 itself not yet
    s.selections = {1: e2[:3], 2: e0[:2], 3: e1[:1], 4: e0[2:3]}
    counts = s._cap_state(5).window_env_count.tolist()
    if window_steps == 3:  # the current step and two previous: steps 3 and 4 (step 2 is just outside)
        assert counts == [1, 1, 0]
    else:  # steps 2, 3 and 4 (step 1 just outside)
        assert counts == [3, 1, 0]


def test_c3_blocks_an_environment_exactly_at_the_cap():
    pool = TaskPool.from_records(synthetic_records(2, 8))
    cfg = EnvSchedConfig(batch_size=4, cap_env_window=5, cap_env_round=10, relax_caps_when_short=False)
    s = EnvScheduler(pool, cfg, graph=eye_graph(pool))
    e0 = np.flatnonzero(pool.env == 0)
    s.selections = {6: e0[:2], 7: e0[2:4]}  # 4 in the window for step 8 (steps 6 and 7)
    b = BatchBuilder(s.graph, cfg, s._cap_state(8), s.available.copy())
    assert b.eligible()[e0].all()  # 4 < 5
    b.add(int(e0[4]), "exploitation")
    assert not b.eligible()[e0].any()  # 4 + 1 = 5 reaches C3
    assert b.eligible()[pool.env == 1].all()
    s.selections = {5: e0[:2], 6: e0[2:3], 7: e0[3:4]}  # step 5 is outside the window of step 8: only 2 count
    b = BatchBuilder(s.graph, cfg, s._cap_state(8), s.available.copy())
    for i in e0[4:6]:
        b.add(int(i), "exploitation")
    assert b.eligible()[e0[6:]].all()  # 2 + 2 = 4 < 5


def exploitation_pick_order(c0: float, q: list[float], sel_count: list[int]) -> list[int]:
    """The exploitation order of ``_fill`` (rho = 0: no coverage slot) for given q and selection counts."""
    pool = TaskPool.from_records(synthetic_records(2, 2))
    cfg = EnvSchedConfig(batch_size=4, rho=0.0, exposure_c0=c0, progress_filter=False, cap_env_round=4, cap_task_consecutive=5)
    s = EnvScheduler(pool, cfg, graph=eye_graph(pool))
    s.sel_count = np.asarray(sel_count, dtype=np.int64)
    b = BatchBuilder(s.graph, cfg, s._cap_state(10), s.available.copy())
    try:
        selected, phases, _ = s._fill(b, 10, np.asarray(q, dtype=np.float64))
    finally:
        b.close()
    assert set(phases) == {"exploitation"}
    return selected


def test_omega_breaks_a_tie_in_q():
    # equal q: the task selected less often goes first, whatever its index (without omega the lower index would)
    assert exploitation_pick_order(16.0, [0.7, 0.7, 0.2, 0.1], [5, 1, 0, 0])[:2] == [1, 0]
    assert exploitation_pick_order(16.0, [0.7, 0.7, 0.2, 0.1], [1, 5, 0, 0])[:2] == [0, 1]
    # equal counts: omega is the same, q decides and the tie in both goes to the lower index
    assert exploitation_pick_order(16.0, [0.7, 0.7, 0.2, 0.1], [3, 3, 0, 0])[:2] == [0, 1]


def test_exploitation_score_is_q_times_omega():
    # q 0.9 seen 16 times vs q 0.8 never: omega = (1 + 16/c0)^-1/2
    assert exploitation_pick_order(16.0, [0.9, 0.8, 0.1, 0.05], [16, 0, 0, 0])[0] == 1  # 0.9 / sqrt(2) = 0.64 < 0.8
    assert exploitation_pick_order(64.0, [0.9, 0.8, 0.1, 0.05], [16, 0, 0, 0])[0] == 0  # 0.9 / sqrt(1.25) = 0.805 > 0.8


def test_resume_after_the_identifier_filter_removed_a_task():
    pool = TaskPool.from_records(synthetic_records(3, 4))
    cfg = EnvSchedConfig(batch_size=6)

    def make() -> EnvScheduler:
        return EnvScheduler(pool, cfg, replay=lambda tid, acts: 1.0 if len(acts) == 2 else 0.0)

    s = make()
    ids = s.select(0)
    target = ids[0]
    traj = [{"name": "update_thing", "arguments": {"thing_id": "ZZ-0000"}}, {"name": "get_x", "arguments": {}}]
    s.observe(0, {t: [1.0, 0.0] for t in ids}, trajectories={target: [traj, traj]})
    assert not s.available[pool.index[target]]
    for step in (1, 2):
        s.observe(step, {t: [float(i % 2), 1.0] for i, t in enumerate(s.select(step))})

    restored = make()
    restored.load_state_dict(s.state_dict())
    assert not restored.available[pool.index[target]]
    # 12 tasks, batches of 6, one removed: over 5 more steps every other task is picked, the removed one never
    after = run(restored, range(3, 8))
    assert all(target not in batch for batch in after)
    assert set().union(*after) == set(pool.task_ids) - {target}
    assert after == run(s, range(3, 8))  # and the restored copy chooses what the uninterrupted one does


def run(sched: EnvScheduler, steps: range) -> list[list[str]]:
    batches = []
    for step in steps:
        batches.append(sched.select(step))
        sched.observe(step, {t: [1.0, 0.0] for t in batches[-1]})
    return batches


def test_identifier_filter_removes_task_from_scheduling():
    recs = synthetic_records(3, 4)
    pool = TaskPool.from_records(recs)
    s = EnvScheduler(pool, EnvSchedConfig(batch_size=6), replay=lambda tid, acts: 1.0 if len(acts) == 2 else 0.0)
    ids = s.select(0)
    target = ids[0]
    traj = [{"name": "update_thing", "arguments": {"thing_id": "ZZ-0000"}}, {"name": "get_x", "arguments": {}}]
    m = s.observe(0, {t: [1.0, 0.0] for t in ids}, trajectories={target: [traj, traj]})
    assert m["envsched/identifier_filtered"] == 1.0
    for step in range(1, 6):
        got = s.select(step)
        assert target not in got
        s.observe(step, {t: [1.0, 0.0] for t in got})
