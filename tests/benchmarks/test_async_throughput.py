"""benchmarks/async_throughput.py: one run's figures from hand-made metrics files, the mean ± s.e. over seeds, the
paired async/sync ratio, the table with a blocked arm, the runs' overrides (composed here as the runs would compose
them), and the loop over arms with a refusal and a failure (no training: the runs are the benchmark's own job)."""

from __future__ import annotations

import argparse
import json
import math
import shlex
from pathlib import Path

import async_throughput as bench
import pytest

SETUP = bench.Setup(pools=("synthetic",), pool_kwargs={"synthetic": {"tasks_per_env": 65, "renamings": False}},
                    batch=8, mini_batch=4, n=4, steps=3, ms=200.0, longtail_p=0.05, longtail_factor=10.0,
                    staleness_threshold=2)


def _write_metrics(run_dir: Path, steps: dict[int, dict[str, float]]) -> None:
    """verl's file-logger lines, one per step, plus a line at step 0 (the first validation)."""
    (run_dir / "metrics").mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"step": s, "data": data}) for s, data in sorted(steps.items())]
    (run_dir / "metrics" / "run.jsonl").write_text("\n".join(lines) + "\n")


def _steps(step_s: list[float], gen_s: list[float], stale: list[tuple[float, float]] | None = None,
           change: tuple[float, float] = (0.05, 0.02)) -> dict[int, dict[str, float]]:
    steps: dict[int, dict[str, float]] = {0: {"val-core/heldout/success/mean@3": 0.2}}
    for i, (step, gen) in enumerate(zip(step_s, gen_s, strict=True), 1):
        steps[i] = {"timing_s/step": step, "timing_s/gen": gen, "timing_s/update_actor": step - gen,
                    "envace/trajectories": 32.0}
        if stale is not None:
            steps[i] |= {"envace/staleness/mean": stale[i - 1][0], "envace/staleness/max": stale[i - 1][1],
                         "training/off_policy/trajectory_staleness_worst/max": stale[i - 1][1]}
    last = len(step_s)
    steps[last] |= {"timing_s/testing": 100.0, "val-aux/heldout/success/change": change[0],
                    "val-aux/heldout/success/change_sem": change[1]}
    return steps


# -- one run -------------------------------------------------------------------------------------------------------
def test_a_runs_figures_from_its_metrics_files(tmp_path):
    from envace.metrics import load_metrics

    _write_metrics(tmp_path, _steps([10.0, 6.0, 8.0], [7.0, 3.0, 2.0], stale=[(0.0, 0.0), (0.5, 1.0), (0.25, 1.0)],
                                    change=(0.06, 0.021)))
    got = bench.summarise(load_metrics(tmp_path), 300.0, {"calls": 40, "slow_calls": 2, "injected_s": 11.6})
    assert got["steps"] == 3 and got["rollouts"] == 96 and got["train_s"] == 24.0
    assert got["rollouts_per_s"] == pytest.approx(96 / 24)  # validation (timing_s/testing) left out
    assert got["idle"] == pytest.approx(12 / 24)  # sum of gen waits over sum of steps
    assert got["staleness_mean"] == pytest.approx(0.25) and got["staleness_max"] == 1.0
    assert got["verl_staleness_worst_max"] == 1.0
    assert (got["change"], got["change_sem"]) == (0.06, 0.021)
    assert got["latency_calls"] == 40 and got["latency_ms_per_call"] == pytest.approx(290.0)


def test_a_sync_run_without_staleness_metrics_has_none():
    got = bench.summarise({"timing_s/step": {1: 2.0}, "timing_s/gen": {1: 1.0}}, 5.0, {})
    assert got["staleness_mean"] is None and got["staleness_max"] is None and got["change"] is None
    assert got["rollouts_per_s"] == 0.0 and got["latency_ms_per_call"] is None


# -- over seeds ----------------------------------------------------------------------------------------------------
def test_mean_and_standard_error_over_seeds():
    est = bench.estimate([1.0, 2.0, 3.0, None])
    assert (est.mean, est.n) == (2.0, 3) and est.sem == pytest.approx(1.0 / math.sqrt(3))
    assert est.text(2) == "2.00 ± 0.58"
    assert bench.estimate([4.0]).text(1) == "4.0"  # one seed: the value alone
    assert bench.estimate([None]).text() == "-"


def _run(seed: int, rps: float, change: float, sem: float = 0.02, **extra) -> dict:
    return {"seed": seed, "rollouts": 96.0, "rollouts_per_s": rps, "idle": 0.5, "staleness_mean": extra.get("stale", 0.0),
            "staleness_max": extra.get("stale_max", 0.0), "verl_staleness_worst_max": extra.get("stale_max", 0.0),
            "change": change, "change_sem": sem, "wall_s": 600.0, "latency_calls": 500, "latency_ms_per_call": 290.0}


def test_the_async_sync_ratio_is_paired_by_seed():
    sync = [_run(0, 2.0, 0.1), _run(1, 4.0, 0.1)]
    colocate = [_run(0, 3.0, 0.1), _run(1, 8.0, 0.1), _run(2, 9.0, 0.1)]  # seed 2 has no sync run to pair with
    est = bench.ratio_to_sync(colocate, sync)
    assert est.n == 2 and est.mean == pytest.approx((1.5 + 2.0) / 2)  # not 17/6 over summed means


def test_the_held_out_change_against_sync_in_combined_standard_errors():
    sync = bench.change_estimate([_run(0, 1, 0.10), _run(1, 1, 0.14)])
    arm = bench.change_estimate([_run(0, 1, 0.02), _run(1, 1, 0.06)])
    assert sync.sem == pytest.approx(0.02) and arm.sem == pytest.approx(0.02)
    assert bench.change_z(arm, sync) == pytest.approx(-0.08 / math.hypot(0.02, 0.02))
    one = bench.change_estimate([_run(0, 1, 0.05, sem=0.03)])  # one seed: the run's own paired error
    assert (one.mean, one.sem) == (0.05, 0.03)


def _cell(line: str, column: str) -> str:
    """The text of ``column`` in a table line (the columns have fixed widths)."""
    start = 0
    for name, width in bench.COLUMNS:
        if name == column:
            return line[start:start + width].strip()
        start += width
    raise KeyError(column)


def test_the_table_prints_every_arm_and_latency_with_a_blocked_arm_in_words():
    results = {
        ("envace_sync", "0ms"): [_run(0, 2.0, 0.10), _run(1, 2.2, 0.12)],
        ("envace_sync", "longtail"): [_run(0, 1.0, 0.10), _run(1, 1.0, 0.12)],
        ("envace_colocate_async", "0ms"): [_run(0, 1.8, 0.09, stale=0.4, stale_max=1), _run(1, 2.2, 0.11)],
        ("envace_colocate_async", "longtail"): [_run(0, 1.6, 0.09, stale=0.5, stale_max=1),
                                                _run(1, 1.8, 0.11, stale=0.7, stale_max=1)],
        ("envace_separate_async", "0ms"): "blocked: checkpoint_engine.backend=naive: no CPU engine",
        ("envace_separate_async", "longtail"): "blocked: checkpoint_engine.backend=naive: no CPU engine",
    }
    lines = bench.report(results, SETUP)
    assert lines[0].startswith("each run trains 96 rollouts (3 steps x 8 prompts x 4)")
    assert lines[1].split()[:5] == ["arm", "latency", "runs", "rollouts", "rollouts/s"]
    rows = {tuple(line.split()[:2]): line for line in lines[2:]}
    assert len(rows) == 6
    longtail = rows[("envace_colocate_async", "longtail")]
    assert _cell(longtail, "rollouts") == "96" and _cell(longtail, "rollouts/s") == "1.700 ± 0.100"
    assert "1.70 ± 0.10" in longtail  # paired ratio: 1.6/1.0 and 1.8/1.0
    assert "0.60 ± 0.10" in longtail  # staleness mean
    assert "-0.7" in longtail  # change 0.10 ± 0.01 against sync's 0.11 ± 0.01: -0.01 / (0.01 x sqrt 2)
    assert _cell(rows[("envace_sync", "0ms")], "async/sync") == "-"  # sync has no ratio to itself
    assert _cell(longtail, "async/sync") == "1.70 ± 0.10" and _cell(longtail, "stale max") == "1"
    assert rows[("envace_separate_async", "0ms")].endswith("blocked: checkpoint_engine.backend=naive: no CPU engine")


# -- the runs' overrides -------------------------------------------------------------------------------------------
def test_separate_async_syncs_once_per_batch_of_mini_batches_and_async_arms_bound_staleness():
    sep = bench.arm_overrides("envace_separate_async", SETUP)
    assert "trainer.v1.separate_async.parameter_sync_step=2" in sep  # 8 prompts = 2 x 4
    assert "trainer.v1.sampler.max_off_policy_threshold=2" in sep
    assert "trainer.v1.sampler.max_off_policy_strategy=drop" in bench.arm_overrides("envace_colocate_async", SETUP)
    assert bench.arm_overrides("envace_sync", SETUP) == ["trainer.v1.trainer_mode=envace_sync"]
    with pytest.raises(ValueError, match="unknown arm"):
        bench.arm_overrides("sync", SETUP)


def test_latencies_are_the_wrappers_distributions():
    assert bench.latency_kwargs("0ms", SETUP) == {"dist": "fixed", "ms": 0}
    assert bench.latency_kwargs("200ms", SETUP) == {"dist": "fixed", "ms": 200.0}
    assert bench.latency_kwargs("longtail", SETUP) == {"dist": "longtail", "ms": 200.0, "p": 0.05, "factor": 10.0}


def test_hydra_values_parse_back_to_what_was_written():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    value = {"latency:synthetic": {"pool_kwargs": {"shapes": ["act", "query"], "renamings": False, "n": 3},
                                   "ms": 200.0, "p": 0.05, "seed": 0, "stats_dir": "/tmp/a b/latency", "x": None,
                                   "name": "it's"}}
    parsed = OverridesParser.create().parse_override(f"++envace.agent.pool_kwargs={bench.hydra_value(value)}")
    assert parsed.value() == value
    for bad in ({"a b": 1}, "${oc.env:HOME}", float("nan"), object()):
        with pytest.raises(ValueError, match="no .*Hydra"):
            bench.hydra_value(bad)


def test_a_runs_overrides_compose_into_the_latency_wrapper_of_the_default_pool(tmp_path):
    """The run's overrides as scripts/train.sh composes them: every pool wrapped, its own kwargs passed through,
    seeded with the run's seed, counted in the run's folder, the budget of --steps."""
    from envace.config import validate_envace_config
    from envace.verl.config import compose

    setup = bench._setup(argparse.Namespace(overrides=[], steps=3, ms=200.0, longtail_p=0.05, longtail_factor=10.0,
                                            staleness_threshold=2))
    overrides = bench.train_overrides("envace_colocate_async", "longtail", 7, setup, tmp_path, [])
    cfg = compose(overrides)
    envace = validate_envace_config(cfg)
    assert envace.data.pools == ["latency:synthetic"]
    wrapper = envace.agent.pool_kwargs["latency:synthetic"]
    assert wrapper == {"pool_kwargs": envace.agent.pool_kwargs["synthetic"], "dist": "longtail", "ms": 200.0,
                       "p": 0.05, "factor": 10.0, "seed": 7,
                       "stats_dir": str(tmp_path / "envace_colocate_async" / "longtail" / "seed7" / "latency")}
    assert cfg.trainer.v1.trainer_mode == "envace_colocate_async" and cfg.data.seed == 7
    assert (cfg.trainer.total_training_steps, cfg.trainer.test_freq) == (3, 3)
    assert cfg.trainer.default_local_dir == str(tmp_path / "envace_colocate_async" / "longtail" / "seed7")
    assert envace.data.out_dir == str(tmp_path / "envace_colocate_async" / "longtail" / "seed7" / "data")


def test_dry_run_prints_shell_ready_commands_and_runs_nothing(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(bench.subprocess, "run", lambda *a, **k: pytest.fail("ran a command"))
    monkeypatch.setattr(bench, "_setup", lambda args: SETUP)
    assert bench.main(["--dry-run", "--seeds", "0,1", "--latencies", "0ms,longtail", "--out", str(tmp_path)]) == 0
    lines = [line[2:] for line in capsys.readouterr().out.splitlines() if line.startswith("$ ")]
    train = [shlex.split(line) for line in lines if "scripts/train.sh" in line]
    assert len(train) == 3 * 2 * 2 and len(lines) == len(train) + 3  # arms x latencies x seeds, a pre-flight each
    first = train[0]
    assert first[1] == "experiment=cpu_default" and "data.seed=0" in first
    assert any(a.startswith("++envace.agent.pool_kwargs={latency\\:synthetic: ") for a in first)


# -- running -------------------------------------------------------------------------------------------------------
def test_the_loop_blocks_refused_arms_keeps_going_after_a_failure_and_reads_finished_runs(monkeypatch, tmp_path):
    """separate_async refused at its pre-flight; colocate_async's seed 1 fails at 200ms; sync's finished run is read
    back, not run again."""
    done = bench.run_dir(tmp_path, "envace_sync", "200ms", 0) / "benchmark.json"
    done.parent.mkdir(parents=True)
    done.write_text(json.dumps({"arm": "envace_sync", "seed": 0, **_run(0, 3.0, 0.1)}))
    commands = []

    def fake_run(cmd, **kwargs):
        commands.append(cmd)
        if "--preflight-only" in cmd:
            refused = "trainer.v1.trainer_mode=envace_separate_async" in cmd
            return bench.subprocess.CompletedProcess(cmd, 2 if refused else 0, "",
                                                     "envace: config error: no CPU engine\n" if refused else "")
        where = Path(next(a.split("=", 1)[1] for a in cmd if a.startswith("trainer.default_local_dir=")))
        if "envace_colocate_async" in str(where) and where.name == "seed1":
            kwargs["stdout"].write("Traceback ...\nRuntimeError: boom\n")
            return bench.subprocess.CompletedProcess(cmd, 1)
        _write_metrics(where, _steps([10.0], [5.0]))
        return bench.subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    results, failures = bench.run_all(list(bench.ARMS), ["200ms"], [0, 1], SETUP, tmp_path, [])
    assert results[("envace_separate_async", "200ms")] == "blocked: no CPU engine"
    assert [r["seed"] for r in results[("envace_colocate_async", "200ms")]] == [0]
    assert failures == [f"envace_colocate_async 200ms seed 1: exit 1 ({tmp_path}/envace_colocate_async/200ms/seed1.log)"]
    sync = results[("envace_sync", "200ms")]
    assert [r["rollouts_per_s"] for r in sync] == [3.0, 3.2]  # seed 0 read back; seed 1 ran: 32 rollouts / 10 s
    trains = [c for c in commands if "--preflight-only" not in c]
    assert len(trains) == 3  # sync seed 1, colocate seeds 0 and 1; nothing for the blocked arm


def test_a_run_refused_after_its_pre_flight_blocks_the_arm(monkeypatch, tmp_path):
    def fake_run(cmd, **kwargs):
        if "--preflight-only" in cmd:
            return bench.subprocess.CompletedProcess(cmd, 0, "envace: pre-flight passed\n", "")
        kwargs["stdout"].write("envace: config error: envace.data: no tasks\n")
        return bench.subprocess.CompletedProcess(cmd, 2)

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    results, failures = bench.run_all(["envace_sync"], ["0ms", "longtail"], [0, 1], SETUP, tmp_path, [])
    assert results == {("envace_sync", "0ms"): "blocked: envace.data: no tasks",
                       ("envace_sync", "longtail"): "blocked: envace.data: no tasks"}
    assert failures == []
