"""The deterministic engine: state paths, effects, conditions, templates, rule selection, invariants.

Paper §4.3 and Appendix C.3: a transition proposal is "an ordered list of candidate state effects, each a
declarative update to one declared state variable" plus an observation; the harness checks the effects
"on a state copy against the schemas, rule support, and applicable state constraints" before committing.
Reconstructed rules (§4.1, "conditional effects") are executed here without any model — the rule fast path.

State is a tree of plain ``dict``/``list`` values under the namespaces ``world``, ``session``, ``surface``
and ``epistemic``. It is **persistent by convention**: :func:`apply_effects` never mutates its input; it
copies only the containers on the path it changes (path copying) and shares everything else. So a state copy
for validation costs nothing, a commit is a pointer swap whose cost does not grow with the size of the whole
state, and forked sessions share all untouched structure. Callers must treat state values as read-only.

Path grammar: dot-separated segments; ``["any key"]`` brackets for keys with dots or spaces; a segment
``$k`` or ``{{action.arguments.k}}`` is replaced by the argument's value (as one key, dots and all). A missing path is *unknown*
(paper §4.2: "a missing state entry is treated as unknown rather than as evidence of absence").

Templates: ``{{action.arguments.k}}``, ``{{state_before.p}}``, ``{{state_after.p}}``, ``{{outcome}}``;
a ``json:`` prefix (``{{json:action.arguments.k}}``) inserts the JSON encoding; strings insert as-is.
``{{`` never occurs in valid JSON text, so templates of JSON observations need no escaping.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from .models import NAMESPACES, ActionSpec, Condition, Effect, Invariant, Operand, StateField, TransitionRule

__all__ = [
    "MISSING",
    "EngineError",
    "ResolvedEffect",
    "RuleSelection",
    "apply_effects",
    "check_action",
    "check_invariants",
    "empty_state",
    "eval_condition",
    "get_path",
    "json_type_of",
    "normalise",
    "parse_path",
    "render_template",
    "resolve_effects",
    "select_rule",
    "type_matches",
    "validate_effects",
]


class EngineError(ValueError):
    """An effect, path or template that cannot be applied; carries a human-readable reason."""


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()

_TOKEN = re.compile(r"\{\{\s*(json:)?([^{}]+?)\s*\}\}")


def empty_state() -> dict[str, Any]:
    return {ns: {} for ns in NAMESPACES}


# ----------------------------------------------------------------------------------------------- paths


def parse_path(path: str, arguments: Mapping[str, Any] | None = None) -> tuple[str, ...]:
    """``'world.store["a.b"].{{action.arguments.k}}'`` → ``('world', 'store', 'a.b', <value of k>)``."""
    segs: list[str] = []
    i, n = 0, len(path)
    while i < n:
        if path.startswith("{{", i):
            j = path.find("}}", i)
            if j < 0:
                raise EngineError(f"unclosed token in path {path!r}")
            expr = path[i + 2:j].strip()
            if not expr.startswith("action.arguments."):
                raise EngineError(f"path token must be an action argument: {path!r}")
            name = expr[len("action.arguments."):]
            if arguments is None or name not in arguments:
                raise EngineError(f"path {path!r} needs argument {name!r}")
            segs.append(str(arguments[name]))
            i = j + 2
        elif path[i] == "[":
            m = re.match(r'\[\s*("(?:[^"\\]|\\.)*"|\d+)\s*\]', path[i:])
            if not m:
                raise EngineError(f"bad bracket segment in path {path!r}")
            tok = m.group(1)
            segs.append(json.loads(tok) if tok.startswith('"') else tok)
            i += m.end()
        else:
            j = i
            while j < n and path[j] not in ".[" and not path.startswith("{{", j):
                j += 1
            if j > i:
                seg = path[i:j]
                if seg.startswith("$") and len(seg) > 1:
                    if arguments is None or seg[1:] not in arguments:
                        raise EngineError(f"path {path!r} needs argument {seg[1:]!r}")
                    seg = str(arguments[seg[1:]])
                segs.append(seg)
            i = j
        if i < n and path[i] == ".":
            i += 1
    if not segs:
        raise EngineError("empty path")
    if segs[0] not in NAMESPACES:
        raise EngineError(f"path {path!r} must start with one of {', '.join(NAMESPACES)}")
    return tuple(segs)


@lru_cache(maxsize=8192)
def _declared_path(path: str) -> tuple[str, ...]:
    """:func:`parse_path` of an argument-free path (schema fields), parsed once: the schema checks of every
    step look at every declared field, and re-parsing them dominated the rule fast path."""
    return parse_path(path)


def _child(node: Any, seg: str) -> Any:
    if isinstance(node, Mapping):
        return node.get(seg, MISSING)
    if isinstance(node, list) and re.fullmatch(r"-?\d+", seg):
        k = int(seg)
        return node[k] if -len(node) <= k < len(node) else MISSING
    return MISSING


def get_path(state: Any, path: str | Sequence[str], arguments: Mapping[str, Any] | None = None) -> Any:
    segs = parse_path(path, arguments) if isinstance(path, str) else tuple(path)
    node = state
    for s in segs:
        node = _child(node, s)
        if node is MISSING:
            return MISSING
    return node


def _replace(node: Any, segs: tuple[str, ...], fn) -> Any:
    """Return a copy of ``node`` in which the value at ``segs`` is ``fn(old)`` (``MISSING`` deletes).

    Only containers on the path are copied. Intermediate objects are created when absent."""
    if not segs:
        return fn(node)
    head, rest = segs[0], segs[1:]
    if node is MISSING:
        node = {}
    if isinstance(node, Mapping):
        new_child = _replace(node.get(head, MISSING), rest, fn)
        out = dict(node)
        if new_child is MISSING:
            out.pop(head, None)
        else:
            out[head] = new_child
        return out
    if isinstance(node, list) and re.fullmatch(r"-?\d+", head):
        k = int(head)
        if not -len(node) <= k < len(node):
            raise EngineError(f"index {k} out of range")
        new_child = _replace(node[k], rest, fn)
        out_l = list(node)
        if new_child is MISSING:
            del out_l[k]
        else:
            out_l[k] = new_child
        return out_l
    raise EngineError(f"cannot descend into {type(node).__name__} at {head!r}")


# ----------------------------------------------------------------------------------------------- values


def normalise(value: Any) -> Any:
    """Canonical form for comparisons: integral floats become ints, tuples lists, dict keys sorted."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, Mapping):
        return {str(k): normalise(value[k]) for k in sorted(value, key=str)}
    if isinstance(value, (list, tuple)):
        return [normalise(v) for v in value]
    return value


def json_type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, Mapping):
        return "object"
    if isinstance(value, (list, tuple)):
        return "array"
    return "any"


def type_matches(declared: str, value: Any) -> bool:
    t = json_type_of(value)
    return declared == "any" or t == declared or (declared == "number" and t == "integer")


def _resolve_value(value: Any, arguments: Mapping[str, Any], state: Any) -> Any:
    if isinstance(value, Mapping):
        if set(value) == {"$action_arg"}:
            name = value["$action_arg"]
            if name not in arguments:
                raise EngineError(f"effect needs argument {name!r}")
            return arguments[name]
        if set(value) == {"$state"}:
            v = get_path(state, value["$state"], arguments)
            if v is MISSING:
                raise EngineError(f"effect reads unknown state {value['$state']!r}")
            return v
        return {(_resolve_str(k, arguments) if isinstance(k, str) else k): _resolve_value(v, arguments, state)
                for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve_value(v, arguments, state) for v in value]
    if isinstance(value, str):
        m = _TOKEN.fullmatch(value)
        if m and m.group(2).strip().startswith("action.arguments.") and not m.group(1):
            name = m.group(2).strip()[len("action.arguments."):]
            if name not in arguments:
                raise EngineError(f"effect needs argument {name!r}")
            return arguments[name]
        return _resolve_str(value, arguments)
    return value


def _resolve_str(text: str, arguments: Mapping[str, Any]) -> str:
    def sub(m: re.Match[str]) -> str:
        expr = m.group(2).strip()
        if not expr.startswith("action.arguments."):
            raise EngineError(f"only action arguments may appear in effect values: {m.group(0)}")
        name = expr[len("action.arguments."):]
        if name not in arguments:
            raise EngineError(f"effect needs argument {name!r}")
        v = arguments[name]
        return json.dumps(v, ensure_ascii=False) if m.group(1) or not isinstance(v, str) else v

    return _TOKEN.sub(sub, text)


@dataclass(frozen=True)
class ResolvedEffect:
    """An effect with its path parsed and its value resolved against the action and the pre-state."""

    op: str
    path: tuple[str, ...]
    value: Any

    def key(self) -> str:
        return json.dumps([self.op, list(self.path), normalise(self.value)], sort_keys=True)


def resolve_effects(effects: Sequence[Effect], arguments: Mapping[str, Any], state: Any) -> list[ResolvedEffect]:
    return [ResolvedEffect(e.op, parse_path(e.path, arguments), _resolve_value(e.value, arguments, state))
            for e in effects]


def _apply_one(state: Any, eff: ResolvedEffect) -> Any:
    op, v, where = eff.op, eff.value, ".".join(eff.path)
    if len(eff.path) < 2 and op in ("delete", "create"):
        raise EngineError(f"{op} on a whole namespace ({where})")

    def fn(old: Any) -> Any:
        if op == "set":
            return v
        if op == "create":
            if old is not MISSING:
                raise EngineError(f"create: {where} already exists")
            return v
        if op == "delete":
            if old is MISSING:
                raise EngineError(f"delete: {where} does not exist")
            return MISSING
        if op in ("increment", "decrement"):
            if json_type_of(old) not in ("integer", "number"):
                raise EngineError(f"{op}: {where} is not a number")
            delta = 1 if v is None else v
            if json_type_of(delta) not in ("integer", "number"):
                raise EngineError(f"{op}: amount {delta!r} is not a number")
            if json_type_of(old) == "integer" and isinstance(delta, float) and not delta.is_integer():
                raise EngineError(f"{op}: fractional change to integer {where}")
            out = old + delta if op == "increment" else old - delta
            return int(out) if json_type_of(old) == "integer" else out
        if op == "append":
            if old is MISSING:
                return [v]
            if not isinstance(old, list):
                raise EngineError(f"append: {where} is not an array")
            return [*old, v]
        if op == "merge":
            if not isinstance(v, Mapping):
                raise EngineError(f"merge: value for {where} is not an object")
            if old is MISSING:
                return dict(v)
            if not isinstance(old, Mapping):
                raise EngineError(f"merge: {where} is not an object")
            return {**old, **v}
        if op == "remove":
            keys = v if isinstance(v, list) else [v]
            if isinstance(old, Mapping):
                missing = [k for k in keys if k not in old]
                if missing:
                    raise EngineError(f"remove: {where} has no key {missing[0]!r}")
                return {k: x for k, x in old.items() if k not in keys}
            if isinstance(old, list):
                out_l = list(old)
                for k in keys:
                    if k not in out_l:
                        raise EngineError(f"remove: {where} does not contain {k!r}")
                    out_l.remove(k)
                return out_l
            raise EngineError(f"remove: {where} is not an object or array")
        raise EngineError(f"unknown op {op!r}")

    return _replace(state, eff.path, fn)


def apply_effects(state: Any, effects: Sequence[ResolvedEffect]) -> Any:
    """Apply effects in order to a *copy* (path copying); ``state`` itself is never modified.

    Raises :class:`EngineError` on the first effect that cannot apply (the caller keeps the old state)."""
    for e in effects:
        state = _apply_one(state, e)
    return state


# ----------------------------------------------------------------------------------------------- conditions


def _operand(op: Operand | None, arguments: Mapping[str, Any], state: Any) -> Any:
    if op is None:
        return MISSING
    if op.path is not None:
        try:
            return get_path(state, op.path, arguments)
        except EngineError:
            return MISSING
    if op.action_arg is not None:
        return arguments.get(op.action_arg, MISSING)
    return op.literal


def eval_condition(cond: Condition, arguments: Mapping[str, Any], state: Any) -> bool:
    """Evaluate one condition; comparisons with an unknown operand are false (never guessed)."""
    if cond.any_of:
        return any(eval_condition(c, arguments, state) for c in cond.any_of)
    left = _operand(cond.left, arguments, state)
    if cond.op == "exists":
        return left is not MISSING
    if cond.op == "not_exists":
        return left is MISSING
    right = _operand(cond.right, arguments, state)
    if left is MISSING or right is MISSING:
        return False
    a, b = normalise(left), normalise(right)
    try:
        if cond.op == "eq":
            return a == b
        if cond.op == "ne":
            return a != b
        if cond.op == "gt":
            return a > b
        if cond.op == "gte":
            return a >= b
        if cond.op == "lt":
            return a < b
        if cond.op == "lte":
            return a <= b
        if cond.op == "contains":
            return b in a if isinstance(a, (str, list, dict)) else False
        if cond.op == "in":
            return a in b if isinstance(b, (str, list, dict)) else False
    except TypeError:
        return False
    return False


# ----------------------------------------------------------------------------------------------- templates


def render_template(template: str, *, arguments: Mapping[str, Any], before: Any, after: Any, outcome: str) -> str:
    """Fill a template's tokens; an unknown reference raises :class:`EngineError`."""

    def sub(m: re.Match[str]) -> str:
        as_json, expr = bool(m.group(1)), m.group(2).strip()
        if expr == "outcome":
            v: Any = outcome
        elif expr.startswith("action.arguments."):
            v = arguments.get(expr[len("action.arguments."):], MISSING)
        elif expr.startswith(("state_before.", "state_after.")):
            base, _, p = expr.partition(".")
            v = get_path(before if base == "state_before" else after, p, arguments)
        else:
            raise EngineError(f"unknown template token {m.group(0)}")
        if v is MISSING:
            raise EngineError(f"template token {m.group(0)} refers to nothing")
        return json.dumps(v, ensure_ascii=False) if as_json or not isinstance(v, str) else v

    return _TOKEN.sub(sub, template)


# ----------------------------------------------------------------------------------------------- rules


@dataclass(frozen=True)
class RuleSelection:
    """Outcome of :func:`select_rule`: the winning rule (if exactly one plan wins) and the contenders."""

    rule: TransitionRule | None
    effects: tuple[ResolvedEffect, ...] = ()
    candidates: tuple[str, ...] = ()
    ambiguous: bool = False
    reason: str = ""


def select_rule(rules: Sequence[TransitionRule], action: str, arguments: Mapping[str, Any], state: Any, *,
                min_confidence: float = 0.0) -> RuleSelection:
    """Among eligible rules (``supported``, confidence ≥ threshold, same action) whose conditions hold and
    whose effects resolve and apply, the highest priority wins. Several top-priority rules with *different* plans
    (normalised effects, template, outcome) are ambiguous: no rule is chosen and all are reported."""
    applicable: list[tuple[TransitionRule, tuple[ResolvedEffect, ...]]] = []
    for r in rules:
        if r.action_type != action or r.status != "supported" or r.confidence < min_confidence:
            continue
        if not all(eval_condition(c, arguments, state) for c in r.conditions):
            continue
        try:
            effs = tuple(resolve_effects(r.effects, arguments, state))
            apply_effects(state, effs)  # path copying: a dry run costs no more than the commit
        except EngineError:
            continue
        applicable.append((r, effs))
    if not applicable:
        return RuleSelection(None, reason="no applicable rule")
    top = max(r.priority for r, _ in applicable)
    best = [(r, e) for r, e in applicable if r.priority == top]
    plans = {json.dumps([[x.key() for x in e], r.observation_template, r.outcome]) for r, e in best}
    ids = tuple(r.id for r, _ in best)
    if len(plans) > 1:
        return RuleSelection(None, candidates=ids, ambiguous=True,
                             reason=f"{len(best)} rules of priority {top} disagree: {', '.join(ids)}")
    r, e = min(best, key=lambda x: x[0].id)
    return RuleSelection(r, e, candidates=ids)


def check_invariants(invariants: Sequence[Invariant], state: Any) -> list[str]:
    """Ids of the ``error`` invariants that ``state`` violates."""
    return [inv.id for inv in invariants if inv.severity == "error" and not eval_condition(inv.condition, {}, state)]


# ----------------------------------------------------------------------------------------------- schema checks


def _field_for(fields: Sequence[StateField], segs: tuple[str, ...]) -> StateField | None:
    """The declared field covering ``segs``: an exact match, else the longest object/array/any prefix."""
    best: StateField | None = None
    best_len = -1
    for f in fields:
        fs = _declared_path(f.path)
        if (fs == segs[: len(fs)] and (len(fs) == len(segs) or f.type in ("object", "array", "any"))
                and len(fs) > best_len):
            best, best_len = f, len(fs)
    return best


def validate_effects(effects: Sequence[ResolvedEffect], fields: Sequence[StateField]) -> list[str]:
    """Schema errors of resolved effects: undeclared paths, immutable fields, type mismatches, ops on the
    wrong kind of value. An empty list means the effects may be tried on a state copy."""
    errors = []
    for e in effects:
        where = ".".join(e.path)
        f = _field_for(fields, e.path)
        if f is None:
            errors.append(f"{e.op} {where}: path not declared in the state schema")
            continue
        below = [g for g in fields if not g.mutable and _declared_path(g.path)[: len(e.path)] == e.path]
        if not f.mutable or below:
            errors.append(f"{e.op} {where}: field is immutable")
            continue
        exact = _declared_path(f.path) == e.path
        if exact and e.op in ("set", "create") and not type_matches(f.type, e.value):
            errors.append(f"{e.op} {where}: expected {f.type}, got {json_type_of(e.value)}")
        if exact and e.op == "append" and f.type not in ("array", "any"):
            errors.append(f"append {where}: field is {f.type}, not array")
        if exact and e.op == "merge" and f.type not in ("object", "any"):
            errors.append(f"merge {where}: field is {f.type}, not object")
        if exact and e.op in ("increment", "decrement") and f.type not in ("integer", "number", "any"):
            errors.append(f"{e.op} {where}: field is {f.type}, not a number")
    return errors


def check_action(specs: Sequence[ActionSpec], name: str, arguments: Any) -> tuple[ActionSpec | None, list[str]]:
    """Resolve aliases and type-check arguments (required, type, enum, unknown names)."""
    spec = next((s for s in specs if s.name == name or name in s.aliases), None)
    if spec is None:
        return None, [f"unknown action {name!r}"]
    if not isinstance(arguments, Mapping):
        return spec, ["arguments must be an object"]
    errs = [f"missing required argument {k!r}" for k, a in spec.arguments.items() if a.required and k not in arguments]
    for k, v in arguments.items():
        a = spec.arguments.get(k)
        if a is None:
            errs.append(f"unknown argument {k!r}")
        elif not type_matches(a.type, v):
            errs.append(f"argument {k!r}: expected {a.type}, got {json_type_of(v)}")
        elif a.enum is not None and v not in a.enum:
            errs.append(f"argument {k!r}: {v!r} not one of {list(a.enum)}")
    return spec, errs

