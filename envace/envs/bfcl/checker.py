"""BFCL's official multi-turn checker, isolated: a fresh model name per verification, its cached backend
instances evicted afterwards, under a lock."""

from __future__ import annotations

import json
import re
import threading
import uuid
from collections.abc import Mapping
from typing import Any

from envace.envs.bfcl.upstream import multi_turn_checker, multi_turn_irrelevance_checker, multi_turn_utils

_CHECKER_CACHE_LOCK = threading.Lock()
_DROP_DETAIL_KEYS = frozenset(
    {
        "execution_result",
        "model_instance_state",
        "ground_truth_instance_state",
        "model_response (including all previous turns)",
    }
)


def _evict_checker_cache(model_name: str) -> None:
    """Delete the ``*_instance`` globals the checker cached for ``model_name`` (both model and GT)."""
    namespace = vars(multi_turn_utils)
    prefix = re.sub(r"[-./:]", "_", model_name) + "_"
    with _CHECKER_CACHE_LOCK:
        for key in [k for k in list(namespace) if k.startswith(prefix) and k.endswith("_instance")]:
            namespace.pop(key, None)


def compact(value: Any, limit: int = 2000) -> Any:
    """JSON-able, size-bounded copy of checker details (instance states can be megabytes)."""
    if isinstance(value, dict):
        value = {k: v for k, v in value.items() if k not in _DROP_DETAIL_KEYS}
    try:
        text = json.dumps(value, default=repr)
    except (TypeError, ValueError):
        text = repr(value)
    if len(text) <= limit:
        return json.loads(text) if text.startswith(("{", "[")) else text
    return text[:limit] + f"... [{len(text) - limit} more chars]"


def run_official_checker(
    decoded: list[list[list[str]]],
    ground_truth: list[list[str]],
    entry: Mapping[str, Any],
    category: str,
    check_irrelevance: bool = True,
) -> dict[str, Any]:
    """Run ``multi_turn_checker`` (then ``multi_turn_irrelevance_checker``) with an isolated cache.

    ``decoded`` is turns → steps → call strings. Returns the checker's result dict plus ``"checker"``
    (which checker produced it). Thread-safe.
    """
    model_name = f"envace_{uuid.uuid4().hex}"
    checker_entry = {
        "id": entry["id"],
        "initial_config": entry["initial_config"],
        "involved_classes": entry["involved_classes"],
    }
    try:
        result = multi_turn_checker(decoded, ground_truth, checker_entry, category, model_name)
        result["checker"] = "multi_turn_checker"
        if result.get("valid") and check_irrelevance and any(len(turn) == 0 for turn in ground_truth):
            result = multi_turn_irrelevance_checker(decoded, ground_truth)
            result["checker"] = "multi_turn_irrelevance_checker"
    finally:
        _evict_checker_cache(model_name)
    return result


