"""BFCL's executable backend classes: fresh instances per episode, public method signatures, method owners."""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

from envace.envs.bfcl.upstream import CLASS_FILE_PATH_MAPPING, STATELESS_CLASSES


@functools.cache
def _backend_class(class_name: str) -> type:
    try:
        module_path = CLASS_FILE_PATH_MAPPING[class_name]
    except KeyError:
        raise KeyError(f"BFCL backend class {class_name!r} is unknown to bfcl_eval") from None
    return getattr(importlib.import_module(module_path), class_name)


@functools.cache
def public_signatures(class_name: str) -> dict[str, inspect.Signature]:
    """Public method name → signature without ``self`` (what the checker exposes as functions)."""
    cls = _backend_class(class_name)
    out: dict[str, inspect.Signature] = {}
    for name, func in inspect.getmembers(cls, predicate=inspect.isfunction):
        if name.startswith("_"):
            continue
        sig = inspect.signature(func)
        out[name] = sig.replace(parameters=list(sig.parameters.values())[1:])
    return out


def new_instances(entry: Mapping[str, Any], long_context: bool) -> dict[str, Any]:
    """Fresh backend instances in the task's initial state (same recipe as bfcl_eval's executor)."""
    instances: dict[str, Any] = {}
    for class_name in entry["involved_classes"]:
        inst = _backend_class(class_name)()
        if class_name not in STATELESS_CLASSES:
            inst._load_scenario(copy.deepcopy(entry["initial_config"].get(class_name, {})), long_context=long_context)
        instances[class_name] = inst
    return instances


def method_owner(involved_classes: Sequence[str]) -> dict[str, str]:
    """Tool name → owning class, later classes winning as in the checker's name mapping."""
    owner: dict[str, str] = {}
    for class_name in involved_classes:
        for name in public_signatures(class_name):
            owner[name] = class_name
    return owner


