"""Resume verifies the checkpoint it loads and falls back to the newest complete one (envace/verl/resume.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf, open_dict

from envace.config import ConfigError
from envace.verl.config import trainer_kind
from envace.verl.resume import checkpoint_problems, select_resume_checkpoint


def make_step(run: Path, step: int, world: int = 2, *, envsched: bool = False, tq: bool = False) -> Path:
    """A checkpoint laid out as verl 0.9.1's FSDP checkpoint manager writes it (tiny tensors)."""
    folder = run / f"global_step_{step}"
    actor = folder / "actor"
    actor.mkdir(parents=True)
    for rank in range(world):
        for kind in ("model", "optim", "extra_state"):
            torch.save({"w": torch.zeros(2)}, actor / f"{kind}_world_size_{world}_rank_{rank}.pt")
    (actor / "fsdp_config.json").write_text("{}")
    torch.save({"epoch": 0}, folder / "data.pt")
    if envsched:
        torch.save({"obs_count": torch.zeros(3, dtype=torch.int64)}, folder / "envsched.pt")
    if tq:  # what TransferQueue's save_checkpoint writes for an async trainer
        (folder / "transfer_queue").mkdir()
        (folder / "transfer_queue" / "metadata.json").write_text(json.dumps({"global_steps": step, "storage_saved": True}))
        (folder / "transfer_queue" / "controller_state.pkl").write_bytes(b"\x80\x04N.")
    (run / "latest_checkpointed_iteration.txt").write_text(str(step))
    return folder


def cfg_for(run: Path, mode: str = "auto", path: str | None = None, trainer_mode: str = "envace_sync"):
    cfg = OmegaConf.create({"trainer": {"default_local_dir": str(run), "resume_mode": mode,
                                        "resume_from_path": path, "v1": {"trainer_mode": trainer_mode}}})
    OmegaConf.set_struct(cfg, True)
    return cfg


def select(cfg):
    with open_dict(cfg):
        return select_resume_checkpoint(cfg)


def test_a_complete_latest_checkpoint_is_used_as_verl_would(tmp_path):
    make_step(tmp_path, 1)
    step2 = make_step(tmp_path, 2)
    cfg = cfg_for(tmp_path)
    assert select(cfg) == str(step2) and cfg.trainer.resume_mode == "auto"
    assert select(cfg_for(tmp_path / "fresh")) is None  # no tracker: training from scratch


@pytest.mark.parametrize("damage", ["truncate", "missing_rank", "no_data", "empty"])
def test_an_incomplete_latest_checkpoint_falls_back_to_the_newest_complete_one(tmp_path, capsys, damage):
    step1 = make_step(tmp_path, 1)
    make_step(tmp_path, 2)
    step3 = make_step(tmp_path, 3)
    shard = step3 / "actor" / "model_world_size_2_rank_1.pt"
    if damage == "truncate":  # a crash or a full disk in the middle of the write
        shard.write_bytes(shard.read_bytes()[:100])
    elif damage == "missing_rank":
        shard.unlink()
    elif damage == "no_data":
        (step3 / "data.pt").unlink()
    else:
        shard.write_bytes(b"")
    (tmp_path / "global_step_2" / "data.pt").unlink()  # step 2 is broken too: the newest *complete* one is 1
    cfg = cfg_for(tmp_path)
    assert select(cfg) == str(step1)
    assert cfg.trainer.resume_mode == "resume_path" and cfg.trainer.resume_from_path == str(step1)
    err = capsys.readouterr().err
    assert "WARNING" in err and "global_step_3" in err and "global_step_1" in err


def test_no_complete_checkpoint_is_an_error_not_a_silent_restart(tmp_path):
    step = make_step(tmp_path, 1)
    (step / "data.pt").write_bytes(b"torn")
    with pytest.raises(ConfigError, match="no older complete checkpoint"):
        select(cfg_for(tmp_path))


def test_an_explicit_resume_path_must_be_complete(tmp_path):
    step = make_step(tmp_path, 4)
    (step / "actor" / "optim_world_size_2_rank_0.pt").unlink()
    with pytest.raises(ConfigError, match=r"ranks \[0\] of world size 2 are missing"):
        select(cfg_for(tmp_path, "resume_path", str(step)))


def test_envsched_state_must_load_with_weights_only(tmp_path):
    import numpy as np

    step = make_step(tmp_path, 1, envsched=True)
    assert checkpoint_problems(step, envsched=True) == []
    torch.save({"obs_count": np.zeros(3)}, step / "envsched.pt")  # a pickled numpy array (the old format)
    assert any("weights_only" in p for p in checkpoint_problems(step, envsched=True))
    (step / "envsched.pt").unlink()
    assert checkpoint_problems(step, envsched=True) == ["envsched.pt is missing"]


def test_an_async_checkpoint_needs_the_transferqueue_state_of_the_prompts_in_flight(tmp_path):
    """An async trainer's resume restores finished groups and re-issues pending prompts from ``transfer_queue/``:
    without it, or with a torn one, the relaunch falls back to the newest checkpoint that has it."""
    assert trainer_kind("envace_colocate_async") == (False, "colocate_async")
    assert trainer_kind("envsched_sync") == (True, "sync") and trainer_kind("sync") == (False, "sync")
    assert trainer_kind("envsched_separate_async") == (True, "separate_async")
    step1 = make_step(tmp_path, 1, tq=True)
    step2 = make_step(tmp_path, 2, tq=True)
    assert checkpoint_problems(step2, asynchronous=True) == []
    (step2 / "transfer_queue" / "metadata.json").write_text("{")
    assert "transfer_queue/metadata.json does not read as JSON" in checkpoint_problems(step2, asynchronous=True)[0]
    (step2 / "transfer_queue" / "controller_state.pkl").unlink()
    assert "transfer_queue/controller_state.pkl is missing" in checkpoint_problems(step2, asynchronous=True)
    assert select(cfg_for(tmp_path, trainer_mode="envace_colocate_async")) == str(step1)
    assert select(cfg_for(tmp_path, trainer_mode="envace_sync")) == str(step2)  # a sync run never reads it


def test_prepare_refuses_to_resume_from_a_broken_checkpoint(tmp_path):
    """Old behaviour: verl read the tracker and loaded the torn checkpoint inside its workers, after the whole
    cluster had started."""
    from envace.train import prepare
    from envace.verl.config import compose

    step = make_step(tmp_path / "run", 1, world=1)
    (step / "actor" / "model_world_size_1_rank_0.pt").write_bytes(b"PK\x03\x04 torn")
    cfg = compose([f"trainer.default_local_dir={tmp_path / 'run'}", "envace.data.max_tasks_per_pool=4",
                   "actor_rollout_ref.model.path=builtin:tiny-qwen3",
                   f"envace.data.out_dir={tmp_path / 'data'}"])
    with pytest.raises(ConfigError, match="cannot resume"):
        prepare(cfg)
