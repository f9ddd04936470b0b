"""Selection rules of the task-selection baselines in benchmarks/envsched_baselines.py on tiny hand-computed cases,
and how benchmarks/envsched_quality.py charges dynamic sampling for the groups it discards."""

from __future__ import annotations

import sys

import envsched_baselines as bl
import numpy as np
import pytest

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


def test_quality_benchmark_refuses_text_reading_arms_on_a_text_free_pool(monkeypatch, capsys):
    import envsched_quality as q
    monkeypatch.setattr(sys, "argv", ["envsched_quality.py", "--text-free", "--arms", "random,EnvSched (full)"])
    with pytest.raises(SystemExit) as exc:
        q.main()
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "EnvSched (full)" in err


def test_heldout_at_equal_rollouts_stops_where_the_fixed_batch_budget_runs_out():
    import envsched_quality as q
    curve = [0.1, 0.2, 0.3, 0.4]
    # a fixed-batch arm spends the whole budget: its final figure
    assert q.heldout_within(curve, np.cumsum([512] * 4), 4 * 512) == 0.4
    # dynamic sampling at 900 rollouts a step: 1,800 fit in 2,048, 2,700 do not
    assert q.heldout_within(curve, np.cumsum([900] * 4), 4 * 512) == 0.2
    # a first step already past the budget has no figure at equal cost
    assert np.isnan(q.heldout_within(curve, np.cumsum([5000] * 4), 4 * 512))
