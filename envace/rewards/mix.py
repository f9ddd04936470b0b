"""Weighted mix of reward components (e.g. a verifiable reward and a checklist-judge reward)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["mix_rewards"]


def mix_rewards(
    components: Mapping[str, float | None],
    weights: Mapping[str, float],
    *,
    normalize: bool = False,
    reasons: Mapping[str, str] | None = None,
) -> tuple[float | None, dict[str, Any]]:
    """``sum(weights[k] * components[k])`` over the weighted components, and the details.

    A component with a nonzero weight that is ``None`` (masked, e.g. a failed judge) masks the mix: the
    reward is ``None`` and ``details["reason"]`` names the masked components (with ``reasons[name]`` when
    given). Components with weight 0 or without a weight are reported but never mask. ``normalize``
    divides by the sum of the nonzero weights. Raises :class:`ValueError` for a weighted component that is
    missing, a non-finite weight or value, or no nonzero weight at all.
    """
    reasons = reasons or {}
    for name, w in weights.items():
        if not isinstance(w, int | float) or not math.isfinite(w):
            raise ValueError(f"weight of {name!r} must be a finite number, got {w!r}")
    active = {name: float(w) for name, w in weights.items() if w != 0}
    if not active:
        raise ValueError(f"mix_rewards needs at least one nonzero weight, got {dict(weights)}")
    missing = sorted(set(active) - set(components))
    if missing:
        raise ValueError(f"weighted reward component(s) {missing} not given (have {sorted(components)})")
    for name, value in components.items():
        if value is not None and (not isinstance(value, int | float) or not math.isfinite(value)):
            raise ValueError(f"reward component {name!r} must be a finite number or None, got {value!r}")

    details: dict[str, Any] = {
        "components": dict(components),
        "weights": {name: float(weights.get(name, 0.0)) for name in sorted(set(components) | set(weights))},
        "normalized": normalize,
    }
    masked = [name for name in active if components[name] is None]
    if masked:
        why = ", ".join(f"{name} ({reasons[name]})" if reasons.get(name) else name for name in masked)
        details.update(masked=True, reason=f"masked component(s): {why}", contributions={}, reward=None)
        return None, details

    contributions = {name: w * float(components[name]) for name, w in active.items()}  # type: ignore[arg-type]
    reward = sum(contributions.values())
    if normalize:
        reward /= sum(active.values())
    details.update(masked=False, reason="", contributions=contributions, reward=reward)
    return reward, details
