"""Per-package line-coverage table from a coverage.py data file (used by ``scripts/test.sh --cov``).

    python scripts/coverage_table.py DATA_FILE [--files]

Rows: each top-level package (envace, envsched, trace2env, envllm) and the EnvACE math/engine modules as one group
(envace/advantage.py, envace/toolcall.py, envace/agents/engine.py; docs/results/testing.md's coverage targets).  ``--files``
adds one row per file.  Files of the packages that the run never imported count with all their lines missed.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import coverage

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("envace", "envsched", "trace2env", "envllm")
GROUPS = {"envace math/engine": ("envace/advantage.py", "envace/toolcall.py", "envace/agents/engine.py")}


def table(data_file: str, per_file: bool = False) -> str:
    cov = coverage.Coverage(data_file=data_file)
    cov.load()
    rows: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    files: list[tuple[str, int, int]] = []
    for measured in sorted(cov.get_data().measured_files()):
        try:
            rel = Path(measured).resolve().relative_to(ROOT).as_posix()
        except ValueError:
            continue
        if rel.split("/", 1)[0] not in PACKAGES:
            continue
        _, statements, _, missing, _ = cov.analysis2(measured)
        n, miss = len(statements), len(missing)
        files.append((rel, n, miss))
        for key in [rel.split("/", 1)[0]] + [g for g, members in GROUPS.items() if rel in members]:
            rows[key][0] += n
            rows[key][1] += miss
    width = max([len(r) for r, *_ in files] + [24]) if per_file else 24
    out = [f"{'package':<{width}} {'lines':>7} {'missed':>7} {'cover':>7}"]
    for key in [*PACKAGES, *GROUPS]:
        if key in rows:
            n, miss = rows[key]
            out.append(f"{key:<{width}} {n:>7} {miss:>7} {100.0 * (n - miss) / max(n, 1):>6.1f}%")
    if per_file:
        out.append("")
        out += [f"{rel:<{width}} {n:>7} {miss:>7} {100.0 * (n - miss) / max(n, 1):>6.1f}%" for rel, n, miss in files]
    return "\n".join(out)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    print(table(sys.argv[1], "--files" in sys.argv[2:]))
