"""Eq. 5 greedy selection, caps, coverage priority, cold start, progress and identifier filters."""

import math

import numpy as np
import pytest
import scipy.sparse as sp

from envsched import EnvSchedConfig, EnvScheduler, TaskPool, build_static_graph
from envsched.filters import IdentifierFilter, ProgressFilter, dependent_edits, find_suspicious_actions
from envsched.graph import StaticGraph
from envsched.select import BatchBuilder, CapState, cold_start_batch
from envsched.synthetic import synthetic_records


def hand_graph(rows, env):
    x = sp.csr_matrix(np.asarray(rows, dtype=np.float64))
    env = np.asarray(env)
    members = [np.flatnonzero(env == e) for e in range(env.max() + 1)]
    return StaticGraph(x_full=x, x_abs=x, env=env, env_members=members, descriptions=[], extractor_counts={})


def builder(g, cfg, window=None, blocked=None):
    n_env = len(g.env_members)
    caps = CapState(np.zeros(n_env, int) if window is None else np.asarray(window), np.zeros(g.n, bool) if blocked is None else np.asarray(blocked))
    return BatchBuilder(g, cfg, caps, np.ones(g.n, bool))


def test_eq5_similarity_penalty_by_hand():
    r = 1 / math.sqrt(2)
    g = hand_graph([[1, 0], [1, 0], [0, 1], [r, r]], [0, 1, 2, 3])
    b = builder(g, EnvSchedConfig(lambda_sim=0.08))
    score = np.array([0.9, 0.85, 0.8, 0.84])
    cands = np.arange(4)
    assert b.pick(cands, score) == 0  # empty batch: no penalty
    b.add(0, "exploitation")
    # node1: 0.85 - 0.08*1 = 0.77 ; node2: 0.80 - 0 = 0.80 ; node3: 0.84 - 0.08*0.7071 = 0.7834
    assert b.pick(np.array([1, 2, 3]), score[[1, 2, 3]]) == 2
    b.add(2, "exploitation")
    # node1: 0.77 ; node3: 0.84 - 0.08*max(0.7071, 0.7071) = 0.7834
    assert b.pick(np.array([1, 3]), score[[1, 3]]) == 3
    assert b.pen[3] == pytest.approx(r)


def test_lazy_greedy_equals_brute_force():
    rng = np.random.default_rng(0)
    x = rng.random((300, 20)) * (rng.random((300, 20)) < 0.3)
    x /= np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    g = hand_graph(x, np.arange(300) % 30)
    cfg = EnvSchedConfig(lambda_sim=0.5, cap_env_round=100, cap_env_window=100)
    b = builder(g, cfg)
    score = rng.random(300)
    S = x @ x.T
    chosen = []
    for _ in range(40):
        c = np.flatnonzero(~b.in_batch)
        i = b.pick(c, score[c])
        pen = S[c][:, chosen].max(axis=1) if chosen else np.zeros(len(c))
        assert score[i] - 0.5 * (S[i, chosen].max() if chosen else 0) == pytest.approx((score[c] - 0.5 * pen).max())
        b.add(i, "exploitation")
        chosen.append(i)


def test_caps_c1_c3_ctask():
    g = hand_graph(np.eye(12), [0] * 8 + [1] * 4)
    cfg = EnvSchedConfig(cap_env_round=3, cap_env_window=5, relax_caps_when_short=False)
    # C1: env 0 has the 8 best scores, but at most 3 may enter
    b = builder(g, cfg)
    score = np.r_[np.linspace(1, 0.9, 8), np.linspace(0.5, 0.4, 4)]
    for _ in range(6):
        c = b.candidates()
        b.add(b.pick(c, score[c]), "exploitation")
    assert np.bincount(g.env[b.selected]).tolist() == [3, 3]
    # C3: env 0 already has 4 selections in the window -> only 1 more this step
    b = builder(g, cfg, window=[4, 0])
    assert b.eligible()[:8].all()
    b.add(0, "exploitation")
    assert not b.eligible()[:8].any() and b.eligible()[8:].all()
    # C_task: blocked tasks are not eligible
    blocked = np.zeros(12, bool)
    blocked[[1, 9]] = True
    b = builder(g, cfg, blocked=blocked)
    assert not b.eligible()[[1, 9]].any() and b.eligible().sum() == 10


def test_ctask_window_from_history():
    pool = TaskPool.from_records(synthetic_records(3, 4))
    s = EnvScheduler(pool, EnvSchedConfig(batch_size=4))
    s.selections = {3: np.array([0, 1, 2]), 4: np.array([1, 2, 5])}
    caps = s._cap_state(5)
    assert np.flatnonzero(caps.blocked_tasks).tolist() == [1, 2]  # selected in both previous steps
    assert caps.window_env_count.tolist() == [5, 1, 0]  # steps 3 and 4 (window of three incl. current)


def test_coverage_lexicographic_priority():
    g = hand_graph(np.eye(6), [0, 0, 1, 1, 2, 2])
    b = builder(g, EnvSchedConfig())
    q = np.array([0.9, 0.8, 0.7, 0.95, 0.1, 0.2])
    env_exposure = np.array([5, 1, 1])
    obs = np.array([0, 0, 2, 1, 0, 0])
    # all envs uncovered in this batch; least exposed: envs 1, 2; least observed among them: tasks 4, 5 -> higher q
    assert b.coverage_pick(q, env_exposure, obs) == 5
    b.add(5, "coverage")
    # env 2 now covered -> env 1 (exposure 1) beats env 0 (5); task 3 has fewer observations than 2
    assert b.coverage_pick(q, env_exposure, obs) == 3


def test_cold_start_representatives_and_env_cap():
    pool = TaskPool.from_records(synthetic_records(10, 5, seed=2))
    cfg = EnvSchedConfig(batch_size=15)
    g = build_static_graph(pool, cfg)
    batch = cold_start_batch(g, cfg, 15, np.ones(len(pool), bool))
    assert len(set(batch)) == 15
    counts = np.bincount(pool.env[batch], minlength=10)
    assert counts.min() >= 1 and counts.max() <= 2
    dense = (g.x_full @ g.x_full.T).toarray()
    for e in range(10):
        m = np.flatnonzero(pool.env == e)
        mean_sim = (dense[np.ix_(m, m)].sum(axis=1) - dense[m, m]) / (len(m) - 1)
        assert m[np.argmax(mean_sim)] in batch  # representative: highest mean within-env similarity
    assert batch[:10] == [int(np.flatnonzero(pool.env == e)[np.argmax(g.mean_within_env_similarity()[pool.env == e])]) for e in range(10)]


def test_progress_filter_blocks_falling_tasks_only():
    env = np.zeros(6, dtype=np.int64)
    pf = ProgressFilter(EnvSchedConfig(progress_min_fit_transitions=6), env, 1)
    rising = [0.1, 0.3, 0.5, 0.7, 0.9]
    falling = [0.9, 0.7, 0.5, 0.3, 0.1]
    scored = []
    for step in range(5):
        m = np.array([rising[step]] * 3 + [falling[step]] * 3)
        scored.append(pf.observe(step, np.arange(6), m, np.full(6, 0.05)))
    # step 1: transitions exist but none ended earlier; step 2 scores with the 6 transitions of step 1
    assert scored == [0, 0, 6, 6, 6]
    arr = pf.arrays()
    assert np.isnan(arr["residual"][arr["step_next"] == 1]).all()
    blocked = pf.blocked([])
    assert blocked.tolist() == [False] * 3 + [True] * 3


def test_identifier_filter_replay_protocol():
    task = TaskPool.from_records([{"task_id": "t", "env_id": "bank", "instruction": "Freeze card 4411 of Ana Ruiz"}])[0]
    actions = [
        {"name": "get_card", "arguments": {"card_id": "4411"}, "output": {"owner": "Ana Ruiz"}},
        {"name": "update_card", "arguments": {"card_id": "CARD-9999", "status": "frozen"}},
        {"name": "update_limits", "arguments": {"card_id": "CARD-9999", "limit": 0}},
        {"name": "update_card", "arguments": {"card_id": "4411", "status": "frozen"}},
    ]
    assert find_suspicious_actions(task, actions) == [1, 2]
    assert dependent_edits(actions, [1]) == {1, 2}
    calls = []

    def replay(tid, acts):
        calls.append(len(acts))
        return 1.0 if any(a["arguments"].get("card_id") == "CARD-9999" for a in acts) else 0.25

    filt = IdentifierFilter(EnvSchedConfig(), replay)
    res = filt.check(task, 1.0, actions)
    assert res.outcome == "filtered" and res.removed == (1, 2) and calls == [4, 2]
    assert filt.check(task, 0.5, actions).outcome == "replay_mismatch"  # stored reward disagrees with replay
    keep = IdentifierFilter(EnvSchedConfig(), lambda tid, acts: 1.0).check(task, 1.0, actions)
    assert keep.outcome == "kept"  # removal does not lower the reward
    assert IdentifierFilter(EnvSchedConfig(), replay).check(task, 1.0, [actions[0], actions[3]]).outcome == "clean"


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
