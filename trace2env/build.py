"""The construction pipeline: traces → aligned evidence → schemas → rules (reviewed by replay) → package.

Paper §4.1 and Appendix C.2 (Figure 2): alignment, local evidence, schema induction, abstraction induction
with review against supporting and contrasting cases, then compilation into an immutable worldbook. This
module runs the deterministic path end to end (:mod:`trace2env.induce`) and, when a
:class:`~trace2env.providers.Provider` is given, merges the model stages ``induce_schema`` and
``induce_rules`` (a scripted provider in tests; an OpenAI-compatible one later). Every candidate rule,
deterministic or proposed, is promoted only by :func:`~trace2env.induce.replay_review`.

Only ``train`` traces of the split manifest are used (all traces when no manifest is given). Traces in which no
action has an observation (chat traces with their ``tool`` messages left out) are refused: a worldbook of them would
hold no rule and no evidence, and its simulator could only answer with errors.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .induce import (
    induce_action_schema,
    induce_contracts,
    induce_state_schema,
    induce_template_rules,
    replay_review,
    select_demonstrations,
)
from .ingest import align, content_hash
from .models import ActionSpec, SplitManifest, StateField, Trace
from .package import compile_worldbook
from .providers import Provider, RuleProposal, SchemaProposal

__all__ = ["build_worldbook", "merge_actions", "merge_fields"]


def merge_actions(base: Sequence[ActionSpec], extra: Sequence[ActionSpec]) -> list[ActionSpec]:
    """Proposed specs replace induced ones of the same name; new names are added."""
    out = {a.name: a for a in base}
    out.update({a.name: a for a in extra})
    return [out[k] for k in sorted(out)]


def merge_fields(base: Sequence[StateField], extra: Sequence[StateField]) -> list[StateField]:
    out = {f.path: f for f in base}
    out.update({f.path: f for f in extra})
    return [out[k] for k in sorted(out)]


def build_worldbook(traces: Sequence[Trace], out_dir: str | Path, *, provider: Provider | None = None,
                    split: SplitManifest | None = None, environment_id: str | None = None,
                    name: str = "", description: str = "") -> Path:
    """Build and publish a worldbook from the ``train`` traces. Returns the package directory."""
    if split is not None:
        missing = [t.trace_id for t in traces if t.trace_id not in split.assignments]
        if missing:
            raise ValueError(f"traces not in the split manifest: {missing[:3]}")
        traces = [t for t in traces if split.assignments[t.trace_id].split == "train"]
    if not traces:
        raise ValueError("no training traces")
    episodes = [(align(t), t.metadata.get("initial_state") or {}) for t in traces]
    transitions = [x for ts, _ in episodes for x in ts]
    if not any(t.observation is not None for t in transitions):
        raise ValueError(f"the {len(traces)} training trace(s) hold {len(transitions)} action(s) and not one observation "
                         "(were the tool results left out?): a worldbook needs observations to learn from")
    actions = induce_action_schema(transitions)
    fields = induce_state_schema(transitions)
    rules = induce_template_rules(transitions)
    invariants = []
    stages = []
    if provider is not None:
        summary = {"actions": [a.model_dump(mode="json") for a in actions],
                   "state_fields": [f.model_dump(mode="json") for f in fields],
                   "transitions": [{"id": t.id, "action": t.action.model_dump(mode="json"), "observation": t.observation,
                                    "alignment": t.alignment} for t in transitions]}
        schema = provider.complete("induce_schema", summary, SchemaProposal)
        actions = merge_actions(actions, schema.actions)
        fields = merge_fields(fields, schema.state_fields)
        proposal = provider.complete("induce_rules", {**summary, "actions": [a.model_dump(mode="json") for a in actions],
                                                      "state_fields": [f.model_dump(mode="json") for f in fields]},
                                     RuleProposal)
        rules = [*rules, *proposal.rules]
        invariants = list(proposal.invariants)
        stages = ["induce_schema", "induce_rules"]
    ids = [r.id for r in rules]
    if len(ids) != len(set(ids)):
        raise ValueError("duplicate rule ids among candidates")
    reviewed, report = replay_review(rules, episodes, fields)
    return compile_worldbook(
        out_dir, environment_id=environment_id or f"env_{content_hash(sorted(t.trace_id for t in traces))[:16]}",
        traces=traces, transitions=transitions, actions=actions, state_fields=fields, rules=reviewed,
        invariants=invariants, contracts=induce_contracts(transitions), demonstrations=select_demonstrations(transitions),
        replay=report.to_json(), name=name, description=description,
        metadata={"model_stages": stages, "deterministic": provider is None})
