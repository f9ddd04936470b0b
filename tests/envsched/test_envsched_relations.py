"""Relation evidence options (issue 12): evidence-weighted fusion of the two relations (Eq. 3-4), the
environment-relative cross-environment reference, and the simulated learner the quality benchmark uses."""

import numpy as np
import pytest

from envsched import ConfigError, EnvSchedConfig
from envsched.estimate import (
    ObservationLog,
    environment_reference,
    graph_prior,
    predict_all,
    reconstructed_variance,
    relation_estimate,
    relation_values,
)
from envsched.synthetic import LatentSkillLearner


def test_graph_prior_fixed_is_the_papers_eq4():
    G_in, G_cr = np.array([0.1, 0.3]), np.array([0.2, 0.0])
    P = graph_prior(G_in, G_cr, np.array([1.0, 0.0]), np.array([0.0, 2.0]), 0.05, 2.0, 0.3, "fixed")
    assert P == pytest.approx(0.3 * G_in + 0.7 * G_cr)


def test_graph_prior_evidence_pools_both_relations_by_mass():
    b, lam = 0.1, 2.0
    # target 0: within mass 2 with neighbour mean 0.2, cross mass 1 with neighbour mean 0.05
    a_in, y_in = np.array([[1.0, 1.0]]), np.array([[0.2, 0.2]])
    a_cr, y_cr = np.array([[1.0]]), np.array([[0.05]])
    G_in = relation_estimate(a_in, y_in, b, lam)  # (0.4 + 0.2) / 4 = 0.15
    G_cr = relation_estimate(a_cr, y_cr, b, lam)  # (0.05 + 0.2) / 3
    assert G_in == pytest.approx([0.15]) and G_cr == pytest.approx([0.25 / 3])
    P = graph_prior(G_in, G_cr, a_in.sum(1), a_cr.sum(1), b, lam, 0.5, "evidence")
    # pooled Eq. 3: (0.4 + 0.05 + 2 * 0.1) / (2 + 1 + 2) = 0.13
    assert P == pytest.approx([0.13])
    # relation weights 2w / 2(1 - w): w = 0.75 -> (1.5 * 0.4 + 0.5 * 0.05 + 0.2) / (1.5 * 2 + 0.5 + 2)
    P = graph_prior(G_in, G_cr, a_in.sum(1), a_cr.sum(1), b, lam, 0.75, "evidence")
    assert P == pytest.approx([(0.6 + 0.025 + 0.2) / 5.5])


def test_graph_prior_evidence_relation_without_neighbours_does_not_dilute():
    b, lam = 0.1, 2.0
    a_in, y_in = np.array([[3.0]]), np.array([[0.25]])
    G_in = relation_estimate(a_in, y_in, b, lam)  # (0.75 + 0.2) / 5 = 0.19
    G_cr = relation_estimate(np.zeros((1, 2)), np.zeros((1, 2)), b, lam)  # no evidence -> b
    fixed = graph_prior(G_in, G_cr, np.array([3.0]), np.array([0.0]), b, lam, 0.5, "fixed")
    evid = graph_prior(G_in, G_cr, np.array([3.0]), np.array([0.0]), b, lam, 0.5, "evidence")
    assert fixed == pytest.approx([0.5 * 0.19 + 0.5 * 0.1])  # paper: halfway back to b_t
    assert evid == pytest.approx([(0.75 + 0.2) / 5.0])  # undiluted within-environment estimate
    # no evidence at all -> the global reference
    none = graph_prior(np.array([b]), np.array([b]), np.array([0.0]), np.array([0.0]), b, lam, 0.5, "evidence")
    assert none == pytest.approx([b])


def test_environment_reference_and_relative_cross_values():
    ybar = np.array([0.2, 0.4, 0.1, 0.0])
    W = np.array([1.0, 1.0, 2.0, 0.0])  # task 3 has no history
    env = np.array([0, 0, 1, 1])
    e = environment_reference(ybar, W, env, 0.15, 2.0)
    # env 0: (0.2 + 0.4 + 0.3) / 4 = 0.225; env 1: (0.2 + 0 + 0.3) / 4 = 0.125
    assert e == pytest.approx([0.225, 0.225, 0.125, 0.125])
    safe = np.array([[2], [2], [0], [0]])  # cross neighbours
    assert relation_values(ybar, safe, None, (0.0, 0.25)) == pytest.approx(ybar[safe])
    vals = relation_values(ybar, safe, e, (0.0, 0.25))
    # target 0 (env 0) <- task 2 (env 1): 0.1 - 0.125 + 0.225 = 0.2; target 2 (env 1) <- task 0: 0.2 - 0.225 + 0.125
    assert vals[:, 0] == pytest.approx([0.2, 0.2, 0.1, 0.1])
    # the clip interval of Eq. 6 bounds the moved value
    hi = relation_values(np.array([0.25, 0.0]), np.array([[1], [0]]), np.array([0.2, 0.0]), (0.0, 0.25))
    assert hi[:, 0] == pytest.approx([0.2, 0.05])


def _two_env_log():
    """Env 0: tasks 0 (observed, m = 0.9) and 1 (unobserved); env 1: tasks 2 (m = 0.3) and 3 (m = 0.1)."""
    log = ObservationLog()
    for node, m in ((0, 0.9), (2, 0.3), (3, 0.1)):
        log.add(node, 0, m, m * (1 - m), 1.0)
    # task 1 has one cross neighbour (task 3, the structural twin in the harder environment) and no within one
    idx = {"in": np.full((4, 1), -1), "cross": np.array([[-1], [3], [-1], [-1]])}
    sim = {"in": np.full((4, 1), -np.inf), "cross": np.array([[-np.inf], [0.9], [-np.inf], [-np.inf]])}
    return log, idx, sim, np.array([0, 0, 1, 1])


def test_environment_cross_reference_moves_evidence_to_the_targets_environment():
    log, idx, sim, env = _two_env_log()
    base = EnvSchedConfig(h_long=1.0, h_short=1.0, fusion="evidence", lambda_g=1.0, lambda_s=1.0)
    glob = predict_all(log, idx, sim, 1, list("abcd"), base.replace(cross_reference="global"))
    rel = predict_all(log, idx, sim, 1, list("abcd"), base.replace(cross_reference="environment"), env)
    # by hand (h = 1: W = 1/2 per observation; b_t = 1.3 / 3): Eq. 7 a = exp(-1/2) sqrt(1/2) (delta = sigma)
    b, a = 1.3 / 3, np.exp(-0.5) * np.sqrt(0.5)
    e0 = (0.5 * 0.9 + b) / 1.5  # environment levels (lambda_g = 1)
    e1 = (0.5 * 0.3 + 0.5 * 0.1 + b) / 2.0
    # global (paper): task 1 inherits its twin's low mean 0.1; environment-relative: the twin is below its
    # (hard) environment, task 1's environment is easy, so the evidence moves up by e0 - e1
    assert glob.m[1] == pytest.approx((a * 0.1 + b) / (a + 1.0))
    assert rel.m[1] == pytest.approx((a * (0.1 - e1 + e0) + b) / (a + 1.0))
    assert rel.m[1] > glob.m[1] + 0.08
    # tasks with no neighbours are unchanged by the option
    assert rel.m[[0, 2, 3]] == pytest.approx(glob.m[[0, 2, 3]])
    with pytest.raises(ValueError, match="env="):
        predict_all(log, idx, sim, 1, list("abcd"), base.replace(cross_reference="environment"))


def test_environment_mean_cross_reference_moves_only_the_mean():
    log, idx, sim, env = _two_env_log()
    base = EnvSchedConfig(h_long=1.0, h_short=1.0, fusion="evidence", lambda_g=1.0, lambda_s=1.0)
    glob = predict_all(log, idx, sim, 1, list("abcd"), base.replace(cross_reference="global"))
    full = predict_all(log, idx, sim, 1, list("abcd"), base.replace(cross_reference="environment"), env)
    mean = predict_all(log, idx, sim, 1, list("abcd"), base.replace(cross_reference="environment_mean"), env)
    b, a = 1.3 / 3, np.exp(-0.5) * np.sqrt(0.5)
    e0, e1 = (0.5 * 0.9 + b) / 1.5, (0.5 * 0.3 + 0.5 * 0.1 + b) / 2.0
    # the mean is transferred relative to the environments (as with "environment") ...
    assert mean.m[1] == pytest.approx((a * (0.1 - e1 + e0) + b) / (a + 1.0))
    assert mean.m == pytest.approx(full.m)
    # ... while variance and dispersion keep the paper's global reference
    assert mean.v == pytest.approx(glob.v)
    assert mean.d == pytest.approx(glob.d)
    assert not np.allclose(full.v, glob.v)
    with pytest.raises(ValueError, match="env="):
        predict_all(log, idx, sim, 1, list("abcd"), base.replace(cross_reference="environment_mean"))


def test_reconstructed_target_learnability():
    d, m = np.array([0.5, 1.0, 1.0, 0.2]), np.array([0.5, 0.25, 0.0, 1.0])
    assert reconstructed_variance(d, m) == pytest.approx(d * m * (1 - m))
    # 1 - m^K - (1 - m)^K for K = 8: m = 1/2 -> 1 - 2 / 256; m = 1/4 -> 1 - (1 + 3^8) / 4^8; m in {0, 1} -> 0
    want = np.array([0.5 * (1 - 2 / 256), 1 - (1 + 3**8) / 4**8, 0.0, 0.0])
    assert reconstructed_variance(d, m, "learnability", 8) == pytest.approx(want)
    assert reconstructed_variance(np.ones(1), np.array([0.5]), "learnability", 2) == pytest.approx([0.5])
    with pytest.raises(ValueError, match="reconstructed_target"):
        reconstructed_variance(d, m, "entropy")
    # it reaches the score: a pool where d varies ranks f differently under the two targets
    log, idx, sim, env = _two_env_log()
    cfg = EnvSchedConfig(h_long=1.0, h_short=1.0, lambda_g=1.0, lambda_s=1.0)
    p0 = predict_all(log, idx, sim, 1, list("abcd"), cfg)
    p1 = predict_all(log, idx, sim, 1, list("abcd"), cfg.replace(reconstructed_target="learnability"), env)
    assert p1.f == pytest.approx(reconstructed_variance(p0.d, p0.m, "learnability", cfg.rollouts_per_task))
    assert p1.v == pytest.approx(p0.v) and p1.m == pytest.approx(p0.m)
    with pytest.raises(ConfigError, match="'reconstructed_target'"):
        EnvSchedConfig.from_dict({"reconstructed_target": "entropy"})


def test_new_fields_are_validated():
    with pytest.raises(ConfigError, match="'fusion'"):
        EnvSchedConfig.from_dict({"fusion": "average"})
    with pytest.raises(ConfigError, match="'cross_reference'"):
        EnvSchedConfig.from_dict({"cross_reference": "local"})


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


def test_abstraction_without_gold_calls_warns(caplog):
    from envsched import TaskPool, build_static_graph
    from envsched.synthetic import synthetic_records

    recs = synthetic_records(2, 40, seed=1)
    with caplog.at_level("WARNING", logger="envsched.graph"):
        g = build_static_graph(TaskPool.from_records(recs), EnvSchedConfig())
    assert g.report()["abstraction"]["low_resolution"] == 0.0 and "gold_actions" not in caplog.text
    bare = [{k: v for k, v in r.items() if k != "gold_actions"} for r in recs]
    with caplog.at_level("WARNING", logger="envsched.graph"):
        g = build_static_graph(TaskPool.from_records(bare), EnvSchedConfig())
    rep = g.report()["abstraction"]
    assert rep["tasks_without_gold_actions"] == 80.0 and rep["low_resolution"] == 1.0
    assert rep["distinct_abstract_fraction_median"] < 0.25
    assert "80 of 80 tasks have no gold_actions" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="envsched.graph"):
        build_static_graph(TaskPool.from_records(bare), EnvSchedConfig(abstraction_min_distinct_fraction=0.0))
    assert "gold_actions" not in caplog.text
