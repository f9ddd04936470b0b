"""EnvSched selection quality on simulated learners: the paper's Table 2 / Table 3(a) comparison.

    .venv/bin/python benchmarks/envsched_quality.py            # 2 learners x 10 arms x 3 seeds x 200 steps
    .venv/bin/python benchmarks/envsched_quality.py --quick    # 2 learners x 10 arms x 3 seeds x 60 steps
    .venv/bin/python benchmarks/envsched_quality.py --arms "random,EnvSched (full)" --learners binary --seeds 5
    .venv/bin/python benchmarks/envsched_quality.py --tasks-per-env 400   # a pool 8x the rollout budget's reach

Pool: ``envsched.synthetic.synthetic_records`` (51 environments x 60 tasks with tool schemas, instructions,
verifier checks and code, and gold call sequences); per environment 50 tasks form the training pool
(2,550 tasks, as in the paper; ``--tasks-per-env`` changes it) and 10 are held out.  Each task's structural
archetype is its cross-environment structure cluster (the cluster is never shown to the scheduler; S_abs must find it).

Learners (``envsched.synthetic.LatentSkillLearner``; latent difficulty per environment, per structure cluster
and per task; updates proportional to the realised within-group reward spread):

* ``partial``: partial credit over 4 ordered verifier checks;
* ``binary``: 0/1 reward on harder tasks.

Neither saturates within 200 steps (median reward of random scheduling ends near 0.7 / 0.5).

Arms: random; full EnvSched (the shipped config); the paper's Table 3(a) ablations and the eligibility
filters: without S_abs (within-environment edges only: K_cross = 0, all fusion weight on G^in), without
S_full (cross-environment edges only), without both (K_within = K_cross = 0: the prior is b_t), rho = 0
(exploitation only), rho = 1 (coverage only), without the progress filter, without the identifier filter.
``oracle q (ceiling)`` is full EnvSched's batch construction (same phases, caps, exposure discount and
similarity penalty) with the score q replaced by the percentile rank of the learner's noise-free expected group
variance: what a perfect predictor would reach under the paper's coverage rule, so the distance between it and
full EnvSched is what better prediction can still gain.  ``--extra`` adds the non-paper relation options
(``fusion: evidence``, ``cross_reference: environment``, and the same with longer half-lives; longer half-lives
alone; ``cross_reference: environment_mean`` with ``quantile_weight_v: 0.35``, with and without longer half-lives;
``reconstructed_target: learnability``);
``--set KEY=JSON`` changes a field of every EnvSched arm.

Columns (mean ± sd over seeds): mean realised within-group variance over all steps (Eq. 2), the same over the
coverage-phase and the exploitation-phase picks, median reward,
environments per batch, final held-out success (mean probability of full success on the held-out tasks),
final training-pool success, and the prediction diagnostics (``envsched/spearman_q_<type>``: Spearman
correlation of the selection score q with the realised variance, averaged over steps) for ``all`` groups,
``observed`` tasks and tasks without history (``within_env`` evidence); ``rho_true``: the same score against
the learner's noise-free expected group variance over the whole pool every 10 steps (``all``, ``observed``
tasks, and among each environment's unobserved tasks: the coverage phase's choice).  Runtime of the full figure on
the project's 2-core CPU machine: see the README's EnvSched section.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from envsched import EnvSchedConfig, EnvScheduler, TaskPool
from envsched.estimate import Prediction, evidence_types, percentile_rank, rank_correlation
from envsched.synthetic import LatentSkillLearner, synthetic_records

N_ENVS, TRAIN_PER_ENV, HELDOUT_PER_ENV = 51, 50, 10
LEARNERS = {  # LatentSkillLearner keyword arguments
    "partial": {"reward": "partial", "n_checks": 4, "offset": 0.5},
    "binary": {"reward": "binary", "offset": 2.0},
}
RELATION_ARMS = ("without S_abs", "without S_full", "without both")
ORACLE = "oracle q (ceiling)"
DIAG = ("all", "observed", "within_env", "cross_env_only")
TRUE_DIAG = ("all", "observed", "unobs_env")


def arms(base: EnvSchedConfig, extra: bool) -> dict[str, EnvSchedConfig]:
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


def split_records(seed: int = 0, train_per_env: int = TRAIN_PER_ENV) -> tuple[list[dict], list[dict]]:
    recs = synthetic_records(N_ENVS, train_per_env + HELDOUT_PER_ENV, seed=seed)
    train = [r for r in recs if int(r["task_id"].rsplit("_", 1)[1]) < train_per_env]
    held = [r for r in recs if int(r["task_id"].rsplit("_", 1)[1]) >= train_per_env]
    return train, held


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


def run(cfg: EnvSchedConfig, pool: TaskPool, graph, learner: LatentSkillLearner, steps: int, true_every: int = 10, oracle: bool = False) -> dict[str, float]:
    if oracle:
        sched = OracleScheduler(pool, cfg.replace(seed=learner.seed), graph=graph, learner=learner)
        true_every = 0  # its score is the truth
    else:
        sched = EnvScheduler(pool, cfg.replace(seed=learner.seed), graph=graph)
    var, med_r, envs, diag = [], [], [], {k: [] for k in DIAG}
    phase_var: dict[str, list[float]] = {"coverage": [], "exploitation": []}
    tdiag: dict[str, list[float]] = {k: [] for k in TRUE_DIAG}
    t0 = time.perf_counter()
    for step in range(steps):
        ids = sched.select(step)
        nodes = pool.indices(ids)
        if cfg.scheduler == "envsched" and step > 0 and true_every and step % true_every == 0:
            for k, x in true_diagnostics(sched, learner, step, cfg.rollouts_per_task).items():
                tdiag[k].append(x)
        R = learner.rollout(nodes, cfg.rollouts_per_task)
        learner.train(nodes, R)
        m = sched.observe(step, {t: r.tolist() for t, r in zip(ids, R)})
        v = R.var(axis=1)
        var.append(v.mean())
        phases = np.asarray(sched.selection_phases[step])
        for ph, vals in phase_var.items():
            if (phases == ph).any():
                vals.append(float(v[phases == ph].mean()))
        med_r.append(np.median(R.mean(axis=1)))
        envs.append(m["envsched/envs_per_batch"])
        for k in DIAG:
            if f"envsched/spearman_q_{k}" in m:
                diag[k].append(m[f"envsched/spearman_q_{k}"])
    out = {
        "mean_var": float(np.mean(var)),
        **{f"var_{ph}": float(np.mean(vals)) if vals else float("nan") for ph, vals in phase_var.items()},
        "median_reward": float(np.median(med_r)), "envs": float(np.mean(envs)),
        "heldout": learner.heldout_success(), "train_success": float(learner.success_prob().mean()),
        "seconds": time.perf_counter() - t0,
    }
    for k in DIAG:
        out[f"rho_{k}"] = float(np.mean(diag[k])) if diag[k] else float("nan")
    for k in TRUE_DIAG:
        out[f"rho_true_{k}"] = float(np.mean(tdiag[k])) if tdiag[k] else float("nan")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="60 steps instead of 200")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--tasks-per-env", type=int, default=TRAIN_PER_ENV, help="training tasks per environment (paper: 50)")
    ap.add_argument("--seeds", type=int, default=3, help="learner / scheduler seeds (>= 3 for mean ± sd)")
    ap.add_argument("--learners", default=",".join(LEARNERS), help="comma-separated subset of " + ",".join(LEARNERS))
    ap.add_argument("--arms", default=None, help="comma-separated subset of the arm names (default: all)")
    ap.add_argument("--extra", action="store_true", help="add the 'paper estimation' and 'beyond the paper' arms")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON", help="override a config field of every EnvSched arm")
    ap.add_argument("--json", default=None, help="write the per-seed results here")
    args = ap.parse_args()
    steps = args.steps or (60 if args.quick else 200)
    t_all = time.perf_counter()
    if args.tasks_per_env < 1:
        raise SystemExit("--tasks-per-env must be >= 1")
    train, held = split_records(train_per_env=args.tasks_per_env)
    pool = TaskPool.from_records(train)
    env, cluster = pool.env, np.array([r["meta"]["archetype"] for r in train])
    held_env = np.array([pool.env_names.index(r["env_id"]) for r in held])
    held_cluster = np.array([r["meta"]["archetype"] for r in held])
    overrides = {k: json.loads(v) for k, v in (s.split("=", 1) for s in args.set)}
    base = EnvSchedConfig(batch_size=64, rollouts_per_task=8).replace(**overrides)
    graph = EnvScheduler(pool, base).graph
    variants = arms(base, args.extra)
    if args.arms:
        keep = [a.strip() for a in args.arms.split(",")]
        unknown = [a for a in keep if a not in variants]
        if unknown:
            raise SystemExit(f"unknown arm(s) {unknown}; choose from {list(variants)}")
        variants = {k: v for k, v in variants.items() if k in keep}
    learners = [x.strip() for x in args.learners.split(",")]
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    for lname in learners:
        results[lname] = {}
        for aname, cfg in variants.items():
            runs = []
            for seed in range(args.seeds):
                learner = LatentSkillLearner(env, cluster, held_env, held_cluster, seed=seed, **LEARNERS[lname])
                runs.append(run(cfg, pool, graph, learner, steps, oracle=aname == ORACLE))
            results[lname][aname] = runs
            print(f"  {lname:<8} {aname:<36} done ({sum(r['seconds'] for r in runs):.0f}s)", flush=True)
    wall = time.perf_counter() - t_all
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print_table(results, steps, args.seeds, wall, args.tasks_per_env)


def _ms(runs: list[dict[str, float]], key: str) -> tuple[float, float]:
    x = np.asarray([r[key] for r in runs], dtype=float)
    x = x[np.isfinite(x)]
    if not len(x):
        return float("nan"), float("nan")
    return float(x.mean()), float(x.std(ddof=1)) if len(x) > 1 else 0.0


def print_table(results: dict, steps: int, seeds: int, wall: float, train_per_env: int = TRAIN_PER_ENV) -> None:
    cols = [("mean var", "mean_var", ".4f"), ("var coverage", "var_coverage", ".4f"), ("var exploit", "var_exploitation", ".4f"), ("med reward", "median_reward", ".3f"), ("envs/batch", "envs", ".2f"),
            ("held-out", "heldout", ".3f"), ("train succ", "train_success", ".3f"),
            ("rho_q all", "rho_all", ".2f"), ("rho_q obs", "rho_observed", ".2f"), ("rho_q within", "rho_within_env", ".2f"),
            ("rho_true all", "rho_true_all", ".2f"), ("rho_true obs", "rho_true_observed", ".2f"), ("rho_true unobs/env", "rho_true_unobs_env", ".2f")]
    print(f"\nEnvSched quality: simulated learners, {N_ENVS} envs x {train_per_env} tasks (+{HELDOUT_PER_ENV} held out per env), "
          f"B=64, K=8, {steps} steps, {seeds} seeds, mean ± sd over seeds; wall {wall:.0f}s")
    for lname, arms_ in results.items():
        print(f"\nlearner: {lname}")
        hdr = f"{'arm':<36}" + "".join(f" {c[0]:>17}" for c in cols)
        print(hdr)
        print("-" * len(hdr))
        for aname, runs in arms_.items():
            cells = []
            for _, key, spec in cols:
                m, s = _ms(runs, key)
                cells.append("-" if not np.isfinite(m) else f"{format(m, spec)} ± {format(s, spec)}")
            print(f"{aname:<36}" + "".join(f" {c:>17}" for c in cells))
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


def _paired(a: list[dict[str, float]], b: list[dict[str, float]], key: str) -> tuple[float, float, int]:
    """Seed-paired difference a - b of ``key`` (run i of both arms uses learner seed i): mean, sd over seeds, and
    the number of seeds on which a is ahead.  Seeds draw different latent difficulties, so the paired sd is the
    noise that matters for an arm-vs-arm comparison, not the per-arm sd of the table."""
    d = np.asarray([x[key] - y[key] for x, y in zip(a, b)], dtype=float)
    return float(d.mean()), float(d.std(ddof=1)) if len(d) > 1 else 0.0, int(np.sum(d > 0))


if __name__ == "__main__":
    main()
