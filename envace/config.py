"""Typed schema of envace's own config keys (the ``envace:`` group of the Hydra config), and of the verl keys
envace reads or verl uses unchecked.

These dataclasses validate ours. :func:`validate_envace_config` merges the composed config onto the schema, so a
typo (``envace.data.pool=...``) or a wrong type fails before anything heavy starts, with the offending key's full
name. verl checks some of its keys only inside its workers, or not at all (a step count of ``abc`` or a batch size
of 0 would end in a traceback once the data and the model are built); :func:`validate_verl_keys` checks those keys'
types and ranges (:class:`VerlKeys`) the same way, before anything is built.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from envace.loop_config import LoopLimits, RehearsalPrompt, TTSConfig, prompt_text
from envace.rewards.checklist import ChecklistJudgeConfig
from envace.roles import Role
from envllm import RENAMED_KEYS, EndpointConfig

if TYPE_CHECKING:
    from envsched import EnvSchedConfig

__all__ = [
    "ENVSCHED_TRAINER_KEYS",
    "AdvantageConfig",
    "AgentConfig",
    "ConfigError",
    "DataConfig",
    "EnvAceConfig",
    "RewardConfig",
    "VerlKeys",
    "agent_config_from",
    "envace_config_from",
    "envsched_config_from",
    "prompt_versions",
    "record_prompt_versions",
    "tts_config_from",
    "validate_envace_config",
    "validate_verl_keys",
]


class ConfigError(ValueError):
    """An invalid envace configuration, reported before any work starts."""


@dataclass
class DataConfig:
    # environment pools whose tasks become training rows (see `python -m envace.envs list`)
    pools: list[str] = field(default_factory=lambda: ["bfcl_multi_turn"])
    # pool split used for training rows
    train_split: str = "train"
    # pool split used for validation rows (disjoint tasks)
    val_split: str = "test"
    # cap on tasks per pool and split, spread over categories (null: all)
    max_tasks_per_pool: int | None = None
    # seed of the deterministic task order used by the cap
    seed: int = 0
    # training tasks by id (every pool; null: the whole train split, capped by max_tasks_per_pool); an id no pool's
    # train split holds is an error. Validation keeps val_split. E.g. tasks chosen inside a learnable band
    train_task_ids: list[str] | None = None
    # task categories kept in both splits (a task's TaskSpec.category: a synthetic task's shape, a BFCL category;
    # null: all), before max_tasks_per_pool; explicit train_task_ids are kept as given
    categories: list[str] | None = None
    # where built parquet files go (null: $ENVACE_CACHE/data/<content hash>, or with trainer.nnodes > 1 the run
    # directory's data/<content hash>: envace.train.generated_dir); a folder holding a build of another recipe (its
    # recipe.json) is an error, never silently reused
    out_dir: str | None = None

    def __post_init__(self) -> None:
        if not self.pools:
            raise ValueError("envace.data.pools is empty: name at least one pool (`python -m envace.envs list`)")
        _at_least("envace.data.max_tasks_per_pool", self.max_tasks_per_pool, 1)


@dataclass
class AgentConfig:
    # who answers the agent's tool calls in training rollouts: real (the environment; standard GRPO),
    # rehearse (the policy itself, EnvACE), simulator (an external LLM, `simulator` below)
    observation_source: str = "real"
    # who answers them in validation rollouts (real: validation success is measured in the real environment)
    val_observation_source: str = "real"
    # training samples: message (one output per generation, EnvACE) or trajectory (all acting messages in one)
    act_layout: str = "message"
    # turn, step and call limits and the malformed-call / malformed-rehearsal policies (shared with evaluation)
    limits: LoopLimits = field(default_factory=LoopLimits)
    # tokens one acting message may generate (null: whatever is left of data.max_response_length)
    act_max_tokens: int | None = None
    # tokens one rehearsal (tool response written by the policy) may generate
    rehearse_max_tokens: int = 256
    # sampling temperature of the rehearse role (null: the rollout temperature)
    rehearse_temperature: float | None = None
    # seed every generation by its rollout and its index in it (envace.agents.verl_loop.request_seed), so runs of one
    # seed draw alike; false: the rollout server's own seeding (on GPUs vLLM then keeps FlashInfer's top-k/top-p
    # sampler, which takes no per-request seed)
    seed_requests: bool = True
    # how the rehearsal prompt is built (history budget, real examples, schemas)
    rehearsal: RehearsalPrompt = field(default_factory=RehearsalPrompt)
    # version of the note that hands the policy tools added mid-episode (BFCL miss_func) in training rollouts, the file
    # envace/prompts/tools_added_<version>.txt (an OpenAI endpoint re-renders its system prompt instead)
    tools_added_version: str = "v1"
    # seconds one environment call or verification may take before the rollout is masked (unscored)
    env_timeout_s: float = 60.0
    # external simulator endpoint (observation_source=simulator; envllm.EndpointConfig keys, e.g.
    # {base_urls: [http://10.0.0.5:8000/v1], model: Qwen3-32B}); with a worldbook it drives the Trace2Env
    # world-model agent for steps no rule or evidence covers. null: none
    simulator: EndpointConfig | None = None
    # Trace2Env worldbook (observation_source=simulator, or the simulated_envs below): one package, or a directory
    # of packages matched by environment id (scripts/build_worldbook.sh); auto: one book per simulated environment,
    # built model-free from gold traces of its train-split tasks and cached under $ENVACE_CACHE/worldbooks, or with
    # trainer.nnodes > 1 the run directory's worldbooks/ (envace.data.worldbooks); null: the external LLM alone
    # writes tool responses
    worldbook: str | None = None
    # environments (env ids of the training pools, or fnmatch patterns such as syn-bank-*) whose training
    # rollouts Trace2Env's simulator answers over `worldbook` (the envace_simulator loop; reward from the real
    # environment's shadow replay); the others keep observation_source. Each entry must match a training
    # environment, and each matched environment needs a book. null: every environment uses observation_source
    simulated_envs: list[str] | None = None
    # keyword arguments passed to the environment pool constructor, per pool name
    pool_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _choice("agent.observation_source", self.observation_source, SOURCES)
        _choice("agent.val_observation_source", self.val_observation_source, SOURCES)
        _choice("agent.act_layout", self.act_layout, ("message", "trajectory"))
        if self.act_max_tokens is not None and self.act_max_tokens < 1:
            raise ValueError(f"envace.agent.act_max_tokens must be >= 1 or null, got {self.act_max_tokens}")
        if self.rehearse_max_tokens < 1:
            raise ValueError(f"envace.agent.rehearse_max_tokens must be >= 1, got {self.rehearse_max_tokens}")
        if self.env_timeout_s <= 0:
            raise ValueError(f"envace.agent.env_timeout_s must be > 0, got {self.env_timeout_s}")
        try:
            prompt_text("tools_added", self.tools_added_version)
        except ValueError as exc:
            version = self.tools_added_version
            raise ValueError(f"envace.agent.tools_added_version {version!r} has no file: {exc}") from None
        if self.worldbook is not None:
            if self.worldbook != AUTO and not Path(self.worldbook).exists():
                raise ValueError(f"envace.agent.worldbook {self.worldbook!r} does not exist "
                                 "(build one with scripts/build_worldbook.sh, or set it to auto)")
            sim = "simulator" in (self.observation_source, self.val_observation_source)
            if not sim and not self.simulated_envs and self.worldbook != AUTO:
                raise ValueError("envace.agent.worldbook is set but no observation source is 'simulator' "
                                 "and envace.agent.simulated_envs is empty")
        if self.simulated_envs is not None:
            envs = list(self.simulated_envs)
            if not envs:
                raise ValueError("envace.agent.simulated_envs is empty (null: no environment is simulated)")
            if any(not isinstance(e, str) or not e.strip() for e in envs):
                raise ValueError(f"envace.agent.simulated_envs entries must be non-empty env ids, got {envs}")
            dup = sorted({e for e in envs if envs.count(e) > 1})
            if dup:
                raise ValueError(f"envace.agent.simulated_envs lists {', '.join(dup)} twice")
            if self.worldbook is None:
                raise ValueError("envace.agent.simulated_envs needs envace.agent.worldbook (a folder of books, "
                                 "or auto to build them from the environments' recorded traces)")
            if self.observation_source == "simulator":
                raise ValueError("envace.agent.simulated_envs picks the environments the simulator serves, but "
                                 "observation_source=simulator already serves every environment; set "
                                 "observation_source to real or rehearse for the others")
        elif self.worldbook == AUTO and "simulator" not in (self.observation_source, self.val_observation_source):
            raise ValueError("envace.agent.worldbook=auto builds books for simulated environments: set "
                             "envace.agent.simulated_envs or observation_source=simulator")


SOURCES = ("real", "rehearse", "simulator")
#: ``envace.agent.worldbook`` value that builds the books from recorded traces (envace.data.worldbooks)
AUTO = "auto"


def _choice(name: str, value: str, allowed: tuple[str, ...], prefix: str = "envace.") -> None:
    if value not in allowed:
        raise ValueError(f"{prefix}{name} must be one of {list(allowed)}, got {value!r}")


def _at_least(name: str, value: float | None, low: float) -> None:
    """``value`` (None: unset, allowed) is a finite number >= ``low``; else a ValueError naming the key."""
    if value is not None and not (math.isfinite(value) and value >= low):
        raise ValueError(f"{name} must be >= {low:g}, got {value}")


@dataclass
class AdvantageConfig:
    # role-wise GRPO options (algorithm.adv_estimator=grpo_rolewise; EnvACE §4.2, envace/advantage.py)
    # baseline over outputs of the role (output: the paper, row-weighted) or over trajectories (trajectory)
    baseline: str = "output"
    # divide by the same-role std (+ epsilon); the EnvACE reference trains without it
    norm_by_std: bool = False
    # added to the std before dividing
    epsilon: float = 1.0e-6
    # a (prompt, role) group with a single member: zero advantage, or verl's raw score
    singleton: str = "zero"
    # subtracted from the reward of an output that decoded to empty text
    empty_penalty: float = 0.0
    # roles whose outputs carry a policy-gradient loss (null: both); [act] is the ablation "EnvACE without the
    # rehearse role's loss": rehearsals still write the observations, but are not trained
    trained_roles: list[str] | None = None

    def __post_init__(self) -> None:
        _choice("advantage.baseline", self.baseline, ("output", "trajectory"))
        _choice("advantage.singleton", self.singleton, ("zero", "raw"))
        for role in self.trained_roles or ():
            _choice("advantage.trained_roles", role, tuple(r.value for r in Role))
        if self.epsilon < 0:
            raise ValueError(f"envace.advantage.epsilon must be >= 0, got {self.epsilon}")


@dataclass
class RewardConfig:
    # weight of the environment verifier's reward (tasks with an executable environment)
    verifiable_weight: float = 1.0
    # weight of the checklist judge's reward (rows whose reward_model.style is "checklist", e.g. CM2)
    checklist_weight: float = 1.0
    # judge endpoint for checklist rows (envllm.EndpointConfig keys, e.g.
    # {base_urls: [http://10.0.0.9:8000/v1], model: Qwen3-30B-A3B, concurrency: 500}); null: none
    judge: EndpointConfig | None = None
    # how the judge prompts and aggregates (envace.rewards.checklist.ChecklistJudgeConfig)
    checklist: ChecklistJudgeConfig = field(default_factory=ChecklistJudgeConfig)

    def __post_init__(self) -> None:
        if self.verifiable_weight < 0 or self.checklist_weight < 0:
            raise ValueError("envace.reward weights must be >= 0")
        _judge_settings_named_once(self.checklist)


def _judge_settings_named_once(checklist: ChecklistJudgeConfig) -> None:
    """A judge request's settings have one name here, the judge endpoint's key (``envace.reward.judge.*``).

    ``ChecklistJudgeConfig`` can also set them per call (``use_json_schema``, and endpoint fields such as
    ``temperature`` in ``sampling``), which would override the endpoint's value without a word: refused, naming the
    key to set instead. ``sampling`` keeps the request fields the endpoint has no key for (e.g. ``stop``)."""
    if checklist.use_json_schema is not None:
        raise ValueError(f"envace.reward.checklist.use_json_schema={checklist.use_json_schema} would override "
                         "envace.reward.judge.use_json_schema: set that key (one name) and leave this one null")
    clash = sorted(set(checklist.sampling) & {f.name for f in fields(EndpointConfig)})
    if clash:
        raise ValueError(f"envace.reward.checklist.sampling.{clash[0]} would override envace.reward.judge.{clash[0]}: "
                         "set that key (one name)")


@dataclass
class ValidationConfig:
    # after the validation verl runs (rollout.val_kwargs: its temperature and samples per task), a second, greedy
    # pass over the same held-out tasks, one sample each (val-core/greedy/... and val-core/heldout_greedy/...)
    greedy: bool = False


@dataclass
class LossConfig:
    # weight of an auxiliary loss beside verl's policy loss: the negative log-likelihood of the real environment's
    # observation tokens in each training sample (ECHO, arXiv 2605.24517; envace/verl/observation_loss.py); 0: off.
    # Only agent.observation_source=real with agent.act_layout=trajectory puts observation tokens in a sample
    observation_nll_coef: float = 0.0

    def __post_init__(self) -> None:
        _at_least("envace.loss.observation_nll_coef", self.observation_nll_coef, 0)


@dataclass
class EnvAceConfig:
    # training rows: which environment pools and splits
    data: DataConfig = field(default_factory=DataConfig)
    # multi-turn agent loops (`envace_env`, `envace_act_rehearse`, `envace_simulator`)
    agent: AgentConfig = field(default_factory=AgentConfig)
    # role-wise GRPO options
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    # reward components and their mix (verifiable replay, checklist judge)
    reward: RewardConfig = field(default_factory=RewardConfig)
    # held-out validation beyond verl's own (envace.verl.trainer.HeldoutValidation)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    # auxiliary loss terms beside verl's policy loss (envace/verl/observation_loss.py)
    loss: LossConfig = field(default_factory=LossConfig)
    # test-time rehearsal (EnvACE §4.3): the settings `python -m envace.eval --tts ...` runs with, one flag per field
    # (envace.loop_config.TTSConfig, the one source of their defaults); training rollouts do not rehearse at test time
    tts: TTSConfig = field(default_factory=TTSConfig)
    # run the pre-flight checks (GPU presence, Ray resources, model path) before launching
    preflight: bool = True
    # seconds between the sync trainer's checks that a step's rollouts are done (verl's replay buffer polls every
    # 2 s, which rounds each generation phase up to a multiple of 2 s: about a second per step on CPU)
    replay_poll_s: float = 0.25

    def __post_init__(self) -> None:
        if not self.replay_poll_s > 0:
            raise ValueError(f"envace.replay_poll_s must be > 0, got {self.replay_poll_s}")
        _observation_tokens_exist(self.loss, self.agent)


def _observation_tokens_exist(loss: LossConfig, agent: AgentConfig) -> None:
    """The observation loss needs samples that hold the real environment's observation tokens: the real source's
    rollouts in the trajectory layout (the message layout's samples hold only generated tokens, and a rehearsed or
    simulated observation is not the real environment's)."""
    coef = loss.observation_nll_coef
    got = {"observation_source": agent.observation_source, "act_layout": agent.act_layout}
    if not coef or (got == {"observation_source": "real", "act_layout": "trajectory"} and not agent.simulated_envs):
        return
    setting = ", ".join(f"{k}={v}" for k, v in got.items()) + (", simulated_envs set" if agent.simulated_envs else "")
    raise ValueError(f"envace.loss.observation_nll_coef={coef:g} trains on the real environment's observation tokens, "
                     "which only envace.agent.observation_source=real with envace.agent.act_layout=trajectory and no "
                     f"envace.agent.simulated_envs puts in a training sample (got {setting})")


# -- verl's keys: those envace reads, and those verl uses unchecked until its workers run ------------------------
@dataclass
class VerlSamplerKeys:
    # versions a trajectory may span in the async trainers' replay buffer (null: no bound); verl asserts an
    # integer >= 1 only when the trainer builds its buffer, inside Ray
    max_off_policy_threshold: int | None = 8
    # drop (evict stale groups and regenerate them) or wait (hold sampling until stale prompts finish)
    max_off_policy_strategy: str = "drop"

    def __post_init__(self) -> None:
        _at_least("trainer.v1.sampler.max_off_policy_threshold", self.max_off_policy_threshold, 1)
        _choice("max_off_policy_strategy", self.max_off_policy_strategy, ("drop", "wait"),
                prefix="trainer.v1.sampler.")


@dataclass
class VerlColocateAsyncKeys:
    # training batches dispatched before the first step (fractions allowed: verl's _add_async_warmup_batches)
    num_warmup_batches: float = 1

    def __post_init__(self) -> None:
        _at_least("trainer.v1.colocate_async.num_warmup_batches", self.num_warmup_batches, 0)


@dataclass
class VerlSeparateAsyncKeys:
    # training batches dispatched before the first step
    num_warmup_batches: float = 1
    # mini-batch updates between two weight syncs to the standalone rollout
    parameter_sync_step: int = 4

    def __post_init__(self) -> None:
        _at_least("trainer.v1.separate_async.num_warmup_batches", self.num_warmup_batches, 0)
        _at_least("trainer.v1.separate_async.parameter_sync_step", self.parameter_sync_step, 1)


@dataclass
class VerlV1Keys:
    # the V1 trainer, a name of verl's trainer registry (resolved by envace.verl.config.check_registries)
    trainer_mode: str = "envace_sync"
    # the async trainers' replay buffer and the two async kinds (envace.train.check_async_trainer)
    sampler: VerlSamplerKeys = field(default_factory=VerlSamplerKeys)
    colocate_async: VerlColocateAsyncKeys = field(default_factory=VerlColocateAsyncKeys)
    separate_async: VerlSeparateAsyncKeys = field(default_factory=VerlSeparateAsyncKeys)


@dataclass
class VerlTrainerKeys:
    # steps to train (null: verl's epochs decide)
    total_training_steps: int | None = None
    # auto (the epochs total_training_steps needs: envace.train.fit_total_epochs) or a number of epochs (verl's
    # default here; configs/envace_trainer.yaml sets auto)
    total_epochs: Any = 30
    # nodes and device slots per node
    nnodes: int = 1
    n_gpus_per_node: int = 1
    # the device verl trains on
    device: str = "cuda"
    # checkpoint and validation period in steps (verl: <= 0 never)
    save_freq: int = -1
    test_freq: int = -1
    # auto (the newest complete checkpoint), disable, or resume_path (trainer.resume_from_path)
    resume_mode: str = "auto"
    # verl's V1 trainer (trainer.v1.trainer_mode) or its V0 one
    use_v1: bool = True
    # validate before the first step
    val_before_train: bool = True
    v1: VerlV1Keys = field(default_factory=VerlV1Keys)

    def __post_init__(self) -> None:
        _at_least("trainer.total_training_steps", self.total_training_steps, 1)
        epochs = self.total_epochs
        if epochs not in (None, "auto") and (isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1):
            raise ValueError(f"trainer.total_epochs must be auto or an integer >= 1, got {epochs!r}")
        if epochs in (None, "auto") and self.total_training_steps is None:
            raise ValueError("trainer.total_epochs=auto needs trainer.total_training_steps (or set an epoch count)")
        _at_least("trainer.nnodes", self.nnodes, 1)
        _at_least("trainer.n_gpus_per_node", self.n_gpus_per_node, 1)
        _choice("device", self.device, ("cuda", "npu", "cpu"), prefix="trainer.")
        _choice("resume_mode", self.resume_mode, ("auto", "disable", "resume_path"), prefix="trainer.")


@dataclass
class VerlDataKeys:
    # prompts per training step
    train_batch_size: int = 8
    # token budgets of a prompt and of one rollout's whole response
    max_prompt_length: int = 1024
    max_response_length: int = 1024
    # caps on the rows read (-1: all)
    train_max_samples: int = -1
    val_max_samples: int = -1
    # drop prompts longer than max_prompt_length; shuffle the training rows
    filter_overlong_prompts: bool = True
    shuffle: bool = True

    def __post_init__(self) -> None:
        for key in ("train_batch_size", "max_prompt_length", "max_response_length"):
            _at_least(f"data.{key}", getattr(self, key), 1)


@dataclass
class VerlOptimKeys:
    # the actor's learning rate
    lr: float = 1.0e-6

    def __post_init__(self) -> None:
        _at_least("actor_rollout_ref.actor.optim.lr", self.lr, 0)


@dataclass
class VerlActorKeys:
    # prompts per PPO mini-batch (verl checks it against data.train_batch_size), and passes over each batch
    ppo_mini_batch_size: int = 4
    ppo_epochs: int = 1
    optim: VerlOptimKeys = field(default_factory=VerlOptimKeys)

    def __post_init__(self) -> None:
        _at_least("actor_rollout_ref.actor.ppo_mini_batch_size", self.ppo_mini_batch_size, 1)
        _at_least("actor_rollout_ref.actor.ppo_epochs", self.ppo_epochs, 1)


@dataclass
class VerlRolloutKeys:
    # the rollout engine and its mode, a pair of verl's rollout registry (resolved by envace.verl.config.check_registries)
    name: str = "hfcpu"
    mode: str = "async"
    # rollouts per prompt (the GRPO group) and their sampling temperature
    n: int = 4
    temperature: float = 1.0

    def __post_init__(self) -> None:
        _at_least("actor_rollout_ref.rollout.n", self.n, 1)
        _at_least("actor_rollout_ref.rollout.temperature", self.temperature, 0)


@dataclass
class VerlActorRolloutRefKeys:
    actor: VerlActorKeys = field(default_factory=VerlActorKeys)
    rollout: VerlRolloutKeys = field(default_factory=VerlRolloutKeys)


@dataclass
class VerlKeys:
    """The verl keys :func:`validate_verl_keys` types and ranges (a subset of verl's ``ppo_trainer``; verl's own
    ``validate_config`` and dataclasses check the rest, and the cross-key batch sizes)."""

    trainer: VerlTrainerKeys = field(default_factory=VerlTrainerKeys)
    data: VerlDataKeys = field(default_factory=VerlDataKeys)
    actor_rollout_ref: VerlActorRolloutRefKeys = field(default_factory=VerlActorRolloutRefKeys)


def _typed(schema: type, raw: Any, prefix: str, what: str) -> Any:
    """``raw`` merged onto the dataclass ``schema`` and built (its ``__post_init__`` checks run); a bad key, type or
    value is a :class:`ConfigError` naming the key (``prefix`` + its path in ``schema``)."""
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), raw))
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or ""
        msg = str(exc.msg if hasattr(exc, "msg") else exc).splitlines()[0]
        last = key.rsplit(".", 1)[-1]
        if last in RENAMED_KEYS:  # an endpoint key of the configs the shared one replaced
            msg = f"endpoint key {last!r} was renamed {RENAMED_KEYS[last]!r}"
        raise ConfigError(f"invalid {what} key '{prefix}{key}': {msg}") from exc
    except (ValueError, TypeError) as exc:  # a dataclass's own checks (e.g. LoopLimits, an endpoint's values)
        raise ConfigError(f"invalid {what}: {str(exc).splitlines()[0]}") from exc


def validate_envace_config(cfg: DictConfig) -> EnvAceConfig:
    """Check ``cfg.envace`` against :class:`EnvAceConfig`; return the typed object.

    Raises :class:`ConfigError` naming the bad key.
    """
    raw = cfg.get("envace") if isinstance(cfg, DictConfig) else None
    if raw is None:
        raise ConfigError("config has no 'envace' group; compose configs/envace_trainer.yaml")
    return _typed(EnvAceConfig, raw, "envace.", "envace config")


_ABSENT = object()


def _values_at(cfg: DictConfig, schema: DictConfig, prefix: str = "") -> dict[str, Any]:
    """``cfg``'s values at the keys of ``schema``, nested like it (keys ``cfg`` lacks are left out)."""
    out: dict[str, Any] = {}
    for key in schema:
        path = f"{prefix}{key}"
        if isinstance(schema[key], DictConfig):
            out[key] = _values_at(cfg, schema[key], f"{path}.")
            continue
        value = OmegaConf.select(cfg, path, default=_ABSENT)
        if value is not _ABSENT:
            out[key] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    return out


def validate_verl_keys(cfg: DictConfig) -> VerlKeys:
    """Check the verl keys of :class:`VerlKeys` in ``cfg`` (types, ranges, choices); return them typed.

    Raises :class:`ConfigError` naming the bad key.
    """
    return _typed(VerlKeys, _values_at(cfg, OmegaConf.structured(VerlKeys)), "", "config")


#: the envsched keys that are a setting of verl's trainer, each with the trainer key that holds it: EnvSched's batch B is
#: the prompts of a training step, its K the rollouts of each prompt (EnvSched §3.1). configs/envace_trainer.yaml sets
#: each to an interpolation of its trainer key, so the trainer's key is the one name of the setting in training; the
#: envsched library keeps the fields for use without verl (its own benchmarks set them)
ENVSCHED_TRAINER_KEYS = {"batch_size": "data.train_batch_size", "rollouts_per_task": "actor_rollout_ref.rollout.n"}


def envsched_config_from(cfg: Any) -> EnvSchedConfig:
    """The typed ``envsched`` group of a composed trainer config (an ``envsched.EnvSchedConfig``: unknown keys and bad
    values fail), whose fields of :data:`ENVSCHED_TRAINER_KEYS` equal their trainer keys.

    A value the user set on ``envsched.batch_size`` that differs from ``data.train_batch_size`` would otherwise size
    the scheduler's batches apart from verl's step (or a K apart from the group observe() checks): refused, naming
    both keys and both values. Raises :class:`ConfigError`.
    """
    from envsched import EnvSchedConfig  # the scheduler's dependencies load only where EnvSched is configured
    from envsched.config import ConfigError as SchedConfigError

    raw = cfg.get("envsched") or {}
    try:
        typed = EnvSchedConfig.from_dict(OmegaConf.to_container(raw, resolve=True) if OmegaConf.is_config(raw) else raw)
    except SchedConfigError as exc:
        raise ConfigError(f"envsched: {exc}") from None
    for field_name, trainer_key in ENVSCHED_TRAINER_KEYS.items():
        mine, theirs = getattr(typed, field_name), OmegaConf.select(cfg, trainer_key)
        if theirs is not None and mine != int(theirs):
            raise ConfigError(
                f"envsched.{field_name}={mine} differs from {trainer_key}={theirs}: one setting with two values; set "
                f"{trainer_key} and leave envsched.{field_name} at its interpolation ${{{trainer_key}}}"
            )
    return typed


def tts_config_from(cfg: Any, where: str = "config") -> TTSConfig:
    """The typed ``envace.tts`` of a config mapping (a composed config, or an experiment file's ``envace: {tts: ...}``;
    absent: the defaults). A bad key or value is a :class:`ConfigError` naming ``envace.tts.<key>`` and ``where``."""
    raw = OmegaConf.select(cfg if OmegaConf.is_config(cfg) else OmegaConf.create(cfg), "envace.tts", default=None)
    return _typed(TTSConfig, raw if raw is not None else {}, "envace.tts.", where)


def prompt_versions(ecfg: EnvAceConfig) -> dict[str, str]:
    """The versions of the prompt files a training run with ``ecfg`` uses, by prompt: those the policy reads (the
    rehearsal prompt of its REHEARSE role, ``envace.agent.rehearsal.version``; the mid-episode tool announcement,
    ``envace.agent.tools_added_version``) and the checklist judge's (``envace.reward.checklist.prompt_version``)."""
    return {"rehearsal": ecfg.agent.rehearsal.version, "tools_added": ecfg.agent.tools_added_version,
            "checklist_judge": ecfg.reward.checklist.prompt_version}


#: the run directory's record of the prompt versions, one line per launch (a resumed run adds one)
PROMPT_VERSIONS_FILE = "prompt_versions.jsonl"


def record_prompt_versions(run_dir: str | os.PathLike[str], ecfg: EnvAceConfig) -> Path:
    """Append this launch's :func:`prompt_versions` to ``run_dir/prompt_versions.jsonl`` (``{"time": ..., "prompts":
    {...}}``): what the run's rollouts were prompted with, next to its checkpoints; a resume with other versions shows
    as a second line."""
    path = Path(run_dir) / PROMPT_VERSIONS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    line = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "prompts": prompt_versions(ecfg)}
    with path.open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(line, sort_keys=True) + "\n")
    return path


_CACHE: dict[int, tuple[Any, EnvAceConfig]] = {}


def envace_config_from(cfg: Any) -> EnvAceConfig:
    """The typed ``envace`` group of a composed trainer config (as verl hands it to agent loops).

    Cached per config object: verl builds one agent-loop instance per rollout from the same config.
    """
    hit = _CACHE.get(id(cfg))
    if hit is not None and hit[0] is cfg:
        return hit[1]
    typed = validate_envace_config(cfg)
    _CACHE[id(cfg)] = (cfg, typed)
    return typed


def agent_config_from(cfg: Any) -> AgentConfig:
    """The typed ``envace.agent`` of a composed trainer config."""
    return envace_config_from(cfg).agent
