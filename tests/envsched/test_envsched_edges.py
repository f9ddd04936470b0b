"""Boundaries of the scheduling rules (EnvSched §2.4, App. C): the C3 rolling window at its first and last
step, the exposure factor omega deciding between tasks of equal q (and the product q * omega against a larger q),
and a resume after the identifier filter removed a task."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from envsched import EnvSchedConfig, EnvScheduler, TaskPool
from envsched.graph import StaticGraph
from envsched.select import BatchBuilder
from envsched.synthetic import synthetic_records


def eye_graph(pool: TaskPool) -> StaticGraph:
    """Orthogonal tasks: S_full = S_abs = 0 between distinct tasks, so Eq. 5's similarity penalty is 0."""
    x = sp.csr_matrix(np.eye(len(pool)))
    members = [np.flatnonzero(pool.env == e) for e in range(pool.n_envs)]
    return StaticGraph(x_full=x, x_abs=x, env=pool.env, env_members=members, descriptions=[], extractor_counts={})


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


def test_rank_correlation_needs_three_pairs_by_default():
    from envsched.estimate import rank_correlation

    assert rank_correlation([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)
    assert rank_correlation([1, 2], [1, 2]) is None
    assert rank_correlation([1, 2, 3], [1, 2, 3], min_count=4) is None
    assert rank_correlation([1, 1, 1], [1, 2, 3]) is None  # constant side
