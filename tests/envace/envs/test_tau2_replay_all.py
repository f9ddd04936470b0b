"""Gold replay of every τ²-bench task (airline 50, retail 114, telecom 114) through the pool and the
official evaluator. ~1 s of CPU per airline/retail task (τ² reloads and hashes the database twice per
verification), so this is ``slow``; ``python -m envace.eval`` is not needed for it."""

from __future__ import annotations

import pytest

from envace.envs.base import get_pool

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("domain", ["airline", "retail", "telecom"])
def test_every_gold_replay_scores_one(domain: str) -> None:
    pool = get_pool("tau2", domains=(domain,))
    failures = {}
    for tid in pool.task_ids():
        verdict = pool.replay(tid, pool.gold_actions(tid))
        if verdict.reward != 1.0 or not verdict.passed:
            failures[tid] = verdict.details["reason"]
    assert not failures, failures
