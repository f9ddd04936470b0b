"""Which code may import which: the three libraries, the layers inside each, and the turn engine's promise.

envace may import envsched and trace2env; those two never import envace (or verl) and stay usable alone. All three
may import ``envllm``, the LLM-client core they share (the endpoint config and the error taxonomy), which imports none
of them (nor verl).

Inside each library every unit is of one layer (each order is also in the package's ``__init__.py`` docstring, and
:func:`test_the_layer_orders_are_written_in_the_package_docstrings` keeps the two in step); an import may only reach
a unit of a lower layer, or the importer's own unit. Units of one layer are peers and import none of each other. In
``envace`` a unit is a sub-package or a top-level module; ``envsched`` and ``trace2env`` are flat, so there a unit is
a module. Lowest first:

``envace`` (:data:`LAYERS`):

1. ``roles`` — the one :class:`~envace.roles.Role` enum (imports no other envace unit: every layer uses it);
2. ``envace`` (the package root), ``cache``, ``loop_config`` (the rollout loop's limits, the test-time rehearsal
   settings, the prompt files' loader), ``metrics``, ``trackers``, ``advantage`` (role-wise GRPO, pure math),
   ``platform`` (verl's CPU platform, ``hfcpu`` rollout and vLLM-CPU hooks: the device layer, which the warm start's
   in-process decoder reuses) — import no other envace unit;
3. ``envs`` — the environment protocol, the pools and their verifiers;
4. ``data`` — training data built from the pools (verl parquet, CM2 conversion, EnvSched records, traces,
   worldbooks): it reads pools, no pool reads it;
5. ``toolcall`` (tool-call parsing and rendering over ``envs``' call type), ``rewards`` (judges and reward mixing);
6. ``config`` — the typed ``envace:`` config schema;
7. ``agents`` — the turn engine, observation sources, verl's agent loop;
8. ``models`` — the embedded tiny models and the warm start;
9. ``eval`` — benchmark evaluation;
10. ``verl`` — everything plugged into verl's trainer: plugin entry point, registrations, trainers, runner;
11. ``launch`` — ``scripts/train.sh``'s cluster helpers (``python -m envace.launch``);
12. ``train`` — ``python -m envace.train``: pre-flight, then verl's trainer;
13. ``gpu_smoke``, ``cli`` — commands that drive the ones above.

``envsched`` (:data:`ENVSCHED_LAYERS`):

1. ``config``, ``pool``, ``tfidf``, ``synthetic`` — import no other envsched module;
2. ``estimate`` (the equations over arrays), ``operations`` (App. E descriptions and their extractors);
3. ``relations`` (Eq. 3' weights measured on the estimates' predictions), ``predictor``, ``filters``, ``graph`` (Eq. 1);
4. ``graph_cache``, ``neighbors``, ``select`` — over the graph;
5. ``scheduler`` — the loop that drives them;
6. ``envsched`` (the package root) — the public API it re-exports.

``trace2env`` (:data:`TRACE2ENV_LAYERS`):

1. ``models``, ``cliargs`` — import no other trace2env module;
2. ``engine``, ``ingest``, ``providers``, ``llm``;
3. ``induce``, ``applicability``, ``judge``;
4. ``package``;
5. ``build``, ``runtime``;
6. ``agent``;
7. ``baselines``;
8. ``evaluate``;
9. ``consistency``;
10. ``trace2env`` (the package root: the public API), ``__main__`` (the command line).

``envllm`` (:data:`ENVLLM_LAYERS`):

1. ``core`` (the error taxonomy, reading a reply, the repair loop), ``endpoint`` — import no other envllm module;
2. ``envllm`` (the package root) — the public API it re-exports.

Every ``import`` and ``from ... import`` counts, at module level or inside a function (``ast`` walks them all),
annotation-only ones (``if TYPE_CHECKING:``) included; and no import cycle may exist among a library's modules (an
annotation-only import never runs, so it makes no cycle; one inside a function does). :data:`ALLOWED` names the
known exceptions, each with its reason; it holds nothing that is fixed.

The turn engine (``envace/agents/engine.py``) imports neither verl nor an HTTP client (its docstring): checked
statically over every envace module that importing it runs (its imports, theirs, and the packages above each, at
module level or inside a function) for the third-party modules they import (:data:`ENGINE_FORBIDDEN`), and at run
time in a fresh interpreter, which also sees what those third-party packages import in turn.
"""

from __future__ import annotations

import ast
import graphlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

LAYERS: list[tuple[str, ...]] = [
    ("envace.roles",),
    ("envace", "envace.cache", "envace.loop_config", "envace.metrics", "envace.trackers", "envace.advantage",
     "envace.platform"),
    ("envace.envs",),
    ("envace.data",),
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
ENVSCHED_LAYERS: list[tuple[str, ...]] = [
    ("envsched.config", "envsched.pool", "envsched.tfidf", "envsched.synthetic"),
    ("envsched.estimate", "envsched.operations"),
    ("envsched.relations", "envsched.predictor", "envsched.filters", "envsched.graph"),
    ("envsched.graph_cache", "envsched.neighbors", "envsched.select"),
    ("envsched.scheduler",),
    ("envsched",),
]
TRACE2ENV_LAYERS: list[tuple[str, ...]] = [
    ("trace2env.models", "trace2env.cliargs"),
    ("trace2env.engine", "trace2env.ingest", "trace2env.providers", "trace2env.llm"),
    ("trace2env.induce", "trace2env.applicability", "trace2env.judge"),
    ("trace2env.package",),
    ("trace2env.build", "trace2env.runtime"),
    ("trace2env.agent",),
    ("trace2env.baselines",),
    ("trace2env.evaluate",),
    ("trace2env.consistency",),
    ("trace2env", "trace2env.__main__"),
]
ENVLLM_LAYERS: list[tuple[str, ...]] = [("envllm.core", "envllm.endpoint"), ("envllm",)]
PACKAGES: dict[str, list[tuple[str, ...]]] = {"envace": LAYERS, "envsched": ENVSCHED_LAYERS,
                                              "trace2env": TRACE2ENV_LAYERS, "envllm": ENVLLM_LAYERS}
RANKS: dict[str, dict[str, int]] = {
    top: {unit: rank for rank, layer in enumerate(layers) for unit in layer} for top, layers in PACKAGES.items()}
RANK = RANKS["envace"]

#: (importing module, imported module) -> why it is tolerated for now. Empty of anything fixed.
ALLOWED: dict[tuple[str, str], str] = {}

ENGINE = "envace.agents.engine"
#: what the turn engine promises not to import: verl, and any HTTP client (the OpenAI and LiteLLM clients included)
ENGINE_FORBIDDEN = ("verl", "openai", "litellm", "httpx", "httpcore", "requests", "aiohttp", "urllib3", "websockets",
                    "http.client", "urllib.request")


def modules_of(top: str, root: Path = REPO) -> dict[str, Path]:
    """Every module of package ``top`` under ``root``: dotted name -> file."""
    mods = {}
    for path in sorted((root / top).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def envace_modules() -> dict[str, Path]:
    return modules_of("envace")


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the nodes inside ``if TYPE_CHECKING:`` / ``if typing.TYPE_CHECKING:`` bodies (never executed)."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            inside.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return inside


def _imports(name: str, path: Path, type_only: bool) -> list[tuple[str, list[str]]]:
    """(module, names) of every import in ``path``: ``import a.b`` -> ("a.b", []), ``from a import b, c`` ->
    ("a", ["b", "c"]), relative imports resolved against the module's package. Without ``type_only``, imports under
    ``if TYPE_CHECKING:`` are left out."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = set() if type_only else _type_checking_only(tree)
    out: list[tuple[str, list[str]]] = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out.append((module, [a.name for a in node.names]))
    return out


def imported_modules(name: str, path: Path, known: set[str], top: str, *, type_only: bool = True) -> set[str]:
    """The ``top``-package modules ``path`` imports anywhere in its code: ``from a import b`` counts as ``a.b`` when
    that is a module, else as ``a``; relative imports are resolved against the module's package. Without
    ``type_only``, imports under ``if TYPE_CHECKING:`` (annotations only, never run) are left out."""
    out: set[str] = set()
    for module, names in _imports(name, path, type_only):
        if module.split(".")[0] != top:
            continue
        if not names:
            out.add(module)
        for alias in names:
            sub = f"{module}.{alias}"
            out.add(sub if sub in known else module)
    out.discard(name)
    return out


def external_imports(name: str, path: Path, top: str) -> set[str]:
    """The modules outside ``top`` that ``path`` imports when it runs (``if TYPE_CHECKING:`` left out), in full:
    ``from urllib import request`` gives ``urllib`` and ``urllib.request``."""
    out: set[str] = set()
    for module, names in _imports(name, path, type_only=False):
        if module.split(".")[0] == top:
            continue
        out.add(module)
        out.update(f"{module}.{alias}" for alias in names)
    return out


def forbidden(module: str) -> str | None:
    """The entry of :data:`ENGINE_FORBIDDEN` that ``module`` is or lies under, or None."""
    return next((f for f in ENGINE_FORBIDDEN if module == f or module.startswith(f + ".")), None)


def unit_of(module: str) -> str:
    """The unit of its package's layers ``module`` belongs to: the longest unit name that is ``module`` or a package
    above it (a package root is a unit of its own module only)."""
    top = module.split(".")[0]
    rank = RANKS.get(top, {})
    parts = module.split(".")
    for n in range(len(parts), 1, -1):
        if ".".join(parts[:n]) in rank:
            return ".".join(parts[:n])
    if module == top and top in rank:
        return module
    raise AssertionError(f"{module} belongs to no layer: add its unit to the layers of {top} in {Path(__file__).name}")


def import_graph(top: str, *, type_only: bool, root: Path = REPO) -> dict[str, set[str]]:
    mods = modules_of(top, root)
    return {name: imported_modules(name, path, set(mods), top, type_only=type_only) for name, path in mods.items()}


@pytest.fixture(scope="module")
def graphs() -> dict[str, dict[str, set[str]]]:
    """Every import, annotation-only ones included (an upward import is upward even when only a type needs it)."""
    return {top: import_graph(top, type_only=True) for top in PACKAGES}


@pytest.fixture(scope="module")
def runtime_graphs() -> dict[str, dict[str, set[str]]]:
    """The imports that run (those under ``if TYPE_CHECKING:`` are left out: a type-only back-reference is how a
    module annotates with a class of a module that imports it, without a cycle)."""
    return {top: import_graph(top, type_only=False) for top in PACKAGES}


#: the top-level packages each standalone library never imports
NOT_IMPORTED: dict[str, tuple[str, ...]] = {"envsched": ("envace", "verl"), "trace2env": ("envace", "verl"),
                                            "envllm": ("envace", "envsched", "trace2env", "verl")}


@pytest.mark.parametrize("package", list(NOT_IMPORTED))
def test_standalone_libraries_do_not_import_envace_or_verl(package):
    offenders = []
    for path in (REPO / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            offenders += [f"{path.relative_to(REPO)}: {n}" for n in names if n.split(".")[0] in NOT_IMPORTED[package]]
    assert not offenders, offenders


@pytest.mark.parametrize("package", list(PACKAGES))
def test_every_module_has_a_layer_and_every_unit_a_module(graphs, package):
    for module in graphs[package]:
        unit_of(module)
    stale = [unit for unit in RANKS[package] if not any(m == unit or m.startswith(unit + ".") for m in graphs[package])]
    assert not stale, f"units of no module, remove them from the layers of {package}: {stale}"


@pytest.mark.parametrize("package", list(PACKAGES))
def test_no_import_runs_upward_or_between_peers(graphs, package):
    offenders = []
    for module, imports in sorted(graphs[package].items()):
        src = unit_of(module)
        for target in sorted(imports):
            dst = unit_of(target)
            if dst != src and RANKS[package][dst] >= RANKS[package][src] and (module, target) not in ALLOWED:
                offenders.append(f"{module} (layer {RANKS[package][src] + 1}) imports {target} "
                                 f"(layer {RANKS[package][dst] + 1})")
    assert not offenders, "\n".join(offenders)


def test_the_allow_list_holds_only_imports_that_still_run_upward(graphs):
    def still_upward(importer: str, imported: str) -> bool:
        rank = RANKS[importer.split(".")[0]]
        graph = graphs[importer.split(".")[0]]
        return imported in graph.get(importer, set()) and rank[unit_of(imported)] >= rank[unit_of(importer)]

    fixed = [pair for pair in ALLOWED if not still_upward(*pair)]
    assert not fixed, f"fixed, remove from ALLOWED: {fixed}"


@pytest.mark.parametrize("package", list(PACKAGES))
def test_no_import_cycle(runtime_graphs, package):
    try:
        graphlib.TopologicalSorter(runtime_graphs[package]).prepare()
    except graphlib.CycleError as exc:
        pytest.fail(f"import cycle: {' -> '.join(exc.args[1])}")


def written_layers(top: str, root: Path = REPO) -> list[set[str]]:
    """The numbered list of ``top/__init__.py``'s docstring: per item (``N. `` and its indented continuation lines),
    the units of ``top`` it names in double backquotes (``x`` names ``top.x``, or ``top`` itself)."""
    doc = ast.get_docstring(ast.parse((root / top / "__init__.py").read_text(encoding="utf-8"))) or ""
    items: list[str] = []
    open_item = False
    for line in doc.splitlines():
        if re.match(r"\d+\. ", line):
            items.append(line)
            open_item = True
        elif open_item and line.startswith(" ") and line.strip():
            items[-1] += " " + line
        else:
            open_item = False
    units = []
    for item in items:
        names = {n if n == top or n.startswith(top + ".") else f"{top}.{n}" for n in re.findall(r"``([\w.]+)``", item)}
        units.append(names & set(RANKS[top]))
    return units


@pytest.mark.parametrize("package", list(PACKAGES))
def test_the_layer_orders_are_written_in_the_package_docstrings(package):
    assert written_layers(package) == [set(layer) for layer in PACKAGES[package]], (
        f"{package}/__init__.py's docstring and {Path(__file__).name} disagree on the layer order")


def engine_closure(graph: dict[str, set[str]], start: str = ENGINE) -> set[str]:
    """Every module of ``start``'s package that importing ``start`` runs: its imports, theirs, and each one's parent
    packages (importing ``a.b.c`` runs ``a/__init__.py`` and ``a/b/__init__.py`` first)."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        parts = module.split(".")
        todo += [".".join(parts[:n]) for n in range(1, len(parts))]
        todo += sorted(graph.get(module, ()))
    return seen


def engine_offenders(root: Path = REPO) -> tuple[set[str], list[str]]:
    """(the envace modules importing the engine runs, "module imports forbidden" for each forbidden import)."""
    mods = modules_of("envace", root)
    graph = {name: imported_modules(name, path, set(mods), "envace", type_only=False) for name, path in mods.items()}
    closure = engine_closure(graph) & set(mods)
    offenders = [f"{m} imports {ext}" for m in sorted(closure)
                 for ext in sorted(external_imports(m, mods[m], "envace")) if forbidden(ext)]
    return closure, offenders


def test_the_turn_engine_imports_neither_verl_nor_an_http_client():
    closure, offenders = engine_offenders()
    assert {ENGINE, "envace.agents", "envace.envs.base"} <= closure  # the walk follows imports and parent packages
    assert not offenders, f"{ENGINE} must import neither verl nor an HTTP client (its docstring):\n" + "\n".join(
        offenders)


def test_importing_the_turn_engine_loads_neither_verl_nor_an_http_client():
    """What a fresh interpreter loads for ``import envace.agents.engine``: third-party packages' own imports too."""
    code = ("import json, sys\nbefore = set(sys.modules)\nimport envace.agents.engine as e\n"
            "print(json.dumps({'file': e.__file__, 'loaded': sorted(set(sys.modules) - before)}))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert Path(result["file"]).resolve() == (REPO / "envace" / "agents" / "engine.py").resolve()
    assert "envace.envs.base" in result["loaded"]
    loaded = sorted({forbidden(m) for m in result["loaded"]} - {None})
    assert not loaded, f"importing {ENGINE} loaded {', '.join(loaded)}"


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


def test_the_engine_check_sees_a_forbidden_import_two_modules_away(tmp_path):
    """verl imported inside a function of a module the engine's import reaches through a parent package, and an HTTP
    client under ``if TYPE_CHECKING:`` (never run, so allowed)."""
    pkg = tmp_path / "envace"
    (pkg / "agents").mkdir(parents=True)
    (pkg / "envs").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "agents" / "__init__.py").write_text("from envace.envs import base\n")
    (pkg / "agents" / "engine.py").write_text("import asyncio\nfrom typing import TYPE_CHECKING\n"
                                              "if TYPE_CHECKING:\n    import httpx\n")
    (pkg / "envs" / "__init__.py").write_text("")
    (pkg / "envs" / "base.py").write_text("def f():\n    from verl.utils import tokenizer\n")
    closure, offenders = engine_offenders(tmp_path)
    assert closure == {"envace", "envace.agents", "envace.agents.engine", "envace.envs", "envace.envs.base"}
    assert offenders == ["envace.envs.base imports verl.utils", "envace.envs.base imports verl.utils.tokenizer"]


def test_the_docstring_reader_sees_each_numbered_item(tmp_path):
    (tmp_path / "envsched").mkdir()
    (tmp_path / "envsched" / "__init__.py").write_text(
        '"""Layers:\n\n1. ``config``, ``pool`` and the\n   ``tfidf`` module;\n2. ``estimate``\n\n'
        'Later text naming ``scheduler``.\n"""\n')
    assert written_layers("envsched", tmp_path) == [{"envsched.config", "envsched.pool", "envsched.tfidf"},
                                                    {"envsched.estimate"}]
