"""bfcl_eval, imported with ``BFCL_PROJECT_ROOT`` redirected first.

``bfcl_eval`` creates ``result/``, ``score/`` and ``.file_locks/`` under ``BFCL_PROJECT_ROOT`` (default: inside
site-packages) when it is imported, so this module points it at ``$ENVACE_CACHE/bfcl`` before importing it; every
module of this package imports bfcl_eval through here."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from envace.cache import cache_dir


def _bfcl_project_root() -> Path:
    return cache_dir() / "bfcl"


if "BFCL_PROJECT_ROOT" not in os.environ:
    if "bfcl_eval.constants.eval_config" in sys.modules:  # pragma: no cover - depends on import order
        import warnings

        warnings.warn(
            "bfcl_eval was imported before envace.envs.bfcl; BFCL_PROJECT_ROOT could not be redirected "
            "and bfcl_eval may write result/score folders into site-packages",
            RuntimeWarning,
            stacklevel=2,
        )
    else:
        _root = _bfcl_project_root()
        _root.mkdir(parents=True, exist_ok=True)
        os.environ["BFCL_PROJECT_ROOT"] = str(_root)

from bfcl_eval.constants.default_prompts import DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC
from bfcl_eval.constants.executable_backend_config import (
    CLASS_FILE_PATH_MAPPING,
    STATELESS_CLASSES,
)
from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import (
    multi_turn_checker,
    multi_turn_irrelevance_checker,
)
from bfcl_eval.utils import load_dataset_entry, load_ground_truth_entry

__all__ = [
    "CLASS_FILE_PATH_MAPPING",
    "DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC",
    "STATELESS_CLASSES",
    "load_dataset_entry",
    "load_ground_truth_entry",
    "multi_turn_checker",
    "multi_turn_irrelevance_checker",
    "multi_turn_utils",
]
