"""An additive latent-logit predictor of each task's reward statistics, learned online (beyond the paper).

**Beyond the paper** (config ``predictor: additive_logit``; the paper's Eq. 3-13 are ``predictor: paper``).

Why.  The paper (and ``relations.py``) predicts each statistic y in {v, m, d} by shrinking averages of the
neighbours' *realised* y toward fixed references with fixed strengths (Eq. 3-4).  A group of K = 8 rewards
measures its variance very noisily, the neighbours' variances do not move additively (the variance is hump-shaped
in the policy's margin on a task), and how much each source says is never fitted.  What decides a task's expected
group variance is its success margin: for a binary reward the expected population variance of K rollouts is
(K - 1) / K p (1 - p), and a partial-credit reward's is hump-shaped in the same margin.  So this predictor models
the margin itself, on the logit scale where the sources of difficulty add, fits how much each source explains from
every group observed so far, and scores each task by the variance that margin implies.

Model (a linear mixed model, the Gaussian-process view of ridge regression with an additive kernel).  Each
observed group o of task i gives the empirical logit of its mean reward m (Eq. 2) and that logit's sampling
variance (the standard small-sample forms, K = ``rollouts_per_task``)

    y_o = log((K m + 1/2) / (K (1 - m) + 1/2)),     s_o^2 = (K + 1) (K + 2) / (K (K m + 1) (K (1 - m) + 1)),

the Bernoulli form scaled by delta, the recency-weighted mean observed dispersion d (Eq. 9) clipped to
[0.05, 1] (partial credit spreads less than 0/1 rewards of the same mean).  Observations age with the half-life
weights of Eq. 10, w_o = 2^{-(t - s_o) / h} (h = ``predictor_half_life``): one of weight w counts as one of
variance n_o = delta s_o^2 / w_o.  The task's latent logit when group o was drawn is

    z_o = mu + sd_env a_{e(i)} + sd_struct x_i^T b + sd_drift c^T F_o + g_i,    a, b, c ~ N(0, I),  g_i ~ N(0, tau^2),

with e(i) the task's environment (the environment reference), x_i its row of the S_abs view ``StaticGraph.x_abs``
(the abstract operation structure the cross-environment relation compares: the structure reference), g_i the
task's own deviation (its own history), mu the global reference (unpenalised), and F_o the drift features: the
reward spread sqrt(v) (Eq. 2) summed over the groups observed before step s_o in the task's environment, of the
task itself and over the whole pool, each divided by its largest current total (over environments, over tasks)
(a policy learns where its groups had spread: GRPO learns nothing from a group without it; ``predictor_drift_sd``
= 0 leaves them out).  For the prediction at t the features are the current totals, so c says how far the
logits moved with the training so far.  Given tau^2, the generalised-least-squares fit of the fixed part, one row per
observed group, is a ridge regression (:func:`weighted_ridge`, scikit-learn's ``Ridge`` by its normal equations;
alpha = 1 on the scaled features, sample weights 1 / (tau^2 + n_o); the groups of one task are treated as
independent there).  Per task the residuals
r_o = y_o - f_o pool to a precision P_i = sum_o 1 / n_o and a mean r-bar_i = sum_o r_o / n_o / P_i; tau^2 is
estimated by moments, tau^2 = mean_i(r-bar_i^2 - 1 / P_i), floored at ``predictor_task_sd_floor``^2
(``predictor_task_sd`` until ``predictor_min_tasks`` tasks are observed), and the fit is redone with it once.  Each
task then gets its posterior (BLUP) logit

    z-hat_i = f_i + k_i r-bar_i,   k_i = tau^2 / (tau^2 + 1 / P_i),   f_i the fixed part at t,
    var_i  = (1 - k_i) tau^2 + u_{e(i)},  u_e = 1 / (1 / sd_env^2 + sum_{j in e, observed} 1 / (tau^2 + 1 / P_j)),

u_e the approximate posterior variance of the environment's effect (an environment never observed keeps its prior
sd_env^2); a task without own history has P_i = 0, so k_i = 0 and var_i = tau^2 + u_e.

Score.  The expected Bernoulli variance of the posterior, E[sigma(z)(1 - sigma(z))] with z ~ N(z-hat_i, var_i),
by Gauss-Hermite quadrature (``numpy.polynomial.hermite_e.hermegauss``, ``predictor_quadrature_nodes``
nodes): the variance a task chosen now is expected to show, its uncertainty included (a far-off margin known
only vaguely may still land near 1/2).  ``predictor_score: variance`` (default): q = that variance / 0.25 (its
maximum), so the exposure discount q omega of the exploitation phase (EnvSched Sec. 2.4) trades variance against
exposure in variance units; ``rank``: q = pr(that variance) (Eq. 8), as the paper's q.  The Prediction's m is
E[sigma(z)], its v that variance times delta (a constant factor, so the ranking is the variance's), d = delta,
f = v and u = u_long = u_short = the expected variance (no decline term of Eq. 13: the drift terms and the
half-life already age the evidence).

Fallbacks.  No observation before t: every task gets the prior (all alike, m = 1/2).  One environment,
one observed task, an S_abs view without columns: the same formulas (the ridge shrinks what the data cannot
identify to mu; a feature whose total is 0 stays 0).  The fit is a function of the observation log alone, so a restored scheduler predicts the same
floats (no state of its own).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
from numpy.polynomial.hermite_e import hermegauss
from scipy.sparse.linalg import spsolve

from .config import EnvSchedConfig
from .estimate import ObservationLog, Prediction, percentile_rank

QUADRATURE_ROWS = 1 << 16  # tasks a block of the quadrature (its temporaries: rows x nodes floats each)
DISPERSION_FLOOR = 0.05  # least delta in the sampling variance delta s^2 (a pool of near-constant groups)


@dataclass
class LogitFit:
    """What ``fit_additive_logit`` returns: per task the posterior logit and its variance, and the fitted parts."""

    z: np.ndarray  # posterior mean of the latent logit z_i
    z_var: np.ndarray  # its posterior variance
    prior: np.ndarray  # f_i = mu + sd_env a_e + sd_struct x_i^T b (the fixed part alone)
    precision: np.ndarray  # P_i (0: no own history)
    tau2: float  # the task-level variance tau^2 used
    intercept: float  # mu
    dispersion: float  # recency-weighted mean of the observed d (1.0 without observations)


def empirical_logit(m: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(y, s^2): the empirical logit of a group mean m of k rewards and its sampling variance (module docstring)."""
    m = np.asarray(m, dtype=np.float64)
    y = np.log((k * m + 0.5) / (k * (1.0 - m) + 0.5))
    s2 = (k + 1.0) * (k + 2.0) / (k * (k * m + 1.0) * (k * (1.0 - m) + 1.0))
    return y, s2


def design_matrix(env: np.ndarray, x_struct: sp.spmatrix | None, n_envs: int, cfg: EnvSchedConfig) -> sp.csr_matrix:
    """[sd_env * one-hot(environment) | sd_struct * x_abs]: a ridge of alpha 1 on it puts the priors N(0, sd^2)
    of the module docstring on the environment effects and the structure coefficients."""
    env = np.asarray(env, dtype=np.int64)
    n = len(env)
    onehot = sp.csr_matrix((np.full(n, cfg.predictor_env_sd), (np.arange(n), env)), shape=(n, max(n_envs, 1)))
    if x_struct is None or x_struct.shape[1] == 0 or cfg.predictor_structure_sd == 0:
        return onehot
    if x_struct.shape[0] != n:
        raise ValueError(f"predictor: the structure view has {x_struct.shape[0]} rows for {n} tasks")
    return sp.hstack([onehot, sp.csr_matrix(x_struct, dtype=np.float64) * cfg.predictor_structure_sd], format="csr")


def weighted_ridge(X: sp.spmatrix, node: np.ndarray, F: np.ndarray | None, y: np.ndarray, sample_weight: np.ndarray,
                   alpha: float = 1.0) -> tuple[np.ndarray, float]:
    """(coef, intercept) minimising sum_o w_o (y_o - a_o coef - intercept)^2 + alpha |coef|^2 over the rows
    a_o = [X[node_o] | F_o] (a task's design row, then the observation's own features; F None: none): scikit-learn's
    ``Ridge(alpha, fit_intercept=True).fit(A, y, sample_weight=w)`` on the stacked rows (the test compares them).

    Solved by its normal equations with the intercept as an unpenalised column, A_1^T W A_1 + diag(alpha, ..., 0),
    sparse (``scipy.sparse.linalg.spsolve``: the environments' one-hot block is diagonal, so the system stays sparse
    at thousands of environments).  The X block of the Gram sums the weights per task first, X_u^T diag(W_u) X_u
    over the observed tasks u, so it costs one pass over their rows however many groups each has had; Ridge's
    iterative sparse solvers pass over every observed group many times (and its direct solver refuses a sparse A
    with an intercept), a cost that grew with the run."""
    w = np.asarray(sample_weight, dtype=np.float64)
    tasks, row = np.unique(np.asarray(node, dtype=np.int64), return_inverse=True)
    Xu = sp.csr_matrix(X[tasks], dtype=np.float64)
    ones = np.ones((len(w), 1))
    Fa = ones if F is None else np.hstack([np.asarray(F, dtype=np.float64).reshape(len(w), -1), ones])
    per_task = lambda v: np.bincount(row, weights=v, minlength=len(tasks))
    W_u = per_task(w)
    WF_u = np.column_stack([per_task(w * col) for col in Fa.T])
    xf = Xu.T @ WF_u
    gram = sp.bmat([[Xu.T @ Xu.multiply(W_u[:, None]), sp.csr_matrix(xf)],
                    [sp.csr_matrix(xf.T), sp.csr_matrix(Fa.T @ (w[:, None] * Fa))]], format="csc")
    penalty = np.full(gram.shape[0], float(alpha))
    penalty[-1] = 0.0
    wy = w * np.asarray(y, dtype=np.float64)
    rhs = np.concatenate([Xu.T @ per_task(wy), Fa.T @ wy])
    sol = np.atleast_1d(spsolve(gram + sp.diags(penalty, format="csc"), rhs))
    return sol[:-1], float(sol[-1])


def exposure_before(group: np.ndarray, step: np.ndarray, signal: np.ndarray, n_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """(before, now): per observation, the sum of ``signal`` over the observations of its group (environment, task,
    ...) at strictly earlier steps; per group, the sum over all the observations given."""
    group, step = np.asarray(group, dtype=np.int64), np.asarray(step, dtype=np.int64)
    signal = np.asarray(signal, dtype=np.float64)
    n = len(group)
    order = np.lexsort((step, group))
    g, s = group[order], step[order]
    cs = np.concatenate([[0.0], np.cumsum(signal[order])])
    idx = np.arange(n)
    new_block = np.ones(n, dtype=bool)
    new_block[1:] = (g[1:] != g[:-1]) | (s[1:] != s[:-1])
    new_group = np.ones(n, dtype=bool)
    new_group[1:] = g[1:] != g[:-1]
    block_start = np.maximum.accumulate(np.where(new_block, idx, 0)) if n else idx
    group_start = np.maximum.accumulate(np.where(new_group, idx, 0)) if n else idx
    before = np.empty(n)
    before[order] = cs[block_start] - cs[group_start]
    return before, np.bincount(group, weights=signal, minlength=n_groups)


def fit_additive_logit(node: np.ndarray, step: np.ndarray, m: np.ndarray, v: np.ndarray, d: np.ndarray, t: float,
                       env: np.ndarray, x_struct: sp.spmatrix | None, cfg: EnvSchedConfig, n_envs: int | None = None,
                       design: sp.csr_matrix | None = None) -> LogitFit:
    """The fit of the module docstring for selection ``t`` from the logged groups (node, step, m, v, d: Eq. 2 / 9)
    with step < t; ``env``: environment code per task, ``x_struct``: the S_abs view (one row per task; None:
    environment only).  ``design``: ``design_matrix(env, x_struct, n_envs, cfg)`` when the caller keeps it (it
    depends on the pool and the config only; at a million tasks building it is seconds a step)."""
    env = np.asarray(env, dtype=np.int64)
    n = len(env)
    n_envs = (int(env.max()) + 1 if n else 0) if n_envs is None else int(n_envs)
    K, h = cfg.rollouts_per_task, cfg.predictor_half_life
    tau2 = cfg.predictor_task_sd ** 2
    step_all = np.asarray(step, dtype=np.int64)
    keep = step_all < t
    if not keep.any():  # no evidence: the prior, every task alike
        var = np.full(n, tau2 + cfg.predictor_env_sd ** 2)
        return LogitFit(np.zeros(n), var, np.zeros(n), np.zeros(n), tau2, 0.0, 1.0)
    node_o, step_o = np.asarray(node, dtype=np.int64)[keep], step_all[keep]
    m_o, v_o = np.asarray(m, dtype=np.float64)[keep], np.asarray(v, dtype=np.float64)[keep]
    w = np.power(2.0, -(t - step_o.astype(np.float64)) / h)
    dispersion = float(np.sum(w * np.asarray(d, dtype=np.float64)[keep]) / np.sum(w))
    delta = min(max(dispersion, DISPERSION_FLOOR), 1.0)
    y, s2 = empirical_logit(m_o, K)
    noise_o = delta * s2 / w  # an aged observation counts as a noisier one
    # the fixed part: environment, structure and (drift) the reward spread trained on so far (module docstring)
    X = design_matrix(env, x_struct, n_envs, cfg) if design is None else design
    if X.shape[0] != n:
        raise ValueError(f"predictor: the design matrix has {X.shape[0]} rows for {n} tasks")
    X_o, F_o, F_now = X[node_o], None, None
    if cfg.predictor_drift_sd > 0:
        spread = np.sqrt(np.maximum(v_o, 0.0))
        before, now = [], []
        for group, n_groups in ((env[node_o], n_envs), (node_o, n), (np.zeros(len(node_o), dtype=np.int64), 1)):
            b, c = exposure_before(group, step_o, spread, n_groups)
            before.append(b)
            now.append(c)
        now_rows = [now[0][env], now[1], np.full(n, now[2][0])]
        scale = [max(float(c.max()), 1e-12) for c in now]
        F_o = np.column_stack([b / sc for b, sc in zip(before, scale)]) * cfg.predictor_drift_sd
        F_now = np.column_stack([c / sc for c, sc in zip(now_rows, scale)]) * cfg.predictor_drift_sd
    prec_o = 1.0 / noise_o
    P = np.bincount(node_o, weights=prec_o, minlength=n)
    obs = np.flatnonzero(P > 0)
    floor2 = cfg.predictor_task_sd_floor ** 2
    for rnd in range(2):
        coef, intercept = weighted_ridge(X, node_o, F_o, y, 1.0 / (tau2 + noise_o))
        resid = y - X_o @ coef[: X.shape[1]] - intercept
        if F_o is not None:
            resid -= F_o @ coef[X.shape[1]:]
        rbar = np.bincount(node_o, weights=prec_o * resid, minlength=n)[obs] / P[obs]
        if rnd or len(obs) < cfg.predictor_min_tasks:
            break
        tau2 = max(float(np.mean(rbar ** 2 - 1.0 / P[obs])), floor2)
    # the fixed part of every task at t: the fitted [X | F_now] coef + intercept without stacking the pool's rows
    prior = X @ coef[: X.shape[1]] + intercept
    if F_now is not None:
        prior += F_now @ coef[X.shape[1]:]
    gain = np.zeros(n)
    gain[obs] = tau2 / (tau2 + 1.0 / P[obs])
    z = prior.copy()
    z[obs] += gain[obs] * rbar
    env_prec = np.bincount(env[obs], weights=1.0 / (tau2 + 1.0 / P[obs]), minlength=n_envs)
    u_env = 1.0 / (1.0 / cfg.predictor_env_sd ** 2 + env_prec) if cfg.predictor_env_sd > 0 else np.zeros(n_envs)
    z_var = (1.0 - gain) * tau2 + u_env[env]
    return LogitFit(z, z_var, prior, P, tau2, intercept, dispersion)


def expected_bernoulli_variance(z: np.ndarray, z_var: np.ndarray, nodes: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """(E[sigma(z)], E[sigma(z)(1 - sigma(z))]) for z ~ N(z, z_var), by Gauss-Hermite quadrature (probabilists'
    weights, ``nodes`` points; exact for z_var = 0)."""
    x, wq = hermegauss(nodes)
    wq = wq / wq.sum()
    z = np.asarray(z, dtype=np.float64)
    sd = np.sqrt(np.maximum(np.asarray(z_var, dtype=np.float64), 0.0))
    mean, var = np.empty(len(z)), np.empty(len(z))
    for a in range(0, len(z), QUADRATURE_ROWS):  # rows x nodes temporaries, bounded at a million tasks
        rows = slice(a, a + QUADRATURE_ROWS)
        p = 0.5 * (1.0 + np.tanh(0.5 * (z[rows, None] + sd[rows, None] * x[None, :])))  # sigma(z), overflow-free
        mean[rows], var[rows] = p @ wq, (p * (1.0 - p)) @ wq
    return mean, var


def predict_additive_logit(log: ObservationLog, t: int, task_ids: list[str], env: np.ndarray, x_struct: sp.spmatrix | None,
                           cfg: EnvSchedConfig, n_envs: int | None = None, design: sp.csr_matrix | None = None) -> Prediction:
    """The Prediction of selection ``t`` under ``predictor: additive_logit`` (module docstring): q = pr(expected
    variance) (Eq. 8), m = E[sigma(z)], v = dispersion x expected Bernoulli variance; ``design`` as in
    ``fit_additive_logit``."""
    obs = log.arrays()
    fit = fit_additive_logit(obs["node"], obs["step"], obs["m"], obs["v"], obs["d"], t, env, x_struct, cfg, n_envs, design)
    m_hat, ev = expected_bernoulli_variance(fit.z, fit.z_var, cfg.predictor_quadrature_nodes)
    v = fit.dispersion * ev
    q = percentile_rank(ev) if cfg.predictor_score == "rank" else np.clip(ev / 0.25, 0.0, 1.0)
    d = np.full(len(task_ids), fit.dispersion)
    return Prediction(task_ids=task_ids, v=v, m=m_hat, d=d, f=v.copy(), u_long=ev, u_short=ev, u=ev, q=q,
                      reference={"m": float(np.mean(m_hat)) if len(m_hat) else 0.0, "v": float(np.mean(v)) if len(v) else 0.0,
                                 "d": fit.dispersion, "tau2": fit.tau2, "intercept": fit.intercept}, step=t)
