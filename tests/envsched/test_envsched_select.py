"""Eq. 5 greedy selection, caps, coverage priority, cold start, progress and identifier filters."""

import math

import numpy as np
import pytest
import scipy.sparse as sp

from envsched import EnvSchedConfig, EnvScheduler, TaskPool, build_static_graph
from envsched import select as select_mod
from envsched.filters import IdentifierFilter, ProgressFilter, dependent_edits, find_suspicious_actions
from envsched.graph import StaticGraph
from envsched.select import BatchBuilder, CapState, PenaltyBlock, cold_start_batch
from envsched.synthetic import synthetic_records


def hand_graph(rows, env):
    x = sp.csr_matrix(np.asarray(rows, dtype=np.float64))
    env = np.asarray(env)
    members = [np.flatnonzero(env == e) for e in range(env.max() + 1)]
    return StaticGraph(x_full=x, x_abs=x, env=env, env_members=members, descriptions=[], extractor_counts={})


def builder(g, cfg, window=None, blocked=None):
    n_env = len(g.env_members)
    caps = CapState(
        np.zeros(n_env, int) if window is None else np.asarray(window),
        np.zeros(g.n, bool) if blocked is None else np.asarray(blocked),
    )
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
    assert batch[:10] == [
        int(np.flatnonzero(pool.env == e)[np.argmax(g.mean_within_env_similarity()[pool.env == e])]) for e in range(10)
    ]


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


# ---- PenaltyBlock (the Eq. 5 penalty max_{j in B} S_full_ij) --------------------------------------------------


def dense_max_sim(x, members, rows, start):
    """max_{start_r <= j < m} x_r . x_(member j) by brute force (-inf for an empty range)."""
    S = x @ x.T
    return np.array([S[r, members[s:]].max() if s < len(members) else -np.inf for r, s in zip(rows, start)])


@pytest.fixture(params=["scipy_private", "public_api"])
def kernels(request, monkeypatch):
    """Run with scipy's private CSR kernels and with the public-API fallback used when they are missing."""
    if request.param == "public_api":
        monkeypatch.setattr(select_mod, "_csr_matvec", None)
        monkeypatch.setattr(select_mod, "_csr_matvecs", None)
    return request.param


def test_penalty_block_by_hand_start_and_member_order(kernels):
    # S = x x^T by hand: row 3 = (1, 1, 1) meets member 4 = (2, 0, 1) with 3 and member 1 = (0, 2, 0) with 2;
    # row 0 = (1, 0, 0): 2 with member 4, 0 with member 1; row 2 = (0, 0, 3): 3 with member 4, 0 with member 1
    x = np.array([[1, 0, 0], [0, 2, 0], [0, 0, 3], [1, 1, 1], [2, 0, 1]], dtype=float)
    g = hand_graph(x, [0, 0, 0, 0, 0])
    blk = PenaltyBlock(g.x_full, g.scratch_map(), 2)
    rows = np.array([0, 2, 3, 1])
    assert blk.max_sim(rows, np.zeros(4, np.int64)).tolist() == [-np.inf] * 4  # no member yet
    blk.add(4)
    assert blk.max_sim(rows, np.zeros(4, np.int64)).tolist() == [2.0, 3.0, 3.0, 0.0]
    blk.add(1)
    assert blk.max_sim(rows, np.zeros(4, np.int64)).tolist() == [2.0, 3.0, 3.0, 4.0]
    # start = 1: only the second member (node 1) counts; start = 2 = m: nothing left
    assert blk.max_sim(rows, np.ones(4, np.int64)).tolist() == [0.0, 0.0, 2.0, 4.0]
    assert blk.max_sim(rows, np.array([2, 0, 1, 2])).tolist() == [-np.inf, 3.0, 2.0, -np.inf]
    assert blk.max_sim(np.zeros(0, np.int64), np.zeros(0, np.int64)).shape == (0,)
    # one row at a time (row 0 has none of the features member 1 brought)
    assert blk.max_sim(np.array([0]), np.array([0])).tolist() == [2.0]
    assert blk.max_sim(np.array([0]), np.array([1])).tolist() == [0.0]
    # the scratch map holds member features only (node 4: cols 0 and 2, node 1: col 1), in order of arrival
    assert g.scratch_map().tolist() == [0, 2, 1] and blk.n_feat == 3 and blk.m == 2
    blk.close()
    assert g.scratch_map().tolist() == [-1, -1, -1] and blk.used == []


@pytest.mark.parametrize("capacity", [0, 1, 3])
def test_penalty_block_both_paths_negative_features_and_growth(kernels, capacity):
    """Signed features make every similarity of a row negative, so a stale zero (unused member column, a
    member before ``start``, an accumulator not reset) would win the max; 9 members from capacity <= 3 force
    the member and feature arrays to grow; starts from 0 to m cover the slot-major path (start < m - 4) and
    the member-by-member path (m - 4 <= start < m)."""
    rng = np.random.default_rng(capacity)
    n, d = 40, 30
    x = (rng.random((n, d)) + 0.5) * (rng.random((n, d)) < 0.3)
    x[:20] *= -1  # rows 0..19 negative, members (20..39) positive: every similarity of rows 0..19 is <= 0
    g = hand_graph(x, np.arange(n) % 4)
    members = rng.permutation(np.arange(20, n))[:9]
    blk = PenaltyBlock(g.x_full, g.scratch_map(), capacity)
    for k, j in enumerate(members):
        blk.add(int(j))
        rows = np.arange(n)
        start = np.arange(n) % (k + 2)  # 0..m: every start, several rows each
        got = blk.max_sim(rows, start)
        want = dense_max_sim(x, members[: k + 1], rows, start)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    assert blk.cap >= 9 and blk.by_member.shape[0] == blk.by_slot.shape[1] == blk.cap
    assert blk.n_feat == len(np.unique(x[members].nonzero()[1]))
    blk.close()
    assert (g.scratch_map() == -1).all()


def test_penalty_block_few_members_path_uses_only_members_from_start(kernels):
    # m = 5 members and start = 1: the member-by-member path (start >= m - 4) compares with members 1..4 only;
    # member 0 is the row's own copy (similarity 1), the others are orthogonal to it (0)
    x = np.eye(6)
    g = hand_graph(x, [0] * 6)
    blk = PenaltyBlock(g.x_full, g.scratch_map(), 8)
    for j in range(5):
        blk.add(j)
    rows = np.array([0, 0, 0, 3, 3, 5])
    assert blk.max_sim(rows, np.array([0, 1, 5, 3, 4, 0])).tolist() == [1.0, 0.0, -np.inf, 1.0, 0.0, 0.0]
    # every row on the slot-major path (start < m - 4), one row alone, one row with no member feature
    assert blk.max_sim(np.array([0, 3]), np.array([0, 0])).tolist() == [1.0, 1.0]
    assert blk.max_sim(np.array([2]), np.array([0])).tolist() == [1.0]
    assert blk.max_sim(np.array([5]), np.array([0])).tolist() == [0.0]
    blk.close()


# ---- BatchBuilder: exact lazy arg-max across chunks, cap relaxation order, progress-filter fallback ------------


def chunk_tie_graph(n_fill, a_first):
    """Member M = e0; 15 decoys equal to e0 (S = 1), A = 0.25 e0 + sqrt(15/16) e_A (S = 0.25), B = e_B (S = 0),
    fillers orthogonal to everything. Node order: [A or B], decoys, [B or A], fillers, M."""
    n = 17 + n_fill + 1
    x = np.zeros((n, n + 1))
    low, high = 0, 16
    a, b = (low, high) if a_first else (high, low)
    x[1:16, 0] = 1.0
    x[a, 0], x[a, 1 + a] = 0.25, math.sqrt(15 / 16)
    x[b, 1 + b] = 1.0
    for k in range(17, n):
        x[k, 1 + k] = 1.0
    x[n - 1] = 0.0
    x[n - 1, 0] = 1.0  # the member M
    score = np.full(n, 0.1)
    score[1:16], score[a], score[b] = 1.5, 1.25, 1.0
    return hand_graph(x, np.arange(n) % 3), score, a, b


@pytest.mark.parametrize("n_fill", [0, 13])
@pytest.mark.parametrize("a_first", [False, True])
def test_pick_tie_between_lazy_chunks_goes_to_lowest_index(n_fill, a_first):
    # Eq. 5 with lambda_sim = 1 after M joined the batch: decoys 1.5 - 1 = 0.5, A 1.25 - 0.25 = 1.0, B 1.0 - 0 = 1.0,
    # fillers 0.1. Upper bounds (cached penalty 0) are the scores, so the first chunk of 16 is the decoys and A;
    # B ties with A from the second chunk. 17 candidates (n_fill = 0) is one past the first chunk.
    g, score, a, b = chunk_tie_graph(n_fill, a_first)
    m = g.n - 1
    cfg = EnvSchedConfig(lambda_sim=1.0, cap_env_round=100, cap_env_window=100)
    bb = builder(g, cfg)
    bb.add(m, "exploitation")
    cands = np.arange(m)
    assert bb.pick(cands, score[cands]) == min(a, b)
    bb.close()


def test_pick_strict_winner_in_a_later_chunk():
    # as above with B's score 1.125 > A's value 1.0: B (second chunk) is the unique arg-max
    g, score, _, b = chunk_tie_graph(13, a_first=True)
    score[b] = 1.125
    bb = builder(g, EnvSchedConfig(lambda_sim=1.0, cap_env_round=100, cap_env_window=100))
    bb.add(g.n - 1, "exploitation")
    assert bb.pick(np.arange(g.n - 1), score[: g.n - 1]) == b
    # lambda_sim = 0: no penalty, the decoy with the lowest index (1) wins on score 1.5
    bb0 = builder(g, EnvSchedConfig(lambda_sim=0.0, cap_env_round=100, cap_env_window=100))
    bb0.add(g.n - 1, "exploitation")
    assert bb0.pick(np.arange(g.n - 1), score[: g.n - 1]) == 1


def test_cap_relaxation_order_ctask_then_c3_then_c1():
    g = hand_graph(np.eye(6), [0, 0, 0, 1, 1, 1])
    cfg = EnvSchedConfig(cap_env_round=2, cap_env_window=3)  # relax_caps_when_short defaults to True
    # C_task blocks every task, env 1 is at C3 (3 in the window): level 1 drops C_task only -> env 0
    b = builder(g, cfg, window=[0, 3], blocked=np.ones(6, bool))
    assert b.candidates().tolist() == [0, 1, 2] and b.relaxations == 1
    assert b.eligible(1).tolist() == [True] * 3 + [False] * 3
    # both envs at C3; env 0 also at C1 (2 in the batch): level 2 drops C_task and C3 but keeps C1 -> env 1
    b = builder(g, cfg, window=[3, 3])
    b.add(0, "exploitation")
    b.add(1, "exploitation")
    assert b.candidates().tolist() == [3, 4, 5] and b.relaxations == 1
    assert b.eligible(2).tolist() == [False, False, False, True, True, True]
    b.add(3, "exploitation")
    b.add(4, "exploitation")
    # every env at C1 as well: level 3 drops C1 -> what is left; relaxations add up (1 + 1)
    assert b.candidates().tolist() == [2, 5] and b.relaxations == 2
    assert b.eligible(2).tolist() == [False] * 6 and b.eligible(3).tolist() == [False, False, True, False, False, True]
    # an unconstrained call counts no relaxation
    fresh = builder(g, cfg)
    assert fresh.candidates().tolist() == list(range(6)) and fresh.relaxations == 0


def test_no_relaxation_when_disabled_gives_no_candidates():
    g = hand_graph(np.eye(6), [0, 0, 0, 1, 1, 1])
    cfg = EnvSchedConfig(cap_env_round=2, cap_env_window=3, relax_caps_when_short=False)
    for window, blocked in (([0, 0], np.ones(6, bool)), ([3, 3], None)):
        b = builder(g, cfg, window=window, blocked=blocked)
        c = b.candidates()
        assert len(c) == 0 and c.dtype.kind == "i" and b.relaxations == 0
        assert b.coverage_pick(np.ones(6), np.zeros(2), np.zeros(6)) is None
        assert b.exploitation_pick(np.ones(6), np.ones(6, bool)) == (None, False)


def test_exploitation_pick_progress_filter_and_fallback():
    g = hand_graph(np.eye(4), [0, 1, 2, 3])
    b = builder(g, EnvSchedConfig())
    score = np.array([0.9, 0.1, 0.5, 0.3])
    # the filter leaves node 1 only: it is taken although its score is the lowest
    assert b.exploitation_pick(score, np.array([False, True, False, False])) == (1, False)
    assert b.exploitation_pick(score, np.array([False, True, True, False])) == (2, False)
    # the filter removes everything: fall back to all candidates and say so
    assert b.exploitation_pick(score, np.zeros(4, bool)) == (0, True)
    for i in (0, 2, 3):
        b.add(i, "exploitation")
    # one candidate (node 1) left and filtered out: still taken, with the fallback flag
    node, used = b.exploitation_pick(score, np.zeros(4, bool))
    assert node == 1 and used is True
    # one candidate left for coverage as well
    assert b.coverage_pick(score, np.zeros(4), np.zeros(4)) == 1
    b.add(1, "exploitation")
    assert b.exploitation_pick(score, np.ones(4, bool)) == (None, False)
    assert b.exploitation_pick(score, np.zeros(4, bool)) == (None, False)
    assert b.coverage_pick(score, np.zeros(4), np.zeros(4)) is None


# ---- cold start (App. C), by hand --------------------------------------------------------------------------------


@pytest.mark.parametrize("w,third", [(0.25, 3), (0.75, 1)])
def test_cold_start_fill_weights_global_and_within_env_novelty(w, third):
    # env 0: node 0 = e0, node 1 = 0.6 e0 + 0.8 e1; env 1: node 2 = e2, node 3 = e0 (a copy of node 0, other env)
    # representatives (mean within-env S_full): env 0 ties 0.6/0.6 -> node 0; env 1 ties 0/0 -> node 2
    # fill: node 1: global max S_abs 0.6, env max S_full 0.6 -> novelty w*0.4 + (1-w)*0.4 = 0.4
    #       node 3: global 1 (node 0), env 0 (node 2)  -> novelty w*0 + (1-w)*1 = 1 - w (0.75 or 0.25)
    g = hand_graph([[1, 0, 0], [0.6, 0.8, 0], [0, 0, 1], [1, 0, 0]], [0, 0, 1, 1])
    cfg = EnvSchedConfig(cold_start_global_weight=w)
    assert cold_start_batch(g, cfg, 3, np.ones(4, bool)) == [0, 2, third]


def test_cold_start_more_environments_than_slots():
    # env 0: 0 = 1 = e0, 2 = e1 (mean within-env similarity 0.5, 0.5, 0 -> node 0); env 1: 3 = 4 = e2 (1.0 -> node 3);
    # env 2: 5 = 0.6 e2 + 0.8 e3; env 3: 6 = 0.3 e2 + sqrt(0.91) e4 (single members: 0)
    g = hand_graph(
        [
            [1, 0, 0, 0, 0],
            [1, 0, 0, 0, 0],
            [0, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 0.6, 0.8, 0],
            [0, 0, 0.3, 0, math.sqrt(0.91)],
        ],
        [0, 0, 0, 1, 1, 2, 3],
    )
    cfg = EnvSchedConfig()
    ones = np.ones(7, bool)
    # 4 representatives, 4 slots: all of them, in environment order
    assert cold_start_batch(g, cfg, 4, ones) == [0, 3, 5, 6]
    # fewer slots: the best representative (node 3, 1.0) first, then by global novelty 1 - max S_abs to the batch:
    # node 0: 1 - 0 = 1, node 5: 1 - 0.6 = 0.4, node 6: 1 - 0.3 = 0.7
    assert cold_start_batch(g, cfg, 1, ones) == [3]
    assert cold_start_batch(g, cfg, 2, ones) == [3, 0]
    assert cold_start_batch(g, cfg, 3, ones) == [3, 0, 6]


def test_cold_start_cap_fallback_availability_and_short_pool():
    # orthogonal tasks: every novelty is 1, ties go to the lowest index; env 0 = nodes 0..3, env 1 = node 4
    g = hand_graph(np.eye(5), [0, 0, 0, 0, 1])
    cfg = EnvSchedConfig(cold_start_env_cap=2)
    ones = np.ones(5, bool)
    # representatives 0 and 4, node 1 fills env 0 to its cap; then only env 0 is left: the cap is dropped
    assert cold_start_batch(g, cfg, 5, ones) == [0, 4, 1, 2, 3]
    assert cold_start_batch(g, cfg, 3, ones) == [0, 4, 1]
    # more slots than tasks: stops when the pool is used up; unavailable tasks are never chosen
    assert cold_start_batch(g, cfg, 8, ones) == [0, 4, 1, 2, 3]
    avail = np.array([False, True, False, True, True])
    assert cold_start_batch(g, cfg, 5, avail) == [1, 4, 3]
    assert cold_start_batch(g, EnvSchedConfig(cold_start_env_cap=3), 4, ones) == [0, 4, 1, 2]
