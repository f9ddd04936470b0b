"""Which code may import which: the three libraries, and the layers inside ``envace``.

envace may import envsched and trace2env; those two never import envace (or verl) and stay usable alone.

Inside ``envace`` every sub-package and top-level module is a unit of one layer (the order is also in
``envace/__init__.py``'s docstring); an import may only reach a unit of a lower layer, or the importer's own unit.
Units of one layer are peers and import none of each other. Lowest first:

1. ``roles`` — the one :class:`~envace.roles.Role` enum (imports no other envace unit: every layer uses it);
2. ``envace`` (the package root), ``cache``, ``loop_config`` (the rollout loop's limits), ``metrics``, ``trackers``,
   ``advantage`` (role-wise GRPO, pure math), ``platform`` (verl's CPU platform, ``hfcpu`` rollout and vLLM-CPU
   hooks: the device layer, which the warm start's in-process decoder reuses) — import no other envace unit;
3. ``envs`` — environment pools, their verifiers, EnvSched pool records;
4. ``toolcall`` (tool-call parsing and rendering over ``envs``' call type), ``rewards`` (judges and reward mixing);
5. ``config`` — the typed ``envace:`` config schema;
6. ``agents`` — the turn engine, observation sources, verl's agent loop;
7. ``models`` — the embedded tiny models and the warm start;
8. ``eval`` — benchmark evaluation;
9. ``verl`` — everything plugged into verl's trainer: plugin entry point, registrations, trainers, runner;
10. ``launch`` — ``scripts/train.sh``'s cluster helpers (``python -m envace.launch``);
11. ``train`` — ``python -m envace.train``: pre-flight, then verl's trainer;
12. ``gpu_smoke``, ``cli`` — commands that drive the ones above.

Every ``import`` and ``from ... import`` counts, at module level or inside a function (``ast`` walks them all),
annotation-only ones (``if TYPE_CHECKING:``) included; and no import cycle may exist among envace's modules (an
annotation-only import never runs, so it makes no cycle). :data:`ALLOWED` names the known exceptions, each with its
reason; it holds nothing that is fixed.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

LAYERS: list[tuple[str, ...]] = [
    ("envace.roles",),
    ("envace", "envace.cache", "envace.loop_config", "envace.metrics", "envace.trackers", "envace.advantage",
     "envace.platform"),
    ("envace.envs",),
    ("envace.toolcall", "envace.rewards"),
    ("envace.config",),
    ("envace.agents",),
    ("envace.models",),
    ("envace.eval",),
    ("envace.verl",),
    ("envace.launch",),
    ("envace.train",),
    ("envace.gpu_smoke", "envace.cli"),
]
RANK = {unit: rank for rank, layer in enumerate(LAYERS) for unit in layer}

#: (importing module, imported module) -> why it is tolerated for now. Empty of anything fixed.
ALLOWED: dict[tuple[str, str], str] = {}


def envace_modules() -> dict[str, Path]:
    mods = {}
    for path in sorted((REPO / "envace").rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the nodes inside ``if TYPE_CHECKING:`` / ``if typing.TYPE_CHECKING:`` bodies (never executed)."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            inside.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return inside


def imported_modules(name: str, path: Path, known: set[str], top: str, *, type_only: bool = True) -> set[str]:
    """The ``top``-package modules ``path`` imports anywhere in its code: ``from a import b`` counts as ``a.b`` when
    that is a module, else as ``a``; relative imports are resolved against the module's package. Without
    ``type_only``, imports under ``if TYPE_CHECKING:`` (annotations only, never run) are left out."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = set() if type_only else _type_checking_only(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == top)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] != top:
                continue
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                out.add(sub if sub in known else module)
    out.discard(name)
    return out


def unit_of(module: str) -> str:
    """The unit of LAYERS ``module`` belongs to: the longest unit name that is ``module`` or a package above it (the
    package root ``envace`` is a unit of its own module only)."""
    parts = module.split(".")
    for n in range(len(parts), 1, -1):
        if ".".join(parts[:n]) in RANK:
            return ".".join(parts[:n])
    if module == "envace":
        return module
    raise AssertionError(f"{module} belongs to no layer: add its unit to LAYERS in {Path(__file__).name}")


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    """Every import, annotation-only ones included (an upward import is upward even when only a type needs it)."""
    mods = envace_modules()
    return {name: imported_modules(name, path, set(mods), "envace") for name, path in mods.items()}


@pytest.fixture(scope="module")
def runtime_graph() -> dict[str, set[str]]:
    """The imports that run (those under ``if TYPE_CHECKING:`` are left out: a type-only back-reference is how a
    module annotates with a class of a module that imports it, without a cycle)."""
    mods = envace_modules()
    return {name: imported_modules(name, path, set(mods), "envace", type_only=False) for name, path in mods.items()}


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


def test_every_envace_module_has_a_layer(graph):
    for module in graph:
        unit_of(module)


def test_no_envace_import_runs_upward_or_between_peers(graph):
    offenders = []
    for module, imports in sorted(graph.items()):
        src = unit_of(module)
        for target in sorted(imports):
            dst = unit_of(target)
            if dst != src and RANK[dst] >= RANK[src] and (module, target) not in ALLOWED:
                offenders.append(f"{module} (layer {RANK[src] + 1}) imports {target} (layer {RANK[dst] + 1})")
    assert not offenders, "\n".join(offenders)


def test_the_allow_list_holds_only_imports_that_still_run_upward(graph):
    fixed = [pair for pair in ALLOWED if pair[1] not in graph.get(pair[0], set())
             or RANK[unit_of(pair[1])] < RANK[unit_of(pair[0])]]
    assert not fixed, f"fixed, remove from ALLOWED: {fixed}"


def test_no_import_cycle_among_envace_modules(runtime_graph):
    try:
        graphlib.TopologicalSorter(runtime_graph).prepare()
    except graphlib.CycleError as exc:
        pytest.fail(f"import cycle: {' -> '.join(exc.args[1])}")


def test_the_checks_see_function_level_imports_and_cycles(tmp_path):
    """The checks fail on what they are meant to catch: an import inside a function, and a two-module cycle."""
    pkg = tmp_path / "envace"
    (pkg / "envs").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "envs" / "__init__.py").write_text("")
    (pkg / "envs" / "pool.py").write_text("def f():\n    from envace.eval import cli\n")
    (pkg / "eval").mkdir()
    (pkg / "eval" / "__init__.py").write_text("")
    (pkg / "eval" / "cli.py").write_text("import typing\nfrom ..envs.pool import f\nif typing.TYPE_CHECKING:\n"
                                         "    from envace.envs import base\n")
    known = {"envace", "envace.envs", "envace.envs.base", "envace.envs.pool", "envace.eval", "envace.eval.cli"}
    graph = {
        "envace.envs.pool": imported_modules("envace.envs.pool", pkg / "envs" / "pool.py", known, "envace"),
        "envace.eval.cli": imported_modules("envace.eval.cli", pkg / "eval" / "cli.py", known, "envace"),
    }
    assert graph == {"envace.envs.pool": {"envace.eval.cli"},
                     "envace.eval.cli": {"envace.envs.pool", "envace.envs.base"}}
    assert imported_modules("envace.eval.cli", pkg / "eval" / "cli.py", known, "envace", type_only=False) == {
        "envace.envs.pool"}
    assert RANK[unit_of("envace.eval.cli")] > RANK[unit_of("envace.envs.pool")]  # the first import runs upward
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter(graph).prepare()
