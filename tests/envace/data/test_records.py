"""EnvSched pool records of environment tasks (envace/data/records.py): the views EnvSched reads, built from the real
BFCL pool, the multi-turn replay its identifier filter scores through the pool's own verifier, and the JSONL export
EnvSched loads back."""

from __future__ import annotations

import pytest

from envace.data.records import export_envsched_jsonl, make_replay, task_records
from envace.envs.base import END_TURN, get_pool, split_turns
from envace.envs.synthetic import SyntheticPool


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


def test_envsched_export_loads(tmp_path):
    from envsched import TaskPool

    small = SyntheticPool(n_envs=4, tasks_per_env=6, seed=1)
    path = tmp_path / "pool.jsonl"
    assert export_envsched_jsonl(small, path) == 24
    tp = TaskPool.from_jsonl(path)
    assert len(tp) == 24 and tp.n_envs == 4
    task = tp[0]
    tid = small.task_ids()[0]
    assert task.task_id == f"synthetic/{tid}" and task.env_id == small.task(tid).env_id
    assert task.instruction == small.task(tid).first_user_message and task.tools and task.verifier_checks
    multiturn = next(t for t in tp.tasks if t.meta["category"] == "multiturn")
    assert any(a.name == END_TURN for a in multiturn.gold_actions)
    n_test = export_envsched_jsonl(small, tmp_path / "test.jsonl", split="test")
    assert n_test == len(small.task_ids("test")) and n_test > 0
    assert len(TaskPool.from_jsonl(tmp_path / "test.jsonl")) == n_test
