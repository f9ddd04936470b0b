"""scripts/plot_metrics.py turns a run's metrics JSONL files into PNG curves."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_plots_merge_launches_and_skip_bad_lines(tmp_path):
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    first = [{"step": s, "data": {"critic/score/mean": 0.1 * s, "actor/grad_norm": 1.0, "note": "x"}} for s in (1, 2)]
    (metrics / "metrics-1.jsonl").write_text("\n".join(map(json.dumps, first)) + "\n{broken\n")
    (metrics / "metrics-2.jsonl").write_text(json.dumps({"step": 3, "data": {"critic/score/mean": 0.5}}) + "\n")
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "plot_metrics.py"), str(tmp_path)],
                         capture_output=True, text=True, check=True)
    assert "wrote 2 plot(s) of 2 metric(s)" in out.stdout
    assert "skipped unreadable line" in out.stderr
    pngs = sorted(p.name for p in (tmp_path / "plots").glob("*.png"))
    assert pngs == ["actor.png", "critic.png"]
    assert (tmp_path / "plots" / "critic.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_metrics_is_a_clear_error(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "plot_metrics.py"), str(tmp_path)],
                         capture_output=True, text=True, check=False)
    assert out.returncode != 0 and "no metrics/*.jsonl" in out.stderr


def test_learning_summary_averages_the_first_and_last_training_steps():
    from envace.metrics import learning_summary

    reward = {s: r for s, r in enumerate([0.0, 0.2, 0.1, 0.3, 0.5, 0.4, 0.6, 0.8, 0.7, 0.9, 0.5, 1.0], start=1)}
    series = {"critic/score/mean": reward, "val-core/synthetic/act/acc/mean@1": {0: 0.25, 12: 0.5},
              "val-core/synthetic/query/acc/mean@1": {0: 0.75, 12: 0.5}}
    out = learning_summary(series)
    assert (out["first"], out["last"], out["first_step"], out["last_step"], out["sources"]) == (0.5, 0.5, 0, 12, 2)
    # 12 steps: windows of 3 (a quarter of the run), not single steps
    assert out["train_steps_first"] == (1, 3) and out["train_steps_last"] == (10, 12)
    assert abs(out["train_reward_first"] - 0.1) < 1e-9 and abs(out["train_reward_last"] - 0.8) < 1e-9
    long = {"critic/score/mean": {s: 0.1 for s in range(1, 41)}, **{k: v for k, v in series.items() if "val" in k}}
    assert learning_summary(long)["train_steps_last"] == (36, 40)  # at most 5 steps a side
    assert learning_summary({"critic/score/mean": reward}) is None  # no validation: nothing to report


def test_validations_that_sampled_a_different_n_are_one_series():
    """The first validation of a cpu_mcp_git run scored one sample of one task (``mean@1``), the last two of each of
    three (``mean@2``): the run's closing line read 'step 0 -> step 0'. Each validation's N is its own; the held-out
    series is every step of every N, with each step's own standard error."""
    from envace.metrics import learning_summary, validation_success

    series = {"val-core/heldout/success/mean@1": {0: 0.0}, "val-core/heldout/success/sem@1": {0: 0.1},
              "val-core/heldout/success/mean@2": {2: 0.5}, "val-core/heldout/success/sem@2": {2: 0.2},
              "critic/score/mean": {1: 0.0, 2: 0.5}}
    assert validation_success(series) == {0: 0.0, 2: 0.5}
    out = learning_summary(series)
    assert (out["first_step"], out["last_step"], out["first"], out["last"]) == (0, 2, 0.0, 0.5)
    assert (out["first_sem"], out["last_sem"]) == (0.1, 0.2)


def test_heldout_estimate_is_the_mean_of_task_means_with_the_error_of_that_mean():
    from envace.metrics import heldout_estimate

    est = heldout_estimate({"a": [1, 1, 0, 0], "b": [1, 1, 1, 1], "c": [0, 0, 0, 0]})
    assert (est.mean, est.tasks, est.samples) == (0.5, 3, 12)
    # the spread of the three task means (0.5, 1, 0), not of 12 independent coin flips (which would give 0.151)
    assert abs(est.sem - 0.2887) < 1e-4
    assert math.isnan(heldout_estimate({"a": [1, 0]}).sem)
    with pytest.raises(ValueError):
        heldout_estimate({})


def test_heldout_change_pairs_the_tasks_both_validations_scored():
    from envace.metrics import heldout_change

    first = {"a": [0, 0], "b": [1, 0], "c": [1, 1], "gone": [0, 0]}
    last = {"a": [1, 0], "b": [1, 1], "c": [1, 1], "new": [1, 1]}
    ch = heldout_change(first, last)
    assert ch.tasks == 3 and abs(ch.mean - (0.5 + 0.5 + 0) / 3) < 1e-12
    # the tasks' own levels cancel: the error is that of the differences (0.5, 0.5, 0)
    assert abs(ch.sem - 0.16667) < 1e-4
    with pytest.raises(ValueError):
        heldout_change({"a": [1]}, {"b": [1]})


def test_learning_line_reports_errors_the_paired_change_and_the_greedy_pass():
    from envace.metrics import learning_line, learning_summary

    series = {
        "val-core/heldout/success/mean@4": {0: 0.20, 20: 0.32},
        "val-core/heldout/success/sem@4": {0: 0.025, 20: 0.028},
        "val-core/heldout_greedy/success/mean@1": {0: 0.30, 20: 0.36},
        "val-core/synthetic/act/acc/mean@4": {0: 0.1, 20: 0.9},  # a category: not the held-out figure
        "val-aux/heldout/success/change": {20: 0.12},
        "val-aux/heldout/success/change_sem": {20: 0.03},
        "critic/score/mean": {s: 0.1 for s in range(1, 21)},
    }
    summary = learning_summary(series)
    assert (summary["first"], summary["last"], summary["first_sem"]) == (0.20, 0.32, 0.025)
    line = learning_line(summary)
    assert "0.200 ± 0.025 (step 0) -> 0.320 ± 0.028 (step 20)" in line
    assert "change +0.120 ± 0.030 (+4.0 s.e., paired by task)" in line
    assert "greedy 0.300 -> 0.360" in line
