"""The applicability gate: may a recorded piece of evidence stand in for *this* episode's step?

Paper §4.2 (knowledge in the workspace is "applicable" only when grounded in this episode) and the
reference's knowledge gate (``../shared/design/trace2env-reference.md`` §2, "Applicability gate"): every
evidence item shown to the world model carries a label

* ``supporting`` — its values may be reused as they are;
* ``uncertain`` — it shares identities with this episode but its values may not hold here;
* ``format_only`` — it shows the shape of an observation only;

and items that are not ``supporting`` are *sanitised* (ids, hashes, dates, long numbers become
placeholders) before a model sees them.

The reference scores hand-tuned, domain-specific "specific tokens". Here the identity signal is generic and
exact, from the traces themselves: the **operands** of an action (its scalar argument values). A recorded
transition is ``supporting`` when

1. it is the same action with the same normalised arguments,
2. its episode started from the same initial state (``initial_state_id`` in the trace metadata equals the
   session's context; unknown on either side means *not* the same), and
3. the two episodes have the same history *on these operands*: the actions before it that share an operand
   with it (or have no operand at all, so may touch anything), in order, equal this episode's.

Under those three conditions a deterministic environment must answer the same, so the recorded observation is
replayed without a model (the ``evidence`` route of :class:`~trace2env.runtime.Session`). Otherwise
``score = shared operands + min(shared names, 3)`` (names: string values of the item's action and
observation seen in this episode) gives ``uncertain`` when ≥ 1, else ``format_only``.

Everything here is a pure function of its arguments.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .engine import normalise
from .ingest import canonical_json
from .models import ActionCall

__all__ = ["Applicability", "applicability", "history_projection", "names_in", "operands", "sanitise"]

Label = Literal["supporting", "uncertain", "format_only"]


@dataclass(frozen=True)
class Applicability:
    label: Label
    score: int
    reason: str
    shared_operands: tuple[str, ...] = ()
    shared_names: tuple[str, ...] = ()


def _leaves(value: Any) -> Iterable[Any]:
    if isinstance(value, Mapping):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _leaves(v)
    else:
        yield value


def operands(arguments: Mapping[str, Any]) -> frozenset[str]:
    """Scalar argument values (recursively), canonicalised (``1.0`` and ``1`` are one operand); booleans
    and ``None`` are not identities."""
    out = set()
    for v in _leaves(normalise(dict(arguments))):
        if isinstance(v, bool) or v is None:
            continue
        if isinstance(v, str) and not v.strip():
            continue
        out.add(v if isinstance(v, str) else json.dumps(v))
    return frozenset(out)


def names_in(text: str | None) -> frozenset[str]:
    """String values of a JSON observation (or word-like tokens of a text one) of 3+ characters."""
    if not text:
        return frozenset()
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return frozenset(t for t in re.findall(r"[\w./:-]{3,}", text))
    return frozenset(v for v in _leaves(obj) if isinstance(v, str) and len(v) >= 3)


def _key(a: ActionCall) -> str:
    return canonical_json([a.name, normalise(dict(a.arguments))])


def history_projection(history: Sequence[ActionCall], ops: frozenset[str]) -> list[str]:
    """The actions of ``history`` that may affect an action with operands ``ops``: those sharing an operand,
    and those without operands (they may touch anything). With no operands, the whole history."""
    if not ops:
        return [_key(a) for a in history]
    out = []
    for a in history:
        o = operands(a.arguments)
        if not o or o & ops:
            out.append(_key(a))
    return out


def applicability(item_action: ActionCall, item_observation: str | None, action: ActionCall, *,
                  item_history: Sequence[ActionCall], history: Sequence[ActionCall],
                  item_context: str | None, context: str | None,
                  episode_names: frozenset[str] = frozenset()) -> Applicability:
    """Label one recorded transition for the current step (see the module docstring)."""
    ops = operands(action.arguments)
    item_ops = operands(item_action.arguments)
    shared_ops = tuple(sorted(ops & item_ops))
    item_names = names_in(item_observation) | frozenset(o for o in item_ops if len(o) >= 3)
    shared_names = tuple(sorted(item_names & episode_names))
    score = len(shared_ops) + min(len(shared_names), 3)
    exact = _key(item_action) == _key(action)
    if exact:
        if item_context is None or context is None or item_context != context:
            return Applicability("uncertain", score, "same action, but not known to start from the same state",
                                 shared_ops, shared_names)
        if history_projection(item_history, ops) != history_projection(history, ops):
            return Applicability("uncertain", score, "same action and initial state, different history on its operands",
                                 shared_ops, shared_names)
        return Applicability("supporting", score, "same action, initial state and history on its operands",
                             shared_ops, shared_names)
    if score >= 1:
        return Applicability("uncertain", score, f"shares {len(shared_ops)} operand(s) and {len(shared_names)} name(s)",
                             shared_ops, shared_names)
    return Applicability("format_only", score, "no identity shared with this episode")


_PATTERNS = [
    (re.compile(r"\b\d{4}-\d{2}-\d{2}(?:[T ]\d{2}:\d{2}(?::\d{2})?)?\b"), "<date>"),
    (re.compile(r"\b(?:\d{1,3}\.){3}\d{1,3}\b"), "<ip>"),
    (re.compile(r"\b[0-9a-fA-F]{8,}\b"), "<hash>"),
    (re.compile(r"\b[A-Za-z]{1,4}[-_]?\d{2,}\b"), "<id>"),
    (re.compile(r"\b\d{3,}(?:\.\d+)?\b"), "<num>"),
]


def sanitise(text: str) -> str:
    """Replace episode-specific values (dates, IPs, hashes, ids like ``A17``, numbers of 3+ digits) with
    placeholders, so a non-supporting item can show shape but not values."""
    for pat, rep in _PATTERNS:
        text = pat.sub(rep, text)
    return text
