"""The optimised step paths equal straightforward reference computations (random inputs)."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from envsched import EnvSchedConfig, TaskPool
from envsched.graph import StaticGraph, build_static_graph
from envsched.neighbors import NeighborIndex, merge_topk
from envsched.select import BatchBuilder, CapState, PenaltyBlock
from envsched.synthetic import synthetic_records


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
    # no row cache here (cache_bytes=0): every max_sim reads x (the cache: test_envsched_fastpaths3.py)
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


def test_cross_merge_only_changed_rows_equals_full_merge():
    pool = TaskPool.from_records(synthetic_records(12, 10, seed=3))
    g = build_static_graph(pool, EnvSchedConfig())
    rng = np.random.default_rng(0)
    order = rng.permutation(g.n)
    nb = NeighborIndex(g, 3, 5)
    idx = np.full((g.n, 5), -1)
    sim = np.full((g.n, 5), -np.inf)
    for chunk in np.array_split(order[:90], 6):
        nb.add_observed(chunk)
        s = g.sim_abs(None, chunk)  # reference: merge every row with every candidate
        s[g.env[:, None] == g.env[chunk][None, :]] = -np.inf
        rows = np.flatnonzero((s > 0).any(axis=1))
        idx[rows], sim[rows] = merge_topk(idx[rows], sim[rows], np.broadcast_to(chunk, (len(rows), len(chunk))), s[rows], 5, 0.0)
        assert np.array_equal(nb.idx["cross"], idx)
        assert np.array_equal(nb.sim["cross"], sim)
