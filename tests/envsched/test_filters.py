"""The progress and identifier filters (``envsched/filters.py``): the progress filter blocks falling tasks only and
equals a list-based reference, its Ridge fit equals sklearn's, and the identifier filter's replay protocol."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.linear_model import Ridge

from envsched import EnvSchedConfig, TaskPool
from envsched.filters import IdentifierFilter, ProgressFilter, dependent_edits, find_suspicious_actions, ridge_fit_dense


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


# -- fast paths equal straightforward reference computations on random inputs -----------------------------------------

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
