"""Fast paths of the step (progress-filter Ridge, growing logs, rank statistics, shared Eq. 7 kernel) equal
straightforward reference computations on random inputs."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import rankdata
from sklearn.linear_model import Ridge

from envsched import EnvSchedConfig
from envsched.estimate import ObservationLog, average_rank, neighbor_weights, percentile_rank, predict_all
from envsched.filters import ProgressFilter, ridge_fit_dense


@pytest.mark.parametrize("seed", range(4))
def test_average_rank_equals_scipy(seed):
    rng = np.random.default_rng(seed)
    for n in (1, 2, 7, 300):
        z = np.round(rng.random(n), 1 + seed % 3)  # many exact ties
        assert np.array_equal(average_rank(z), rankdata(z, method="average"))
        assert np.array_equal(percentile_rank(z), (rankdata(z, method="average") - 0.5) / n)
    z = np.array([0.3, np.nan, 0.1])
    assert np.array_equal(average_rank(z), rankdata(z, method="average"), equal_nan=True)


@pytest.mark.parametrize("shape", [(40, 8), (5, 12), (200, 30)])  # primal and kernel (features > samples)
def test_ridge_fit_dense_equals_sklearn(shape):
    rng = np.random.default_rng(shape[0])
    X = rng.random(shape)
    X[:, -3:] = (rng.random((shape[0], 3)) < 0.3).astype(float)  # one-hot-like columns
    y = rng.random(shape[0])
    for alpha in (1.0, 0.01):
        coef, intercept = ridge_fit_dense(X, y, alpha)
        model = Ridge(alpha=alpha, solver="auto").fit(X, y)
        np.testing.assert_allclose(coef, model.coef_, rtol=1e-12, atol=1e-12)
        assert intercept == pytest.approx(float(model.intercept_), rel=1e-12, abs=1e-12)
        Xt = rng.random((10, shape[1]))
        np.testing.assert_allclose(Xt @ coef + intercept, model.predict(Xt), rtol=1e-12, atol=1e-12)


class _ListProgressFilter:
    """The straightforward version: Python lists, sparse features, scikit-learn Ridge on every scoring step."""

    def __init__(self, cfg, env, n_envs):
        self.cfg, self.env, self.n_envs = cfg, env, n_envs
        n = len(env)
        self.last = {}
        self.count = np.zeros(n, dtype=np.int64)
        self.t = []  # [node, env, step_prev, step_next, m_prev, v_prev, count_prev, m_next, residual]

    def observe(self, step, nodes, m, v):
        new = []
        for i, mi, vi in zip(nodes, m, v):
            i = int(i)
            if self.count[i] > 0:
                sp_, mp, vp = self.last[i]
                new.append(len(self.t))
                self.t.append([i, int(self.env[i]), sp_, step, mp, vp, int(self.count[i]), float(mi), np.nan])
            self.last[i] = (step, float(mi), float(vi))
            self.count[i] += 1
        if not new:
            return
        T = np.array(self.t, dtype=np.float64)
        train = T[:, 3] < step
        if train.sum() < self.cfg.progress_min_fit_transitions:
            return
        X = ProgressFilter.features(T[:, 4], T[:, 5], T[:, 2], T[:, 6], T[:, 1].astype(int), self.n_envs).toarray()
        model = Ridge(alpha=self.cfg.progress_ridge_alpha).fit(X[train], T[train, 7])
        for r, p in zip(new, model.predict(X[new])):
            self.t[r][8] = self.t[r][7] - p


@pytest.mark.parametrize("seed", range(3))
def test_progress_filter_matches_list_reference(seed):
    rng = np.random.default_rng(seed)
    n, n_envs = 60, 4
    env = rng.integers(0, n_envs, n)
    cfg = EnvSchedConfig(progress_min_fit_transitions=8)
    fast, ref = ProgressFilter(cfg, env, n_envs), _ListProgressFilter(cfg, env, n_envs)
    for step in range(30):
        nodes = rng.choice(n, rng.integers(5, 25), replace=False)
        m, v = rng.random(len(nodes)), rng.random(len(nodes)) * 0.25
        fast.observe(step, nodes, m, v)
        ref.observe(step, nodes, m, v)
    arr = fast.arrays()
    T = np.array(ref.t, dtype=np.float64)
    assert len(arr["node"]) == len(T) > 256  # grew past the initial capacity
    for c, k in enumerate(("node", "env", "step_prev", "step_next", "m_prev", "v_prev", "count_prev", "m_next")):
        assert np.array_equal(arr[k], T[:, c]), k
    np.testing.assert_allclose(arr["residual"], T[:, 8], rtol=1e-10, atol=1e-12)  # same NaNs (unscored)
    # state round trip keeps the columns and the growth
    other = ProgressFilter(cfg, env, n_envs)
    other.load_state_dict(fast.state_dict())
    for k, a in other.arrays().items():
        assert np.array_equal(a, arr[k], equal_nan=True)
    nodes = rng.choice(n, 10, replace=False)
    other.observe(30, nodes, rng.random(10), rng.random(10))
    assert len(other.arrays()["node"]) > len(arr["node"])


def test_observation_log_growth_and_state():
    rng = np.random.default_rng(0)
    log, rows = ObservationLog(), []
    for _ in range(2500):  # past the initial capacity
        row = (int(rng.integers(0, 50)), int(rng.integers(0, 30)), *rng.random(3).tolist())
        log.add(*row)
        rows.append(row)
    arr = log.arrays()
    R = np.array(rows)
    for c, k in enumerate(("node", "step", "m", "v", "d")):
        assert np.array_equal(arr[k], R[:, c])
    assert arr["node"].dtype == np.int64 and arr["m"].dtype == np.float64
    other = ObservationLog()
    other.load_state_dict(log.state_dict())
    assert len(other) == 2500
    other.add(1, 2, 0.5, 0.1, 0.2)
    assert len(other.arrays()["node"]) == 2501 and len(log) == 2500


@pytest.mark.parametrize("seed", range(3))
def test_prediction_with_shared_kernel_equals_separate_passes(seed):
    """predict_all (Eq. 7 kernel shared by the two half-lives) == each pass with its own neighbor_weights."""
    from envsched import estimate as E

    rng = np.random.default_rng(seed)
    n, k = 120, 4
    cfg = EnvSchedConfig()
    log = ObservationLog()
    for s in range(6):
        for i in rng.choice(n, 30, replace=False):
            r = rng.random(8) < rng.random()
            log.add(int(i), s, *E.group_statistics(r.astype(float), cfg.dispersion_floor))
    idx = {rel: np.where(rng.random((n, kk)) < 0.8, rng.integers(0, n, (n, kk)), -1) for rel, kk in (("in", k), ("cross", 2 * k))}
    sim = {rel: np.where(idx[rel] >= 0, np.round(rng.random(idx[rel].shape), 2), -np.inf) for rel in idx}
    got = predict_all(log, idx, sim, 6, [str(i) for i in range(n)], cfg)

    def separate(h):  # the original per-pass computation
        out = E.estimate_half_life(log, idx, sim, 6, h, n, cfg, kernels=None)
        return out

    long, short = separate(cfg.h_long), separate(cfg.h_short)
    assert np.array_equal(got.u_long, long["u"]) and np.array_equal(got.u_short, short["u"])
    assert np.array_equal(got.v, long["v"])
    # and the kernel path itself equals neighbor_weights
    W = long["W"]
    for rel, nbrs in idx.items():
        safe = np.maximum(nbrs, 0)
        avail = (nbrs >= 0) & (W[safe] > 0)
        a = neighbor_weights(sim[rel], W[safe], avail, cfg.bandwidth_floor, cfg.neighbor_weight_clip)
        kern = E.neighbor_kernel(sim[rel], avail, cfg.bandwidth_floor)
        assert np.array_equal(a, np.where(avail, kern * np.sqrt(np.clip(W[safe], *cfg.neighbor_weight_clip)), 0.0))
