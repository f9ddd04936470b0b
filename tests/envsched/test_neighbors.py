"""Neighbour search (``envsched/neighbors.py``): the index against brute force, ``merge_topk``'s total order,
incremental cross-environment merges and updates equal to the full merge, classes of nodes with identical N^cross
rows, and within-environment columns equal to the whole block's."""

from __future__ import annotations

import numpy as np
import pytest

from envsched import EnvSchedConfig, TaskPool, build_static_graph
from envsched.neighbors import NeighborIndex, merge_topk
from envsched.synthetic import synthetic_records


def test_neighbor_index_matches_brute_force(small):
    pool, _, g = small
    n = len(pool)
    full = (g.x_full @ g.x_full.T).toarray()
    ab = (g.x_abs @ g.x_abs.T).toarray()
    nb = NeighborIndex(g, 3, 4)
    rng = np.random.default_rng(0)
    observed = rng.choice(n, 20, replace=False)
    nb.add_observed(observed[:7])
    nb.add_observed(observed[7:])  # incremental == one-shot
    env = pool.env
    for i in range(n):
        same = [j for j in observed if env[j] == env[i] and j != i and full[i, j] > 0]
        other = [j for j in observed if env[j] != env[i] and ab[i, j] > 0]
        want_in = sorted(same, key=lambda j: (-full[i, j], j))[:3]
        want_x = sorted(other, key=lambda j: (-ab[i, j], j))[:4]
        got_in = [j for j in nb.idx["in"][i] if j >= 0]
        got_x = [j for j in nb.idx["cross"][i] if j >= 0]
        assert sorted(got_in) == sorted(want_in), i
        assert sorted(got_x) == sorted(want_x), i
        assert nb.sim["in"][i][: len(got_in)] == pytest.approx([full[i, j] for j in got_in])


def test_merge_topk_total_order_is_insertion_independent():
    idx = np.full((1, 2), -1)
    sim = np.full((1, 2), -np.inf)
    a = merge_topk(idx, sim, np.array([[5, 2, 9]]), np.array([[0.5, 0.5, 0.7]]), 2, 0.0)
    b1 = merge_topk(idx, sim, np.array([[9]]), np.array([[0.7]]), 2, 0.0)
    b = merge_topk(*b1, np.array([[5, 2]]), np.array([[0.5, 0.5]]), 2, 0.0)
    assert a[0].tolist() == b[0].tolist() == [[9, 2]]  # tie at 0.5 -> lower index


# -- incremental updates equal the full merge -------------------------------------------------------------------------

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


def test_cross_classes_have_identical_rows_at_every_step(many_envs_pool, run_steps):
    seen = []

    def check(sched, step):
        nb = sched.neighbors
        rows, inverse = nb.cross_classes()
        assert np.array_equal(rows, np.sort(rows)) and np.array_equal(inverse[rows], np.arange(len(rows)))
        _, group = sched.graph.abs_groups()
        assert (group[rows[inverse]] == group).all() and (sched.env[rows[inverse]] == sched.env).all()
        assert np.array_equal(nb.idx["cross"], nb.idx["cross"][rows[inverse]])
        assert np.array_equal(nb.sim["cross"], nb.sim["cross"][rows[inverse]])
        seen.append(len(rows) < len(many_envs_pool) and (nb.idx["cross"] >= 0).any())

    run_steps(many_envs_pool, EnvSchedConfig(batch_size=8), 6, check)
    assert any(seen)  # classes with several nodes and non-empty rows were checked


@pytest.fixture(scope="module")
def pool():
    return TaskPool.from_records(synthetic_records(6, 40, seed=3))


def test_within_env_columns_equal_the_whole_block(pool):
    """NeighborIndex computes only the new nodes' columns of an environment's S_full block: each entry is the
    value the whole block holds (a pinned run's neighbour lists depend on it bit for bit)."""
    graph = build_static_graph(pool, EnvSchedConfig())
    cached, direct = NeighborIndex(graph, 6, 12), NeighborIndex(graph, 6, 12)
    direct._env_sim = None  # as for a pool whose blocks do not fit in _ENV_BLOCK_BYTES
    assert cached._env_sim == {}
    for e in range(3):
        members = graph.env_members[e]
        x = graph.x_full[members]
        block = (x @ x.T).toarray()
        for pos in (np.array([0]), np.array([5, 1, 30]), np.arange(len(members))):
            assert np.array_equal(direct.within_sim(e, pos), block[:, pos])
            assert np.array_equal(cached.within_sim(e, pos), block[:, pos])


def _reference_add_cross(nb, nodes):
    """The cross-environment merge before row blocks, distinct-row products and the exact entry test: S_abs of
    the new nodes to all N rows, every row whose best candidate is within 2^-30 of its K-th entry merged."""
    g, env = nb.graph, nb.graph.env
    s = g.sim_abs32(nodes)
    node_env = env[nodes]
    for e in np.unique(node_env):
        s[np.ix_(g.env_members[e], np.flatnonzero(node_env == e))] = -np.inf
    best = s.max(axis=1).astype(np.float64)
    k = nb.k["cross"]
    kth_idx, kth_sim = nb.idx["cross"][:, k - 1], nb.sim["cross"][:, k - 1]
    rows = np.flatnonzero((best > nb.min_sim) & ((kth_idx < 0) | (best >= kth_sim - 2.0 * 2.0**-30)))
    if len(rows):
        nb._merge("cross", rows, np.broadcast_to(nodes, (len(rows), len(nodes))), s[rows].astype(np.float64))


@pytest.mark.parametrize("min_sim", [0.0, 0.3])
def test_cross_update_equals_the_full_merge(pool, monkeypatch, min_sim):
    """NeighborIndex._add_cross (distinct abstract rows, one row per cross class in blocks, merge only where a
    candidate beats the K-th entry, merged rows copied to their classes) gives the neighbour arrays of merging
    every row that may change; the synthetic pool's abstractions repeat, so similarities tie and the index
    tie-break decides."""
    from envsched import neighbors as neighbors_mod

    graph = build_static_graph(pool, EnvSchedConfig())
    reps, group = graph.abs_groups()
    assert len(reps) < graph.n and np.array_equal(group[reps], np.arange(len(reps)))
    monkeypatch.setattr(neighbors_mod, "_CROSS_BLOCK", 20)
    rng = np.random.default_rng(int(min_sim * 10))
    new, ref = NeighborIndex(graph, 0, 12, min_sim), NeighborIndex(graph, 0, 12, min_sim)
    crows, _ = new.cross_classes()
    assert 20 < len(crows) < graph.n  # several blocks of classes, classes of several nodes
    for _ in range(6):
        nodes = np.unique(rng.choice(np.flatnonzero(~new.observed), 15, replace=False))
        new.add_observed(nodes)
        ref.observed[nodes] = True
        _reference_add_cross(ref, nodes)
        assert np.array_equal(new.idx["cross"], ref.idx["cross"]) and np.array_equal(new.sim["cross"], ref.sim["cross"])
    assert (new.idx["cross"] >= 0).any()
