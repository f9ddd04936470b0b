#!/usr/bin/env python
"""Synchronous against asynchronous EnvACE on the CPU default, under simulated tool latency (issue 46).

    .venv/bin/python benchmarks/async_throughput.py [--seeds 0,1,2] [--arms ARM,...] [--latencies 0ms,200ms,longtail]
        [--steps 20] [--ms 200] [--longtail-p 0.05] [--longtail-factor 10] [--staleness-threshold 2]
        [--out DIR] [--dry-run] [HYDRA_OVERRIDE ...]

Each run is ``scripts/train.sh experiment=cpu_default`` plus the overrides given, the arm's, the latency's and the
run's own (its folder ``--out/ARM/LATENCY/seedN``, with its data build in ``data/``). Runs go one at a time, for every
arm × latency × seed:

=========================  ==========================================================================================
arm                        ``trainer.v1.trainer_mode`` and what it needs
=========================  ==========================================================================================
envace_sync                verl's sync trainer: a step generates its batch, then trains on it
envace_colocate_async      rollouts keep generating while the trainer trains (the same devices), one warm-up batch,
                           ``sampler.max_off_policy_threshold`` (``--staleness-threshold``) with the ``drop`` strategy
envace_separate_async      a standalone rollout (``rollout.nnodes = n_gpus_per_node = 1``), ``parameter_sync_step =
                           train_batch_size / ppo_mini_batch_size``, the same staleness bound. Blocked on CPU: the only
                           checkpoint engine there is ``naive``, which separate_async refuses
=========================  ==========================================================================================

Latencies (the ``latency:POOL`` wrapper of every pool in ``envace.data.pools``, :mod:`envace.envs.latency`, seeded
with the run's seed, so every arm meets the same slow calls at one seed):

* ``0ms``: the wrapper with no wait (every arm goes through the same code path);
* ``200ms``: ``--ms`` on every call;
* ``longtail``: ``--ms``, or ``--ms × --longtail-factor`` with probability ``--longtail-p``.

Every run trains ``--steps`` steps of ``data.train_batch_size × rollout.n`` rollouts, so every arm trains the same
number of rollouts. It validates before the first step and after the last (``trainer.test_freq = --steps``), and
``data.seed`` is the seed.

An arm is checked first with ``python -m envace.train --preflight-only``. An arm the checks refuse is printed as
``blocked: <reason>``, and so is a run that exits with envace's one-line config error. A run that fails in another
way is printed as ``failed: exit N (log)``. The other runs go on, and the benchmark then exits 1. A run whose folder
holds its result (``benchmark.json``, written when the run finished) is read, not run again.

What is printed, per arm × latency (mean ± standard error over the seeds; one seed: its value), from the run's
``metrics/*.jsonl``:

* **rollouts/s**: the rollouts trained (``envace/trajectories``, summed over the steps) over the training time, which
  is the sum of ``timing_s/step``. Validation (``timing_s/testing``, outside the step) and start-up are excluded;
  the wall time of the whole command is printed beside it.
* **rollouts**: the rollouts a run trained (the mean over seeds; each should be the budget above the table).
* **async/sync**: the ratio of rollouts/s to ``envace_sync``'s at the same latency, paired by seed.
* **trainer idle**: Σ ``timing_s/gen`` / Σ ``timing_s/step``. verl's ``gen`` timer wraps the trainer's wait for its
  batch (``replay_buffer.sample``, with the ``on_sample_begin/end`` hooks: verl/trainer/ppo/v1/trainer_base.py,
  ``_step_once``). In the sync trainer this is the whole generation. In the async trainers it is the wait for enough
  finished groups. On a CPU the same cores generate, so "idle" means the training loop is blocked, not that cores
  are free.
* **staleness**: envace's per-trajectory lag, ``envace/staleness/mean`` averaged over the steps and
  ``envace/staleness/max`` maxed over them. Beside it is verl's per-row worst case,
  ``training/off_policy/trajectory_staleness_worst/max``.
* **held-out change**: ``val-aux/heldout/success/change`` after the last step (first to last validation, paired by
  task), with its standard error over the seeds (one seed: the run's ``change_sem``). The last column is the
  difference from ``envace_sync``'s change in units of the two errors combined. Issue 46's target is within 2.
* **latency**: the calls the wrapper delayed and the mean injected milliseconds a call (training and validation,
  from its counters, :func:`envace.envs.latency.collect_stats`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

ARMS = ("envace_sync", "envace_colocate_async", "envace_separate_async")
SYNC = "envace_sync"
LATENCIES = ("0ms", "200ms", "longtail")
CONFIG_ERROR = "envace: config error: "  # envace.train.config_error's one line
PREFLIGHT = "--preflight-only"  # envace.train's flag: the checks alone


@dataclass(frozen=True)
class Setup:
    """What the runs' overrides need from the composed config and the flags."""

    pools: tuple[str, ...]  # envace.data.pools
    pool_kwargs: Mapping[str, Any]  # envace.agent.pool_kwargs
    batch: int  # data.train_batch_size
    mini_batch: int  # actor_rollout_ref.actor.ppo_mini_batch_size
    n: int  # actor_rollout_ref.rollout.n
    steps: int  # --steps: training steps of every run
    ms: float  # --ms: a call's latency (200ms), a fast call's (longtail)
    longtail_p: float  # --longtail-p: probability that a call is slow
    longtail_factor: float  # --longtail-factor: a slow call takes ms x this
    staleness_threshold: int  # --staleness-threshold: the async arms' max_off_policy_threshold

    @property
    def rollouts(self) -> int:
        """Rollouts every run trains."""
        return self.steps * self.batch * self.n


def latency_kwargs(name: str, setup: Setup) -> dict[str, Any]:
    """The latency wrapper's distribution for latency ``name``."""
    if name == "0ms":
        return {"dist": "fixed", "ms": 0}
    if name == "200ms":
        return {"dist": "fixed", "ms": setup.ms}
    if name == "longtail":
        return {"dist": "longtail", "ms": setup.ms, "p": setup.longtail_p, "factor": setup.longtail_factor}
    raise ValueError(f"unknown latency {name!r} (known: {', '.join(LATENCIES)})")


def arm_overrides(arm: str, setup: Setup) -> list[str]:
    """The trainer mode and what it needs (module docstring)."""
    mode = [f"trainer.v1.trainer_mode={arm}"]
    bound = [f"trainer.v1.sampler.max_off_policy_threshold={setup.staleness_threshold}",
             "trainer.v1.sampler.max_off_policy_strategy=drop"]
    if arm == SYNC:
        return mode
    if arm == "envace_colocate_async":
        return [*mode, "trainer.v1.colocate_async.num_warmup_batches=1", *bound]
    if arm == "envace_separate_async":
        return [*mode, "trainer.v1.separate_async.num_warmup_batches=1",
                f"trainer.v1.separate_async.parameter_sync_step={max(1, setup.batch // setup.mini_batch)}",
                "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1", *bound]
    raise ValueError(f"unknown arm {arm!r} (known: {', '.join(ARMS)})")


_KEY = re.compile(r"[A-Za-z0-9_\-./:]+")


def hydra_value(value: Any) -> str:
    """``value`` (dicts, lists, strings, numbers, booleans, None) written in Hydra's override grammar; a colon in a
    dict key is escaped (``latency\\:synthetic``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise ValueError(f"no Hydra literal for {value!r}")
        return repr(value)
    if isinstance(value, str):
        if "${" in value or ("'" in value and '"' in value) or "\\" in value:
            raise ValueError(f"no plain Hydra quoted string for {value!r}")
        return f'"{value}"' if "'" in value else f"'{value}'"
    if isinstance(value, Mapping):
        items = []
        for key, item in value.items():
            if not _KEY.fullmatch(str(key)):
                raise ValueError(f"no Hydra dict key for {key!r}")
            items.append(f"{str(key).replace(':', chr(92) + ':')}: {hydra_value(item)}")
        return "{" + ", ".join(items) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(hydra_value(v) for v in value) + "]"
    raise ValueError(f"no Hydra literal for a {type(value).__name__}")


def latency_overrides(latency: str, seed: int, setup: Setup, stats_dir: Path) -> list[str]:
    """Every pool of ``envace.data.pools`` behind the latency wrapper, its own kwargs passed through."""
    wrapped = {f"latency:{pool}": {"pool_kwargs": dict(setup.pool_kwargs.get(pool, {}) or {}),
                                   **latency_kwargs(latency, setup), "seed": seed, "stats_dir": str(stats_dir)}
               for pool in setup.pools}
    return [f"envace.data.pools={hydra_value(list(wrapped))}", f"++envace.agent.pool_kwargs={hydra_value(wrapped)}"]


def run_dir(out: Path, arm: str, latency: str, seed: int) -> Path:
    return out / arm / latency / f"seed{seed}"


def train_overrides(arm: str, latency: str, seed: int, setup: Setup, out: Path, user: Sequence[str]) -> list[str]:
    """The Hydra overrides of one run: the CPU default (unless the user names an experiment), the user's, the arm's,
    the latency's and the run's own."""
    where = run_dir(out, arm, latency, seed)
    base = [] if any(o.startswith("experiment=") for o in user) else ["experiment=cpu_default"]
    return [*base, *user, *arm_overrides(arm, setup), *latency_overrides(latency, seed, setup, where / "latency"),
            f"data.seed={seed}", f"trainer.total_training_steps={setup.steps}", f"trainer.test_freq={setup.steps}",
            "trainer.val_before_train=true", "trainer.save_freq=-1", "trainer.logger=[console,file]",
            f"envace.data.out_dir={where / 'data'}", f"trainer.default_local_dir={where}",
            f"trainer.experiment_name=async_{arm}_{latency}"]


# -- one run's figures ---------------------------------------------------------------------------------------------
def _total(series: Mapping[str, Mapping[int, float]], key: str) -> float:
    return float(sum(series.get(key, {}).values()))


def _last(values: Mapping[int, float]) -> float | None:
    return values[max(values)] if values else None


def summarise(series: Mapping[str, Mapping[int, float]], wall_s: float, latency: Mapping[str, float]) -> dict:
    """One run's figures (module docstring) from its metrics ``{key: {step: value}}``."""
    train_s = _total(series, "timing_s/step")
    rollouts = _total(series, "envace/trajectories")
    stale = series.get("envace/staleness/mean", {})
    stale_max = series.get("envace/staleness/max", {})
    worst = series.get("training/off_policy/trajectory_staleness_worst/max", {})
    calls = latency.get("calls", 0)
    return {
        "steps": len(series.get("timing_s/step", {})),
        "rollouts": rollouts,
        "train_s": train_s,
        "wall_s": wall_s,
        "rollouts_per_s": rollouts / train_s if train_s > 0 else None,
        "idle": _total(series, "timing_s/gen") / train_s if train_s > 0 else None,
        "staleness_mean": statistics.fmean(stale.values()) if stale else None,
        "staleness_max": max(stale_max.values()) if stale_max else None,
        "verl_staleness_worst_max": max(worst.values()) if worst else None,
        "change": _last(series.get("val-aux/heldout/success/change", {})),
        "change_sem": _last(series.get("val-aux/heldout/success/change_sem", {})),
        "latency_calls": calls,
        "latency_ms_per_call": 1000.0 * latency.get("injected_s", 0.0) / calls if calls else None,
    }


# -- over seeds ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Estimate:
    """A mean over seeds and its standard error (nan with one seed, unless the run's own error stands in)."""

    mean: float
    sem: float
    n: int

    def text(self, digits: int = 2) -> str:
        if math.isnan(self.mean):
            return "-"
        if math.isnan(self.sem):
            return f"{self.mean:.{digits}f}"
        return f"{self.mean:.{digits}f} ± {self.sem:.{digits}f}"


def estimate(values: Sequence[float | None]) -> Estimate:
    """Mean ± standard error (sd / sqrt(n)) of the values present."""
    vals = [v for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return Estimate(math.nan, math.nan, 0)
    sem = statistics.stdev(vals) / math.sqrt(len(vals)) if len(vals) > 1 else math.nan
    return Estimate(statistics.fmean(vals), sem, len(vals))


def change_estimate(runs: Sequence[dict]) -> Estimate:
    """The held-out change over seeds; with one run, its own paired standard error (``change_sem``)."""
    est = estimate([r["change"] for r in runs])
    if est.n == 1:
        sem = next(r["change_sem"] for r in runs if r["change"] is not None)
        return Estimate(est.mean, math.nan if sem is None else sem, 1)
    return est


def ratio_to_sync(runs: Sequence[dict], sync_runs: Sequence[dict]) -> Estimate:
    """rollouts/s over the sync arm's at the same seed, mean ± s.e. over the seeds both have."""
    sync = {r["seed"]: r["rollouts_per_s"] for r in sync_runs}
    return estimate([r["rollouts_per_s"] / sync[r["seed"]] for r in runs
                     if r["rollouts_per_s"] is not None and sync.get(r["seed"])])


def change_z(arm: Estimate, sync: Estimate) -> float:
    """(arm - sync) in units of their combined standard error (nan when either has none)."""
    return (arm.mean - sync.mean) / math.hypot(arm.sem, sync.sem) if arm.sem > 0 or sync.sem > 0 else math.nan


# -- the table -----------------------------------------------------------------------------------------------------
COLUMNS = (("arm", 23), ("latency", 9), ("runs", 5), ("rollouts", 9), ("rollouts/s", 15), ("async/sync", 13), ("trainer idle", 14),
           ("stale mean", 13), ("stale max", 10), ("verl worst", 11), ("held-out change", 17), ("vs sync", 9),
           ("wall s", 10), ("calls", 7), ("ms/call", 8))


def report(results: Mapping[tuple[str, str], Any], setup: Setup) -> list[str]:
    """The table's lines. ``results[(arm, latency)]`` is the list of run summaries (with ``seed``), or a string: why
    the arm has no figures (``blocked: ...`` / ``failed: ...``)."""
    title = (f"each run trains {setup.rollouts} rollouts ({setup.steps} steps x {setup.batch} prompts x {setup.n}); "
             "mean ± s.e. over seeds")
    lines = [title,
             "".join(f"{name:>{width}}" if i > 1 else f"{name:<{width}}" for i, (name, width) in enumerate(COLUMNS))]
    for (arm, latency), runs in results.items():
        head = f"{arm:<23}{latency:<9}"
        if isinstance(runs, str):
            lines.append(f"{head}{runs}")
            continue
        sync = results.get((SYNC, latency))
        sync_runs = sync if isinstance(sync, list) else []
        ratio = ratio_to_sync(runs, sync_runs) if arm != SYNC and sync_runs else Estimate(math.nan, math.nan, 0)
        change = change_estimate(runs)
        z = change_z(change, change_estimate(sync_runs)) if arm != SYNC and sync_runs else math.nan
        stale_max = [r["staleness_max"] for r in runs if r["staleness_max"] is not None]
        worst = [r["verl_staleness_worst_max"] for r in runs if r["verl_staleness_worst_max"] is not None]
        cells = [str(len(runs)), f"{statistics.fmean(r['rollouts'] for r in runs):.0f}",
                 estimate([r["rollouts_per_s"] for r in runs]).text(3), ratio.text(2),
                 estimate([r["idle"] for r in runs]).text(2), estimate([r["staleness_mean"] for r in runs]).text(2),
                 f"{max(stale_max):g}" if stale_max else "-", f"{max(worst):g}" if worst else "-", change.text(3),
                 "-" if math.isnan(z) else f"{z:+.1f}", estimate([r["wall_s"] for r in runs]).text(0),
                 f"{statistics.fmean(r['latency_calls'] for r in runs):.0f}",
                 estimate([r["latency_ms_per_call"] for r in runs]).text(0)]
        lines.append(head + "".join(f"{c:>{w}}" for c, (_, w) in zip(cells, COLUMNS[2:], strict=True)))
    return lines


# -- running -------------------------------------------------------------------------------------------------------
class RunRefused(Exception):
    """envace refused the run's config (its one-line config error)."""


class RunFailed(Exception):
    """The run exited non-zero for another reason."""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)  # each run starts its own Ray cluster
    return env


def refusal(output: str) -> str | None:
    """envace's config error in a run's output (the reason after ``envace: config error:``), if any."""
    lines = [line for line in output.splitlines() if line.startswith(CONFIG_ERROR)]
    return lines[-1][len(CONFIG_ERROR):].strip() if lines else None


def preflight(overrides: Sequence[str]) -> str | None:
    """Why envace's pre-flight refuses ``overrides``, or None when it passes."""
    proc = subprocess.run([sys.executable, "-m", "envace.train", PREFLIGHT, *overrides], cwd=REPO, env=_env(),
                          capture_output=True, text=True, check=False)
    if proc.returncode == 0:
        return None
    output = proc.stdout + proc.stderr
    return refusal(output) or f"pre-flight exited {proc.returncode}: {(output.strip().splitlines() or [''])[-1]}"


def run_one(arm: str, latency: str, seed: int, setup: Setup, out: Path, user: Sequence[str]) -> dict:
    """One run's summary (read from its ``benchmark.json`` when it already finished). Raises :class:`RunRefused`
    or :class:`RunFailed`."""
    from envace.envs.latency import collect_stats
    from envace.metrics import load_metrics

    where = run_dir(out, arm, latency, seed)
    done = where / "benchmark.json"
    if done.exists():
        return json.loads(done.read_text())
    cmd = [str(REPO / "scripts" / "train.sh"), *train_overrides(arm, latency, seed, setup, out, user)]
    print("$", shlex.join(cmd), flush=True)
    log = where.parent / f"seed{seed}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with log.open("w") as fh:
        proc = subprocess.run(cmd, cwd=REPO, env=_env(), stdout=fh, stderr=subprocess.STDOUT, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        why = refusal(log.read_text(errors="replace"))
        if why is not None:
            raise RunRefused(why)
        raise RunFailed(f"exit {proc.returncode} ({log})")
    result = {"arm": arm, "latency": latency, "seed": seed,
              **summarise(load_metrics(where), wall, collect_stats(where / "latency"))}
    done.write_text(json.dumps(result, indent=1))
    return result


def _setup(args: argparse.Namespace) -> Setup:
    from omegaconf import OmegaConf

    from envace.verl.config import compose

    user = list(args.overrides)
    cfg = compose(user if any(o.startswith("experiment=") for o in user) else ["experiment=cpu_default", *user])
    return Setup(pools=tuple(cfg.envace.data.pools),
                 pool_kwargs=OmegaConf.to_container(cfg.envace.agent.pool_kwargs, resolve=True),
                 batch=int(cfg.data.train_batch_size), mini_batch=int(cfg.actor_rollout_ref.actor.ppo_mini_batch_size),
                 n=int(cfg.actor_rollout_ref.rollout.n), steps=args.steps, ms=args.ms, longtail_p=args.longtail_p,
                 longtail_factor=args.longtail_factor, staleness_threshold=args.staleness_threshold)


def _names(text: str, known: Sequence[str], flag: str, parser: argparse.ArgumentParser) -> list[str]:
    names = [a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in names if a not in known]
    if unknown or not names:
        parser.error(f"{flag}: unknown or no name(s) {', '.join(unknown)} (known: {', '.join(known)})")
    return names


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated data and latency seeds")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--latencies", default=",".join(LATENCIES))
    parser.add_argument("--steps", type=int, default=20, help="training steps of every run (the fixed rollout budget)")
    parser.add_argument("--ms", type=float, default=200.0, help="latency of a call (200ms) and of a fast call (longtail)")
    parser.add_argument("--longtail-p", type=float, default=0.05, help="longtail: probability that a call is slow")
    parser.add_argument("--longtail-factor", type=float, default=10.0, help="longtail: a slow call takes ms x this")
    parser.add_argument("--staleness-threshold", type=int, default=2,
                        help="async arms: trainer.v1.sampler.max_off_policy_threshold (drop strategy)")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "benchmarks" / "async_throughput")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides applied to every run")
    args = parser.parse_args(argv)
    arms = _names(args.arms, ARMS, "--arms", parser)
    latencies = _names(args.latencies, LATENCIES, "--latencies", parser)
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        parser.error(f"--seeds: a comma-separated list of integers, got {args.seeds!r}")
    if args.steps < 1:
        parser.error(f"--steps: at least 1, got {args.steps}")
    setup = _setup(args)
    out = args.out.resolve()
    if args.dry_run:
        for arm in arms:
            pre = train_overrides(arm, latencies[0], seeds[0], setup, out, args.overrides)
            print("# pre-flight of", arm)
            print("$", shlex.join([sys.executable, "-m", "envace.train", PREFLIGHT, *pre]))
            for latency in latencies:
                for seed in seeds:
                    cmd = train_overrides(arm, latency, seed, setup, out, args.overrides)
                    print("$", shlex.join([str(REPO / "scripts" / "train.sh"), *cmd]))
        return 0
    results, failures = run_all(arms, latencies, seeds, setup, out, args.overrides)
    print("\n" + "\n".join(report(results, setup)))
    for failure in failures:
        print(f"failed: {failure}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({f"{a}/{lat}": r for (a, lat), r in results.items()}, indent=1))
    return 1 if failures else 0


def run_all(arms: Sequence[str], latencies: Sequence[str], seeds: Sequence[int], setup: Setup, out: Path,
            user: Sequence[str]) -> tuple[dict[tuple[str, str], Any], list[str]]:
    """Every run, arm by arm: ``{(arm, latency): [run summaries] | "blocked: ..." | "failed: ..."}`` and the failed
    runs, each in words. An arm refused once (its pre-flight or a run) is blocked at every latency."""
    results: dict[tuple[str, str], Any] = {}
    failures: list[str] = []
    for arm in arms:
        why = preflight(train_overrides(arm, latencies[0], seeds[0], setup, out, user))
        for latency in latencies:
            runs = []
            for seed in seeds if why is None else ():
                try:
                    runs.append({"seed": seed, **run_one(arm, latency, seed, setup, out, user)})
                except RunRefused as exc:
                    why = str(exc)
                    break
                except RunFailed as exc:
                    failures.append(f"{arm} {latency} seed {seed}: {exc}")
            if why is not None:
                results[(arm, latency)] = f"blocked: {why}"
            else:
                results[(arm, latency)] = runs or "failed: every seed (below)"
    return results, failures


if __name__ == "__main__":
    sys.exit(main())
