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

:func:`load_worldbook` recomputes every sha256 and refuses a package whose file is changed, missing or
not listed, naming the file (:class:`WorldbookIntegrityError`). A loaded :class:`Worldbook` is frozen.
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

from pydantic import BaseModel, ValidationError

from .induce import retrieve_exact
from .models import (
    SCHEMA_VERSION,
    ActionSpec,
    Demonstration,
    Invariant,
    RenderContract,
    StateField,
    Trace,
    Transition,
    TransitionRule,
    WorldbookManifest,
)

__all__ = ["Worldbook", "WorldbookIntegrityError", "check_worldbook", "compile_worldbook", "load_worldbook"]

MANIFEST = "manifest.json"


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
                      **dict(metadata or {})})
        _write_json(tmp / MANIFEST, _dump(manifest))
        for p in tmp.rglob("*"):
            if p.is_file():
                os.chmod(p, 0o444)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _verify(root: Path) -> WorldbookManifest:
    mpath = root / MANIFEST
    if not mpath.is_file():
        raise WorldbookIntegrityError(MANIFEST, "missing")
    try:
        manifest = WorldbookManifest.model_validate_json(mpath.read_text(encoding="utf-8"))
    except (ValidationError, UnicodeDecodeError) as e:
        raise WorldbookIntegrityError(MANIFEST, f"invalid manifest: {e}") from e
    if manifest.schema_version != SCHEMA_VERSION:
        raise WorldbookIntegrityError(MANIFEST, f"schema version {manifest.schema_version!r}, expected {SCHEMA_VERSION!r}")
    for rel, digest in sorted(manifest.files.items()):
        p = root / rel
        if not p.is_file():
            raise WorldbookIntegrityError(rel, "listed in the manifest but missing")
        actual = _sha256(p)
        if actual != digest:
            raise WorldbookIntegrityError(rel, f"sha256 mismatch (manifest {digest[:12]}…, file {actual[:12]}…): tampered")
    on_disk = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()} - {MANIFEST}
    extra = sorted(on_disk - set(manifest.files))
    if extra:
        raise WorldbookIntegrityError(extra[0], "not listed in the manifest")
    return manifest


def _read_jsonl(root: Path, rel: str, model: type[BaseModel]) -> tuple[Any, ...]:
    out = []
    for i, line in enumerate((root / rel).read_text(encoding="utf-8").splitlines()):
        if line.strip():
            try:
                out.append(model.model_validate_json(line))
            except ValidationError as e:
                raise WorldbookIntegrityError(rel, f"line {i + 1}: {e}") from e
    return tuple(out)


def _read_list(root: Path, rel: str, model: type[BaseModel], key: str | None = None) -> tuple[Any, ...]:
    data = json.loads((root / rel).read_text(encoding="utf-8"))
    items = data[key] if key else data
    try:
        return tuple(model.model_validate(x) for x in items)
    except ValidationError as e:
        raise WorldbookIntegrityError(rel, str(e)) from e


def load_worldbook(path: str | Path) -> Worldbook:
    """Verify every hash, then parse. Raises :class:`WorldbookIntegrityError` naming the offending file."""
    root = Path(path)
    if not root.is_dir():
        raise WorldbookIntegrityError(".", f"{root} is not a directory")
    manifest = _verify(root)
    return Worldbook(
        root=root, manifest=manifest,
        actions=_read_list(root, "action_schema.json", ActionSpec, "actions"),
        state_fields=_read_list(root, "state_schema.json", StateField, "fields"),
        rules=_read_jsonl(root, "rules/index.jsonl", TransitionRule),
        candidate_rules=_read_jsonl(root, "candidates/rules.jsonl", TransitionRule),
        invariants=_read_list(root, "invariants.json", Invariant),
        contracts=_read_list(root, "renderer/contracts.json", RenderContract),
        demonstrations=_read_jsonl(root, "demonstrations/transitions.jsonl", Demonstration),
        transitions=_read_jsonl(root, "evidence/transitions.jsonl", Transition),
        sources=tuple(json.loads((root / "evidence/sources.json").read_text(encoding="utf-8"))),
    )


def check_worldbook(path: str | Path) -> list[str]:
    """Problems of a package (empty when it verifies and parses); each names its file first."""
    try:
        wb = load_worldbook(path)
    except WorldbookIntegrityError as e:
        return [str(e)]
    problems = []
    names = {a.name for a in wb.actions}
    for r in wb.rules:
        if r.action_type not in names:
            problems.append(f"rules/index.jsonl: rule {r.id} is for undeclared action {r.action_type!r}")
        if r.status != "supported":
            problems.append(f"rules/index.jsonl: rule {r.id} is executable but {r.status}")
    return problems

