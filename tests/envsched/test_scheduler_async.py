"""EnvSched with lag (issue 46, deliverable 3): selections of any size that keep in-flight tasks out, observations
of any selection in pieces and in any order, each (selection, task) once, dropped groups, and a state that carries
what is in flight.  A hypothesis state machine runs any interleaving of select / observe / drop / state round trip
on a 12-task pool; the plain tests below pin each refusal message."""

from __future__ import annotations

import copy
import functools
import logging

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from envsched import EnvSchedConfig, EnvScheduler, ObservationError, TaskPool, UnknownTaskError
from envsched.scheduler import STATE_VERSION
from envsched.synthetic import synthetic_records

B, K = 4, 2


REWARDS = st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=1, max_size=K)


@functools.cache
def pool() -> TaskPool:
    return TaskPool.from_records(synthetic_records(3, 4, seed=5))


@functools.cache
def graph():
    return EnvScheduler(pool(), EnvSchedConfig(batch_size=B, rollouts_per_task=K)).graph


def make(mode: str = "envsched", **cfg) -> EnvScheduler:
    config = EnvSchedConfig(batch_size=B, rollouts_per_task=K, scheduler=mode, seed=3, **cfg)
    return EnvScheduler(pool(), config, graph=graph() if mode == "envsched" else None)


def same_state(a, b, path="state"):
    """Deep equality of two state_dict()s (arrays by dtype and value, NaN == NaN), wall-clock timings aside."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            if not (isinstance(k, str) and k.endswith("_time_s")):
                same_state(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{path}: {a!r} != {b!r}"
        for k, (x, y) in enumerate(zip(a, b)):
            same_state(x, y, f"{path}[{k}]")
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a!r} != {b!r}"
        assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), f"{path}: values differ"
    elif isinstance(a, float) and np.isnan(a):
        assert isinstance(b, float) and np.isnan(b), path
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


class LaggedScheduler(RuleBasedStateMachine):
    """The scheduler next to a model of what is open, observed and dropped per selection."""

    MODE = "envsched"

    def __init__(self):
        super().__init__()
        self.s = make(self.MODE)
        self.next_id = 0
        self.open: dict[int, set[str]] = {}
        self.observed: dict[int, set[str]] = {}
        self.dropped: dict[int, set[str]] = {}

    def _select(self, s: EnvScheduler, size: int) -> list[str]:
        return s.select(self.next_id, size=size, exclude=s.in_flight_mask())

    def _record(self, ids: list[str], size: int) -> None:
        """Check a new selection against the model and add it."""
        busy = {t for ts in self.open.values() for t in ts}
        assert len(ids) == size == len(set(ids))
        reselected = len(busy & set(ids))
        # an in-flight task is chosen again only when the pool is too small to avoid it, and then it is counted
        assert reselected == max(0, size - (len(pool()) - len(busy)))
        assert self.s.metrics(self.next_id)["envsched/inflight_reselected"] == reselected
        self.open[self.next_id] = set(ids)
        self.next_id += 1

    @rule(size=st.integers(1, 12))
    def select(self, size):
        self._record(self._select(self.s, size), size)

    def _pairs(self, data, selections):
        """A drawn subset of the open (selection, task) pairs of ``selections``, by selection, in a drawn order."""
        chosen: dict[int, list[str]] = {}
        for sel in data.draw(st.permutations(sorted(selections))):
            tasks = data.draw(st.lists(st.sampled_from(sorted(self.open[sel])), unique=True))
            if tasks:
                chosen[sel] = tasks
        return chosen

    @precondition(lambda self: self.open)
    @rule(data=st.data())
    def observe(self, data):
        """Observe a subset of the open groups of any selections, each selection's call in any order."""
        for sel, tasks in self._pairs(data, self.open).items():
            m = self.s.observe(sel, {t: data.draw(REWARDS) for t in tasks})
            self._close(sel, tasks, self.observed)
            assert m["envsched/observed_groups"] == len(self.observed[sel])

    @precondition(lambda self: self.open)
    @rule(data=st.data())
    def drop(self, data):
        for sel, tasks in self._pairs(data, self.open).items():
            self.s.drop(sel, tasks)
            self._close(sel, tasks, self.dropped)

    def _close(self, sel, tasks, into):
        into.setdefault(sel, set()).update(tasks)
        self.open[sel] -= set(tasks)
        if not self.open[sel]:
            del self.open[sel]

    @precondition(lambda self: any(self.observed.values()) or any(self.dropped.values()))
    @rule(data=st.data(), how=st.sampled_from(["observe", "drop"]))
    def repeat_is_refused(self, data, how):
        """A resolved (selection, task), alone or next to open tasks of that selection: refused, nothing changes."""
        resolved = sorted((s, t) for rec in (self.observed, self.dropped) for s, ts in rec.items() for t in ts)
        sel, task = data.draw(st.sampled_from(resolved))
        tasks = [*data.draw(st.lists(st.sampled_from(sorted(self.open.get(sel, {task}))), unique=True)), task]
        tasks = list(dict.fromkeys(data.draw(st.permutations(tasks))))
        before = copy.deepcopy(self.s.state_dict())
        word = "observed" if task in self.observed.get(sel, ()) else "dropped"
        with pytest.raises(ObservationError, match=f"task {task!r} of step {sel} was (already )?{word}"):
            if how == "observe":
                self.s.observe(sel, {t: [1.0] for t in tasks})
            else:
                self.s.drop(sel, tasks)
        same_state(before, self.s.state_dict())

    @rule(size=st.integers(1, 12))
    def round_trip(self, size):
        """A scheduler restored from the state chooses the next batch the original chooses, and carries on."""
        restored = make(self.MODE)
        restored.load_state_dict(copy.deepcopy(self.s.state_dict()))
        assert restored.in_flight() == self.s.in_flight()
        ids = self._select(restored, size)
        assert self._select(self.s, size) == ids
        same_state(restored.state_dict(), self.s.state_dict())
        self.s = restored
        self._record(ids, size)

    @invariant()
    def record_matches_the_model(self):
        s = self.s
        assert s.in_flight() == {sel: [t for t in s.select(sel) if t in ts] for sel, ts in sorted(self.open.items())}
        assert {sel: {s.pool.task_ids[i] for i in nodes} for sel, nodes in s.observed.items()} == {k: v for k, v in self.observed.items() if v}
        for sel, nodes in s._open.items():
            assert not nodes & s.observed.get(sel, set())  # open and observed are disjoint
        obs = s.log.arrays()
        pairs = list(zip(obs["step"].tolist(), obs["node"].tolist()))
        assert len(pairs) == len(set(pairs))  # each (selection, task) logged at most once
        assert s.obs_count.tolist() == np.bincount(obs["node"], minlength=len(s.pool)).tolist()
        assert set(s.selection_predictions) <= set(self.open)  # a resolved selection's record is gone


class LaggedRandomScheduler(LaggedScheduler):
    MODE = "random"


SETTINGS = settings(max_examples=50, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


TestLaggedScheduler = LaggedScheduler.TestCase


TestLaggedScheduler.settings = SETTINGS


TestLaggedRandomScheduler = LaggedRandomScheduler.TestCase


TestLaggedRandomScheduler.settings = SETTINGS


# ---- plain tests ----------------------------------------------------------------------------------------------
def test_sync_caller_default_size_and_no_exclude_is_unchanged():
    """No size and no exclude: batch_size tasks and no inflight_reselected metric (the sync metrics stay)."""
    s = make()
    ids = s.select(0)
    assert len(ids) == B and "envsched/inflight_reselected" not in s.metrics(0)


def test_a_later_selection_is_observed_before_an_earlier_one():
    s = make()
    a = s.select(0, size=3)
    b = s.select(1, size=3, exclude=s.in_flight_mask())
    assert not set(a) & set(b)
    s.observe(1, {b[2]: [1.0, 0.0]})
    s.observe(0, {a[0]: [1.0, 1.0], a[1]: [0.0]})
    s.observe(1, {b[0]: [0.5, 0.0]})
    assert s.in_flight() == {0: [a[2]], 1: [b[1]]}
    assert s.metrics(0)["envsched/observed_groups"] == 2 and s.metrics(0)["envsched/short_groups"] == 1
    assert s.metrics(1)["envsched/observed_groups"] == 2 and s.metrics(1)["envsched/unobserved_selected"] == 1
    s.drop(0, [a[2]])
    s.observe(1, {b[1]: [1.0]})
    assert s.in_flight() == {} and s.selection_predictions == {}
    assert s.metrics(0)["envsched/dropped_groups"] == 1 and s.observed_steps == {0, 1}


def test_metrics_of_a_selection_observed_in_pieces_equal_one_call():
    """The realised statistics and prediction diagnostics cover every observed group of the selection."""
    whole, pieces = make(relation_weights="paper"), make(relation_weights="paper")
    rng = np.random.default_rng(0)
    for step in range(3):
        ids = whole.select(step)
        assert pieces.select(step) == ids
        rewards = {t: rng.choice([0.0, 0.5, 1.0], size=K).tolist() for t in ids}
        m_whole = whole.observe(step, rewards)
        pieces.observe(step, {t: rewards[t] for t in ids[2:]})
        m_pieces = pieces.observe(step, {t: rewards[t] for t in ids[:2]})
        strip = lambda m: {k: v for k, v in m.items() if not k.endswith("_time_s")}
        assert strip(m_pieces) == pytest.approx(strip(m_whole))


def test_pool_too_small_reselects_in_flight_tasks_with_a_warning(caplog):
    for mode in ("envsched", "random"):
        s = make(mode)
        first = s.select(0, size=10)
        with caplog.at_level(logging.WARNING, logger="envsched.scheduler"):
            second = s.select(1, size=4, exclude=s.in_flight_mask())
        assert len(set(second) - set(first)) == 2 and s.metrics(1)["envsched/inflight_reselected"] == 2
        assert [r.getMessage() for r in caplog.records] == [
            "envsched: select(1): only 2 of the 4 tasks asked for are not in flight; 2 in-flight tasks chosen again"
        ]
        caplog.clear()


def test_exclude_as_task_ids_and_as_a_mask_choose_the_same():
    a, b = make(), make()
    first = a.select(0, size=5)
    assert b.select(0, size=5) == first
    assert a.select(1, size=5, exclude=first) == b.select(1, size=5, exclude=b.in_flight_mask())


def test_random_baseline_stays_reproducible_with_sizes_and_exclusions():
    def run():
        s = make("random")
        return [s.select(i, size=k, exclude=s.in_flight_mask()) for i, k in enumerate([3, 1, 5, 2])]

    assert run() == run()


def test_select_refusals():
    s = make()
    for size, msg in ((0, "size must be between 1 and the pool size 12, got 0"), (13, "got 13"), (True, "size must be an integer, got True"),
                      (2.0, "size must be an integer, got 2.0")):
        with pytest.raises(ValueError, match=rf"^select\(0\): .*{msg}$"):
            s.select(0, size=size)
    with pytest.raises(ValueError, match=r"^select\(0\): exclude holds 'nope', which is not a task id of the pool$"):
        s.select(0, exclude=["nope"])
    with pytest.raises(ValueError, match=r"^select\(0\): exclude must be task ids or a bool mask over the pool, got str$"):
        s.select(0, exclude=s.pool.task_ids[0])
    with pytest.raises(ValueError, match=r"^select\(0\): an exclude mask must have the pool's shape \(12,\), got \(3,\)$"):
        s.select(0, exclude=np.zeros(3, dtype=bool))
    assert s.selections == {}


def test_observe_refusals_of_resolved_tasks():
    s = make()
    ids = s.select(0)
    s.observe(0, {ids[0]: [1.0]})
    s.drop(0, [ids[1]])
    before = copy.deepcopy(s.state_dict())
    with pytest.raises(ObservationError) as exc:
        s.observe(0, {ids[2]: [1.0], ids[0]: [0.0]})
    assert str(exc.value) == f"observe(step=0): task {ids[0]!r} of step 0 was already observed; each (step, task) is observed once"
    assert exc.value.step == 0 and exc.value.task_id == ids[0]
    with pytest.raises(ObservationError) as exc:
        s.observe(0, {ids[1]: [1.0]})
    assert str(exc.value) == f"observe(step=0): task {ids[1]!r} of step 0 was dropped; a dropped task is not observed"
    same_state(before, s.state_dict())


def test_drop_refusals():
    s = make()
    ids = s.select(0)
    other = next(t for t in s.pool.task_ids if t not in ids)
    s.observe(0, {ids[0]: [1.0]})
    s.drop(0, [ids[1]])
    before = copy.deepcopy(s.state_dict())
    cases = [
        (1, [ids[2]], ObservationError, f"drop(step=1): step 1 was never selected; task ids given: {ids[2]!r}"),
        (0, ids[2], ObservationError, "drop(step=0): task_ids must be a list of task ids, got str"),
        (0, 5, ObservationError, "drop(step=0): task_ids must be a list of task ids, got int"),
        ("0", [ids[2]], ObservationError, "drop(): step must be an integer, got '0'"),
        (0, [ids[2], "nope"], UnknownTaskError, "drop(step=0): unknown task_id 'nope' (not in the pool)"),
        (0, [other], ObservationError, f"drop(step=0): task {other!r} is not in step 0's batch"),
        (0, [ids[2], ids[2]], ObservationError, f"drop(step=0): task {ids[2]!r} is given twice"),
        (0, [ids[2], ids[0]], ObservationError, f"drop(step=0): task {ids[0]!r} of step 0 was already observed; each (step, task) is observed once"),
        (0, [ids[1]], ObservationError, f"drop(step=0): task {ids[1]!r} of step 0 was dropped; a dropped task is not observed"),
    ]
    for step, tasks, kind, msg in cases:
        with pytest.raises(kind) as exc:
            s.drop(step, tasks)
        assert type(exc.value) is kind and str(exc.value) == msg
        same_state(before, s.state_dict())
    assert s.drop(0, []) == s.metrics(0)  # nothing to drop: nothing changes
    same_state(before, s.state_dict())


def test_state_carries_what_is_in_flight():
    s = make()
    a = s.select(0)
    b = s.select(1, exclude=s.in_flight_mask())
    s.observe(1, {b[0]: [1.0, 0.0]})
    s.drop(0, [a[3]])
    state = s.state_dict()
    assert state["version"] == STATE_VERSION == 2
    assert state["open_steps"].tolist() == [0, 1] and [x.tolist() for x in state["open"]] == [s.selections[0][:3].tolist(), s.selections[1][1:].tolist()]
    r = make()
    r.load_state_dict(copy.deepcopy(state))
    assert r.in_flight() == s.in_flight() and r.observed == s.observed and sorted(r.selection_predictions) == [0, 1]
    with pytest.raises(ObservationError, match="was dropped"):
        r.observe(0, {a[3]: [1.0]})
    r.observe(0, {a[0]: [1.0]})


def test_a_version_1_state_loads_with_nothing_in_flight():
    s = make()
    ids = s.select(0)
    s.observe(0, {t: [1.0, 0.0] for t in ids[:3]})  # the fourth had no scored rollout
    state = copy.deepcopy(s.state_dict())
    for key in ("open_steps", "open", "tools_used"):
        del state[key]
    state["version"] = 1
    r = make()
    r.load_state_dict(state)
    assert r.in_flight() == {} and r.selection_predictions == {} and r.observed_steps == {0}
    with pytest.raises(ObservationError, match=f"task {ids[3]!r} of step 0 was dropped"):
        r.observe(0, {ids[3]: [1.0]})
    assert r.select(1) == s.select(1)
