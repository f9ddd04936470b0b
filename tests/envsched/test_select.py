"""Batch selection (``envsched/select.py``): Eq. 5 greedy selection and its similarity penalty, the caps C1-C4
and their relaxation order, coverage priority, cold start; the penalty block, the lazy and pruned candidate scans, the
row cache and the scan order against brute-force references (random inputs, ties, memory-mapped rows)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.sparse as sp

from envsched import EnvSchedConfig, EnvScheduler, TaskPool, build_static_graph
from envsched import select as select_mod
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


# -- the optimised paths equal brute-force references (random inputs, ties, memory-mapped rows) -----------------------

def _graph(x, env):
    x = sp.csr_matrix(np.asarray(x, dtype=np.float64))
    env = np.asarray(env)
    members = [np.flatnonzero(env == e) for e in range(env.max() + 1)]
    return StaticGraph(x_full=x, x_abs=x, env=env, env_members=members, descriptions=[], extractor_counts={})


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_penalty_block_matches_dense(seed):
    rng = np.random.default_rng(seed)
    x = rng.random((80, 40)) * (rng.random((80, 40)) < 0.2)
    g = _graph(x, np.arange(80) % 8)
    blk = PenaltyBlock(g.x_full, g.scratch_map(), 4)  # capacity grows past 4
    members = rng.choice(80, 12, replace=False)
    for j in members:
        blk.add(int(j))
    S = x @ x.T
    rows = rng.choice(80, 30, replace=False)
    start = rng.integers(0, 13, size=30)
    got = blk.max_sim(rows, start)
    for r, s0, v in zip(rows, start, got):
        want = S[r, members[s0:]].max() if s0 < 12 else -np.inf
        assert v == pytest.approx(want, abs=1e-12)
    blk.close()
    assert (g.scratch_map() == -1).all()


def test_penalty_rows_in_blocks_equal_one_pass_and_release_mapped_pages(monkeypatch):
    """max_sim cut into row blocks gives the one-pass values bit for bit, and releases a memory-mapped x_full's
    pages once per _RELEASE_ROWS rows read (so a scan over a million rows does not keep them resident)."""
    from envsched import select

    rng = np.random.default_rng(3)
    x = rng.random((200, 60)) * (rng.random((200, 60)) < 0.15)
    g = _graph(x, np.arange(200) % 5)
    released = []
    # no row cache here (cache_bytes=0): every max_sim reads x (the cache: test_select.py's test_penalty_rows_from_the_row_cache_equal_rows_from_x)
    blk = PenaltyBlock(g.x_full, g.scratch_map(), 8, release=lambda: released.append(blk.rows_read), cache_bytes=0)
    for j in rng.choice(200, 10, replace=False):
        blk.add(int(j))
    rows, start = rng.permutation(200), rng.integers(0, 11, size=200)
    whole = blk.max_sim(rows, start)
    assert released == []
    monkeypatch.setattr(select, "_ROW_BLOCK", 7)
    monkeypatch.setattr(select, "_RELEASE_ROWS", 50)
    assert np.array_equal(blk.max_sim(rows, start), whole)
    assert len(released) == 4 and min(released) >= 50  # 400 rows read (200 + 200), one release per 50+ of them
    blk.close()


@pytest.mark.parametrize("seed", [0, 1])
def test_lazy_pick_is_exact_argmax_lowest_index_on_ties(seed):
    rng = np.random.default_rng(seed)
    base = rng.random((40, 15)) * (rng.random((40, 15)) < 0.4)
    x = np.vstack([base, base, base])  # duplicates -> exact ties in the penalty
    x /= np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    n = len(x)
    g = _graph(x, np.arange(n) % 10)
    cfg = EnvSchedConfig(lambda_sim=0.3, cap_env_round=1000, cap_env_window=1000)
    b = BatchBuilder(g, cfg, CapState(np.zeros(10, int), np.zeros(n, bool)), np.ones(n, bool))
    score = np.round(rng.random(n), 1)  # many exact score ties
    score = np.tile(score[:40], 3)
    S = x @ x.T
    chosen: list[int] = []
    for _ in range(30):
        c = np.flatnonzero(~b.in_batch)
        i = b.pick(c, score[c])
        pen = np.maximum(S[c][:, chosen].max(axis=1), 0.0) if chosen else np.zeros(len(c))
        val = score[c] - 0.3 * pen
        best = val.max()
        assert score[i] - 0.3 * (max(S[i, chosen].max(), 0.0) if chosen else 0.0) == pytest.approx(best, abs=1e-12)
        b._refresh(c)  # every candidate's penalty, as the builder computes it: i is the lowest-index arg-max
        own = score[c] - 0.3 * b.pen[c] if chosen else score[c]
        assert i == c[own == own.max()].min()
        b.add(i, "exploitation")
        chosen.append(i)
    b.close()


def _penalty_graph(seed, n=300, f=80):
    import scipy.sparse as sp

    from envsched.graph import StaticGraph

    rng = np.random.default_rng(seed)
    x = sp.csr_matrix(rng.random((n, f)) * (rng.random((n, f)) < 0.2))
    env = np.arange(n) % 6
    return StaticGraph(x_full=x, x_abs=x, env=env, env_members=[np.flatnonzero(env == e) for e in range(6)], descriptions=[], extractor_counts={}), rng


@pytest.mark.parametrize("seed", range(3))
def test_penalty_rows_from_the_row_cache_equal_rows_from_x(seed, monkeypatch, tmp_path):
    """Eq. 5 penalties of rows re-read from the row cache (one per block, one shared by consecutive blocks, one
    too small that empties itself), read by csr_row_index or by the numpy gather: the same floats as a block
    without cache, and rows read from x_full's files by pread; only rows read from x count towards the page release."""
    from envsched import select
    from envsched.select import PenaltyBlock, RowCache
    from envsched.tfidf import DiskCSR, DiskCSRWriter

    g, rng = _penalty_graph(seed)
    n = g.n
    entry = g.x_full.indices.itemsize + g.x_full.data.itemsize
    shared, small = RowCache(g.x_full, entry * g.x_full.nnz), RowCache(g.x_full, entry * g.x_full.nnz // 3)
    kept = PenaltyBlock(g.x_full, np.full(80, -1), 4, row_cache=shared)  # closed after a batch and used again
    w = DiskCSRWriter(tmp_path, "x_full", *g.x_full.shape, g.x_full.nnz, g.x_full.dtype)  # x_full's files, as cached
    w.append(g.x_full)
    w.finish()
    disk = DiskCSR(tmp_path, "x_full")
    by_pread = RowCache(g.x_full, entry * g.x_full.nnz // 3, reader=disk.read_rows)  # small: it empties itself
    for batch in range(2):  # the shared caches carry rows from one batch's block to the next
        blocks = {"none": PenaltyBlock(g.x_full, np.full(80, -1), 4, cache_bytes=0),
                  "own": PenaltyBlock(g.x_full, np.full(80, -1), 4),
                  "shared": PenaltyBlock(g.x_full, np.full(80, -1), 4, row_cache=shared),
                  "small": PenaltyBlock(g.x_full, np.full(80, -1), 4, row_cache=small), "kept": kept,
                  "pread": PenaltyBlock(g.x_full, np.full(80, -1), 4, row_cache=by_pread),
                  "pread_uncached": PenaltyBlock(g.x_full, np.full(80, -1), 4, row_cache=RowCache(g.x_full, 0, reader=disk.read_rows))}
        members = []
        for _ in range(6):  # members arrive between refreshes, rows are read again
            j = int(rng.integers(n))
            members.append(j)
            for b in blocks.values():
                b.add(j)
            rows = rng.choice(n, 90, replace=False)
            start = rng.integers(0, blocks["none"].m + 1, size=90)
            want = blocks["none"].max_sim(rows, start)
            for name in ("own", "shared", "small", "kept", "pread", "pread_uncached"):
                before = blocks[name].rows_read
                cached = (blocks[name].cached(rows) >= 0).sum()
                assert np.array_equal(blocks[name].max_sim(rows, start), want), (batch, name)
                # rows read from x's mapping count towards its release; rows read by pread map nothing
                assert blocks[name].rows_read - before == (0 if name.startswith("pread") else len(rows) - cached)
        assert blocks["none"].row_cache.rows == 0 and 0 < small.used <= small.capacity < shared.used
        cached = shared.lookup(np.arange(n))
        assert (cached >= 0).sum() == shared.rows and np.array_equal(np.sort(cached[cached >= 0]), np.arange(shared.rows))
        full = blocks["none"].max_sim(np.arange(n), np.zeros(n, dtype=np.int64))
        for b in blocks.values():
            b.close()
        # a closed block holds nothing: every entry its members wrote is zero again, the scratch map all -1
        assert kept.m == kept.n_feat == 0 and not kept.by_member.any() and not kept.by_slot.any()
        assert not kept.slot_of.any() and (kept.fmap == -1).all()
    small.clear()
    assert small.rows == 0 and (small.lookup(np.arange(n)) == -1).all()
    # the numpy gather (scipy's private kernel missing) gives the same floats
    monkeypatch.setattr(select, "_csr_row_index", None)
    plain = PenaltyBlock(g.x_full, np.full(80, -1), 4)
    for j in members:
        plain.add(j)
    rows, start = np.arange(n), np.zeros(n, dtype=np.int64)
    assert np.array_equal(plain.max_sim(rows, start), full)


@pytest.mark.parametrize("seed", range(3))
def test_a_block_refresh_gives_the_same_floats_multiplying_all_columns_or_the_needed_ones(seed, monkeypatch):
    """Eq. 5 penalties of rows that have not seen several members: the refresh multiplies either the members'
    columns copied contiguous or all the block's columns as they lie, whichever costs less; each column's sums are
    the same products in the same order, so both give the same floats (and the exact dense products, closely)."""
    from envsched import select
    from envsched.select import PenaltyBlock

    g, rng = _penalty_graph(seed)
    n = g.n
    members = rng.choice(n, 7, replace=False)
    rows, start = np.arange(n), rng.integers(0, 3, size=n)  # every row misses more than _FEW_MEMBERS members
    got = {}
    for always in (True, False):
        monkeypatch.setattr(select, "_all_columns", lambda *a, always=always: always)
        blk = PenaltyBlock(g.x_full, np.full(80, -1), 4, cache_bytes=0)  # capacity grows past 4
        for j in members:
            blk.add(int(j))
        got[always] = blk.max_sim(rows, start)
    assert np.array_equal(got[True], got[False])
    dense = (g.x_full @ g.x_full[members].T).toarray()
    dense[np.arange(len(members))[None, :] < start[:, None]] = -np.inf
    np.testing.assert_allclose(got[True], dense.max(axis=1), rtol=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_descending_order_equals_stable_argsort(seed):
    from envsched.select import descending_order

    rng = np.random.default_rng(seed)
    for n in (0, 1, 2, 5, 1000, 1024, 5000, 70_000):  # from 1,024 nodes: the rank route where values repeat
        for x in (rng.random(n), np.round(rng.random(n), 1 + seed % 2), np.where(rng.random(n) < 0.5, 0.0, -0.0),
                  np.where(rng.random(n) < 0.3, np.inf, np.round(rng.random(n), 1)), np.full(n, 0.25),
                  np.where(rng.random(n) < 0.6, -np.inf, rng.random(n)), np.round(rng.normal(size=n), 3)):
            assert np.array_equal(descending_order(x), np.argsort(-x, kind="stable"))
    x = np.array([0.3, np.nan, 0.3, 0.1])
    assert np.array_equal(descending_order(x), np.argsort(-x, kind="stable"))


def test_descending_order_ranks_repeated_values_and_falls_back_past_16_bits(monkeypatch):
    """The rank route is taken where a sample repeats (a pool's scores) and handed back to the float sort when the
    whole array has more distinct values than 16-bit ranks hold; both give the stable argsort's permutation."""
    from envsched import select

    calls = []
    factorize = select.pd.factorize
    monkeypatch.setattr(select.pd, "factorize", lambda v: calls.append(len(v)) or factorize(v))
    rng = np.random.default_rng(7)
    tied = np.round(rng.random(200_000), 2)
    assert np.array_equal(select.descending_order(tied), np.argsort(-tied, kind="stable")) and calls == [200_000]
    # 70 % one value (the sample repeats), the rest ~90,000 distinct values: over 16-bit ranks, the float sort
    wide = np.where(rng.random(300_000) < 0.7, 0.5, rng.random(300_000))
    assert np.array_equal(select.descending_order(wide), np.argsort(-wide, kind="stable")) and len(calls) == 2
    distinct = rng.random(200_000)  # the sample does not repeat: no hashing
    assert np.array_equal(select.descending_order(distinct), np.argsort(-distinct, kind="stable")) and len(calls) == 2


def test_row_cache_size():
    from envsched import select
    from envsched.select import RowCache

    g, _ = _penalty_graph(0)
    entry = g.x_full.indices.itemsize + g.x_full.data.itemsize
    assert RowCache(g.x_full).capacity == g.x_full.nnz // select._ROW_CACHE_SHARE  # an eighth of x_full ...
    assert RowCache(g.x_full, 10 * entry).capacity == 10
    big = type("X", (), {"nnz": 10**9, "indices": g.x_full.indices, "data": g.x_full.data, "shape": (10**6, 10)})()
    assert RowCache(big).capacity == select._ROW_CACHE_BYTES // entry  # ... and at most _ROW_CACHE_BYTES


@pytest.fixture(scope="module")
def pool():
    return TaskPool.from_records(synthetic_records(6, 40, seed=3))


def _tie_cut(c, a, max_tied):
    """The candidates ``c`` with each value that more than ``max_tied`` of all nodes share in ``a`` (a long tie) cut
    to the ``max_tied`` of its candidates first in spread_key order (None: ``c``)."""
    from envsched.select import spread_key

    if max_tied is None:
        return c
    kept = []
    for v in np.unique(a[c]):
        cv = c[a[c] == v]
        if (a == v).sum() > max_tied:
            cv = cv[np.argsort(spread_key(cv))][:max_tied]
        kept.append(cv)
    return np.sort(np.concatenate(kept))


def _reference_batch(b, q, score, env_exposure, obs_count, progress_ok, n_cov, batch, max_tied=None):
    """The batch the unpruned selection builds: every pick over ``candidates()`` (all N nodes), each long tie cut
    to its first ``max_tied`` candidates in spread_key order (None: no cut)."""
    for _ in range(n_cov):
        c = b.candidates()
        if not len(c):
            break
        for key_of in (lambda c: b.batch_env_count[b.env[c]], lambda c: env_exposure[b.env[c]], lambda c: obs_count[c]):
            key = key_of(c)
            c = c[key == key.min()]
        c = _tie_cut(c, q, max_tied)
        b.add(b.pick(c, q[c]), "coverage")
    while len(b.selected) < batch:
        c = b.candidates(progress_ok)
        if not len(c):
            c = b.candidates()
        if not len(c):
            break
        c = _tie_cut(c, score, max_tied)
        b.add(b.pick(c, score[c]), "exploitation")
    return b.selected, b.relaxations


def _pruned_and_reference(pool, seed, max_tied, decimals):
    """The batch coverage_pick + exploitation_pick build and the one ``_reference_batch`` builds, on random
    predictions rounded to ``decimals`` (ties), caps, masks and ``eq5_max_tied=max_tied``."""
    from envsched.select import BatchBuilder, CapState, scan_order

    graph = build_static_graph(pool, EnvSchedConfig())
    rng = np.random.default_rng(seed)
    n, n_env = graph.n, len(graph.env_members)
    cfg = EnvSchedConfig(cap_env_round=[4, 1, 2, 4, 3, 1][seed], cap_env_window=[11, 2, 5, 11, 6, 3][seed],
                         lambda_sim=[0.08, 0.08, 0.5, 0.0, 0.3, 0.08][seed], eq5_max_tied=max_tied)
    q = np.round(rng.random(n), decimals)
    score = q * (1.0 + rng.integers(0, 3, n) / 16.0) ** -0.5
    env_exposure = rng.integers(0, 3, n_env).astype(float)
    obs_count = rng.integers(0, 2, n)
    progress_ok = rng.random(n) < [1.0, 0.5, 0.05, 0.9, 0.0, 0.7][seed]
    caps = CapState(rng.integers(0, 4, n_env), rng.random(n) < 0.2)
    available = rng.random(n) < 0.95
    batch = [64, 30, 40, 64, 64, 50][seed]
    ref = BatchBuilder(graph, cfg, caps, available.copy())
    want = _reference_batch(ref, q, score, env_exposure, obs_count, progress_ok, batch // 2, batch, max_tied)
    ref.close()
    new = BatchBuilder(graph, cfg, caps, available.copy())
    order = scan_order(score, cfg.eq5_max_tied)
    for _ in range(batch // 2):
        i = new.coverage_pick(q, env_exposure, obs_count)
        if i is None:
            break
        new.add(i, "coverage")
    while len(new.selected) < batch:
        i, _ = new.exploitation_pick(score, progress_ok, order)
        if i is None:
            break
        new.add(i, "exploitation")
    new.close()
    return (new.selected, new.relaxations), want


@pytest.mark.parametrize("row_block", [None, 5], ids=["default_blocks", "blocks_of_5"])
@pytest.mark.parametrize("seed", range(6))
def test_pruned_picks_equal_the_full_scan(pool, seed, row_block, monkeypatch):
    """coverage_pick (per-environment keys) and exploitation_pick (scan by descending score, stop when no
    later score can reach the best value) choose the nodes the unpruned Eq. 5 arg-max over all candidates
    chooses, with ties, C_task / C3 / progress masks and cap relaxation (tiny caps); also when the lazy chunks
    and the penalty computation are cut into blocks of 5 rows (the 8,192 of a large pool, scaled down).
    The default eq5_max_tied exceeds the pool: every tie is compared whole."""
    from envsched import select

    if row_block is not None:
        monkeypatch.setattr(select, "_ROW_BLOCK", row_block)
    got, want = _pruned_and_reference(pool, seed, EnvSchedConfig().eq5_max_tied, 2)
    assert got == want


@pytest.mark.parametrize("chunk", [None, 1])
@pytest.mark.parametrize("max_tied", [1, 4, 9])
@pytest.mark.parametrize("seed", range(6))
def test_long_ties_compare_their_first_max_tied_candidates(pool, seed, max_tied, chunk, monkeypatch):
    """With ties longer than eq5_max_tied (240 nodes, predictions rounded to one decimal: ~24 a value), each pick
    is the Eq. 5 arg-max over the candidates with every long tie cut to its max_tied first in spread_key order,
    whatever the caps, masks and phase; the shorter ties stay whole.  ``chunk`` 1: a tie's sample is read in
    blocks of at least 16 nodes instead of 256, so it takes several blocks where the caps exclude many."""
    from envsched import select

    if chunk is not None:
        monkeypatch.setattr(select, "_CHUNK", chunk)
    got, want = _pruned_and_reference(pool, seed, max_tied, 1)
    assert got == want


def test_scan_order_equals_sorting_each_long_tie_by_spread_key():
    """The O(N) filter of the pool's spread order gives each long run the order a sort by spread_key gives it."""
    from envsched.select import descending_order, scan_order, spread_key

    rng = np.random.default_rng(5)
    for n, levels, max_tied in ((2_000, 3, 50), (5_000, 40, 100), (777, 1, 10), (300, 300, 2)):
        x = rng.integers(0, levels, n) / 7.0
        want = descending_order(x)
        xs = x[want]
        starts = np.flatnonzero(np.r_[True, xs[1:] != xs[:-1]])
        for a, b in zip(starts, np.r_[starts[1:], n]):
            if b - a > max_tied:
                want[a:b] = want[a:b][np.argsort(spread_key(want[a:b]))]
        assert np.array_equal(scan_order(x, max_tied).nodes, want), (n, levels, max_tied)


def test_scan_order_spreads_only_the_long_ties():
    from envsched.select import descending_order, scan_order, spread_key

    x = np.array([0.5] * 7 + [0.9, 0.2, 0.2, 0.9, 0.9] + [0.1] * 12)
    assert np.array_equal(scan_order(x, None).nodes, descending_order(x)) and scan_order(x, None).long_runs == ()
    assert np.array_equal(scan_order(x, len(x)).nodes, descending_order(x)) and scan_order(x, len(x)).long_runs == ()
    o = scan_order(x, 6)
    assert o.long_runs == ((3, 10), (12, 24)) and o.max_tied == 6
    assert list(o.nodes[:3]) == [7, 10, 11] and list(o.nodes[10:12]) == [8, 9]  # short ties: by index
    for a, b in o.long_runs:
        run = o.nodes[a:b]
        assert len(set(x[run])) == 1 and list(spread_key(run)) == sorted(spread_key(run))
        assert sorted(run) == sorted(np.flatnonzero(x == x[run[0]]))
    assert list(o.nodes[12:24]) != list(range(12, 24))  # spread, not index order
    keys = spread_key(np.arange(1 << 16))
    assert len(np.unique(keys)) == 1 << 16  # a bijection: no two nodes share a key
