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
``VIPSampler`` is the one baseline that reads task text: it predicts success rates with scikit-learn's
``GaussianProcessRegressor`` over TF-IDF features of the instructions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from scipy.special import betaln, expit, logit
from scipy.stats import rankdata
from sklearn.decomposition import TruncatedSVD
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.gaussian_process import GaussianProcessRegressor
from sklearn.gaussian_process.kernels import RBF
from sklearn.preprocessing import normalize


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


def instruction_features(pool, n_components: int = 32, seed: int = 0) -> np.ndarray:
    """Unit-length prompt embeddings of the pool's tasks: TF-IDF of each task's instruction (scikit-learn's
    ``TfidfVectorizer``, sublinear tf), projected on its ``n_components`` leading singular directions
    (``TruncatedSVD``) and L2-normalised, so that distances lie in [0, 2] as between the unit sentence embeddings
    VIP's kernel is defined on.  Raises ValueError when the instructions hold no term (a text-free pool)."""
    texts = [t.instruction for t in pool.tasks]
    try:
        x = TfidfVectorizer(sublinear_tf=True).fit_transform(texts)
    except ValueError:  # empty vocabulary
        raise ValueError("VIPSampler: the pool's instructions hold no terms to embed; VIP reads task text") from None
    k = max(1, min(n_components, x.shape[0] - 1, x.shape[1] - 1))
    return normalize(TruncatedSVD(k, random_state=seed).fit_transform(x))


class VIPSampler(_Baseline):
    """VIP: a Gaussian-process prediction of each task's success rate, and the batch chosen by its predicted
    Bernoulli variance.

    Source: Nguyen, Nguyen, Ma, Zhao, She & Nguyen (2026), "Adaptive Rollout Allocation for Online Reinforcement
    Learning with Verifiable Rewards" (VIP, ICLR 2026, arXiv 2602.01601).
    * Prediction: p_q = sigmoid(g(x_q)) with a latent g ~ GP(m_t, k) over prompt embeddings x_q and the RBF kernel
      k(x, x') = exp(-|x - x'|^2 / (2 h^2)).  A group's mean reward R_q becomes the latent observation
      g_hat_q = logit(clip(R_q, eps, 1 - eps)), and each step the prior mean moves to the GP posterior mean given
      the observations of the last ``window_steps`` steps (the latest one per task), X = their tasks:
          m_{t+1}(x) = m_t(x) + k(x, X) [k(X, X) + sigma^2 I]^{-1} (g_hat_X - m_t(X)),
          var_{t+1}(x) = k(x, x) - k(x, X) [k(X, X) + sigma^2 I]^{-1} k(X, x)   (``posterior``),
      p_hat_q = sigmoid(m_{t+1}(x_q)).  Defaults are the authors' released settings: h = 0.4 on unit-length embeddings,
      sigma^2 = 1e-4, m_0 = -1 (p = 0.27), a window of 3 steps, eps = 1e-6.
    * Variance: the per-prompt gradient variance of Dr. GRPO, (n - 1) / n^2 * 4 sigma_Z^2 p (1 - p), and of RLOO,
      4 sigma_Z^2 p (1 - p) / (n - 1), with n rollouts, both scale with the Bernoulli variance p (1 - p) of a 0/1
      reward (with partial credit in [0, 1], p (1 - p) bounds the reward variance of a task with mean p);
      a_q = p_hat_q (1 - p_hat_q) is its prediction.
    * Allocation: VIP splits a rollout budget over the prompts of the incoming batch by a convex program (minimise
      the summed per-prompt gradient variance a_q c(n_q) over n_q, sum_q n_q = budget, bounds on n_q, c(n) the
      Dr. GRPO or RLOO factor above); each prompt's term is a_q times a function of n_q alone, so the optimal n_q
      grows with a_q.  Adapted to fixed B x K batches, every allocation is n_q in {0, K} with exactly B prompts at
      K, and the prompts' terms at K differ only through a_q: the K rollouts go to the B prompts of largest a_q
      (``top_b``, ties at random).  The incoming batch is the whole pool (as for ``ThompsonSampler``), or, with
      ``candidate_factor`` c, c x B tasks drawn uniformly each step (VIP's data-loader batch).
    The prompt embedding is ``instruction_features`` (TF-IDF + truncated SVD of the instruction, standing in for the
    sentence embedding VIP uses).  Observed tasks keep their updated latent mean; unobserved tasks far from any
    observation keep m_0, the exploration VIP gets from its prior.

    Cost, with N tasks, d embedding dimensions and w <= window_steps x B tasks in the window: building the
    features is one TF-IDF pass over the instructions and a randomized SVD (O(nnz x d)); each observe factorises
    the w x w kernel matrix (O(w^3 + w^2 d)) and moves the mean of every task (O(N w d)); each select scores and
    ranks the pool (O(N)).  Memory is O(N d).
    """

    phase = "vip"

    def __init__(self, pool, batch_size: int = 64, rollouts_per_task: int = 8, seed: int = 0, *,
                 length_scale: float = 0.4, noise: float = 1e-4, prior_mean: float = -1.0, window_steps: int = 3,
                 clip: float = 1e-6, n_components: int = 32, candidate_factor: int | None = None):
        super().__init__(pool, batch_size, rollouts_per_task, seed)
        if window_steps < 1:
            raise ValueError(f"window_steps must be >= 1, got {window_steps}")
        if not 0.0 < clip < 0.5:
            raise ValueError(f"clip must be in (0, 0.5), got {clip}")
        if candidate_factor is not None and candidate_factor < 1:
            raise ValueError(f"candidate_factor must be >= 1 or None, got {candidate_factor}")
        self.noise, self.prior_mean, self.window_steps = noise, prior_mean, window_steps
        self.clip, self.candidate_factor = clip, candidate_factor
        self.kernel = RBF(length_scale, length_scale_bounds="fixed")
        self.features = instruction_features(pool, n_components)
        self.latent_mean = np.full(self.n, float(prior_mean))  # m_t over the pool
        self.window: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # step -> (tasks, g_hat) observed at it
        self.gp: GaussianProcessRegressor | None = None  # the last step's posterior over the window
        self._exclude = np.zeros(self.n, dtype=bool)

    def select(self, step: int, exclude: Sequence[str] | np.ndarray | None = None) -> list[str]:
        """The step's B tasks; ``exclude`` (task ids, or a bool mask over the pool) are never chosen.  Raises
        ValueError when fewer than B tasks remain."""
        mask = self._exclude_mask(step, exclude)
        if step not in self.selections and self.n - int(mask.sum()) < self.B:
            raise ValueError(f"select({step}): {int(mask.sum())} of {self.n} tasks excluded, fewer than B = {self.B} left")
        self._exclude = mask
        return super().select(step)

    def _exclude_mask(self, step: int, exclude: Sequence[str] | np.ndarray | None) -> np.ndarray:
        mask = np.zeros(self.n, dtype=bool)
        if isinstance(exclude, np.ndarray) and exclude.dtype == bool:
            if exclude.shape != (self.n,):
                raise ValueError(f"select({step}): an exclude mask must have the pool's shape ({self.n},), got {exclude.shape}")
            mask[:] = exclude
        elif exclude is not None:
            try:
                mask[self.pool.indices(list(exclude))] = True
            except KeyError as exc:
                raise ValueError(f"select({step}): exclude holds {exc.args[0]}") from None
        return mask

    def success_rate(self) -> np.ndarray:
        """p_hat = sigmoid(m_t) for every task of the pool."""
        return expit(self.latent_mean)

    def score(self) -> np.ndarray:
        """a = p_hat (1 - p_hat): the predicted Bernoulli variance the allocation ranks by."""
        p = self.success_rate()
        return p * (1.0 - p)

    def posterior(self, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(m_t, var_t) of the latent g at ``nodes``: the recursive mean, and the GP variance given the window (the
        prior variance k(x, x) = 1 before any observation)."""
        nodes = np.asarray(nodes, dtype=np.int64)
        if self.gp is None:
            return self.latent_mean[nodes].copy(), np.ones(len(nodes))
        _, sd = self.gp.predict(self.features[nodes], return_std=True)
        return self.latent_mean[nodes].copy(), sd**2

    def _choose(self, step: int) -> np.ndarray:
        free = np.flatnonzero(~self._exclude)
        if self.candidate_factor is not None:
            free = self.rng.choice(free, size=min(len(free), self.candidate_factor * self.B), replace=False)
        return top_b(self.score(), self.B, self.rng, free)

    def _update(self, step: int, nodes: np.ndarray, groups: list[np.ndarray]) -> None:
        if not len(nodes):
            return
        g_hat = logit(np.clip([g.mean() for g in groups], self.clip, 1.0 - self.clip))
        if step in self.window:  # a step observed in pieces
            old_nodes, old_g = self.window[step]
            nodes, g_hat = np.concatenate([old_nodes, nodes]), np.concatenate([old_g, g_hat])
        self.window[step] = (nodes, g_hat)
        for s in [s for s in self.window if s <= step - self.window_steps]:
            del self.window[s]
        x, g = self._window_data()
        gp = GaussianProcessRegressor(self.kernel, alpha=self.noise, optimizer=None)
        self.gp = gp.fit(self.features[x], g - self.latent_mean[x])
        self.latent_mean += gp.predict(self.features)

    def _window_data(self) -> tuple[np.ndarray, np.ndarray]:
        """The window's tasks and their latest latent observations (later steps, and later pieces, win)."""
        nodes = np.concatenate([self.window[s][0] for s in sorted(self.window)])
        g = np.concatenate([self.window[s][1] for s in sorted(self.window)])
        last = len(nodes) - 1 - np.unique(nodes[::-1], return_index=True)[1]
        return nodes[last], g[last]
