"""Sub-linear step paths (issue 34) equal the computations they replace, bit for bit:

* Eq. 8 ranks, Eq. 12 quantiles and Eq. 13 over classes of equal values (``counts``) equal the same functions on
  the repeated values;
* ``NeighborIndex.cross_classes``: nodes of one class have identical N^cross rows at every step;
* ``predict_all`` with those classes (each class of tasks with identical inputs computed once) equals
  ``predict_all`` without them, in every relation mode, also with the Eq. 7 kernel cache kept between steps.
"""

from __future__ import annotations

import numpy as np
import pytest

from envsched import EnvSchedConfig, EnvScheduler, TaskPool
from envsched.estimate import (
    average_rank,
    decline_priority,
    linear_quantiles,
    percentile_rank,
    predict_all,
    prediction_classes,
    quantile_score,
)
from envsched.synthetic import synthetic_records


@pytest.fixture(scope="module")
def pool():
    return TaskPool.from_records(synthetic_records(30, 8, seed=4))  # more environments than a batch touches


@pytest.mark.parametrize("seed", range(4))
def test_ranks_and_quantiles_over_counts_equal_the_repeated_values(seed):
    rng = np.random.default_rng(seed)
    for n in (1, 2, 9, 400):
        z = np.round(rng.random(n), 1 + seed % 3)  # many exact ties, also between entries
        counts = rng.integers(1, 6, n)
        full = np.repeat(z, counts)
        first = np.cumsum(counts) - counts  # where each entry's copies start in the repeated array
        assert np.array_equal(average_rank(z, counts), average_rank(full)[first])
        assert np.array_equal(percentile_rank(z, counts), percentile_rank(full)[first])
        assert np.array_equal(average_rank(z, np.ones(n, dtype=np.int64)), average_rank(z))
        p = np.concatenate([rng.random(n), [0.0, 1.0]])[:n]
        assert np.array_equal(linear_quantiles(z, p, counts), np.quantile(full, np.repeat(p, counts), method="linear")[first])
        f = np.round(rng.random(n), 2)
        assert np.array_equal(quantile_score(z, f, 0.65, counts), quantile_score(full, np.repeat(f, counts), 0.65)[first])
        u2 = np.round(rng.random(n), 2)
        got, want = decline_priority(z, u2, 0.5, counts), decline_priority(full, np.repeat(u2, counts), 0.5)
        assert np.array_equal(got[0], want[0][first]) and np.array_equal(got[1], want[1][first])
    # NaN goes to scipy's policy on the repeated values
    assert np.isnan(average_rank(np.array([0.2, np.nan]), np.array([2, 1]))).all()
    with pytest.raises(ValueError):
        average_rank(np.array([0.1, 0.2]), np.array([1, 0]))


def _run(pool, cfg, steps, check):
    sched = EnvScheduler(pool, cfg)
    rng = np.random.default_rng(1)
    for step in range(steps):
        ids = sched.select(step)
        check(sched, step)
        sched.observe(step, {t: (rng.random(8) < rng.random()).astype(float).tolist() for t in ids})
    return sched


def test_cross_classes_have_identical_rows_at_every_step(pool):
    seen = []

    def check(sched, step):
        nb = sched.neighbors
        rows, inverse = nb.cross_classes()
        assert np.array_equal(rows, np.sort(rows)) and np.array_equal(inverse[rows], np.arange(len(rows)))
        _, group = sched.graph.abs_groups()
        assert (group[rows[inverse]] == group).all() and (sched.env[rows[inverse]] == sched.env).all()
        assert np.array_equal(nb.idx["cross"], nb.idx["cross"][rows[inverse]])
        assert np.array_equal(nb.sim["cross"], nb.sim["cross"][rows[inverse]])
        seen.append(len(rows) < len(pool) and (nb.idx["cross"] >= 0).any())

    _run(pool, EnvSchedConfig(batch_size=8), 6, check)
    assert any(seen)  # classes with several nodes and non-empty rows were checked


@pytest.mark.parametrize("extra", [{}, {"fusion": "evidence"}, {"cross_reference": "environment"}, {"cross_reference": "environment_mean", "reconstructed_target": "learnability"}, {"relation_weights": "measured"}, {"k_within": 0}])
def test_prediction_over_classes_equals_the_prediction_per_task(pool, extra):
    """predict_all computing each class of identical tasks once (as the scheduler calls it, with the kernel cache
    kept from step to step) == predict_all on every task without any cache."""
    classes_seen = []

    def check(sched, step):
        nb = sched.neighbors
        got = sched.predict(step)
        rw = sched.relation_weights.weights() if sched.relation_weights is not None else None
        want = predict_all(sched.log, nb.idx, nb.sim, step, pool.task_ids, sched.cfg, sched.env, relation_weights=rw)
        for name in ("v", "m", "d", "f", "u_long", "u_short", "u", "q"):
            assert np.array_equal(getattr(got, name), getattr(want, name)), (step, name)
        assert got.reference == want.reference
        if want.sources is not None:
            assert set(got.sources) == set(want.sources)
            for k, a in want.sources.items():
                assert np.array_equal(got.sources[k], a), (step, k)
        classes = prediction_classes(sched.log, nb.idx, step, len(pool), nb.cross_classes())
        classes_seen.append(step > 1 and (classes.counts > 1).any() and (classes.counts == 1).any())  # shared and own classes

    _run(pool, EnvSchedConfig(batch_size=8, **extra), 7, check)
    assert any(classes_seen)


def test_kernel_cache_over_changing_class_rows_equals_no_cache(pool):
    """The Eq. 7 kernel cache keyed by the rows computed (rows that join, leave or keep their place between
    calls) gives the kernels of an uncached pass: the prediction of every step equals a cache-free one."""
    many_envs = pool
    kernels: dict = {}
    sizes = []

    def check(sched, step):
        nb = sched.neighbors
        got = predict_all(sched.log, nb.idx, nb.sim, step, many_envs.task_ids, sched.cfg, sched.env, kernels, cross_classes=nb.cross_classes())
        want = predict_all(sched.log, nb.idx, nb.sim, step, many_envs.task_ids, sched.cfg, sched.env)
        assert np.array_equal(got.q, want.q) and np.array_equal(got.v, want.v), step
        sizes.append(len(kernels["in:rows"]))

    _run(many_envs, EnvSchedConfig(batch_size=8), 8, check)
    assert min(sizes) < len(many_envs) and len(set(sizes)) > 2  # fewer rows than tasks, and rows changing


def _penalty_graph(seed, n=300, f=80):
    import scipy.sparse as sp

    from envsched.graph import StaticGraph

    rng = np.random.default_rng(seed)
    x = sp.csr_matrix(rng.random((n, f)) * (rng.random((n, f)) < 0.2))
    env = np.arange(n) % 6
    return StaticGraph(x_full=x, x_abs=x, env=env, env_members=[np.flatnonzero(env == e) for e in range(6)], descriptions=[], extractor_counts={}), rng


@pytest.mark.parametrize("seed", range(3))
def test_penalty_rows_from_the_row_cache_equal_rows_from_x(seed, monkeypatch):
    """Eq. 5 penalties of rows re-read from the row cache (one per block, one shared by consecutive blocks, one
    too small that empties itself), read by csr_row_index or by the numpy gather: the same floats as a block
    without cache; only rows read from x count towards the page release."""
    from envsched import select
    from envsched.select import PenaltyBlock, RowCache

    g, rng = _penalty_graph(seed)
    n = g.n
    entry = g.x_full.indices.itemsize + g.x_full.data.itemsize
    shared, small = RowCache(g.x_full, entry * g.x_full.nnz), RowCache(g.x_full, entry * g.x_full.nnz // 3)
    for batch in range(2):  # the shared caches carry rows from one batch's block to the next
        blocks = {"none": PenaltyBlock(g.x_full, np.full(80, -1), 4, cache_bytes=0),
                  "own": PenaltyBlock(g.x_full, np.full(80, -1), 4),
                  "shared": PenaltyBlock(g.x_full, np.full(80, -1), 4, row_cache=shared),
                  "small": PenaltyBlock(g.x_full, np.full(80, -1), 4, row_cache=small)}
        members = []
        for _ in range(6):  # members arrive between refreshes, rows are read again
            j = int(rng.integers(n))
            members.append(j)
            for b in blocks.values():
                b.add(j)
            rows = rng.choice(n, 90, replace=False)
            start = rng.integers(0, blocks["none"].m + 1, size=90)
            want = blocks["none"].max_sim(rows, start)
            for name in ("own", "shared", "small"):
                before = blocks[name].rows_read
                cached = (blocks[name].cached(rows) >= 0).sum()
                assert np.array_equal(blocks[name].max_sim(rows, start), want), (batch, name)
                assert blocks[name].rows_read - before == len(rows) - cached
        assert blocks["none"].row_cache.rows == 0 and 0 < small.used <= small.capacity < shared.used
        cached = shared.lookup(np.arange(n))
        assert (cached >= 0).sum() == shared.rows and np.array_equal(np.sort(cached[cached >= 0]), np.arange(shared.rows))
        for b in blocks.values():
            b.close()
    small.clear()
    assert small.rows == 0 and (small.lookup(np.arange(n)) == -1).all()
    # the numpy gather (scipy's private kernel missing) gives the same floats
    monkeypatch.setattr(select, "_csr_row_index", None)
    plain = PenaltyBlock(g.x_full, np.full(80, -1), 4)
    for j in members:
        plain.add(j)
    rows, start = np.arange(n), np.zeros(n, dtype=np.int64)
    assert np.array_equal(plain.max_sim(rows, start), blocks["none"].max_sim(rows, start))


@pytest.mark.parametrize("seed", range(4))
def test_descending_order_equals_stable_argsort(seed):
    from envsched.select import descending_order

    rng = np.random.default_rng(seed)
    for n in (0, 1, 2, 5, 1000):
        for x in (rng.random(n), np.round(rng.random(n), 1 + seed % 2), np.where(rng.random(n) < 0.5, 0.0, -0.0),
                  np.where(rng.random(n) < 0.3, np.inf, np.round(rng.random(n), 1)), np.full(n, 0.25)):
            assert np.array_equal(descending_order(x), np.argsort(-x, kind="stable"))
    x = np.array([0.3, np.nan, 0.3, 0.1])
    assert np.array_equal(descending_order(x), np.argsort(-x, kind="stable"))


def test_row_cache_size():
    from envsched import select
    from envsched.select import RowCache

    g, _ = _penalty_graph(0)
    entry = g.x_full.indices.itemsize + g.x_full.data.itemsize
    assert RowCache(g.x_full).capacity == g.x_full.nnz // select._ROW_CACHE_SHARE  # an eighth of x_full ...
    assert RowCache(g.x_full, 10 * entry).capacity == 10
    big = type("X", (), {"nnz": 10**9, "indices": g.x_full.indices, "data": g.x_full.data, "shape": (10**6, 10)})()
    assert RowCache(big).capacity == select._ROW_CACHE_BYTES // entry  # ... and at most _ROW_CACHE_BYTES
