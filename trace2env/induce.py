"""Deterministic (model-free) construction stages: schema induction, contracts, template rules, demos,
exact-match evidence retrieval, and the replay review that promotes or falsifies candidate rules.

Paper §4.1 / Appendix C.2 describe construction as alignment → local evidence → schema induction →
abstraction induction, with rules "reviewed against supporting and available contrasting cases: … a
counterexample can narrow a rule or leave it tentative". Where a stage needs no model, it is done here:

* :func:`induce_action_schema` — action names, argument keys, JSON types and which are always present;
* :func:`induce_state_schema` — state variables from JSON observations (``surface.observed.<action>.<key>``
  with the types seen), so a world-model agent may record observed values on declared paths;
* :func:`induce_contracts` — per action: JSON or text, keys present in every observation, examples;
* :func:`induce_template_rules` — argument-echo templates: an action whose every recorded observation is the
  same text once argument values are replaced by tokens gets an unconditional rule with that template;
* :func:`select_demonstrations` — at most ``k`` per action, diverse in outcome and episode;
* :func:`retrieve_exact` — recorded transitions with the same action and normalised arguments;
* :func:`replay_review` — replays every training trace through the engine from its initial state and
  judges each candidate rule on every transition where it applies: exact reproduction of the recorded
  observation is support, anything else a counterexample. Rules with support and no counterexample become
  ``supported`` (executable); rules with counterexamples become ``conflicted``; unexercised ones stay
  ``tentative``. Model-proposed rules (scripted provider in tests) go through the same review.

Ambiguously aligned transitions never contribute effects or rule support (§4.1: "effects with ambiguous
attribution are withheld").
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .engine import (
    MISSING,
    EngineError,
    apply_effects,
    eval_condition,
    json_type_of,
    normalise,
    parse_path,
    render_template,
    resolve_effects,
)
from .ingest import canonical_json, content_hash
from .models import (
    ActionSpec,
    ArgumentSpec,
    Demonstration,
    RenderContract,
    SourceRef,
    StateField,
    Transition,
    TransitionRule,
)

__all__ = [
    "ReplayReport",
    "argument_template",
    "induce_action_schema",
    "induce_contracts",
    "induce_state_schema",
    "induce_template_rules",
    "initial_state_for",
    "merge_types",
    "outcome_of",
    "replay_review",
    "retrieve_exact",
    "select_demonstrations",
    "source_ref",
]


def source_ref(t: Transition) -> SourceRef:
    return SourceRef(source_id=t.trace_id, episode_id=t.episode_id, transition_id=t.id,
                     event_ids=(t.action_event_id, *t.observation_event_ids),
                     excerpt=(t.observation or "")[:200])


def merge_types(types: Iterable[str]) -> str:
    ts = set(types) - {"null"}
    if not ts:
        return "any"
    if ts == {"integer", "number"}:
        return "number"
    return ts.pop() if len(ts) == 1 else "any"


def _json(text: str | None) -> Any:
    if text is None:
        return MISSING
    try:
        return json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return MISSING


def outcome_of(t: Transition) -> str:
    """``failure`` when the observation is a JSON object with an ``error`` key or text starting with
    ``error``; ``unknown`` without an observation; else ``success``."""
    if t.observation is None:
        return "unknown"
    obj = _json(t.observation)
    if isinstance(obj, dict):
        return "failure" if "error" in obj else "success"
    return "failure" if t.observation.strip().lower().startswith("error") else "success"


def _clean(transitions: Iterable[Transition]) -> list[Transition]:
    return [t for t in transitions if t.alignment != "ambiguous" and t.observation is not None]


def induce_action_schema(transitions: Sequence[Transition]) -> list[ActionSpec]:
    """One :class:`ActionSpec` per action name: argument types merged over calls; ``required`` when the
    argument appears in every call."""
    calls: dict[str, list[Transition]] = defaultdict(list)
    for t in transitions:
        calls[t.action.name].append(t)
    out = []
    for name in sorted(calls):
        ts = calls[name]
        keys = sorted({k for t in ts for k in t.action.arguments})
        args = {k: ArgumentSpec(type=merge_types(json_type_of(t.action.arguments[k]) for t in ts if k in t.action.arguments),
                                required=all(k in t.action.arguments for t in ts)) for k in keys}
        out.append(ActionSpec(name=name, arguments=args, description=f"observed {len(ts)} times",
                              provenance=tuple(source_ref(t) for t in ts[:3])))
    return out


def induce_state_schema(transitions: Sequence[Transition]) -> list[StateField]:
    """State variables from JSON-object observations: ``surface.observed.<action>`` (object) and one field
    per top-level key with the merged type of its values."""
    seen: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    refs: dict[str, list[Transition]] = defaultdict(list)
    for t in _clean(transitions):
        obj = _json(t.observation)
        if isinstance(obj, dict):
            refs[t.action.name].append(t)
            for k, v in obj.items():
                seen[t.action.name][k].append(json_type_of(v))
    out = []
    for name in sorted(seen):
        base = f'surface.observed["{name}"]'
        out.append(StateField(path=base, type="object", description=f"last observed fields of {name}",
                              provenance=tuple(source_ref(t) for t in refs[name][:3])))
        for k in sorted(seen[name]):
            out.append(StateField(path=f"{base}[{json.dumps(k)}]", type=merge_types(seen[name][k]),
                                  description=f"top-level key {k!r} of {name} observations"))
    return out


def induce_contracts(transitions: Sequence[Transition], *, examples: int = 3) -> list[RenderContract]:
    by_action: dict[str, list[Transition]] = defaultdict(list)
    for t in _clean(transitions):
        by_action[t.action.name].append(t)
    out = []
    for name in sorted(by_action):
        ts = by_action[name]
        objs = [_json(t.observation) for t in ts]
        is_json = all(isinstance(o, dict) for o in objs)
        required: tuple[str, ...] = ()
        if is_json:
            common = set(objs[0])
            for o in objs[1:]:
                common &= set(o)
            required = tuple(sorted(common))
        ex = tuple(dict.fromkeys(t.observation for t in ts))[:examples]  # type: ignore[misc]
        out.append(RenderContract(id=f"contract:{name}", action_types=(name,), content_type="json" if is_json else "text",
                                  required_fields=required, examples=ex, provenance=tuple(source_ref(t) for t in ts[:3])))
    return out


def argument_template(observation: str, arguments: Mapping[str, Any]) -> str:
    """The observation with every JSON-quoted string argument value replaced by ``{{json:action.arguments.k}}``
    (longest values first, so a value that contains another is replaced whole)."""
    out = observation
    for k, v in sorted(((k, v) for k, v in arguments.items() if isinstance(v, str) and v),
                       key=lambda kv: -len(kv[1])):
        out = out.replace(json.dumps(v, ensure_ascii=False), "{{json:action.arguments." + k + "}}")
    return out


def induce_template_rules(transitions: Sequence[Transition]) -> list[TransitionRule]:
    """Unconditional, effect-free rules for actions whose observations are a pure function of the
    arguments (one template fits every recorded call). They are candidates: :func:`replay_review` decides."""
    groups: dict[str, list[tuple[Transition, str]]] = defaultdict(list)
    for t in _clean(transitions):
        groups[t.action.name].append((t, argument_template(t.observation or "", t.action.arguments)))
    out = []
    for name in sorted(groups):
        templates = {tpl for _, tpl in groups[name]}
        if len(templates) != 1:
            continue
        tpl = templates.pop()
        ts = [t for t, _ in groups[name]]
        out.append(TransitionRule(id=f"tpl:{name}:{content_hash(tpl)[:8]}", action_type=name,
                                  description=f"{name} always answers with one argument template",
                                  outcome=outcome_of(ts[0]), observation_template=tpl, confidence=0.0,
                                  status="tentative", provenance=tuple(source_ref(t) for t in ts[:5])))
    return out


def select_demonstrations(transitions: Sequence[Transition], *, k: int = 3) -> list[Demonstration]:
    """At most ``k`` per action: first one per outcome, then one per new episode, then in order."""
    by_action: dict[str, list[Transition]] = defaultdict(list)
    for t in _clean(transitions):
        by_action[t.action.name].append(t)
    out = []
    for name in sorted(by_action):
        chosen: list[Transition] = []
        outcomes: set[str] = set()
        episodes: set[str] = set()
        for pred in (lambda t, seen=outcomes: outcome_of(t) not in seen, lambda t, seen=episodes: t.episode_id not in seen,
                     lambda t: True):
            for t in by_action[name]:
                if len(chosen) < k and t not in chosen and pred(t):
                    chosen.append(t)
                    outcomes.add(outcome_of(t))
                    episodes.add(t.episode_id)
        out += [Demonstration(id=f"demo:{t.id}", action=t.action, observation=t.observation or "",
                              outcome=outcome_of(t), provenance=(source_ref(t),)) for t in chosen]  # type: ignore[arg-type]
    return out


def retrieve_exact(transitions: Sequence[Transition], name: str, arguments: Mapping[str, Any]) -> list[Transition]:
    """Recorded transitions of the same action with equal arguments after normalisation (1 == 1.0)."""
    key = canonical_json(normalise(dict(arguments)))
    return [t for t in transitions if t.action.name == name and canonical_json(normalise(t.action.arguments)) == key]


def _set_default(state: dict[str, Any], segs: tuple[str, ...], value: Any) -> None:
    node = state
    for s in segs[:-1]:
        node = node.setdefault(s, {})
    node.setdefault(segs[-1], value)


def initial_state_for(fields: Sequence[StateField], initial: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Defaults of the declared fields, overlaid by a supplied (possibly partial) initial state."""
    import copy

    from .engine import empty_state

    state = empty_state()
    for ns, sub in (initial or {}).items():
        state[ns] = copy.deepcopy(dict(sub))
    for f in fields:
        if f.default is not None:
            _set_default(state, parse_path(f.path), copy.deepcopy(f.default))
    return state


@dataclass
class ReplayReport:
    """Per-rule support/counterexamples and per-transition coverage from :func:`replay_review`."""

    support: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    counterexamples: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    transitions: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"support": {k: v for k, v in sorted(self.support.items())},
                "counterexamples": {k: v for k, v in sorted(self.counterexamples.items())},
                "transitions": self.transitions}


def replay_review(rules: Sequence[TransitionRule], episodes: Sequence[tuple[Sequence[Transition], Mapping[str, Any]]],
                  fields: Sequence[StateField]) -> tuple[list[TransitionRule], ReplayReport]:
    """Judge every candidate rule by replaying ``episodes`` (transitions in order, initial state).

    On each unambiguous transition, every rule of that action whose conditions hold and whose effects
    resolve and apply is rendered and compared with the recorded observation. The state advances with the
    effects of the highest-priority reproducing rules when they agree (else it stays: the effect is unknown). Returns the rules
    with updated ``status``, ``confidence`` and ``counterexamples``, and the report."""
    report = ReplayReport()
    by_action: dict[str, list[TransitionRule]] = defaultdict(list)
    for r in rules:
        by_action[r.action_type].append(r)
    refs: dict[str, list[SourceRef]] = defaultdict(list)
    for transitions, initial in episodes:
        state: Any = initial_state_for(fields, initial)
        for t in transitions:
            entry: dict[str, Any] = {"transition": t.id, "action": t.action.name, "rules": [], "reproduced": []}
            if t.alignment == "ambiguous" or t.observation is None:
                entry["skipped"] = "ambiguous" if t.alignment == "ambiguous" else "no_observation"
                report.transitions.append(entry)
                continue
            matches: list[tuple[int, Any]] = []
            for r in by_action.get(t.action.name, ()):
                args = t.action.arguments
                if not all(eval_condition(c, args, state) for c in r.conditions):
                    continue
                try:
                    after = apply_effects(state, resolve_effects(r.effects, args, state))
                    text = (render_template(r.observation_template, arguments=args, before=state, after=after,
                                            outcome=r.outcome) if r.observation_template is not None else None)
                except EngineError:
                    continue
                entry["rules"].append(r.id)
                if text == t.observation:
                    report.support[r.id].append(t.id)
                    entry["reproduced"].append(r.id)
                    matches.append((r.priority, after))
                else:
                    report.counterexamples[r.id].append(t.id)
                    refs[r.id].append(source_ref(t))
            # advance like the runtime would: the highest-priority reproducing rules, when they agree
            top = [a for p, a in matches if p == max(p for p, _ in matches)]
            if len({canonical_json(normalise(a)) for a in top}) == 1:
                state = top[0]
            report.transitions.append(entry)
    out = []
    for r in rules:
        sup, bad = len(report.support.get(r.id, ())), len(report.counterexamples.get(r.id, ()))
        # confidence = fraction of the replayed applications that reproduced the recorded observation
        if bad:
            status, conf = "conflicted", sup / (sup + bad)
        elif sup:
            status, conf = "supported", 1.0
        else:
            status, conf = "tentative", r.confidence
        out.append(r.model_copy(update={"status": status, "confidence": round(conf, 6),
                                        "counterexamples": tuple(r.counterexamples) + tuple(refs.get(r.id, ())[:5])}))
    return out, report
