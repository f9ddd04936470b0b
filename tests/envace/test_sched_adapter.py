"""envace ↔ envsched adapters: pool records from the real BFCL pool, multi-turn replay, scheduler build."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from envace.envs.base import END_TURN, get_pool, split_turns
from envace.sched import build_scheduler, collect_groups, make_replay, task_records


@pytest.fixture(scope="module")
def bfcl():
    return get_pool("bfcl_multi_turn")


def test_records_carry_envsched_views_and_turn_structure(bfcl):
    tid = "multi_turn_base_0"
    (rec,) = task_records({"bfcl_multi_turn": bfcl}, [("bfcl_multi_turn", tid)])
    assert rec["task_id"] == f"bfcl_multi_turn/{tid}"
    assert rec["env_id"] == bfcl.task(tid).env_id
    assert rec["instruction"] and rec["tools"] and rec["verifier_code"].startswith("# turn 0")
    turns = bfcl.gold_actions(tid)
    assert sum(a["name"] == END_TURN for a in rec["gold_actions"]) == len(turns) - 1
    assert [[c.name for c in t] for t in split_turns(rec["gold_actions"])] == [[c.name for c in t] for t in turns]

    from envsched import TaskPool

    TaskPool.from_records([rec])  # envsched accepts the record format


def test_replay_scores_gold_one_and_a_corrupted_sequence_zero(bfcl):
    tid = "multi_turn_base_0"
    (rec,) = task_records({"bfcl_multi_turn": bfcl}, [("bfcl_multi_turn", tid)])
    replay = make_replay({"bfcl_multi_turn": bfcl})
    assert replay(rec["task_id"], rec["gold_actions"]) == 1.0
    dropped = [a for a in rec["gold_actions"] if a["name"] == END_TURN or a is not rec["gold_actions"][0]]
    assert replay(rec["task_id"], dropped) == 0.0


def test_build_scheduler_uses_train_batch_size_and_selects_known_tasks(bfcl):
    rows = [{"extra_info": {"pool": "bfcl_multi_turn", "task_id": t}} for t in bfcl.task_ids("train")[:40]]
    cfg = OmegaConf.create({"data": {"train_batch_size": 4}, "actor_rollout_ref": {"rollout": {"n": 2}},
                            "envsched": {"scheduler": "envsched"}})
    sched, keys = build_scheduler(cfg, rows)
    assert sched.cfg.batch_size == 4 and len(keys) == 40
    batch = sched.select(1)
    assert len(batch) == 4 and set(batch) <= set(keys)
    sched.observe(1, {t: [0.0, 1.0] for t in batch})
    assert len(sched.select(2)) == 4


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
    act = '[{"name": "ls", "arguments": {}}]'
    extra = [{"actions": act}, {"actions": act}, {"actions": act},
             {"actions": act}, {"actions": act, "reward_extra_info": {"verify_failed": 1.0}}]
    rewards, trajs, unscored = collect_groups(keys, uids, scores, extra, uid_task)
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
    rewards, _, unscored = collect_groups(keys, uids, scores, [{}] * 4, {"u1": "p/t1"}, tags)
    assert rewards == {"p/t1": [1.0]} and unscored == 0
    with pytest.raises(KeyError):  # without the tags the pad uid is unknown
        collect_groups(keys, uids, scores, [{}] * 4, {"u1": "p/t1"})


def test_scheduler_state_file_loads_with_weights_only_and_restores_the_next_batch(bfcl, tmp_path):
    """Old behaviour: envsched.pt held pickled numpy objects and was read with torch.load(weights_only=False),
    i.e. resuming unpickled whatever the file contained."""
    import torch

    from envace.sched import load_scheduler_state, save_scheduler_state

    rows = [{"extra_info": {"pool": "bfcl_multi_turn", "task_id": t}} for t in bfcl.task_ids("train")[:40]]
    cfg = OmegaConf.create({"data": {"train_batch_size": 4}, "actor_rollout_ref": {"rollout": {"n": 2}},
                            "envsched": {"scheduler": "envsched"}})
    sched, _ = build_scheduler(cfg, rows)
    for step in (1, 2, 3):
        sched.observe(step, {t: [float(i % 2), 1.0] for i, t in enumerate(sched.select(step))})
    path = tmp_path / "envsched.pt"
    save_scheduler_state(sched, path)
    torch.load(path, weights_only=True)  # no pickled objects beyond tensors and plain containers
    restored, _ = build_scheduler(cfg, rows)
    load_scheduler_state(restored, path)
    assert restored.select(4) == sched.select(4)
