"""Typed contracts for every Trace2Env artifact: traces, transitions, schemas, rules, the worldbook manifest.

Trace2Env (seed paper ``../shared/seeds/002_3678f87863e1a507.txt``) reconstructs a simulator from recorded
interaction traces alone (paper §3, "trace-based environment reconstruction"). Its offline constructor
produces an *environment worldbook* with four components (paper §4.1 and Appendix C.1, Table 12):

* **schemas** — :class:`ActionSpec` (the action interface) and :class:`StateField` (the state variables the
  simulator may maintain);
* **grounded evidence** — :class:`Transition` records with their original observation text, and
  :class:`Demonstration` s;
* **induced abstractions** — :class:`TransitionRule` (conditional effects), :class:`Invariant` (state
  constraints) and :class:`RenderContract` (observation contracts);
* **provenance** — :class:`SourceRef` on every derived artifact, back to the trace and event it came from.

Every model forbids unknown fields (``extra="forbid"``) and is frozen, so a loaded worldbook cannot be
changed by accident; JSON Schema export comes from pydantic (``Model.model_json_schema()``).
``SCHEMA_VERSION`` is written into every package manifest.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "NAMESPACES",
    "SCHEMA_VERSION",
    "ActionCall",
    "ActionSpec",
    "ArgumentSpec",
    "Condition",
    "Demonstration",
    "Effect",
    "Event",
    "Frozen",
    "Invariant",
    "JsonType",
    "Operand",
    "RenderContract",
    "SourceRef",
    "SplitAssignment",
    "SplitManifest",
    "StateField",
    "Trace",
    "Transition",
    "TransitionRule",
    "WorldbookManifest",
]

SCHEMA_VERSION = "trace2env/1"

#: state namespaces (reference §2): world facts, the current session, what the agent sees, what it believes
NAMESPACES = ("world", "session", "surface", "epistemic")

JsonType = Literal["string", "integer", "number", "boolean", "object", "array", "null", "any"]


class Frozen(BaseModel):
    """Base of every artifact: immutable, unknown fields rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True)


# ----------------------------------------------------------------------------------------------- traces


class Event(Frozen):
    """One recorded event of a trace, kept verbatim.

    ``kind="action"`` events carry ``content = {"type"|"name": str, "arguments": dict, ...}``;
    ``kind="observation"`` events carry the environment's answer exactly as recorded (a string, or any
    JSON value when the source stored structured output). ``call_id`` links an observation to its action.
    """

    id: str
    actor: Literal["agent", "environment", "user", "system"]
    kind: Literal["action", "observation", "message"]
    content: Any
    call_id: str | None = None


class Trace(Frozen):
    """A recorded interaction sequence ``h^(i)`` (paper §3). ``trace_id`` is a content hash (``src_<sha>``)."""

    trace_id: str
    episode_id: str
    events: tuple[Event, ...]
    metadata: dict[str, Any] = Field(default_factory=dict)


class ActionCall(Frozen):
    """An action as the environment received it: a name and JSON arguments."""

    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    call_id: str | None = None


class Transition(Frozen):
    """One aligned action → observation pair of a trace (reference §2, ``TransitionSlice``).

    ``observation`` is the recorded text, never rewritten (structured observations are JSON-dumped once,
    at ingestion, and ``observation_content`` keeps the original value). ``alignment`` says how the pair
    was made; ``ambiguities`` lists why it may be wrong (then construction withholds its effects).
    """

    id: str
    trace_id: str
    episode_id: str
    index: int
    action: ActionCall
    action_event_id: str
    observation: str | None
    observation_content: Any = None
    observation_event_ids: tuple[str, ...] = ()
    alignment: Literal["correlated", "sequential", "ambiguous"]
    ambiguities: tuple[str, ...] = ()


class SplitAssignment(Frozen):
    split: Literal["train", "dev", "test"]
    trajectory_group: str


class SplitManifest(Frozen):
    """``{"assignments": {trace_id: {split, trajectory_group}}}``; construction uses ``train`` traces only."""

    assignments: dict[str, SplitAssignment]

    def ids(self, split: str) -> list[str]:
        return sorted(t for t, a in self.assignments.items() if a.split == split)


# ----------------------------------------------------------------------------------------------- schemas


class SourceRef(Frozen):
    """Provenance: which trace, episode and events support an artifact."""

    source_id: str
    episode_id: str = ""
    event_ids: tuple[str, ...] = ()
    transition_id: str = ""
    excerpt: str = ""


class ArgumentSpec(Frozen):
    type: JsonType = "any"
    required: bool = False
    description: str = ""
    enum: tuple[Any, ...] | None = None


class ActionSpec(Frozen):
    name: str
    description: str = ""
    arguments: dict[str, ArgumentSpec] = Field(default_factory=dict)
    aliases: tuple[str, ...] = ()
    provenance: tuple[SourceRef, ...] = ()


class StateField(Frozen):
    """A declared state variable. ``path`` starts with one of :data:`NAMESPACES`; an ``object``/``array``/
    ``any`` field also covers every path below it."""

    path: str
    type: JsonType = "any"
    description: str = ""
    default: Any = None
    mutable: bool = True
    provenance: tuple[SourceRef, ...] = ()


# ----------------------------------------------------------------------------------------------- rules


class Operand(Frozen):
    """Exactly one of: a state path, an action argument name, a literal value."""

    path: str | None = None
    action_arg: str | None = None
    literal: Any = None


class Condition(Frozen):
    """``left op right``; ``any_of`` (when non-empty) is a disjunction of sub-conditions instead."""

    left: Operand = Field(default_factory=Operand)
    op: Literal["eq", "ne", "gt", "gte", "lt", "lte", "exists", "not_exists", "contains", "in"] = "exists"
    right: Operand | None = None
    any_of: tuple[Condition, ...] = ()


class Effect(Frozen):
    """A declarative state update on one declared path (reference §2, ``StateMutation``).

    ``value`` may hold ``{"$action_arg": name}``, ``{"$state": path}`` (the pre-step value) or a whole
    string ``"{{action.arguments.name}}"``; path segments may be ``{{action.arguments.name}}`` tokens.
    """

    op: Literal["set", "create", "delete", "increment", "decrement", "append", "merge", "remove"]
    path: str
    value: Any = None


class TransitionRule(Frozen):
    id: str
    action_type: str
    description: str = ""
    priority: int = 0
    conditions: tuple[Condition, ...] = ()
    effects: tuple[Effect, ...] = ()
    outcome: Literal["success", "failure", "partial", "unknown"] = "unknown"
    observation_template: str | None = None
    confidence: float = 0.0
    status: Literal["supported", "tentative", "conflicted", "deprecated"] = "tentative"
    provenance: tuple[SourceRef, ...] = ()
    counterexamples: tuple[SourceRef, ...] = ()


class Invariant(Frozen):
    """A state-only constraint; a step that introduces a violation is rejected by the validation gate."""

    id: str
    description: str = ""
    condition: Condition
    severity: Literal["error", "warning"] = "error"
    provenance: tuple[SourceRef, ...] = ()


class RenderContract(Frozen):
    """Observation contract for some actions: content type, fields every observation carries, examples."""

    id: str
    action_types: tuple[str, ...]
    content_type: Literal["json", "text"] = "text"
    template: str | None = None
    required_fields: tuple[str, ...] = ()
    examples: tuple[str, ...] = ()
    provenance: tuple[SourceRef, ...] = ()


class Demonstration(Frozen):
    id: str
    action: ActionCall
    observation: str
    outcome: Literal["success", "failure", "partial", "unknown"] = "unknown"
    rule_ids: tuple[str, ...] = ()
    provenance: tuple[SourceRef, ...] = ()


class WorldbookManifest(Frozen):
    """``manifest.json``: identity, counts and the sha256 of every other file of the package."""

    schema_version: str = SCHEMA_VERSION
    environment_id: str
    name: str = ""
    description: str = ""
    source_count: int = 0
    transition_count: int = 0
    files: dict[str, str]
    metadata: dict[str, Any] = Field(default_factory=dict)
    #: ``metadata["pool"]`` of the traces the book was built from (None: traces without one)
    source_pool: str | None = None
    #: the distinct ``metadata["env_id"]`` of those traces
    source_environments: tuple[str, ...] = ()
    #: sha256 of every other field (:func:`trace2env.package.manifest_digest`): an edit of the manifest itself,
    #: not only of the files it lists, fails verification; also the book's identity
    digest: str = ""
