"""The simulated learners (``envsched/synthetic.py``) the quality benchmark uses: expected variance against
sampling, learning only from reward spread."""

from __future__ import annotations

import numpy as np
import pytest

from envsched.synthetic import LatentSkillLearner


def _learner(reward, **kw):
    env = np.repeat(np.arange(4), 10)
    cl = np.tile(np.arange(5), 8)
    return LatentSkillLearner(env, cl, np.arange(4), np.arange(4), reward=reward, seed=3, **kw)


@pytest.mark.parametrize("reward", ["partial", "binary"])
def test_learner_expected_variance_matches_sampling(reward):
    L = _learner(reward, offset=0.5)
    nodes = np.repeat(np.arange(40), 2000)
    R = L.rollout(nodes, 8)
    levels = np.unique(R)
    assert set(levels) <= ({0.0, 0.25, 0.5, 0.75, 1.0} if reward == "partial" else {0.0, 1.0})
    empirical = R.var(axis=1).reshape(40, 2000).mean(axis=1)
    assert empirical == pytest.approx(L.expected_variance(8), abs=0.01)
    assert np.mean(R == 1.0) == pytest.approx(L.success_prob().mean(), abs=0.01)


def test_learner_learns_only_from_reward_spread():
    L = _learner("binary")
    before = (L.logit().copy(), L.heldout_success())
    L.train(np.arange(10), np.ones((10, 8)))  # no spread: no update (GRPO-like)
    assert np.array_equal(L.logit(), before[0]) and L.heldout_success() == before[1]
    L.train(np.arange(10), np.tile([0.0, 1.0], (10, 4)))
    assert np.all(L.logit()[:10] > before[0][:10]) and L.heldout_success() > before[1]
    with pytest.raises(ValueError, match="reward"):
        _learner("ternary")
