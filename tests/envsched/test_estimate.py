"""EnvSched's prediction (``envsched/estimate.py``): every equation (Eq. 2-13, App. B) against values computed by
hand, the non-paper branches (``cross_reference`` = "environment" / "environment_mean", ``fusion = "evidence"``,
``reconstructed_target = "learnability"``) against a plain loop oracle written from the docstrings (one loop per
sum), the edge cases of every helper (empty neighbour sets, zero denominators, ties, NaN, 0-d / 2-D / empty inputs),
the prediction diagnostics, and the fast paths (rank statistics, growing logs, the shared and cached Eq. 7 kernel,
classes of tasks with identical inputs) against the straightforward computations they replace, bit for bit.
Library references: scipy's ``rankdata`` and ``spearmanr``, numpy's quantiles. The paper oracle of the whole
prediction is ``test_estimate_oracle.py``.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from scipy.stats import rankdata, spearmanr

from envsched import ConfigError, EnvSchedConfig, EnvScheduler, TaskPool
from envsched.estimate import (
    EVIDENCE_TYPES,
    ObservationLog,
    _masked_row_median,
    average_rank,
    center,
    decline_priority,
    environment_reference,
    estimate_half_life,
    evidence_types,
    exposure_factor,
    fuse,
    fuse_prior,
    global_reference,
    graph_prior,
    group_statistics,
    half_life_weight,
    linear_quantiles,
    neighbor_kernel,
    neighbor_weights,
    percentile_rank,
    predict_all,
    prediction_classes,
    prediction_diagnostics,
    quantile_score,
    rank_correlation,
    reconstructed_variance,
    relation_estimate,
    relation_values,
    task_history,
)
from envsched.synthetic import synthetic_records


def test_eq2_eq9_group_statistics():
    # [1,0,1,1]: m = 0.75; v = (3*0.0625 + 0.5625)/4 = 0.1875; d = 0.1875 / (0.75*0.25) = 1
    m, v, d = group_statistics([1, 0, 1, 1])
    assert (m, v, d) == pytest.approx((0.75, 0.1875, 1.0))
    # [0,0,0,0.2]: m = 0.05; v = (3*0.0025 + 0.0225)/4 = 0.0075; d = 0.0075/0.0475
    m, v, d = group_statistics([0, 0, 0, 0.2])
    assert (m, v, d) == pytest.approx((0.05, 0.0075, 0.0075 / 0.0475))
    # floor: m(1-m) = 0.0099 < 0.01 -> d = 0.0003 / 0.01 = 0.03
    m, v, d = group_statistics([0, 0, 0, 0.04])
    assert (m, v, d) == pytest.approx((0.01, 0.0003, 0.03))
    assert group_statistics([0.5, 0.5]) == pytest.approx((0.5, 0.0, 0.0))
    with pytest.raises(ValueError):
        group_statistics([])


def test_eq10_half_life_weight():
    assert half_life_weight(10, np.array([8.0]), 2)[0] == pytest.approx(0.5)
    assert half_life_weight(10, np.array([2.0]), 8)[0] == pytest.approx(0.5)
    assert half_life_weight(10, np.array([6.0]), 2)[0] == pytest.approx(0.25)


def test_exposure_factor():
    assert exposure_factor(np.array([0, 16, 48]), 16) == pytest.approx([1.0, 1 / math.sqrt(2), 0.5])


def test_eq6_reference_and_centering():
    # steps 0,1 with step means 0.1, 0.2; t = 2, h = 1: weights 1/4, 1/2 -> (0.025 + 0.1) / 0.75
    b_t = global_reference(np.array([0.1, 0.2]), np.array([0, 1]), 2, 1.0)
    assert b_t == pytest.approx(0.125 / 0.75)
    # steps >= t are ignored
    assert global_reference(np.array([0.1, 0.9]), np.array([0, 2]), 2, 1.0) == pytest.approx(0.1)
    # 0.3 - 0.2 + 0.1667 = 0.2667 -> clipped to 0.25 ; 0.02 - 0.2 + 0.1667 = -0.0133 -> 0
    out = center(np.array([0.3, 0.02, 0.2]), np.array([0.2, 0.2, 0.2]), b_t, (0.0, 0.25))
    assert out == pytest.approx([0.25, 0.0, 0.2 - 0.2 + 0.125 / 0.75])


def test_eq11_task_history():
    # node 0: y~ = 0.2 at step 0, 0.1 at step 1; t=2, h=1 -> W = 0.25 + 0.5, ybar = (0.05 + 0.05) / 0.75
    W, ybar = task_history(np.array([0, 0, 2]), np.array([0, 1, 5]), np.array([0.2, 0.1, 0.9]), 2, 1.0, 3, b_t=0.07)
    assert W == pytest.approx([0.75, 0.0, 0.0])
    assert ybar == pytest.approx([0.1 / 0.75, 0.07, 0.07])  # node 2 observed only at step 5 >= t


def test_eq7_neighbor_weights():
    sims = np.array([[0.9, 0.6, 0.5]])
    W = np.array([[1.0, 4.0, 0.05]])
    a = neighbor_weights(sims, W, np.ones((1, 3), bool), 0.05, (0.1, 3.0))
    # delta = (0.1, 0.4, 0.5), sigma = median = 0.4; sqrt(clip W) = (1, sqrt 3, sqrt 0.1)
    expect = [math.exp(-0.5 * 0.25**2) * 1.0, math.exp(-0.5) * math.sqrt(3.0), math.exp(-0.5 * 1.25**2) * math.sqrt(0.1)]
    assert a[0] == pytest.approx(expect)
    # bandwidth floor: delta = (0, 0.01) -> median 0.005 -> sigma 0.05; unavailable entry gets 0 and skips the median
    a = neighbor_weights(np.array([[1.0, 0.99, 0.1]]), np.array([[1.0, 1.0, 1.0]]), np.array([[True, True, False]]))
    assert a[0] == pytest.approx([1.0, math.exp(-0.5 * (0.01 / 0.05) ** 2), 0.0])
    # even count: median is the mean of the two middle values: delta (0.2, 0.4) -> sigma 0.3
    a = neighbor_weights(np.array([[0.8, 0.6]]), np.array([[1.0, 1.0]]), np.ones((1, 2), bool))
    assert a[0] == pytest.approx([math.exp(-0.5 * (0.2 / 0.3) ** 2), math.exp(-0.5 * (0.4 / 0.3) ** 2)])


def test_eq3_relation_estimate():
    # (1*0.1 + 2*0.4 + 2*0.2) / (1 + 2 + 2) = 1.3 / 5
    g = relation_estimate(np.array([[1.0, 2.0], [0.0, 0.0]]), np.array([[0.1, 0.4], [0.9, 0.9]]), 0.2, 2.0)
    assert g == pytest.approx([0.26, 0.2])  # second target: no available neighbour -> b_t


def test_eq4_fusion():
    P, y = fuse(np.array([0.2, 0.2]), np.array([0.4, 0.4]), np.array([2.0, 0.0]), np.array([0.1, 0.9]), 2.0)
    assert P == pytest.approx([0.3, 0.3])
    assert y == pytest.approx([(2 * 0.1 + 2 * 0.3) / 4, 0.3])


def test_eq8_percentile_rank_average_ties():
    assert percentile_rank(np.array([3.0, 1.0, 3.0, 2.0])) == pytest.approx([0.75, 0.125, 0.75, 0.375])


def test_eq12_reconstruction_and_quantile_mapping():
    assert reconstructed_variance(np.array([0.5]), np.array([0.2])) == pytest.approx([0.08])
    v = np.array([0.0, 0.1, 0.2, 0.3])
    f = np.array([0.3, 0.2, 0.1, 0.0])
    # pr(v) = (.125,.375,.625,.875), pr(f) reversed; p = .65 pr(v) + .35 pr(f) = (.3875,.4625,.5375,.6125)
    # Q linear on (0,.1,.2,.3): position 3p -> value 0.1 * 3p
    assert quantile_score(v, f, 0.65) == pytest.approx([0.11625, 0.13875, 0.16125, 0.18375])


def test_eq13_decline():
    u, q = decline_priority(np.array([0.2, 0.1, 0.3]), np.array([0.1, 0.2, 0.3]), 0.5)
    assert u == pytest.approx([0.15, 0.1, 0.3])
    assert q == pytest.approx([1.5 / 3, 0.5 / 3, 2.5 / 3])


def test_full_pass_by_hand():
    """Two tasks, one neighbour edge each way; everything computed by hand for h_long = h_short = 1."""
    cfg = EnvSchedConfig(h_long=1.0, h_short=1.0, k_within=1, k_cross=0)
    log = ObservationLog()
    log.add(0, 0, 0.5, 0.2, 0.8)  # step 0: step means b_0 = (0.5, 0.2, 0.8)
    # t = 1: b_1 = b_0, y~ = y, W_0 = 2^-1 = 0.5, ybar_0 = y_0; task 1 has no history
    nbr_idx = {"in": np.array([[1], [0]]), "cross": np.zeros((2, 0), dtype=np.int64)}
    nbr_sim = {"in": np.array([[0.7], [0.7]]), "cross": np.zeros((2, 0))}
    pred = predict_all(log, nbr_idx, nbr_sim, 1, ["a", "b"], cfg)
    # task 1: neighbour 0, delta = 0.3 = sigma -> a = exp(-0.5) * sqrt(clip(0.5)) ; G_in = (a y0 + 2 b)/(a + 2) = y0
    # (b = y0), G_cross = b -> P = y0 -> yhat = y0 for both tasks
    assert pred.v == pytest.approx([0.2, 0.2])
    assert pred.m == pytest.approx([0.5, 0.5])
    assert pred.q == pytest.approx([0.5, 0.5])  # all tied
    assert pred.reference == pytest.approx({"v": 0.2, "m": 0.5, "d": 0.8})


# -- edge cases and the non-paper branches, against hand values and a loop oracle -------------------------------------

# Non-default, pairwise distinct hyper-parameters (a swap of two of them changes the result).
PARAMS = {
    "lambda_g": 0.7,
    "lambda_s": 3.1,
    "h_long": 5.0,
    "h_short": 1.5,
    "eta_decline": 0.35,
    "fusion_within": 0.3,
    "quantile_weight_v": 0.55,
    "bandwidth_floor": 0.12,
    "neighbor_weight_clip": (0.45, 1.3),
    "dispersion_floor": 0.03,
    "clip_v": (0.0, 0.2),
    "clip_m": (0.08, 0.9),
    "clip_d": (0.0, 0.95),
    "rollouts_per_task": 5,
}


def clip(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


def oracle_pr(z: list[float]) -> list[float]:
    out = []
    for zi in z:
        below = sum(1 for zj in z if zj < zi - 1e-12)
        tied = sum(1 for zj in z if abs(zj - zi) <= 1e-12)
        out.append((below + (tied + 1) / 2 - 0.5) / len(z))
    return out


def oracle_quantile(values: list[float], p: float) -> float:
    s = sorted(values)
    pos = p * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (pos - lo) * (s[hi] - s[lo])


def oracle_pass(obs, idx, sim, env, t, h, cfg: EnvSchedConfig) -> dict:
    """``obs`` rows (i, s, m, v, d); ``idx``/``sim``: per relation, rows of candidate neighbours (-1 = empty)."""
    N = len(env)
    intervals = {"v": cfg.clip_v, "m": cfg.clip_m, "d": cfg.clip_d}
    col = {"m": 2, "v": 3, "d": 4}
    past = [o for o in obs if o[1] < t]
    steps = sorted({o[1] for o in past})
    w = {s: 2.0 ** (-(t - s) / h) for s in steps}
    W = [0.0] * N
    for o in past:
        W[o[0]] += w[o[1]]
    b, ybar = {}, {}
    for y in ("v", "m", "d"):
        b_s = {s: sum(o[col[y]] for o in past if o[1] == s) / sum(1 for o in past if o[1] == s) for s in steps}
        b[y] = sum(w[s] * b_s[s] for s in steps) / sum(w[s] for s in steps) if steps else 0.0
        num = [0.0] * N
        for o in past:
            num[o[0]] += w[o[1]] * clip(o[col[y]] - b_s[o[1]] + b[y], *intervals[y])
        ybar[y] = [num[i] / W[i] if W[i] > 0 else b[y] for i in range(N)]
    # Eq. 7 weights over the available entries (index >= 0 and own history non-empty)
    a = {}
    for rel in ("in", "cross"):
        a[rel] = []
        for i in range(N):
            js = [(j, sim[rel][i][k]) for k, j in enumerate(idx[rel][i]) if j >= 0 and W[j] > 0]
            deltas = sorted(clip(1 - s_, 0.0, 1.0) for _, s_ in js)
            if deltas:
                mid = len(deltas) // 2
                med = deltas[mid] if len(deltas) % 2 else 0.5 * (deltas[mid - 1] + deltas[mid])
            else:
                med = 1.0
            sigma = max(med, cfg.bandwidth_floor)
            a[rel].append(
                [
                    (
                        j,
                        math.exp(-0.5 * (clip(1 - s_, 0.0, 1.0) / sigma) ** 2)
                        * math.sqrt(clip(W[j], *cfg.neighbor_weight_clip)),
                    )
                    for j, s_ in js
                ]
            )
    relative = {"global": (), "environment": ("v", "m", "d"), "environment_mean": ("m",)}[cfg.cross_reference]
    lg, ls, wi = cfg.lambda_g, cfg.lambda_s, cfg.fusion_within
    out = {"b": b, "W": W}
    for y in ("v", "m", "d"):
        # environment level: Eq. 3 over an environment's own tasks with weights W_j
        level = {}
        for e in set(env):
            num = sum(W[j] * ybar[y][j] for j in range(N) if env[j] == e) + lg * b[y]
            den = sum(W[j] for j in range(N) if env[j] == e) + lg
            level[e] = num / den if den > 0 else b[y]
        yhat = []
        for i in range(N):
            S, A, G = {}, {}, {}
            for rel in ("in", "cross"):
                vals = []
                for j, aj in a[rel][i]:
                    if rel == "cross" and y in relative:
                        vals.append((aj, clip(ybar[y][j] - level[env[j]] + level[env[i]], *intervals[y])))
                    else:
                        vals.append((aj, ybar[y][j]))
                S[rel] = sum(aj * v for aj, v in vals)
                A[rel] = sum(aj for aj, _ in vals)
                G[rel] = (S[rel] + lg * b[y]) / (A[rel] + lg) if A[rel] + lg > 0 else b[y]
            if cfg.fusion == "fixed":
                P = wi * G["in"] + (1 - wi) * G["cross"]
            else:
                den = 2 * wi * A["in"] + 2 * (1 - wi) * A["cross"] + lg
                P = (2 * wi * S["in"] + 2 * (1 - wi) * S["cross"] + lg * b[y]) / den if den > 0 else b[y]
            yhat.append((W[i] * ybar[y][i] + ls * P) / (W[i] + ls) if W[i] + ls > 0 else P)
        out[y] = yhat
    K = cfg.rollouts_per_task
    if cfg.reconstructed_target == "bernoulli":
        out["f"] = [d * m * (1 - m) for d, m in zip(out["d"], out["m"])]
    else:
        out["f"] = [d * (1 - clip(m, 0, 1) ** K - (1 - clip(m, 0, 1)) ** K) for d, m in zip(out["d"], out["m"])]
    pv, pf = oracle_pr(out["v"]), oracle_pr(out["f"])
    out["u"] = [
        oracle_quantile(out["v"], cfg.quantile_weight_v * pv[i] + (1 - cfg.quantile_weight_v) * pf[i]) for i in range(N)
    ]
    return out


def make_scenario(seed: int):
    """12 tasks in 3 environments; steps 0..6 (step 3 absent) so that t = 3 and t = 6 also hold observations
    at the prediction step itself and after it; one task observed at every step (W above the Eq. 7 clip), one
    observed once early (W below it), several never observed; neighbour rows mix -1 slots, tasks without
    history and tasks with history."""
    rng = np.random.default_rng(seed)
    N = 12
    env = [i % 3 for i in range(N)]
    obs = []
    for s in (0, 1, 2, 4, 5, 6):
        batch = [0] + [int(i) for i in rng.choice(np.arange(2, 10), size=4, replace=False)]
        if s == 0:
            batch.append(1)
        for i in batch:
            r = (rng.random(5) < rng.uniform(0.05, 0.95)).astype(float) if i % 2 else np.round(rng.random(5) * 4) / 4
            obs.append((i, s, *group_statistics(r, PARAMS["dispersion_floor"])))
    idx, sim = {}, {}
    for rel in ("in", "cross"):
        idx[rel] = np.full((N, 5), -1, dtype=np.int64)
        sim[rel] = np.full((N, 5), -np.inf)
        for i in range(N):
            cands = [j for j in range(N) if j != i and (env[j] == env[i]) == (rel == "in")]
            row = [int(j) for j in rng.choice(cands, size=min(4, len(cands)), replace=False)]
            idx[rel][i, : len(row)] = row
            sim[rel][i, : len(row)] = rng.uniform(0.3, 0.99, size=len(row))
    idx["in"][11] = -1  # a target without any within-environment candidate
    return obs, idx, sim, env


def fill_log(obs) -> ObservationLog:
    log = ObservationLog()
    for row in obs:
        log.add(*row)
    return log


MODES = [
    ("environment", "evidence", "learnability"),
    ("environment_mean", "fixed", "bernoulli"),
    ("global", "evidence", "bernoulli"),
    ("environment", "fixed", "learnability"),
]


@pytest.mark.parametrize("cross_reference,fusion,target", MODES)
@pytest.mark.parametrize("t", [3, 6])
def test_estimate_half_life_matches_loop_oracle_in_every_mode(cross_reference, fusion, target, t):
    obs, idx, sim, env = make_scenario(7)
    cfg = EnvSchedConfig(cross_reference=cross_reference, fusion=fusion, reconstructed_target=target, **PARAMS)
    log = fill_log(obs)
    W_ref = None
    for h in (cfg.h_long, cfg.h_short):
        ref = oracle_pass(obs, idx, sim, env, t, h, cfg)
        got = estimate_half_life(log, idx, sim, t, h, len(env), cfg, env=np.array(env))
        for k in ("v", "m", "d", "f", "u", "W"):
            np.testing.assert_allclose(got[k], ref[k], rtol=1e-10, atol=1e-13, err_msg=f"{k} h={h}")
        assert got["b"] == pytest.approx(ref["b"], rel=1e-12)
        W_ref = ref["W"]
    # the scenario does exercise the edges it claims to
    assert max(W_ref) > cfg.neighbor_weight_clip[1] or t == 3
    assert 0 < min(w for w in W_ref if w > 0) < cfg.neighbor_weight_clip[0]
    assert any(o[1] >= t for o in obs) and any(o[1] == t for o in obs) == (t == 6)


def test_the_mode_oracle_sees_the_mode():
    """The modes really change the prediction on this scenario (so a mode that is ignored is caught)."""
    obs, idx, sim, env = make_scenario(7)
    log = fill_log(obs)
    outs = {}
    for mode in [("global", "fixed", "bernoulli"), *MODES]:
        cfg = EnvSchedConfig(cross_reference=mode[0], fusion=mode[1], reconstructed_target=mode[2], **PARAMS)
        outs[mode] = estimate_half_life(log, idx, sim, 6, cfg.h_long, len(env), cfg, env=np.array(env))
    base = outs[("global", "fixed", "bernoulli")]
    for mode in MODES:
        assert not np.allclose(outs[mode]["m"], base["m"]) or not np.allclose(outs[mode]["f"], base["f"]), mode


@pytest.mark.parametrize("cross_reference,fusion,target", MODES[:2])
def test_predict_all_environment_modes_against_oracle(cross_reference, fusion, target):
    obs, idx, sim, env = make_scenario(11)
    cfg = EnvSchedConfig(cross_reference=cross_reference, fusion=fusion, reconstructed_target=target, **PARAMS)
    ids = [f"task{i}" for i in range(len(env))]
    pred = predict_all(fill_log(obs), idx, sim, 6, ids, cfg, env=np.array(env))
    long = oracle_pass(obs, idx, sim, env, 6, cfg.h_long, cfg)
    short = oracle_pass(obs, idx, sim, env, 6, cfg.h_short, cfg)
    u = [ul - cfg.eta_decline * max(ul - us, 0.0) for ul, us in zip(long["u"], short["u"])]
    for k, want in (
        ("v", long["v"]),
        ("m", long["m"]),
        ("d", long["d"]),
        ("f", long["f"]),
        ("u_long", long["u"]),
        ("u_short", short["u"]),
        ("u", u),
        ("q", oracle_pr(u)),
    ):
        np.testing.assert_allclose(getattr(pred, k), want, rtol=1e-10, atol=1e-13, err_msg=k)
    assert pred.task_ids == ids and pred.step == 6
    assert pred.reference == pytest.approx(long["b"], rel=1e-12)
    d = pred.as_dict()
    assert list(d) == ids
    assert d["task3"] == pytest.approx({"v": pred.v[3], "m": pred.m[3], "d": pred.d[3], "q": pred.q[3]})
    assert all(isinstance(x, float) for x in d["task0"].values())


@pytest.mark.parametrize("mode", ["environment", "environment_mean"])
def test_environment_modes_need_env(mode):
    obs, idx, sim, env = make_scenario(7)
    cfg = EnvSchedConfig(cross_reference=mode, **PARAMS)
    with pytest.raises(ValueError, match="needs the environment of every task"):
        predict_all(fill_log(obs), idx, sim, 6, [str(i) for i in range(len(env))], cfg)
    with pytest.raises(ValueError, match=f"cross_reference='{mode}'"):
        estimate_half_life(fill_log(obs), idx, sim, 6, 2.0, len(env), cfg)


def test_kernel_cache_is_filled_reused_for_an_equal_mask_and_ignored_otherwise():
    obs, idx, sim, env = make_scenario(7)
    cfg = EnvSchedConfig(**PARAMS)
    log = fill_log(obs)
    n = len(env)
    plain = estimate_half_life(log, idx, sim, 6, 2.0, n, cfg)  # kernels=None: no cache at all
    kernels: dict = {}
    cached = estimate_half_life(log, idx, sim, 6, 2.0, n, cfg, kernels)
    np.testing.assert_array_equal(cached["v"], plain["v"])
    has = plain["W"] > 0
    for rel in ("in", "cross"):
        mask, kern = kernels[rel]
        want_mask = (idx[rel] >= 0) & has[np.maximum(idx[rel], 0)]
        np.testing.assert_array_equal(mask, want_mask)
        np.testing.assert_allclose(kern, neighbor_kernel(sim[rel], want_mask, cfg.bandwidth_floor))
    # an entry for the same mask is taken as it is (here a flat kernel: every available neighbour counts 1)
    flat = {rel: (kernels[rel][0].copy(), np.ones_like(kernels[rel][1])) for rel in kernels}
    reused = estimate_half_life(log, idx, sim, 6, 2.0, n, cfg, dict(flat))
    assert not np.allclose(reused["m"], plain["m"])
    # an entry for another mask is recomputed
    stale = {rel: (~flat[rel][0], flat[rel][1]) for rel in flat}
    again = estimate_half_life(log, idx, sim, 6, 2.0, n, cfg, stale)
    np.testing.assert_array_equal(again["m"], plain["m"])
    # predict_all shares one cache between its two passes and still equals two uncached passes
    pred = predict_all(log, idx, sim, 6, [str(i) for i in range(n)], cfg)
    np.testing.assert_allclose(pred.u_short, estimate_half_life(log, idx, sim, 6, cfg.h_short, n, cfg)["u"], rtol=1e-12)


def test_environment_reference_by_hand():
    # env 0: tasks 0, 2 (W 1.5, 0.5; ybar 0.2, 0.6); env 1: task 1 (W 0) ; env 2: task 3 (W 0.25, ybar 0.9)
    ybar = np.array([0.2, 0.4, 0.6, 0.9])
    W = np.array([1.5, 0.0, 0.5, 0.25])
    env = np.array([0, 1, 0, 2])
    e = environment_reference(ybar, W, env, 0.3, 0.7)
    e0 = (1.5 * 0.2 + 0.5 * 0.6 + 0.7 * 0.3) / (1.5 + 0.5 + 0.7)
    e2 = (0.25 * 0.9 + 0.7 * 0.3) / (0.25 + 0.7)  # denominator 0.95 < 1
    assert e == pytest.approx([e0, 0.3, e0, e2], rel=1e-12)  # env 1 has no history -> (0 + lg b)/lg = b
    assert e.dtype == np.float64
    # lambda_g = 0: an environment without history gets b_t (0/0 avoided), the others the plain W-mean
    e = environment_reference(ybar, W, env, 0.3, 0.0)
    assert e == pytest.approx([(0.3 + 0.3) / 2.0, 0.3, 0.6 / 2.0, 0.9], rel=1e-12)
    assert np.isfinite(e).all() and e.dtype == np.float64
    # unused environment codes are allowed (env 1 missing here)
    assert environment_reference(
        np.array([0.5, 0.1]), np.array([1.0, 1.0]), np.array([0, 2]), 0.2, 0.5
    ) == pytest.approx([(0.5 + 0.1) / 1.5, (0.1 + 0.1) / 1.5])
    # no task at all (plain lists)
    out = environment_reference(np.zeros(0), np.zeros(0), [], 0.3, 0.7)
    assert out.shape == (0,)


def test_relation_values_global_and_environment_transfer():
    # one row per target (all 4 tasks), one column per neighbour slot
    ybar = np.array([0.1, 0.5, 0.95, 0.3])
    safe = np.array([[1, 2], [2, 3], [3, 3], [0, 1]])
    assert relation_values(ybar, safe, None, (0.0, 1.0)) == pytest.approx(
        np.array([[0.5, 0.95], [0.95, 0.3], [0.3, 0.3], [0.1, 0.5]])
    )
    level = np.array([0.2, 0.6, 0.4, 0.5])
    # neighbour j moved by -e(j) + e(i), clipped to (0.05, 0.9)
    got = relation_values(ybar, safe, level, (0.05, 0.9))
    raw = np.array(
        [
            [0.5 - 0.6 + 0.2, 0.95 - 0.4 + 0.2],
            [0.95 - 0.4 + 0.6, 0.3 - 0.5 + 0.6],
            [0.3 - 0.5 + 0.4, 0.3 - 0.5 + 0.4],
            [0.1 - 0.2 + 0.5, 0.5 - 0.6 + 0.5],
        ]
    )
    assert raw[1, 0] > 0.9 and (np.delete(raw.ravel(), 2) < 0.9).all() and raw.min() > 0.05  # the upper clip bites once
    assert got == pytest.approx(np.clip(raw, 0.05, 0.9))
    assert got[1, 0] == pytest.approx(0.9)
    low = relation_values(np.array([0.02, 0.1]), np.array([[1], [0]]), np.array([0.5, 0.1]), (0.05, 0.9))
    assert low == pytest.approx(np.array([[0.5], [0.05]]))  # 0.1 - 0.1 + 0.5 ; 0.02 - 0.5 + 0.1 < 0.05 -> lower clip


def test_graph_prior_fixed_and_evidence_by_hand():
    G_in, G_cr = np.array([0.6, 0.6, 0.3, 0.25]), np.array([0.2, 0.2, 0.3, 0.25])
    A_in, A_cr = np.array([1.2, 0.0, 0.4, 0.0]), np.array([0.5, 0.8, 0.0, 0.0])
    b, lg, w = 0.25, 0.7, 0.3
    # fixed (paper): w G_in + (1 - w) G_cross
    assert graph_prior(G_in, G_cr, A_in, A_cr, b, lg, w, "fixed") == pytest.approx(w * G_in + (1 - w) * G_cr)
    # defaults: w = 1/2, mode "fixed" (masses ignored)
    assert graph_prior(G_in, G_cr, A_in, A_cr, b, lg) == pytest.approx(0.5 * G_in + 0.5 * G_cr)
    got = graph_prior(G_in, G_cr, A_in, A_cr, b, lg, w, "evidence")
    want = []
    for gi, gc, ai, ac in zip(G_in, G_cr, A_in, A_cr):
        si = gi * (ai + lg) - lg * b
        sc = gc * (ac + lg) - lg * b
        want.append((0.6 * si + 1.4 * sc + lg * b) / (0.6 * ai + 1.4 * ac + lg))
    assert got == pytest.approx(want, rel=1e-12)
    # row 0 by hand: S_in = 0.6*1.9 - 0.175 = 0.965, S_cr = 0.2*1.2 - 0.175 = 0.065
    assert got[0] == pytest.approx((0.6 * 0.965 + 1.4 * 0.065 + 0.175) / (0.72 + 0.7 + 0.7))
    assert got[3] == pytest.approx(0.25)  # no evidence at all: b_t (G_r = b_t there)
    assert got.dtype == np.float64


def test_graph_prior_evidence_zero_and_small_denominators():
    # lambda_g = 0 and no mass: 0/0 -> b_t; small masses (denominator < 1) divide as they are
    G_in, G_cr = np.array([0.4, 0.8, 0.9]), np.array([0.1, 0.5, 0.7])
    A_in, A_cr = np.array([0.0, 0.3, 0.0]), np.array([0.0, 0.1, 0.2])
    got = graph_prior(G_in, G_cr, A_in, A_cr, 0.35, 0.0, 0.3, "evidence")
    assert got[0] == pytest.approx(0.35)
    assert got[1] == pytest.approx((0.6 * 0.8 * 0.3 + 1.4 * 0.5 * 0.1) / (0.6 * 0.3 + 1.4 * 0.1))
    assert got[2] == pytest.approx(0.7)  # only the cross relation carries evidence -> undiluted
    assert np.isfinite(got).all() and got.dtype == np.float64
    # evidence with equal masses and w = 1/2 pools both relations: (S_in + S_cr + lg b) / (A_in + A_cr + lg)
    p = graph_prior(np.array([0.6]), np.array([0.2]), np.array([0.5]), np.array([0.5]), 0.3, 0.4, 0.5, "evidence")
    s_in, s_cr = 0.6 * 0.9 - 0.12, 0.2 * 0.9 - 0.12
    assert p == pytest.approx([(s_in + s_cr + 0.12) / 1.4])


def test_reconstructed_variance_learnability_by_hand():
    d = np.array([0.8, 0.5, 0.9, 0.6, 0.7])
    m = np.array([0.3, 0.5, -0.2, 1.3, 0.0])
    got = reconstructed_variance(d, m, "learnability", 5)
    want = [0.8 * (1 - 0.3**5 - 0.7**5), 0.5 * (1 - 2 * 0.5**5), 0.0, 0.0, 0.0]  # m clipped into [0, 1]
    assert got == pytest.approx(want, abs=1e-15)
    # default K = 8
    assert reconstructed_variance(d[:2], m[:2], "learnability") == pytest.approx(
        [0.8 * (1 - 0.3**8 - 0.7**8), 0.5 * (1 - 2 * 0.5**8)]
    )
    # bernoulli is the default target, no clipping of m
    assert reconstructed_variance(d, m) == pytest.approx(d * m * (1 - m))
    with pytest.raises(
        ValueError, match="reconstructed_target must be 'bernoulli' or 'learnability', got 'Learnability'"
    ):
        reconstructed_variance(d, m, "Learnability")


def test_quantile_and_decline_defaults():
    v = np.array([0.0, 0.1, 0.2, 0.3])
    f = np.array([0.3, 0.2, 0.1, 0.0])
    # default weight 0.65 (the values of test_eq12_reconstruction_and_quantile_mapping)
    assert quantile_score(v, f) == pytest.approx([0.11625, 0.13875, 0.16125, 0.18375])
    u, q = decline_priority(np.array([0.5, 0.25, 0.75]), np.array([0.25, 0.5, 0.25]))
    assert u == pytest.approx([0.375, 0.25, 0.5])  # default eta = 0.5: 0.5 - 0.125 ; no decline ; 0.75 - 0.25
    assert q == pytest.approx([1.5 / 3, 0.5 / 3, 2.5 / 3])


@pytest.mark.parametrize("seed", [0, 1])
def test_average_rank_equals_scipy_rankdata(seed):
    rng = np.random.default_rng(seed)
    z = np.round(rng.random(40) * 6) / 6  # many ties
    np.testing.assert_array_equal(average_rank(z), rankdata(z, method="average"))
    zi = rng.integers(0, 5, size=17).tolist()  # a plain list of ints
    np.testing.assert_array_equal(average_rank(zi), rankdata(zi, method="average"))
    assert average_rank(np.array([2.5])) == pytest.approx([1.0])


def test_average_rank_edge_inputs_follow_scipy():
    assert average_rank(np.zeros(0)).shape == (0,)
    nan = average_rank(np.array([0.3, np.nan, 0.1]))
    np.testing.assert_array_equal(nan, rankdata(np.array([0.3, np.nan, 0.1]), method="average"))
    two_d = np.array([[3.0, 1.0, 2.0], [1.0, 5.0, 0.5]])
    np.testing.assert_array_equal(average_rank(two_d), rankdata(two_d, method="average"))
    np.testing.assert_array_equal(average_rank(np.float64(4.0)), rankdata(np.float64(4.0), method="average"))
    assert percentile_rank([5, 1, 5]) == pytest.approx([(2.5 - 0.5) / 3, 0.5 / 3, 2.0 / 3])


def test_rank_correlation_edges():
    x, y = [0.1, 0.4, 0.2, 0.9], [1.0, 3.0, 2.0, 2.5]
    assert rank_correlation(x, y) == pytest.approx(spearmanr(x, y)[0])
    # exactly min_count pairs are enough; min_count below 2 still needs 2 pairs; min_count = 2 allows 2
    assert rank_correlation([0.0, 0.5, 1.0], [2.0, 1.0, 3.0]) == pytest.approx(0.5)  # range of x is exactly 1
    assert rank_correlation([0.2, 0.7, 0.5], [0.0, 1.0, 0.4]) == pytest.approx(1.0)  # range of y is exactly 1
    assert rank_correlation([1.0, 2.0], [3.0, 5.0], min_count=2) == pytest.approx(1.0)
    assert rank_correlation([1.0, 2.0], [3.0, 5.0], min_count=0) == pytest.approx(1.0)
    assert rank_correlation([1.0], [3.0], min_count=0) is None
    assert rank_correlation([1.0, 2.0, 3.0], [3.0, 5.0, 4.0], min_count=4) is None
    # booleans and ints are numbers here
    assert rank_correlation([True, False, True, False], [0.9, 0.1, 0.8, 0.3]) == pytest.approx(
        spearmanr([1, 0, 1, 0], [0.9, 0.1, 0.8, 0.3])[0]
    )
    assert rank_correlation([0.9, 0.1, 0.8, 0.3], [True, False, True, False]) == pytest.approx(
        spearmanr([0.9, 0.1, 0.8, 0.3], [1, 0, 1, 0])[0]
    )
    # undefined: constant x or constant y (None without scipy's constant-input warning); NaN input
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert rank_correlation([0.3, 0.3, 0.3, 0.3], [0.1, 0.2, 0.4, 0.3]) is None
        assert rank_correlation([0.1, 0.2, 0.4, 0.3], [0.5, 0.5, 0.5, 0.5]) is None
    assert rank_correlation([0.1, np.nan, 0.4, 0.3], [0.1, 0.2, 0.4, 0.3]) is None


def test_prediction_diagnostics_min_count_and_defaults():
    score = np.array([0.1, 0.5, 0.3, 0.9, 0.7, 0.2, 0.6])
    real = np.array([0.01, 0.04, 0.02, 0.05, 0.0, 0.03, 0.06])
    pred_v = np.array([0.02, 0.03, 0.01, 0.06, 0.02, 0.04, 0.05])
    ev = np.array([0, 0, 0, 1, 1, 1, 1])
    out = prediction_diagnostics(score, real, ev, pred_v)  # default min_count 3: both types reported
    assert out["spearman_q_observed"] == pytest.approx(spearmanr(score[:3], real[:3])[0])
    assert out["spearman_v_within_env"] == pytest.approx(spearmanr(pred_v[3:], real[3:])[0])
    assert out["spearman_q_all"] == pytest.approx(spearmanr(score, real)[0])
    assert out["scored_observed"] == 3.0 and out["scored_cold"] == 0.0
    out = prediction_diagnostics(score, real, ev, pred_v, min_count=4)  # only the 4-group and "all" remain
    assert "spearman_q_observed" not in out and "spearman_v_observed" not in out
    assert "spearman_q_within_env" in out and "spearman_v_within_env" in out
    out = prediction_diagnostics(score.tolist(), real.tolist(), ev.tolist(), pred_v.tolist(), min_count=5)
    assert {k for k in out if k.startswith("spearman")} == {"spearman_q_all", "spearman_v_all"}


def test_group_statistics_clip_and_messages():
    # rewards outside [0, 1] (accepted when finite): m = 0, v = 1, d = 1 / max(0, 0.01) = 100 -> clipped to 1
    assert group_statistics([-1.0, 1.0]) == pytest.approx((0.0, 1.0, 1.0))
    assert group_statistics([-1.0, 1.0, 1.0, 1.0], dispersion_floor=0.5)[2] == pytest.approx(1.0)
    assert group_statistics([1, 0, 0, 0]) == pytest.approx((0.25, 0.1875, 1.0))  # ints
    with pytest.raises(ValueError, match=r"^a reward group must be a non-empty 1-D sequence$"):
        group_statistics([[0.0, 1.0]])
    with pytest.raises(ValueError, match=r"non-finite reward in group \[0.5, nan\]"):
        group_statistics([0.5, float("nan")])


def test_global_reference_without_earlier_steps_is_zero():
    assert global_reference(np.array([0.4, 0.6]), np.array([3, 5]), 3, 2.0) == 0.0
    assert global_reference(np.zeros(0), np.zeros(0), 1, 2.0) == 0.0


def test_task_history_observation_at_t_and_integer_reference():
    # step == t does not count (H_t holds s < t); b_t given as the integer 0 still gives float y-bar
    W, ybar = task_history(np.array([0, 0, 1]), np.array([1, 3, 3]), np.array([0.3, 0.9, 0.7]), 3, 2.0, 3, 0)
    assert W == pytest.approx([0.5, 0.0, 0.0])
    assert ybar == pytest.approx([0.3, 0.0, 0.0])
    W, ybar = task_history(np.array([2, 2]), np.array([0, 1]), np.array([0.25, 0.5]), 2, 1.0, 3, 1)
    assert ybar == pytest.approx([1.0, 1.0, (0.25 * 0.25 + 0.5 * 0.5) / 0.75])
    assert ybar.dtype == np.float64


def test_relation_estimate_zero_denominator_and_integer_reference():
    a = np.array([[0.0, 0.0], [0.5, 0.25]])
    vals = np.array([[0.9, 0.9], [0.2, 0.8]])
    g = relation_estimate(a, vals, 0.3, 0.0)  # lambda_g = 0, no neighbour: b_t, not 0/0
    assert g == pytest.approx([0.3, (0.1 + 0.2) / 0.75])
    g = relation_estimate(a, vals, 1, 0.5)  # integer b_t
    assert g == pytest.approx([1.0, (0.1 + 0.2 + 0.5) / 1.25])
    assert g.dtype == np.float64


def test_fuse_prior_zero_and_small_denominators():
    P = np.array([0.4, 0.4, 0.6])
    W = np.array([0.0, 0.3, 0.2])
    ybar = np.array([0.9, 0.1, 0.5])
    got = fuse_prior(P, W, ybar, 0.0)  # lambda_s = 0: W = 0 -> P; otherwise the task's own y-bar
    assert got == pytest.approx([0.4, 0.1, 0.5])
    got = fuse_prior(P, W, ybar, 0.5)  # denominators 0.5, 0.8, 0.7 (< 1)
    assert got == pytest.approx([0.4, (0.03 + 0.2) / 0.8, (0.1 + 0.3) / 0.7])


def test_neighbor_kernel_default_floor_and_similarities_outside_0_1():
    # default floor 0.05: delta (0.01, 0.03, 0.02) -> median 0.02 < 0.05 -> sigma 0.05
    k = neighbor_kernel(np.array([[0.99, 0.97, 0.98]]), np.ones((1, 3), bool))
    assert k[0] == pytest.approx(np.exp(-0.5 * (np.array([0.01, 0.03, 0.02]) / 0.05) ** 2))
    # similarities above 1 give delta 0, below 0 give delta 1 (clip_[0,1](1 - S)); median over available only
    sim = np.array([[1.3, 1.2, 0.5, -0.5]])
    avail = np.array([[True, True, True, True]])
    k = neighbor_kernel(sim, avail, 0.1)
    # delta = (0, 0, 0.5, 1): median 0.25
    assert k[0] == pytest.approx(np.exp(-0.5 * (np.array([0.0, 0.0, 0.5, 1.0]) / 0.25) ** 2))
    k = neighbor_kernel(np.array([[-0.4, 0.2, 0.6]]), np.array([[1, 1, 0]]), 0.1)  # 0/1 ints as the mask
    # delta (1, 0.8) -> median 0.9
    assert k[0, :2] == pytest.approx(np.exp(-0.5 * (np.array([1.0, 0.8]) / 0.9) ** 2))


def test_masked_row_median_rows_without_entries():
    x = np.array([[0.2, 0.4, 0.9, 0.1], [0.5, 0.5, 0.5, 0.5], [0.3, 0.7, 0.6, 0.2]])
    mask = np.array([[True, True, True, False], [False, False, False, False], [True, True, True, True]])
    assert _masked_row_median(x, mask) == pytest.approx([0.4, 1.0, 0.45])
    assert _masked_row_median(np.zeros((2, 0)), np.zeros((2, 0), bool)) == pytest.approx([1.0, 1.0])


def test_observation_log_grows_past_its_initial_capacity_and_is_read_only():
    log = ObservationLog()
    rows = [(i % 7, i // 3, (i % 11) / 10, (i % 5) / 20, (i % 3) / 2) for i in range(2600)]
    for r in rows:
        log.add(*r)
    assert len(log) == 2600
    arr = log.arrays()
    np.testing.assert_array_equal(arr["node"], [r[0] for r in rows])
    np.testing.assert_array_equal(arr["step"], [r[1] for r in rows])
    np.testing.assert_allclose(arr["m"], [r[2] for r in rows])
    np.testing.assert_allclose(arr["d"], [r[4] for r in rows])
    assert arr["node"].dtype == np.int64 and arr["m"].dtype == np.float64
    with pytest.raises(ValueError):
        arr["m"][0] = 1.0
    # a restored log keeps growing
    other = ObservationLog()
    other.load_state_dict(log.state_dict())
    for r in rows[:1500]:
        other.add(*r)
    assert len(other) == 4100
    np.testing.assert_array_equal(other.arrays()["node"][2600:], [r[0] for r in rows[:1500]])
    np.testing.assert_allclose(other.arrays()["v"][:2600], [r[3] for r in rows])


# -- relation evidence: evidence-weighted fusion (Eq. 3-4), environment-relative cross reference, learnability --------

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


# -- rank correlation and the prediction diagnostics ------------------------------------------------------------------

def test_rank_correlation_needs_three_pairs_by_default():
    from envsched.estimate import rank_correlation

    assert rank_correlation([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)
    assert rank_correlation([1, 2], [1, 2]) is None
    assert rank_correlation([1, 2, 3], [1, 2, 3], min_count=4) is None
    assert rank_correlation([1, 1, 1], [1, 2, 3]) is None  # constant side


# ---- prediction diagnostics ------------------------------------------------------------------------------
def test_evidence_types_follow_the_availability_of_eq3():
    log = ObservationLog()
    log.add(0, 0, 0.5, 0.1, 0.4)  # node 0 observed at step 0
    log.add(5, 2, 0.5, 0.1, 0.4)  # node 5 observed at step 2 (not before t = 2)
    idx = {
        "in": np.array([[-1, -1], [0, -1], [5, -1], [-1, -1], [5, 0], [-1, -1]]),
        "cross": np.array([[-1], [-1], [0], [0], [-1], [5]]),
    }
    got = evidence_types(log, idx, 2, np.arange(6), 6)
    # 0: own history; 1: within neighbour 0; 2: within neighbour 5 has no history before t = 2, cross 0 has;
    # 3: cross only; 4: within neighbour 0 (5 unavailable); 5: cross neighbour 5 unavailable -> cold
    assert [EVIDENCE_TYPES[c] for c in got] == ["observed", "within_env", "cross_env_only", "cross_env_only", "within_env", "cold"]
    assert [EVIDENCE_TYPES[c] for c in evidence_types(log, idx, 3, np.arange(6), 6)] == ["observed", "within_env", "within_env", "cross_env_only", "within_env", "observed"]


def test_prediction_diagnostics_report_only_defined_correlations():
    q = np.array([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8])
    v = np.array([0.0, 0.01, 0.02, 0.05, 0.04, 0.06, 0.2, 0.1])
    ev = np.array([0, 0, 0, 0, 1, 1, 2, 2])
    out = prediction_diagnostics(q, v, ev, predicted_v=-q)
    assert out["spearman_q_observed"] == pytest.approx(1.0)
    assert out["spearman_v_observed"] == pytest.approx(-1.0)
    assert out["spearman_q_all"] == pytest.approx(spearmanr(q, v)[0])
    assert "spearman_q_within_env" not in out and "spearman_q_cross_env_only" not in out  # only 2 groups each
    assert "spearman_q_cold" not in out
    assert (out["scored_observed"], out["scored_within_env"], out["scored_cross_env_only"], out["scored_cold"], out["scored_all"]) == (4, 2, 2, 0, 8)
    const = prediction_diagnostics(np.full(5, 0.5), v[:5], np.zeros(5, dtype=int))
    assert "spearman_q_observed" not in const and "spearman_q_all" not in const  # constant scores (cold start)
    flat = prediction_diagnostics(q[:5], np.zeros(5), np.zeros(5, dtype=int))
    assert not any(k.startswith("spearman") for k in flat)  # constant realised variance
    assert all(np.isfinite(x) for x in out.values())


# -- fast paths equal straightforward reference computations on random inputs -----------------------------------------

@pytest.mark.parametrize("seed", range(4))
def test_average_rank_equals_scipy(seed):
    rng = np.random.default_rng(seed)
    for n in (1, 2, 7, 300):
        z = np.round(rng.random(n), 1 + seed % 3)  # many exact ties
        assert np.array_equal(average_rank(z), rankdata(z, method="average"))
        assert np.array_equal(percentile_rank(z), (rankdata(z, method="average") - 0.5) / n)
    z = np.array([0.3, np.nan, 0.1])
    assert np.array_equal(average_rank(z), rankdata(z, method="average"), equal_nan=True)


def test_observation_log_growth_and_state():
    rng = np.random.default_rng(0)
    log, rows = ObservationLog(), []
    for _ in range(2500):  # past the initial capacity
        row = (int(rng.integers(0, 50)), int(rng.integers(0, 30)), *rng.random(3).tolist())
        log.add(*row)
        rows.append(row)
    arr = log.arrays()
    R = np.array(rows)
    for c, k in enumerate(("node", "step", "m", "v", "d")):
        assert np.array_equal(arr[k], R[:, c])
    assert arr["node"].dtype == np.int64 and arr["m"].dtype == np.float64
    other = ObservationLog()
    other.load_state_dict(log.state_dict())
    assert len(other) == 2500
    other.add(1, 2, 0.5, 0.1, 0.2)
    assert len(other.arrays()["node"]) == 2501 and len(log) == 2500


@pytest.mark.parametrize("seed", range(3))
def test_prediction_with_shared_kernel_equals_separate_passes(seed):
    """predict_all (Eq. 7 kernel shared by the two half-lives) == each pass with its own neighbor_weights."""
    from envsched import estimate as E

    rng = np.random.default_rng(seed)
    n, k = 120, 4
    cfg = EnvSchedConfig()
    log = ObservationLog()
    for s in range(6):
        for i in rng.choice(n, 30, replace=False):
            r = rng.random(8) < rng.random()
            log.add(int(i), s, *E.group_statistics(r.astype(float), cfg.dispersion_floor))
    idx = {rel: np.where(rng.random((n, kk)) < 0.8, rng.integers(0, n, (n, kk)), -1) for rel, kk in (("in", k), ("cross", 2 * k))}
    sim = {rel: np.where(idx[rel] >= 0, np.round(rng.random(idx[rel].shape), 2), -np.inf) for rel in idx}
    got = predict_all(log, idx, sim, 6, [str(i) for i in range(n)], cfg)

    def separate(h):  # the original per-pass computation
        out = E.estimate_half_life(log, idx, sim, 6, h, n, cfg, kernels=None)
        return out

    long, short = separate(cfg.h_long), separate(cfg.h_short)
    assert np.array_equal(got.u_long, long["u"]) and np.array_equal(got.u_short, short["u"])
    assert np.array_equal(got.v, long["v"])
    # and the kernel path itself equals neighbor_weights
    W = long["W"]
    for rel, nbrs in idx.items():
        safe = np.maximum(nbrs, 0)
        avail = (nbrs >= 0) & (W[safe] > 0)
        a = neighbor_weights(sim[rel], W[safe], avail, cfg.bandwidth_floor, cfg.neighbor_weight_clip)
        kern = E.neighbor_kernel(sim[rel], avail, cfg.bandwidth_floor)
        assert np.array_equal(a, np.where(avail, kern * np.sqrt(np.clip(W[safe], *cfg.neighbor_weight_clip)), 0.0))


# -- classes of equal values give what the computation per task gives, bit for bit ------------------------------------

@pytest.mark.parametrize("seed", range(4))
def test_ranks_and_quantiles_over_counts_equal_the_repeated_values(seed):
    rng = np.random.default_rng(seed)
    for n in (1, 2, 9, 400):
        z = np.round(rng.random(n), 1 + seed % 3)  # many exact ties, also between entries
        counts = rng.integers(1, 6, n)
        full = np.repeat(z, counts)
        first = np.cumsum(counts) - counts  # where each entry's copies start in the repeated array
        assert np.array_equal(average_rank(z, counts), average_rank(full)[first])
        assert np.array_equal(percentile_rank(z, counts), percentile_rank(full)[first])
        assert np.array_equal(average_rank(z, np.ones(n, dtype=np.int64)), average_rank(z))
        p = np.concatenate([rng.random(n), [0.0, 1.0]])[:n]
        assert np.array_equal(linear_quantiles(z, p, counts), np.quantile(full, np.repeat(p, counts), method="linear")[first])
        f = np.round(rng.random(n), 2)
        assert np.array_equal(quantile_score(z, f, 0.65, counts), quantile_score(full, np.repeat(f, counts), 0.65)[first])
        u2 = np.round(rng.random(n), 2)
        got, want = decline_priority(z, u2, 0.5, counts), decline_priority(full, np.repeat(u2, counts), 0.5)
        assert np.array_equal(got[0], want[0][first]) and np.array_equal(got[1], want[1][first])
    # NaN goes to scipy's policy on the repeated values
    assert np.isnan(average_rank(np.array([0.2, np.nan]), np.array([2, 1]))).all()
    with pytest.raises(ValueError):
        average_rank(np.array([0.1, 0.2]), np.array([1, 0]))


@pytest.mark.parametrize("extra", [{}, {"fusion": "evidence"}, {"cross_reference": "environment"}, {"cross_reference": "environment_mean", "reconstructed_target": "learnability"}, {"relation_weights": "measured"}, {"k_within": 0}])
def test_prediction_over_classes_equals_the_prediction_per_task(many_envs_pool, extra, run_steps):
    """predict_all computing each class of identical tasks once (as the scheduler calls it, with the kernel cache
    kept from step to step) == predict_all on every task without any cache."""
    classes_seen = []

    def check(sched, step):
        nb = sched.neighbors
        got = sched.predict(step)
        rw = sched.relation_weights.weights() if sched.relation_weights is not None else None
        want = predict_all(sched.log, nb.idx, nb.sim, step, many_envs_pool.task_ids, sched.cfg, sched.env, relation_weights=rw)
        for name in ("v", "m", "d", "f", "u_long", "u_short", "u", "q"):
            assert np.array_equal(getattr(got, name), getattr(want, name)), (step, name)
        assert got.reference == want.reference
        if want.sources is not None:
            assert set(got.sources) == set(want.sources)
            for k, a in want.sources.items():
                assert np.array_equal(got.sources[k], a), (step, k)
        classes = prediction_classes(sched.log, nb.idx, step, len(many_envs_pool), nb.cross_classes())
        classes_seen.append(step > 1 and (classes.counts > 1).any() and (classes.counts == 1).any())  # shared and own classes

    run_steps(many_envs_pool, EnvSchedConfig(batch_size=8, predictor="paper", **extra), 7, check)  # Eq. 3-13's classes
    assert any(classes_seen)


def test_kernel_cache_over_changing_class_rows_equals_no_cache(many_envs_pool, run_steps):
    """The Eq. 7 kernel cache keyed by the rows computed (rows that join, leave or keep their place between
    calls) gives the kernels of an uncached pass: the prediction of every step equals a cache-free one."""
    many_envs = many_envs_pool
    kernels: dict = {}
    sizes = []

    def check(sched, step):
        nb = sched.neighbors
        got = predict_all(sched.log, nb.idx, nb.sim, step, many_envs.task_ids, sched.cfg, sched.env, kernels, cross_classes=nb.cross_classes())
        want = predict_all(sched.log, nb.idx, nb.sim, step, many_envs.task_ids, sched.cfg, sched.env)
        assert np.array_equal(got.q, want.q) and np.array_equal(got.v, want.v), step
        sizes.append(len(kernels["in:rows"]))

    run_steps(many_envs, EnvSchedConfig(batch_size=8), 8, check)
    assert min(sizes) < len(many_envs) and len(set(sizes)) > 2  # fewer rows than tasks, and rows changing


# -- linear quantiles and the Eq. 7 kernel cache kept between steps ---------------------------------------------------

@pytest.fixture(scope="module")
def pool():
    return TaskPool.from_records(synthetic_records(6, 40, seed=3))


@pytest.mark.parametrize("seed", range(4))
def test_linear_quantiles_equal_numpy(seed):
    """Eq. 12's Q_{v-hat}[p] from one sort equals np.quantile(..., method="linear") float for float."""
    from envsched.estimate import linear_quantiles

    rng = np.random.default_rng(seed)
    for n in (1, 2, 3, 17, 5000):
        x = np.round(rng.random(n) * 0.25, seed + 1)
        x[rng.random(n) < 0.5] = 0.1  # a tie block, as cold tasks share the reference
        p = rng.random(n)
        p[: min(n, 3)] = [0.0, 1.0, 0.5][: min(n, 3)]
        assert np.array_equal(linear_quantiles(x, p), np.quantile(x, p, method="linear"))


def test_kernel_cache_kept_between_steps_gives_the_uncached_prediction(pool):
    """The Eq. 7 kernels kept in NeighborIndex.kernel_cache from step to step (only rows whose mask or
    neighbour list changed are recomputed) give every step the prediction of a pass without any cache."""
    from envsched.estimate import predict_all

    sched = EnvScheduler(pool, EnvSchedConfig(batch_size=16, predictor="paper"))  # the Eq. 7 kernel cache
    rng = np.random.default_rng(5)
    masks = []
    for step in range(6):
        ids = sched.select(step)
        nb = sched.neighbors
        cached = sched.predict(step)
        plain = predict_all(sched.log, nb.idx, nb.sim, step, pool.task_ids, sched.cfg, sched.env,
                            relation_weights=sched.relation_weights.weights())
        for name in ("v", "m", "d", "u_long", "u_short", "q"):
            assert np.array_equal(getattr(cached, name), getattr(plain, name)), (step, name)
        if "cross" in nb.kernel_cache:
            masks.append(nb.kernel_cache["cross"][0].copy())
        sched.observe(step, {t: rng.integers(0, 2, 8).tolist() for t in ids})
    assert len(masks) >= 4  # the cache was kept over the steps
