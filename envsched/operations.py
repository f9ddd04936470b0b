"""Structured operation descriptions (EnvSched §2.2, Appendix E).

* ``OperationDescription`` — the App. E schema (operations with types, gates with provenance,
  dependencies, reward groups, conflicts), validated with pydantic including cross-references.
* ``DeterministicExtractor`` — derives a description from tool schemas and the ground-truth call
  sequence, without an LLM.
* ``LLMExtractor`` — asks an OpenAI-compatible chat endpoint (``response_format=json_object``),
  validates the answer, caches it on disk keyed by a content hash; an answer that fails the schema is
  retried once with the error, then falls back to the deterministic extractor with a logged reason
  (or raises ``OperationExtractionError`` when configured so).  Never returns an unvalidated answer.  Its
  endpoint is the project's one endpoint config and its failures the one taxonomy (:mod:`envllm`).
* ``abstract_text`` — the deterministic abstraction of App. E.1 (tool names -> operation types,
  identifiers and field names removed, literals -> type placeholders) whose TF-IDF gives S_abs (Eq. 1).
* ``concrete_text`` — the complete (concrete) description, the sixth within-environment view.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import logging
import re
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from envllm import ConfigurationError, InfrastructureError, ModelOutputError, is_retryable_status, not_found_hint, short

from .config import LLMExtractorConfig
from .pool import Task

log = logging.getLogger(__name__)

OpType = Literal["lookup", "update", "create", "delete", "validate", "authorize"]
GateType = Literal["identifier_resolution", "state_precondition", "authorization"]
Provenance = Literal["task_literal", "unique_lookup", "broad_lookup", "prior_tool_output", "agent_generated", "unavailable"]
GroupRelation = Literal["shared_operation", "shared_gate", "initially_satisfied", "independent"]
ConflictType = Literal["order", "mutual_exclusion", "destructive"]
TargetKind = Literal[
    "entity_by_name", "entity_by_id", "entity_by_attribute", "entity_list", "entity_field",
    "status", "relation", "record", "constraint", "permission", "other",
]
LiteralType = Literal["<string>", "<int>", "<float>", "<bool>", "<date>", "<id>", "<list>", "<object>", "<null>"]

PROMPT_VERSION = "envsched-ops-v1"

MUTATING = ("update", "create", "delete")


class OperationExtractionError(ModelOutputError):
    """The LLM answer could not be turned into a valid OperationDescription (the taxonomy's model-output failure)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Operation(_Strict):
    id: str = Field(min_length=1)
    type: OpType
    tool: str | None = None  # concrete tool name (removed by the abstraction)
    target_kind: TargetKind = "other"  # abstract kind of the object acted on (kept by the abstraction)
    description: str = ""  # free text (removed by the abstraction)
    arguments: dict[str, LiteralType] = Field(default_factory=dict)  # field name -> literal type
    depends_on: list[str] = Field(default_factory=list)


class Gate(_Strict):
    id: str = Field(min_length=1)
    type: GateType
    provenance: Provenance
    blocks: list[str] = Field(default_factory=list)  # operation ids that cannot run until the gate holds
    description: str = ""


class Dependency(_Strict):
    source: str  # must finish first
    target: str


class RewardGroup(_Strict):
    checks: list[int] = Field(min_length=1)  # 0-based indices into the task's verifier checks
    relation: GroupRelation
    controlled_by: list[str] = Field(default_factory=list)  # operation or gate ids


class Conflict(_Strict):
    first: str
    second: str
    type: ConflictType


class OperationDescription(_Strict):
    """App. E output schema.  Every reference must name an existing operation/gate id."""

    operations: list[Operation] = Field(min_length=1)
    gates: list[Gate] = Field(default_factory=list)
    dependencies: list[Dependency] = Field(default_factory=list)
    reward_groups: list[RewardGroup] = Field(default_factory=list)
    conflicts: list[Conflict] = Field(default_factory=list)

    @model_validator(mode="after")
    def _references(self) -> OperationDescription:
        ops = [o.id for o in self.operations]
        if len(set(ops)) != len(ops):
            raise ValueError(f"duplicate operation ids {sorted({o for o in ops if ops.count(o) > 1})}")
        op_set, gate_set = set(ops), {g.id for g in self.gates}
        for o in self.operations:
            bad = [d for d in o.depends_on if d not in op_set]
            if bad:
                raise ValueError(f"operation {o.id!r} depends on unknown operation(s) {bad}")
        for g in self.gates:
            bad = [b for b in g.blocks if b not in op_set]
            if bad:
                raise ValueError(f"gate {g.id!r} blocks unknown operation(s) {bad}")
        for d in self.dependencies:
            for end in (d.source, d.target):
                if end not in op_set:
                    raise ValueError(f"dependency references unknown operation {end!r}")
        for r in self.reward_groups:
            bad = [c for c in r.controlled_by if c not in op_set | gate_set]
            if bad:
                raise ValueError(f"reward group controlled by unknown id(s) {bad}")
            if any(c < 0 for c in r.checks):
                raise ValueError("reward group check indices must be >= 0")
        for c in self.conflicts:
            for end in (c.first, c.second):
                if end not in op_set:
                    raise ValueError(f"conflict references unknown operation {end!r}")
        return self

    def validate_for(self, task: Task) -> None:
        """Task-specific checks: check indices exist."""
        n = len(task.verifier_checks)
        for r in self.reward_groups:
            bad = [c for c in r.checks if c >= n]
            if bad:
                raise ValueError(f"reward group names check index {bad} but the task has {n} checks")


@dataclass(frozen=True)
class Extraction:
    """A validated description and where it came from."""

    description: OperationDescription
    extractor: str  # "deterministic" | "llm" | "llm-cache" | "deterministic-fallback"
    reason: str = ""  # why a fallback happened


# ---------------------------------------------------------------------------------------------------
# Deterministic extractor
# ---------------------------------------------------------------------------------------------------

_VERBS: list[tuple[OpType, frozenset[str]]] = [
    ("authorize", frozenset({"authorize", "authorized", "authorization", "authenticate", "auth", "login", "permission", "permissions"})),
    ("lookup", frozenset({"get", "find", "list", "search", "query", "lookup", "fetch", "retrieve", "read", "view", "show", "count", "describe", "browse"})),
    ("validate", frozenset({"check", "verify", "validate", "is", "has", "can", "confirm", "ensure", "test"})),
    ("delete", frozenset({"delete", "remove", "cancel", "drop", "revoke", "release", "unassign", "clear", "archive", "withdraw", "retract"})),
    ("create", frozenset({"create", "add", "insert", "register", "book", "new", "make", "schedule", "open", "post", "submit", "issue", "enroll", "log", "report"})),
    ("update", frozenset({"update", "set", "modify", "change", "edit", "assign", "transfer", "move", "reschedule", "rename", "replace", "approve", "reject", "mark", "apply", "enable", "disable", "toggle", "increase", "decrease", "reset", "resolve", "advance", "amend"})),
]
_RELATION_VERBS = frozenset({"assign", "transfer", "move", "reschedule", "replace", "unassign", "link", "attach"})


def split_identifier(name: str) -> list[str]:
    """``getUserByName`` / ``get_user_by_name`` -> ['get', 'user', 'by', 'name']."""
    return list(_split_identifier(name))


@functools.lru_cache(maxsize=1 << 16)  # tool names repeat across every task of an environment
def _split_identifier(name: str) -> tuple[str, ...]:
    name = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name)
    return tuple(p for p in re.split(r"[^A-Za-z0-9]+", name.lower()) if p)


@functools.lru_cache(maxsize=1 << 16)
def tool_operation_type(tool_name: str) -> OpType:
    """Map a tool name to an App. E operation type by its verb (first word first, then any word)."""
    words = split_identifier(tool_name)
    if set(words) & _VERBS[0][1]:  # authorization words win wherever they appear (is_authorized_user...)
        return "authorize"
    for w in words:  # then the first verb-like word
        for op, verbs in _VERBS:
            if w in verbs:
                return op
    return "update"


def literal_type(value: Any, key: str = "") -> LiteralType:
    """Type placeholder of a literal (App. E.1 step 4)."""
    if value is None:
        return "<null>"
    if isinstance(value, bool):
        return "<bool>"
    if isinstance(value, int):
        return "<id>" if _is_id_key(key) else "<int>"
    if isinstance(value, float):
        return "<float>"
    if isinstance(value, list):
        return "<list>"
    if isinstance(value, dict):
        return "<object>"
    s = str(value)
    if re.fullmatch(r"\d{4}-\d{2}-\d{2}([ T].*)?", s):
        return "<date>"
    if _is_id_key(key) or _looks_like_id(s):
        return "<id>"
    return "<string>"


@functools.lru_cache(maxsize=1 << 16)
def _is_id_key(key: str) -> bool:
    """``id``, ``user_id``, ``policy-ids``, ``userId`` are identifier fields; ``paid`` / ``valid`` are not."""
    return bool(re.search(r"(^|[_-])ids?$", key.lower()) or re.search(r"[a-z0-9]Ids?$", key))


def _looks_like_id(s: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z]{0,6}[-_]?\d[\w-]{1,}", s)) and any(ch.isdigit() for ch in s)


def _target_kind(op: OpType, tool_name: str, arg_names: Sequence[str]) -> TargetKind:
    words = set(split_identifier(tool_name))
    names = [a.lower() for a in arg_names]
    if op == "lookup":
        if words & {"list", "search", "all"} or not names:
            return "entity_list"
        if any("name" in a for a in names):
            return "entity_by_name"
        if any(_is_id_key(a) for a in names):
            return "entity_by_id"
        return "entity_by_attribute"
    if op == "update":
        if words & _RELATION_VERBS:
            return "relation"
        if words & {"status", "state"}:
            return "status"
        return "entity_field"
    if op in ("create", "delete"):
        return "relation" if words & _RELATION_VERBS else "record"
    if op == "validate":
        return "constraint"
    return "permission"


def _flat_values(value: Any) -> list[str]:
    if isinstance(value, Mapping):
        return [v for x in value.values() for v in _flat_values(x)]
    if isinstance(value, (list, tuple)):
        return [v for x in value for v in _flat_values(x)]
    if value is None or isinstance(value, bool):
        return []
    s = str(value).strip()
    return [s] if len(s) >= 2 else []


class DeterministicExtractor:
    """Operation description from tool schemas and the ground-truth call sequence (no LLM).

    Operations are the gold calls in order (or, without gold calls, the tools named in the instruction /
    verifier, else all tools).  Dependencies link each call to earlier calls that share an argument value,
    and each state change to the lookups/validations/authorizations since the previous state change.
    Gates: an identifier argument not given in the instruction -> identifier_resolution gate (provenance
    from an earlier lookup / prior output / agent-generated for creates / unavailable); each authorize call
    -> authorization gate on later state changes; each validate call -> state_precondition gate on the next
    state change.  Reward groups: checks grouped by the set of operations whose tool words or argument
    values they mention.  Conflicts: validate/authorize before a state change -> order; delete followed by a
    call on the same value -> destructive.
    """

    name = "deterministic"

    def extract(self, task: Task) -> Extraction:
        return Extraction(self.describe(task), self.name)

    def describe(self, task: Task) -> OperationDescription:
        """The validated App. E description of ``task``."""
        plan = self._plan(task)
        ops = []
        for o in plan.operations:
            op = Operation(id=o.id, type=o.type, tool=o.tool, target_kind=o.target_kind, description=o.description, arguments=o.arguments)
            op.depends_on.extend(o.depends_on)
            ops.append(op)
        return OperationDescription(
            operations=ops,
            gates=[Gate(id=g.id, type=g.type, provenance=g.provenance, blocks=g.blocks) for g in plan.gates],
            dependencies=[Dependency(source=d.source, target=d.target) for d in plan.dependencies],
            reward_groups=[RewardGroup(checks=r.checks, relation=r.relation, controlled_by=r.controlled_by) for r in plan.reward_groups],
            conflicts=[Conflict(first=c.first, second=c.second, type=c.type) for c in plan.conflicts],
        )

    def texts(self, task: Task) -> tuple[str, str]:
        """``(concrete_text, abstract_text)`` of ``describe(task)``, without building the pydantic models (what a graph
        build keeps of a description; the models' validation is about a third of ``describe``).

        The unvalidated plan is valid by construction: ids are ``op<k>`` / ``g<k>`` made here, every reference
        names one of them, the literal fields take their values from the schema's vocabularies and every reward
        group has a check.  Only a tool's name and description and the argument names come from the pool; unless
        they are plain strings the description is validated (``describe``), so bad input fails as it does there.
        """
        plan = self._plan(task)
        if not all(type(o.tool) is str and type(o.description) is str and all(type(a) is str for a in o.arguments) for o in plan.operations):
            desc = self.describe(task)
            return concrete_text(desc), abstract_text(desc)
        return concrete_text(plan), abstract_text(plan)  # type: ignore[arg-type]  # the same attributes

    def _plan(self, task: Task) -> Any:
        """The description's fields as plain objects (``SimpleNamespace`` with the models' attribute names)."""
        tools = {t.name: t for t in task.tools}
        calls: list[tuple[str, dict[str, Any]]] = [(a.name, dict(a.arguments)) for a in task.gold_actions]
        if not calls:
            text = " ".join([task.instruction, task.verifier_code, *task.verifier_checks]).lower()
            named = [t.name for t in task.tools if t.name.lower() in text]
            calls = [(n, {}) for n in (named or [t.name for t in task.tools])]
        if not calls:
            calls = [("respond", {})]
        instr = f"{task.instruction} {task.initial_state}".lower()

        ops: list[Any] = []
        gates: list[Any] = []
        deps: set[tuple[str, str]] = set()
        conflicts: list[Any] = []
        values_of: list[set[str]] = []
        since_change: list[str] = []
        for k, (name, args) in enumerate(calls):
            oid = f"op{k}"
            typ = tool_operation_type(name)
            arg_names = list(args) or (tools[name].param_names() if name in tools else [])
            vals = {v.lower() for v in _flat_values(args)}
            for j, prev_vals in enumerate(values_of):
                if vals & prev_vals:
                    deps.add((f"op{j}", oid))
            if typ in MUTATING:
                for prev in since_change:
                    deps.add((prev, oid))
            fields = {
                "id": oid, "type": typ, "tool": name, "target_kind": _target_kind(typ, name, arg_names),
                "description": (tools[name].description if name in tools else ""),
                "arguments": {a: literal_type(args.get(a), a) if a in args else "<string>" for a in arg_names},
            }
            if type(fields["description"]) is not str or not all(type(a) is str for a in fields["arguments"]):
                Operation(**fields)  # values from the pool the schema may refuse: raises here, as it always did
            ops.append(SimpleNamespace(**fields, depends_on=[]))
            # identifier gates
            earlier_lookup = any(o.type == "lookup" for o in ops[:-1])
            for a, v in args.items():
                if not (_is_id_key(a) or (isinstance(v, str) and _looks_like_id(v))):
                    continue
                sv = str(v).lower()
                if sv and sv in instr:
                    prov: Provenance = "task_literal"
                elif any(sv in pv for pv in values_of):
                    prov = "prior_tool_output"
                elif earlier_lookup:
                    prov = "unique_lookup"
                elif typ == "create":
                    prov = "agent_generated"
                else:
                    prov = "unavailable"
                gates.append(SimpleNamespace(id=f"g{len(gates)}", type="identifier_resolution", provenance=prov, blocks=[oid], description=""))
            values_of.append(vals)
            if typ in MUTATING:
                since_change = []
            else:
                since_change.append(oid)
        # authorization / precondition gates and order conflicts
        for k, o in enumerate(ops):
            later_changes = [p.id for p in ops[k + 1 :] if p.type in MUTATING]
            if o.type == "authorize" and later_changes:
                gates.append(SimpleNamespace(id=f"g{len(gates)}", type="authorization", provenance="prior_tool_output", blocks=later_changes, description=""))
                conflicts.append(SimpleNamespace(first=o.id, second=later_changes[0], type="order"))
            if o.type == "validate" and later_changes:
                gates.append(SimpleNamespace(id=f"g{len(gates)}", type="state_precondition", provenance="prior_tool_output", blocks=later_changes[:1], description=""))
                conflicts.append(SimpleNamespace(first=o.id, second=later_changes[0], type="order"))
            if o.type == "delete":
                for p, pv in zip(ops[k + 1 :], values_of[k + 1 :]):
                    if pv & values_of[k] and p.type != "lookup":
                        conflicts.append(SimpleNamespace(first=o.id, second=p.id, type="destructive"))
                        break
        for src, dst in deps:
            op = ops[int(dst[2:])]
            if src not in op.depends_on:
                op.depends_on.append(src)
        for o in ops:
            o.depends_on.sort(key=lambda s: int(s[2:]))
        # reward groups
        groups: dict[tuple[str, ...], list[int]] = {}
        for c, check in enumerate(task.verifier_checks):
            low = check.lower()
            ctrl = []
            for o, vals in zip(ops, values_of):
                words = [w for w in split_identifier(o.tool or "") if len(w) > 3 and w not in _STOP]
                if (any(v in low for v in vals if len(v) >= 3) or any(w in low for w in words)) and (
                        o.type in MUTATING or o.type in ("validate", "authorize")):
                    ctrl.append(o.id)
            groups.setdefault(tuple(ctrl), []).append(c)
        reward_groups = []
        for ctrl, checks in groups.items():
            if not ctrl:
                rel: GroupRelation = "independent"
            elif len(ctrl) == 1 and ops[int(ctrl[0][2:])].type in ("validate", "authorize"):
                rel = "shared_gate"
            else:
                rel = "shared_operation"
            reward_groups.append(SimpleNamespace(checks=checks, relation=rel, controlled_by=list(ctrl)))
        return SimpleNamespace(
            operations=ops, gates=gates,
            dependencies=[SimpleNamespace(source=s, target=t) for s, t in sorted(deps, key=lambda e: (int(e[0][2:]), int(e[1][2:])))],
            reward_groups=reward_groups, conflicts=conflicts,
        )


_STOP = frozenset({"with", "from", "into", "user", "info", "data", "details", "record", "records", "item", "items", "by"})


# ---------------------------------------------------------------------------------------------------
# LLM extractor
# ---------------------------------------------------------------------------------------------------

SYSTEM_PROMPT = """You analyse one task of an executable tool-use environment and describe, as JSON, the \
operations it requires and how they depend on each other and on the verifier's checks.
Answer with one JSON object and nothing else, with exactly these keys:
{"operations": [{"id": str, "type": OP, "tool": str|null, "target_kind": KIND, "description": str,
                 "arguments": {field_name: LITERAL}, "depends_on": [operation id]}],
 "gates": [{"id": str, "type": GATE, "provenance": PROV, "blocks": [operation id], "description": str}],
 "dependencies": [{"source": operation id, "target": operation id}],
 "reward_groups": [{"checks": [0-based verifier check index], "relation": REL, "controlled_by": [operation or gate id]}],
 "conflicts": [{"first": operation id, "second": operation id, "type": CONFLICT}]}
Fixed vocabularies (use only these strings):
OP: lookup (read data), update (modify existing records), create (add entities), delete (remove records),
    validate (check constraints without changing state), authorize (check permissions).
KIND: entity_by_name, entity_by_id, entity_by_attribute, entity_list, entity_field, status, relation, record,
      constraint, permission, other.
LITERAL: <string>, <int>, <float>, <bool>, <date>, <id>, <list>, <object>, <null>.
GATE: identifier_resolution (a needed identifier must first be resolved), state_precondition (a state must
      hold before an operation), authorization (a permission is required).
PROV (where the gated information comes from): task_literal, unique_lookup, broad_lookup, prior_tool_output,
      agent_generated, unavailable.
REL: shared_operation (checks written by the same operation), shared_gate (checks that fail together when a
     gate fails), initially_satisfied (already true in the initial state), independent.
CONFLICT: order (A must precede B without a data dependency), mutual_exclusion (A and B cannot both run),
          destructive (A removes a precondition of B).
An operation depends on another when it needs that operation's output or effect. A dependency edge goes from
the operation that must finish first (source) to the one that waits (target). Partition every verifier check
into exactly one reward group. Every id you reference must be defined."""


def build_user_message(task: Task) -> str:
    """App. E.3: structured JSON, tasks of one environment share the ``shared_environment`` object."""
    payload = {
        "shared_environment": {
            "environment_id": task.env_id,
            "tools": [{"name": t.name, "description": t.description, "parameters": dict(t.parameters)} for t in task.tools],
        },
        "task": {
            "instruction": task.instruction,
            "initial_state": task.initial_state,
            "verifier_checks": [{"index": i, "text": c} for i, c in enumerate(task.verifier_checks)],
            "verifier_code": task.verifier_code,
        },
    }
    return json.dumps(payload, ensure_ascii=False, sort_keys=True)


def parse_description(text: str, task: Task) -> OperationDescription:
    """Parse and validate an LLM answer; raises ValueError with a human-readable reason."""
    body = text.strip()
    fence = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", body, flags=re.DOTALL)
    if fence:
        body = fence.group(1)
    try:
        data = json.loads(body)
    except json.JSONDecodeError as exc:
        raise ValueError(f"answer is not JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(data, dict):
        raise ValueError(f"answer is a JSON {type(data).__name__}, expected an object")  # noqa: TRY004 - a malformed answer, as the JSON error above
    try:
        desc = OperationDescription.model_validate(data)
    except ValidationError as exc:
        errs = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in exc.errors()[:5])
        raise ValueError(f"answer fails the App. E schema: {errs}") from None
    desc.validate_for(task)
    return desc


class LLMExtractor:
    """App. E extraction through an OpenAI-compatible chat-completions endpoint, with an on-disk cache.

    ``config`` is the endpoint and the extractor's knobs (:class:`envsched.config.LLMExtractorConfig`, the shared
    :class:`envllm.EndpointConfig` extended). ``client`` is anything with ``client.chat.completions.create(...)``
    returning an object whose ``choices[0].message.content`` is the answer (a fake in tests); None: an
    ``openai.OpenAI`` on the first base URL, with the config's key, time-out and ``max_retries``.

    Failures follow the project's one taxonomy (:mod:`envllm`): a request the endpoint refuses as configured (HTTP
    400/401/403/404/422: bad key, unknown model, wrong URL) raises :class:`~envllm.ConfigurationError` at once,
    whatever ``on_invalid`` says. A failed request (:class:`~envllm.InfrastructureError`, after the client's own
    retries) or an answer that fails the schema uses up one of the ``1 + repair_rounds`` requests; when none is
    left the task falls back to the deterministic extractor, or (``on_invalid='raise'``) the last failure is raised
    as an :class:`OperationExtractionError` (a :class:`~envllm.ModelOutputError`) or an ``InfrastructureError``.
    """

    name = "llm"

    def __init__(self, config: LLMExtractorConfig, client: Any = None, *, fallback: DeterministicExtractor | None = None):
        if client is None:
            import openai

            client = openai.OpenAI(base_url=config.base_url, api_key=config.resolved_api_key(),
                                   timeout=config.timeout_s, max_retries=config.max_retries)
        self.client = client
        self.config = config
        self.model = config.model
        self.cache_dir = Path(config.cache_dir) if config.cache_dir else None
        self.fallback = fallback or DeterministicExtractor()

    @classmethod
    def from_config(cls, cfg: LLMExtractorConfig, client: Any = None) -> LLMExtractor:
        return cls(cfg, client)

    def cache_key(self, task: Task) -> str:
        blob = json.dumps([PROMPT_VERSION, self.model, SYSTEM_PROMPT, build_user_message(task)], ensure_ascii=False)
        return hashlib.sha256(blob.encode("utf-8")).hexdigest()

    def _cache_path(self, key: str) -> Path | None:
        return self.cache_dir / f"{key[:2]}/{key}.json" if self.cache_dir else None

    def _request_fields(self) -> dict[str, Any]:
        """The endpoint's model and sampling fields of every request (a field left null is not sent)."""
        cfg = self.config
        sampling = {"temperature": cfg.temperature, "top_p": cfg.top_p, "max_tokens": cfg.max_tokens, "seed": cfg.seed}
        fields = {"model": cfg.model, **{k: v for k, v in sampling.items() if v is not None}}
        return {**fields, "extra_body": dict(cfg.extra_body)} if cfg.extra_body else fields

    def _ask(self, messages: list[dict[str, str]]) -> str:
        """One request's answer text; a failure raised as the taxonomy's ConfigurationError or InfrastructureError."""
        try:
            resp = self.client.chat.completions.create(
                messages=messages, response_format={"type": "json_object"}, **self._request_fields())
        except Exception as exc:  # the openai client's errors and a fake client's alike, classified below
            status = getattr(exc, "status_code", None)
            where = f"{self.config.base_url}: {type(exc).__name__}: {short(str(exc))}"
            if isinstance(status, int) and not is_retryable_status(status):
                raise ConfigurationError(f"{where}{not_found_hint(status)}", status_code=status,
                                         base_url=self.config.base_url) from exc
            raise InfrastructureError(where, attempts=1 + self.config.max_retries) from exc
        return resp.choices[0].message.content or ""

    def _store(self, path: Path | None, desc: OperationDescription) -> None:
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(desc.model_dump_json(), encoding="utf-8")
            tmp.replace(path)

    def extract(self, task: Task) -> Extraction:
        key = self.cache_key(task)
        path = self._cache_path(key)
        if path is not None and path.exists():
            try:
                return Extraction(parse_description(path.read_text(encoding="utf-8"), task), "llm-cache")
            except ValueError as exc:  # corrupt cache entry: ignore it and ask again
                log.warning("envsched: ignoring invalid cache entry %s (%s)", path, exc)
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": build_user_message(task)}]
        reason, failure = "", OperationExtractionError
        for _ in range(self.config.repair_rounds + 1):
            try:
                content = self._ask(messages)
            except InfrastructureError as exc:
                reason, failure = f"request failed: {exc}", InfrastructureError
                continue
            try:
                desc = parse_description(content, task)
            except ValueError as exc:
                reason, failure = str(exc), OperationExtractionError
                messages = messages[:2] + [
                    {"role": "assistant", "content": content},
                    {"role": "user", "content": f"Your answer was invalid: {reason}. Answer again with a corrected JSON object."},
                ]
            else:
                self._store(path, desc)
                return Extraction(desc, "llm")
        msg = f"task {task.task_id!r}: LLM operation extraction failed after {self.config.repair_rounds + 1} attempt(s): {reason}"
        if self.config.on_invalid == "raise":
            raise failure(msg)
        log.warning("envsched: %s; falling back to the deterministic extractor", msg)
        return Extraction(self.fallback.describe(task), "deterministic-fallback", reason)

    def extract_many(self, tasks: Sequence[Task]) -> list[Extraction]:
        if self.config.concurrency <= 1 or len(tasks) <= 1:
            return [self.extract(t) for t in tasks]
        with ThreadPoolExecutor(self.config.concurrency) as pool:
            return list(pool.map(self.extract, tasks))


def extract_all(tasks: Sequence[Task], extractor: Any) -> list[Extraction]:
    if hasattr(extractor, "extract_many"):
        return extractor.extract_many(tasks)
    return [extractor.extract(t) for t in tasks]


# ---------------------------------------------------------------------------------------------------
# Texts for TF-IDF
# ---------------------------------------------------------------------------------------------------


def _size_bucket(n: int) -> str:
    return "1" if n <= 1 else "2" if n == 2 else "3-4" if n <= 4 else "5+"


def abstract_text(desc: OperationDescription) -> str:
    """Deterministic abstraction of App. E.1 -> one token string (TF-IDF gives g_i of Eq. 1).

    Tool names become operation types, identifiers / field names / free text are dropped, argument literals
    become type placeholders; dependency structure, gate types and provenance, group relations and conflict
    types are kept.  Operation ids are replaced by the operation's abstract label.
    """
    label = {o.id: f"{o.type}({o.target_kind})" for o in desc.operations}
    toks: list[str] = []
    for o in desc.operations:
        toks.append(f"op:{o.type}")
        toks.append(f"op:{label[o.id]}")
        toks.extend(f"arg:{o.type}:{t}" for t in sorted(o.arguments.values()))
    seq = [o.type for o in desc.operations]
    toks.extend(f"seq:{a}>{b}" for a, b in itertools.pairwise(seq))
    toks.extend(f"seq3:{a}>{b}>{c}" for a, b, c in zip(seq, seq[1:], seq[2:]))
    edges = {(d.source, d.target) for d in desc.dependencies} | {(s, o.id) for o in desc.operations for s in o.depends_on}
    toks.extend(f"dep:{label[s]}>{label[t]}" for s, t in sorted(edges))
    for g in desc.gates:
        toks.append(f"gate:{g.type}")
        toks.append(f"gate:{g.type}:{g.provenance}")
        toks.extend(f"gate:{g.type}>{label[b]}" for b in g.blocks)
    for r in desc.reward_groups:
        toks.append(f"group:{r.relation}")
        toks.append(f"group:{r.relation}:n{_size_bucket(len(r.checks))}")
    for c in desc.conflicts:
        toks.append(f"conflict:{c.type}")
        toks.append(f"conflict:{c.type}:{label[c.first]}>{label[c.second]}")
    toks.append(f"size:ops{_size_bucket(len(desc.operations))}")
    return " ".join(toks)


def concrete_text(desc: OperationDescription) -> str:
    """The complete operation description (tool names, field names, free text): within-environment view 6."""
    parts = []
    for o in desc.operations:
        parts.append(f"{o.type} {o.tool or ''} {o.target_kind} {' '.join(o.arguments)} {o.description}")
    for g in desc.gates:
        parts.append(f"gate {g.type} {g.provenance} {g.description}")
    for r in desc.reward_groups:
        parts.append(f"group {r.relation} {len(r.checks)}")
    for c in desc.conflicts:
        parts.append(f"conflict {c.type}")
    return " ; ".join(parts)
