"""benchmarks/env_serving.py in its smoke mode: a real ``python -m envace.envs serve`` replica consumed through the
``openenv`` pool; the table has its rows, and every episode's verdict is the in-process ``pool.replay`` verdict of
the same actions (recomputed here, not taken from the benchmark's own count)."""

from __future__ import annotations

import json
from pathlib import Path

import env_serving as bench
import pytest

from envace.envs.base import get_pool


def test_jobs_drop_the_last_call_of_every_fourth_episode():
    pool = get_pool("synthetic")
    jobs = bench.jobs_for(pool, 8)
    assert [j.variant for j in jobs] == ["gold", "gold", "gold", "dropped"] * 2
    for job in jobs:
        gold = pool.gold_actions(job.task_id)
        assert job.calls == sum(map(len, gold)) - (job.variant == "dropped")


def test_ideal_wall_schedules_episodes_on_the_slots_in_order():
    jobs = [bench.Job("t", "gold", [[None] * n]) for n in (1, 3, 1, 1)]  # 1, 3, 1, 1 calls
    assert bench.ideal_wall(jobs, 0.1, 2) == pytest.approx(0.3)  # slot A: 1 + 1 + 1, slot B: 3
    assert bench.ideal_wall(jobs, 0.1, 1) == pytest.approx(0.6)
    assert bench.ideal_wall(jobs, 0.0, 4) == 0.0


def test_smoke_table_and_verdicts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "env_serving.json"
    assert bench.main(["--smoke", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())

    rows = [(c["mode"], c["replicas"], c["delay_ms"]) for c in data["cells"]]
    assert rows == [("in-process", 0, 0.0), ("served", 1, 0.0)]
    table = [line for line in printed.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| mode | replicas | delay ms | episodes/s")
    assert [line.split(" | ")[0] for line in table[1:3]] == ["| in-process", "| served"]
    assert table[3].startswith("| replica | RSS after start MB")
    assert len(table) == 5 and table[4].startswith("| 1 | ")  # one replica's memory row
    assert len(data["memory"]) == 1 and data["memory"][0]["peak_mb"] >= data["memory"][0]["rss_mb"] > 0

    pool = get_pool("synthetic")
    jobs = bench.jobs_for(pool, 8)
    expected = [pool.replay(j.task_id, j.turns) for j in jobs]
    assert {v.passed for v in expected} == {True, False}  # the check can tell a wrong verdict
    for cell in data["cells"]:
        assert cell["episodes"] == len(cell["verdicts"]) == 8 and cell["agree"] == 8
        assert cell["calls"] == sum(j.calls for j in jobs) and cell["wall_s"] > 0
        got = [(v["task_id"], v["variant"], v["reward"], v["passed"]) for v in cell["verdicts"]]
        assert got == [(j.task_id, j.variant, e.reward, e.passed) for j, e in zip(jobs, expected, strict=True)]
