"""The training config verl reads: composed from ``configs/envace_trainer.yaml`` and checked by verl itself.

:func:`compose` builds the config exactly as ``scripts/train.sh`` does (verl's ``ppo_trainer`` defaults plus
envace's groups; no side effects). :func:`validate_verl_config` runs verl's own checks on it before any Ray work:
``validate_config`` and the typed dataclasses verl would otherwise build only inside its workers.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from envace.config import ConfigError

__all__ = ["CONFIG_DIR", "CONFIG_NAME", "VERL_TYPED_SECTIONS", "compose", "validate_verl_config"]

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
CONFIG_NAME = "envace_trainer"

#: the sections verl turns into its typed dataclasses inside its workers (``omega_conf_to_dataclass``)
VERL_TYPED_SECTIONS = ("actor_rollout_ref.rollout", "actor_rollout_ref.rollout.checkpoint_engine",
                       "actor_rollout_ref.model", "algorithm")


def compose(overrides: list[str] | None = None, config_name: str = CONFIG_NAME) -> DictConfig:
    """Compose the training config exactly as ``scripts/train.sh`` does (no side effects)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return hydra_compose(config_name=config_name, overrides=list(overrides or []))


def validate_verl_config(cfg: DictConfig) -> None:
    """verl's own validation, before any Ray work: ``validate_config`` (batch sizes, the actor's dataclass)
    and the typed dataclasses verl builds later inside its workers (rollout, model, algorithm; critic when
    used), whose ``__post_init__`` checks would otherwise fail only after the cluster is up."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    sections = list(VERL_TYPED_SECTIONS)
    try:
        use_critic = need_critic(cfg)
        if use_critic:
            sections.append("critic")
        validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=use_critic)
        for key in sections:
            node = OmegaConf.select(cfg, key)
            if node is not None:
                omega_conf_to_dataclass(node)
    except (AssertionError, ValueError, TypeError, OmegaConfBaseException, HydraException) as exc:
        cause = exc.__cause__ if isinstance(exc, (OmegaConfBaseException, HydraException)) and exc.__cause__ else exc
        raise ConfigError(f"verl rejects the config: {type(cause).__name__}: {cause}") from exc
