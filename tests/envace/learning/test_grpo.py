"""Plain GRPO acting in the real environment learns on CPU: the run's reward rises over its
own control steps (the measure, the settings and the figures measured: ``conftest.py`` of this folder)."""

from __future__ import annotations

import pytest

# a run (its fixture set-up counts toward its first test) takes 7-14 min on 2 cores
pytestmark = [pytest.mark.slow, pytest.mark.warm_start, pytest.mark.timeout(3600)]

ESTIMATOR = "grpo"


def test_control_without_updates_does_not_drift(run, learning):
    learning.control_does_not_drift(run)


def test_training_raises_the_reward_over_the_control(run, learning):
    learning.training_raises_the_reward(run)
