"""Online estimation of task informativeness (EnvSched §2.3, Appendix B, Eq. 2–4 and 6–13).

Every function is vectorised over the whole pool and cites the equation it implements.  Statistics are
indexed by y in {v, m, d}; "h" is a half-life (h_long = 8, h_short = 2 by default).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
from scipy.stats import rankdata, spearmanr

from .config import EnvSchedConfig

STATS = ("v", "m", "d")


# ---------------------------------------------------------------------------------------------------
# Observation statistics
# ---------------------------------------------------------------------------------------------------


def group_statistics(rewards: np.ndarray, dispersion_floor: float = 0.01) -> tuple[float, float, float]:
    """EnvSched Eq. 2 / Eq. 9: mean m, population variance v and mean-corrected dispersion d of one group.

    m = (1/K) sum_k r_k,  v = (1/K) sum_k (r_k - m)^2,  d = clip_[0,1]( v / max(m(1-m), floor) ).
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1 or r.size == 0:
        raise ValueError("a reward group must be a non-empty 1-D sequence")
    if not np.all(np.isfinite(r)):
        raise ValueError(f"non-finite reward in group {r.tolist()}")
    m = float(r.mean())
    v = float(np.var(r))  # ddof=0: population variance over all K rollouts
    d = float(np.clip(v / max(m * (1.0 - m), dispersion_floor), 0.0, 1.0))
    return m, v, d


def half_life_weight(t: float, s: np.ndarray, h: float) -> np.ndarray:
    """EnvSched Eq. 10: w_{t,s}^(h) = 2^{-(t - s) / h}."""
    return np.power(2.0, -(t - np.asarray(s, dtype=np.float64)) / h)


def exposure_factor(count: np.ndarray, c0: float) -> np.ndarray:
    """EnvSched §2.4: omega_{i,t} = (1 + c_{i,t} / c0)^{-1/2}."""
    return (1.0 + np.asarray(count, dtype=np.float64) / c0) ** -0.5


# ---------------------------------------------------------------------------------------------------
# Centering and task histories (Eq. 6, 11)
# ---------------------------------------------------------------------------------------------------


def global_reference(step_values: np.ndarray, steps: np.ndarray, t: float, h: float) -> float:
    """EnvSched Eq. 6 (left): b_t = sum_{s<t} w_{t,s} b_s / sum_{s<t} w_{t,s}; b_s = step mean of y.

    ``step_values[k]`` is b_{steps[k]}.  Only steps s < t count.  Returns 0.0 when no step is available.
    """
    steps = np.asarray(steps, dtype=np.float64)
    keep = steps < t
    if not keep.any():
        return 0.0
    w = half_life_weight(t, steps[keep], h)
    return float(np.sum(w * np.asarray(step_values, dtype=np.float64)[keep]) / np.sum(w))


def center(y: np.ndarray, b_s: np.ndarray, b_t: float, interval: tuple[float, float]) -> np.ndarray:
    """EnvSched Eq. 6 (right): y~_{i,s} = clip_{I_y}( y_{i,s} - b_s + b_t )."""
    return np.clip(np.asarray(y, dtype=np.float64) - b_s + b_t, interval[0], interval[1])


def task_history(node: np.ndarray, step: np.ndarray, y_tilde: np.ndarray, t: float, h: float, n: int, b_t: float) -> tuple[np.ndarray, np.ndarray]:
    """EnvSched Eq. 11: W_{i,t} = sum_{s in H_t(i)} w_{t,s},  y-bar_{i,t} = sum w y~ / W.

    H_t(i) holds the observation steps s < t of task i; a task without history gets W = 0, y-bar = b_t.
    """
    node = np.asarray(node, dtype=np.int64)
    step = np.asarray(step, dtype=np.float64)
    keep = step < t
    w = half_life_weight(t, step[keep], h)
    W = np.bincount(node[keep], weights=w, minlength=n)
    num = np.bincount(node[keep], weights=w * np.asarray(y_tilde)[keep], minlength=n)
    ybar = np.full(n, b_t, dtype=np.float64)
    has = W > 0
    ybar[has] = num[has] / W[has]
    return W, ybar


# ---------------------------------------------------------------------------------------------------
# Neighbour aggregation (Eq. 7, 3) and fusion (Eq. 4)
# ---------------------------------------------------------------------------------------------------


def neighbor_weights(nbr_sim: np.ndarray, nbr_W: np.ndarray, available: np.ndarray, bandwidth_floor: float = 0.05, w_clip: tuple[float, float] = (0.1, 3.0)) -> np.ndarray:
    """EnvSched Eq. 7: adaptive-bandwidth neighbour weights a_ij.

    delta_ij = clip_[0,1](1 - S_ij);  sigma_i = max{ median_{j in N(i)} delta_ij, floor };
    a_ij = exp(-1/2 (delta_ij / sigma_i)^2) * sqrt(clip_[0.1,3](W_j)).
    ``available`` masks the entries of N(i) (unavailable entries get weight 0 and do not enter the median).
    """
    avail = np.asarray(available, dtype=bool)
    kern = neighbor_kernel(nbr_sim, avail, bandwidth_floor)
    a = kern * np.sqrt(np.clip(nbr_W, w_clip[0], w_clip[1]))
    return np.where(avail, a, 0.0)


def neighbor_kernel(nbr_sim: np.ndarray, available: np.ndarray, bandwidth_floor: float = 0.05) -> np.ndarray:
    """The W-independent part of Eq. 7: exp(-1/2 (delta_ij / sigma_i)^2) (shared by both half-lives when
    the available entries are the same)."""
    nbr_sim = np.asarray(nbr_sim, dtype=np.float64)
    avail = np.asarray(available, dtype=bool)
    delta = np.clip(1.0 - np.where(avail, nbr_sim, 0.0), 0.0, 1.0)
    sigma = np.maximum(_masked_row_median(delta, avail), bandwidth_floor)
    return np.exp(-0.5 * (delta / sigma[:, None]) ** 2)


def _masked_row_median(x: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Median of each row over the masked entries (rows with no entry -> 1.0)."""
    n, k = x.shape
    if k == 0:
        return np.ones(n)
    srt = np.sort(np.where(mask, x, np.inf), axis=1)
    c = mask.sum(axis=1)
    lo = np.take_along_axis(srt, np.maximum((c - 1) // 2, 0)[:, None], 1)[:, 0]
    hi = np.take_along_axis(srt, np.minimum(c // 2, k - 1)[:, None], 1)[:, 0]
    return np.where(c > 0, 0.5 * (lo + hi), 1.0)


def relation_estimate(a: np.ndarray, nbr_ybar: np.ndarray, b_t: float, lambda_g: float, a_sum: np.ndarray | None = None) -> np.ndarray:
    """EnvSched Eq. 3: G_i = (sum_j a_ij y-bar_j + lambda_g b_t) / (sum_j a_ij + lambda_g).

    A target with no available neighbour gets b_t (App. B).  ``a_sum``: ``np.sum(a, axis=1)`` when the caller
    has it (the three statistics share the weights, and each sum is an N x K pass).
    """
    num = np.sum(a * nbr_ybar, axis=1) + lambda_g * b_t
    den = (np.sum(a, axis=1) if a_sum is None else a_sum) + lambda_g
    out = np.full(a.shape[0], b_t, dtype=np.float64)
    ok = den > 0
    out[ok] = num[ok] / den[ok]
    return out


def weighted_relation_estimate(
    num: np.ndarray, mass: np.ndarray, b_t: float, lambda_g: float, c: float
) -> np.ndarray:
    """EnvSched Eq. 3 with the relation's evidence mass scaled by its weight c (Eq. 3' of ``envsched/relations.py``,
    which measures c):

        G_i = (c S_i + lambda_g b_t) / (c A_i + lambda_g),  S_i = sum_j a_ij y_j,  A_i = sum_j a_ij;

    b_t where the denominator is 0 (no evidence and lambda_g = 0).  c = 1 gives ``relation_estimate``'s floats."""
    num, mass = np.asarray(num, dtype=np.float64), np.asarray(mass, dtype=np.float64)
    den = c * mass + lambda_g
    out = np.full(num.shape[0], b_t, dtype=np.float64)
    b = np.broadcast_to(b_t, num.shape)
    ok = den > 0
    out[ok] = (c * num[ok] + lambda_g * b[ok]) / den[ok]
    return out


def environment_reference(ybar: np.ndarray, W: np.ndarray, env: np.ndarray, b_t: float, lambda_g: float) -> np.ndarray:
    """Eq. 3 applied to an environment's own observed tasks: the environment level of statistic y,

        e_E = (sum_{j in E} W_j y-bar_j + lambda_g b_t) / (sum_{j in E} W_j + lambda_g),

    returned per task (e_env(i)).  An environment without history gets b_t.  Used by
    ``cross_reference = "environment"`` (``relation_values``)."""
    env = np.asarray(env, dtype=np.int64)
    n_env = int(env.max()) + 1 if env.size else 0
    num = np.bincount(env, weights=W * ybar, minlength=n_env) + lambda_g * b_t
    den = np.bincount(env, weights=W, minlength=n_env) + lambda_g
    e = np.where(den > 0, num / np.where(den > 0, den, 1.0), b_t)
    return e[env]


def relation_values(ybar: np.ndarray, safe: np.ndarray, env_level: np.ndarray | None, interval: tuple[float, float], rows: np.ndarray | None = None) -> np.ndarray:
    """What each neighbour j of target i contributes to Eq. 3 (one row per target, one column per neighbour).

    ``env_level is None`` (paper, ``cross_reference = "global"``): y-bar_j.  Otherwise (``"environment"``):
    clip_{I_y}(y-bar_j - e_env(j) + e_env(i)) (Eq. 6 clip interval), the neighbour's deviation from its own
    environment's level moved to the target's environment.  The shrinkage target of Eq. 3 stays b_t, so a
    relation without neighbours still carries no evidence.  ``rows``: the targets of the rows of ``safe`` (None:
    one row per node, in node order).
    """
    if env_level is None:
        return ybar[safe]
    target = env_level if rows is None else env_level[rows]
    vals = ybar[safe] - env_level[safe] + target[:, None]
    return np.clip(vals, interval[0], interval[1])


def graph_prior(G_in: np.ndarray, G_cross: np.ndarray, mass_in: np.ndarray, mass_cross: np.ndarray, b_t: float, lambda_g: float, w_in: float = 0.5, mode: str = "fixed") -> np.ndarray:
    """EnvSched Eq. 4 (left): the graph prior P from the relation estimates G^r of Eq. 3.

    ``mode="fixed"`` (paper): P = w G^in + (1 - w) G^cross.
    ``mode="evidence"``: one pooled Eq. 3 over both relations' neighbours, with evidence masses
    A_r = sum_j a^r_ij and relation weights c_in = 2w, c_cross = 2(1 - w):

        P = (c_in S_in + c_cross S_cross + lambda_g b_t) / (c_in A_in + c_cross A_cross + lambda_g),

    where S_r = sum_j a^r_ij y_j = G^r (A_r + lambda_g) - lambda_g b_t is recovered from Eq. 3.  A relation
    without evidence (A_r = 0) then leaves the other undiluted; with equal masses and w = 1/2 it equals
    "fixed" up to the shared shrinkage.
    """
    if mode == "fixed":
        return w_in * G_in + (1.0 - w_in) * G_cross
    c_in, c_cr = 2.0 * w_in, 2.0 * (1.0 - w_in)
    s_in = G_in * (mass_in + lambda_g) - lambda_g * b_t
    s_cr = G_cross * (mass_cross + lambda_g) - lambda_g * b_t
    num = c_in * s_in + c_cr * s_cr + lambda_g * b_t
    den = c_in * mass_in + c_cr * mass_cross + lambda_g
    return np.where(den > 0, num / np.where(den > 0, den, 1.0), b_t)


def fuse(G_in: np.ndarray, G_cross: np.ndarray, W: np.ndarray, ybar: np.ndarray, lambda_s: float, w_in: float = 0.5) -> tuple[np.ndarray, np.ndarray]:
    """EnvSched Eq. 4: P = 1/2 G^in + 1/2 G^cross;  y-hat = (W y-bar + lambda_s P) / (W + lambda_s).

    Returns (P, y_hat).  With W = 0 (no own history) y-hat = P.
    """
    P = w_in * G_in + (1.0 - w_in) * G_cross
    return P, fuse_prior(P, W, ybar, lambda_s)


def fuse_prior(P: np.ndarray, W: np.ndarray, ybar: np.ndarray, lambda_s: float) -> np.ndarray:
    """EnvSched Eq. 4 (right): y-hat = (W y-bar + lambda_s P) / (W + lambda_s); y-hat = P when W = 0."""
    den = W + lambda_s
    return np.where(den > 0, (W * ybar + lambda_s * P) / np.where(den > 0, den, 1.0), P)


# ---------------------------------------------------------------------------------------------------
# Scoring (Eq. 8, 12, 13)
# ---------------------------------------------------------------------------------------------------


def percentile_rank(z: np.ndarray, counts: np.ndarray | None = None) -> np.ndarray:
    """EnvSched Eq. 8: pr(z_i) = (rank_avg(z_i) - 0.5) / N over the full pool, average ranks for ties.

    ``counts``: ``z[k]`` stands for ``counts[k]`` equal entries of the pool (classes of tasks with the same
    value, ``prediction_classes``); N = sum(counts), and each entry gets the value its class's tasks get in
    ``percentile_rank(np.repeat(z, counts))``."""
    z = np.asarray(z, dtype=np.float64)
    total = z.size if counts is None else int(np.sum(counts))
    return (average_rank(z, counts) - 0.5) / total


def average_rank(z: np.ndarray, counts: np.ndarray | None = None) -> np.ndarray:
    """``scipy.stats.rankdata(z, method="average")`` for a 1-D float array (ranks 1..n, ties share the mean
    rank; half-integers, so exactly the same floats), without scipy's per-call overhead.  NaN input goes to
    scipy (its NaN policy).

    ``counts`` (EnvSched Eq. 8 over classes of equal tasks): ``z[k]`` stands for ``counts[k]`` (>= 1) equal
    entries; entry k gets the rank of its value in ``np.repeat(z, counts)`` (the same half-integers, from a sort
    of ``len(z)`` values instead of ``sum(counts)``)."""
    z = np.asarray(z, dtype=np.float64)
    n = z.size
    if counts is not None:
        counts = np.asarray(counts, dtype=np.int64)
        if z.ndim != 1 or counts.shape != z.shape or (n and counts.min() < 1):
            raise ValueError("average_rank: counts must be positive integers aligned with a 1-D z")
        if n and np.isnan(z).any():  # scipy's NaN policy on the expanded array
            return rankdata(np.repeat(z, counts), method="average")[np.cumsum(counts) - counts]
    elif z.ndim != 1 or n == 0 or np.isnan(z).any():
        return rankdata(z, method="average")
    if n == 0:
        return np.zeros(0)
    sorter = np.argsort(z)  # any order within ties: tied values get one rank
    zs = z[sorter]
    bound = np.empty(n + 1, dtype=bool)  # bound[k]: sorted position k starts a run of equal values (k = n: the end)
    bound[0] = bound[n] = True
    np.not_equal(zs[1:], zs[:-1], out=bound[1:n])
    edges = np.flatnonzero(bound)
    if counts is None:
        lo, hi = edges[:-1], edges[1:]  # entries before the run, entries up to its end
    else:
        cum = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(counts[sorter], out=cum[1:])
        lo, hi = cum[edges[:-1]], cum[edges[1:]]
    out = np.empty(n)
    out[sorter] = np.repeat(0.5 * (hi + lo + 1), np.diff(edges))
    return out


def reconstructed_variance(d_hat: np.ndarray, m_hat: np.ndarray, target: str = "bernoulli", k: int = 8) -> np.ndarray:
    """EnvSched Eq. 12 (left): f = d-hat * m-hat * (1 - m-hat)  (``target="bernoulli"``, the paper).

    ``target="learnability"`` (beyond the paper, config ``reconstructed_target``): f = d-hat * (1 - m-hat^K -
    (1 - m-hat)^K), the probability that K Bernoulli(m-hat) rollouts are not all equal (a GRPO group with
    non-zero spread).
    """
    if target == "bernoulli":
        return d_hat * m_hat * (1.0 - m_hat)
    if target == "learnability":
        m = np.clip(m_hat, 0.0, 1.0)
        return d_hat * (1.0 - m**k - (1.0 - m) ** k)
    raise ValueError(f"reconstructed_target must be 'bernoulli' or 'learnability', got {target!r}")


def quantile_score(v_hat: np.ndarray, f: np.ndarray, weight_v: float = 0.65, counts: np.ndarray | None = None) -> np.ndarray:
    """EnvSched Eq. 12 (right): u = Q_{v-hat}[ 0.65 pr(v-hat) + 0.35 pr(f) ], Q linear-interpolated
    (``counts``: entry k stands for ``counts[k]`` equal tasks, see ``percentile_rank``)."""
    p = weight_v * percentile_rank(v_hat, counts) + (1.0 - weight_v) * percentile_rank(f, counts)
    return linear_quantiles(v_hat, p, counts)


def linear_quantiles(x: np.ndarray, p: np.ndarray, counts: np.ndarray | None = None) -> np.ndarray:
    """``np.quantile(x, p, method="linear")`` for a 1-D finite ``x`` and many probabilities ``p``: the same
    floats (numpy's virtual index (n - 1) p, neighbouring order statistics and its two-sided lerp), from one
    sort of ``x``.  numpy partitions at every requested index instead, which with a probability per task costs
    far more at scale (docs/results/envsched_scale.md).  Non-finite input goes to numpy.

    ``counts``: ``x[k]`` stands for ``counts[k]`` equal values (``np.quantile(np.repeat(x, counts), p)``): one
    sort of ``len(x)`` values, then the sorted values repeated."""
    x = np.asarray(x, dtype=np.float64)
    p = np.asarray(p, dtype=np.float64)
    if counts is not None:
        counts = np.asarray(counts, dtype=np.int64)
        if x.ndim != 1 or counts.shape != x.shape or x.size == 0 or not np.isfinite(x).all() or not np.isfinite(p).all():
            return np.quantile(np.repeat(x, counts), p, method="linear")
    n = x.size if counts is None else int(counts.sum())
    if x.ndim != 1 or n == 0 or p.ndim != 1 or not np.isfinite(x).all() or not np.isfinite(p).all():
        return np.quantile(x, p, method="linear")
    if counts is None:
        xs = np.sort(x)
    else:  # the sorted repeated x (N values, one pass): cheaper than a search per probability
        order = np.argsort(x)
        xs = np.repeat(x[order], counts[order])
    vi = (n - 1) * p
    prev = np.floor(vi)
    nxt = prev + 1
    above = vi >= n - 1
    prev[above] = -1
    nxt[above] = -1
    below = vi < 0
    prev[below] = 0
    nxt[below] = 0
    prev_i, nxt_i = prev.astype(np.intp), nxt.astype(np.intp)
    gamma = vi - prev_i
    a, b = xs[prev_i], xs[nxt_i]
    diff = b - a
    out = a + diff * gamma
    np.subtract(b, diff * (1 - gamma), out=out, where=gamma >= 0.5)
    return out


def decline_priority(u_long: np.ndarray, u_short: np.ndarray, eta: float = 0.5, counts: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """EnvSched Eq. 13: u = u_long - eta max{u_long - u_short, 0};  q = pr(u).  Returns (u, q) (``counts``: see
    ``percentile_rank``)."""
    u = u_long - eta * np.maximum(u_long - u_short, 0.0)
    return u, percentile_rank(u, counts)


# ---------------------------------------------------------------------------------------------------
# Observation log and the full prediction pass
# ---------------------------------------------------------------------------------------------------


class ObservationLog:
    """Append-only log of group statistics (node, step, m, v, d) in preallocated columns (grown by doubling)."""

    _DTYPES: ClassVar[dict[str, type]] = {"node": np.int64, "step": np.int64, "m": np.float64, "v": np.float64, "d": np.float64}

    def __init__(self) -> None:
        self._set({k: np.zeros(0, dtype=t) for k, t in self._DTYPES.items()})

    def _set(self, cols: dict[str, np.ndarray]) -> None:
        self._n = len(cols["node"])
        cap = max(1024, 2 * self._n)
        self._cols = {k: np.empty(cap, dtype=t) for k, t in self._DTYPES.items()}
        for k, a in self._cols.items():
            a[: self._n] = cols[k]
        self._cache: dict[str, np.ndarray] | None = None

    def add(self, node: int, step: int, m: float, v: float, d: float) -> None:
        if self._n >= len(self._cols["node"]):
            for k, a in self._cols.items():
                grown = np.empty(2 * len(a), dtype=a.dtype)
                grown[: self._n] = a[: self._n]
                self._cols[k] = grown
        for k, x in zip(("node", "step", "m", "v", "d"), (node, step, m, v, d)):
            self._cols[k][self._n] = x
        self._n += 1
        self._cache = None

    def arrays(self) -> dict[str, np.ndarray]:
        """Read-only views of the logged columns."""
        if self._cache is None:
            self._cache = {}
            for k, a in self._cols.items():
                view = a[: self._n]
                view.flags.writeable = False
                self._cache[k] = view
        return self._cache

    def __len__(self) -> int:
        return self._n

    def state_dict(self) -> dict[str, Any]:
        return {k: v.copy() for k, v in self.arrays().items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._set({k: np.asarray(state[k], dtype=t) for k, t in self._DTYPES.items()})


@dataclass
class Prediction:
    """Output of ``predict``: per-task arrays aligned with ``task_ids`` (pool order)."""

    task_ids: list[str]
    v: np.ndarray  # predicted variance v-hat (long half-life), Eq. 4
    m: np.ndarray  # predicted mean m-hat (long half-life), Eq. 4
    d: np.ndarray  # predicted dispersion d-hat (long half-life), Eq. 4
    f: np.ndarray  # reconstructed variance d m (1 - m), Eq. 12
    u_long: np.ndarray  # Eq. 12 with h_long
    u_short: np.ndarray  # Eq. 12 with h_short
    u: np.ndarray  # Eq. 13
    q: np.ndarray  # informativeness score q = pr(u), Eq. 13
    reference: dict[str, float] = field(default_factory=dict)  # b_t^y for the long half-life
    step: int = 0
    # relation_weights: measured only: the evidence the weights are measured on (estimate_half_life, long pass)
    sources: dict[str, np.ndarray] | None = None

    def as_dict(self) -> dict[str, dict[str, float]]:
        """{task_id: {"v": .., "m": .., "d": .., "q": ..}}."""
        return {tid: {"v": float(self.v[i]), "m": float(self.m[i]), "d": float(self.d[i]), "q": float(self.q[i])} for i, tid in enumerate(self.task_ids)}


@dataclass
class PredictionClasses:
    """Tasks whose prediction inputs are the same, computed once (``prediction_classes``).

    ``rows``: one node per class, ascending; ``inverse[i]``: the class of node i (``rows[inverse[i]]`` has node
    i's inputs); ``counts``: the class sizes.  ``cross_rows`` / ``cross_inverse``: the same for N^cross alone
    (``NeighborIndex.cross_classes``): node i's N^cross row equals that of ``cross_rows[cross_inverse[i]]``.
    """

    rows: np.ndarray
    inverse: np.ndarray
    counts: np.ndarray
    cross_rows: np.ndarray
    cross_inverse: np.ndarray


def prediction_classes(log: ObservationLog, nbr_idx: dict[str, np.ndarray], t: int, n: int, cross_classes: tuple[np.ndarray, np.ndarray]) -> PredictionClasses:
    """Group the tasks whose Eq. 3-4 and 6-12 inputs for step ``t`` are identical (they get identical floats).

    A task without own history (H_t(i) empty: W = 0 and y-bar = b_t in Eq. 11) and without any entry in its
    N^in row (Eq. 3 within: no neighbour at all, so every a_ij is 0 and G^in is the value of an empty row)
    depends on nothing of its own but its N^cross row, and with ``cross_reference`` other than "global" its
    environment.  ``cross_classes`` (rows, inverse) groups nodes with identical N^cross rows within one
    environment (``NeighborIndex.cross_classes``), so such tasks form one class per cross class; every other task
    (own history, or a within-environment neighbour) is a class of its own.  Computing each class once makes the
    relation sums O(classes x K) instead of O(N x K) (EnvSched Eq. 3, 7); the ranks of Eq. 8 and the quantiles of
    Eq. 12 weight each class by its size (``percentile_rank(z, counts)``), giving each task the same value.
    """
    cross_rows, cross_inverse = cross_classes
    obs = log.arrays()
    grouped = np.ones(n, dtype=bool)
    grouped[obs["node"][obs["step"] < t]] = False  # own history
    if nbr_idx["in"].shape[1]:
        grouped &= (nbr_idx["in"] < 0).all(axis=1)
    g_rows = np.flatnonzero(grouped)
    g_cls = cross_inverse[g_rows]
    first = np.full(len(cross_rows), n, dtype=np.int64)
    np.minimum.at(first, g_cls, g_rows)  # the lowest grouped node of each cross class stands for it
    rows = np.sort(np.concatenate([np.flatnonzero(~grouped), first[first < n]]))
    inverse = np.empty(n, dtype=np.int64)
    inverse[rows] = np.arange(len(rows))
    inverse[g_rows] = inverse[first[g_cls]]
    return PredictionClasses(rows, inverse, np.bincount(inverse, minlength=len(rows)), np.asarray(cross_rows), np.asarray(cross_inverse))


def _kernel(kernels: dict[str, Any] | None, rel: str, rows: np.ndarray | None, sim: np.ndarray, avail: np.ndarray, floor: float, persistent: bool) -> np.ndarray:
    """The W-independent Eq. 7 kernel of the given neighbour rows (``rows``: their nodes, None: every node in
    order), taken from ``kernels[rel]`` for each row whose mask (and, when the cache holds them, neighbour
    similarities) is unchanged, computed for the others; the kernel is row-wise, so the result equals
    ``neighbor_kernel(sim, avail, floor)``.  The cache then holds these rows (``kernels[f"{rel}:rows"]``)."""
    old = kernels.get(rel) if kernels is not None else None
    old_rows = kernels.get(f"{rel}:rows") if kernels is not None else None
    old_sim = kernels.get(f"{rel}:sim") if kernels is not None else None
    kern, changed, moved = None, None, False
    if old is not None and old[0].ndim == 2 and old[0].shape[1] == avail.shape[1] and (rows is None) == (old_rows is None):
        if rows is None or (len(rows) == len(old_rows) and np.array_equal(rows, old_rows)):
            if old[0].shape == avail.shape:
                o_avail, kern = old
                changed = (o_avail != avail).any(axis=1)
                if old_sim is not None:
                    changed |= (old_sim != sim).any(axis=1)
        else:  # other rows: each row's cached entry, where the cache has it
            moved = True
            pos = np.searchsorted(old_rows, rows)
            found = pos < len(old_rows)
            found[found] = old_rows[pos[found]] == rows[found]
            pos = np.where(found, pos, 0)
            kern = old[1][pos] if len(old_rows) else np.zeros(avail.shape)
            changed = ~found
            if len(old_rows):
                changed |= (old[0][pos] != avail).any(axis=1)
                if old_sim is not None:
                    changed |= (old_sim[pos] != sim).any(axis=1)
    if kern is None:
        kern = neighbor_kernel(sim, avail, floor)
    elif changed.any():
        kern = kern if moved else kern.copy()
        kern[changed] = neighbor_kernel(sim[changed], avail[changed], floor)
    if kernels is not None and (changed is None or moved or changed.any()):
        kernels[rel] = (avail, kern)
        if rows is None:
            kernels.pop(f"{rel}:rows", None)
        else:
            kernels[f"{rel}:rows"] = rows
        if old_sim is not None or persistent:
            kernels[f"{rel}:sim"] = np.array(sim, dtype=np.float64)
    return kern


def estimate_half_life(log: ObservationLog, nbr_idx: dict[str, np.ndarray], nbr_sim: dict[str, np.ndarray], t: int, h: float, n: int, cfg: EnvSchedConfig, kernels: dict[str, Any] | None = None, env: np.ndarray | None = None, persistent: bool = False, relation_weights: dict[str, dict[str, float]] | None = None, classes: PredictionClasses | None = None) -> dict[str, Any]:
    """One prediction pass for half-life h: Eq. 6, 11, 7, 3, 4 for y in {v, m, d}, then Eq. 12.

    ``relation_weights`` ({y: {"in": c, "cross": c}}, ``relations.RelationWeights.weights``; beyond the paper):
    Eq. 3 with each relation's evidence mass scaled by its weight (Eq. 3' of ``envsched/relations.py``); the
    result then also holds ``"sources"``, what the weights are measured on: per task W (``"W"``), each
    relation's evidence mass A (``"A:<rel>"``) and sum S = sum_j a_ij y_j (``"<y>:S:<rel>"``), the own history
    y-bar (``"<y>:own"``) and b_t (``"<y>:b"``).  None: the paper's Eq. 3.

    ``kernels`` (optional, shared between the passes of one prediction) caches the W-independent Eq. 7
    kernel per relation with the availability mask it was computed for; rows whose mask differs are
    recomputed.  ``persistent=True`` (a cache kept from step to step, ``NeighborIndex.kernel_cache``) also
    keeps a copy of the neighbour similarities and recomputes the rows whose neighbour lists changed: a step
    changes few rows, and the kernel is a row median and N x K exponentials.

    ``classes`` (``prediction_classes``): Eq. 3-4 and 12 are computed once per class of tasks with identical
    inputs, N^cross once per cross class; "v", "m", "d", "f", "u" then come back per class (aligned with
    ``classes.rows``; ``x[classes.inverse]`` gives every task the value it gets without classes), "W" and
    "sources" per task.
    """
    obs = log.arrays()
    intervals = {"v": cfg.clip_v, "m": cfg.clip_m, "d": cfg.clip_d}
    keep = obs["step"] < t
    steps_u, inv = np.unique(obs["step"][keep], return_inverse=True)
    out: dict[str, Any] = {"b": {}}
    W = None
    ybars: dict[str, np.ndarray] = {}
    for y in STATS:
        vals = obs[y][keep]
        step_means = np.bincount(inv, weights=vals, minlength=len(steps_u)) / np.maximum(np.bincount(inv, minlength=len(steps_u)), 1)
        b_t = global_reference(step_means, steps_u, t, h)
        y_tilde = center(vals, step_means[inv], b_t, intervals[y])
        W, ybar = task_history(obs["node"][keep], obs["step"][keep], y_tilde, t, h, n, b_t)
        ybars[y] = ybar
        out["b"][y] = b_t
    assert W is not None
    # the nodes whose neighbour rows are computed (None: all, in node order), and where each computed task's
    # relation values are found among them (None: the same position)
    rows = None if classes is None else classes.rows
    rel_rows = {"in": rows, "cross": None if classes is None else classes.cross_rows}
    to_task = {"in": None, "cross": None if classes is None else classes.cross_inverse[rows]}
    weights = {}
    for rel in ("in", "cross"):
        rr = rel_rows[rel]
        idx = nbr_idx[rel] if rr is None else nbr_idx[rel][rr]
        safe = np.maximum(idx, 0)
        avail = (idx >= 0) & (W[safe] > 0)
        kern = _kernel(kernels, rel, rr, nbr_sim[rel] if rr is None else nbr_sim[rel][rr], avail, cfg.bandwidth_floor, persistent)
        root_w = np.sqrt(np.clip(W, cfg.neighbor_weight_clip[0], cfg.neighbor_weight_clip[1]))  # per node, then gathered
        a = np.where(avail, kern * root_w[safe], 0.0)
        weights[rel] = (safe, a)
    if cfg.cross_reference != "global" and env is None:
        raise ValueError(f"cross_reference={cfg.cross_reference!r} needs the environment of every task (env=...)")
    env_relative = {"global": (), "environment": STATS, "environment_mean": ("m",)}[cfg.cross_reference]
    mass = {rel: a.sum(axis=1) for rel, (_, a) in weights.items()}

    def per_task(x: np.ndarray, rel: str) -> np.ndarray:  # a relation's per-row values, for the computed tasks
        return x if to_task[rel] is None else x[to_task[rel]]

    def per_node(x: np.ndarray, rel: str) -> np.ndarray:  # a relation's per-row values, for every node
        if classes is None:
            return x
        return x[classes.inverse] if rel == "in" else x[classes.cross_inverse]

    if relation_weights is not None:
        out["sources"] = {"W": W, **{f"A:{rel}": per_node(mass[rel], rel) for rel in weights}}
    W_rows = W if rows is None else W[rows]
    for y in STATS:
        G, m_used = {}, dict(mass)
        for rel, (safe, a) in weights.items():
            level = None
            if rel == "cross" and y in env_relative:
                level = environment_reference(ybars[y], W, env, out["b"][y], cfg.lambda_g)
            vals = relation_values(ybars[y], safe, level, intervals[y], rel_rows[rel])
            if relation_weights is None:
                G[rel] = relation_estimate(a, vals, out["b"][y], cfg.lambda_g, mass[rel])
            else:  # Eq. 3' (envsched/relations.py): the relation's evidence mass scaled by its measured weight
                c = relation_weights[y][rel]
                num = np.sum(a * vals, axis=1)
                G[rel] = weighted_relation_estimate(num, mass[rel], out["b"][y], cfg.lambda_g, c)
                m_used[rel] = c * mass[rel]
                out["sources"][f"{y}:S:{rel}"] = per_node(num, rel)
        if relation_weights is not None:
            out["sources"][f"{y}:own"] = ybars[y]
            out["sources"][f"{y}:b"] = np.broadcast_to(out["b"][y], ybars[y].shape)
        P = graph_prior(per_task(G["in"], "in"), per_task(G["cross"], "cross"), per_task(m_used["in"], "in"), per_task(m_used["cross"], "cross"), out["b"][y], cfg.lambda_g, cfg.fusion_within, cfg.fusion)
        out[y] = fuse_prior(P, W_rows, ybars[y] if rows is None else ybars[y][rows], cfg.lambda_s)
    out["f"] = reconstructed_variance(out["d"], out["m"], cfg.reconstructed_target, cfg.rollouts_per_task)
    out["u"] = quantile_score(out["v"], out["f"], cfg.quantile_weight_v, None if classes is None else classes.counts)
    out["W"] = W
    return out


def predict_all(log: ObservationLog, nbr_idx: dict[str, np.ndarray], nbr_sim: dict[str, np.ndarray], t: int, task_ids: list[str], cfg: EnvSchedConfig, env: np.ndarray | None = None, kernels: dict[str, Any] | None = None, relation_weights: dict[str, dict[str, float]] | None = None, cross_classes: tuple[np.ndarray, np.ndarray] | None = None) -> Prediction:
    """EnvSched Eq. 12–13 over both half-lives: q_{i,t} for every task of the pool (``env``: environment code
    of every task, needed for ``cross_reference = "environment"``; ``kernels``: a kernel cache kept between
    calls on the same neighbour arrays, see ``estimate_half_life``; ``relation_weights``: Eq. 3' of
    ``envsched/relations.py`` in both passes, the long pass's ``sources`` kept on the Prediction).

    ``cross_classes`` ((rows, inverse), ``NeighborIndex.cross_classes``: nodes of one class have identical
    N^cross rows and one environment): each class of tasks with identical inputs is computed once
    (``prediction_classes``), the same floats as without."""
    n = len(task_ids)
    persistent = kernels is not None
    kernels = {} if kernels is None else kernels
    classes = None if cross_classes is None else prediction_classes(log, nbr_idx, t, n, cross_classes)
    long = estimate_half_life(log, nbr_idx, nbr_sim, t, cfg.h_long, n, cfg, kernels, env, persistent, relation_weights, classes)
    short = estimate_half_life(log, nbr_idx, nbr_sim, t, cfg.h_short, n, cfg, kernels, env, persistent, relation_weights, classes)
    u, q = decline_priority(long["u"], short["u"], cfg.eta_decline, None if classes is None else classes.counts)

    def node(x: np.ndarray) -> np.ndarray:
        return x if classes is None else x[classes.inverse]

    return Prediction(task_ids=task_ids, v=node(long["v"]), m=node(long["m"]), d=node(long["d"]), f=node(long["f"]), u_long=node(long["u"]), u_short=node(short["u"]), u=node(u), q=node(q), reference=dict(long["b"]), step=t, sources=long.get("sources"))


# ---------------------------------------------------------------------------------------------------
# Prediction diagnostics: does the score rank the variance later realised?
# ---------------------------------------------------------------------------------------------------

# Evidence behind a prediction, in the order of the codes ``evidence_types`` returns.
EVIDENCE_TYPES = ("observed", "within_env", "cross_env_only", "cold")


def evidence_types(log: ObservationLog, nbr_idx: dict[str, np.ndarray], t: int, nodes: np.ndarray, n: int) -> np.ndarray:
    """Which evidence the prediction of each of ``nodes`` for step ``t`` rests on (codes into EVIDENCE_TYPES).

    0 ``observed``: the task's own history H_t(i) (observations at steps s < t) is non-empty, so Eq. 4 fuses
      its history y-bar (Eq. 11) with the graph prior;
    1 ``within_env``: no own history, but at least one available neighbour in N_t^in(i) (S_full), so G^in of
      Eq. 3 carries evidence (and G^cross may too);
    2 ``cross_env_only``: no own history and no available within-environment neighbour, at least one in
      N_t^cross(i) (S_abs): G^in = b_t and only G^cross carries evidence;
    3 ``cold``: none of these: every term of Eq. 3-4 is the global reference b_t (App. B).

    "Available" is the test of ``estimate_half_life``: a neighbour index >= 0 whose own history is non-empty.
    """
    nodes = np.asarray(nodes, dtype=np.int64)
    obs = log.arrays()
    has = np.zeros(n, dtype=bool)
    has[obs["node"][obs["step"] < t]] = True

    def any_available(rel: str) -> np.ndarray:
        idx = nbr_idx[rel][nodes]
        return ((idx >= 0) & has[np.maximum(idx, 0)]).any(axis=1)

    code = np.full(len(nodes), 3, dtype=np.int8)
    code[any_available("cross")] = 2
    code[any_available("in")] = 1
    code[has[nodes]] = 0
    return code


def rank_correlation(x: np.ndarray, y: np.ndarray, min_count: int = 3) -> float | None:
    """Spearman's rank correlation (``scipy.stats.spearmanr``) of x and y, or None where it is undefined
    or not meaningful: fewer than ``min_count`` pairs, or a constant x or y."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if len(x) < max(min_count, 2) or np.ptp(x) == 0 or np.ptp(y) == 0:
        return None
    rho = float(spearmanr(x, y)[0])
    return rho if np.isfinite(rho) else None


def prediction_diagnostics(score: np.ndarray, realised_v: np.ndarray, evidence: np.ndarray, predicted_v: np.ndarray | None = None, min_count: int = 3) -> dict[str, float]:
    """Rank agreement between what the scheduler predicted at selection and what the rollouts showed.

    For the observed groups of one step: ``score`` is each task's q_{i,t} (Eq. 13) at selection,
    ``predicted_v`` its v-hat (Eq. 4, long half-life), ``realised_v`` the group's population variance v_{i,t}
    (Eq. 2) and ``evidence`` its code from ``evidence_types``.  Returns, per evidence type and for ``all``:

    * ``spearman_q_<type>``: Spearman correlation of q and the realised variance;
    * ``spearman_v_<type>``: the same for v-hat (when ``predicted_v`` is given);
    * ``scored_<type>``: how many groups of the type were observed.

    A correlation is reported only with >= ``min_count`` groups and non-constant values on both sides
    (otherwise its key is absent, never NaN).
    """
    score = np.asarray(score, dtype=np.float64)
    realised_v = np.asarray(realised_v, dtype=np.float64)
    evidence = np.asarray(evidence)
    out: dict[str, float] = {}
    groups = [(name, evidence == code) for code, name in enumerate(EVIDENCE_TYPES)] + [("all", np.ones(len(score), dtype=bool))]
    for name, mask in groups:
        out[f"scored_{name}"] = float(mask.sum())
        rho = rank_correlation(score[mask], realised_v[mask], min_count)
        if rho is not None:
            out[f"spearman_q_{name}"] = rho
        if predicted_v is not None:
            rho = rank_correlation(np.asarray(predicted_v, dtype=np.float64)[mask], realised_v[mask], min_count)
            if rho is not None:
                out[f"spearman_v_{name}"] = rho
    return out
