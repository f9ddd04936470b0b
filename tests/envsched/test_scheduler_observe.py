"""observe(): all-or-nothing guards (issue 12, item 4) and the prediction diagnostics (item 1)."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from envsched import EnvSchedConfig, EnvScheduler, ObservationError, TaskPool, UnknownTaskError
from envsched.estimate import EVIDENCE_TYPES, evidence_types, prediction_diagnostics
from envsched.synthetic import SimulatedLearner, synthetic_records

B, K = 12, 4


@pytest.fixture(scope="module")
def records():
    return synthetic_records(8, 10, seed=11)


@pytest.fixture(scope="module")
def pool(records):
    return TaskPool.from_records(records)


@pytest.fixture(scope="module")
def graph(pool):
    return EnvScheduler(pool, EnvSchedConfig(batch_size=B, rollouts_per_task=K)).graph


def _sched(pool, graph, **cfg):
    return EnvScheduler(pool, EnvSchedConfig(batch_size=B, rollouts_per_task=K, **cfg), graph=graph)


def _rewards(ids, seed):
    rng = np.random.default_rng(seed)
    return {t: rng.choice([0.0, 0.25, 0.5, 1.0], size=K).tolist() for t in ids}


def _warm(s, steps):
    """Select and observe ``steps`` steps; returns the batch of the next step (selected, not observed)."""
    for step in range(steps):
        s.observe(step, _rewards(s.select(step), step))
    return s.select(steps)


def assert_same_state(a, b, path="state"):
    """Deep equality of two state_dict()s (arrays by dtype and value, NaN == NaN)."""
    assert type(a) is type(b) or (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, dict):
        assert set(a) == set(b), f"{path}: keys {set(a) ^ set(b)}"
        for k in a:
            assert_same_state(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for k, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{path}[{k}]")
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
        assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), f"{path}: values differ"
    elif isinstance(a, float) and np.isnan(a):
        assert np.isnan(b), path
    elif not path.startswith("state['metrics']") or not path.endswith("_time_s']"):  # wall-clock timings differ
        assert a == b, f"{path}: {a!r} != {b!r}"


def test_assert_same_state_detects_differences(pool, graph):
    s = _sched(pool, graph)
    ids = _warm(s, 2)
    before = copy.deepcopy(s.state_dict())
    s.observe(2, _rewards(ids, 9))
    with pytest.raises(AssertionError):
        assert_same_state(before, s.state_dict())


# ---- the guards, each on a call whose offending group comes after B - 1 valid ones ----------------------
def _bad_calls(pool, batch, other):
    """(name, rewards dict with a bad last entry, expected message fragment, offending task)."""
    good = _rewards(batch[:-1], 123)
    last = batch[-1]
    return [
        ("outside batch", {**good, other: [1.0, 0.0]}, f"task {other!r} is not in step 2's batch", other),
        ("unknown task", {**good, "no-such-task": [1.0]}, "unknown task_id 'no-such-task'", "no-such-task"),
        ("nan", {**good, last: [1.0, float("nan")]}, f"task {last!r}: non-finite reward", last),
        ("inf", {**good, last: [float("inf"), 0.0]}, f"task {last!r}: non-finite reward", last),
        ("above range", {**good, last: [5.0, 0.0]}, f"task {last!r}: reward 5.0 outside reward_range [0.0, 1.0]", last),
        ("below range", {**good, last: [0.5, -0.01]}, f"task {last!r}: reward -0.01 outside reward_range", last),
        ("scalar", {**good, last: 0.5}, f"task {last!r}: rewards must be a list of 1..{K} numbers, got a scalar (0.5)", last),
        ("string", {**good, last: "1.0"}, f"task {last!r}: rewards must be a list", last),
        ("nested", {**good, last: [[1.0, 0.0]]}, f"task {last!r}: rewards must be a flat list", last),
        ("not numbers", {**good, last: [1.0, "x"]}, f"task {last!r}: rewards must be numbers", last),
        ("empty", {**good, last: []}, f"task {last!r}: empty reward group", last),
        ("more than K", {**good, last: [1.0] * (K + 1)}, f"task {last!r}: {K + 1} rewards, more than K", last),
    ]


CASES = ["outside batch", "unknown task", "nan", "inf", "above range", "below range", "scalar", "string", "nested", "not numbers", "empty", "more than K"]


@pytest.mark.parametrize("case", CASES)
def test_refused_call_changes_nothing_and_a_retry_equals_a_correct_first_call(pool, graph, case):
    s, twin = _sched(pool, graph), _sched(pool, graph)
    batch, batch_twin = _warm(s, 2), _warm(twin, 2)
    assert batch == batch_twin
    other = next(t for t in pool.task_ids if t not in batch)
    _, bad, fragment, offender = next(c for c in _bad_calls(pool, batch, other) if c[0] == case)
    before = copy.deepcopy(s.state_dict())
    with pytest.raises(ObservationError) as exc:
        s.observe(2, bad)
    assert fragment in str(exc.value), str(exc.value)
    assert exc.value.task_id == offender and exc.value.step == 2
    assert_same_state(before, s.state_dict())  # nothing of the B - 1 valid groups was recorded
    fixed = _rewards(batch, 77)
    s.observe(2, fixed)
    twin.observe(2, fixed)
    assert_same_state(twin.state_dict(), s.state_dict())
    assert s.select(3) == twin.select(3)


def test_unknown_task_is_still_a_key_error(pool, graph):
    s = _sched(pool, graph)
    s.select(0)
    with pytest.raises(KeyError) as exc:
        s.observe(0, {"nope": [1.0]})
    assert isinstance(exc.value, UnknownTaskError) and str(exc.value) == "observe(step=0): unknown task_id 'nope' (not in the pool)"


def test_step_never_selected_is_refused(pool, graph):
    s = _sched(pool, graph)
    batch = _warm(s, 2)
    before = copy.deepcopy(s.state_dict())
    with pytest.raises(ObservationError, match=r"step 7 was never selected \(call select\(7\) first\); rewards given for") as exc:
        s.observe(7, _rewards(batch, 1))
    assert exc.value.task_id == batch[0]
    assert_same_state(before, s.state_dict())


def test_task_observed_twice_is_refused(pool, graph):
    """Each (step, task) is observed once: the rest of a batch in a second call is accepted, a task again is not."""
    s = _sched(pool, graph)
    batch = _warm(s, 2)
    s.observe(2, _rewards(batch[:6], 1))
    before = copy.deepcopy(s.state_dict())
    with pytest.raises(ObservationError, match=f"task {batch[5]!r} of step 2 was already observed"):
        s.observe(2, _rewards(batch[5:], 2))  # the rest of the batch and one task again: nothing recorded
    with pytest.raises(ObservationError, match="step 1 was already observed"):
        s.observe(1, _rewards(s.select(1), 1))
    assert_same_state(before, s.state_dict())
    s.observe(2, _rewards(batch[6:], 2))  # the rest of the batch, in a second call
    assert s.observed[2] == set(s.selections[2].tolist()) and s.in_flight() == {}


def test_observed_steps_survive_a_state_round_trip(pool, graph):
    s = _sched(pool, graph)
    batch = _warm(s, 3)
    restored = _sched(pool, graph)
    restored.load_state_dict(copy.deepcopy(s.state_dict()))
    with pytest.raises(ObservationError, match="step 1 was already observed"):
        restored.observe(1, _rewards(restored.select(1), 1))
    restored.observe(3, _rewards(batch, 5))  # the selected, unobserved step is still open


def test_bad_step_and_container_types_are_refused(pool, graph):
    s = _sched(pool, graph)
    ids = s.select(0)
    before = copy.deepcopy(s.state_dict())
    with pytest.raises(ObservationError, match="step must be an integer"):
        s.observe(0.0, _rewards(ids, 0))
    with pytest.raises(ObservationError, match="rewards must be a mapping"):
        s.observe(0, [[1.0, 0.0]])
    with pytest.raises(ObservationError, match="needs at least one task's rewards"):
        s.observe(0, {})
    assert_same_state(before, s.state_dict())


@pytest.mark.parametrize("step", [1.5, "2", True, 1.0, None])
def test_select_refuses_a_step_that_is_not_an_integer_as_observe_does(pool, graph, step):
    """Issue 33 finding 11: select(1.5) / select("2") silently became steps 1 and 2."""
    s = _sched(pool, graph)
    before = copy.deepcopy(s.state_dict())
    with pytest.raises(ValueError, match="select\\(\\): step must be an integer"):
        s.select(step)
    assert_same_state(before, s.state_dict())
    assert s.select(np.int64(0)) == s.select(0)  # numpy integers are integers


def test_a_missing_reward_is_named_as_missing(pool, graph):
    """Issue 33 finding 11: observe([None]) was refused as "non-finite reward in [nan]"."""
    s = _sched(pool, graph)
    ids = s.select(0)
    before = copy.deepcopy(s.state_dict())
    with pytest.raises(ObservationError, match=f"task {ids[0]!r}: reward 1 is missing \\(None\\)") as exc:
        s.observe(0, {ids[0]: [1.0, None]})
    assert exc.value.task_id == ids[0] and "nan" not in str(exc.value)
    assert_same_state(before, s.state_dict())


def test_trajectories_of_a_task_without_rewards_are_refused(pool, graph):
    s = _sched(pool, graph)
    ids = s.select(0)
    before = copy.deepcopy(s.state_dict())
    traj = [{"name": "x", "arguments": {}}]
    with pytest.raises(ObservationError, match=f"trajectories given for task {ids[-1]!r}, which has no rewards") as exc:
        s.observe(0, _rewards(ids[:-1], 0), trajectories={ids[0]: [traj], ids[-1]: [traj]})
    assert exc.value.task_id == ids[-1]
    with pytest.raises(ObservationError, match=f"task {ids[0]!r}: trajectory 0 must be a list of action objects"):
        s.observe(0, _rewards(ids, 0), trajectories={ids[0]: ["get_user"]})
    assert_same_state(before, s.state_dict())


def test_fewer_than_k_rewards_and_a_subset_of_the_batch_are_accepted_and_counted(pool, graph):
    s = _sched(pool, graph)
    ids = s.select(0)
    rewards = {t: [1.0, 0.0, 1.0, 0.0] for t in ids[:8]}
    rewards[ids[0]] = [1.0]  # 3 missing
    rewards[ids[1]] = [0.0, 1.0]  # 2 missing
    m = s.observe(0, rewards)
    assert m["envsched/observed_groups"] == 8 and m["envsched/unobserved_selected"] == 4
    assert m["envsched/short_groups"] == 2 and m["envsched/missing_rewards"] == 5
    log = s.log.arrays()
    assert len(log["node"]) == 8 and log["v"][0] == 0.0 and log["v"][1] == 0.25  # Eq. 2 over the scored rollouts


def test_reward_range_is_configurable_and_rounding_is_clipped(pool, graph):
    s = _sched(pool, graph, reward_range=(-1.0, 2.0))
    ids = s.select(0)
    s.observe(0, {ids[0]: [-1.0, 2.0]})
    assert s.log.arrays()["m"][0] == 0.5
    s = _sched(pool, graph)
    ids = s.select(0)
    s.observe(0, {ids[0]: [1.0 + 1e-9, 1.0], ids[1]: [-1e-9, 0.0]})  # within reward_range_tolerance
    assert list(s.log.arrays()["m"]) == [1.0, 0.0] and list(s.log.arrays()["v"]) == [0.0, 0.0]
    with pytest.raises(Exception, match="reward_range"):
        EnvSchedConfig(reward_range=(1.0, 0.0))


def test_scheduler_reports_diagnostics_every_step_from_predictions_made_at_selection(records, pool, graph):
    s = _sched(pool, graph)
    arch = np.array([r["meta"]["archetype"] for r in records])
    learner = SimulatedLearner(pool.env, arch, np.array([len(r["verifier_checks"]) for r in records]), seed=3)
    seen_types = set()
    for step in range(8):
        ids = s.select(step)
        sel_metrics = s.metrics(step)
        assert sum(sel_metrics[f"envsched/selected_{t}"] for t in EVIDENCE_TYPES) == B
        pred = s.predict(step)  # the prediction select() used (same step, same log)
        nodes = pool.indices(ids)
        code = evidence_types(s.log, s.neighbors.idx, step, nodes, len(pool))
        seen_types |= {EVIDENCE_TYPES[c] for c in code}
        R = learner.rollout(nodes, K)
        learner.train(nodes, R)
        state = copy.deepcopy(s.state_dict())  # between select and observe: the selection record travels
        m = s.observe(step, {t: r.tolist() for t, r in zip(ids, R)})
        realised = R.var(axis=1)
        expected = prediction_diagnostics(pred.q[nodes], realised, code, pred.v[nodes])
        for key, val in expected.items():
            assert m[f"envsched/{key}"] == pytest.approx(val), key
        assert {k for k in m if "spearman" in k} == {f"envsched/{k}" for k in expected if "spearman" in k}  # no stray / NaN keys
        assert all(np.isfinite(v) for v in m.values())
        if step == 0:
            assert sel_metrics["envsched/selected_cold"] == B and not any("spearman" in k for k in m)
        if step == 5:
            restored = _sched(pool, graph)
            restored.load_state_dict(state)
            again = restored.observe(step, {t: r.tolist() for t, r in zip(ids, R)})
            assert {k: v for k, v in again.items() if "spearman" in k} == {k: v for k, v in m.items() if "spearman" in k}
    assert "envsched/spearman_q_all" in m
    assert {"observed", "within_env"} <= seen_types
    assert s.selection_predictions == {}  # dropped once observed


def test_random_scheduler_has_no_diagnostics(pool):
    s = EnvScheduler(pool, EnvSchedConfig(batch_size=B, rollouts_per_task=K, scheduler="random"))
    for step in range(2):
        m = s.observe(step, _rewards(s.select(step), step))
    assert not any("spearman" in k or "selected_" in k for k in m) and s._graph is None
