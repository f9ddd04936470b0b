#!/usr/bin/env python
"""Held-out learning of the CPU default against real-environment GRPO, ECHO and two ablations, on the default's
budget, over seeds, with the arms' differences and their errors (issues 32 and 48).

    .venv/bin/python benchmarks/learning.py [--seeds 0,1,2,3,4] [--arms envace,grpo_real,echo,no_rehearse_loss,control]
                                            [--shapes act[,query,lookup_act,lookup_query]] [--out DIR] [--smoke]
                                            [HYDRA_OVERRIDE ...]

Each arm is ``scripts/train.sh`` (the CPU default, ``experiment=cpu_default``) with the arm's overrides, once per
seed (``data.seed``: the order of the training tasks), one run at a time. The arms (:data:`ARMS`):

==================  ================================================================================================
arm                 what differs from the default
==================  ================================================================================================
envace              nothing: act + rehearse, role-wise GRPO (EnvACE §4.2), one training row per ACT message and
                    per rehearsal (``act_layout=message``)
grpo_real           GRPO against the real environment: ECHO's settings with the observation loss off
                    (``observation_source=real``, ``act_layout=trajectory``: one row per rollout,
                    ``algorithm.adv_estimator=grpo``: verl's GRPO, ``envace.loss.observation_nll_coef=0``)
echo                ECHO (arXiv 2605.24517; ``configs/experiment/echo_cpu.yaml``): ``grpo_real`` plus the real
                    observation tokens' negative log-likelihood, ``envace.loss.observation_nll_coef`` as the recipe
                    sets it (:func:`recipe_observation_coef`; chosen on seed 0, docs/results/learning.md)
                    (``envace/verl/observation_loss.py``), so ``grpo_real`` − ``echo`` is that loss alone
no_rehearse_loss    EnvACE, but the rehearse role's outputs carry no loss (``envace.advantage.trained_roles=[act]``)
control             no update: every step generates and scores, none trains (``trainer.critic_warmup`` = steps + 1:
                    verl updates the actor at step s iff critic_warmup <= s)
grpo_real_message   (not run unless named in ``--arms``) the ``grpo_real`` of the figures in
                    docs/results/learning.md before issue 48: the default with ``observation_source=real`` only
                    (one row per ACT message, role-wise GRPO without the std division, as EnvACE)
==================  ================================================================================================

``grpo_real`` and ``echo`` differ from ``envace`` in more than where observations come from: one training row per
rollout (the token-mean loss weighs a rollout's tokens together, not per message) and verl's GRPO, whose advantages are
the group's mean subtracted without the std division (``algorithm.norm_adv_by_std_in_grpo=false``, as EnvACE's
``envace.advantage.norm_by_std: false``). ``grpo_real_message`` differs from ``envace`` in the observation source
alone.

Before the first training every arm's command passes ``envace.train``'s pre-flight (seconds), so a wrong override
stops the benchmark before hours of runs. The runs go seed by seed, every arm at each seed, so an interrupted
benchmark holds its arms at the same seeds. A run whose result is recorded (``benchmark.json`` in its directory, or
``<records>/<arm>/seed<N>.json`` with ``--records``: written when the run finished, with the commit it trained
from) is read, not re-run, so an interrupted benchmark resumes and ``--seeds`` can grow, across machines where the
records travel; one recorded for other overrides stops the benchmark. A control run that updated the actor, or
another arm's run that never did, stops it too.

**What it prints** (markdown), with the command and the seeds:

* per arm: held-out success (``val-core/heldout/success/mean@N``: all held-out tasks of the trained shapes, sampled
  at the training temperature) at the first and the last validation; the change, paired by task within a run (mean
  ± sd over seeds, and the runs' own errors); the last validation's mean over seeds and tasks with its two-way error
  (below); the greedy pass's first and last; the steps that updated the actor; rollouts and tokens generated (both
  roles); the real environment's calls of the training rollouts; the wall time of each ``train.sh``;
* the differences of every pair of arms run (``envace − grpo_real`` and ``envace − echo`` first: the issue's
  question), each with its error, ``d / s.e.``, whether it is resolved (``|d| > 2 s.e.``) and the seeds the error
  needs to reach 0.015;
* the same per task shape (a synthetic task's ``TaskSpec.category``: ``act``, ``query``, ``lookup_act``,
  ``lookup_query``) for the shapes trained and validated (``--shapes``);
* the curves of held-out success (``--out``/learning.png).

**Real-environment calls.** The turn engine counts the calls an observation source answered
(``Transcript.tool_calls``); envace's trainer logs their mean per trajectory (``envace/act/calls_per_trajectory``)
and the trajectories of each step (``envace/trajectories``); their product summed over the steps is the run's calls.
The real environment runs a call in one place, ``envace.agents.sources.RealSource.execute``: as the observation source
itself (``observation_source=real``: the actor reads what it returned: *acting* calls) or as the shadow of a rehearsal
(``GeneratedSource.observe``: the same call executed unseen, the replay the reward scores: *replay* calls), once per
answered call either way. So a run's calls are acting calls under ``real`` and replay calls under ``rehearse``
(EnvACE's rollouts touch the real environment only for that replay). Validation, in the real environment in every
arm, is not counted (the same tasks and samples in every run).

**Arm differences and their error.** For arms A and B, d(s, t) is A's held-out success on task t at the last
validation of seed s minus B's (each the mean of the task's samples): paired by seed (the same training-task order)
and by task (every run validates the same held-out tasks: ``data.val_max_samples: -1``). The first validation
scores the same weights (the warm start) in every run, so subtracting it would add only its sampling noise; the
per-arm change is printed beside. The difference is the mean of d over S seeds × T tasks. Its error is the two-way
(seed, task) random-effects one, Var = σ_seed²/S + σ_task²/T + σ_res²/(S·T), from the ANOVA mean squares:
(MS_seed + MS_task − MS_res) / (S·T), never below either one-way error (MS_seed or MS_task over S·T). The seed term
is the run-to-run spread of training, which more seeds cut; the task term is a difference the arms make on
particular tasks, which no number of seeds cuts. With one seed the error is the task-paired one of the per-run change
(:func:`envace.metrics.heldout_change`), and the run-to-run spread is not in it. "Seeds for s.e. ≤ 0.015" keeps the
measured terms and solves MS_seed/(T·S) + σ_task²/T ≤ 0.015² for S.

**How many seeds, tasks and samples** (arithmetic from docs/results/learning.md, the default's 187 held-out ``act``
tasks): the sampling variance of one episode is v ≈ 0.093; three seeds an arm at 187 × 2 varied in their change by
sd 0.033 (EnvACE), 0.015 (real-environment GRPO, message rows), 0.038 (no rehearse loss), pooled sd² ≈ 0.00092. That
is the first and the last validation's sampling noise over a fixed task set, 2 · v / (2 · 187) ≈ 0.00050, plus
training's own run-to-run variance σ_r² ≈ 0.00042 (sd ≈ 0.020). A paired difference of two arms at one seed then
has variance 2σ_r² + 2v / (n · T) = 0.00084 + 0.00099 / n at T = 187 and n samples a task, and over S seeds
s.e. = √((0.00084 + 0.00099 / n) / S):

=====================  ========  ========  ========  ========
samples a task (n)      S = 5     S = 6     S = 8     S = 10
=====================  ========  ========  ========  ========
2                       0.0164    0.0150    0.0129    0.0116
3 (the default's)       0.0153    0.0140    0.0121    0.0108
4                       0.0148    0.0135    0.0117    0.0105
=====================  ========  ========  ========  ========

So 5 seeds × 187 tasks × 3 samples sit at the line (≈ 0.015) and 6 seeds clear it (≈ 0.014), before any task term
(a stable per-task difference between arms; the published runs cannot measure it, the benchmark does). Training's
spread dominates: more samples buy little, and more tasks (``tasks_per_env`` above 65) cut only the sampling term
and change the training pool. σ_r² rests on three seeds an arm (a variance on about six degrees of freedom: a 95 %
interval of × 0.4 to × 4.8) and ECHO's spread is unmeasured, hence the printed seeds needed: a finished benchmark that
misses 0.015 grows by ``--seeds 0,...,S-1`` (finished runs are read).

**Shapes.** ``--shapes`` sets ``envace.data.categories`` for every arm: the shapes trained and validated (the
default's: ``act``). The synthetic pool of the default keeps ``act``, ``query``, ``lookup_act`` and ``lookup_query``
(``envace.agent.pool_kwargs.synthetic.shapes``); with all four, validation covers 672 held-out tasks instead of 187
(3.6 × the validation time).

**Smoke.** ``--smoke`` runs the whole pipeline (every arm's pre-flight and ``train.sh``, the pairing, the tables) at
the smallest size, into ``outputs/benchmarks/learning_smoke`` by default: two seeds (the two-way error needs two),
one training step of 2 prompts × 2 rollouts, a pool of 5 tasks an environment (its held-out tasks are validated
whole, so every seed validates the same ones) × 2 samples (:data:`SMOKE_OVERRIDES`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]

#: ECHO's arm (``experiment=echo_cpu``); ``grpo_real`` is the same with the coefficient 0. Like EnvACE's role-wise
#: advantages (``envace.advantage.norm_by_std: false``), verl's GRPO subtracts the group's mean without dividing by its
#: std, so the arms differ in where the observations come from and in the layout, not in the advantages' scale
_REAL_TRAJECTORY_GRPO = ["envace.agent.observation_source=real", "envace.agent.act_layout=trajectory",
                         "algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std_in_grpo=false"]


def recipe_observation_coef() -> float:
    """ECHO's λ as its recipe sets it (``configs/experiment/echo_cpu.yaml``): the ``echo`` arm trains with it, so the
    benchmark and the recipe users run cannot drift apart."""
    from omegaconf import OmegaConf

    return float(OmegaConf.load(REPO / "configs" / "experiment" / "echo_cpu.yaml").envace.loss.observation_nll_coef)


#: each arm's Hydra overrides on the CPU default (the module docstring's table says what each changes)
ARMS: dict[str, list[str]] = {
    "envace": [],
    "grpo_real": [*_REAL_TRAJECTORY_GRPO, "envace.loss.observation_nll_coef=0"],
    "echo": [*_REAL_TRAJECTORY_GRPO, f"envace.loss.observation_nll_coef={recipe_observation_coef():g}"],
    "no_rehearse_loss": ["envace.advantage.trained_roles=[act]"],
    "control": [],  # trainer.critic_warmup is set past the run's last step by run_arm
    "grpo_real_message": ["envace.agent.observation_source=real"],
}
#: the arms run unless ``--arms`` names others (issue 48's five)
DEFAULT_ARMS = ("envace", "grpo_real", "echo", "no_rehearse_loss", "control")
#: the differences printed first: the issue's question
PRIMARY = (("envace", "grpo_real"), ("envace", "echo"))
#: the error each primary difference is sized for (issue 48)
TARGET_SE = 0.015
#: --smoke: the smallest run of the pipeline (one step, 2 prompts x 2 rollouts, 5 tasks an environment, 2 samples)
SMOKE_OVERRIDES = ["trainer.total_training_steps=1", "trainer.test_freq=1", "data.train_batch_size=2",
                   "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                   "envace.agent.pool_kwargs.synthetic.tasks_per_env=5", "actor_rollout_ref.rollout.val_kwargs.n=2"]
SMOKE_SEEDS = "0,1"


@dataclass(frozen=True)
class ArmConfig:
    """What the benchmark needs from an arm's composed config."""

    steps: int  # trainer.total_training_steps
    observation_source: str  # envace.agent.observation_source: real -> acting calls, else replay calls
    pool_kwargs: dict  # envace.agent.pool_kwargs: to name each held-out task's shape
    shapes: list[str]  # the synthetic pool's kept shapes (what --shapes may name)


@dataclass(frozen=True)
class Difference:
    """The mean of d(s, t) over seeds and tasks and its two-way error (module docstring)."""

    d: float
    se: float
    seeds: int
    tasks: int
    seeds_needed: int | None  # seeds for se <= TARGET_SE at the measured terms; None: the task term alone exceeds it


def arm_config(arm: str, overrides: Sequence[str]) -> ArmConfig:
    from omegaconf import OmegaConf

    from envace.verl.config import compose

    cfg = compose([*overrides, *ARMS[arm]])
    pool_kwargs = OmegaConf.to_container(cfg.envace.agent.pool_kwargs, resolve=True) or {}
    return ArmConfig(int(cfg.trainer.total_training_steps), str(cfg.envace.agent.observation_source), pool_kwargs,
                     list(pool_kwargs.get("synthetic", {}).get("shapes") or []))


def train_args(arm: str, seed: int, overrides: Sequence[str], steps: int) -> list[str]:
    """The Hydra overrides of one run (its directory aside): the benchmark's, the arm's, the seed's."""
    extra = list(ARMS[arm]) + ([f"trainer.critic_warmup={steps + 1}"] if arm == "control" else [])
    return [*overrides, *extra, f"data.seed={seed}", "trainer.save_freq=-1", f"trainer.experiment_name=learning_{arm}"]


def preflight(args: Sequence[str], run_dir: Path) -> None:
    """``envace.train``'s pre-flight of one run's command (nothing built or started); exits on a refusal."""
    from envace.train import main as train_main

    if train_main(["--preflight-only", *args, f"trainer.default_local_dir={run_dir}"]) != 0:
        raise SystemExit(f"pre-flight refused: scripts/train.sh {shlex.join(args)}")


def record_path(out: Path, records: Path | None, arm: str, seed: int) -> Path:
    """Where a finished run's result lives: ``<records>/<arm>/seed<seed>.json`` with ``--records``, else
    ``benchmark.json`` in its run directory."""
    return records / arm / f"seed{seed}.json" if records else out / arm / f"seed{seed}" / "benchmark.json"


def source_commit() -> str:
    """The commit the runs train from (``git describe --always --dirty``): recorded with each result, since a
    benchmark that grows by seeds may span commits."""
    proc = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True,
                          check=False)
    return proc.stdout.strip() or "unknown"


def read_record(done: Path, args: Sequence[str]) -> tuple[dict, str | None]:
    """A finished run's record and, in one line, why it cannot stand for the run of ``args`` (None: it can)."""
    try:
        result = json.loads(done.read_text())
    except (OSError, ValueError) as exc:
        return {}, f"{done}: not a readable record ({exc}); delete it to train the run again"
    if not isinstance(result, dict) or result.get("overrides") != list(args):
        got = result.get("overrides") if isinstance(result, dict) else None
        return {}, f"{done}: recorded for other overrides ({shlex.join(got or [])}); use another --out or delete it"
    return result, None


def output_problem(out: Path, records: Path | None, runs: Sequence[tuple[Path, Sequence[str]]]) -> str | None:
    """Pre-flight of where the results go, before any training: ``out`` and ``records`` must be folders this process
    can create or write into (checked without writing), and every record already there for one of ``runs`` ((record
    path, its overrides)) must be one the benchmark may reuse. The problem in one line, or None."""
    for folder in (out, records):
        if folder is None:
            continue
        existing = next(p for p in (folder, *folder.parents) if p.exists())
        if not existing.is_dir():
            return f"{folder}: {existing} is not a folder"
        if not os.access(existing, os.W_OK | os.X_OK):
            return f"{folder}: {existing} is not writable"
    return next((problem for done, args in runs if done.exists() and (problem := read_record(done, args)[1])), None)


def run_arm(arm: str, seed: int, out: Path, overrides: Sequence[str], steps: int, records: Path | None = None) -> dict:
    from envace.metrics import load_metrics

    run_dir = out / arm / f"seed{seed}"
    args = train_args(arm, seed, overrides, steps)
    done = record_path(out, records, arm, seed)
    if done.exists():
        result, problem = read_record(done, args)
        if problem:
            raise SystemExit(problem)
        return result
    commit = source_commit()
    cmd = [str(REPO / "scripts" / "train.sh"), *args, f"trainer.default_local_dir={run_dir}"]
    print("$", shlex.join(cmd), flush=True)
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    t0 = time.perf_counter()
    log = out / arm / f"seed{seed}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as fh:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        print(log.read_text()[-4000:], file=sys.stderr)
        raise SystemExit(f"{arm} seed {seed}: scripts/train.sh exited {proc.returncode} (log: {log})")
    series = load_metrics(run_dir)
    # the steps that updated the actor (verl reports actor/* metrics only from an update)
    updates = len(series.get("actor/pg_loss", {}))
    if (arm == "control") != (updates == 0):
        raise SystemExit(f"{arm} seed {seed}: the actor was updated at {updates} of {steps} steps ({run_dir})")
    key = next(k for k in series if k.startswith("val-core/heldout/success/mean@"))
    greedy = next((k for k in series if k.startswith("val-core/heldout_greedy/success/mean@")), None)
    first, last = validation_scores(run_dir)
    result = {
        "arm": arm, "seed": seed, "commit": commit, "wall_s": wall, "overrides": args,
        "heldout": {str(s): v for s, v in sorted(series[key].items())},
        "heldout_sem": {str(s): v for s, v in sorted(series[key.replace("/mean@", "/sem@")].items())},
        "greedy": {str(s): v for s, v in sorted(series[greedy].items())} if greedy else {},
        "change": _last(series.get("val-aux/heldout/success/change", {})),
        "change_sem": _last(series.get("val-aux/heldout/success/change_sem", {})),
        "updates": updates,
        "rollouts": sum(series.get("envace/trajectories", {}).values()),
        "tokens": sum(series.get("envace/act/tokens", {}).values()) + sum(
            series.get("envace/rehearse/tokens", {}).values()),
        "env_calls": env_calls(series),
        "first_tasks": first, "last_tasks": last,
    }
    done.parent.mkdir(parents=True, exist_ok=True)
    done.write_text(json.dumps(result, indent=1))
    return result


def validation_scores(run_dir: Path) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """The sampled pass's per-task scores ({"pool/task_id": [score, ...]}) of the run's first and last validation
    (``validation/step_<N>.json``, written by envace's trainer: :class:`envace.verl.trainer.HeldoutValidation`)."""
    from envace.metrics import HELDOUT

    files = sorted((run_dir / "validation").glob("step_*.json"), key=lambda p: int(p.stem.split("_", 1)[1]))
    if len(files) < 2:
        raise SystemExit(f"{run_dir / 'validation'}: {len(files)} validation(s), the first and the last needed")
    return tuple(json.loads(f.read_text())[HELDOUT] for f in (files[0], files[-1]))  # type: ignore[return-value]


def env_calls(series: Mapping[str, Mapping[int, float]]) -> float | None:
    """The real-environment calls of the run's training rollouts: Σ over steps of trajectories × calls answered per
    trajectory (module docstring); None when the run logged neither."""
    trajectories = series.get("envace/trajectories", {})
    per = series.get("envace/act/calls_per_trajectory", {})
    if not trajectories or not per:
        return None
    return sum(n * per[s] for s, n in trajectories.items() if s in per)


def task_shapes(pool_kwargs: Mapping[str, Mapping], tasks: set[str]) -> dict[str, str]:
    """Each ``pool/task_id`` key's category (a synthetic task's shape), from the pool the runs built."""
    from envace.envs.base import get_pool

    pools: dict[str, list[str]] = defaultdict(list)
    for key in tasks:
        name, task_id = key.split("/", 1)
        pools[name].append(task_id)
    shapes = {}
    for name, ids in pools.items():
        pool = get_pool(name, **dict(pool_kwargs.get(name, {}) or {}))
        shapes.update({f"{name}/{t}": pool.task(t).category for t in ids})
    return shapes


def _last(values: dict[int, float]) -> float | None:
    return values[max(values)] if values else None


def _task_means(scores: Mapping[str, Sequence[float]], tasks: Sequence[str]) -> np.ndarray:
    return np.array([statistics.fmean(scores[t]) for t in tasks])


def two_way(matrix: np.ndarray) -> tuple[float, float, float]:
    """The error of the mean of a seeds × tasks matrix (module docstring) and its two parts: the per-seed variance
    MS_seed / T (what one seed adds; nan with one seed) and the task term σ_task² / T (0 with one seed)."""
    s, t = matrix.shape
    if t < 2:
        return math.nan, math.nan, math.nan
    if s == 1:  # the task-paired error of one run
        return float(matrix.std(ddof=1) / math.sqrt(t)), math.nan, 0.0
    grand = matrix.mean()
    seed_means, task_means = matrix.mean(axis=1), matrix.mean(axis=0)
    ms_seed = t * float(((seed_means - grand) ** 2).sum()) / (s - 1)
    ms_task = s * float(((task_means - grand) ** 2).sum()) / (t - 1)
    resid = matrix - seed_means[:, None] - task_means[None, :] + grand
    ms_res = float((resid ** 2).sum()) / ((s - 1) * (t - 1))
    var = max(ms_seed + ms_task - ms_res, ms_seed, ms_task) / (s * t)
    return math.sqrt(var), ms_seed / t, max(ms_task - ms_res, 0.0) / (s * t)


def _tasks(runs: Sequence[dict], shapes: Mapping[str, str] | None, shape: str | None) -> list[str]:
    """The tasks (of ``shape``, if given) every one of ``runs`` scored at its last validation."""
    tasks = set.intersection(*(set(r["last_tasks"]) for r in runs)) if runs else set()
    return sorted(t for t in tasks if shape is None or (shapes or {}).get(t) == shape)


def last_success(runs: Sequence[dict], shapes: Mapping[str, str] | None = None,
                 shape: str | None = None) -> tuple[float, float, int]:
    """An arm's held-out success at the last validation: mean over seeds and tasks, its two-way error, tasks."""
    tasks = _tasks(runs, shapes, shape)
    if not tasks:
        return math.nan, math.nan, 0
    matrix = np.stack([_task_means(r["last_tasks"], tasks) for r in sorted(runs, key=lambda r: r["seed"])])
    return float(matrix.mean()), two_way(matrix)[0], len(tasks)


def difference(a: Sequence[dict], b: Sequence[dict], shapes: Mapping[str, str] | None = None,
               shape: str | None = None) -> Difference | None:
    """A − B at the last validation, paired by seed and by task (module docstring); None: fewer than two tasks
    or no seed both arms ran."""
    by_a, by_b = {r["seed"]: r for r in a}, {r["seed"]: r for r in b}
    seeds = sorted(by_a.keys() & by_b.keys())
    tasks = _tasks([*(by_a[s] for s in seeds), *(by_b[s] for s in seeds)], shapes, shape)
    if len(tasks) < 2:
        return None
    matrix = np.stack([_task_means(by_a[s]["last_tasks"], tasks) - _task_means(by_b[s]["last_tasks"], tasks)
                       for s in seeds])
    se, per_seed, task_term = two_way(matrix)
    room = TARGET_SE ** 2 - task_term
    needed = max(1, math.ceil(per_seed / room)) if room > 0 and not math.isnan(per_seed) else None
    return Difference(float(matrix.mean()), se, len(seeds), len(tasks), needed)


def _ms(values: Sequence[float | None], digits: int = 3) -> str:
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return "-"
    if len(values) == 1:  # one seed: no spread to show
        return f"{values[0]:.{digits}f}"
    return f"{statistics.fmean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def _pm(mean: float, se: float) -> str:
    return "-" if math.isnan(mean) else f"{mean:.3f}" + ("" if math.isnan(se) else f" ± {se:.3f}")


def markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def _calls(rs: Sequence[dict], counted: bool) -> str:
    """The runs' mean real-environment calls where this column counts them (acting or replay), else 0."""
    calls = [r.get("env_calls") for r in rs]
    if any(c is None for c in calls):
        return "-"
    return f"{statistics.fmean(calls):.0f}" if counted else "0"


def _overrides_cell(arm: str) -> str:
    extra = [*ARMS[arm], *(["trainer.critic_warmup=<steps + 1>"] if arm == "control" else [])]
    return f"`{' '.join(extra)}`" if extra else "(the default)"


def arm_rows(results: Mapping[str, list[dict]], sources: Mapping[str, str]) -> list[list[str]]:
    rows = []
    for arm, rs in results.items():
        real = sources[arm] == "real"
        first = [r["heldout"][min(r["heldout"], key=int)] for r in rs]
        final = [r["heldout"][max(r["heldout"], key=int)] for r in rs]
        sems = [r["change_sem"] for r in rs if r.get("change_sem") is not None]
        greedy = [(r["greedy"][min(r["greedy"], key=int)], r["greedy"][max(r["greedy"], key=int)])
                  for r in rs if r["greedy"]]
        rows.append([
            arm, _overrides_cell(arm), f"{_ms(first)} → {_ms(final)}", _ms([r["change"] for r in rs]),
            f"{statistics.fmean(sems):.3f}" if sems else "-", _pm(*last_success(rs)[:2]),
            (f"{statistics.fmean(g[0] for g in greedy):.3f} → {statistics.fmean(g[1] for g in greedy):.3f}"
             if greedy else "-"),
            f"{statistics.fmean(r['updates'] for r in rs):.0f}", f"{statistics.fmean(r['rollouts'] for r in rs):.0f}",
            f"{statistics.fmean(r['tokens'] for r in rs):.0f}", _calls(rs, real), _calls(rs, not real),
            _ms([r["wall_s"] for r in rs], 0),
        ])
    return rows


def pairs(arms: Sequence[str]) -> list[tuple[str, str]]:
    """Every pair of ``arms`` in table order, the issue's (:data:`PRIMARY`) first."""
    primary = [p for p in PRIMARY if p[0] in arms and p[1] in arms]
    return primary + [p for p in itertools.combinations(arms, 2) if p not in primary]


def difference_rows(results: Mapping[str, list[dict]]) -> list[list[str]]:
    rows = []
    for a, b in pairs(list(results)):
        diff = difference(results[a], results[b])
        if diff is None:
            continue
        z = diff.d / diff.se if diff.se > 0 else math.nan
        resolved = abs(diff.d) > 2 * diff.se
        rows.append([f"{a} − {b}", f"{diff.d:+.3f}", f"{diff.se:.3f}", f"{z:+.1f}",
                     (f"yes: {a if diff.d > 0 else b} ahead" if resolved else "no"), str(diff.seeds),
                     str(diff.tasks), str(diff.seeds_needed) if diff.seeds_needed is not None else "-"])
    return rows


def shape_rows(results: Mapping[str, list[dict]], shapes: Mapping[str, str]) -> tuple[list[str], list[list[str]]]:
    primary = [p for p in PRIMARY if p[0] in results and p[1] in results]
    header = ["shape", "tasks", *results, *(f"{a} − {b}" for a, b in primary)]
    rows = []
    for shape in sorted(set(shapes.values())):
        cells = [last_success(rs, shapes, shape) for rs in results.values()]
        diffs = [difference(results[a], results[b], shapes, shape) for a, b in primary]
        rows.append([shape, str(max(c[2] for c in cells)), *(_pm(m, se) for m, se, _ in cells),
                     *("-" if d is None else f"{d.d:+.3f} ± {d.se:.3f}" for d in diffs)])
    return header, rows


def report(results: dict[str, list[dict]], out: Path, shapes: Mapping[str, str], sources: Mapping[str, str],
           command: str) -> None:
    seeds = sorted({r["seed"] for rs in results.values() for r in rs})
    steps = sorted({int(s) for rs in results.values() for r in rs for s in r["heldout"]})
    commits = sorted({r.get("commit", "unrecorded") for rs in results.values() for r in rs})
    print(f"\n## Learning benchmark\n\n```bash\n{command}\n```\n\nseeds: {', '.join(map(str, seeds))}; each run "
          f"`scripts/train.sh` with the arm's overrides, `data.seed=<seed>`; trained from {', '.join(commits)}.\n")
    print("### Held-out success per validation step (mean ± sd over seeds)\n")
    print(markdown(["arm", *(f"step {s}" for s in steps)],
                   [[arm, *(_ms([r["heldout"].get(str(s)) for r in rs]) for s in steps)] for arm, rs in results.items()]))
    print("\n### Arms\n\nchange: first → last validation, paired by task (mean ± sd over seeds; runs' own error "
          "beside); last: mean over seeds and tasks ± its two-way error; real-environment calls of the training "
          "rollouts (acting: the actor read them; replay: executed unseen, the reward's), mean a run\n")
    print(markdown(["arm", "overrides", "held-out first → last", "change", "change s.e. (run)", "last (± s.e.)",
                    "greedy first → last", "updates", "rollouts", "tokens", "env calls: acting",
                    "env calls: replay", "wall s"], arm_rows(results, sources)))
    print(f"\n### Differences at the last validation, paired by seed and task\n\nresolved: |d| > 2 s.e.; seeds for "
          f"s.e. ≤ {TARGET_SE}: at the measured seed and task terms ('-': the task term alone exceeds it, or one seed)"
          "\n")
    print(markdown(["difference", "d", "s.e.", "d / s.e.", "resolved", "seeds", "tasks", f"seeds for {TARGET_SE}"],
                   difference_rows(results)))
    if len(seeds) == 1:
        print("\none seed: the errors are over tasks only; the run-to-run spread of training is not in them")
    header, rows = shape_rows(results, shapes)
    print("\n### Per task shape: held-out success at the last validation (± two-way error)\n")
    print(markdown(header, rows))
    plot(results, steps, out / "learning.png")
    print(f"\nplot: {out / 'learning.png'}")


def plot(results: dict[str, list[dict]], steps: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for arm, rs in results.items():
        xs = [s for s in steps if all(str(s) in r["heldout"] for r in rs)]
        means = [statistics.fmean(r["heldout"][str(s)] for r in rs) for s in xs]
        sds = [statistics.stdev([r["heldout"][str(s)] for r in rs]) if len(rs) > 1 else 0.0 for s in xs]
        ax.errorbar(xs, means, yerr=sds, marker="o", markersize=4, capsize=3, label=arm)
    ax.set_xlabel("step")
    ax.set_ylabel("held-out success (sampled)")
    ax.set_title("held-out success, mean ± sd over seeds", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default=None, help=f"comma-separated data.seed values (0,1,2,3,4; --smoke: "
                                                      f"{SMOKE_SEEDS})")
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"of {', '.join(ARMS)}")
    parser.add_argument("--shapes", default=None, help="task shapes trained and validated (envace.data.categories; "
                                                       "default: the default's, act)")
    parser.add_argument("--out", type=Path, default=None, help="run directories, results and the plot "
                                                               "(outputs/benchmarks/learning[_smoke])")
    parser.add_argument("--records", type=Path, default=None,
                        help="where each finished run's result is written and read (<records>/<arm>/seed<N>.json; "
                             "default: benchmark.json in its run directory): a small folder that can be kept, "
                             "e.g. in the repository, while the run directories are not")
    parser.add_argument("--smoke", action="store_true", help="the whole pipeline at the smallest size")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides applied to every arm")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        parser.error(f"--arms: unknown arm(s) {', '.join(unknown)} (known: {', '.join(ARMS)})")
    seeds_text = args.seeds or (SMOKE_SEEDS if args.smoke else "0,1,2,3,4")
    try:
        seeds = [int(s) for s in seeds_text.split(",")]
    except ValueError:
        parser.error(f"--seeds: a comma-separated list of integers, got {seeds_text!r}")
    shapes = [s.strip() for s in (args.shapes or "").split(",") if s.strip()]
    overrides = [*(SMOKE_OVERRIDES if args.smoke else []),
                 *([f"envace.data.categories=[{','.join(shapes)}]"] if shapes else []), *args.overrides]
    out = args.out or REPO / "outputs" / "benchmarks" / ("learning_smoke" if args.smoke else "learning")
    configs = {arm: arm_config(arm, overrides) for arm in arms}
    kept = configs[arms[0]].shapes
    if shapes and (bad := [s for s in shapes if s not in kept]):
        parser.error(f"--shapes: {', '.join(bad)} not among the pool's shapes {kept} "
                     "(envace.agent.pool_kwargs.synthetic.shapes)")
    runs = [(record_path(out, args.records, arm, seed), train_args(arm, seed, overrides, configs[arm].steps))
            for seed in seeds for arm in arms]
    if problem := output_problem(out, args.records, runs):  # an unwritable folder or a stale record: before training
        print(f"benchmarks/learning.py: {problem}", file=sys.stderr)
        return 2
    for arm in arms:  # a wrong override stops here, not hours later
        preflight(train_args(arm, seeds[0], overrides, configs[arm].steps), out / arm / f"seed{seeds[0]}")
    # seed by seed, every arm at each: an interrupted benchmark leaves its arms at the same seeds, paired
    results: dict[str, list[dict]] = {arm: [] for arm in arms}
    for seed in seeds:
        for arm in arms:
            results[arm].append(run_arm(arm, seed, out, overrides, configs[arm].steps, args.records))
    tasks = {t for rs in results.values() for r in rs for t in r["last_tasks"]}
    command = shlex.join([".venv/bin/python", "benchmarks/learning.py", *(sys.argv[1:] if argv is None else argv)])
    report(results, out, task_shapes(configs[arms[0]].pool_kwargs, tasks),
           {arm: c.observation_source for arm, c in configs.items()}, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
