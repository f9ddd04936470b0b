"""The prompt ledger (envace/verl/prompts.py): every prompt verl dispatched is trained once, dropped, or in flight,
across steps and a checkpoint."""

from __future__ import annotations

import json

import pytest

from envace.verl.prompts import STATE_FILE, PromptLedger


def test_a_step_trains_some_groups_drops_the_ones_gone_from_transferqueue_and_keeps_the_rest(tmp_path):
    ledger = PromptLedger()
    ledger.dispatched(1, ["a", "b", "c", "d"], [["s1", "t1"], ["s1", "t2"], ["s1", "t3"], ["s1", "t4"]])
    settled = ledger.settle(trained=["a", "a", "b"], registered=["c"])  # d: evicted by verl; c: still running
    assert settled.trained == {"a": ["s1", "t1"], "b": ["s1", "t2"]} and settled.dropped == {"d": ["s1", "t4"]}
    assert ledger.open == {"c": (1, ["s1", "t3"])} and settled.unknown == ()
    ledger.log(tmp_path, 1, settled)
    ledger.dispatched(2, ["e"])
    settled = ledger.settle(trained=["c", "zzz"], registered=["e"])
    assert list(settled.trained) == ["c"] and settled.unknown == ("zzz",)
    ledger.log(tmp_path, 2, settled)
    lines = [json.loads(x) for x in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    assert lines == [
        {"step": 1, "dispatched": {"a": 1, "b": 1, "c": 1, "d": 1}, "trained": ["a", "b"], "dropped": ["d"],
         "open": ["c"]},
        {"step": 2, "dispatched": {"e": 2}, "trained": ["c", "zzz"], "dropped": [], "open": ["e"]},
    ]


def test_a_uid_dispatched_twice_is_refused():
    ledger = PromptLedger()
    ledger.dispatched(1, ["a"])
    with pytest.raises(ValueError, match="prompt uid a dispatched twice"):
        ledger.dispatched(2, ["a"])


def test_the_open_uids_survive_a_checkpoint_and_a_checkpoint_without_a_ledger_holds_none(tmp_path):
    """A resumed run starts from the open set saved with the checkpoint: verl restores or re-issues those same uids,
    so they settle in the resumed run, once."""
    ledger = PromptLedger()
    ledger.dispatched(3, ["a", "b"], [[7, "p/t1"], [8, "p/t2"]])
    ledger.settle(trained=["a"], registered=["b"])
    ledger.save(tmp_path / "global_step_3")
    restored = PromptLedger.load(tmp_path / "global_step_3")
    assert restored.open == {"b": (3, [8, "p/t2"])}
    assert restored.settle(trained=["b"], registered=[]).trained == {"b": [8, "p/t2"]}
    assert PromptLedger.load(tmp_path / "elsewhere").open == {}
    assert not (tmp_path / "global_step_3" / (STATE_FILE + ".tmp")).exists()
