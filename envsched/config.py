"""Typed configuration of the EnvSched scheduler.

Every research constant of the EnvSched paper (§2, Appendices B–D) is a field here, with the paper's
value as the default.  Unknown keys fail loudly and name the key (``EnvSchedConfig.from_dict``).

Example::

    cfg = EnvSchedConfig.from_dict({"batch_size": 64, "rho": 0.5})
    cfg = EnvSchedConfig.from_yaml("configs/envsched/envsched.yaml")
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from envllm import RENAMED_KEYS, EndpointConfig


class ConfigError(ValueError):
    """A configuration could not be built (unknown key, wrong type, out-of-range value)."""


#: keys of the extractor config before it extended the shared endpoint config, and the key to write instead
#: (its ``max_retries`` counted repair rounds; the key now counts retries after an infrastructure error)
RENAMED_LLM_KEYS: dict[str, str] = {**RENAMED_KEYS, "max_workers": "concurrency"}


@dataclass
class LLMExtractorConfig(EndpointConfig):
    """The endpoint of the LLM operation extractor (EnvSched App. E; used only when ``operation_extractor='llm'``):
    the project's one endpoint config (:class:`envllm.EndpointConfig`: ``base_urls``, ``model``, ``api_key_env``,
    ``timeout_s``, ``max_retries``, ``concurrency``, sampling), plus the extractor's own knobs below.

    The extractor talks to the first of ``base_urls`` through ``openai.OpenAI`` (whose own backoff retries an
    infrastructure error ``max_retries`` times), ``concurrency`` requests at a time while it extracts a pool; it
    sends ``temperature``, ``top_p``, ``max_tokens``, ``seed`` and ``extra_body``, and asks for a JSON object. The
    async pool's ``routing``, ``unhealthy_cooldown_s``, ``backoff_*`` and ``use_json_schema`` do not apply here.
    """

    renamed_keys: ClassVar[dict[str, str]] = RENAMED_LLM_KEYS

    # requests in flight while the extractor works through a pool (its own default, below the endpoint config's 64)
    concurrency: int = 8
    # completion-token limit per answer (None: the server's default, as before the shared config: an App. E answer
    # for a task with many operations can outgrow the endpoint config's 2048)
    max_tokens: int | None = None
    # directory of the on-disk cache of validated answers, keyed by the SHA-256 of model + prompt + task (null: none)
    cache_dir: str | None = ".cache/envsched/operations"
    # follow-up requests after an answer that fails the schema (the failure reason is fed back to the model)
    repair_rounds: int = 1
    # what to do when no answer validated: "fallback" to the deterministic extractor (logged, with the reason
    # recorded per task) or "raise" (OperationExtractionError; envllm.InfrastructureError when the endpoint failed)
    on_invalid: Literal["fallback", "raise"] = "fallback"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.repair_rounds < 0:
            raise ValueError(f"repair_rounds must be >= 0, got {self.repair_rounds}")
        if self.on_invalid not in ("fallback", "raise"):
            raise ValueError(f"on_invalid must be 'fallback' or 'raise', got {self.on_invalid!r}")


class EnvSchedConfig(BaseModel):
    """All constants of EnvSched.  Defaults are the paper's values (App. D) unless marked otherwise."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # ---- which scheduler -------------------------------------------------------------------------
    # "envsched" (the paper's method) or "random" (uniform without replacement, seeded; the paper's baseline).
    scheduler: Literal["envsched", "random"] = "envsched"
    # Seed of every random choice (random scheduler, random cold start).
    seed: int = 0

    # ---- batch ---------------------------------------------------------------------------------
    # B: environment–task pairs per training batch (§3.1).
    batch_size: int = Field(64, ge=1)
    # K: rollouts per pair (§3.1).  observe() accepts 1..K rewards per task (fewer when unscored rollouts are
    # skipped; counted in the short_groups / missing_rewards metrics) and refuses more than K.
    rollouts_per_task: int = Field(8, ge=1)
    # rho: fraction of the batch assigned to coverage, B_cov = floor(rho * B) (§2.4).
    rho: float = Field(0.5, ge=0.0, le=1.0)

    # ---- observation guards (observe(), Eq. 2) ---------------------------------------------------
    # Closed interval [low, high] every observed reward must lie in; observe() refuses a reward outside it
    # (naming the task) before changing any state.  The clip intervals of Eq. 6 below assume [0, 1].
    reward_range: tuple[float, float] = (0.0, 1.0)
    # Rounding slack of that check: a reward at most this far outside reward_range (float32 reward tensors,
    # normalised reward mixes) is clipped into it; anything farther is refused.  Implementation choice.
    reward_range_tolerance: float = Field(1e-6, ge=0.0)

    # ---- static graph (Eq. 1, App. D) ----------------------------------------------------------
    # alpha_a: weights of the six concrete TF-IDF views in S_full, in the order
    # (instruction words 1-2-grams, instruction char 3-5-grams, verifier-check text,
    #  verifier code structure, initial context, operation description).
    view_weights: tuple[float, float, float, float, float, float] = (0.28, 0.08, 0.16, 0.12, 0.16, 0.20)
    # Minimum document frequency of every TF-IDF encoder.
    tfidf_min_df: int = Field(1, ge=1)
    # Feature cap of every TF-IDF encoder: the most frequent terms, the alphabetically first among those tied at the cap.
    tfidf_max_features: int = Field(35_000, ge=1)
    # Sublinear term frequency (1 + log tf) in every TF-IDF encoder.
    tfidf_sublinear_tf: bool = True
    # Store TF-IDF matrices as float32 (halves memory at 100k tasks; similarities differ by < 1e-6).
    # Implementation choice, not in the paper.
    tfidf_float32: bool = True
    # Source of the structured operation description: "deterministic" (tool schemas + ground-truth
    # call sequences) or "llm" (App. E prompt on an OpenAI-compatible endpoint, see `llm`).
    operation_extractor: Literal["deterministic", "llm"] = "deterministic"
    # The LLM extractor's endpoint and settings (LLMExtractorConfig: envllm.EndpointConfig keys plus cache_dir,
    # repair_rounds, on_invalid), e.g. {base_urls: [http://127.0.0.1:8000/v1], model: M}; required when
    # operation_extractor is "llm".  null: none.
    llm: LLMExtractorConfig | None = None
    # Folder of the on-disk cache of the static graph (the Eq. 1 views and operation descriptions), one
    # entry per (pool content hash, graph-relevant config fields); a restart with the same pool and config
    # loads the entry instead of rebuilding.  null: no cache.  Implementation choice, not in the paper.
    graph_cache_dir: str | None = None
    # Processes that build the static graph (operation extraction and TF-IDF counting, by row chunk, in forked
    # children; the graph is the same for every value; each busy worker holds one chunk's counts, a few hundred
    # MiB).  1: in this process.  null: the CPUs this process may use, at most graph.MAX_AUTO_WORKERS.
    # Implementation choice, not in the paper; not part of the graph cache key.
    build_workers: int | None = Field(None, ge=1)
    # Warn when tasks lack gold call sequences and the median share of distinct App. E abstract descriptions
    # per environment is below this (the deterministic extractor then works from tool schemas and S_abs
    # cannot tell the tasks apart; StaticGraph.report()["abstraction"] has the figures).  0 disables it.
    abstraction_min_distinct_fraction: float = Field(0.25, ge=0.0, le=1.0)

    # ---- neighbours (§2.2, Eq. 3, Eq. 7) -------------------------------------------------------
    # K_within: observed within-environment neighbours per target (by S_full).
    k_within: int = Field(6, ge=0)
    # K_cross: observed cross-environment neighbours per target (by S_abs).
    k_cross: int = Field(12, ge=0)
    # A neighbour must have similarity strictly above this value (zero-similarity pairs carry no
    # evidence and are never retrieved by the sparse neighbour search).  Implementation choice.
    min_neighbor_similarity: float = Field(0.0, ge=0.0, lt=1.0)
    # Lower bound of the adaptive bandwidth sigma in Eq. 7.
    bandwidth_floor: float = Field(0.05, gt=0.0)
    # Clip interval of the neighbour history weight W_j inside the square root of Eq. 7.
    neighbor_weight_clip: tuple[float, float] = (0.1, 3.0)

    # ---- estimation (Eq. 3-4, 6-13) ----------------------------------------------------------
    # lambda_g: shrinkage of each relation estimate toward the global reference b_t (Eq. 3).
    lambda_g: float = Field(2.0, ge=0.0)
    # lambda_s: shrinkage of the task history toward the graph prior P (Eq. 4).
    lambda_s: float = Field(2.0, ge=0.0)
    # Weight of the within-environment relation in the graph prior P (Eq. 4); cross gets 1 - this.
    fusion_within: float = Field(0.5, ge=0.0, le=1.0)
    # How the two relation estimates form the graph prior P (Eq. 4).  "fixed" (paper): P = w G^in +
    # (1 - w) G^cross with w = fusion_within, each G shrunk to its reference by lambda_g on its own (Eq. 3),
    # so a relation without evidence still pulls P halfway to the reference.  "evidence": one pooled
    # Eq. 3 over both relations' neighbours, relation weights 2w and 2(1 - w) on the a_ij, so each
    # relation counts by its evidence mass and a relation without evidence does not dilute the other
    # (equals "fixed" when both carry the same mass).  estimate.graph_prior.
    fusion: Literal["fixed", "evidence"] = "fixed"
    # Reference of the cross-environment relation (Eq. 3).  "global" (paper): neighbours' y-bar_j as they
    # are, shrunk toward b_t.  "environment": cross-environment evidence is transferred as the neighbour's
    # deviation from its own environment's level, y-bar_j - e_env(j) + e_env(i), where e_env is Eq. 3 over
    # the environment's observed tasks (estimate.environment_reference); a structural twin in an easier
    # environment then says "easier than its environment", not "easy".  Shrinkage stays toward b_t.
    # "environment_mean": the same transfer for the mean m only (v and d keep "global"): the mean is monotone
    # in the policy's margin on a task, so an environment offset moves it additively, whereas the variance is
    # hump-shaped in that margin and a neighbour's variance does not move that way; the variance then reaches
    # the score through the reconstructed f = d m (1 - m) of Eq. 12 (see quantile_weight_v).
    cross_reference: Literal["global", "environment", "environment_mean"] = "global"
    # Weights of the two relations in Eq. 3 (beyond the paper; envsched/relations.py).  "paper": fixed (each
    # relation's evidence mass as it is).  "measured": per statistic v, m, d, each relation's mass is scaled by
    # c in relation_weight_grid, the pair (c_in, c_cross) whose predictions of the selected tasks ranked the
    # realised statistic best (Spearman, Fisher z, paired against the reference pair relation_weight_start,
    # decayed over steps), if it beats the reference at relation_weight_confidence standard errors; else the
    # reference.  c = 0 fades a relation to b_t (both faded = the "without both" ablation).
    relation_weights: Literal["paper", "measured"] = "measured"
    # The candidate weights of each relation; must hold 1.0 (the paper's).
    relation_weight_grid: tuple[float, ...] = (0.0, 0.125, 0.25, 0.5, 1.0)
    # Half-life in steps of the step weights 2^(-(t - s) / h) averaging the measured correlations (as Eq. 10).
    relation_weight_half_life: float = Field(16.0, gt=0.0)
    # kappa: a pair replaces the paper's (1, 1) only when its mean gain minus kappa standard errors is > 0.
    relation_weight_confidence: float = Field(2.0, ge=0.0)
    # A step counts only with at least this many observed groups.
    relation_weight_min_groups: int = Field(8, ge=4)
    # The pair in force until a measured pair beats it at relation_weight_confidence standard errors: "none"
    # (0, 0), every relation starts faded (the "without both" ablation) and earns its weight (needs 0.0 in
    # relation_weight_grid); "paper": (1, 1), a relation keeps the paper's weight until a smaller one ranks better.
    relation_weight_start: Literal["none", "paper"] = "none"
    # Which predictor scores the tasks (beyond the paper; envsched/predictor.py).  "paper": Eq. 3-13 (neighbour
    # averages of the realised v, m, d, fused with fixed shrinkage; relation_weights applies).  "additive_logit" (the
    # default, beyond the paper): a mixed model of each task's latent success logit (global level + environment
    # effect + a linear effect of the S_abs structure view + drift with the reward spread trained on + the task's
    # own deviation), fitted online by ridge regression (scikit-learn) on the empirical logits of every observed
    # group, scored by the posterior's expected Bernoulli variance; the relation weights, neighbour sums, Eq. 6 clip
    # intervals, lambda_g / lambda_s, h_long / h_short, quantile_weight_v and eta_decline are then unused.  It closed
    # 66 % / 58 % of the gap to the oracle's variance per group on the partial / binary learner at 51 x 400 and beat
    # the paper's predictor at 51 x 50 (docs/results/envsched_quality.md, issue 49).
    predictor: Literal["paper", "additive_logit"] = "additive_logit"
    # additive_logit: half-life in steps of the observations' weights 2^(-(t - s) / h) (as Eq. 10).  Long: on the
    # simulated learners difficulty moves little in 200 steps, and 1000 ranked better than 32 (issue 49).
    predictor_half_life: float = Field(1000.0, gt=0.0)
    # additive_logit: prior sd of the drift terms: the logit's change per unit of reward spread trained on so far in
    # the task's environment, on the task itself and over the pool (each scaled to 1 at its current total; 0: none).
    predictor_drift_sd: float = Field(2.0, ge=0.0)
    # additive_logit: prior sd of an environment's effect on the logit (ridge penalty 1 / sd^2; 0: no effect).
    predictor_env_sd: float = Field(1.5, ge=0.0)
    # additive_logit: prior sd of the coefficients of the (L2-normalised) S_abs features (0: no structure effect).
    predictor_structure_sd: float = Field(1.5, ge=0.0)
    # additive_logit: sd of a task's own deviation tau before predictor_min_tasks tasks are observed.
    predictor_task_sd: float = Field(1.0, gt=0.0)
    # additive_logit: floor of the moment estimate of tau (a fit with few tasks can drive it to 0).
    predictor_task_sd_floor: float = Field(0.1, gt=0.0)
    # additive_logit: observed tasks needed before tau is estimated from the residuals.
    predictor_min_tasks: int = Field(20, ge=2)
    # additive_logit: the score q.  "rank": q = pr(expected variance) (Eq. 8, as the paper's q).  "variance": q =
    # expected Bernoulli variance / 0.25 (its maximum), in [0, 1]: the exposure discount q * omega of the
    # exploitation phase then trades variance against exposure in variance units, not in ranks of the whole pool.
    predictor_score: Literal["rank", "variance"] = "variance"
    # additive_logit: Gauss-Hermite nodes of the expected variance over the logit's posterior.
    predictor_quadrature_nodes: int = Field(16, ge=1, le=100)
    # h_long: long half-life in training steps (Eq. 10, 13).
    h_long: float = Field(8.0, gt=0.0)
    # h_short: short half-life in training steps (Eq. 10, 13).
    h_short: float = Field(2.0, gt=0.0)
    # Clip interval I_v of the centred variance (Eq. 6); rewards on [0, 1] have variance <= 0.25.
    clip_v: tuple[float, float] = (0.0, 0.25)
    # Clip interval I_m of the centred mean (Eq. 6).
    clip_m: tuple[float, float] = (0.0, 1.0)
    # Clip interval I_d of the centred dispersion (Eq. 6).
    clip_d: tuple[float, float] = (0.0, 1.0)
    # Floor of the Bernoulli variance m(1-m) in the dispersion d = v / max(m(1-m), floor) (Eq. 9).
    dispersion_floor: float = Field(0.01, gt=0.0)
    # Weight of pr(v_hat) in the quantile mapping of Eq. 12; pr(f) gets 1 - this (paper: 0.65 / 0.35).
    quantile_weight_v: float = Field(0.65, ge=0.0, le=1.0)
    # Variance reconstructed from the predicted mean in Eq. 12.  "bernoulli" (paper): f = d m (1 - m).
    # "learnability" (beyond the paper): f = d (1 - m^K - (1 - m)^K), the probability that a binary group of
    # K = rollouts_per_task rollouts has non-zero spread (GRPO learns nothing from a group without spread).
    # Both are decreasing in |m - 1/2|; Eq. 12 uses f only through its percentile rank, so the two rank tasks
    # differently only through the factor d.  Off: on benchmarks/envsched_quality.py it ranked the learner's
    # expected variance slightly worse (Spearman 0.60 vs 0.61, binary learner).  estimate.reconstructed_variance.
    reconstructed_target: Literal["bernoulli", "learnability"] = "bernoulli"
    # eta_decline: penalty on a recent decline u_long - u_short (Eq. 13).
    eta_decline: float = Field(0.5, ge=0.0)

    # ---- scheduling (§2.4, App. C) -------------------------------------------------------------
    # c0: exposure-count scale of omega = (1 + c / c0)^(-1/2).
    exposure_c0: float = Field(16.0, gt=0.0)
    # lambda_sim: batch similarity penalty of Eq. 5.
    lambda_sim: float = Field(0.08, ge=0.0)
    # Eq. 5 over a tie of more than this many tasks with equal a_i (unobserved tasks share one prediction while the
    # relations are faded) compares the penalties of this many of them, the first eligible in a fixed hash order of
    # the task index (spread over environments), not all: a pick's cost stops growing with N. Smaller ties, and every
    # tie with null, get the exact arg-max (pools of up to 32,768 tasks always). Implementation choice.
    eq5_max_tied: int | None = Field(32768, ge=1)
    # C1: at most this many tasks of one environment per batch.
    cap_env_round: int = Field(4, ge=1)
    # C3: at most this many tasks of one environment over the current and two previous steps.
    cap_env_window: int = Field(11, ge=1)
    # Length of the rolling window of C3, in steps (paper: three).
    cap_env_window_steps: int = Field(3, ge=1)
    # C_task: a task may be selected in at most this many consecutive steps.
    cap_task_consecutive: int = Field(2, ge=1)
    # When the hard caps leave fewer than B candidates (tiny pools), relax them in the order
    # C_task -> C3 -> C1 and count the relaxation in the metrics instead of returning a short batch.
    # Implementation choice (the paper's pool never hits this).
    relax_caps_when_short: bool = True

    # ---- cold start (App. C) -------------------------------------------------------------------
    # "structural": one representative per environment by highest mean within-environment similarity,
    # then novelty; "random": uniform random batch (the robustness study of §3.4.2).
    cold_start: Literal["structural", "random"] = "structural"
    # At most this many tasks of one environment in the cold-start batch.
    cold_start_env_cap: int = Field(2, ge=1)
    # Weight of global (cross-structure, S_abs) novelty vs within-environment (S_full) novelty when
    # filling the cold-start batch; the paper says "combining" without weights.  Implementation choice.
    cold_start_global_weight: float = Field(0.5, ge=0.0, le=1.0)

    # ---- progress filter (App. C) ----------------------------------------------------------------
    # Enable the progress filter (exploitation eligibility only).
    progress_filter: bool = True
    # A task needs at least this many scorable transitions before it can be filtered.
    progress_min_transitions: int = Field(3, ge=1)
    # Ridge regularisation strength of the progress predictor (sklearn Ridge alpha); not in the paper.
    progress_ridge_alpha: float = Field(1.0, gt=0.0)
    # Minimum number of earlier-step transitions needed to fit the predictor; not in the paper.
    progress_min_fit_transitions: int = Field(8, ge=2)
    # Shrinkage of the task's mean residual toward the environment/neighbour reference
    # (est = (n * r_task + s * ref) / (n + s)); the paper says "combined" without a formula.
    progress_shrinkage: float = Field(2.0, ge=0.0)

    # ---- identifier filter (App. C) --------------------------------------------------------------
    # Enable the identifier filter (needs a replay callable and observed trajectories).
    identifier_filter: bool = True
    # Replayed reward must agree with the stored reward within this tolerance.
    replay_tolerance: float = Field(1e-4, gt=0.0)
    # Trajectories with reward >= this are "high-reward" and examined; not in the paper.
    identifier_min_reward: float = 0.5
    # At most this many trajectories per task and step are replayed (highest reward first).
    identifier_max_checks_per_task: int = Field(1, ge=1)

    @field_validator("llm", mode="before")
    @classmethod
    def _endpoint(cls, value: Any) -> Any:
        """The ``llm`` mapping's keys checked as the shared endpoint config checks them (an unknown or renamed key
        named), one URL string taken as a list of one as everywhere else; pydantic then checks the values' types and
        the dataclass its ranges."""
        if not isinstance(value, Mapping):
            return value
        LLMExtractorConfig.check_keys(value, where="llm")
        urls = value.get("base_urls")
        return {**value, "base_urls": [urls]} if isinstance(urls, str) else value

    @model_validator(mode="after")
    def _check(self) -> EnvSchedConfig:
        if self.operation_extractor == "llm" and self.llm is None:
            raise ValueError("operation_extractor: llm needs the llm endpoint (llm: {base_urls: [...], model: ...})")
        for name in ("clip_v", "clip_m", "clip_d", "neighbor_weight_clip", "reward_range"):
            lo, hi = getattr(self, name)
            if lo > hi:
                raise ValueError(f"{name}: lower bound {lo} exceeds upper bound {hi}")
        if 1.0 not in self.relation_weight_grid or any(not 0.0 <= c <= 1.0 for c in self.relation_weight_grid):
            raise ValueError("relation_weight_grid must lie in [0, 1] and hold 1.0 (the paper's weight)")
        if self.relation_weight_start == "none" and 0.0 not in self.relation_weight_grid:
            raise ValueError("relation_weight_start: none needs 0.0 in relation_weight_grid")
        if any(w < 0 for w in self.view_weights) or sum(self.view_weights) <= 0:
            raise ValueError("view_weights must be non-negative with a positive sum")
        return self

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any] | None = None, **overrides: Any) -> EnvSchedConfig:
        """Build a config; unknown or invalid keys raise ConfigError naming the key."""
        merged = dict(data or {})
        merged.update(overrides)
        try:
            return cls.model_validate(merged)
        except ValidationError as exc:
            raise ConfigError(_explain(exc)) from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> EnvSchedConfig:
        """Load a YAML mapping (optionally nested under a top-level ``envsched:`` key)."""
        import yaml

        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping at top level, got {type(data).__name__}")
        if set(data) == {"envsched"}:
            data = data["envsched"] or {}
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def replace(self, **changes: Any) -> EnvSchedConfig:
        """A copy with some fields changed (validated like from_dict)."""
        return self.from_dict({**self.to_dict(), **changes})


def _explain(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "<root>"
        if err["type"] == "extra_forbidden":
            parts.append(f"unknown config key '{key}'")
        else:
            parts.append(f"config key '{key}': {err['msg']} (got {err.get('input')!r})")
    return "; ".join(parts)
