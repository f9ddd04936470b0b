"""The immutable worldbook package on disk: compile (atomic publish), load (hashes checked), search.

Paper §4.1: "The resulting worldbook is stored as an immutable package, fixed for online simulation and
reused across agent rollouts"; Appendix C.1 (Table 12) lists its artifacts. Layout::

    manifest.json                   WorldbookManifest: ids, counts, sha256 of every other file
    action_schema.json              {"actions": [ActionSpec]}
    state_schema.json               {"fields": [StateField]}
    rules/index.jsonl               executable rules (status "supported")
    candidates/rules.jsonl          every reviewed rule, whatever its status
    invariants.json                 [Invariant]
    renderer/contracts.json         [RenderContract]
    demonstrations/transitions.jsonl
    evidence/sources.json           traces: id, episode, metadata
    evidence/transitions.jsonl      every aligned Transition, observation text verbatim
    validation/replay.json          the replay review (support / counterexamples / coverage)
    provenance.json                 artifact id → source references
    index.sqlite                    evidence table + FTS5 index ``evidence_fts`` (stdlib sqlite3)

:func:`load_worldbook` refuses, naming the file (:class:`WorldbookIntegrityError`), a package whose manifest was
edited (its ``digest`` is the sha256 of its other fields, and the book's identity), whose file is changed,
missing, not listed or outside the package (the listed files are exactly the artifacts above), or whose
artifact does not parse and validate (every one, ``index.sqlite`` included; counts cross-checked with the
manifest). A loaded :class:`Worldbook` is frozen.

:func:`load_worldbooks` loads one package or a folder of them (one per environment, as
``scripts/build_worldbook.sh`` writes) all or nothing: an entry of the folder that is not a valid package
refuses the whole folder, naming the entry and its problem; two books for one environment are refused too.
The manifest records the ``pool`` and ``env_id`` metadata of the traces a book was built from
(``source_pool``, ``source_environments``); :func:`compile_worldbook` refuses traces of several pools.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import tempfile
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from .induce import retrieve_exact
from .models import (
    SCHEMA_VERSION,
    ActionSpec,
    Demonstration,
    Invariant,
    RenderContract,
    SourceRef,
    StateField,
    Trace,
    Transition,
    TransitionRule,
    WorldbookManifest,
)

__all__ = ["Worldbook", "WorldbookIntegrityError", "check_worldbook", "compile_worldbook", "load_worldbook",
           "load_worldbooks", "manifest_digest", "source_pool"]

MANIFEST = "manifest.json"
#: every file of a package besides the manifest; the manifest must list exactly these
ARTIFACTS = frozenset({
    "action_schema.json", "state_schema.json", "rules/index.jsonl", "candidates/rules.jsonl", "invariants.json",
    "renderer/contracts.json", "demonstrations/transitions.jsonl", "evidence/sources.json",
    "evidence/transitions.jsonl", "validation/replay.json", "provenance.json", "index.sqlite",
})


class WorldbookIntegrityError(RuntimeError):
    """A package that fails verification; ``path`` is the offending file (relative to the package)."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


@dataclass(frozen=True)
class Worldbook:
    """The loaded, verified, immutable environment knowledge ``K_E`` (paper §4.2)."""

    root: Path
    manifest: WorldbookManifest
    actions: tuple[ActionSpec, ...]
    state_fields: tuple[StateField, ...]
    rules: tuple[TransitionRule, ...]
    candidate_rules: tuple[TransitionRule, ...]
    invariants: tuple[Invariant, ...]
    contracts: tuple[RenderContract, ...]
    demonstrations: tuple[Demonstration, ...]
    transitions: tuple[Transition, ...]
    #: ``evidence/sources.json``: one record per trace (``source_id``, ``episode_id``, ``metadata``)
    sources: tuple[dict[str, Any], ...] = field(default=(), compare=False)

    @cached_property
    def _by_trace(self) -> dict[str, list[Transition]]:
        out: dict[str, list[Transition]] = defaultdict(list)
        for t in self.transitions:
            out[t.trace_id].append(t)
        for ts in out.values():
            ts.sort(key=lambda t: t.index)
        return dict(out)

    @cached_property
    def _contexts(self) -> dict[str, str | None]:
        return {s["source_id"]: (s.get("metadata") or {}).get("initial_state_id") for s in self.sources}

    def history_of(self, t: Transition) -> list[Transition]:
        """The transitions of ``t``'s trace before it, in order."""
        return [x for x in self._by_trace.get(t.trace_id, ()) if x.index < t.index]

    def context_of(self, t: Transition) -> str | None:
        """The ``initial_state_id`` recorded with ``t``'s trace (None: unknown)."""
        return self._contexts.get(t.trace_id)

    def transition(self, transition_id: str) -> Transition | None:
        return next((t for t in self.transitions if t.id == transition_id), None)

    def exact_evidence(self, name: str, arguments: Mapping[str, Any]) -> list[Transition]:
        """Recorded transitions with the same action and (normalised) arguments."""
        return retrieve_exact(self.transitions, name, arguments)

    def search_evidence(self, query: str, *, limit: int = 5) -> list[dict[str, Any]]:
        """Lexical FTS5 search over action names, arguments and observations (read-only connection)."""
        terms = [t for t in "".join(c if c.isalnum() or c == "_" else " " for c in query).split() if t]
        if not terms:
            return []
        fts = " OR ".join(f'"{t}"' for t in terms)
        con = sqlite3.connect(f"file:{self.root / 'index.sqlite'}?mode=ro&immutable=1", uri=True)
        try:
            rows = con.execute(
                "SELECT e.transition_id, e.action, e.arguments, e.observation FROM evidence_fts f "
                "JOIN evidence e ON e.rowid = f.rowid WHERE evidence_fts MATCH ? ORDER BY bm25(evidence_fts) LIMIT ?",
                (fts, limit)).fetchall()
        finally:
            con.close()
        return [{"transition_id": r[0], "action": r[1], "arguments": json.loads(r[2]), "observation": r[3]} for r in rows]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _dump(model: BaseModel | Any) -> Any:
    return model.model_dump(mode="json") if isinstance(model, BaseModel) else model


def _write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, ensure_ascii=False, sort_keys=True) + "\n", encoding="utf-8")


def _write_jsonl(path: Path, items: Sequence[BaseModel]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for it in items:
            f.write(json.dumps(_dump(it), ensure_ascii=False, sort_keys=True) + "\n")


def _write_index(path: Path, transitions: Sequence[Transition]) -> None:
    con = sqlite3.connect(path)
    try:
        con.execute("CREATE TABLE evidence (transition_id TEXT, action TEXT, arguments TEXT, observation TEXT)")
        con.execute("CREATE VIRTUAL TABLE evidence_fts USING fts5(action, arguments, observation)")
        for t in transitions:
            row = (t.id, t.action.name, json.dumps(t.action.arguments, ensure_ascii=False, sort_keys=True),
                   t.observation or "")
            cur = con.execute("INSERT INTO evidence VALUES (?, ?, ?, ?)", row)
            con.execute("INSERT INTO evidence_fts(rowid, action, arguments, observation) VALUES (?, ?, ?, ?)",
                        (cur.lastrowid, *row[1:]))
        con.commit()
    finally:
        con.close()


def manifest_digest(manifest: WorldbookManifest) -> str:
    """sha256 of the manifest's fields other than ``digest`` (canonical JSON)."""
    body = manifest.model_dump(mode="json", exclude={"digest"})
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
                          .encode("utf-8")).hexdigest()


def source_pool(traces: Sequence[Trace]) -> str | None:
    """The one ``metadata["pool"]`` of ``traces`` (None when none has one); ValueError when they name several,
    or some name one and others none: one book simulates one environment of one pool."""
    pools = {t.metadata.get("pool") for t in traces}
    if len(pools) > 1:
        names = sorted(str(p) if p is not None else "<no pool>" for p in pools)
        raise ValueError(f"traces from several pools ({', '.join(names)}) cannot make one worldbook; "
                         "build one book per pool")
    return next(iter(pools), None)


def compile_worldbook(out_dir: str | Path, *, environment_id: str, traces: Sequence[Trace],
                      transitions: Sequence[Transition], actions: Sequence[ActionSpec],
                      state_fields: Sequence[StateField], rules: Sequence[TransitionRule],
                      invariants: Sequence[Invariant] = (), contracts: Sequence[RenderContract] = (),
                      demonstrations: Sequence[Demonstration] = (), replay: Mapping[str, Any] | None = None,
                      name: str = "", description: str = "", metadata: Mapping[str, Any] | None = None) -> Path:
    """Write the package into a temporary sibling directory, hash every file, then publish it with one
    ``rename``. An existing ``out_dir`` is never overwritten (packages are immutable)."""
    out = Path(out_dir)
    if out.exists():
        raise FileExistsError(f"{out} exists; worldbooks are immutable, build into a new directory")
    pool = source_pool(traces)
    environments = tuple(sorted({str(t.metadata["env_id"]) for t in traces if t.metadata.get("env_id")}))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _write_json(tmp / "action_schema.json", {"actions": [_dump(a) for a in actions]})
        _write_json(tmp / "state_schema.json", {"fields": [_dump(f) for f in state_fields]})
        _write_jsonl(tmp / "rules/index.jsonl", [r for r in rules if r.status == "supported"])
        _write_jsonl(tmp / "candidates/rules.jsonl", list(rules))
        _write_json(tmp / "invariants.json", [_dump(i) for i in invariants])
        _write_json(tmp / "renderer/contracts.json", [_dump(c) for c in contracts])
        _write_jsonl(tmp / "demonstrations/transitions.jsonl", list(demonstrations))
        _write_json(tmp / "evidence/sources.json", [{"source_id": t.trace_id, "episode_id": t.episode_id,
                                                     "events": len(t.events), "metadata": t.metadata} for t in traces])
        _write_jsonl(tmp / "evidence/transitions.jsonl", list(transitions))
        _write_json(tmp / "validation/replay.json", dict(replay or {}))
        prov: dict[str, list[Any]] = {}
        for kind, items in (("action", actions), ("state_field", state_fields), ("rule", rules),
                            ("invariant", invariants), ("contract", contracts), ("demonstration", demonstrations)):
            for it in items:
                key = f"{kind}:{getattr(it, 'id', None) or getattr(it, 'name', None) or getattr(it, 'path', '')}"
                prov[key] = [_dump(p) for p in getattr(it, "provenance", ())]
        _write_json(tmp / "provenance.json", prov)
        _write_index(tmp / "index.sqlite", transitions)
        files = {p.relative_to(tmp).as_posix(): _sha256(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
        manifest = WorldbookManifest(
            schema_version=SCHEMA_VERSION, environment_id=environment_id, name=name, description=description,
            source_count=len(traces), transition_count=len(transitions), files=files,
            metadata={"construction_kind": "reconstructed", "executable_rules": sum(r.status == "supported" for r in rules),
                      **dict(metadata or {})},
            source_pool=pool, source_environments=environments)
        manifest = manifest.model_copy(update={"digest": manifest_digest(manifest)})
        _write_json(tmp / MANIFEST, _dump(manifest))
        for p in tmp.rglob("*"):
            if p.is_file():
                os.chmod(p, 0o444)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _confined(root: Path, rel: str) -> Path:
    """``root / rel`` for a plain relative path that stays inside the package (no ``..``, no link out)."""
    parts = Path(rel).parts
    if not rel or Path(rel).is_absolute() or ".." in parts or "\\" in rel:
        raise WorldbookIntegrityError(rel, "path outside the package")
    p = root / rel
    try:
        p.resolve().relative_to(root.resolve())
    except ValueError:
        raise WorldbookIntegrityError(rel, "path outside the package (a link)") from None
    return p


def _verify(root: Path) -> WorldbookManifest:
    mpath = root / MANIFEST
    if not mpath.is_file():
        raise WorldbookIntegrityError(MANIFEST, "missing")
    try:
        manifest = WorldbookManifest.model_validate_json(mpath.read_bytes())
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "(top level)"
        raise WorldbookIntegrityError(MANIFEST, f"invalid manifest: {where}: {first['msg']}") from e
    if manifest.schema_version != SCHEMA_VERSION:
        raise WorldbookIntegrityError(MANIFEST, f"schema version {manifest.schema_version!r}, expected {SCHEMA_VERSION!r}")
    if not manifest.digest:
        raise WorldbookIntegrityError(MANIFEST, "no digest (written by an older trace2env); rebuild the worldbook")
    if manifest_digest(manifest) != manifest.digest:
        raise WorldbookIntegrityError(MANIFEST, "digest mismatch: the manifest was edited after the build (tampered)")
    if not manifest.environment_id.strip():
        raise WorldbookIntegrityError(MANIFEST, "empty environment_id")
    for rel in sorted(manifest.files):
        _confined(root, rel)
        if rel not in ARTIFACTS:
            raise WorldbookIntegrityError(rel, "listed in the manifest but not an artifact of a worldbook")
    for rel in sorted(ARTIFACTS - set(manifest.files)):
        raise WorldbookIntegrityError(rel, "an artifact the manifest does not list")
    for rel, digest in sorted(manifest.files.items()):
        p = root / rel
        if p.is_symlink() or not p.is_file():
            raise WorldbookIntegrityError(rel, "listed in the manifest but missing" if not p.exists()
                                          else "not a regular file")
        actual = _sha256(p)
        if actual != digest:
            raise WorldbookIntegrityError(rel, f"sha256 mismatch (manifest {digest[:12]}…, file {actual[:12]}…): tampered")
    on_disk = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() or p.is_symlink()} - {MANIFEST}
    extra = sorted(on_disk - set(manifest.files))
    if extra:
        raise WorldbookIntegrityError(extra[0], "not listed in the manifest")
    return manifest


def _first_error(e: ValidationError) -> str:
    first = e.errors()[0]
    where = ".".join(str(x) for x in first["loc"])
    return f"{where}: {first['msg']}" if where else first["msg"]


def _read_text(root: Path, rel: str) -> str:
    try:
        return (root / rel).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise WorldbookIntegrityError(rel, f"not UTF-8 text (byte {e.start})") from None


def _read_json(root: Path, rel: str) -> Any:
    try:
        return json.loads(_read_text(root, rel))
    except json.JSONDecodeError as e:
        raise WorldbookIntegrityError(rel, f"not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None


def _read_jsonl(root: Path, rel: str, model: type[BaseModel]) -> tuple[Any, ...]:
    out = []
    for i, line in enumerate(_read_text(root, rel).split("\n")):
        if line.strip():
            try:
                out.append(model.model_validate_json(line))
            except ValidationError as e:
                raise WorldbookIntegrityError(rel, f"line {i + 1}: {_first_error(e)}") from e
    return tuple(out)


def _read_list(root: Path, rel: str, model: type[BaseModel], key: str | None = None) -> tuple[Any, ...]:
    data = _read_json(root, rel)
    if key is not None:
        if not isinstance(data, dict) or set(data) != {key}:
            raise WorldbookIntegrityError(rel, f"expected an object with exactly the key {key!r}")
        data = data[key]
    if not isinstance(data, list):
        raise WorldbookIntegrityError(rel, f"expected a list, got {type(data).__name__}")
    try:
        return tuple(model.model_validate(x) for x in data)
    except ValidationError as e:
        raise WorldbookIntegrityError(rel, _first_error(e)) from e


class _SourceRecord(BaseModel):
    """One entry of ``evidence/sources.json``."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    source_id: str
    episode_id: str
    events: int
    metadata: dict[str, Any]


_PROVENANCE = TypeAdapter(dict[str, list[SourceRef]])


def _check_index(root: Path, transition_count: int) -> None:
    try:
        con = sqlite3.connect(f"file:{root / 'index.sqlite'}?mode=ro&immutable=1", uri=True)
        try:
            rows = con.execute("SELECT count(*) FROM evidence").fetchone()[0]
            fts = con.execute("SELECT count(*) FROM evidence_fts").fetchone()[0]
        finally:
            con.close()
    except sqlite3.Error as e:
        raise WorldbookIntegrityError("index.sqlite", f"not a readable evidence index: {e}") from None
    if rows != transition_count or fts != transition_count:
        raise WorldbookIntegrityError("index.sqlite", f"{rows} evidence rows and {fts} indexed, but "
                                      f"{transition_count} transitions")


def load_worldbook(path: str | Path) -> Worldbook:
    """Verify the manifest and every hash, then parse and validate every artifact. Raises
    :class:`WorldbookIntegrityError` naming the offending file."""
    root = Path(path)
    if not root.is_dir():
        raise WorldbookIntegrityError(".", f"{root} is not a directory" if root.exists() else f"{root} does not exist")
    manifest = _verify(root)
    sources = _read_list(root, "evidence/sources.json", _SourceRecord)
    replay = _read_json(root, "validation/replay.json")
    if not isinstance(replay, dict):
        raise WorldbookIntegrityError("validation/replay.json", f"expected an object, got {type(replay).__name__}")
    try:
        _PROVENANCE.validate_python(_read_json(root, "provenance.json"))
    except ValidationError as e:
        raise WorldbookIntegrityError("provenance.json", _first_error(e)) from e
    wb = Worldbook(
        root=root, manifest=manifest,
        actions=_read_list(root, "action_schema.json", ActionSpec, "actions"),
        state_fields=_read_list(root, "state_schema.json", StateField, "fields"),
        rules=_read_jsonl(root, "rules/index.jsonl", TransitionRule),
        candidate_rules=_read_jsonl(root, "candidates/rules.jsonl", TransitionRule),
        invariants=_read_list(root, "invariants.json", Invariant),
        contracts=_read_list(root, "renderer/contracts.json", RenderContract),
        demonstrations=_read_jsonl(root, "demonstrations/transitions.jsonl", Demonstration),
        transitions=_read_jsonl(root, "evidence/transitions.jsonl", Transition),
        sources=tuple(s.model_dump() for s in sources),
    )
    counts = {"transition_count": (manifest.transition_count, len(wb.transitions), "evidence/transitions.jsonl"),
              "source_count": (manifest.source_count, len(wb.sources), "evidence/sources.json")}
    executable = manifest.metadata.get("executable_rules")
    if executable is not None:
        counts["metadata.executable_rules"] = (executable, len(wb.rules), "rules/index.jsonl")
    for key, (claimed, actual, rel) in counts.items():
        if claimed != actual:
            raise WorldbookIntegrityError(MANIFEST, f"{key} is {claimed} but {rel} holds {actual}")
    _check_index(root, len(wb.transitions))
    return wb


def _is_book(path: Path) -> bool:
    """A package (possibly a broken one) rather than a folder of packages: it has a manifest or an artifact."""
    return (path / MANIFEST).exists() or any((path / a).exists() for a in ("action_schema.json", "index.sqlite"))


def load_worldbooks(path: str | Path) -> tuple[bool, dict[str, Worldbook]]:
    """``(single, {environment_id: Worldbook})`` of one package or a folder of packages, all or nothing.

    A folder: every entry must be a valid package (a hidden leftover of an interrupted build, a stray file, a
    book without its manifest all refuse the folder), their environment ids distinct, and at least one book.
    Errors are :class:`WorldbookIntegrityError` whose ``path`` starts with the entry's name."""
    root = Path(path)
    if not root.exists():
        raise WorldbookIntegrityError(".", f"{root} does not exist")
    if not root.is_dir():
        raise WorldbookIntegrityError(".", f"{root} is not a directory (a worldbook package or a folder of them)")
    if _is_book(root):
        wb = load_worldbook(root)
        return True, {wb.manifest.environment_id: wb}
    books: dict[str, Worldbook] = {}
    where: dict[str, str] = {}
    for entry in sorted(root.iterdir()):
        if not entry.is_dir() or entry.is_symlink():
            raise WorldbookIntegrityError(entry.name, "unexpected entry in a folder of worldbooks (not a package)")
        try:
            wb = load_worldbook(entry)
        except WorldbookIntegrityError as e:
            raise WorldbookIntegrityError(f"{entry.name}/{e.path}", e.reason) from None
        env = wb.manifest.environment_id
        if env in books:
            raise WorldbookIntegrityError(entry.name, f"a second worldbook for environment {env!r} "
                                          f"(the first is {where[env]})")
        books[env], where[env] = wb, entry.name
    if not books:
        raise WorldbookIntegrityError(".", f"{root} holds no worldbook package")
    return False, books


def _semantic_problems(wb: Worldbook, prefix: str = "") -> list[str]:
    problems = []
    if not any(t.observation is not None for t in wb.transitions):  # build refuses such traces; older books
        problems.append(f"{prefix}evidence/transitions.jsonl: no observation to learn from ({len(wb.transitions)} "
                        "action(s), none with an observation): rebuild from traces that keep the tool results")
    names = {a.name for a in wb.actions}
    for r in wb.rules:
        if r.action_type not in names:
            problems.append(f"{prefix}rules/index.jsonl: rule {r.id} is for undeclared action {r.action_type!r}")
        if r.status != "supported":
            problems.append(f"{prefix}rules/index.jsonl: rule {r.id} is executable but {r.status}")
    return problems


def check_worldbook(path: str | Path) -> list[str]:
    """Problems of a package, or of every package of a folder (empty when all verify and parse); each names its
    file first (``BOOK/FILE`` in a folder)."""
    root = Path(path)
    if root.is_dir() and not _is_book(root):
        entries = sorted(root.iterdir())
        if not entries:
            return [f".: {root} holds no worldbook package"]
        problems = []
        envs: dict[str, str] = {}
        for entry in entries:
            if not entry.is_dir() or entry.is_symlink():
                problems.append(f"{entry.name}: unexpected entry in a folder of worldbooks (not a package)")
                continue
            try:
                wb = load_worldbook(entry)
            except WorldbookIntegrityError as e:
                problems.append(f"{entry.name}/{e}")
                continue
            env = wb.manifest.environment_id
            if env in envs:
                problems.append(f"{entry.name}: a second worldbook for environment {env!r} (the first is {envs[env]})")
            envs.setdefault(env, entry.name)
            problems += _semantic_problems(wb, f"{entry.name}/")
        return problems
    try:
        wb = load_worldbook(path)
    except WorldbookIntegrityError as e:
        return [str(e)]
    return _semantic_problems(wb)
