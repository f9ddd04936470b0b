"""envace's registrations with verl's registries (envace/verl/extensions.py): the ``grpo_rolewise`` estimator is
registered once, a re-registration of envace's own estimator (after a reload) replaces it, and someone else's
estimator under the same name is never overwritten; the trainers are found under their ``trainer_mode`` names."""

from __future__ import annotations

import pytest
from verl.trainer.ppo import core_algos

import envace.advantage as adv_mod
from envace.verl.extensions import register_rolewise_estimator, register_trainer_extensions


def test_registration_is_idempotent(monkeypatch):
    register_rolewise_estimator()
    register_rolewise_estimator()
    assert core_algos.get_adv_estimator_fn("grpo_rolewise") is adv_mod.rolewise_adv_estimator

    # An earlier registration of envace's estimator (e.g. before importlib.reload: a different function
    # object with the same module and name) is replaced rather than raising.
    def stale(**kw):
        return None

    stale.__module__, stale.__qualname__ = adv_mod.__name__, adv_mod.rolewise_adv_estimator.__qualname__
    monkeypatch.setitem(core_algos.ADV_ESTIMATOR_REGISTRY, "grpo_rolewise", stale)
    register_rolewise_estimator()
    assert core_algos.get_adv_estimator_fn("grpo_rolewise") is adv_mod.rolewise_adv_estimator
    # Another module's estimator under the same name is not silently overwritten.
    monkeypatch.setitem(core_algos.ADV_ESTIMATOR_REGISTRY, "grpo_rolewise", lambda **kw: None)
    with pytest.raises(ValueError, match="already been registered"):
        register_rolewise_estimator()


def test_registration_replaces_only_its_own_estimator(monkeypatch):
    """Only a function of envace.advantage named like the estimator counts as an earlier registration of it; a
    same-named function of another module, another function of that module, or a callable object are someone
    else's estimator, which verl refuses to overwrite."""
    ours = adv_mod.rolewise_adv_estimator.__qualname__

    def other_module(**kw):
        return None

    other_module.__qualname__ = ours  # the same name, another module

    def other_name(**kw):
        return None

    other_name.__module__ = adv_mod.__name__  # envace.advantage, another function

    class Estimator:
        def __call__(self, **kw):
            return None

    Estimator.__module__ = adv_mod.__name__  # an instance: a __module__ but no __qualname__

    for foreign in (other_module, other_name, Estimator()):
        monkeypatch.setitem(core_algos.ADV_ESTIMATOR_REGISTRY, "grpo_rolewise", foreign)
        with pytest.raises(ValueError, match="already been registered"):
            register_rolewise_estimator()
        assert core_algos.ADV_ESTIMATOR_REGISTRY["grpo_rolewise"] is foreign


def test_the_trainer_extensions_register_the_estimator_and_every_trainer():
    from verl.trainer.ppo.v1.trainer_base import get_trainer_cls

    register_trainer_extensions()
    register_trainer_extensions()  # idempotent
    from envace.verl import trainers

    assert core_algos.get_adv_estimator_fn("grpo_rolewise") is adv_mod.rolewise_adv_estimator
    for kind in ("sync", "colocate_async", "separate_async"):
        envace_cls, envsched_cls = get_trainer_cls(f"envace_{kind}"), get_trainer_cls(f"envsched_{kind}")
        assert envace_cls is trainers.TRAINERS[f"envace_{kind}"]
        assert issubclass(envace_cls, trainers.EnvaceTrainerMixin) and issubclass(envsched_cls, trainers.EnvSchedMixin)
        assert issubclass(envsched_cls, get_trainer_cls(kind)) and envsched_cls.VERL_MODE == kind
