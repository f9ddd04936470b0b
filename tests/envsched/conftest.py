"""Shared by the EnvSched tests: a small pool with its static graph, a pool of more environments than a batch touches,
and a loop that runs a scheduler through select → check → observe for a few steps."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from envsched import EnvSchedConfig, EnvScheduler, TaskPool, build_static_graph
from envsched.synthetic import synthetic_records


@pytest.fixture(scope="module")
def small():
    """(pool, config, static graph) of 6 environments x 8 tasks, TF-IDF in float64."""
    pool = TaskPool.from_records(synthetic_records(6, 8, seed=3))
    cfg = EnvSchedConfig(tfidf_float32=False)
    return pool, cfg, build_static_graph(pool, cfg)


@pytest.fixture(scope="module")
def many_envs_pool():
    return TaskPool.from_records(synthetic_records(30, 8, seed=4))  # more environments than a batch touches


def _run_steps(pool: TaskPool, cfg: EnvSchedConfig, steps: int,
               check: Callable[[EnvScheduler, int], None]) -> EnvScheduler:
    sched = EnvScheduler(pool, cfg)
    rng = np.random.default_rng(1)
    for step in range(steps):
        ids = sched.select(step)
        check(sched, step)
        sched.observe(step, {t: (rng.random(8) < rng.random()).astype(float).tolist() for t in ids})
    return sched


@pytest.fixture
def run_steps():
    """``run_steps(pool, cfg, steps, check)``: a fresh scheduler over ``pool`` selects, ``check(sched, step)`` runs,
    and it observes 8 seeded random rewards per selected task, ``steps`` times; returns the scheduler."""
    return _run_steps
