"""Selection rules of the task-selection baselines in benchmarks/envsched_baselines.py on tiny hand-computed cases,
and how benchmarks/envsched_quality.py charges dynamic sampling for the groups it discards."""

from __future__ import annotations

import sys

import envsched_baselines as bl
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envsched import TaskPool


def pool_of(n: int, n_envs: int = 1) -> TaskPool:
    return TaskPool.from_records({"task_id": f"t{i}", "env_id": f"e{i % n_envs}", "instruction": "-"} for i in range(n))


def test_top_b_takes_the_largest_and_breaks_ties_uniformly():
    score = np.array([0.1, 0.5, 0.5, 0.5, 0.9])
    picks = {frozenset(bl.top_b(score, 2, np.random.default_rng(s)).tolist()) for s in range(60)}
    assert picks == {frozenset({4, 1}), frozenset({4, 2}), frozenset({4, 3})}  # 4 always; each tied task drawn
    assert sorted(bl.top_b(score, 1, np.random.default_rng(0)).tolist()) == [4]
    assert sorted(bl.top_b(score, 3, np.random.default_rng(0), candidates=np.array([0, 1, 4])).tolist()) == [0, 1, 4]


def test_expected_learnability_matches_hand_computed_beta_moments():
    # Beta(1, 1): E[p(1-p)] = 1/6; E[1 - p^8 - (1-p)^8] = 1 - 2/9
    assert bl.beta_expected_learnability(np.array([1.0]), np.array([1.0]), "bernoulli")[0] == pytest.approx(1 / 6)
    assert bl.beta_expected_learnability(np.array([1.0]), np.array([1.0]), "grpo", k=8)[0] == pytest.approx(7 / 9)
    # Beta(2, 3): E[p(1-p)] = a b / ((a+b)(a+b+1)) = 6/30; with K = 2 the GRPO form is 2 p (1-p)
    assert bl.beta_expected_learnability(np.array([2.0]), np.array([3.0]), "bernoulli")[0] == pytest.approx(0.2)
    assert bl.beta_expected_learnability(np.array([2.0]), np.array([3.0]), "grpo", k=2)[0] == pytest.approx(0.4)
    with pytest.raises(ValueError, match="target"):
        bl.beta_expected_learnability(np.ones(1), np.ones(1), "variance")


@pytest.mark.parametrize("target", ["bernoulli", "grpo"])
def test_learnability_picks_the_task_nearest_p_half_and_explores_past_tasks_far_from_it(target):
    sched = bl.LearnabilitySampler(pool_of(4), batch_size=3, rollouts_per_task=8, seed=0, target=target)
    assert sorted(sched.select(0)) == sorted(sched.select(0))  # a selected step returns the same batch
    sched.observe(0, {"t0": [1.0] * 8, "t1": [1.0, 0.0] * 4, "t2": [0.0] * 8})  # always, half, never solved
    assert (sched.alpha[:3].tolist(), sched.beta[:3].tolist()) == ([9.0, 5.0, 1.0], [1.0, 5.0, 9.0])
    sched.B = 1
    assert sched.select(1) == ["t1"]  # Beta(5, 5) beats the unobserved prior and both extremes
    sched.B = 2
    assert sorted(sched.select(2)) == ["t1", "t3"]  # the unobserved t3 (prior) ranks above t0 and t2


def test_partial_credit_counts_as_fractional_successes_and_the_decay_forgets_toward_the_prior():
    sched = bl.ThompsonSampler(pool_of(2), batch_size=1, seed=0, decay=0.5)
    sched.observe(0, {"t0": [0.25, 0.75, 1.0, 1.0]})  # alpha = 0.5*1 + 0.5*1 + 3, beta = 0.5*1 + 0.5*1 + 1
    assert (sched.alpha[0], sched.beta[0]) == (4.0, 2.0)
    assert (sched.alpha[1], sched.beta[1]) == (1.0, 1.0)


def test_thompson_keeps_the_tasks_whose_sampled_rate_is_nearest_the_target():
    sched = bl.ThompsonSampler(pool_of(3), batch_size=1, seed=0)
    sched.alpha[:] = [5000.0, 3000.0, 1.0]  # posteriors concentrated at ~1.0, 0.5 and ~0.0
    sched.beta[:] = [1.0, 3000.0, 5000.0]
    assert all(sched.select(s) == ["t1"] for s in range(5))
    sched2 = bl.ThompsonSampler(pool_of(3), batch_size=1, seed=0, target_rate=0.0)
    sched2.alpha[:], sched2.beta[:] = sched.alpha, sched.beta
    assert sched2.select(0) == ["t2"]


def test_dynamic_sampling_refills_and_counts_every_discarded_group():
    sched = bl.DynamicSampler(pool_of(8), batch_size=2, seed=0)
    first = sched.select(0)
    zero, spread = [1.0] * 8, [1.0, 0.0] * 4
    sched.observe(0, {first[0]: zero, first[1]: spread})  # one group without spread: dropped
    again = sched.refill(0)
    assert len(again) == 2 and not set(again) & set(first)  # a whole generation batch, tasks not drawn this step
    sched.observe(0, {again[0]: spread, again[1]: spread})  # fills the batch; the surplus group is dropped too
    assert sched.refill(0) == []
    assert sched.kept(0) == [first[1], again[0]]
    assert (sched.generated_groups, sched.discarded_groups) == (4, 2)

    short = bl.DynamicSampler(pool_of(8), batch_size=2, seed=0, refill="shortfall")
    ids = short.select(0)
    short.observe(0, {ids[0]: zero, ids[1]: spread})
    assert len(short.refill(0)) == 1  # only the missing group

    capped = bl.DynamicSampler(pool_of(8), batch_size=2, seed=0, max_rounds=1)
    ids = capped.select(0)
    capped.observe(0, {ids[0]: zero, ids[1]: zero})
    assert capped.refill(0) == [] and capped.kept(0) == []  # round limit: trains on what it has


def test_plr_replay_distribution_is_the_papers_rank_and_staleness_mixture():
    sched = bl.PrioritizedLevelReplay(pool_of(4), batch_size=1, seed=0, temperature=0.5, staleness_coef=0.1)
    sched.observe(0, {"t0": [1.0, 0.0, 0.0, 0.0]})  # score mean|r - 0.25| = (0.75 + 3 * 0.25) / 4
    assert sched.scores[0] == pytest.approx(0.375)
    sched.seen[:3] = True
    sched.scores[:3] = [0.3, 0.1, 0.2]
    sched.last_played[:3] = [0, 1, 2]
    idx, p = sched.replay_distribution(step=3)
    assert idx.tolist() == [0, 1, 2]
    h = np.array([1 / 1, 1 / 3, 1 / 2]) ** (1 / 0.5)  # ranks 1, 3, 2; h = 1 / rank, P_S ~ h^(1/beta)
    p_s = h / h.sum()
    p_c = np.array([3, 2, 1]) / 6  # (c - C_i) / sum_j (c - C_j)
    np.testing.assert_allclose(p, 0.9 * p_s + 0.1 * p_c)
    sched.scores[:3] = [0.3, 0.3, 0.1]  # tied scores share their average rank (1.5)
    _, p = sched.replay_distribution(step=3)
    assert p[0] - 0.1 * 3 / 6 == pytest.approx(p[1] - 0.1 * 2 / 6)


def test_plr_replays_in_proportion_to_the_seen_levels():
    sched = bl.PrioritizedLevelReplay(pool_of(6), batch_size=3, seed=0)
    assert sched.select(0) and set(sched.selection_phases[0]) == {"new"}  # nothing seen: all new levels
    sched.seen[:] = True
    sched.select(1)
    assert set(sched.selection_phases[1]) == {"replay"}  # all seen: P_D = 1
    sched.seen[:] = [True] * 3 + [False] * 3  # P_D = 1/2: replays come from t0-t2, new levels from t3-t5
    n_replay = []
    for step in range(2, 42):
        ids, phases = sched.select(step), sched.selection_phases[step]
        assert len(set(ids)) == 3 and all((int(t[1:]) < 3) == (ph == "replay") for t, ph in zip(ids, phases))
        n_replay.append(phases.count("replay"))
    assert set(n_replay) == {0, 1, 2, 3}  # Binomial(3, 1/2) replays per batch (seeded: 40 batches)


# Three instructions with disjoint words, one per kind of task: the embeddings of two kinds are orthogonal
# (distance sqrt(2)), those of one kind equal.
MID, EASY, HARD = "assign the coverage record", "delete archived log entry", "reconcile quarterly ledger totals"


def text_pool(n_mid: int = 60, n_easy: int = 30, n_hard: int = 30) -> tuple[TaskPool, np.ndarray]:
    """A pool of mid-, easy- and hard-template tasks and their success rates 0.5, 0.98 and 0.02."""
    kinds = [(MID, 0.5)] * n_mid + [(EASY, 0.98)] * n_easy + [(HARD, 0.02)] * n_hard
    pool = TaskPool.from_records({"task_id": f"t{i}", "env_id": f"e{i % 3}", "instruction": text}
                                 for i, (text, _) in enumerate(kinds))
    return pool, np.array([p for _, p in kinds])


def rbf(a: np.ndarray, b: np.ndarray, h: float) -> np.ndarray:
    return np.exp(-((a[:, None, :] - b[None, :, :]) ** 2).sum(-1) / (2 * h**2))


def test_vip_mean_update_is_the_gp_posterior_mean_over_the_window_by_hand():
    pool, _ = text_pool(4, 2, 2)
    sched = bl.VIPSampler(pool, batch_size=2, rollouts_per_task=4, seed=0, window_steps=2)
    f, h, s2, m0 = sched.features, 0.4, 1e-4, -1.0
    assert np.allclose(np.linalg.norm(f, axis=1), 1.0)
    assert np.allclose(sched.success_rate(), 1 / (1 + np.e))  # m_0 = -1 everywhere
    sched.observe(0, {"t0": [1, 0, 1, 1], "t4": [1.0] * 4})  # R = 0.75 and 1 (clipped to 1 - 1e-6)
    x, g = np.array([0, 4]), np.log(np.array([0.75, 1 - 1e-6]) / np.array([0.25, 1e-6]))
    m1 = m0 + rbf(f, f[x], h) @ np.linalg.solve(rbf(f[x], f[x], h) + s2 * np.eye(2), g - m0)
    np.testing.assert_allclose(sched.latent_mean, m1, rtol=1e-6, atol=1e-6)
    assert sched.latent_mean[0] == pytest.approx(np.log(3), abs=1e-3)  # the posterior mean interpolates g_hat
    mean, var = sched.posterior(np.array([0, 1, 6]))
    np.testing.assert_allclose(mean, m1[[0, 1, 6]])
    k = rbf(f[[0, 1, 6]], f[x], h)
    np.testing.assert_allclose(var, 1 - np.einsum("ij,ji->i", k, np.linalg.solve(rbf(f[x], f[x], h) + s2 * np.eye(2), k.T)),
                               atol=1e-8)
    # t0 observed and t1 with the same instruction: near-certain; t6, far from every observation: the prior's 1
    assert var[0] < 1e-3 and var[1] < 1e-3 and var[2] == pytest.approx(1.0, abs=1e-4)
    # step 1: the window holds steps 0 and 1, t0 again with its newer observation (the latest one per task wins)
    sched.observe(1, {"t0": [0.0] * 4, "t6": [0, 0, 0, 1]})
    x, g = np.array([4, 0, 6]), np.log(np.array([1 - 1e-6, 1e-6, 0.25]) / np.array([1e-6, 1 - 1e-6, 0.75]))
    m2 = m1 + rbf(f, f[x], h) @ np.linalg.solve(rbf(f[x], f[x], h) + s2 * np.eye(3), g - m1[x])
    np.testing.assert_allclose(sched.latent_mean, m2, rtol=1e-6, atol=1e-5)
    sched.observe(3, {"t1": [1, 0, 1, 0]})  # steps 0 and 1 leave the window (2 steps: 2 and 3)
    assert list(sched.window) == [3]


def test_vip_picks_the_top_b_of_the_predicted_bernoulli_variance():
    pool, _ = text_pool(4, 2, 2)
    sched = bl.VIPSampler(pool, batch_size=3, seed=0)
    sched.latent_mean[:] = [0.1, -3.0, 2.0, -0.2, 5.0, 0.0, -6.0, 1.0]
    p = 1 / (1 + np.exp(-sched.latent_mean))
    np.testing.assert_allclose(sched.score(), p * (1 - p))
    assert sorted(sched.select(0)) == ["t0", "t3", "t5"]  # the three latent means nearest 0 (p nearest 1/2)
    assert sorted(sched.select(1, exclude=["t5"])) == ["t0", "t3", "t7"]
    mask = np.zeros(8, dtype=bool)
    mask[[0, 3]] = True
    assert sorted(sched.select(2, exclude=mask)) == ["t2", "t5", "t7"]
    with pytest.raises(ValueError, match="exclude holds"):
        sched.select(3, exclude=["nope"])
    with pytest.raises(ValueError, match="fewer than B"):
        sched.select(3, exclude=[f"t{i}" for i in range(6)])


@settings(max_examples=30, deadline=None)
@given(n=st.integers(6, 40), data=st.data())
def test_vip_returns_b_distinct_pool_tasks_and_none_excluded(n, data):
    pool, rate = text_pool(n // 2, n // 4, n - n // 2 - n // 4)
    b = data.draw(st.integers(1, n // 2))
    excluded = data.draw(st.lists(st.booleans(), min_size=n, max_size=n).filter(lambda m: n - sum(m) >= b))
    factor = data.draw(st.sampled_from([None, 1, 2]))
    sched = bl.VIPSampler(pool, batch_size=b, rollouts_per_task=4, seed=data.draw(st.integers(0, 3)),
                          candidate_factor=factor)
    rng = np.random.default_rng(0)
    for step in range(3):
        ids = sched.select(step, exclude=np.array(excluded))
        assert len(ids) == len(set(ids)) == b
        assert not np.array(excluded)[pool.indices(ids)].any()
        sched.observe(step, {t: rng.binomial(1, rate[i], 4).tolist() for t, i in zip(ids, pool.indices(ids))})


def test_vip_is_deterministic_for_a_seed():
    pool, rate = text_pool()

    def batches(seed):
        sched, rng, out = bl.VIPSampler(pool, batch_size=8, seed=seed), np.random.default_rng(1), []
        for step in range(5):
            ids = sched.select(step)
            sched.observe(step, {t: rng.binomial(1, rate[i], 8).tolist() for t, i in zip(ids, pool.indices(ids))})
            out.append(ids)
        return out, sched.latent_mean

    (a, ma), (b, mb), (c, _) = batches(0), batches(0), batches(1)
    assert a == b and np.array_equal(ma, mb)
    assert a != c  # the seed breaks the ties among the unobserved tasks


def test_vip_learns_to_pick_tasks_near_half_success_far_more_often_than_random():
    pool, rate = text_pool()  # 60 tasks at p = 0.5, 60 at 0.98 or 0.02
    sched, rng = bl.VIPSampler(pool, batch_size=8, rollouts_per_task=8, seed=0), np.random.default_rng(0)
    mid = []
    for step in range(13):
        ids = sched.select(step)
        nodes = pool.indices(ids)
        if step >= 3:  # after three observed steps
            mid.extend(rate[nodes] == 0.5)
        sched.observe(step, {t: rng.binomial(1, rate[i], 8).tolist() for t, i in zip(ids, nodes)})
    # 80 picks; random picks a mid task with probability 1/2 (sd of the fraction <= 0.056 over 80 picks), so 0.85
    # is more than six sd above random: the GP carries the mid template's p ~ 0.5 to its unobserved tasks and the
    # extremes' g_hat = logit(1e-6) or logit(1 - 1e-6) to theirs
    assert np.mean(mid) >= 0.85


def test_vip_refuses_a_pool_without_text():
    with pytest.raises(ValueError, match="VIP reads task text"):
        bl.VIPSampler(pool_of(8), batch_size=2)


class _StubLearner:
    """Rollouts fixed per task: tasks i < 100 have no reward spread, the others have variance 0.25."""

    seed = 0

    def rollout(self, nodes, k):
        return np.array([[1.0] * k if i < 100 else [1.0, 0.0] * (k // 2) for i in nodes])

    def train(self, nodes, rewards):
        self.trained = len(nodes)

    def heldout_success(self):
        return 0.0

    def success_prob(self):
        return np.zeros(1)


def test_quality_benchmark_divides_the_trained_variance_by_every_group_generated():
    import envsched_quality as q
    pool = pool_of(200, n_envs=4)
    spec = q.BASELINES["dynamic sampling (DAPO)"]
    out = q.run(spec, pool, None, _StubLearner(), steps=1)
    sched = spec(pool, q.BATCH, q.ROLLOUTS, 0)
    ids = sched.select(0)
    n_gen = len(ids)
    sched.observe(0, dict(zip(ids, _StubLearner().rollout(pool.indices(ids), q.ROLLOUTS).tolist())))
    while more := sched.refill(0):
        n_gen += len(more)
        sched.observe(0, dict(zip(more, _StubLearner().rollout(pool.indices(more), q.ROLLOUTS).tolist())))
    assert out["var_trained"] == pytest.approx(0.25)
    assert out["mean_var"] == pytest.approx(0.25 * q.BATCH / n_gen)
    assert out["rollouts_per_step"] == n_gen * q.ROLLOUTS and n_gen > q.BATCH


@pytest.mark.parametrize("arm", ["EnvSched (full)", "VIP"])
def test_quality_benchmark_refuses_text_reading_arms_on_a_text_free_pool(monkeypatch, capsys, arm):
    import envsched_quality as q
    monkeypatch.setattr(sys, "argv", ["envsched_quality.py", "--text-free", "--arms", f"random,{arm}"])
    with pytest.raises(SystemExit) as exc:
        q.main()
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and arm in err
    assert "VIP" in q.BASELINES and "VIP" not in q.CHEAP_ARMS


def test_heldout_at_equal_rollouts_stops_where_the_fixed_batch_budget_runs_out():
    import envsched_quality as q
    curve = [0.1, 0.2, 0.3, 0.4]
    # a fixed-batch arm spends the whole budget: its final figure
    assert q.heldout_within(curve, np.cumsum([512] * 4), 4 * 512) == 0.4
    # dynamic sampling at 900 rollouts a step: 1,800 fit in 2,048, 2,700 do not
    assert q.heldout_within(curve, np.cumsum([900] * 4), 4 * 512) == 0.2
    # a first step already past the budget has no figure at equal cost
    assert np.isnan(q.heldout_within(curve, np.cumsum([5000] * 4), 4 * 512))
