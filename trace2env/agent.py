"""The world-model agent: inspects the workspace with tools under a budget, then submits a transition.

Paper §4.3 / Appendix C.3: when no reconstructed rule covers a step, a world-model agent "inspects the
worldbook, the episode state and memory, proposes a transition, and the validation gate commits it". This is
that agent, behind the :class:`~trace2env.runtime.Proposer` protocol, driven by any
:class:`~trace2env.providers.Provider` (stage ``world_model_step``; :class:`~trace2env.llm.OpenAIProvider`
for a real model, :class:`~trace2env.providers.ScriptedProvider` in tests).

Each model call returns one :class:`AgentTurn` — ``{"tool": name, "arguments": {...}}``, or ``tool="submit"``
with a :class:`~trace2env.runtime.TransitionProposal` as arguments. The loop (budgets from the reference:
8 tool calls, 20 model calls, 2 invalid submissions):

* the first payload is a **brief**: the action and its spec, the rules of that action with ``applies_now``,
  exact and lexical evidence **labelled by the applicability gate** (:mod:`trace2env.applicability`;
  non-supporting items sanitised), demonstrations, contracts, a state summary and the recent turns;
* each tool result is appended to the transcript the next call sees; when the tool budget is spent the
  payload says ``must_submit`` and any further tool call counts as an invalid submission;
* a submission is checked with the validation gate (:func:`~trace2env.runtime.validation_gate`) on a state
  copy; a rejected one is fed back with the gate's errors; after ``max_invalid_submissions`` the agent gives
  up (``None``: the step becomes an error observation, the state unchanged).

A model reply that never validates (:class:`~trace2env.providers.ModelOutputError`) is the world model's
failure (``None``); infrastructure and configuration errors propagate to the caller.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from .applicability import applicability, names_in, operands, sanitise
from .engine import (
    MISSING,
    EngineError,
    apply_effects,
    eval_condition,
    get_path,
    normalise,
    render_template,
    resolve_effects,
)
from .models import ActionCall, Transition
from .providers import ModelOutputError, Provider
from .runtime import TransitionProposal, Workspace, validation_gate

__all__ = ["TOOLS", "AgentStats", "AgentTurn", "WorldModelAgent"]

#: the inspection tools offered to the model (name → what it does and its arguments)
TOOLS: dict[str, str] = {
    "list_actions": "{} -> the actions of the environment",
    "inspect_action": '{"name"} -> spec, contract, demonstrations of one action',
    "search_evidence": '{"query", "limit"?} -> recorded transitions matching words (labelled, sanitised when not supporting)',
    "read_evidence": '{"transition_id"} -> one recorded transition with its label',
    "read_state": '{"path"?, "offset"?} -> the episode state (or one path of it), paged',
    "state_schema": "{} -> the declared state variables",
    "recall": '{"text"} -> turns of this episode mentioning text',
    "recent_turns": '{"n"?} -> the last n turns of this episode',
    "apply_rule": '{"rule_id"} -> dry run of a rule on the current state: applicable, effects, rendered observation',
    "dry_run": '{"effects"} -> what the validation gate says about these effects (nothing is committed)',
    "submit": '{"effects", "observation", "outcome", "rule_ids"} -> the transition (ends the step)',
}


class AgentTurn(BaseModel):
    """One model call's answer: a tool to run, or ``submit``."""

    model_config = ConfigDict(extra="ignore")

    thought: str = ""
    tool: str
    arguments: dict[str, Any] = {}


@dataclass
class AgentStats:
    steps: int = 0
    model_calls: int = 0
    tool_calls: int = 0
    invalid_submissions: int = 0
    accepted: int = 0
    gave_up: int = 0
    format_failures: int = 0


def _clip(value: Any, limit: int) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[:limit] + f"...({len(text) - limit} more characters; page with offset)"


@dataclass
class WorldModelAgent:
    """The agentic world model (see the module docstring)."""

    provider: Provider
    max_tool_calls: int = 8
    max_model_calls: int = 20
    max_invalid_submissions: int = 2
    evidence_k: int = 5
    memory_turns: int = 8
    page_chars: int = 2000
    stats: AgentStats = field(default_factory=AgentStats)

    # -- the gate applied to one recorded transition ---------------------------------------------------
    def _label(self, ws: Workspace, t: Transition, action: ActionCall, history: list[ActionCall],
               names: frozenset[str]) -> dict[str, Any]:
        wb = ws.worldbook
        lab = applicability(t.action, t.observation, action, item_history=[x.action for x in wb.history_of(t)],
                            history=history, item_context=wb.context_of(t), context=ws.context, episode_names=names)
        obs = t.observation or ""
        args = t.action.arguments
        if lab.label != "supporting":
            obs = sanitise(obs)
            args = json.loads(sanitise(json.dumps(args, ensure_ascii=False)))
        return {"transition_id": t.id, "action": t.action.name, "arguments": args, "observation": obs,
                "applicability": {"label": lab.label, "reason": lab.reason}}

    def _names(self, ws: Workspace, history: list[ActionCall]) -> frozenset[str]:
        out: set[str] = set()
        for a in history:
            out |= operands(a.arguments)
        for turn in ws.memory.newest_first():
            out |= names_in(turn.observation)
        return frozenset(out)

    def brief(self, ws: Workspace, action: ActionCall) -> dict[str, Any]:
        """The first payload of a step."""
        wb = ws.worldbook
        history = ws.history()
        names = self._names(ws, history)
        spec = next((a for a in wb.actions if a.name == action.name), None)
        rules = []
        for r in wb.rules:
            if r.action_type == action.name:
                rules.append({"id": r.id, "description": r.description, "outcome": r.outcome,
                              "applies_now": all(eval_condition(c, action.arguments, ws.state) for c in r.conditions),
                              "effects": [e.model_dump(mode="json") for e in r.effects],
                              "observation_template": r.observation_template})
        exact = wb.exact_evidence(action.name, action.arguments)[: self.evidence_k]
        seen = {t.id for t in exact}
        query = " ".join([action.name, *[str(v) for v in operands(action.arguments)]])
        lexical = [h for h in wb.search_evidence(query, limit=self.evidence_k) if h["transition_id"] not in seen]
        evidence = [self._label(ws, t, action, history, names) for t in exact]
        for h in lexical:
            t = wb.transition(h["transition_id"])
            if t is not None:
                evidence.append(self._label(ws, t, action, history, names))
        labels = [e["applicability"]["label"] for e in evidence]
        return {
            "action": action.model_dump(mode="json"),
            "action_spec": spec.model_dump(mode="json", exclude={"provenance"}) if spec else None,
            "rules": rules,
            "invariants": [i.model_dump(mode="json", exclude={"provenance"}) for i in wb.invariants],
            "contracts": [c.model_dump(mode="json", exclude={"provenance"}) for c in wb.contracts
                          if action.name in c.action_types],
            "demonstrations": [{"action": d.action.model_dump(mode="json"), "observation": sanitise(d.observation),
                                "outcome": d.outcome} for d in wb.demonstrations if d.action.name == action.name][:4],
            "evidence": evidence,
            "package_applicability": {"supporting_items": labels.count("supporting"),
                                      "abstained": "supporting" not in labels,
                                      "guidance": "no evidence applies to this exact step: use the items for the "
                                                  "observation's shape only" if "supporting" not in labels else
                                                  "supporting items may be reused as they are"},
            "state": _clip(normalise(ws.state), self.page_chars),
            "recent_turns": [{"step": t.step, "action": t.action.model_dump(mode="json") if t.action else None,
                              "observation": t.observation, "accepted": t.accepted}
                             for t in ws.memory.recent(self.memory_turns)],
            "tools": TOOLS,
        }

    # -- tools -----------------------------------------------------------------------------------------
    def run_tool(self, ws: Workspace, action: ActionCall, tool: str, args: Mapping[str, Any]) -> Any:
        """Run one inspection tool; bad arguments give an ``{"error"}`` result (never an exception)."""
        wb = ws.worldbook
        try:
            if tool == "list_actions":
                return [{"name": a.name, "description": a.description} for a in wb.actions]
            if tool == "inspect_action":
                name = str(args.get("name", action.name))
                spec = next((a for a in wb.actions if a.name == name), None)
                if spec is None:
                    return {"error": f"unknown action {name!r}"}
                return {"spec": spec.model_dump(mode="json", exclude={"provenance"}),
                        "contracts": [c.model_dump(mode="json", exclude={"provenance"}) for c in wb.contracts
                                      if name in c.action_types],
                        "demonstrations": [{"arguments": d.action.arguments, "observation": sanitise(d.observation)}
                                           for d in wb.demonstrations if d.action.name == name]}
            if tool in ("search_evidence", "read_evidence"):
                history = ws.history()
                names = self._names(ws, history)
                if tool == "read_evidence":
                    t = wb.transition(str(args.get("transition_id", "")))
                    return self._label(ws, t, action, history, names) if t else {"error": "unknown transition_id"}
                limit = max(1, min(int(args.get("limit", self.evidence_k)), 10))
                hits = wb.search_evidence(str(args.get("query", "")), limit=limit)
                return [self._label(ws, t, action, history, names) for h in hits
                        if (t := wb.transition(h["transition_id"])) is not None]
            if tool == "read_state":
                path = str(args.get("path") or "")
                value = get_path(ws.state, path) if path else ws.state
                if value is MISSING:
                    return {"path": path, "value": None, "known": False}
                text = json.dumps(normalise(value), ensure_ascii=False)
                off = max(0, int(args.get("offset", 0)))
                return {"path": path, "known": True, "offset": off, "total_chars": len(text),
                        "text": text[off: off + self.page_chars]}
            if tool == "state_schema":
                return [f.model_dump(mode="json", exclude={"provenance"}) for f in wb.state_fields]
            if tool == "recall":
                return [{"step": t.step, "observation": t.observation} for t in ws.memory.recall(str(args.get("text", "")))]
            if tool == "recent_turns":
                n = max(1, min(int(args.get("n", self.memory_turns)), 50))
                return [{"step": t.step, "action": t.action.model_dump(mode="json") if t.action else None,
                         "observation": t.observation} for t in ws.memory.recent(n)]
            if tool == "apply_rule":
                r = next((x for x in wb.rules if x.id == args.get("rule_id")), None)
                if r is None:
                    return {"error": f"no executable rule {args.get('rule_id')!r}"}
                if r.action_type != action.name or not all(eval_condition(c, action.arguments, ws.state) for c in r.conditions):
                    return {"rule_id": r.id, "applicable": False}
                effs = resolve_effects(r.effects, action.arguments, ws.state)
                after = apply_effects(ws.state, effs)
                obs = (render_template(r.observation_template, arguments=action.arguments, before=ws.state, after=after,
                                       outcome=r.outcome) if r.observation_template else None)
                return {"rule_id": r.id, "applicable": True, "effects": [e.model_dump(mode="json") for e in r.effects],
                        "observation": obs, "outcome": r.outcome}
            if tool == "dry_run":
                prop = TransitionProposal.model_validate({"effects": args.get("effects", [])})
                d = validation_gate(wb, ws.state, action, prop)
                return {"accepted": d.accepted, "errors": list(d.errors), "warnings": list(d.warnings)}
        except (EngineError, ValidationError, ValueError, TypeError) as e:
            return {"error": f"{tool}: {e}"}
        return {"error": f"unknown tool {tool!r}; tools: {sorted(TOOLS)}"}

    # -- the loop --------------------------------------------------------------------------------------
    def propose(self, workspace: Workspace, action: ActionCall, *, seed: int | None) -> TransitionProposal | None:
        self.stats.steps += 1
        brief = self.brief(workspace, action)
        transcript: list[dict[str, Any]] = []
        tools_left, invalid = self.max_tool_calls, 0
        for _ in range(self.max_model_calls):
            payload = {**brief, "transcript": list(transcript), "tool_calls_left": tools_left, "must_submit": tools_left <= 0,
                       "seed": seed}
            self.stats.model_calls += 1
            try:
                turn = self.provider.complete("world_model_step", payload, AgentTurn)
            except ModelOutputError:
                self.stats.format_failures += 1
                return None
            if turn.tool == "submit":
                try:
                    prop = TransitionProposal.model_validate({**turn.arguments, "source": "agent"})
                except ValidationError as e:
                    errors = [f"submission is not a transition: {e.errors()[0].get('msg')}"]
                else:
                    d = validation_gate(workspace.worldbook, workspace.state, action, prop)
                    if d.accepted and prop.observation is not None:
                        self.stats.accepted += 1
                        return prop
                    errors = list(d.errors) or ["a submission needs an observation"]
                invalid += 1
                self.stats.invalid_submissions += 1
                transcript.append({"tool": "submit", "arguments": turn.arguments, "result": {"rejected": errors}})
                if invalid > self.max_invalid_submissions:
                    break
                continue
            if tools_left <= 0:
                invalid += 1
                self.stats.invalid_submissions += 1
                transcript.append({"tool": turn.tool, "result": {"error": "the tool budget is spent: submit now"}})
                if invalid > self.max_invalid_submissions:
                    break
                continue
            tools_left -= 1
            self.stats.tool_calls += 1
            result = self.run_tool(workspace, action, turn.tool, turn.arguments)
            transcript.append({"tool": turn.tool, "arguments": turn.arguments,
                               "result": _clip(result, self.page_chars) if not isinstance(result, (dict, list))
                               or len(json.dumps(result, default=str)) > self.page_chars else result})
        self.stats.gave_up += 1
        return None
