"""Typed schema of envace's own config keys (the ``envace:`` group of the Hydra config).

verl validates its own keys; these dataclasses validate ours. :func:`validate_envace_config`
merges the composed config onto the schema, so a typo (``envace.data.pool=...``) or a wrong type
fails before anything heavy starts, with the offending key's full name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

__all__ = ["EnvAceConfig", "DataConfig", "AgentConfig", "ConfigError", "validate_envace_config"]


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
    # where built parquet files go (null: $ENVACE_CACHE/data/<content hash>)
    out_dir: str | None = None


@dataclass
class AgentConfig:
    # assistant generations allowed within one user turn (tool call rounds + final answer)
    max_steps_per_turn: int = 4
    # user turns an episode may run (BFCL tasks have up to 8)
    max_user_turns: int = 8
    # tool calls executed from one assistant message (extra calls get an error observation)
    max_calls_per_step: int = 4
    # observation text longer than this many characters is truncated in the middle
    max_observation_chars: int = 2000
    # keyword arguments passed to the environment pool constructor, per pool name
    pool_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class EnvAceConfig:
    # training rows: which environment pools and splits
    data: DataConfig = field(default_factory=DataConfig)
    # multi-turn environment agent loop (`envace_env`)
    agent: AgentConfig = field(default_factory=AgentConfig)
    # run the pre-flight checks (GPU presence, Ray resources, model path) before launching
    preflight: bool = True


def validate_envace_config(cfg: DictConfig) -> EnvAceConfig:
    """Check ``cfg.envace`` against :class:`EnvAceConfig`; return the typed object.

    Raises :class:`ConfigError` naming the bad key.
    """
    raw = cfg.get("envace") if isinstance(cfg, DictConfig) else None
    if raw is None:
        raise ConfigError("config has no 'envace' group; compose configs/envace_trainer.yaml")
    schema = OmegaConf.structured(EnvAceConfig)
    try:
        merged = OmegaConf.merge(schema, raw)
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or ""
        raise ConfigError(f"invalid envace config key 'envace.{key}': {exc.msg if hasattr(exc, 'msg') else exc}") from exc
