"""EnvSched inside verl's trainer (envace/verl/sched.py): the scheduler built from the real BFCL pool, reward groups
from a trained batch, the scheduler state saved in and restored from verl's checkpoint."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from envace.agents.contract import RolloutFields
from envace.envs.base import get_pool
from envace.verl.sched import build_scheduler, collect_groups

#: envsched's batch and group size as the training config sets them (configs/envace_trainer.yaml): the trainer's keys
TRAINER_KEYS = {"batch_size": "${data.train_batch_size}", "rollouts_per_task": "${actor_rollout_ref.rollout.n}"}


@pytest.fixture(scope="module")
def bfcl():
    return get_pool("bfcl_multi_turn")


def test_build_scheduler_uses_train_batch_size_and_selects_known_tasks(bfcl):
    rows = [{"extra_info": {"pool": "bfcl_multi_turn", "task_id": t}} for t in bfcl.task_ids("train")[:40]]
    cfg = OmegaConf.create({"data": {"train_batch_size": 4}, "actor_rollout_ref": {"rollout": {"n": 2}},
                            "envsched": {"scheduler": "envsched", **TRAINER_KEYS}})
    sched, keys = build_scheduler(cfg, rows)
    assert sched.cfg.batch_size == 4 and len(keys) == 40
    batch = sched.select(1)
    assert len(batch) == 4 and set(batch) <= set(keys)
    sched.observe(1, {t: [0.0, 1.0] for t in batch})
    assert len(sched.select(2)) == 4


@pytest.mark.parametrize(("envsched", "line"), [
    ({"batch_size": 8}, "envsched.batch_size=8 differs from data.train_batch_size=4: "),
    ({"rollouts_per_task": 3}, "envsched.rollouts_per_task=3 differs from actor_rollout_ref.rollout.n=2: "),
    ({}, "envsched.batch_size=64 differs from data.train_batch_size=4: "),  # the library's default is not the trainer's
])
def test_build_scheduler_refuses_a_batch_or_group_size_apart_from_the_trainers(bfcl, envsched, line):
    """Issue 47, item 2: the trainer's own guard, for a config that did not pass envace's pre-flight. Before,
    ``envsched.batch_size`` and ``rollouts_per_task`` were replaced here by the trainer's values, without a word."""
    rows = [{"extra_info": {"pool": "bfcl_multi_turn", "task_id": t}} for t in bfcl.task_ids("train")[:40]]
    cfg = OmegaConf.create({"data": {"train_batch_size": 4}, "actor_rollout_ref": {"rollout": {"n": 2}},
                            "envsched": {**TRAINER_KEYS, **envsched} if envsched else {}})
    with pytest.raises(ValueError) as err:
        build_scheduler(cfg, rows)
    assert str(err.value).startswith(line) and "\n" not in str(err.value)


def test_rows_without_task_refs_are_rejected():
    cfg = OmegaConf.create({"data": {"train_batch_size": 1}, "actor_rollout_ref": {"rollout": {"n": 2}}})
    with pytest.raises(ValueError, match="extra_info.pool/task_id"):
        build_scheduler(cfg, [{"extra_info": {}}])


def test_collect_groups_one_reward_per_rollout_and_skips_unscored():
    import torch

    uid_task = {"u1": "p/t1", "u2": "p/t2"}
    keys = ["u1_0_0", "u1_0_1", "u1_1_0", "u2_0_0", "u2_1_0"]  # rollout u1_0 has two outputs
    uids = ["u1", "u1", "u1", "u2", "u2"]
    scores = [torch.tensor([0.0, 1.0]), torch.tensor([0.0, 1.0]), torch.tensor([0.0, 0.0]),
              torch.tensor([0.0, 1.0]), torch.tensor([0.0, 0.0])]
    act = ({"name": "ls", "arguments": {}},)
    rows = [RolloutFields(trajectory_id=k.rsplit("_", 1)[0], actions=act, verify_failed=(k == "u2_1_0")) for k in keys]
    rewards, trajs, unscored = collect_groups(keys, uids, scores, rows, uid_task)
    assert rewards == {"p/t1": [1.0, 0.0], "p/t2": [1.0]}
    assert unscored == 1
    assert trajs["p/t1"] == [[{"name": "ls", "arguments": {}}]] * 2


def test_collect_groups_skips_the_padding_rows_verl_appends():
    """verl pads a multi-output batch with no-op rows of an unknown uid (``is_padding`` tag)."""
    import torch

    keys = ["u1_0_0", "u1_0_1", "padabc_0_0", "padabc_1_0"]
    uids = ["u1", "u1", "padabc", "padabc"]
    scores = [torch.tensor([1.0])] * 4
    tags = [{}, {}, {"is_padding": True}, {"is_padding": True}]
    rows = [RolloutFields.from_extra_fields({})] * 4  # rows of verl's own loops: no actions, valid
    rewards, _, unscored = collect_groups(keys, uids, scores, rows, {"u1": "p/t1"}, tags)
    assert rewards == {"p/t1": [1.0]} and unscored == 0
    with pytest.raises(KeyError):  # without the tags the pad uid is unknown
        collect_groups(keys, uids, scores, rows, {"u1": "p/t1"})


def three_observed_steps(bfcl):
    """(config, dataset rows, scheduler) of a 40-task BFCL envsched run that has selected and observed steps 1-3."""
    rows = [{"extra_info": {"pool": "bfcl_multi_turn", "task_id": t}} for t in bfcl.task_ids("train")[:40]]
    cfg = OmegaConf.create({"data": {"train_batch_size": 4}, "actor_rollout_ref": {"rollout": {"n": 2}},
                            "envsched": {"scheduler": "envsched", **TRAINER_KEYS}})
    sched, _ = build_scheduler(cfg, rows)
    for step in (1, 2, 3):
        sched.observe(step, {t: [float(i % 2), 1.0] for i, t in enumerate(sched.select(step))})
    return cfg, rows, sched


def test_scheduler_state_file_loads_with_weights_only_and_restores_the_next_batch(bfcl, tmp_path):
    """Old behaviour: envsched.pt held pickled numpy objects and was read with torch.load(weights_only=False),
    i.e. resuming unpickled whatever the file contained."""
    import torch

    from envace.verl.sched import load_scheduler_state, save_scheduler_state

    cfg, rows, sched = three_observed_steps(bfcl)
    path = tmp_path / "envsched.pt"
    save_scheduler_state(sched, path)
    torch.load(path, weights_only=True)  # no pickled objects beyond tensors and plain containers
    restored, _ = build_scheduler(cfg, rows)
    load_scheduler_state(restored, path)
    assert restored.select(4) == sched.select(4)


@pytest.fixture
def envsched_trainer(monkeypatch):
    """``make(trainer_cfg, scheduler, global_steps)``: an ``envsched_sync`` trainer (the registered class, no
    __init__: no workers, no Ray) whose checkpoint hooks run with verl's own save/load replaced by recorders.
    The save recorder notes whether envsched.pt was already in the step's folder when verl's save began."""
    from pathlib import Path

    from verl.trainer.ppo.v1.trainer_base import get_trainer_cls

    from envace.verl.extensions import register_trainer_extensions
    from envace.verl.sched import STATE_FILE

    register_trainer_extensions()
    cls = get_trainer_cls("envsched_sync")
    calls: list[tuple] = []

    def verl_save(self):
        folder = Path(self.config.trainer.default_local_dir) / f"global_step_{self.global_steps}"
        calls.append(("save", self.global_steps, (folder / STATE_FILE).is_file()))

    verl_cls = get_trainer_cls("sync")
    monkeypatch.setattr(verl_cls, "_save_checkpoint", verl_save)
    monkeypatch.setattr(verl_cls, "_load_checkpoint", lambda self: calls.append(("load", self.global_steps)))

    def make(trainer_cfg, scheduler, global_steps):
        trainer = cls.__new__(cls)
        trainer.config = OmegaConf.create({"trainer": trainer_cfg})
        trainer.scheduler, trainer.global_steps = scheduler, global_steps
        return trainer

    return make, calls


def test_the_trainer_writes_envsched_pt_with_each_checkpoint_and_restores_it_on_resume(bfcl, tmp_path, envsched_trainer):
    """The envsched_sync trainer's own glue (before: exercised only by the slow end-to-end resume test): a
    checkpoint at step 3 writes global_step_3/envsched.pt before verl's save; a resume at step 3 (verl's load
    sets global_steps) restores it, so the scheduler knows steps 1-3 and picks the batch of step 4 the
    uninterrupted run picks; ``resume_mode=resume_path`` reads the file next to ``resume_from_path``; a fresh start
    (step 0) loads nothing; a checkpoint folder without the file is refused."""
    make, calls = envsched_trainer
    cfg, rows, sched = three_observed_steps(bfcl)
    ckpt = tmp_path / "ckpt"
    auto = {"default_local_dir": str(ckpt), "resume_mode": "auto", "resume_from_path": None}
    make(auto, sched, 3)._save_checkpoint()
    assert calls == [("save", 3, True)]

    resumed = make(auto, build_scheduler(cfg, rows)[0], 3)
    resumed._load_checkpoint()
    assert calls[-1] == ("load", 3) and sorted(resumed.scheduler.selections) == [1, 2, 3]
    assert resumed.scheduler.select(4) == sched.select(4)

    moved = tmp_path / "elsewhere" / "global_step_3"  # verl requires global_step_<N> in resume_from_path
    moved.parent.mkdir()
    (ckpt / "global_step_3").rename(moved)
    by_path = make({**auto, "resume_mode": "resume_path", "resume_from_path": str(moved)}, build_scheduler(cfg, rows)[0], 3)
    by_path._load_checkpoint()
    assert sorted(by_path.scheduler.selections) == [1, 2, 3]

    fresh = make(auto, build_scheduler(cfg, rows)[0], 0)
    fresh._load_checkpoint()
    assert fresh.scheduler.selections == {}
    (ckpt / "global_step_5").mkdir()
    with pytest.raises(FileNotFoundError, match="envsched.pt is missing"):
        make(auto, build_scheduler(cfg, rows)[0], 5)._load_checkpoint()


def test_async_dispatches_of_any_size_are_selections_that_keep_tasks_in_flight_out(bfcl, tmp_path):
    """verl's async trainers dispatch a warm-up of 2B prompts and the step's B at step 1, then refills of any size
    inside a step: each call is its own selection, none picks a task still in flight, and every uid enters the
    prompt ledger with its (selection, task). Before: one selection per global step, so the second call at step 1
    got the cached first batch again, and any size other than B was refused."""
    import torch
    from verl.trainer.ppo.v1.trainer_base import get_trainer_cls

    from envace.verl.extensions import register_trainer_extensions

    register_trainer_extensions()
    cls = get_trainer_cls("envsched_colocate_async")
    trainer = cls.__new__(cls)
    rows = [{"extra_info": {"pool": "bfcl_multi_turn", "task_id": t}} for t in bfcl.task_ids("train")[:40]]
    trainer.config = OmegaConf.create({"data": {"train_batch_size": 4}, "actor_rollout_ref": {"rollout": {"n": 2}},
                                       "envsched": {"scheduler": "envsched", **TRAINER_KEYS},
                                       "trainer": {"default_local_dir": str(tmp_path)}})
    trainer.scheduler, keys = build_scheduler(trainer.config, rows)
    trainer._row_of = {k: i for i, k in enumerate(keys)}
    trainer.train_dataset = [{"input_ids": torch.tensor([i]), "extra_info": r["extra_info"]} for i, r in enumerate(rows)]
    trainer.global_steps = 1
    batches = [trainer._next_train_batch(8), trainer._next_train_batch(), trainer._next_train_batch(1)]
    assert [len(b["uid"]) for b in batches] == [8, 4, 1]
    payloads = [trainer._ledger.open[str(u)][1] for b in batches for u in b["uid"]]
    assert [sel for sel, _ in payloads] == [1] * 8 + [2] * 4 + [3]
    tasks = [task for _, task in payloads]
    assert len(set(tasks)) == 13  # nothing in flight chosen again
    assert {i: sorted(t) for i, t in trainer.scheduler.in_flight().items()} == {
        1: sorted(tasks[:8]), 2: sorted(tasks[8:12]), 3: tasks[12:]}
    log = [json.loads(line) for line in (tmp_path / "envsched_selections.jsonl").read_text().splitlines()]
    assert [(r["step"], r["selection"], len(r["uids"])) for r in log] == [(1, 1, 8), (1, 2, 4), (1, 3, 1)]
