"""Plain GRPO acting in the real environment learns on CPU: the run's reward rises over its
own control steps (the measure and the settings: ``conftest.py`` of this folder; measured figures:
``docs/results/learning.md``).

``extended``: a second opinion CI leaves out (``scripts/test.sh --extended`` runs it). It learns through verl's own
GRPO estimator; what envace adds on this path (the trajectory layout's one masked sequence, the real observation
source) is checked by the fast tests of ``tests/envace/agents/test_verl_loop.py``, and CI's learning run is EnvACE's
(``test_grpo_rolewise.py``). Run it after a change to the trajectory layout, the real source or verl's pin."""

from __future__ import annotations

import pytest

# a whole training run (its fixture set-up counts toward its first test): more than CI's 1800 s default under load
pytestmark = [pytest.mark.slow, pytest.mark.heavy, pytest.mark.extended, pytest.mark.warm_start,
              pytest.mark.timeout(3600)]

ESTIMATOR = "grpo"


def test_control_without_updates_does_not_drift(run, learning):
    learning.control_does_not_drift(run)


def test_training_raises_the_reward_over_the_control(run, learning):
    learning.training_raises_the_reward(run)
