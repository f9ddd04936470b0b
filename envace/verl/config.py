"""The training config verl reads: composed from ``configs/envace_trainer.yaml`` and checked by verl itself.

:func:`compose` builds the config exactly as ``scripts/train.sh`` does (verl's ``ppo_trainer`` defaults plus
envace's groups; no side effects). :func:`validate_verl_config` runs verl's own checks on it before any Ray work:
``validate_config`` and the typed dataclasses verl would otherwise build only inside its workers.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from envace.config import ConfigError

__all__ = ["CONFIG_DIR", "CONFIG_NAME", "VERL_TYPED_SECTIONS", "check_registries", "compose", "validate_verl_config"]

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


def validate_verl_config(cfg: DictConfig, model: bool = True) -> None:
    """verl's own validation, before any Ray work: ``validate_config`` (batch sizes, e.g. ``actor.ppo_mini_batch_size``
    against ``data.train_batch_size``; the actor's dataclass) and the typed dataclasses verl builds later inside its
    workers (rollout, model, algorithm; critic when used), whose ``__post_init__`` checks would otherwise fail only
    after the cluster is up. ``model=False`` leaves out the model's section, which loads the model's files (pre-flight
    runs before the model is built), and verl's notes and warnings ("Disabled critic"), so that a refusal there is
    one line; the launch runs it again with the model once it is built."""
    import contextlib
    import io
    import warnings

    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    sections = [s for s in VERL_TYPED_SECTIONS if model or s != "actor_rollout_ref.model"]
    quiet = contextlib.nullcontext() if model else contextlib.redirect_stdout(io.StringIO())
    try:
        with quiet, warnings.catch_warnings():
            if not model:
                warnings.simplefilter("ignore")
            use_critic = need_critic(cfg)
            validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=use_critic)
            for key in sections + (["critic"] if use_critic else []):
                node = OmegaConf.select(cfg, key)
                if node is not None:
                    omega_conf_to_dataclass(node)
    except (AssertionError, ValueError, TypeError, OmegaConfBaseException, HydraException) as exc:
        # a dataclass's own check reaches us wrapped in Hydra's instantiation error: its cause says what is wrong
        cause = exc.__cause__ if isinstance(exc, (OmegaConfBaseException, HydraException)) and exc.__cause__ else exc
        raise ConfigError(f"verl rejects the config: {type(cause).__name__}: {cause}") from exc


def _registered(key: str, value: str, known: list[str], registry: str) -> None:
    if value not in known:
        raise ConfigError(f"{key}={value!r} is not in verl's {registry} registry (registered here: {', '.join(known)})")


def check_registries(cfg: DictConfig) -> None:
    """The names verl looks up only inside Ray, resolved now against its registries: the rollout
    (``actor_rollout_ref.rollout.name`` and ``.mode``), the advantage estimator (``algorithm.adv_estimator``) and,
    for the V1 trainer, ``trainer.v1.trainer_mode``; envace's own entries (``hfcpu`` on CPU, ``grpo_rolewise``,
    the ``envace_*`` and ``envsched_*`` trainers) are registered first, as in verl's TaskRunner. (The registries' locations
    are pinned in ``tests/envace/verl/test_verl_pins.py``.)"""
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY

    from envace.verl.extensions import register_trainer_extensions

    register_trainer_extensions()
    rollout = cfg.actor_rollout_ref.rollout
    _registered("actor_rollout_ref.rollout.name", rollout.name, sorted({n for n, _ in _ROLLOUT_REGISTRY}), "rollout")
    _registered("actor_rollout_ref.rollout.mode", rollout.mode,
                sorted(m for n, m in _ROLLOUT_REGISTRY if n == rollout.name), f"rollout ({rollout.name})")
    _registered("algorithm.adv_estimator", str(cfg.algorithm.adv_estimator), sorted(ADV_ESTIMATOR_REGISTRY),
                "advantage estimator")
    if cfg.trainer.use_v1:
        _registered("trainer.v1.trainer_mode", cfg.trainer.v1.trainer_mode, sorted(TRAINER_REGISTRY), "trainer")


#: verl's three V1 trainer kinds, as it registers them
VERL_MODES = ("sync", "colocate_async", "separate_async")


def trainer_kind(trainer_mode: str) -> tuple[bool, str]:
    """(EnvSched, verl kind) of a V1 ``trainer.v1.trainer_mode``: whether its registered class chooses prompts with
    EnvSched (``envsched_*``), and the verl trainer it derives from (``sync``, ``colocate_async``,
    ``separate_async``), whose name it presents to verl (:mod:`envace.verl.trainers`). A name verl does not know
    counts as ``sync`` (pre-flight refuses it: :func:`check_registries`)."""
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

    from envace.verl.extensions import register_trainer_extensions

    register_trainer_extensions()
    from envace.verl.trainers import EnvSchedMixin

    cls = TRAINER_REGISTRY.get(str(trainer_mode))
    if cls is None:
        return False, "sync"
    return issubclass(cls, EnvSchedMixin), next((m for m in VERL_MODES if issubclass(cls, TRAINER_REGISTRY[m])), "sync")
