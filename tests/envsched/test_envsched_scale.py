"""The data structures that let EnvSched hold a million tasks equal the in-memory ones they replace.

* ``tfidf.tfidf_chunks`` (row-chunked TF-IDF) gives exactly ``TfidfVectorizer.fit_transform`` (values, column
  indices, in-row order), with and without a binding ``max_features``, for every view's analyzer;
* the graph built in chunks equals the graph built in one chunk, and x_full is memory-mapped from disk;
* the graph cache: the key changes with the pool's content and with a graph config field, a hit reproduces
  the same matrices, and ``release_pages`` leaves the mapped matrix readable;
* within-environment S_full computed for the new nodes' columns only equals the whole block's columns.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import scipy.sparse as sp
from sklearn.feature_extraction.text import TfidfVectorizer

from envsched import EnvSchedConfig, TaskPool, build_static_graph
from envsched.graph import code_structure
from envsched.graph_cache import graph_cache_key, load_or_build_graph
from envsched.neighbors import NeighborIndex
from envsched.synthetic import synthetic_records
from envsched.tfidf import DiskCSR, DiskCSRWriter, tfidf_chunks


@pytest.fixture(scope="module")
def pool():
    return TaskPool.from_records(synthetic_records(6, 40, seed=3))


def _same(a: sp.csr_matrix, b: sp.csr_matrix) -> bool:
    a, b = sp.csr_matrix(a), sp.csr_matrix(b)
    return a.shape == b.shape and a.dtype == b.dtype and all(np.array_equal(getattr(a, k), getattr(b, k)) for k in ("indptr", "indices", "data"))


@pytest.mark.parametrize("view", ["words", "chars", "code"])
@pytest.mark.parametrize("max_features", [35_000, 150, 5])
def test_chunked_tfidf_equals_sklearn(pool, view, max_features):
    kw = {"words": {"ngram_range": (1, 2)}, "chars": {"analyzer": "char_wb", "ngram_range": (3, 5)},
          "code": {"token_pattern": r"\S+", "lowercase": False, "ngram_range": (1, 2)}}[view]
    texts = [code_structure(t.verifier_code) for t in pool.tasks] if view == "code" else [t.instruction for t in pool.tasks]
    texts[3] = ""  # an empty document stays an empty row
    args = {"min_df": 1, "max_features": max_features, "sublinear_tf": True, "dtype": np.float32, **kw}
    want = TfidfVectorizer(**args).fit_transform(texts)
    for chunk_rows in (len(texts), 37, 4):
        got = sp.vstack(list(tfidf_chunks(texts, chunk_rows=chunk_rows, **args)), format="csr")
        assert _same(got, want), (view, max_features, chunk_rows)


def test_graph_built_in_chunks_equals_one_chunk(pool):
    cfg = EnvSchedConfig()
    one = build_static_graph(pool, cfg, chunk_rows=len(pool))
    many = build_static_graph(pool, cfg, chunk_rows=17)
    assert _same(one.x_full, many.x_full) and _same(one.x_abs, many.x_abs)
    assert np.array_equal(one.mean_within_env_similarity(), many.mean_within_env_similarity())
    assert one.view_shapes == many.view_shapes and one.abstraction == many.abstraction
    assert isinstance(one.x_full.data, np.ndarray) and not one.x_full.data.flags.writeable  # mapped read-only
    assert [d.model_dump() for d in one.descriptions[:3]] == [d.model_dump() for d in many.descriptions[:3]]
    # S_full from the mapped matrix equals S_full from an in-memory copy, also after its pages are released
    mem = sp.csr_matrix((np.array(one.x_full.data), np.array(one.x_full.indices), np.array(one.x_full.indptr)), shape=one.x_full.shape)
    in_memory = dataclasses.replace(one, x_full=mem, disk=None)
    rows, cols = np.arange(0, len(pool), 7), np.arange(3, len(pool), 11)
    want = in_memory.sim_full(rows, cols)
    assert np.array_equal(one.sim_full(rows, cols), want)
    one.release_pages()
    assert np.array_equal(one.sim_full(rows, cols), want)


def test_disk_csr_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    x = sp.random(50, 30, density=0.2, format="csr", random_state=rng, dtype=np.float64)
    w = DiskCSRWriter(tmp_path, "m", 50, 30, x.nnz, np.float64)
    for a in range(0, 50, 13):
        w.append(x[a : a + 13])
    w.finish()
    assert _same(DiskCSR(tmp_path, "m").matrix, x)
    w = DiskCSRWriter(tmp_path, "bad", 50, 30, x.nnz + 1, np.float64)
    w.append(x)
    with pytest.raises(RuntimeError, match="expected"):
        w.finish()


def test_graph_cache_key_and_hit(pool, tmp_path):
    cfg = EnvSchedConfig(graph_cache_dir=str(tmp_path))
    key = graph_cache_key(pool, cfg)
    t0 = pool.tasks[0]
    changed = TaskPool([dataclasses.replace(t0, instruction=t0.instruction + " today"), *pool.tasks[1:]])
    assert graph_cache_key(changed, cfg) != key  # pool content
    assert graph_cache_key(pool, cfg.replace(view_weights=(0.3, 0.06, 0.16, 0.12, 0.16, 0.2))) != key  # config
    assert graph_cache_key(pool, cfg.replace(k_within=3)) == key  # a field the graph does not depend on
    built = load_or_build_graph(pool, cfg)
    assert built.cache == "miss"
    hit = load_or_build_graph(TaskPool(pool.tasks), cfg)
    assert hit.cache == "hit"
    plain = build_static_graph(pool, EnvSchedConfig())
    for g in (built, hit):
        assert _same(g.x_full, plain.x_full) and _same(g.x_abs, plain.x_abs)
        assert np.array_equal(g.mean_within_env_similarity(), plain.mean_within_env_similarity())
    assert [d.model_dump() for d in hit.descriptions[:3]] == [d.model_dump() for d in plain.descriptions[:3]]
    assert load_or_build_graph(changed, cfg).cache == "miss"


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


@pytest.mark.parametrize("max_tied", [1, 4, 9])
@pytest.mark.parametrize("seed", range(6))
def test_long_ties_compare_their_first_max_tied_candidates(pool, seed, max_tied):
    """With ties longer than eq5_max_tied (240 nodes, predictions rounded to one decimal: ~24 a value), each pick
    is the Eq. 5 arg-max over the candidates with every long tie cut to its max_tied first in spread_key order,
    whatever the caps, masks and phase; the shorter ties stay whole."""
    got, want = _pruned_and_reference(pool, seed, max_tied, 1)
    assert got == want


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


@pytest.mark.parametrize("seed", range(4))
def test_linear_quantiles_equal_numpy(seed):
    """Eq. 12's Q_{v-hat}[p] from one sort equals np.quantile(..., method="linear") float for float."""
    from envsched.estimate import linear_quantiles

    rng = np.random.default_rng(seed)
    for n in (1, 2, 3, 17, 5000):
        x = np.round(rng.random(n) * 0.25, seed + 1)
        x[rng.random(n) < 0.5] = 0.1  # a tie block, as cold tasks share the reference
        p = rng.random(n)
        p[: min(n, 3)] = [0.0, 1.0, 0.5][: min(n, 3)]
        assert np.array_equal(linear_quantiles(x, p), np.quantile(x, p, method="linear"))


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


def test_kernel_cache_kept_between_steps_gives_the_uncached_prediction(pool):
    """The Eq. 7 kernels kept in NeighborIndex.kernel_cache from step to step (only rows whose mask or
    neighbour list changed are recomputed) give every step the prediction of a pass without any cache."""
    from envsched import EnvScheduler
    from envsched.estimate import predict_all

    sched = EnvScheduler(pool, EnvSchedConfig(batch_size=16))
    rng = np.random.default_rng(5)
    masks = []
    for step in range(6):
        ids = sched.select(step)
        nb = sched.neighbors
        cached = sched.predict(step)
        plain = predict_all(sched.log, nb.idx, nb.sim, step, pool.task_ids, sched.cfg, sched.env,
                            relation_weights=sched.relation_weights.weights())
        for name in ("v", "m", "d", "u_long", "u_short", "q"):
            assert np.array_equal(getattr(cached, name), getattr(plain, name)), (step, name)
        if "cross" in nb.kernel_cache:
            masks.append(nb.kernel_cache["cross"][0].copy())
        sched.observe(step, {t: rng.integers(0, 2, 8).tolist() for t in ids})
    assert len(masks) >= 4  # the cache was kept over the steps
