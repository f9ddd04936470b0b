"""benchmarks/learning.py: the arm table, the control's no-update steps, resuming finished runs, the real-environment
calls, the arms' differences paired by seed and task with their two-way error, the per-shape table, and the whole
pipeline (``--smoke``) on runs a stub of ``scripts/train.sh`` writes (no training here: the runs are the benchmark's
own job)."""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
from pathlib import Path

import learning as lb
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

ECHO = ["envace.agent.observation_source=real", "envace.agent.act_layout=trajectory", "algorithm.adv_estimator=grpo",
        "algorithm.norm_adv_by_std_in_grpo=false", "envace.loss.observation_nll_coef=0.01"]


def _result(arm: str, seed: int, first: float, last: float, tasks: dict[str, float] | None = None) -> dict:
    tasks = tasks or {"synthetic/e/t0": last, "synthetic/e/t1": last}
    return {"arm": arm, "seed": seed, "wall_s": 400.0 + seed, "heldout": {"0": first, "20": last},
            "heldout_sem": {"0": 0.03, "20": 0.03}, "greedy": {"0": 0.32, "20": 0.30}, "change": last - first,
            "updates": 0, "change_sem": 0.03, "rollouts": 320.0, "tokens": 27000.0 + seed, "env_calls": 480.0,
            "overrides": [], "first_tasks": {t: [first] for t in tasks}, "last_tasks": {t: [v] for t, v in tasks.items()}}


def test_the_arms_are_the_issues_five_and_grpo_is_echo_without_the_observation_loss():
    assert lb.DEFAULT_ARMS == ("envace", "grpo_real", "echo", "no_rehearse_loss", "control")
    assert set(lb.DEFAULT_ARMS) < set(lb.ARMS)
    assert lb.ARMS["envace"] == [] and lb.ARMS["control"] == []  # control: critic_warmup added per run
    assert lb.ARMS["echo"] == ECHO  # experiment=echo_cpu's overrides
    assert lb.recipe_observation_coef() == 0.01  # the echo arm's λ is read from the recipe
    assert lb.ARMS["grpo_real"] == [*ECHO[:-1], "envace.loss.observation_nll_coef=0"]
    assert lb.ARMS["no_rehearse_loss"] == ["envace.advantage.trained_roles=[act]"]
    assert lb.ARMS["grpo_real_message"] == ["envace.agent.observation_source=real"]
    assert lb.pairs(list(lb.DEFAULT_ARMS))[:2] == [("envace", "grpo_real"), ("envace", "echo")]
    assert len(lb.pairs(list(lb.DEFAULT_ARMS))) == 10


def test_each_arm_composes_to_its_method():
    from envace.verl.config import compose

    def what(arm):
        cfg = compose(lb.ARMS[arm])
        agent = cfg.envace.agent
        return (agent.observation_source, agent.act_layout, cfg.algorithm.adv_estimator,
                cfg.envace.loss.observation_nll_coef, list(cfg.envace.advantage.trained_roles or []))

    assert what("envace") == ("rehearse", "message", "grpo_rolewise", 0, [])
    assert what("grpo_real") == ("real", "trajectory", "grpo", 0, [])
    assert what("echo") == ("real", "trajectory", "grpo", 0.01, [])
    assert what("no_rehearse_loss") == ("rehearse", "message", "grpo_rolewise", 0, ["act"])
    assert what("grpo_real_message") == ("real", "message", "grpo_rolewise", 0, [])


def test_a_finished_run_is_read_not_rerun_unless_recorded_for_other_overrides(tmp_path, monkeypatch):
    done = tmp_path / "control" / "seed1" / "benchmark.json"
    done.parent.mkdir(parents=True)
    done.write_text(json.dumps({**_result("control", 1, 0.2, 0.2), "overrides": lb.train_args("control", 1, [], 20)}))
    monkeypatch.setattr(lb.subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(AssertionError("re-ran")))
    assert lb.run_arm("control", 1, tmp_path, [], 20)["heldout"] == {"0": 0.2, "20": 0.2}
    with pytest.raises(SystemExit, match="benchmark.json: recorded for other overrides"):
        lb.run_arm("control", 1, tmp_path, ["envace.data.categories=[act,query]"], 20)


def test_records_keep_the_results_apart_from_the_run_directories_with_their_commit(tmp_path, monkeypatch, capsys):
    _stub_launch(monkeypatch)
    cmds = _fake_train(monkeypatch)
    monkeypatch.setattr(lb, "source_commit", lambda: "abc1234-dirty")
    records = tmp_path / "records"
    argv = ["--smoke", "--arms", "envace,control", "--out", str(tmp_path / "runs"), "--records", str(records)]
    assert lb.main(argv) == 0 and len(cmds) == 4
    assert sorted(str(p.relative_to(records)) for p in records.rglob("*.json")) == [
        "control/seed0.json", "control/seed1.json", "envace/seed0.json", "envace/seed1.json"]
    assert json.loads((records / "envace" / "seed1.json").read_text())["commit"] == "abc1234-dirty"
    assert not list((tmp_path / "runs").rglob("benchmark.json"))
    assert "trained from abc1234-dirty." in capsys.readouterr().out
    # the run directories gone (another machine), the records alone resume the benchmark: nothing re-runs
    shutil.rmtree(tmp_path / "runs")
    assert lb.main(argv) == 0 and len(cmds) == 4


def _write_run(run_dir: Path, arm: str, seed: int, steps: int, updated: bool, tasks: list[str]) -> None:
    """What a finished ``train.sh`` leaves: verl's file-logger metrics and envace's per-task validation scores."""
    rng = np.random.default_rng(seed)
    (run_dir / "metrics").mkdir(parents=True)
    lines = [{"step": 0, "data": {"val-core/heldout/success/mean@2": 0.1, "val-core/heldout/success/sem@2": 0.02,
                                  "val-core/heldout_greedy/success/mean@1": 0.25}}]
    for step in range(1, steps + 1):
        data = {"envace/trajectories": 4.0, "envace/act/calls_per_trajectory": 1.5, "envace/act/tokens": 100.0}
        data.update({"actor/pg_loss": 0.0} if updated else {})
        lines.append({"step": step, "data": data})
    lines[-1]["data"].update({"val-core/heldout/success/mean@2": 0.2, "val-core/heldout/success/sem@2": 0.03,
                              "val-core/heldout_greedy/success/mean@1": 0.3, "val-aux/heldout/success/change": 0.1,
                              "val-aux/heldout/success/change_sem": 0.03})
    (run_dir / "metrics" / "run.jsonl").write_text("\n".join(json.dumps(line) for line in lines))
    (run_dir / "validation").mkdir()
    for step in (0, steps):
        scores = {t: [float(rng.random() < 0.2 + 0.1 * (step > 0 and updated)) for _ in range(2)] for t in tasks}
        (run_dir / "validation" / f"step_{step}.json").write_text(json.dumps({"heldout": scores, "heldout_greedy": {}}))


TASKS = [f"synthetic/syn-kv-{e:02d}/t{j:02d}" for e in range(4) for j in range(3)]


def _fake_train(monkeypatch, tasks=TASKS) -> list[list[str]]:
    """A stub of ``scripts/train.sh``: records its command and writes a finished run (no actor update where the
    command sets trainer.critic_warmup past the last step)."""
    cmds = []

    def train_sh(cmd, **kwargs):
        cmds.append(cmd)
        args = dict(a.split("=", 1) for a in cmd[1:])
        steps = int(args.get("trainer.total_training_steps", 20))
        updated = int(args.get("trainer.critic_warmup", 0)) <= steps
        _write_run(Path(args["trainer.default_local_dir"]), args["trainer.experiment_name"], int(args["data.seed"]),
                   steps, updated, tasks)
        return lb.subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(lb.subprocess, "run", train_sh)
    monkeypatch.setattr(lb, "source_commit", lambda: "abc1234")
    return cmds


def test_the_control_trains_at_no_step_and_a_run_that_did_stops_the_benchmark(tmp_path, monkeypatch):
    # verl updates the actor at step s iff trainer.critic_warmup <= s: the control's warmup lies past its last step
    cmds = _fake_train(monkeypatch)
    assert lb.run_arm("control", 0, tmp_path, [], 20)["updates"] == 0
    assert "trainer.critic_warmup=21" in cmds[0]
    assert not any("critic_warmup" in a for a in lb.train_args("envace", 0, [], 20))
    monkeypatch.setattr(lb, "train_args", lambda arm, seed, overrides, steps: [f"data.seed={seed}",
                        f"trainer.experiment_name=learning_{arm}", "trainer.critic_warmup=1"])
    with pytest.raises(SystemExit, match="control seed 1: the actor was updated at 20 of 20 steps"):
        lb.run_arm("control", 1, tmp_path, [], 20)
    monkeypatch.setattr(lb, "train_args", lambda arm, seed, overrides, steps: [f"data.seed={seed}",
                        f"trainer.experiment_name=learning_{arm}", "trainer.critic_warmup=21"])
    with pytest.raises(SystemExit, match="envace seed 0: the actor was updated at 0 of 20 steps"):
        lb.run_arm("envace", 0, tmp_path, [], 20)


def test_a_runs_real_environment_calls_are_its_trajectories_times_their_calls(tmp_path, monkeypatch):
    assert lb.env_calls({"envace/trajectories": {1: 32.0, 2: 30.0},
                         "envace/act/calls_per_trajectory": {1: 1.5, 2: 2.0}}) == 32 * 1.5 + 30 * 2.0
    assert lb.env_calls({"envace/trajectories": {1: 32.0}}) is None  # not logged: not guessed
    _fake_train(monkeypatch)
    result = lb.run_arm("echo", 0, tmp_path, ["trainer.total_training_steps=3"], 3)
    assert result["env_calls"] == 3 * 4 * 1.5
    assert set(result["last_tasks"]) == set(TASKS) and len(result["first_tasks"][TASKS[0]]) == 2
    # acting calls under observation_source=real, replay calls (the rehearsal's shadow execution) otherwise
    rows = lb.arm_rows({"echo": [result], "envace": [{**result, "arm": "envace"}]}, {"echo": "real",
                                                                                     "envace": "rehearse"})
    assert rows[0][10:12] == ["18", "0"] and rows[1][10:12] == ["0", "18"]


def _two_way_reference(matrix: np.ndarray) -> float:
    """The error of the mean of a seeds x tasks matrix as the two-way random-effects model writes it, through the
    variance components (unbiased: σ_res² = MS_res, σ_seed² = (MS_seed − MS_res)/T, σ_task² = (MS_task − MS_res)/S)."""
    s, t = matrix.shape
    seed_means, task_means, grand = matrix.mean(1), matrix.mean(0), matrix.mean()
    res = np.sum((matrix - seed_means[:, None] - task_means[None, :] + grand) ** 2) / ((s - 1) * (t - 1))
    seed = (t * np.var(seed_means, ddof=1) - res) / t
    task = (s * np.var(task_means, ddof=1) - res) / s
    return math.sqrt(seed / s + task / t + res / (s * t))


def test_the_two_way_error_matches_its_model_and_its_one_way_limits():
    rng = np.random.default_rng(0)
    seed_fx, task_fx = rng.normal(0, 0.1, (5, 1)), rng.normal(0, 0.2, (1, 60))
    matrix = 0.1 + seed_fx + task_fx + rng.normal(0, 0.3, (5, 60))
    se, per_seed, task_term = lb.two_way(matrix)
    assert se == pytest.approx(_two_way_reference(matrix))
    assert per_seed == pytest.approx(np.var(matrix.mean(1), ddof=1))  # MS_seed / T: a seed mean's variance
    assert se ** 2 == pytest.approx(per_seed / 5 + task_term)  # the part seeds cut and the part they do not
    # a matrix that varies by seed alone: the error of the seed means; by task alone: of the task means
    by_seed = np.repeat(np.array([[0.1], [0.15], [0.05], [0.2]]), 30, axis=1)
    assert lb.two_way(by_seed)[0] == pytest.approx(statistics.stdev([0.1, 0.15, 0.05, 0.2]) / 2)
    by_task = np.repeat(np.linspace(0, 1, 40)[None, :], 3, axis=0)
    assert lb.two_way(by_task)[0] == pytest.approx(statistics.stdev(np.linspace(0, 1, 40)) / math.sqrt(40))
    # one seed: the task-paired error of a run (envace.metrics.heldout_change)
    from envace.metrics import heldout_estimate

    one = matrix[:1]
    assert lb.two_way(one)[0] == pytest.approx(heldout_estimate({str(i): [v] for i, v in enumerate(one[0])}).sem)


def test_the_two_way_error_is_calibrated_on_simulated_benchmarks():
    """Over many simulated 5-seed benchmarks of 30 tasks x 3 Bernoulli samples (a run effect, a stable per-task
    arm difference and sampling noise), the mean estimated variance of the difference is its true variance, within
    10 %."""
    rng = np.random.default_rng(1)
    s, t, n = 5, 30, 3
    task_p = rng.uniform(0.4, 0.6, t)  # the tasks' success, shared by both arms
    gap = np.clip(task_p + rng.normal(0.0, 0.15, t), 0, 1) - task_p  # a stable per-task difference between the arms
    estimates, means = [], []
    for _ in range(2000):
        p_a = np.clip(task_p + gap + rng.normal(0, 0.06, (s, 1)), 0, 1)  # each run's own spread
        p_b = np.clip(task_p + rng.normal(0, 0.06, (s, 1)), 0, 1)
        d = (rng.binomial(n, p_a) - rng.binomial(n, p_b)) / n
        means.append(d.mean())
        estimates.append(lb.two_way(d)[0] ** 2)
    # the variance of the mean over draws of runs and samples, plus the task term: these tasks' gaps are one draw of
    # the tasks' distribution, whose variance over T the error counts. Each of the three terms is over a fifth of the
    # total: leaving the task term out, or treating the episodes as independent, misses by more than 10 %
    true = np.var(means) + np.var(gap, ddof=1) / t
    assert statistics.fmean(estimates) == pytest.approx(true, rel=0.1)


@settings(max_examples=40, deadline=None)
@given(arrays(np.float64, st.tuples(st.integers(2, 6), st.integers(2, 12)), elements=st.floats(0, 1)),
       st.floats(-1, 1))
def test_the_two_way_error_is_at_least_either_one_way_error_and_ignores_a_shift(matrix, shift):
    se, _, _ = lb.two_way(matrix)
    s, t = matrix.shape
    one_way_seed = np.std(matrix.mean(1), ddof=1) / math.sqrt(s)
    one_way_task = np.std(matrix.mean(0), ddof=1) / math.sqrt(t)
    assert se >= max(one_way_seed, one_way_task) - 1e-12
    assert lb.two_way(matrix + shift)[0] == pytest.approx(se, abs=1e-9)


def test_arms_are_differenced_paired_by_seed_and_task():
    # each task's and each seed's success moves both arms alike; A leads B by 0.1 on every (seed, task): paired, the
    # difference has no error, while either arm alone spreads widely
    tasks = [f"synthetic/e/t{i}" for i in range(10)]
    a, b = [], []
    for seed in range(3):
        base = {t: 0.1 * i / 10 + 0.05 * seed for i, t in enumerate(tasks)}
        a.append(_result("envace", seed, 0.1, 0.3, {t: v + 0.1 for t, v in base.items()}))
        b.append(_result("grpo_real", seed, 0.1, 0.2, base))
    b.append(_result("grpo_real", 7, 0.1, 0.9, {t: 0.9 for t in tasks}))  # a seed A never ran: left out
    diff = lb.difference(a, b)
    assert diff.d == pytest.approx(0.1) and diff.se == pytest.approx(0.0, abs=1e-12)
    assert (diff.seeds, diff.tasks) == (3, 10)
    assert lb.last_success(a)[1] > 0.02
    # a task B's runs did not score is left out of the pairs
    del b[0]["last_tasks"][tasks[0]]
    assert lb.difference(a, b).tasks == 9


def test_the_seeds_needed_for_the_target_error():
    tasks = [f"synthetic/e/t{i}" for i in range(50)]
    offsets = [0.0, 0.06, -0.03, 0.03]  # the difference varies by seed alone: sd 0.039, per-seed variance 0.0015
    a = [_result("envace", s, 0.1, 0.3, {t: 0.3 + o for t in tasks}) for s, o in enumerate(offsets)]
    b = [_result("echo", s, 0.1, 0.3, {t: 0.3 for t in tasks}) for s in range(4)]
    diff = lb.difference(a, b)
    per_seed = statistics.variance(offsets)
    assert diff.se == pytest.approx(math.sqrt(per_seed / 4))
    assert diff.seeds_needed == math.ceil(per_seed / lb.TARGET_SE ** 2) == 7
    rows = lb.difference_rows({"envace": a, "echo": b})
    assert rows[0][0] == "envace − echo" and rows[0][4] == "no" and rows[0][7] == "7"


def test_report_prints_the_markdown_tables_and_draws_the_plot(tmp_path, capsys):
    tasks = {"synthetic/e/t0": "act", "synthetic/e/t1": "act", "synthetic/e/t2": "query", "synthetic/e/t3": "query"}
    envace = [_result("envace", s, 0.20 + 0.02 * s, 0.30 - 0.02 * s, {t: 0.5 for t in tasks}) for s in (0, 1)]
    grpo = [_result("grpo_real", s, 0.21, 0.21, {t: 0.1 * i for i, t in enumerate(tasks)}) for s in (0, 1)]
    lb.report({"envace": envace, "grpo_real": grpo}, tmp_path, tasks, {"envace": "rehearse", "grpo_real": "real"},
              ".venv/bin/python benchmarks/learning.py --seeds 0,1")
    out = capsys.readouterr().out
    assert ".venv/bin/python benchmarks/learning.py --seeds 0,1" in out and "seeds: 0, 1" in out
    steps = next(line for line in out.splitlines() if line.startswith("| envace | 0.210 ±"))
    assert "| 0.290 ± 0.014 |" in steps  # step 20: mean and sd of 0.30 and 0.28
    diff = next(line for line in out.splitlines() if line.startswith("| envace − grpo_real |"))
    # A − B on the four tasks: 0.5, 0.4, 0.3, 0.2 in both seeds: +0.35 ± 0.065 (the tasks' spread), 5.4 errors
    assert diff.split(" | ")[1:5] == ["+0.350", "0.065", "+5.4", "yes: envace ahead"]
    act = next(line for line in out.splitlines() if line.startswith("| act |"))
    query = next(line for line in out.splitlines() if line.startswith("| query |"))
    assert act.split(" | ")[1:4] == ["2", "0.500 ± 0.000", "0.050 ± 0.050"]
    assert query.split(" | ")[1:4] == ["2", "0.500 ± 0.000", "0.250 ± 0.050"]
    assert (tmp_path / "learning.png").stat().st_size > 0
    lb.report({"control": [_result("control", 0, 0.21, 0.21)]}, tmp_path, {}, {"control": "rehearse"}, "cmd")
    out = capsys.readouterr().out
    assert "nan" not in out and "one seed: the errors are over tasks only" in out


def _stub_launch(monkeypatch) -> list[list[str]]:
    """arm_config, the pre-flight and the task shapes without Hydra, envace.train or a pool (the arm table's
    composition is test_each_arm_composes_to_its_method's)."""
    preflights = []
    monkeypatch.setattr(lb, "arm_config", lambda arm, overrides: lb.ArmConfig(
        int(next((o.split("=")[1] for o in overrides if o.startswith("trainer.total_training_steps=")), 20)),
        "real" if arm in ("grpo_real", "echo", "grpo_real_message") else "rehearse", {},
        ["act", "query", "lookup_act", "lookup_query"]))
    monkeypatch.setattr(lb, "preflight", lambda args, run_dir: preflights.append(list(args)))
    monkeypatch.setattr(lb, "task_shapes", lambda pool_kwargs, tasks: {t: "act" for t in tasks})
    return preflights


def test_smoke_runs_the_whole_pipeline_at_the_smallest_size(tmp_path, monkeypatch, capsys):
    preflights = _stub_launch(monkeypatch)
    cmds = _fake_train(monkeypatch)
    assert lb.main(["--smoke", "--out", str(tmp_path)]) == 0
    # every arm passes its pre-flight before the first run; then every arm runs seed 0, then seed 1, at the smoke's
    # size (seed by seed: an interrupted benchmark holds its arms at the same seeds)
    assert [p[-1] for p in preflights] == [f"trainer.experiment_name=learning_{a}" for a in lb.DEFAULT_ARMS]
    assert [(c[-2].split("=")[1], c[-4]) for c in cmds] == [
        (f"learning_{a}", f"data.seed={s}") for s in (0, 1) for a in lb.DEFAULT_ARMS]
    assert all(c[1:1 + len(lb.SMOKE_OVERRIDES)] == lb.SMOKE_OVERRIDES for c in cmds)
    assert "trainer.critic_warmup=2" in cmds[-1]
    out = capsys.readouterr().out
    for arm in lb.DEFAULT_ARMS:
        assert f"| {arm} | " in out
    differences = [line.split(" | ")[0] for line in out.splitlines() if " − " in line.split(" | ")[0]]
    assert differences[:2] == ["| envace − grpo_real", "| envace − echo"] and len(differences) == 10
    assert "| act | 12 |" in out
    # resumed: the finished runs are read, none re-run
    assert lb.main(["--smoke", "--out", str(tmp_path)]) == 0 and len(cmds) == 10


def test_shapes_set_the_categories_of_every_arm_and_an_unknown_one_is_refused(tmp_path, monkeypatch, capsys):
    _stub_launch(monkeypatch)
    cmds = _fake_train(monkeypatch)
    assert lb.main(["--smoke", "--arms", "envace,control", "--seeds", "3", "--shapes", "act,query",
                    "--out", str(tmp_path)]) == 0
    assert all("envace.data.categories=[act,query]" in c for c in cmds) and len(cmds) == 2
    with pytest.raises(SystemExit) as exc:
        lb.main(["--shapes", "act,copy_value", "--out", str(tmp_path)])
    assert exc.value.code == 2 and "--shapes: copy_value not among the pool's shapes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        lb.main(["--arms", "envace,ppo", "--out", str(tmp_path)])
    assert "--arms: unknown arm(s) ppo" in capsys.readouterr().err


def test_an_unwritable_destination_or_a_stale_record_is_refused_before_any_training(tmp_path, monkeypatch, capsys):
    """Where the results go is checked with the pre-flight: a --records or --out that cannot be written, or a record
    of a later seed made for other overrides, exits 2 in one line before the first run (not after hours of it)."""
    _stub_launch(monkeypatch)
    cmds = _fake_train(monkeypatch)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert lb.main(["--smoke", "--out", str(tmp_path / "out"), "--records", str(blocker / "records")]) == 2
    assert capsys.readouterr().err.strip() == f"benchmarks/learning.py: {blocker / 'records'}: {blocker} is not a folder"
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if not os.access(locked, os.W_OK):  # root may write anywhere: the mode check is then not observable
        assert lb.main(["--smoke", "--out", str(tmp_path / "out"), "--records", str(locked / "r")]) == 2
        assert capsys.readouterr().err.strip().endswith(f"{locked} is not writable")
    records = tmp_path / "records"
    stale = records / "control" / "seed1.json"
    stale.parent.mkdir(parents=True)
    stale.write_text(json.dumps({**_result("control", 1, 0.2, 0.2), "overrides": ["data.seed=1"]}))
    assert lb.main(["--smoke", "--out", str(tmp_path / "out"), "--records", str(records)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"benchmarks/learning.py: {stale}: recorded for other overrides (data.seed=1)") and "\n" not in err
    stale.write_text("{not json")
    assert lb.main(["--smoke", "--out", str(tmp_path / "out"), "--records", str(records)]) == 2
    assert f"{stale}: not a readable record" in capsys.readouterr().err
    assert cmds == [] and not (tmp_path / "out").exists()  # nothing trained, nothing written
