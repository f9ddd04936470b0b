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
from envsched.estimate import average_rank, decline_priority, linear_quantiles, percentile_rank, predict_all, prediction_classes, quantile_score
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
