"""benchmarks/reproducibility.py's comparison of two runs, on hand-made run folders: verl's per-run uids and its
padding rows are left out, anything else that differs (a metric, a row's output, a missing row) is reported."""

from __future__ import annotations

import json
from pathlib import Path

import reproducibility as bench


def make_run(root: Path, uid: str, output: str = "call()", score: float = 1.0, pad: str = "x",
             mean: float = 0.5) -> Path:
    (root / "metrics").mkdir(parents=True)
    (root / "rollouts").mkdir()
    data = {"critic/score/mean": mean, "envace/act/tokens": 12.0, "timing_s/step": 3.0 + len(uid)}
    (root / "metrics" / "run.jsonl").write_text(json.dumps({"step": 1, "data": data}) + "\n")
    rows = [{"uid": f"{uid}_0_0", "task_id": "p/t1", "role": "act", "input": "q", "output": output, "score": score,
             "advantage": 0.5},
            {"uid": f"{uid}_0_1", "task_id": "p/t1", "role": "rehearse", "input": "q", "output": "{}", "score": score,
             "advantage": 0.0},
            {"uid": f"pad{uid}_0_0", "task_id": "p/t1", "role": "act", "input": "q", "output": pad, "score": 0.0}]
    (root / "rollouts" / "1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def test_runs_that_differ_only_in_uids_timings_and_padding_are_the_same(tmp_path, capsys):
    a = make_run(tmp_path / "a", "1111")
    b = make_run(tmp_path / "b", "22222222", pad="y")
    assert bench.compare(a, b, 1)
    assert "2 metrics compared, 0 differ; rollout rows 2 vs 2, 2 identical" in capsys.readouterr().out


def test_a_different_output_score_or_metric_is_reported(tmp_path, capsys):
    a = make_run(tmp_path / "a", "1111")
    assert not bench.compare(a, make_run(tmp_path / "b", "2222", output="other()"), 1)
    assert "rollout rows 2 vs 2, 1 identical" in capsys.readouterr().out
    assert not bench.compare(a, make_run(tmp_path / "c", "3333", mean=0.25), 1)
    assert "1 differ: critic/score/mean" in capsys.readouterr().out
    assert bench.main(["--compare", str(a), str(tmp_path / "c")]) == 1
