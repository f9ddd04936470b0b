"""Where envace keeps what it builds once and reuses (tiny model, parquet data, BFCL scratch files)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$ENVACE_CACHE`` (default ``~/.cache/envace``)."""
    root = os.environ.get("ENVACE_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "envace"
