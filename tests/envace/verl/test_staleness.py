"""The staleness of a trained batch (envace/verl/trainer.py ``staleness_metrics``), from the weight-version tags verl's
agent-loop worker puts on every TransferQueue row: per trajectory, not per row, and checked against the bound verl's
``drop`` strategy guarantees."""

from __future__ import annotations

import pytest

from envace.verl.trainer import staleness_metrics


def tag(dispatch: int, lo: int, hi: int, **extra):
    return {"global_steps": dispatch, "min_global_steps": lo, "max_global_steps": hi, **extra}


def test_a_sync_batch_is_never_stale():
    """In a sync step N every rollout is generated on version N - 1, the one being updated."""
    keys = ["u1_0_0", "u1_0_1", "u1_1_0", "u2_0_0"]
    out = staleness_metrics(keys, [tag(5, 4, 4)] * 4, global_steps=5, threshold=8)
    assert out["envace/staleness/mean"] == out["envace/staleness/max"] == 0.0
    assert out["envace/staleness/violations"] == 0.0 and out["envace/staleness/bound"] == 7.0
    assert out["envace/groups/version_span_max"] == 1.0


def test_each_trajectory_counts_once_and_padding_not_at_all():
    """u1_0 has three outputs on version 2 (lag 3 at step 6), u1_1 one on version 4 (lag 1): the mean is 2, not the
    row mean 2.5; verl's padding rows carry no versions of their own."""
    keys = ["u1_0_0", "u1_0_1", "u1_0_2", "u1_1_0", "pad_0_0"]
    tags = [tag(3, 2, 2)] * 3 + [tag(3, 4, 5), {"is_padding": True, "min_global_steps": 0, "max_global_steps": 0}]
    out = staleness_metrics(keys, tags, global_steps=6, threshold=4)
    assert out["envace/staleness/mean"] == pytest.approx(2.0) and out["envace/staleness/max"] == 3.0
    assert out["envace/staleness/violations"] == 0.0  # bound 3
    assert out["envace/groups/version_span_mean"] == out["envace/groups/version_span_max"] == 4.0  # versions 2..5


def test_a_trajectory_beyond_the_drop_bound_is_a_violation():
    """With threshold 2, verl's drop strategy trains a group dispatched at t only at steps N ≤ t + 1, generated on
    versions ≥ t - 1: a lag of at most 1. A rollout on version 1 trained at step 4 (lag 2) breaks it."""
    keys = ["u1_0_0", "u2_0_0", "u2_1_0"]
    out = staleness_metrics(keys, [tag(3, 2, 3), tag(2, 1, 1), tag(2, 1, 2)], global_steps=4, threshold=2)
    assert out["envace/staleness/max"] == 2.0 and out["envace/staleness/bound"] == 1.0
    assert out["envace/staleness/violations"] == 2.0
    assert out["envace/groups/version_span_max"] == 2.0 and out["envace/groups/version_span_mean"] == 2.0


def test_without_a_threshold_there_is_no_bound_and_without_versions_no_metric():
    out = staleness_metrics(["u1_0_0"], [tag(1, 0, 0)], global_steps=3, threshold=None)
    assert out["envace/staleness/max"] == 2.0 and "envace/staleness/bound" not in out
    assert staleness_metrics(["u1_0_0"], [{"global_steps": 1}], global_steps=1, threshold=2) == {}
