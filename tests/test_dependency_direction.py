"""envace may import envsched and trace2env; those two never import envace (or verl) and stay usable alone."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("package", ["envsched", "trace2env"])
def test_standalone_libraries_do_not_import_envace_or_verl(package):
    offenders = []
    for path in (REPO / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            offenders += [f"{path.relative_to(REPO)}: {n}" for n in names if n.split(".")[0] in ("envace", "verl")]
    assert not offenders, offenders
