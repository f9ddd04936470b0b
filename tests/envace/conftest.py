"""Fixtures of the envace tests: ``train_sh``, a run of ``scripts/train.sh`` for the end-to-end trainer tests (the
fake OpenAI server and its reply builders are in ``tests/conftest.py``)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _train_sh(run_dir: Path, *overrides: str, timeout: int = 1800) -> str:
    """``scripts/train.sh trainer.default_local_dir=RUN_DIR OVERRIDES…`` on its own Ray cluster; asserts exit 0 and
    returns stdout + stderr (verl's console metrics lines included)."""
    env = dict(os.environ, RAY_DEDUP_LOGS="0")
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [str(REPO / "scripts" / "train.sh"), f"trainer.default_local_dir={run_dir}", *overrides],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-8000:]
    return out


@pytest.fixture(scope="session")
def train_sh() -> Callable[..., str]:
    return _train_sh
