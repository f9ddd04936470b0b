"""EnvSched equations against values computed by hand (numbers written out in each test)."""

import math

import numpy as np
import pytest

from envsched import EnvSchedConfig
from envsched.estimate import (
    ObservationLog,
    center,
    decline_priority,
    exposure_factor,
    fuse,
    global_reference,
    group_statistics,
    half_life_weight,
    neighbor_weights,
    percentile_rank,
    predict_all,
    quantile_score,
    reconstructed_variance,
    relation_estimate,
    task_history,
)


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
