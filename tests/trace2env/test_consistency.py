"""W2R consistency (trace2env.consistency): Real / WM / W2R / CR by hand, the paper's Table 2 arithmetic, and the
task bootstrap on cases small enough to enumerate."""

from __future__ import annotations

import math

import pytest

from trace2env.consistency import TaskOutcome, w2r_consistency

ROWS = [
    TaskOutcome("t1", real=1.0, wm=1.0, w2r=1.0),
    TaskOutcome("t2", real=1.0, wm=1.0, w2r=0.0),  # succeeds in the world model only: a fictitious success
    TaskOutcome("t3", real=0.0, wm=0.0, w2r=1.0),  # fails in the world model, its actions succeed for real
    TaskOutcome("t4", real=1.0, wm=None, w2r=1.0),  # the simulator gave no verdict
    {"task_id": "t5", "real": None, "wm": 1.0, "w2r": 1.0},  # real run not scored: dropped
    TaskOutcome("t6", real=1.0, wm=0.5, w2r=0.5),  # partial rewards
]


def test_hand_computed_columns():
    r = w2r_consistency(ROWS, n_boot=0)
    # kept t1 t2 t3 t4 t6; Real successes t1 t2 t4 t6 = 4/5; W2R t1 t3 t4 = 3/5;
    # WM verdicts t1 t2 t3 t6, of which t1 t2 succeed = 2/4
    assert (r["tasks"], r["wm_tasks"], r["dropped"]) == (5, 4, ["t5"])
    assert (r["real"], r["w2r"], r["wm"]) == pytest.approx((80.0, 60.0, 50.0))
    assert r["cr"] == pytest.approx(3 / 4)
    assert (r["wm_only"], r["w2r_only"]) == (1, 1)  # t2 and t3
    assert all(math.isnan(v) for v in r["cr_ci95"])  # n_boot=0: no interval


def test_success_threshold():
    r = w2r_consistency(ROWS, success_at=0.5, n_boot=0)
    # t6 now succeeds everywhere: Real 4/5, W2R 4/5, WM t1 t2 t6 of 4 verdicts
    assert (r["real"], r["w2r"], r["wm"], r["cr"]) == pytest.approx((80.0, 80.0, 75.0, 1.0))


@pytest.mark.parametrize(("n", "real", "wm", "w2r", "cr"),
                         [(100, 93, 88, 85, 0.914), (100, 93, 97, 3, 0.032), (40, 85, 87.5, 60, 0.706)])
def test_the_papers_table_2_arithmetic(n, real, wm, w2r, cr):
    """ALFWorld (100 tasks) Trace2Env and Direct rows, SciWorld (40 tasks) Trace2Env: CR = W2R / Real."""

    def k(pct: float) -> int:
        return round(pct * n / 100)

    rows = [TaskOutcome(f"x{i}", real=float(i < k(real)), wm=float(i < k(wm)), w2r=float(i < k(w2r))) for i in range(n)]
    r = w2r_consistency(rows, n_boot=0)
    assert (r["real"], r["wm"], r["w2r"]) == pytest.approx((real, wm, w2r))
    assert round(r["cr"], 3) == cr


def test_bootstrap_interval_by_enumeration():
    # A succeeds both ways, B only for real: resamples AA -> 1, AB/BA -> 1/2, BB -> 0 (each >= 1/4 likely)
    r = w2r_consistency([TaskOutcome("A", 1, None, 1), TaskOutcome("B", 1, None, 0)], n_boot=4000, seed=1)
    assert r["cr"] == 0.5 and r["cr_ci95"] == (0.0, 1.0)
    # B fails both ways: BB has no Real success (undefined ratio, skipped); every other resample gives 1
    r = w2r_consistency([TaskOutcome("A", 1, None, 1), TaskOutcome("B", 0, None, 0)], n_boot=4000, seed=1)
    assert r["cr"] == 1.0 and r["cr_ci95"] == (1.0, 1.0)


def test_degenerate_inputs():
    r = w2r_consistency([])
    assert r["tasks"] == 0 and all(math.isnan(r[k]) for k in ("real", "wm", "w2r", "cr"))
    r = w2r_consistency([TaskOutcome("a", 0.0, 1.0, 1.0)])
    assert r["real"] == 0.0 and r["w2r"] == 100.0 and math.isnan(r["cr"])  # no Real success: CR undefined
    r = w2r_consistency([TaskOutcome("a", float("nan"), 1.0, 1.0), TaskOutcome("b", 1.0, None, None)])
    assert r["tasks"] == 0 and r["dropped"] == ["a", "b"]
    with pytest.raises(ValueError, match="repeat"):
        w2r_consistency([TaskOutcome("a", 1, 1, 1), TaskOutcome("a", 0, 0, 0)])
    with pytest.raises(ValueError, match="n_boot"):
        w2r_consistency([], n_boot=-1)
