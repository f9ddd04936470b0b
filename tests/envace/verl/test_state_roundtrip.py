"""``load_state_dict(state_dict())`` is the identity for envace's stateful batch sampler: the EnvSched scheduler
(``envsched.scheduler=envsched``) and its random baseline (``envsched.scheduler=random``) as the trainer saves
and restores them (``envsched.pt``: :func:`envace.verl.sched.save_scheduler_state` / ``load_scheduler_state``, tensors
and plain containers only). Equality is checked on the whole state, arrays with their dtypes, after some
observed steps, and again after both copies run on, so nothing select() depends on is left out of the state.
(The evaluation store's round trips are in tests/envace/eval/test_eval_store.py.)"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from omegaconf import OmegaConf

from envace.envs.base import get_pool
from envace.verl.sched import build_scheduler, decode_state, encode_state, load_scheduler_state, save_scheduler_state


def assert_same(a: Any, b: Any, path: str = "state") -> None:
    """Deep equality of two scheduler states: the same keys, lengths, array dtypes and values."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray), (path, type(a), type(b))
        assert a.dtype == b.dtype and a.shape == b.shape, (path, a.dtype, b.dtype, a.shape, b.shape)
        if a.dtype.kind in "fc":
            assert np.array_equal(a, b, equal_nan=True), path
        else:
            assert np.array_equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (path, list(a), list(b) if isinstance(b, dict) else b)
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), (path, a, b)
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), path
    else:
        assert a == b and isinstance(b, bool) == isinstance(a, bool), (path, a, b)


def without_timings(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` less the wall-clock metrics (``*_time_s``), which two copies never share."""
    metrics = {step: {k: v for k, v in m.items() if not k.endswith("_time_s")} for step, m in state["metrics"].items()}
    return {**state, "metrics": metrics}


@pytest.fixture(scope="module")
def rows() -> list[dict[str, Any]]:
    bfcl = get_pool("bfcl_multi_turn")
    return [{"extra_info": {"pool": "bfcl_multi_turn", "task_id": t}} for t in bfcl.task_ids("train")[:40]]


def make(kind: str, rows: list[dict[str, Any]]):
    cfg = OmegaConf.create({"data": {"train_batch_size": 4}, "actor_rollout_ref": {"rollout": {"n": 2}},
                            "envsched": {"scheduler": kind, "seed": 7, "batch_size": "${data.train_batch_size}",
                                         "rollouts_per_task": "${actor_rollout_ref.rollout.n}"}})
    return build_scheduler(cfg, rows)[0]


def run_steps(sched: Any, steps: range) -> list[list[str]]:
    chosen = []
    for step in steps:
        sel = list(sched.select(step))
        chosen.append(sel)
        # varied groups: all-pass, all-fail and mixed, so the estimates move
        sched.observe(step, {t: [float((i + step) % 3 == 0), float(i % 2)] for i, t in enumerate(sel)})
    return chosen


@pytest.mark.parametrize("kind", ["envsched", "random"])
def test_scheduler_state_survives_envsched_pt(kind, rows, tmp_path):
    sched = make(kind, rows)
    run_steps(sched, range(1, 5))
    # tasks the identifier filter removed (its effect, set directly): a restore must not bring them back
    removed = [i for i in range(len(rows)) if i % 4 == 1]
    sched.available[removed] = False
    state = sched.state_dict()
    assert_same(decode_state(encode_state(state)), state)  # the file's encoding alone

    in_memory = make(kind, rows)
    in_memory.load_state_dict(sched.state_dict())
    assert_same(in_memory.state_dict(), state)

    save_scheduler_state(sched, tmp_path / "envsched.pt")
    restored = make(kind, rows)
    load_scheduler_state(restored, tmp_path / "envsched.pt")
    assert_same(restored.state_dict(), state)

    # both copies run on identically: the state held everything select() and observe() depend on
    assert run_steps(restored, range(5, 8)) == run_steps(sched, range(5, 8))
    assert_same(without_timings(restored.state_dict()), without_timings(sched.state_dict()))


def test_the_equality_used_here_sees_what_a_lossy_restore_would_lose():
    """The comparison itself can fail: a dtype change, a dropped key, a changed value."""
    base = {"a": np.arange(3, dtype=np.int64), "b": {"c": [1.0, float("nan")]}}
    assert_same(base, {"a": np.arange(3, dtype=np.int64), "b": {"c": [1.0, float("nan")]}})
    for other in ({"a": np.arange(3, dtype=np.int32), "b": {"c": [1.0, float("nan")]}},
                  {"a": np.arange(3, dtype=np.int64), "b": {}},
                  {"a": np.arange(3, dtype=np.int64), "b": {"c": [2.0, float("nan")]}},
                  {"a": np.arange(3, dtype=np.int64), "b": {"c": [True, float("nan")]}}):
        with pytest.raises(AssertionError):
            assert_same(base, other)
