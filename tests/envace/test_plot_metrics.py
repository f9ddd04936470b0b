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
