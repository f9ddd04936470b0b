"""``envsched.pt`` carries the selections in flight (issue 46, deliverable 3): a scheduler with selections observed in
pieces, out of order and partly dropped goes through :func:`envace.verl.sched.save_scheduler_state` /
``load_scheduler_state`` (``torch.load(weights_only=True)``: tensors and plain containers only) and comes back with
the same state, the same tasks in flight and the same next selection."""

from __future__ import annotations

import math

import numpy as np
import pytest

from envace.verl.sched import load_scheduler_state, save_scheduler_state
from envsched import EnvSchedConfig, EnvScheduler, ObservationError, TaskPool
from envsched.synthetic import synthetic_records


def make(mode: str, pool: TaskPool) -> EnvScheduler:
    return EnvScheduler(pool, EnvSchedConfig(batch_size=4, rollouts_per_task=2, scheduler=mode, seed=7))


def same(a, b, path="state"):
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (path, list(a), list(b))
        for k in a:
            if not (isinstance(k, str) and k.endswith("_time_s")):
                same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), (path, a, b)
        for k, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{k}]")
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), path
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), path
    else:
        assert a == b, (path, a, b)


@pytest.mark.parametrize("mode", ["envsched", "random"])
def test_in_flight_selections_survive_envsched_pt(mode, tmp_path):
    pool = TaskPool.from_records(synthetic_records(3, 5, seed=2))
    s = make(mode, pool)
    a = s.select(0, size=6)
    b = s.select(1, size=3, exclude=s.in_flight_mask())
    s.observe(1, {b[0]: [1.0, 0.0]}, {b[0]: [[{"name": "x"}], [{"name": None}]]})  # a later selection first
    s.observe(0, {a[0]: [1.0], a[1]: [0.0, 0.5]})
    s.drop(0, [a[2]])
    save_scheduler_state(s, tmp_path / "envsched.pt")
    r = make(mode, pool)
    load_scheduler_state(r, tmp_path / "envsched.pt")
    same(r.state_dict(), s.state_dict())
    assert r.in_flight() == s.in_flight() == {0: a[3:], 1: b[1:]}
    with pytest.raises(ObservationError, match="was dropped"):
        r.observe(0, {a[2]: [1.0]})
    assert r.select(2, size=5, exclude=r.in_flight_mask()) == s.select(2, size=5, exclude=s.in_flight_mask())
    for sched in (r, s):
        sched.observe(1, {t: [0.5, 1.0] for t in b[1:]})
        sched.drop(0, a[3:])
    same(r.state_dict(), s.state_dict())
