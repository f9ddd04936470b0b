"""EnvSched selection quality on simulated learners: the paper's Table 2 / Table 3(a) comparison.

    .venv/bin/python benchmarks/envsched_quality.py            # 2 learners x 19 arms x 3 seeds x 200 steps
    .venv/bin/python benchmarks/envsched_quality.py --quick    # the same, 60 steps
    .venv/bin/python benchmarks/envsched_quality.py --arms "random,EnvSched (full)" --learners binary --seeds 5
    .venv/bin/python benchmarks/envsched_quality.py --tasks-per-env 400   # a pool 8x the rollout budget's reach
    .venv/bin/python benchmarks/envsched_quality.py --text-free --envs 2000 --tasks-per-env 500 \
        --arms "random,learnability p(1-p),dynamic sampling (DAPO),Thompson (MoPPS),PLR"   # 1,000,000 tasks
    # the baseline table and its commands: docs/results/envsched_baselines.md (run with OMP_NUM_THREADS=1)

Pool: ``envsched.synthetic.synthetic_records`` (51 environments x 60 tasks with tool schemas, instructions,
verifier checks and code, and gold call sequences); per environment 50 tasks form the training pool
(2,550 tasks, as in the paper; ``--tasks-per-env`` changes it) and 10 are held out.  Each task's structural
archetype is its cross-environment structure cluster (the cluster is never shown to the scheduler; S_abs must find it).

Learners (``envsched.synthetic.LatentSkillLearner``; latent difficulty per environment, per structure cluster
and per task; updates proportional to the realised within-group reward spread):

* ``partial``: partial credit over 4 ordered verifier checks;
* ``binary``: 0/1 reward on harder tasks.

Neither saturates within 200 steps (median reward of random scheduling ends near 0.7 / 0.5).
``partial-local`` / ``binary-local`` (``--learners``; not in the default run): the same rewards, but neighbours
carry little information about a task: the task-specific part of difficulty has sd 2.2 against 0.5 for the
environment's and 0.5 for the structure cluster's (default 1.0 / 1.5 / 1.5), so the total spread of difficulty,
and with it how hard the pool is, stays about the same (sd 2.31 against 2.35).

Baseline arms (``benchmarks/envsched_baselines.py``, each docstring cites its paper and rule): per-task learnability
sampling from a Beta posterior per task with the target p (1 - p) or the GRPO form 1 - p^K - (1 - p)^K; DAPO-style
dynamic sampling (random batches, groups without reward spread dropped and refilled in batches of B, or only the
shortfall; every rollout generated counted); MoPPS-style Thompson sampling on the same posteriors (sampled p nearest
0.5); prioritized level replay (rank prioritisation of the mean absolute advantage, staleness mixing, proportionate
replay probability); VIP (a Gaussian process over TF-IDF embeddings of the instructions predicts each task's
success rate p, and the batch is the B tasks of largest predicted p (1 - p)).  All but VIP read only task ids and
environments, so ``--text-free`` runs them on a pool without text (``--envs`` x ``--tasks-per-env`` tasks named
like the synthetic ones, structure clusters drawn uniformly): the pool size EnvSched's graph cannot be built at on
this machine (issue 34, deliverable 1).

Arms: random; full EnvSched (the shipped config); the paper's Table 3(a) ablations and the eligibility
filters: without S_abs (within-environment edges only: K_cross = 0, all fusion weight on G^in), without
S_full (cross-environment edges only), without both (K_within = K_cross = 0: the prior is b_t), rho = 0
(exploitation only), rho = 1 (coverage only), without the progress filter, without the identifier filter.
``oracle q (ceiling)`` is full EnvSched's batch construction (same phases, caps, exposure discount and
similarity penalty) with the score q replaced by the percentile rank of the learner's noise-free expected group
variance: what a perfect predictor would reach under the paper's coverage rule, so the distance between it and
full EnvSched is what better prediction can still gain.  ``measured relation weights`` is full EnvSched with
``relation_weights: measured`` (``envsched/relations.py``: each relation's Eq. 3 weight chosen online by how
well it predicted the realised statistics, starting from relations faded; issue 34, deliverable 3);
``measured relation weights, start (1, 1)``: the same with the paper's weights as the reference
(``relation_weight_start: paper``).  ``additive-logit predictor`` is the shipped default (``predictor:
additive_logit``, ``envsched/predictor.py``: a mixed model of each task's success logit, environment + S_abs
structure + drift + own deviation, fitted online; issue 49 item 1); every other EnvSched arm has the paper's
predictor (``predictor: paper``).  ``--extra`` adds the non-paper relation options (``fusion: evidence``,
``cross_reference: environment``, and the same with longer half-lives; longer half-lives alone;
``cross_reference: environment_mean`` with ``quantile_weight_v: 0.35``, with and without longer half-lives;
``reconstructed_target: learnability``);
``--set KEY=JSON`` changes a field of every EnvSched arm.

Columns (mean ± sd over seeds): mean realised within-group variance per group *generated* (Eq. 2: the variance of
the groups a step trains on, summed over steps, divided by the groups rolled out; for every arm but dynamic sampling
that is the plain mean over all groups), the same over the coverage-phase and the exploitation-phase picks, median
reward, environments per batch, final held-out success (mean probability of full success on the held-out tasks),
final training-pool success, and the prediction diagnostics (``envsched/spearman_q_<type>``: Spearman correlation of
the selection score q with the realised variance, averaged over steps) for ``all`` groups, ``observed`` tasks and
tasks without history (``within_env`` evidence); ``rho_true``: the same score against the learner's noise-free
expected group variance over the whole pool every 10 steps (``all``, ``observed`` tasks, and among each
environment's unobserved tasks: the coverage phase's choice).  A second, cost table adds the variance per *trained*
group, rollouts generated per step, the held-out success at equal rollouts (after the last step within the
B x K x steps rollouts a fixed-batch arm generates: dynamic sampling pays its extra rollouts out of the same budget),
and the steps (and rollouts) each arm needs to reach the random arm's final held-out success on the same seed
(held-out success only rises, so that is the first step at or above it).  Runtime
of the full figure on the project's 2-core CPU machine: see the README's EnvSched section.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from envsched_baselines import (
    DynamicSampler,
    LearnabilitySampler,
    PrioritizedLevelReplay,
    ThompsonSampler,
    VIPSampler,
)

from envsched import EnvSchedConfig, EnvScheduler, TaskPool
from envsched.estimate import Prediction, evidence_types, percentile_rank, rank_correlation
from envsched.synthetic import ARCHETYPES, LatentSkillLearner, synthetic_records

N_ENVS, TRAIN_PER_ENV, HELDOUT_PER_ENV = 51, 50, 10
BATCH, ROLLOUTS = 64, 8  # B and K of every arm (the paper's)
LOCAL = {"sd_env": 0.5, "sd_cluster": 0.5, "sd_task": 2.2}  # neighbours carry little information
LEARNERS = {  # LatentSkillLearner keyword arguments
    "partial": {"reward": "partial", "n_checks": 4, "offset": 0.5},
    "binary": {"reward": "binary", "offset": 2.0},
    "partial-local": {"reward": "partial", "n_checks": 4, "offset": 0.5, **LOCAL},
    "binary-local": {"reward": "binary", "offset": 2.0, **LOCAL},
}
DEFAULT_LEARNERS = ("partial", "binary")
# Baseline arms: factory(pool, batch_size, rollouts_per_task, seed) -> scheduler (benchmarks/envsched_baselines.py)
BASELINES = {
    "learnability p(1-p)": lambda *a: LearnabilitySampler(*a, target="bernoulli"),
    "learnability 1-p^K-(1-p)^K": lambda *a: LearnabilitySampler(*a, target="grpo"),
    "dynamic sampling (DAPO)": lambda *a: DynamicSampler(*a),
    "dynamic sampling (refill shortfall)": lambda *a: DynamicSampler(*a, refill="shortfall"),
    "Thompson (MoPPS)": lambda *a: ThompsonSampler(*a),
    "PLR": lambda *a: PrioritizedLevelReplay(*a),
    "VIP": lambda *a: VIPSampler(*a),
}
TEXT_BASELINES = ("VIP",)  # baselines that embed the task text
CHEAP_ARMS = ("random", *(a for a in BASELINES if a not in TEXT_BASELINES))  # arms that read no task text
RELATION_ARMS = ("without S_abs", "without S_full", "without both")
ORACLE = "oracle q (ceiling)"
# Relations weighted by their measured predictive value (issue 34, deliverable 3; envsched/relations.py).
MEASURED = "measured relation weights"
MEASURED_PAPER_START = "measured relation weights, start (1, 1)"  # relation_weight_start: paper
# The additive latent-logit predictor (issue 49 item 1; envsched/predictor.py, config predictor: additive_logit), the
# shipped default since 2026-12-07.
ADDITIVE_LOGIT = "additive-logit predictor"
DIAG = ("all", "observed", "within_env", "cross_env_only")
TRUE_DIAG = ("all", "observed", "unobs_env")


def arms(base: EnvSchedConfig, extra: bool) -> dict[str, Any]:
    out = {
        "random": base.replace(scheduler="random"),
        "EnvSched (full)": base,
        "without S_abs": base.replace(k_cross=0, fusion_within=1.0),
        "without S_full": base.replace(k_within=0, fusion_within=0.0),
        "without both": base.replace(k_within=0, k_cross=0),
        "rho=0 (exploit only)": base.replace(rho=0.0),
        "rho=1 (coverage only)": base.replace(rho=1.0),
        "without progress filter": base.replace(progress_filter=False),
        "without identifier filter": base.replace(identifier_filter=False),
        ORACLE: base,
        MEASURED: base.replace(relation_weights="measured"),
        MEASURED_PAPER_START: base.replace(relation_weights="measured", relation_weight_start="paper"),
        ADDITIVE_LOGIT: base.replace(predictor="additive_logit"),
        **BASELINES,
    }
    if extra:
        out["evidence fusion + env-relative cross"] = base.replace(**RELATION_OPTIONS)
        out["... + h_long=24, h_short=6"] = base.replace(**RELATION_OPTIONS, h_long=24.0, h_short=6.0)
        out["h_long=24, h_short=6"] = base.replace(h_long=24.0, h_short=6.0)
        out["env-mean cross + f-weighted"] = base.replace(**MEAN_TRANSFER)
        out["env-mean cross + f-weighted + h=24/6"] = base.replace(**MEAN_TRANSFER, h_long=24.0, h_short=6.0)
        out["learnability target"] = base.replace(reconstructed_target="learnability")
    return out


# Non-paper relation options of envsched/config.py (issue 12), measured beside the paper's defaults.
RELATION_OPTIONS = {"fusion": "evidence", "cross_reference": "environment"}
# Cross-environment evidence on the mean, moved by the environments' levels, and the Eq. 12 score weighted
# toward the variance reconstructed from that mean (pr(f) weight 0.65 instead of 0.35).
MEAN_TRANSFER = {"cross_reference": "environment_mean", "quantile_weight_v": 0.35}


def split_records(seed: int = 0, train_per_env: int = TRAIN_PER_ENV,
                  n_envs: int = N_ENVS) -> tuple[list[dict], list[dict]]:
    recs = synthetic_records(n_envs, train_per_env + HELDOUT_PER_ENV, seed=seed)
    train = [r for r in recs if int(r["task_id"].rsplit("_", 1)[1]) < train_per_env]
    held = [r for r in recs if int(r["task_id"].rsplit("_", 1)[1]) >= train_per_env]
    return train, held


def text_free_split(n_envs: int, train_per_env: int,
                    seed: int = 0) -> tuple[TaskPool, np.ndarray, np.ndarray, np.ndarray]:
    """A pool of ``n_envs`` x ``train_per_env`` tasks without text (ids and environments only) for the arms that
    read no text, with structure clusters drawn uniformly over the synthetic archetypes, and ``HELDOUT_PER_ENV``
    held-out tasks per environment: (pool, cluster, held-out environment, held-out cluster)."""
    rng = np.random.default_rng(seed)
    n_cl = len(ARCHETYPES)
    pool = TaskPool.from_records({"task_id": f"env_{e:04d}-task_{k}", "env_id": f"env_{e:04d}", "instruction": "-"}
                                 for e in range(n_envs) for k in range(train_per_env))
    cluster = rng.integers(n_cl, size=len(pool))
    held_env = np.repeat(np.arange(n_envs), HELDOUT_PER_ENV)
    return pool, cluster, held_env, rng.integers(n_cl, size=len(held_env))


class OracleScheduler(EnvScheduler):
    """EnvSched whose score q is the percentile rank (Eq. 8) of the learner's expected group variance at
    selection time; everything else (phases, caps, exposure discount, similarity penalty) is the scheduler's."""

    def __init__(self, *args, learner: LatentSkillLearner, **kwargs):
        super().__init__(*args, **kwargs)
        self.learner = learner

    def predict(self, step: int | None = None) -> Prediction:
        pred = super().predict(step)
        return dataclasses.replace(pred, q=percentile_rank(self.learner.expected_variance(self.cfg.rollouts_per_task)))


def true_diagnostics(sched: EnvScheduler, learner: LatentSkillLearner, step: int, k: int) -> dict[str, float]:
    """Noise-free prediction diagnostics: Spearman correlation of the score q_{i,t} (Eq. 13) with the learner's
    *expected* group variance (``LatentSkillLearner.expected_variance``) over the whole pool at selection time:
    ``all`` tasks, ``observed`` tasks (own history), and ``unobs_env``: among each environment's tasks without
    history, averaged over environments (the choice the coverage phase makes, App. C)."""
    pred, n = sched.predict(step), len(sched.pool)
    vt = learner.expected_variance(k)
    code = evidence_types(sched.log, sched.neighbors.idx, step, np.arange(n), n)
    out = {}
    for name, mask in (("all", np.ones(n, dtype=bool)), ("observed", code == 0)):
        rho = rank_correlation(pred.q[mask], vt[mask])
        if rho is not None:
            out[name] = rho
    per_env = [rank_correlation(pred.q[m], vt[m]) for m in ((sched.env == e) & (code != 0) for e in range(sched.pool.n_envs))]
    per_env = [r for r in per_env if r is not None]
    if per_env:
        out["unobs_env"] = float(np.mean(per_env))
    return out


def make_scheduler(spec: Any, pool: TaskPool, graph, learner: LatentSkillLearner, oracle: bool = False):
    """An arm's scheduler for one seed: EnvScheduler (or the oracle) for a config, else the baseline factory's."""
    if isinstance(spec, EnvSchedConfig):
        cfg = spec.replace(seed=learner.seed)
        if oracle:
            return OracleScheduler(pool, cfg, graph=graph, learner=learner)
        return EnvScheduler(pool, cfg, graph=graph)
    return spec(pool, BATCH, ROLLOUTS, learner.seed)


def run(spec: Any, pool: TaskPool, graph, learner: LatentSkillLearner, steps: int, true_every: int = 10,
        oracle: bool = False) -> dict[str, Any]:
    """Drive one arm for ``steps`` steps on ``learner``: select, roll out K per task (and, for dynamic sampling,
    refill until its batch is full), train on the kept groups, observe; per-step figures in the returned dict."""
    sched = make_scheduler(spec, pool, graph, learner, oracle)
    envsched = isinstance(spec, EnvSchedConfig) and spec.scheduler == "envsched"
    if oracle:
        true_every = 0  # its score is the truth
    K = ROLLOUTS
    var_sum, gen_groups, trained_groups, med_r, envs, diag = 0.0, 0, 0, [], [], {k: [] for k in DIAG}
    gen_per_step, heldout_curve = [], []
    phase_var: dict[str, list[float]] = {"coverage": [], "exploitation": []}
    tdiag: dict[str, list[float]] = {k: [] for k in TRUE_DIAG}
    t0 = time.perf_counter()
    for step in range(steps):
        ids = sched.select(step)
        if envsched and step > 0 and true_every and step % true_every == 0:
            for k, x in true_diagnostics(sched, learner, step, K).items():
                tdiag[k].append(x)
        rolled: dict[str, np.ndarray] = {}
        n_gen = 0
        while ids:
            R = learner.rollout(pool.indices(ids), K)
            n_gen += len(ids)
            m = sched.observe(step, {t: r.tolist() for t, r in zip(ids, R)})
            rolled.update(zip(ids, R))
            ids = sched.refill(step) if hasattr(sched, "refill") else []
        kept = sched.kept(step) if hasattr(sched, "kept") else list(rolled)
        nodes = pool.indices(kept)
        R = np.stack([rolled[t] for t in kept]) if kept else np.zeros((0, K))
        learner.train(nodes, R)
        heldout_curve.append(learner.heldout_success())
        v = R.var(axis=1)
        var_sum += float(v.sum())
        gen_groups += n_gen
        trained_groups += len(kept)
        gen_per_step.append(n_gen * K)
        phases = np.asarray(getattr(sched, "selection_phases", {}).get(step, []))
        if len(phases) == len(v):
            for ph, vals in phase_var.items():
                if (phases == ph).any():
                    vals.append(float(v[phases == ph].mean()))
        if len(R):
            med_r.append(np.median(R.mean(axis=1)))
        envs.append(len(np.unique(pool.env[nodes])))
        for k in DIAG:
            if f"envsched/spearman_q_{k}" in m:
                diag[k].append(m[f"envsched/spearman_q_{k}"])
    cum_rollouts = np.cumsum(gen_per_step)
    out = {
        "mean_var": var_sum / max(gen_groups, 1),
        "var_trained": var_sum / max(trained_groups, 1),
        "rollouts_per_step": float(np.mean(gen_per_step)),
        **{f"var_{ph}": float(np.mean(vals)) if vals else float("nan") for ph, vals in phase_var.items()},
        "median_reward": float(np.median(med_r)) if med_r else float("nan"), "envs": float(np.mean(envs)),
        "heldout": learner.heldout_success(), "train_success": float(learner.success_prob().mean()),
        "heldout_equal_rollouts": heldout_within(heldout_curve, cum_rollouts, BATCH * K * steps),
        "heldout_curve": heldout_curve, "cum_rollouts": cum_rollouts.tolist(),
        "seconds": time.perf_counter() - t0,
    }
    for k in DIAG:
        out[f"rho_{k}"] = float(np.mean(diag[k])) if diag[k] else float("nan")
    for k in TRUE_DIAG:
        out[f"rho_true_{k}"] = float(np.mean(tdiag[k])) if tdiag[k] else float("nan")
    return out


def heldout_within(curve: list[float], cum_rollouts: np.ndarray, budget: int) -> float:
    """Held-out success after the last step whose cumulative rollouts generated stay within ``budget`` (the
    B x K x steps a fixed-batch arm generates in the run): the comparison at equal cost, where dynamic sampling's
    extra rollouts are paid out of the same budget.  Arms that generate B x K a step get their final figure."""
    within = np.flatnonzero(np.asarray(cum_rollouts) <= budget)
    return float(curve[within[-1]]) if len(within) else float("nan")


def steps_to_reach(runs: list[dict[str, Any]], reference: list[dict[str, Any]]) -> list[tuple[int, int] | None]:
    """Per seed: (steps, rollouts generated) an arm needs until its held-out success first reaches the final
    held-out success of ``reference`` (the random arm) on the same seed; None when it never does."""
    out = []
    for r, ref in zip(runs, reference):
        hit = np.flatnonzero(np.asarray(r["heldout_curve"]) >= ref["heldout_curve"][-1])
        out.append((int(hit[0]) + 1, int(r["cum_rollouts"][hit[0]])) if len(hit) else None)
    return out


def _fail(message: str) -> None:
    """A command-line mistake: one line on stderr, exit status 2, before anything runs."""
    print(f"envsched_quality.py: {message}", file=sys.stderr)
    raise SystemExit(2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="60 steps instead of 200")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--envs", type=int, default=N_ENVS, help="environments (paper: 51)")
    ap.add_argument("--tasks-per-env", type=int, default=TRAIN_PER_ENV, help="training tasks per environment (paper: 50)")
    ap.add_argument("--text-free", action="store_true",
                    help="a pool of task ids and environments only; for the arms that read no text: "
                    + ", ".join(CHEAP_ARMS))
    ap.add_argument("--seeds", type=int, default=3, help="learner / scheduler seeds (>= 3 for mean ± sd)")
    ap.add_argument("--learners", default=",".join(DEFAULT_LEARNERS),
                    help="comma-separated subset of " + ",".join(LEARNERS))
    ap.add_argument("--arms", default=None, help="comma-separated subset of the arm names (default: all)")
    ap.add_argument("--extra", action="store_true", help="add the 'paper estimation' and 'beyond the paper' arms")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON", help="override a config field of every EnvSched arm")
    ap.add_argument("--json", default=None, help="write the per-seed results here")
    args = ap.parse_args()
    steps = args.steps or (60 if args.quick else 200)
    for flag, value in (("--tasks-per-env", args.tasks_per_env), ("--envs", args.envs), ("--seeds", args.seeds),
                        ("--steps", steps)):
        if value < 1:
            _fail(f"{flag} must be >= 1, got {value}")
    if args.envs * args.tasks_per_env < BATCH:
        _fail(f"--envs x --tasks-per-env = {args.envs * args.tasks_per_env} tasks, fewer than the batch size {BATCH}")
    learners = [x.strip() for x in args.learners.split(",")]
    if unknown := [x for x in learners if x not in LEARNERS]:
        _fail(f"--learners: unknown learner(s) {unknown}; choose from {list(LEARNERS)}")
    try:
        overrides = {k: json.loads(v) for k, v in (s.split("=", 1) for s in args.set)}
        # every arm starts from the paper's method: its predictor (Eq. 3-13) and fixed relation weights (the library's
        # default, predictor: additive_logit, is the arm ADDITIVE_LOGIT; the measured weights are the arm MEASURED)
        base = EnvSchedConfig(batch_size=BATCH, rollouts_per_task=ROLLOUTS, relation_weights="paper",
                              predictor="paper").replace(**overrides)
    except ValueError as exc:  # a --set without '=', invalid JSON, an unknown or invalid config field
        _fail(f"--set: {exc}".splitlines()[0])
    variants = arms(base, args.extra)
    if args.arms:
        keep = [a.strip() for a in args.arms.split(",")]
        if unknown := [a for a in keep if a not in variants]:
            _fail(f"--arms: unknown arm(s) {unknown}; choose from {list(variants)}")
        variants = {k: v for k, v in variants.items() if k in keep}
    if args.text_free and (needs_text := [a for a in variants if a not in CHEAP_ARMS]):
        _fail(f"--text-free: arm(s) {needs_text} read task text; choose from {list(CHEAP_ARMS)}")
    t_all = time.perf_counter()
    if args.text_free:
        pool, cluster, held_env, held_cluster = text_free_split(args.envs, args.tasks_per_env)
        graph = None
    else:
        train, held = split_records(train_per_env=args.tasks_per_env, n_envs=args.envs)
        pool = TaskPool.from_records(train)
        cluster = np.array([r["meta"]["archetype"] for r in train])
        held_env = np.array([pool.env_names.index(r["env_id"]) for r in held])
        held_cluster = np.array([r["meta"]["archetype"] for r in held])
        needs_graph = any(isinstance(v, EnvSchedConfig) and v.scheduler == "envsched" for v in variants.values())
        graph = EnvScheduler(pool, base).graph if needs_graph else None
    print(f"pool: {len(pool):,} tasks in {pool.n_envs} environments, built in {time.perf_counter() - t_all:.0f}s",
          flush=True)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for lname in learners:
        results[lname] = {}
        for aname, spec in variants.items():
            runs = []
            for seed in range(args.seeds):
                learner = LatentSkillLearner(pool.env, cluster, held_env, held_cluster, seed=seed, **LEARNERS[lname])
                runs.append(run(spec, pool, graph, learner, steps, oracle=aname == ORACLE))
            results[lname][aname] = runs
            print(f"  {lname:<13} {aname:<36} done ({sum(r['seconds'] for r in runs):.0f}s)", flush=True)
    wall = time.perf_counter() - t_all
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    shape = (pool.n_envs, args.tasks_per_env)
    print_table(results, steps, args.seeds, wall, shape)
    print_cost_table(results, steps, args.seeds, shape)
    print("\ncommand: " + " ".join(["benchmarks/envsched_quality.py", *sys.argv[1:]]))


def _ms(runs: list[dict[str, float]], key: str) -> tuple[float, float]:
    x = np.asarray([r[key] for r in runs], dtype=float)
    x = x[np.isfinite(x)]
    if not len(x):
        return float("nan"), float("nan")
    return float(x.mean()), float(x.std(ddof=1)) if len(x) > 1 else 0.0


def _cells(runs: list[dict[str, float]], cols: list[tuple[str, str, str]]) -> list[str]:
    """One table row's "mean ± sd" cells over the seeds' runs, "-" where no run has a finite value."""
    cells = []
    for _, key, spec in cols:
        m, sd = _ms(runs, key)
        cells.append("-" if not np.isfinite(m) else f"{format(m, spec)} ± {format(sd, spec)}")
    return cells


def print_table(results: dict, steps: int, seeds: int, wall: float,
                shape: tuple[int, int] = (N_ENVS, TRAIN_PER_ENV)) -> None:
    cols = [("var/gen group", "mean_var", ".4f"),
            ("var coverage", "var_coverage", ".4f"), ("var exploit", "var_exploitation", ".4f"), ("med reward", "median_reward", ".3f"), ("envs/batch", "envs", ".2f"),
            ("held-out", "heldout", ".3f"), ("train succ", "train_success", ".3f"),
            ("rho_q all", "rho_all", ".2f"), ("rho_q obs", "rho_observed", ".2f"), ("rho_q within", "rho_within_env", ".2f"),
            ("rho_true all", "rho_true_all", ".2f"), ("rho_true obs", "rho_true_observed", ".2f"), ("rho_true unobs/env", "rho_true_unobs_env", ".2f")]
    print(f"\nEnvSched quality: simulated learners, {shape[0]} envs x {shape[1]} tasks "
          f"(+{HELDOUT_PER_ENV} held out per env), "
          f"B=64, K=8, {steps} steps, {seeds} seeds, mean ± sd over seeds; wall {wall:.0f}s")
    for lname, arms_ in results.items():
        print(f"\nlearner: {lname}")
        hdr = f"{'arm':<36}" + "".join(f" {c[0]:>17}" for c in cols)
        print(hdr)
        print("-" * len(hdr))
        for aname, runs in arms_.items():
            print(f"{aname:<36}" + "".join(f" {c:>17}" for c in _cells(runs, cols)))
        full, rnd, orc = arms_.get("EnvSched (full)"), arms_.get("random"), arms_.get(ORACLE)
        if orc and rnd:
            print(f"oracle q vs random: variance {_ms(orc, 'mean_var')[0] / _ms(rnd, 'mean_var')[0] - 1:+.1%} "
                  "(the most any predictor reaches with this batch construction)")
        if full and rnd:
            fv, rv = _ms(full, "mean_var")[0], _ms(rnd, "mean_var")[0]
            fe, re_ = _ms(full, "envs")[0], _ms(rnd, "envs")[0]
            fh, rh = _ms(full, "heldout")[0], _ms(rnd, "heldout")[0]
            print(f"EnvSched vs random: variance {fv / rv - 1:+.1%} (target >= +25%, paper +34%), "
                  f"envs/batch {fe / re_ - 1:+.1%} (target >= +20%, paper +26%), held-out {fh - rh:+.3f}")
        if full:
            for rel in RELATION_ARMS:
                if rel in arms_:
                    (dv, sv, wv), (dh, sh, wh) = (_paired(full, arms_[rel], key) for key in ("mean_var", "heldout"))
                    ok = "met" if dv >= 0 and dh >= 0 else "NOT met"
                    print(f"  full - {rel:<15}: variance {dv:+.4f} ± {sv:.4f} (ahead on {wv}/{len(full)} seeds), held-out "
                          f"{dh:+.3f} ± {sh:.3f} ({wh}/{len(full)}) -> full >= ablation {ok}")


def print_cost_table(results: dict, steps: int, seeds: int, shape: tuple[int, int]) -> None:
    """The baseline comparison: variance per group generated and per group trained, rollouts generated per step,
    environments per batch, final held-out success, the held-out success at equal rollouts (after the last step
    within the B x K x steps rollouts a fixed-batch arm generates), and the steps / rollouts to the random arm's
    final held-out success (mean ± sd over the seeds that reach it, with their count); then each EnvSched arm
    present (the paper's weights, ``EnvSched (full)``, and the shipped default's measured weights, ``MEASURED``)
    against each other arm, seed-paired."""
    cols = [("var/gen group", "mean_var", ".4f"), ("var/trained group", "var_trained", ".4f"),
            ("rollouts/step", "rollouts_per_step", ".0f"), ("envs/batch", "envs", ".2f"),
            ("held-out", "heldout", ".3f"), ("held-out eq. roll.", "heldout_equal_rollouts", ".3f")]
    print(f"\nBaseline comparison: {shape[0]} envs x {shape[1]} tasks, B={BATCH}, K={ROLLOUTS}, {steps} steps, "
          f"{seeds} seeds, mean ± sd over seeds")
    for lname, arms_ in results.items():
        rnd = arms_.get("random")
        print(f"\nlearner: {lname}")
        hdr = (f"{'arm':<34}" + "".join(f" {c[0]:>17}" for c in cols)
               + f" {'steps to random':>21} {'k rollouts to random':>21}")
        print(hdr)
        print("-" * len(hdr))
        for aname, runs in arms_.items():
            cells = _cells(runs, cols)
            reach = ["-", "-"]
            if rnd:
                hits = [h for h in steps_to_reach(runs, rnd) if h is not None]
                for j in range(2):
                    if hits:
                        x = np.asarray([h[j] for h in hits], dtype=float) / (1000 if j else 1)
                        sd = float(x.std(ddof=1)) if len(x) > 1 else 0.0
                        spec = ".1f" if j else ".0f"
                        reach[j] = f"{x.mean():{spec}} ± {sd:{spec}} ({len(hits)}/{len(runs)})"
                    else:
                        reach[j] = f"> {steps} (0/{len(runs)})" if j == 0 else "-"
            print(f"{aname:<34}" + "".join(f" {c:>17}" for c in cells) + f" {reach[0]:>21} {reach[1]:>21}")
        ours = {"full": "EnvSched (full)", "measured": MEASURED, "default": ADDITIVE_LOGIT}  # label -> arm
        for label, arm in ours.items():
            if arm not in arms_:
                continue
            mine, n = arms_[arm], len(arms_[arm])
            for aname, runs in arms_.items():
                if aname == arm:
                    continue
                (dv, sv, wv), (dh, sh, wh), (de, se, we) = (
                    _paired(mine, runs, key) for key in ("mean_var", "heldout", "heldout_equal_rollouts"))
                base_v = _ms(runs, "mean_var")[0]
                print(f"  {label:<8} - {aname:<34}: var/gen group {dv:+.4f} ± {sv:.4f} ({dv / base_v:+.1%}; ahead on "
                      f"{wv}/{n} seeds), held-out {dh:+.3f} ± {sh:.3f} (ahead on {wh}/{n}), "
                      f"at equal rollouts {de:+.3f} ± {se:.3f} (ahead on {we}/{n})")


def _paired(a: list[dict[str, float]], b: list[dict[str, float]], key: str) -> tuple[float, float, int]:
    """Seed-paired difference a - b of ``key`` (run i of both arms uses learner seed i): mean, sd over seeds, and
    the number of seeds on which a is ahead.  Seeds draw different latent difficulties, so the paired sd is the
    noise that matters for an arm-vs-arm comparison, not the per-arm sd of the table."""
    d = np.asarray([x[key] - y[key] for x, y in zip(a, b)], dtype=float)
    return float(d.mean()), float(d.std(ddof=1)) if len(d) > 1 else 0.0, int(np.sum(d > 0))


if __name__ == "__main__":
    main()
