"""Relations that earn their weight: each relation's weight in Eq. 3 chosen by measured predictive value.

**Beyond the paper** (config ``relation_weights: measured``, the default; the paper's fixed weights are ``paper``).

The paper fuses its evidence with fixed weights: Eq. 3 shrinks each relation's neighbour evidence toward the
global reference b_t with a fixed lambda_g,

    G^r_i = (sum_j a^r_ij y-bar_j + lambda_g b_t) / (sum_j a^r_ij + lambda_g),        r in {in, cross}

and Eq. 4 mixes the relations into the prior P and shrinks the task's own history y-bar_i (Eq. 11) toward it
with a fixed lambda_s.  Whether the within-environment (S_full) or cross-environment (S_abs) neighbours predict
a task's reward statistics is never checked, although the scheduler measures its predictions every step (the
prediction diagnostics).  Where they do not (a large task-specific part of difficulty) the prior pulls every
prediction toward neighbours that say nothing about the task: a task observed once gets 2/3 of its v-hat from
them (W = 1, lambda_s = 2).

**Eq. 3'.**  Each relation r and statistic y in {v, m, d} gets a weight c^r_y in [0, 1] on its evidence mass:

    G^r_i = (c^r_y sum_j a^r_ij y-bar_j + lambda_g b_t) / (c^r_y sum_j a^r_ij + lambda_g)        (EnvSched Eq. 3')

(with ``fusion: evidence`` the pooled prior of ``estimate.graph_prior`` sees the masses c^r_y A^r); Eq. 4 is
unchanged.  c = 1 is the paper exactly (the same floats); c = 0 fades the relation to b_t, and with both
relations faded P = b_t: the paper's "without both" ablation (Table 3(a)).  The option moves between the two by
what it measures.  The sources of Eq. 3-4 play these parts: the own history keeps its weight W (scaling it is
the same as scaling lambda_s, so one weight per relation is all there is to choose); the global reference b_t
(Eq. 6) is where a faded relation falls back to; the environment reference (``cross_reference:
environment``) stays the transfer inside the cross relation, weighted with it.

**What is measured** (``RelationWeights.update``, when a step is observed).  At selection the scheduler keeps, for
each selected task, what its long-half-life prediction was made of: W_i, y-bar_i, b_t and, per relation, S^r_i =
sum_j a^r_ij y-bar_j and A^r_i = sum_j a^r_ij.  From these, Eq. 3' and Eq. 4 give the prediction y-hat_i(c) the
task would have had under every pair c = (c^in, c^cross) of a grid (``relation_weight_grid``, which holds the
paper's 1 and the ablation's 0), without another pass over the pool.  For each pair the step contributes
Spearman's rank correlation (``scipy.stats.spearmanr``) of y-hat(c) with the realised statistic of the step's
groups (Eq. 2 / 9), on Fisher's z scale (z = artanh rho; a constant prediction ranks nothing, z = 0), and the
paired difference d_s(c) = z_s(c) - z_s(c_0) against the reference pair c_0 (below).  Over steps these are
averaged with the half-life weights 2^{-(t - s) / h} of Eq. 10 (``relation_weight_half_life``), so the weights
follow a learner whose neighbours start or stop predicting: mean D(c), sd of d, and the effective number of steps
n_eff = (sum w)^2 / sum w^2.

**The weights used** are the pair with the largest lower confidence bound D(c) - kappa sd(d) / sqrt(n_eff)
(``relation_weight_confidence`` = kappa), where the reference pair c_0 has D = 0 exactly; fewer than 3
effective steps: c_0.  The reference (``relation_weight_start``) is the pair in force until the measurement
shows, at kappa standard errors, that another ranks the realised statistic better:

* ``none`` (the default of the measured mode): c_0 = (0, 0), every relation faded, the "without both"
  ablation.  A relation earns its weight: it counts once its evidence is shown to rank the realised statistic
  better than the task's own history and b_t alone, and the noise of a few groups cannot switch it on.
* ``paper``: c_0 = (1, 1); a relation keeps the paper's weight until a smaller one is shown to rank better.

Why (0, 0): the first steps decide which tasks have an own history, and a group's realised variance and
dispersion are too noisy for the bound to clear within a few steps.  Started at (1, 1), where neighbours say
little the weights of v and d leave it late, and the relations kept meanwhile cost variance per group; started at
(0, 0), relations that predict clear the bound within a few steps (the figures: docs/results/envsched_baselines.md,
"Relations start faded and earn their weight").

Limits: one pair per statistic for the whole pool (not per environment); it is measured on the selected tasks,
the ones the score already put first, and by how each statistic is ranked, not by the batch it leads to: with
informative neighbours the relations it switches on can rank the statistics better while the batches' variance
trails "without both" (same file); ``EnvScheduler.predict`` for a past step uses the current weights.
Measured on simulated learners: docs/results/envsched_baselines.md.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import numpy as np
from scipy.stats import spearmanr

from .estimate import STATS, fuse_prior, graph_prior, weighted_relation_estimate

RELATIONS = ("in", "cross")
_MIN_STEPS = 3.0  # effective steps before a measured pair can replace the reference pair


class RelationWeights:
    """Online weights c^r_y of the relations r in {in, cross} for the statistics y in {v, m, d} (module docstring).

    ``weights()`` -> ``{y: {r: c}}`` for ``estimate.estimate_half_life``; ``update(step, sources, realised)``
    after a step is observed; ``state_dict()`` / ``load_state_dict()`` for an exact resume.  ``cfg``: an
    ``EnvSchedConfig`` (its lambda_g, lambda_s, fusion and ``relation_weight_*`` fields)."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        grid = sorted({float(c) for c in cfg.relation_weight_grid})
        self.pairs = list(itertools.product(grid, grid))  # (c_in, c_cross)
        self.paper = self.pairs.index((1.0, 1.0))
        # c_0, the pair in force until another is measured to rank better (relation_weight_start)
        start = {"none": 0.0, "paper": 1.0}[cfg.relation_weight_start]
        self.reference = self.pairs.index((start, start))
        # per (y, pair): decayed sums of w, w^2 (same for every pair), w d, w d^2, d = z - z(c_0); the step they are at
        self.sums = np.zeros((len(STATS), len(self.pairs), 4))
        self.step = -1

    def _decay_to(self, step: int) -> None:
        if self.step >= 0 and step > self.step:
            f = 2.0 ** (-(step - self.step) / self.cfg.relation_weight_half_life)
            self.sums *= np.array([f, f * f, f, f])
        self.step = max(self.step, step)

    def predictions(self, y: str, sources: dict[str, np.ndarray]) -> np.ndarray:
        """y-hat_i(c) of every grid pair (rows) for the recorded tasks (columns): Eq. 3' then Eq. 4."""
        cfg, b = self.cfg, np.asarray(sources[f"{y}:b"], dtype=np.float64)
        b_t = float(b[0]) if len(b) else 0.0
        out = np.empty((len(self.pairs), len(b)))
        for k, (c_in, c_cr) in enumerate(self.pairs):
            G = {r: weighted_relation_estimate(sources[f"{y}:S:{r}"], sources[f"A:{r}"], b_t, cfg.lambda_g, c)
                 for r, c in (("in", c_in), ("cross", c_cr))}
            P = graph_prior(G["in"], G["cross"], c_in * sources["A:in"], c_cr * sources["A:cross"], b_t, cfg.lambda_g,
                            cfg.fusion_within, cfg.fusion)
            out[k] = fuse_prior(P, sources["W"], sources[f"{y}:own"], cfg.lambda_s)
        return out

    def update(self, step: int, sources: dict[str, np.ndarray], realised: dict[str, np.ndarray]) -> None:
        """Add step ``step``'s evidence: ``sources`` as ``estimate_half_life`` records them, for the step's
        observed groups; ``realised[y]``: the groups' statistic (Eq. 2 / 9).  Each step is observed once."""
        self._decay_to(int(step))
        n = len(sources["W"])
        if n < self.cfg.relation_weight_min_groups:
            return
        for a, y in enumerate(STATS):
            real = np.asarray(realised[y], dtype=np.float64)
            if np.ptp(real) == 0:
                continue
            pred = self.predictions(y, sources)
            rho = np.zeros(len(self.pairs))  # a constant prediction ranks nothing: rho = 0
            varies = np.ptp(pred, axis=1) > 0
            if varies.any():
                with warnings.catch_warnings():  # a constant row is excluded above; scipy still warns on ties
                    warnings.simplefilter("ignore")
                    corr = spearmanr(np.column_stack([pred[varies].T, real]))[0]
                # two columns give the coefficient, more the matrix (its last row: each prediction vs realised)
                rho[varies] = np.nan_to_num(corr if np.ndim(corr) == 0 else corr[-1, :-1])
            z = np.arctanh(np.clip(rho, -0.999999, 0.999999))
            d = z - z[self.reference]
            self.sums[a] += np.stack([np.ones_like(d), np.ones_like(d), d, d * d], axis=1)

    def lower_bounds(self) -> np.ndarray:
        """(statistic, pair) lower confidence bounds D - kappa sd / sqrt(n_eff) (-inf before 3 effective steps;
        0 for the reference pair c_0)."""
        w, w2, wd, wd2 = (self.sums[..., k] for k in range(4))
        n_eff = np.where(w2 > 0, w * w / np.where(w2 > 0, w2, 1.0), 0.0)
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = wd / w
            sd = np.sqrt(np.maximum(wd2 / w - mean**2, 0.0))
            lcb = mean - self.cfg.relation_weight_confidence * sd / np.sqrt(n_eff)
        lcb = np.where(n_eff >= _MIN_STEPS, lcb, -np.inf)
        lcb[:, self.reference] = 0.0
        return lcb

    def weights(self) -> dict[str, dict[str, float]]:
        """{y: {"in": c, "cross": c}}: the pair of largest lower bound, c_0 unless one is > 0; among tied pairs (the
        same ranking, e.g. (1, 0) and (0.5, 0) where every task has the same evidence mass) the one nearest the
        paper's (1, 1)."""
        lcb = self.lower_bounds()
        total = np.asarray([sum(p) for p in self.pairs])
        out = {}
        for a, y in enumerate(STATS):
            best = self.reference
            if lcb[a].max() > 0.0:
                tied = np.flatnonzero(lcb[a] >= lcb[a].max() - 1e-12)
                best = int(tied[np.argmax(total[tied])])
            out[y] = dict(zip(RELATIONS, self.pairs[best]))
        return out

    def metrics(self) -> dict[str, float]:
        """``relation_weight_<y>_<r>``: the weights the next step uses."""
        return {f"relation_weight_{y}_{r}": c for y, per in self.weights().items() for r, c in per.items()}

    def state_dict(self) -> dict[str, Any]:
        return {"sums": self.sums.copy(), "step": int(self.step), "reference": self.pairs[self.reference]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        sums = np.asarray(state["sums"], dtype=np.float64)
        if sums.shape != self.sums.shape:
            raise ValueError(f"relation weight state of shape {sums.shape}, expected {self.sums.shape} (another grid)")
        ref = tuple(float(c) for c in state.get("reference", (1.0, 1.0)))  # saved before the option: (1, 1)
        if ref != self.pairs[self.reference]:
            raise ValueError(f"relation weight state measured against {ref}, the config's reference is "
                             f"{self.pairs[self.reference]} (relation_weight_start)")
        self.sums = sums.copy()
        self.step = int(state["step"])
