"""A plain, loop-based reference implementation of EnvSched's whole prediction (Eq. 2-13, App. B), written
from the paper (seeds/004, §2.3 and Appendix B), used as a test oracle for the vectorised ``envsched.estimate``.

The oracle works on plain Python lists and dicts: one loop per sum of the paper.  It takes the raw reward
groups of every step, the two similarity matrices of Eq. 1 (inputs: the static graph is not part of the
prediction) and the environment of every task, and returns v-hat, m-hat, d-hat, f, u_long, u_short, u and q.
The comparisons use non-default, pairwise distinct hyper-parameters (lambda_g != lambda_s, h_long / h_short,
eta, the Eq. 4 fusion weight, the Eq. 12 quantile weight, the Eq. 7 bandwidth floor and W clip, the Eq. 9
dispersion floor), multi-step logs with partial batches and short groups, and neighbour arrays that hold
nodes with and without history.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.sparse as sp

from envsched import EnvSchedConfig, EnvScheduler, TaskPool
from envsched.estimate import ObservationLog, group_statistics, predict_all
from envsched.graph import StaticGraph
from envsched.synthetic import synthetic_records

# Non-default values, all different from each other (a swap of two of them changes the result).
PARAMS = {
    "lambda_g": 0.7, "lambda_s": 3.1, "h_long": 5.0, "h_short": 1.5, "eta_decline": 0.35, "fusion_within": 0.3,
    "quantile_weight_v": 0.55, "bandwidth_floor": 0.12, "neighbor_weight_clip": (0.2, 2.4), "dispersion_floor": 0.03,
    # the oracles are the paper's equations: its predictor and fixed relation weights (envsched/relations.py and
    # envsched/predictor.py are beyond the paper)
    "relation_weights": "paper", "predictor": "paper",
}


def clip(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


def oracle_group_stats(rewards: list[float], floor: float) -> tuple[float, float, float]:
    """Eq. 9: m = mean, v = population variance, d = clip_[0,1](v / max(m(1-m), floor))."""
    K = len(rewards)
    m = sum(rewards) / K
    v = sum((r - m) ** 2 for r in rewards) / K
    d = clip(v / max(m * (1 - m), floor), 0.0, 1.0)
    return m, v, d


def oracle_rank_avg(z: list[float]) -> list[float]:
    """Average ranks 1..N (ties share the mean of their ranks); values within 1e-12 count as tied so that
    rounding noise between two implementations does not decide a tie."""
    out = []
    for zi in z:
        below = sum(1 for zj in z if zj < zi - 1e-12)
        tied = sum(1 for zj in z if abs(zj - zi) <= 1e-12)
        out.append(below + (tied + 1) / 2)
    return out


def oracle_pr(z: list[float]) -> list[float]:
    """Eq. 8: pr(z_i) = (rank_avg(z_i) - 0.5) / N."""
    return [(r - 0.5) / len(z) for r in oracle_rank_avg(z)]


def oracle_quantile(values: list[float], p: float) -> float:
    """Empirical quantile with linear interpolation between order statistics (App. B, Q_v-hat)."""
    s = sorted(values)
    pos = p * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (pos - lo) * (s[hi] - s[lo])


def oracle_pass(obs: list[tuple[int, int, float, float, float]], S: dict[str, list[list[float]]], env: list[int], t: int, h: float, p: dict) -> dict:
    """One half-life: Eq. 6, 10, 11, 7, 3, 4 for y in {v, m, d}, then Eq. 12.  ``obs`` rows: (i, s, m, v, d)."""
    N = len(env)
    intervals = {"v": p["clip_v"], "m": p["clip_m"], "d": p["clip_d"]}
    col = {"m": 2, "v": 3, "d": 4}
    past = [o for o in obs if o[1] < t]  # H_t: earlier steps only
    steps = sorted({o[1] for o in past})
    w = {s: 2.0 ** (-(t - s) / h) for s in steps}  # Eq. 10
    W = [0.0] * N  # Eq. 11 (the same for every y)
    for i, s, *_ in past:
        W[i] += w[s]
    observed = [W[i] > 0 for i in range(N)]

    # N_t^r(i): the K most similar *observed* nodes (no self, same env for "in", other envs for "cross").
    def neighbours(i: int, rel: str) -> list[int]:
        k = p["k_within"] if rel == "in" else p["k_cross"]
        cands = [j for j in range(N) if j != i and observed[j] and (env[j] == env[i]) == (rel == "in") and S[rel][i][j] > p["min_sim"]]
        cands.sort(key=lambda j: (-S[rel][i][j], j))
        return cands[:k]

    nbrs = {rel: [neighbours(i, rel) for i in range(N)] for rel in ("in", "cross")}
    b_t, ybar, yhat = {}, {}, {}
    for y in ("v", "m", "d"):
        b_s = {s: sum(o[col[y]] for o in past if o[1] == s) / sum(1 for o in past if o[1] == s) for s in steps}
        b_t[y] = sum(w[s] * b_s[s] for s in steps) / sum(w[s] for s in steps)  # Eq. 6 (left)
        num = [0.0] * N
        for i, s, *vals in past:
            y_tilde = clip(vals[col[y] - 2] - b_s[s] + b_t[y], *intervals[y])  # Eq. 6 (right)
            num[i] += w[s] * y_tilde
        ybar[y] = [num[i] / W[i] if W[i] > 0 else b_t[y] for i in range(N)]  # Eq. 11
    for y in ("v", "m", "d"):
        yhat[y] = []
        for i in range(N):
            G = {}
            for rel in ("in", "cross"):
                js = nbrs[rel][i]
                if not js:
                    G[rel] = b_t[y]  # App. B: no available neighbour
                    continue
                delta = [clip(1 - S[rel][i][j], 0.0, 1.0) for j in js]
                sd = sorted(delta)
                mid = len(sd) // 2
                median = sd[mid] if len(sd) % 2 else 0.5 * (sd[mid - 1] + sd[mid])
                sigma = max(median, p["bandwidth_floor"])  # Eq. 7
                a = [math.exp(-0.5 * (dl / sigma) ** 2) * math.sqrt(clip(W[j], *p["neighbor_weight_clip"])) for dl, j in zip(delta, js)]
                G[rel] = (sum(aj * ybar[y][j] for aj, j in zip(a, js)) + p["lambda_g"] * b_t[y]) / (sum(a) + p["lambda_g"])  # Eq. 3
            P = p["fusion_within"] * G["in"] + (1 - p["fusion_within"]) * G["cross"]  # Eq. 4
            yhat[y].append((W[i] * ybar[y][i] + p["lambda_s"] * P) / (W[i] + p["lambda_s"]))
    f = [yhat["d"][i] * yhat["m"][i] * (1 - yhat["m"][i]) for i in range(N)]  # Eq. 12 (left)
    pr_v, pr_f = oracle_pr(yhat["v"]), oracle_pr(f)
    u = [oracle_quantile(yhat["v"], p["quantile_weight_v"] * pr_v[i] + (1 - p["quantile_weight_v"]) * pr_f[i]) for i in range(N)]
    return {"v": yhat["v"], "m": yhat["m"], "d": yhat["d"], "f": f, "u": u, "b": b_t}


def oracle_predict(groups: dict[int, dict[int, list[float]]], S: dict[str, list[list[float]]], env: list[int], t: int, p: dict) -> dict:
    """Eq. 2 / 9 on every group, both half-lives, then Eq. 13."""
    obs = [(i, s, *oracle_group_stats(r, p["dispersion_floor"])) for s, g in sorted(groups.items()) for i, r in sorted(g.items())]
    long = oracle_pass(obs, S, env, t, p["h_long"], p)
    short = oracle_pass(obs, S, env, t, p["h_short"], p)
    u = [ul - p["eta_decline"] * max(ul - us, 0.0) for ul, us in zip(long["u"], short["u"])]
    return {**{k: long[k] for k in ("v", "m", "d", "f", "b")}, "u_long": long["u"], "u_short": short["u"], "u": u, "q": oracle_pr(u)}


def params(cfg: EnvSchedConfig) -> dict:
    return {k: getattr(cfg, k) for k in ("lambda_g", "lambda_s", "h_long", "h_short", "eta_decline", "fusion_within", "quantile_weight_v",
                                         "bandwidth_floor", "neighbor_weight_clip", "dispersion_floor", "clip_v", "clip_m", "clip_d",
                                         "k_within", "k_cross")} | {"min_sim": cfg.min_neighbor_similarity}


def assert_matches(pred, ref) -> None:
    for k in ("v", "m", "d", "f", "u_long", "u_short", "u", "q"):
        np.testing.assert_allclose(getattr(pred, k), ref[k], rtol=1e-9, atol=1e-12, err_msg=k)
    assert pred.reference == pytest.approx(ref["b"], rel=1e-12)


def random_groups(rng: np.random.Generator, batches: dict[int, list[int]], K: int) -> dict[int, dict[int, list[float]]]:
    """Rewards for most of each batch: binary, partial-credit and constant groups, some of them short."""
    out = {}
    for s, batch in batches.items():
        out[s] = {}
        for i in batch:
            if rng.random() < 0.15:
                continue  # not observed (a partial batch)
            k = K if rng.random() < 0.75 else int(rng.integers(1, K))
            kind = rng.integers(3)
            if kind == 0:
                r = (rng.random(k) < rng.random()).astype(float)
            elif kind == 1:
                r = np.round(rng.random(k) * 4) / 4
            else:
                r = np.full(k, float(rng.integers(2)))
            out[s][int(i)] = r.tolist()
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_predict_all_equals_the_paper_oracle(seed):
    rng = np.random.default_rng(seed)
    N, n_env = 36, 4
    env = rng.integers(n_env, size=N).tolist()
    cfg = EnvSchedConfig(k_within=3, k_cross=5, min_neighbor_similarity=0.15 if seed == 2 else 0.0, **PARAMS)
    p = params(cfg)
    S = {}
    for rel in ("in", "cross"):
        M = rng.uniform(0.0, 0.98, size=(N, N))
        S[rel] = ((M + M.T) / 2).tolist()
    batches = {s: rng.choice(N, size=10, replace=False).tolist() for s in (0, 1, 2, 4, 5, 7)}  # step gaps: 3 and 6 absent
    groups = random_groups(rng, batches, K=6)
    log = ObservationLog()
    for s, g in groups.items():
        for i, r in g.items():
            log.add(i, s, *group_statistics(np.asarray(r), cfg.dispersion_floor))

    for t in (3, 6, 8):  # mid-run (later observations must be ignored) and after the last step
        has_history = {i for s, g in groups.items() if s < t for i in g}
        # Library contract: each row lists candidate neighbours (-1 = empty slot); only those with history at
        # s < t count.  Rows hold the paper's N_t(i) plus, interleaved, the most similar nodes without history.
        idx, sim = {}, {}
        for rel in ("in", "cross"):
            k = cfg.k_within if rel == "in" else cfg.k_cross
            width = k + 4
            idx[rel] = np.full((N, width), -1, dtype=np.int64)
            sim[rel] = np.full((N, width), -np.inf)
            for i in range(N):
                same = [j for j in range(N) if j != i and (env[j] == env[i]) == (rel == "in") and S[rel][i][j] > p["min_sim"]]
                same.sort(key=lambda j: (-S[rel][i][j], j))
                with_h = [j for j in same if j in has_history][:k]
                without = [j for j in same if j not in has_history][:3]
                row = sorted(with_h + without, key=lambda j: (-S[rel][i][j], j))
                idx[rel][i, : len(row)] = row
                sim[rel][i, : len(row)] = [S[rel][i][j] for j in row]
        n_without = sum(int(j not in has_history) for rel in idx for j in idx[rel].ravel() if j >= 0)
        assert n_without > 0 and len(has_history) < N  # the arrays really do hold nodes without history
        pred = predict_all(log, idx, sim, t, [f"t{i}" for i in range(N)], cfg)
        assert_matches(pred, oracle_predict(groups, S, env, t, p))


def test_the_oracle_comparison_sees_a_swap_of_lambda_g_and_lambda_s():
    """The comparison can fail: with lambda_g and lambda_s exchanged the library's prediction is not the oracle's."""
    rng = np.random.default_rng(5)
    N = 20
    env = (np.arange(N) % 3).tolist()
    M = rng.uniform(0.1, 0.9, size=(N, N))
    S = {"in": ((M + M.T) / 2).tolist(), "cross": ((M.T + M) / 2).tolist()}
    cfg = EnvSchedConfig(k_within=3, k_cross=4, **PARAMS)
    swapped = EnvSchedConfig(k_within=3, k_cross=4, **{**PARAMS, "lambda_g": PARAMS["lambda_s"], "lambda_s": PARAMS["lambda_g"]})
    groups = random_groups(rng, {0: list(range(0, N, 2)), 1: list(range(1, N, 2)), 2: list(range(0, N, 3))}, K=4)
    log = ObservationLog()
    for s, g in groups.items():
        for i, r in g.items():
            log.add(i, s, *group_statistics(np.asarray(r), cfg.dispersion_floor))
    has = {i for g in groups.values() for i in g}
    idx, sim = {}, {}
    for rel, k in (("in", 3), ("cross", 4)):
        rows = [sorted((j for j in has if j != i and (env[j] == env[i]) == (rel == "in")), key=lambda j: (-S[rel][i][j], j))[:k] for i in range(N)]
        idx[rel] = np.array([r + [-1] * (k - len(r)) for r in rows], dtype=np.int64)
        sim[rel] = np.array([[S[rel][i][j] if j >= 0 else -np.inf for j in idx[rel][i]] for i in range(N)])
    ref = oracle_predict(groups, S, env, 3, params(cfg))
    assert_matches(predict_all(log, idx, sim, 3, [str(i) for i in range(N)], cfg), ref)
    with pytest.raises(AssertionError):
        assert_matches(predict_all(log, idx, sim, 3, [str(i) for i in range(N)], swapped), ref)


@pytest.mark.parametrize("seed", [3, 4])
def test_scheduler_prediction_equals_the_paper_oracle(seed):
    rng = np.random.default_rng(seed)
    pool = TaskPool.from_records(synthetic_records(5, 8, seed=seed))
    N = len(pool)
    env = pool.env.tolist()
    # a hand-made static graph with strictly positive similarities (dense random views)
    x_full = rng.random((N, 12)) ** 3
    x_abs = rng.random((N, 6)) ** 3
    x_full /= np.linalg.norm(x_full, axis=1, keepdims=True)
    x_abs /= np.linalg.norm(x_abs, axis=1, keepdims=True)
    members = [np.flatnonzero(pool.env == e) for e in range(pool.n_envs)]
    graph = StaticGraph(x_full=sp.csr_matrix(x_full), x_abs=sp.csr_matrix(x_abs), env=pool.env, env_members=members, descriptions=[], extractor_counts={})
    cfg = EnvSchedConfig(batch_size=10, rollouts_per_task=5, k_within=3, k_cross=6, cap_env_round=3, **PARAMS)
    sched = EnvScheduler(pool, cfg, graph=graph)
    batches = {}
    groups: dict[int, dict[int, list[float]]] = {}
    for step in range(6):
        ids = sched.select(step)
        batches[step] = [pool.index[t] for t in ids]
        g = random_groups(rng, {step: batches[step]}, K=cfg.rollouts_per_task)[step]
        if not g:
            g = {batches[step][0]: [1.0, 0.0]}
        groups[step] = g
        sched.observe(step, {pool.task_ids[i]: r for i, r in g.items()})
    S = {"in": graph.sim_full(np.arange(N), np.arange(N)).tolist(), "cross": graph.sim_abs(None, np.arange(N)).tolist()}
    # the next step (what select() uses) and past steps: N_t(i) then holds only nodes observed before t
    for t in (6, 4, 2):
        assert_matches(sched.predict(t), oracle_predict(groups, S, env, t, params(cfg)))
    unobserved = [i for i in range(N) if all(i not in g for g in groups.values())]
    assert unobserved  # the pool holds tasks the graph prior alone predicts


def test_eq7_neighbor_weights_with_a_non_default_floor_and_clip():
    """``neighbor_weights`` (Eq. 7 on its own) against the oracle's loop, with the floor deciding sigma."""
    from envsched.estimate import neighbor_weights

    sim = np.array([[0.99, 0.97, 0.5], [0.2, 0.9, 0.1]])
    W = np.array([[0.05, 1.0, 9.0], [2.0, 0.5, 1.0]])
    avail = np.array([[True, True, False], [True, True, True]])
    got = neighbor_weights(sim, W, avail, bandwidth_floor=0.2, w_clip=(0.3, 1.5))
    for i in range(2):
        delta = [clip(1 - sim[i, j], 0, 1) for j in range(3) if avail[i, j]]
        sd = sorted(delta)
        med = sd[len(sd) // 2] if len(sd) % 2 else 0.5 * (sd[len(sd) // 2 - 1] + sd[len(sd) // 2])
        sigma = max(med, 0.2)
        for j in range(3):
            want = math.exp(-0.5 * (clip(1 - sim[i, j], 0, 1) / sigma) ** 2) * math.sqrt(clip(W[i, j], 0.3, 1.5)) if avail[i, j] else 0.0
            assert got[i, j] == pytest.approx(want, rel=1e-12)
    # row 0: its median delta (0.02) is below the floor, so the floor sets sigma: the default floor gives other weights
    assert not np.allclose(neighbor_weights(sim, W, avail, w_clip=(0.3, 1.5))[0], got[0])
