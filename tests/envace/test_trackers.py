"""Start-up safety: a tracker without credentials (or package) falls back to the console before verl starts."""

from __future__ import annotations

import warnings

import pytest
from omegaconf import OmegaConf

from envace.trackers import TrackerWarning, degrade_trackers, missing_credentials


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An empty home (no ~/.netrc) and no tracker variables; envace's build cache stays where it was."""
    from envace.cache import cache_dir

    monkeypatch.setenv("ENVACE_CACHE", str(cache_dir()))
    monkeypatch.setenv("HOME", str(tmp_path))
    for key in ("NETRC", "WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(key, raising=False)
    return tmp_path


def no_login():
    raise AssertionError("must not prompt without a terminal")


def test_wandb_without_key_netrc_or_terminal_becomes_console(home):
    with pytest.warns(TrackerWarning, match=r"`wandb` dropped \(no WANDB_API_KEY and no api.wandb.ai entry"):
        out = degrade_trackers(["wandb", "file"], interactive=False, login=no_login)
    assert out == ["file", "console"]
    with pytest.warns(TrackerWarning):  # console already there: not doubled
        assert degrade_trackers(["console", "wandb"], interactive=False, login=no_login) == ["console"]


def test_wandb_with_credentials_is_kept(home, monkeypatch):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
        assert degrade_trackers(["console", "wandb"], interactive=False, login=no_login) == ["console", "wandb"]
        monkeypatch.delenv("WANDB_API_KEY")
        (home / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "p" * 40 + "\n")
        (home / ".netrc").chmod(0o600)
        assert degrade_trackers(["wandb"], interactive=False, login=no_login) == ["wandb"]
        # a self-hosted server needs its own host's entry
        monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")
        assert "wandb.example.org" in missing_credentials("wandb")
        monkeypatch.delenv("WANDB_BASE_URL")
        (home / ".netrc").unlink()
        monkeypatch.setenv("WANDB_MODE", "offline")  # offline runs need no account
        assert degrade_trackers(["wandb"], interactive=False, login=no_login) == ["wandb"]


def test_wandb_on_a_terminal_asks_for_the_key_first(home):
    asked = []
    assert degrade_trackers(["wandb"], interactive=True, login=lambda: asked.append(1) or True) == ["wandb"]
    assert asked == [1]
    with pytest.warns(TrackerWarning):  # a refused login still degrades
        assert degrade_trackers(["wandb"], interactive=True, login=lambda: False) == ["console"]


def test_trackers_whose_package_is_missing_are_dropped(home, monkeypatch):
    monkeypatch.setenv("SWANLAB_API_KEY", "x")
    # swanlab is not part of either lock; verl would fail on `import swanlab` inside its TaskRunner
    assert "package `swanlab` is not installed" in missing_credentials("swanlab")
    with pytest.warns(TrackerWarning, match="swanlab"):
        assert degrade_trackers(["tensorboard", "swanlab"], interactive=False, login=no_login) == ["tensorboard",
                                                                                                   "console"]
    assert missing_credentials("console") is None and missing_credentials("file") is None


def test_prepare_rewrites_trainer_logger_before_verl_starts(home, tmp_path, monkeypatch):
    """envace.train.prepare (the pre-flight every launch runs) hands verl the degraded list."""
    from envace.train import prepare
    from envace.verl.config import compose

    monkeypatch.setattr("envace.trackers._interactive", lambda: False)
    cfg = compose(["trainer.logger=[console,wandb,file]", "envace.data.pools=[synthetic]",
                   "actor_rollout_ref.model.path=builtin:tiny-qwen3",  # the warm start takes minutes to build
                   "envace.data.max_tasks_per_pool=8", f"trainer.default_local_dir={tmp_path / 'run'}"])
    with pytest.warns(TrackerWarning, match="wandb"):
        cfg, _ = prepare(cfg)
    assert OmegaConf.to_container(cfg.trainer.logger) == ["console", "file"]
    # and total_epochs became a number for verl
    assert isinstance(cfg.trainer.total_epochs, int) and cfg.trainer.total_epochs >= 1
