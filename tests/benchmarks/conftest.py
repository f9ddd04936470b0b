"""The benchmark scripts (``benchmarks/*.py``, not a package) are importable by name in these tests: their folder goes
on ``sys.path`` before the test modules load."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
