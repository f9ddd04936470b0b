"""mix_rewards: weighted sum, masking, validation."""

from __future__ import annotations

import math

import pytest

from envace.rewards import mix_rewards


def test_weighted_sum_and_details() -> None:
    reward, details = mix_rewards({"verifiable": 1.0, "checklist": 0.25}, {"verifiable": 0.7, "checklist": 0.3})
    assert reward == pytest.approx(0.7 + 0.075)
    assert details["masked"] is False and details["reason"] == ""
    assert details["contributions"] == pytest.approx({"verifiable": 0.7, "checklist": 0.075})
    assert details["reward"] == reward


def test_normalize() -> None:
    reward, _ = mix_rewards({"a": 1.0, "b": 0.0}, {"a": 2.0, "b": 2.0}, normalize=True)
    assert reward == 0.5


def test_masked_component_masks_the_mix() -> None:
    reward, details = mix_rewards(
        {"verifiable": 1.0, "checklist": None},
        {"verifiable": 0.5, "checklist": 0.5},
        reasons={"checklist": "judge timed out"},
    )
    assert reward is None and details["masked"] is True and details["reward"] is None
    assert details["reason"] == "masked component(s): checklist (judge timed out)"


def test_masked_component_with_zero_or_no_weight_does_not_mask() -> None:
    reward, details = mix_rewards(
        {"verifiable": 1.0, "checklist": None, "extra": None}, {"verifiable": 1.0, "checklist": 0}
    )
    assert reward == 1.0 and not details["masked"]
    assert details["weights"] == {"checklist": 0.0, "extra": 0.0, "verifiable": 1.0}


@pytest.mark.parametrize(
    ("components", "weights", "match"),
    [
        ({"a": 1.0}, {"a": 1.0, "b": 0.5}, "not given"),
        ({"a": 1.0}, {"a": 0.0}, "nonzero weight"),
        ({"a": 1.0}, {"a": math.nan}, "finite"),
        ({"a": math.inf}, {"a": 1.0}, "finite number or None"),
        ({"a": "1"}, {"a": 1.0}, "finite number or None"),
    ],
)
def test_invalid_input_raises(components, weights, match) -> None:
    with pytest.raises(ValueError, match=match):
        mix_rewards(components, weights)
