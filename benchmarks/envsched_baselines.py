"""Task-selection baselines for ``benchmarks/envsched_quality.py``: what a practitioner would pick instead of EnvSched.

Comparison arms of the benchmark, not part of ``envsched``'s library API.  Each one has EnvScheduler's interface
as the benchmark drives it: ``select(step) -> [task_id]`` (B distinct tasks), ``observe(step, {task_id: [r_1..r_K]})
-> metrics``, plus ``refill(step) -> [task_id]`` (tasks to roll out before the step can train; empty except for
dynamic sampling) and ``kept(step) -> [task_id]`` (the groups the step trains on: the whole batch except for
dynamic sampling).  ``selection_phases[step]`` names the rule that picked each task.

Rewards lie in [0, 1] (partial credit or 0/1).  The per-task Beta posteriors of the learnability and Thompson arms
count a group's rewards as fractional successes, ``alpha += sum(r)``, ``beta += sum(1 - r)`` (the Beta-Bernoulli
update when rewards are 0/1; with partial credit the posterior is over the task's mean reward).  Beta moments come
from ``scipy.special.betaln``, Beta draws from ``numpy.random.Generator.beta``, ranks from ``scipy.stats.rankdata``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from scipy.special import betaln
from scipy.stats import rankdata


def top_b(score: np.ndarray, b: int, rng: np.random.Generator, candidates: np.ndarray | None = None) -> np.ndarray:
    """Indices of the ``b`` largest ``score`` values among ``candidates`` (default: all), ties at the boundary
    broken uniformly at random (so the unobserved tasks that share a prior score are drawn fairly)."""
    idx = np.arange(len(score)) if candidates is None else np.asarray(candidates)
    s = score[idx]
    b = min(b, len(idx))
    if b == 0:
        return idx[:0]
    thr = np.partition(s, len(s) - b)[len(s) - b]
    above = idx[s > thr]
    tied = idx[s == thr]
    return np.concatenate([above, rng.choice(tied, size=b - len(above), replace=False)])


def beta_expected_learnability(alpha: np.ndarray, beta: np.ndarray, target: str, k: int = 8) -> np.ndarray:
    """Posterior expectation of a task's learnability under p ~ Beta(alpha, beta).

    ``target="bernoulli"``: E[p (1 - p)] = B(a + 1, b + 1) / B(a, b), the learnability L = p (1 - p) of Foster et al.
    (2025, "Learning to Reason at the Frontier of Learnability");
    ``target="grpo"``: E[1 - p^K - (1 - p)^K] = 1 - B(a + K, b) / B(a, b) - B(a, b + K) / B(a, b), the probability
    that a group of K rollouts has any reward spread, i.e. a non-zero GRPO advantage.
    """
    alpha, beta = np.asarray(alpha, dtype=float), np.asarray(beta, dtype=float)
    base = betaln(alpha, beta)
    if target == "bernoulli":
        return np.exp(betaln(alpha + 1, beta + 1) - base)
    if target == "grpo":
        return 1.0 - np.exp(betaln(alpha + k, beta) - base) - np.exp(betaln(alpha, beta + k) - base)
    raise ValueError(f"target must be 'bernoulli' or 'grpo', got {target!r}")


class _Baseline:
    """Bookkeeping shared by the baselines: pool indices, the step's batch and its phases, seeded generator."""

    phase = "baseline"

    def __init__(self, pool, batch_size: int = 64, rollouts_per_task: int = 8, seed: int = 0):
        if batch_size > len(pool):
            raise ValueError(f"batch_size {batch_size} exceeds the pool size {len(pool)}")
        self.pool, self.env = pool, pool.env
        self.n, self.B, self.K = len(pool), int(batch_size), int(rollouts_per_task)
        self.rng = np.random.default_rng(seed)
        self.selections: dict[int, np.ndarray] = {}
        self.selection_phases: dict[int, list[str]] = {}

    def select(self, step: int) -> list[str]:
        if step not in self.selections:
            sel = np.asarray(self._choose(int(step)), dtype=np.int64)
            self.selections[step] = sel
            self.selection_phases[step] = self._phases(sel)
        return [self.pool.task_ids[i] for i in self.selections[step]]

    def observe(self, step: int, rewards: Mapping[str, Sequence[float]]) -> dict[str, float]:
        nodes = self.pool.indices(list(rewards))
        groups = [np.asarray(r, dtype=float) for r in rewards.values()]
        self._update(int(step), nodes, groups)
        var = np.array([g.var() for g in groups])
        return {"envsched/realized_var_mean": float(var.mean()),
                "envsched/envs_per_batch": float(len(np.unique(self.env[nodes])))}

    def refill(self, step: int) -> list[str]:
        return []

    def kept(self, step: int) -> list[str]:
        return [self.pool.task_ids[i] for i in self.selections[step]]

    def _phases(self, sel: np.ndarray) -> list[str]:
        return [self.phase] * len(sel)

    def _choose(self, step: int) -> np.ndarray:
        raise NotImplementedError

    def _update(self, step: int, nodes: np.ndarray, groups: list[np.ndarray]) -> None:
        pass


class _BetaPosterior(_Baseline):
    """Per-task Beta(alpha, beta) over the task's success rate, starting at the prior Beta(a0, b0); each observed
    group moves it by ``alpha <- lam * alpha + (1 - lam) * a0 + sum(r)`` (and ``beta`` with ``1 - r``).  ``lam = 1``
    is the plain conjugate update; ``lam < 1`` forgets old evidence toward the prior (MoPPS's streaming update)."""

    def __init__(self, pool, batch_size: int = 64, rollouts_per_task: int = 8, seed: int = 0, *,
                 prior: tuple[float, float] = (1.0, 1.0), decay: float = 1.0):
        super().__init__(pool, batch_size, rollouts_per_task, seed)
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.a0, self.b0 = prior
        self.decay = decay
        self.alpha = np.full(self.n, self.a0)
        self.beta = np.full(self.n, self.b0)

    def _update(self, step: int, nodes: np.ndarray, groups: list[np.ndarray]) -> None:
        s = np.array([g.sum() for g in groups])
        f = np.array([(1.0 - g).sum() for g in groups])
        lam = self.decay
        self.alpha[nodes] = lam * self.alpha[nodes] + (1 - lam) * self.a0 + s
        self.beta[nodes] = lam * self.beta[nodes] + (1 - lam) * self.b0 + f


class LearnabilitySampler(_BetaPosterior):
    """Per-task learnability sampling: each step trains on the B tasks of highest posterior expected learnability.

    Source: Foster, Sims, Forkel, Fellows & Foerster (2025), "Learning to Reason at the Frontier of Learnability"
    (arXiv 2502.12272), sampling for learnability:
    learnability L(q) = p_q (1 - p_q), largest for tasks solved half the time, where the gradient of a 0/1 reward
    has the most variance; here p_q is not re-estimated with extra rollouts but kept as a Beta posterior per task
    from the groups already trained on, and the score is E[L] under it (``beta_expected_learnability``).
    ``target="grpo"`` scores E[1 - p^K - (1 - p)^K] instead: the probability that the K rollouts of a GRPO group
    disagree (a zero-spread group carries no advantage: the groups DAPO's dynamic sampling drops).  Unobserved tasks
    keep the prior Beta(1, 1) (E[p(1 - p)] = 1/6, E[1 - p^8 - (1 - p)^8] = 7/9), so a task measured far from p = 0.5
    drops below them and the pool gets explored; ties are broken at random (``top_b``).
    """

    def __init__(self, pool, batch_size: int = 64, rollouts_per_task: int = 8, seed: int = 0, *,
                 target: str = "bernoulli", prior: tuple[float, float] = (1.0, 1.0)):
        super().__init__(pool, batch_size, rollouts_per_task, seed, prior=prior)
        beta_expected_learnability(np.ones(1), np.ones(1), target, self.K)  # validates target
        self.target = target
        self.phase = f"learnability_{target}"

    def score(self) -> np.ndarray:
        return beta_expected_learnability(self.alpha, self.beta, self.target, self.K)

    def _choose(self, step: int) -> np.ndarray:
        return top_b(self.score(), self.B, self.rng)


class ThompsonSampler(_BetaPosterior):
    """MoPPS-style prompt selection by posterior sampling, without extra rollouts.

    Source: Qu et al. (2025), "Can Prompt Difficulty be Online Predicted for Accelerating RL Finetuning of
    Reasoning Models?" (MoPPS, arXiv 2507.04632): each task's success rate is a latent Beta-Bernoulli variable,
    updated after each of its groups by the streaming (discounted) Beta update of ``_BetaPosterior`` (``decay`` =
    their forgetting factor; 1.0 here unless set), and each step draws p_hat_i ~ Beta(alpha_i, beta_i) for every
    task and keeps the B tasks whose draw is closest to the target success rate gamma* = 0.5 (their top-B rule).
    The same B tasks maximise the sampled variance p_hat (1 - p_hat).  MoPPS draws its candidates from a data
    loader batch ``ts_ratio`` times larger than B; here every task of the pool is a candidate.
    """

    phase = "thompson"

    def __init__(self, pool, batch_size: int = 64, rollouts_per_task: int = 8, seed: int = 0, *,
                 target_rate: float = 0.5, decay: float = 1.0, prior: tuple[float, float] = (1.0, 1.0)):
        super().__init__(pool, batch_size, rollouts_per_task, seed, prior=prior, decay=decay)
        self.target_rate = target_rate

    def _choose(self, step: int) -> np.ndarray:
        p_hat = self.rng.beta(self.alpha, self.beta)
        return top_b(-np.abs(p_hat - self.target_rate), self.B, self.rng)


class DynamicSampler(_Baseline):
    """DAPO's dynamic sampling: over-generate, drop groups without reward spread, refill, pay for every rollout.

    Source: Yu et al. (2025), "DAPO: An Open-Source LLM Reinforcement Learning System at Scale" (arXiv
    2503.14476), §3.2 "Dynamic Sampling": the constraint 0 < |{o_i : is_equivalent(a, o_i)}| < G of its objective,
    enforced by sampling and filtering (verl's ``filter_groups``, with rewards here instead of accuracy): a batch
    of B tasks drawn uniformly at random (as the random arm draws them) is rolled out; groups whose K rewards are
    all equal (zero variance: no GRPO advantage) are discarded; further batches of B tasks (not yet drawn this
    step) are rolled out until B groups with spread are kept, the surplus of the last batch is discarded too, and
    after ``max_rounds`` generation batches (DAPO recipe's ``max_num_gen_batches`` = 10) the step trains on what it
    has.  ``refill="batch"``: refills come in whole batches of B tasks (verl's ``gen_batch_size`` granularity,
    here equal to B, so one missing group costs a whole batch); ``refill="shortfall"`` draws only the missing
    groups (the cheapest form of the rule: its variance per rollout generated is then the random arm's, in
    expectation, since the discarded groups are exactly the zero-variance ones).  ``generated_groups`` /
    ``discarded_groups`` count every group rolled out and every group not trained on: the benchmark divides the
    trained groups' variance by the rollouts generated.
    """

    phase = "dynamic_sampling"

    def __init__(self, pool, batch_size: int = 64, rollouts_per_task: int = 8, seed: int = 0, *,
                 max_rounds: int = 10, refill: str = "batch"):
        super().__init__(pool, batch_size, rollouts_per_task, seed)
        if refill not in ("batch", "shortfall"):
            raise ValueError(f"refill must be 'batch' or 'shortfall', got {refill!r}")
        self.max_rounds, self.refill_mode = max_rounds, refill
        self.generated_groups = 0
        self.discarded_groups = 0
        self._drawn: dict[int, np.ndarray] = {}  # step -> every task drawn this step
        self._kept: dict[int, list[int]] = {}
        self._rounds: dict[int, int] = {}

    def _draw(self, step: int, size: int) -> np.ndarray:
        drawn = self._drawn.get(step, np.zeros(0, dtype=np.int64))
        free = np.setdiff1d(np.arange(self.n), drawn, assume_unique=True)
        batch = self.rng.choice(free, size=min(size, len(free)), replace=False)
        self._drawn[step] = np.concatenate([drawn, batch])
        self._rounds[step] = self._rounds.get(step, 0) + 1
        return batch

    def _choose(self, step: int) -> np.ndarray:
        self._kept[step] = []
        return self._draw(step, self.B)

    def _update(self, step: int, nodes: np.ndarray, groups: list[np.ndarray]) -> None:
        kept = self._kept[step]
        for i, g in zip(nodes.tolist(), groups):
            self.generated_groups += 1
            if g.var() > 0 and len(kept) < self.B:
                kept.append(i)
            else:
                self.discarded_groups += 1

    def refill(self, step: int) -> list[str]:
        """The next generation batch of ``step``, or [] once B groups with spread are kept, the round limit is
        reached or the pool is exhausted."""
        if len(self._kept[step]) >= self.B or self._rounds[step] >= self.max_rounds or len(self._drawn[step]) >= self.n:
            return []
        size = self.B if self.refill_mode == "batch" else self.B - len(self._kept[step])
        return [self.pool.task_ids[i] for i in self._draw(step, size)]

    def kept(self, step: int) -> list[str]:
        return [self.pool.task_ids[i] for i in self._kept[step]]


class PrioritizedLevelReplay(_Baseline):
    """Prioritized Level Replay (PLR) with a GRPO group's mean absolute advantage as the level score.

    Source: Jiang, Grefenstette & Rocktäschel (2021), "Prioritized Level Replay" (ICML, arXiv 2010.03934):
    * score S_i of a level: the paper's best, the L1 value loss (mean |GAE|, ``value_l1`` in its code); with GRPO's
      group mean as the value baseline that is the group's mean absolute advantage mean_k |r_k - mean(r)|, replaced
      by the latest group each time the level is played (the code's ``alpha = 1``);
    * rank prioritisation (Eq. 2): P_S(l_i) = h(S_i)^(1/beta) / sum_j h(S_j)^(1/beta), h(S_i) = 1 / rank(S_i) among
      the seen levels (ties share their average rank), temperature beta = 0.1;
    * staleness (Eq. 3): P_C(l_i) = (c - C_i) / sum_j (c - C_j), c the current step, C_i the step level i was last
      played; mixed as P_replay = (1 - rho) P_S + rho P_C with rho = 0.1 (the paper's Procgen setting);
    * replay decision (Alg. 1): each batch slot replays a seen level with probability P_D = |seen| / |train levels|
      (the paper's proportionate schedule), otherwise plays an unseen level drawn uniformly.
    The B slots are drawn as one batch: Binomial(B, P_D) replays without replacement from P_replay, the rest unseen.
    """

    def __init__(self, pool, batch_size: int = 64, rollouts_per_task: int = 8, seed: int = 0, *,
                 temperature: float = 0.1, staleness_coef: float = 0.1):
        super().__init__(pool, batch_size, rollouts_per_task, seed)
        self.temperature, self.staleness_coef = temperature, staleness_coef
        self.scores = np.zeros(self.n)
        self.last_played = np.zeros(self.n, dtype=np.int64)
        self.seen = np.zeros(self.n, dtype=bool)

    def replay_distribution(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(seen level indices, P_replay over them) at ``step``."""
        idx = np.flatnonzero(self.seen)
        rank = rankdata(-self.scores[idx], method="average")
        p_s = (1.0 / rank) ** (1.0 / self.temperature)
        p_s /= p_s.sum()
        stale = (step - self.last_played[idx]).astype(float)
        p_c = stale / stale.sum() if stale.sum() > 0 else np.full(len(idx), 1.0 / len(idx))
        return idx, (1 - self.staleness_coef) * p_s + self.staleness_coef * p_c

    def _choose(self, step: int) -> np.ndarray:
        n_seen = int(self.seen.sum())
        n_unseen = self.n - n_seen
        n_replay = int(self.rng.binomial(self.B, n_seen / self.n)) if n_seen else 0
        n_replay = max(min(n_replay, n_seen), self.B - n_unseen)
        self._n_replay = n_replay
        out = []
        if n_replay:
            idx, p = self.replay_distribution(step)
            out.append(self.rng.choice(idx, size=n_replay, replace=False, p=p))
        if self.B - n_replay:
            out.append(self.rng.choice(np.flatnonzero(~self.seen), size=self.B - n_replay, replace=False))
        return np.concatenate(out)

    def _phases(self, sel: np.ndarray) -> list[str]:
        return ["replay"] * self._n_replay + ["new"] * (len(sel) - self._n_replay)

    def _update(self, step: int, nodes: np.ndarray, groups: list[np.ndarray]) -> None:
        self.scores[nodes] = [np.abs(g - g.mean()).mean() for g in groups]
        self.last_played[nodes] = step
        self.seen[nodes] = True
