"""envace's held-out validation around verl's ``_validate`` (:class:`envace.verl.trainer.HeldoutValidation`): the
greedy copy of each validation batch, the task behind each uid, and the estimates and change it reports."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from envace.agents.contract import GREEDY_FIELD
from envace.verl.trainer import GREEDY_PREFIX, HeldoutValidation


def _batch(tasks: list[str]) -> dict:
    return {
        "raw_prompt": np.array([[{"role": "user", "content": t}] for t in tasks], dtype=object),
        "data_source": np.array(["synthetic/act"] * len(tasks), dtype=object),
        "extra_info": np.array([{"pool": "synthetic", "task_id": t} for t in tasks], dtype=object),
    }


def _drive(hv: HeldoutValidation, loader: list[dict]) -> list[dict]:
    """What verl's ``_validate`` does to each batch it draws: stamp fresh uids on it."""
    seen = []
    for i, batch in enumerate(hv.batches(loader)):
        batch["uid"] = np.array([f"u{i}-{j}" for j in range(len(batch["raw_prompt"]))], dtype=object)
        seen.append(batch)
    return seen


def test_each_batch_is_followed_by_its_greedy_copy_and_every_uid_is_mapped_to_its_task(tmp_path):
    hv = HeldoutValidation(tmp_path, greedy=True)
    seen = _drive(hv, [_batch(["t1", "t2"]), _batch(["t3"])])
    assert len(seen) == 4
    sampled, greedy = seen[0], seen[1]
    assert GREEDY_FIELD not in sampled and list(sampled["data_source"]) == ["synthetic/act"] * 2
    assert list(greedy["data_source"]) == [f"{GREEDY_PREFIX}synthetic/act"] * 2
    assert list(greedy["__rollout_n__"]) == [1, 1] and list(greedy[GREEDY_FIELD]) == [True, True]
    assert list(greedy["raw_prompt"]) == list(sampled["raw_prompt"])
    assert hv.tasks == {"u0-0": "synthetic/t1", "u0-1": "synthetic/t2", "u1-0": "synthetic/t1",
                        "u1-1": "synthetic/t2", "u2-0": "synthetic/t3", "u3-0": "synthetic/t3"}
    assert len(_drive(HeldoutValidation(tmp_path, greedy=False), [_batch(["t1"])])) == 1


def test_metrics_are_the_per_task_estimates_and_the_change_is_paired_with_the_first_validation(tmp_path):
    hv = HeldoutValidation(tmp_path / "validation", greedy=True)
    _drive(hv, [_batch(["a", "b", "c"])])
    sampled = ["u0-0"] * 2 + ["u0-1"] * 2 + ["u0-2"] * 2
    sources = ["synthetic/act"] * 6 + [f"{GREEDY_PREFIX}synthetic/act"] * 3
    uids = sampled + ["u1-0", "u1-1", "u1-2"]
    first = hv.metrics(0, sources, uids, [1, 0, 0, 0, 1, 1] + [1, 0, 1])
    assert first["val-core/heldout/success/mean@2"] == pytest.approx(0.5)  # task means 0.5, 0, 1
    assert first["val-core/heldout/success/sem@2"] == pytest.approx(0.5 / math.sqrt(3))
    assert first["val-core/heldout_greedy/success/mean@1"] == pytest.approx(2 / 3)
    assert "val-aux/heldout/success/change" not in first  # nothing to compare with yet
    assert json.loads((tmp_path / "validation" / "step_0.json").read_text())["heldout"] == {
        "synthetic/a": [1.0, 0.0], "synthetic/b": [0.0, 0.0], "synthetic/c": [1.0, 1.0]}

    later = HeldoutValidation(tmp_path / "validation", greedy=False)  # a resumed run: the first record is on disk
    _drive(later, [_batch(["a", "b", "c"])])
    out = later.metrics(10, ["synthetic/act"] * 6, ["u0-0"] * 2 + ["u0-1"] * 2 + ["u0-2"] * 2, [1, 1, 1, 0, 1, 1])
    assert out["val-aux/heldout/success/change"] == pytest.approx((0.5 + 0.5 + 0) / 3)  # diffs 0.5, 0.5, 0
    assert out["val-aux/heldout/success/change_sem"] == pytest.approx(np.std([0.5, 0.5, 0], ddof=1) / math.sqrt(3))
    assert "val-core/heldout_greedy/success/mean@1" not in out
