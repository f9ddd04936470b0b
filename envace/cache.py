"""Where envace keeps what it builds once and reuses: the ``builtin:`` models, a one-node run's generated parquet
data and worldbooks, BFCL's scratch files. A multi-node run generates its data under its run directory instead
(:func:`envace.train.generated_dir`): the cache defaults to the home directory, which the nodes may not share."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$ENVACE_CACHE`` (default ``~/.cache/envace``)."""
    root = os.environ.get("ENVACE_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "envace"
