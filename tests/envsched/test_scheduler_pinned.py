"""Selections at the paper's pool size (51 environments x 50 tasks) are pinned.

The scale work (sparse / memory-mapped graph, chunked TF-IDF, pruned candidate search) must leave EnvSched's
choices unchanged where the paper runs it: the batches of steps 0-5 for seed 0, the default config with the paper's
predictor and fixed relation weights (``predictor: paper``, ``relation_weights: paper``; the default additive-logit
predictor and the measured weights are beyond the paper) and fixed
rewards (a deterministic function of task and step, so no learner is involved) are stored in
``data/pinned_selections_51x50.json``, taken on the code before those changes.  Regenerate only for a
deliberate change of the method: ``python tests/envsched/test_scheduler_pinned.py --write``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from envsched import EnvSchedConfig, EnvScheduler, TaskPool
from envsched.synthetic import synthetic_records

FIXTURE = Path(__file__).parent / "data" / "pinned_selections_51x50.json"


STEPS = 6  # selections of steps 0..5, observations of steps 0..4


def fixed_rewards(node: int, step: int, k: int = 8) -> list[float]:
    """K rewards in [0, 1] that depend only on the task and the step (spread varies from task to task)."""
    return [((node * 7 + step * 3 + j * (node % 5)) % 9) / 8.0 for j in range(k)]


def run(cfg: EnvSchedConfig | None = None) -> dict[str, list]:
    pool = TaskPool.from_records(synthetic_records(51, 50, seed=0))
    sched = EnvScheduler(pool, cfg or EnvSchedConfig(relation_weights="paper", predictor="paper"))
    batches, q = [], []
    for step in range(STEPS):
        ids = sched.select(step)
        batches.append(ids)
        if step < STEPS - 1:
            sched.observe(step, {t: fixed_rewards(pool.index[t], step) for t in ids})
    pred = sched.predict(STEPS)
    q = [round(float(x), 12) for x in pred.q[:: 50]]  # every 50th task's score, as a cheap check of Eq. 13
    return {"batches": batches, "q_every_50th": q}


def test_selections_at_paper_size_are_pinned():
    want = json.loads(FIXTURE.read_text())
    got = run()
    for step, (a, b) in enumerate(zip(got["batches"], want["batches"])):
        assert a == b, f"step {step}: batch differs from the pinned one"
    np.testing.assert_allclose(got["q_every_50th"], want["q_every_50th"], rtol=0, atol=1e-9)


def test_selections_are_the_same_with_rows_read_by_pread(monkeypatch):
    """x_full's rows read from its files by pread (the reader a million-task pool uses) give the pinned batches."""
    from envsched import graph, tfidf

    calls = []
    read_rows = tfidf.DiskCSR.read_rows
    monkeypatch.setattr(graph, "PREAD_MIN_BYTES", 0)
    monkeypatch.setattr(tfidf.DiskCSR, "read_rows", lambda self, rows, c, v: calls.append(len(rows)) or read_rows(self, rows, c, v))
    want = json.loads(FIXTURE.read_text())
    got = run()
    assert calls and got["batches"] == want["batches"]
    np.testing.assert_allclose(got["q_every_50th"], want["q_every_50th"], rtol=0, atol=1e-9)


if __name__ == "__main__" and "--write" in sys.argv:
    FIXTURE.write_text(json.dumps(run(), indent=0) + "\n")
    print(f"wrote {FIXTURE}")
