"""benchmarks/learning.py: the arms' overrides, the control's no-update steps, resuming finished runs, and the
table and plot it prints from the runs' results (no training here: the runs are the benchmark's own job)."""

from __future__ import annotations

import json
from pathlib import Path

import learning as lb
import pytest


def _result(arm: str, seed: int, first: float, last: float) -> dict:
    return {"arm": arm, "seed": seed, "wall_s": 400.0 + seed, "heldout": {"0": first, "20": last},
            "heldout_sem": {"0": 0.03, "20": 0.03}, "greedy": {"0": 0.32, "20": 0.30}, "change": last - first, "updates": 0,
            "change_sem": 0.03, "rollouts": 320.0, "tokens": 27000.0 + seed}


def test_the_arms_are_the_issues_four_and_each_overrides_only_its_difference():
    assert list(lb.ARMS) == ["envace", "grpo_real", "no_rehearse_loss", "control"]
    assert lb.ARMS["envace"] == [] and lb.ARMS["control"] == []  # control: critic_warmup added per run
    assert lb.ARMS["grpo_real"] == ["envace.agent.observation_source=real"]
    assert lb.ARMS["no_rehearse_loss"] == ["envace.advantage.trained_roles=[act]"]


def test_a_finished_run_is_read_not_rerun(tmp_path, monkeypatch):
    done = tmp_path / "control" / "seed1" / "benchmark.json"
    done.parent.mkdir(parents=True)
    done.write_text(json.dumps(_result("control", 1, 0.2, 0.2)))
    monkeypatch.setattr(lb.subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(AssertionError("re-ran")))
    assert lb.run_arm("control", 1, tmp_path, [], 20)["heldout"] == {"0": 0.2, "20": 0.2}


def test_report_prints_mean_and_sd_over_seeds_and_draws_the_plot(tmp_path, capsys):
    results = {"envace": [_result("envace", 0, 0.20, 0.30), _result("envace", 1, 0.22, 0.28)],
               "control": [_result("control", 0, 0.21, 0.21), _result("control", 1, 0.23, 0.23)]}
    lb.report(results, tmp_path)
    out = capsys.readouterr().out
    envace = next(line for line in out.splitlines() if line.startswith("envace") and "0.210 ±" in line)
    assert "0.290 ± 0.014" in envace  # step 20: mean and sd of 0.30 and 0.28
    assert (tmp_path / "learning.png").stat().st_size > 0
    one = {"control": [_result("control", 0, 0.21, 0.21)]}
    lb.report(one, tmp_path)
    assert "nan" not in capsys.readouterr().out  # one seed: the value alone


def _fake_run(tmp_path, monkeypatch, pg_loss_steps):
    """run_arm against a stubbed train.sh (records its command) whose metrics show ``pg_loss_steps`` updates."""
    import envace.metrics

    cmds = []

    def train_sh(cmd, **kwargs):
        cmds.append(cmd)
        run_dir = next(a.split("=", 1)[1] for a in cmd if a.startswith("trainer.default_local_dir="))
        Path(run_dir).mkdir(parents=True)
        return lb.subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(lb.subprocess, "run", train_sh)
    series = {"val-core/heldout/success/mean@4": {0: 0.1, 20: 0.2}, "val-core/heldout/success/sem@4": {0: 0.02, 20: 0.02},
              "actor/pg_loss": {s: 0.0 for s in pg_loss_steps}}
    monkeypatch.setattr(envace.metrics, "load_metrics", lambda run_dir: series)
    return cmds


def test_the_control_trains_at_no_step_and_a_run_that_did_stops_the_benchmark(tmp_path, monkeypatch):
    # verl updates the actor at step s iff trainer.critic_warmup <= s: the control's warmup lies past its last step
    cmds = _fake_run(tmp_path, monkeypatch, pg_loss_steps=[])
    assert lb.run_arm("control", 0, tmp_path, [], 20)["updates"] == 0
    assert "trainer.critic_warmup=21" in cmds[0]
    cmds = _fake_run(tmp_path, monkeypatch, pg_loss_steps=[20])
    with pytest.raises(SystemExit, match="control seed 1: the actor was updated at 1 of 20 steps"):
        lb.run_arm("control", 1, tmp_path, [], 20)
    cmds = _fake_run(tmp_path, monkeypatch, pg_loss_steps=[])
    with pytest.raises(SystemExit, match="envace seed 0: the actor was updated at 0 of 20 steps"):
        lb.run_arm("envace", 0, tmp_path, [], 20)
    assert not any("critic_warmup" in a for a in cmds[0])
