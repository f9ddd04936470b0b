"""scripts/plot_metrics.py turns a run's metrics JSONL files into PNG curves."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
                         capture_output=True, text=True)
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
