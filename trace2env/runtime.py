"""Runtime harness: workspace, validation gate, forkable in-memory sessions, and the gym-style environment.

Paper §4.2: the episode workspace ``W_t = (K_E, ŝ_t, M_t)`` separates the immutable worldbook from the
episode's represented state and its episodic memory. Paper §4.3 / Appendix C.3: a transition *proposal*
``q_t = (Δ_t, õ_{t+1})`` is checked by the validation gate ``G_val`` "on a state copy against the schemas,
rule support, and applicable state constraints", and only accepted proposals are committed.

What this module adds over the public reference (see ``../shared/design/trace2env-reference.md`` §3):

* sessions live in memory; state is persistent (path copying, :mod:`trace2env.engine`) and memory is a
  cons list, so :meth:`Session.fork` is O(1) and a commit never rewrites the whole state or history;
* invalid actions, unknown actions, ambiguous rules and rejected proposals come back as JSON error
  observations (``{"error": ...}``) with the state unchanged — ``step`` never raises for the agent's input;
* the gate (:func:`validation_gate`) is a pure function; effects are compared after normalisation;
* :class:`WorldbookEnv` gives ``reset(task, seed)`` / ``step(action) -> (observation, done, info)``;
  reward comes only from a pluggable :class:`Verifier` (never from the world model's own claim).

Routing per step (:meth:`Session.step`):

1. ``rule`` — the fast path: a single applicable executable rule, no model;
2. ``evidence`` — a recorded transition the applicability gate labels ``supporting``
   (:mod:`trace2env.applicability`: same action, same initial state, same history on its operands) and
   whose supporting records all agree: its observation is replayed verbatim, no model, no effects;
3. ``proposer`` — the optional :class:`Proposer` (the world-model agent, :mod:`trace2env.agent`);
4. otherwise an error observation (``no_applicable_rule``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from .applicability import applicability, names_in, operands
from .engine import (
    MISSING,
    EngineError,
    ResolvedEffect,
    apply_effects,
    check_action,
    check_invariants,
    eval_condition,
    get_path,
    normalise,
    render_template,
    resolve_effects,
    select_rule,
    validate_effects,
)
from .induce import initial_state_for, outcome_of
from .models import ActionCall, Condition, Effect, Frozen, Transition
from .package import Worldbook

__all__ = [
    "GateDecision",
    "Memory",
    "Proposer",
    "Session",
    "StatePredicateVerifier",
    "StepResult",
    "TransitionProposal",
    "Turn",
    "Verdict",
    "Verifier",
    "Workspace",
    "WorldbookEnv",
    "error_observation",
    "validation_gate",
]


def error_observation(message: str, kind: str = "invalid_action") -> str:
    return json.dumps({"error": message, "type": kind}, ensure_ascii=False)


# ----------------------------------------------------------------------------------------------- memory


@dataclass(frozen=True)
class Turn:
    step: int
    action: ActionCall | None
    observation: str
    route: str
    rule_id: str | None = None
    accepted: bool = True


@dataclass(frozen=True)
class Memory:
    """Episodic memory ``M_t``: an immutable cons list (append and fork are O(1))."""

    head: Turn | None = None
    tail: Memory | None = None
    size: int = 0

    def add(self, turn: Turn) -> Memory:
        return Memory(turn, self, self.size + 1)

    def __len__(self) -> int:
        return self.size

    def newest_first(self) -> Iterator[Turn]:
        node: Memory | None = self
        while node is not None and node.head is not None:
            yield node.head
            node = node.tail

    def recent(self, n: int) -> list[Turn]:
        out = []
        for t in self.newest_first():
            if len(out) >= n:
                break
            out.append(t)
        return out[::-1]

    def recall(self, text: str, *, limit: int = 5) -> list[Turn]:
        """Turns whose observation or action contains ``text`` (case-insensitive), newest first."""
        q = text.lower()
        out = []
        for t in self.newest_first():
            hay = t.observation.lower() + (json.dumps(t.action.model_dump()).lower() if t.action else "")
            if q in hay:
                out.append(t)
                if len(out) >= limit:
                    break
        return out


@dataclass(frozen=True)
class Workspace:
    """``W_t = (K_E, ŝ_t, M_t)``: what a proposer may inspect. ``state`` must be treated as read-only."""

    worldbook: Worldbook
    state: Mapping[str, Any]
    memory: Memory
    step: int
    #: the session's ``initial_state_id`` (for the applicability gate; None: unknown)
    context: str | None = None

    def history(self) -> list[ActionCall]:
        return [t.action for t in reversed(list(self.memory.newest_first())) if t.action is not None]


# ----------------------------------------------------------------------------------------------- the gate


class TransitionProposal(Frozen):
    """``q_t``: ordered effects on declared state variables, an observation, the rules it cites."""

    effects: tuple[Effect, ...] = ()
    observation: str | None = None
    outcome: Literal["success", "failure", "partial", "unknown"] = "unknown"
    rule_ids: tuple[str, ...] = ()
    source: str = "agent"


@dataclass(frozen=True)
class GateDecision:
    accepted: bool
    errors: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    state_after: Any = None
    effects: tuple[ResolvedEffect, ...] = ()


def validation_gate(worldbook: Worldbook, state: Any, action: ActionCall, proposal: TransitionProposal) -> GateDecision:
    """``G_val``: resolve the effects, check them against the state schema, apply them to a copy, reject
    any invariant violation the step introduces, and check cited rules (executable, applicable, same
    normalised effects and outcome). Pure: ``state`` is never modified."""
    args = action.arguments
    try:
        effects = tuple(resolve_effects(proposal.effects, args, state))
    except EngineError as e:
        return GateDecision(False, (f"effect does not resolve: {e}",))
    errors = validate_effects(effects, worldbook.state_fields)
    if errors:
        return GateDecision(False, tuple(errors))
    try:
        after = apply_effects(state, effects)
    except EngineError as e:
        return GateDecision(False, (f"effect does not apply: {e}",))
    before_bad = set(check_invariants(worldbook.invariants, state))
    new_bad = [i for i in check_invariants(worldbook.invariants, after) if i not in before_bad]
    if new_bad:
        return GateDecision(False, tuple(f"invariant violated: {i}" for i in new_bad))
    executable = {r.id: r for r in worldbook.rules}
    for rid in proposal.rule_ids:
        r = executable.get(rid)
        if r is None:
            return GateDecision(False, (f"cited rule {rid} is not executable",))
        if r.action_type != action.name or not all(eval_condition(c, args, state) for c in r.conditions):
            return GateDecision(False, (f"cited rule {rid} does not apply here",))
        try:
            want = [e.key() for e in resolve_effects(r.effects, args, state)]
        except EngineError as e:
            return GateDecision(False, (f"cited rule {rid}: {e}",))
        if want != [e.key() for e in effects] or r.outcome != proposal.outcome:
            return GateDecision(False, (f"effects or outcome differ from cited rule {rid}",))
    warnings = []
    if proposal.observation is not None:
        for c in worldbook.contracts:
            if action.name in c.action_types and c.content_type == "json":
                try:
                    obj = json.loads(proposal.observation)
                except json.JSONDecodeError:
                    warnings.append(f"{c.id}: observation is not JSON")
                    continue
                if isinstance(obj, dict) and "error" not in obj:
                    warnings += [f"{c.id}: missing field {k!r}" for k in c.required_fields if k not in obj]
    return GateDecision(True, (), tuple(warnings), after, effects)


@runtime_checkable
class Proposer(Protocol):
    """Proposes a transition when no rule covers the step (:class:`trace2env.agent.WorldModelAgent`)."""

    def propose(self, workspace: Workspace, action: ActionCall, *, seed: int | None) -> TransitionProposal | None: ...


# ----------------------------------------------------------------------------------------------- sessions


@dataclass(frozen=True)
class StepResult:
    observation: str
    accepted: bool
    route: Literal["rule", "evidence", "proposer", "error"]
    rule_id: str | None = None
    errors: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    outcome: str = "unknown"


def _parse_action(action: Any) -> ActionCall:
    if isinstance(action, ActionCall):
        return action
    if isinstance(action, str):
        try:
            action = json.loads(action)
        except json.JSONDecodeError as e:
            raise ValueError(f"action is not JSON: {e.msg}") from None
    if not isinstance(action, Mapping):
        raise ValueError("action must be an object with 'name' and 'arguments'")  # noqa: TRY004 - a malformed action
    fn = action.get("function", action)
    name, args = fn.get("name"), fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"arguments are not JSON: {e.msg}") from None
    if not isinstance(name, str) or not name:
        raise ValueError("action has no name")
    if not isinstance(args, Mapping):
        raise ValueError("arguments must be an object")  # noqa: TRY004 - a malformed action, as above
    return ActionCall(name=name, arguments=dict(args))


@dataclass
class Session:
    """One episode: the worldbook (shared), the committed state and memory (persistent values).

    ``fork()`` shares everything (O(1)); the copies diverge on their next commit without affecting each
    other. ``min_rule_confidence`` gates the fast path."""

    worldbook: Worldbook
    state: Any
    memory: Memory = field(default_factory=Memory)
    step_count: int = 0
    revision: int = 0
    proposer: Proposer | None = None
    seed: int | None = None
    min_rule_confidence: float = 0.9
    #: identity of the episode's initial state (compared with traces' ``initial_state_id``; None: unknown)
    context: str | None = None
    #: replay recorded observations the applicability gate labels supporting (the ``evidence`` route)
    use_evidence: bool = True

    @classmethod
    def start(cls, worldbook: Worldbook, initial_state: Mapping[str, Any] | None = None, **kw: Any) -> Session:
        return cls(worldbook, initial_state_for(worldbook.state_fields, initial_state), **kw)

    @property
    def workspace(self) -> Workspace:
        return Workspace(self.worldbook, self.state, self.memory, self.step_count, self.context)

    def fork(self) -> Session:
        return Session(self.worldbook, self.state, self.memory, self.step_count, self.revision, self.proposer,
                       self.seed, self.min_rule_confidence, self.context, self.use_evidence)

    def history(self) -> list[ActionCall]:
        """The actions of this episode so far, oldest first (every parsed action, accepted or not)."""
        return [t.action for t in reversed(list(self.memory.newest_first())) if t.action is not None]

    def supporting_evidence(self, call: ActionCall) -> list[Transition]:
        """Recorded transitions the applicability gate labels ``supporting`` for ``call`` now."""
        wb = self.worldbook
        exact = [t for t in wb.exact_evidence(call.name, call.arguments)
                 if t.observation is not None and t.alignment != "ambiguous"]
        if not exact:
            return []
        history = self.history()
        names = frozenset().union(*(operands(a.arguments) for a in history), *(
            names_in(t.observation) for t in self.memory.newest_first())) if history else frozenset()
        out = []
        for t in exact:
            lab = applicability(t.action, t.observation, call, item_history=[x.action for x in wb.history_of(t)],
                                history=history, item_context=wb.context_of(t), context=self.context,
                                episode_names=names)
            if lab.label == "supporting":
                out.append(t)
        return out

    def get(self, path: str) -> Any:
        """A deep copy of the value at ``path`` (``None`` when unknown)."""
        import copy

        v = get_path(self.state, path)
        return None if v is MISSING else copy.deepcopy(v)

    def _finish(self, action: ActionCall | None, result: StepResult, state_after: Any = None) -> StepResult:
        self.step_count += 1
        if result.accepted:
            self.state = state_after  # the commit: one reference swap
            self.revision += 1
        self.memory = self.memory.add(Turn(self.step_count, action, result.observation, result.route,
                                           result.rule_id, result.accepted))
        return result

    def _error(self, action: ActionCall | None, message: str, kind: str, errors: Sequence[str] = (),
               route: Literal["rule", "evidence", "proposer", "error"] = "error") -> StepResult:
        return self._finish(action, StepResult(error_observation(message, kind), False, route,
                                               errors=tuple(errors) or (message,), outcome="failure"))

    def step(self, action: Any) -> StepResult:
        """Simulate one action. Never raises for bad input: errors are observations, state unchanged."""
        try:
            call = _parse_action(action)
        except ValueError as e:
            return self._error(None, str(e), "invalid_action")
        spec, errs = check_action(self.worldbook.actions, call.name, call.arguments)
        if spec is None or errs:
            return self._error(call, "; ".join(errs), "invalid_action" if spec else "unknown_action", errs)
        call = ActionCall(name=spec.name, arguments=call.arguments, call_id=call.call_id)
        sel = select_rule(self.worldbook.rules, call.name, call.arguments, self.state,
                          min_confidence=self.min_rule_confidence)
        proposal: TransitionProposal | None = None
        route: Literal["rule", "evidence", "proposer", "error"] = "rule"
        support = ([] if sel.rule is not None and sel.rule.observation_template is not None or not self.use_evidence
                   else self.supporting_evidence(call))
        if sel.rule is not None and sel.rule.observation_template is not None:
            r = sel.rule
            proposal = TransitionProposal(effects=r.effects, outcome=r.outcome, rule_ids=(r.id,), source="rule")
        elif support and len({t.observation for t in support}) == 1:
            route = "evidence"
            proposal = TransitionProposal(observation=support[0].observation, outcome=outcome_of(support[0]),  # type: ignore[arg-type]
                                          source="evidence")
        elif self.proposer is not None:
            route = "proposer"
            proposal = self.proposer.propose(self.workspace, call, seed=self.seed)
            if proposal is None:
                return self._error(call, "the world model proposed nothing", "no_transition", route="proposer")
        elif sel.ambiguous:
            return self._error(call, f"ambiguous rules: {sel.reason}", "ambiguous_rule")
        else:
            return self._error(call, f"no applicable rule for {call.name}", "no_applicable_rule")
        decision = validation_gate(self.worldbook, self.state, call, proposal)
        if not decision.accepted:
            return self._error(call, "transition rejected: " + "; ".join(decision.errors), "rejected", decision.errors, route)
        if route == "rule":
            try:
                obs = render_template(sel.rule.observation_template or "", arguments=call.arguments,  # type: ignore[union-attr]
                                      before=self.state, after=decision.state_after, outcome=proposal.outcome)
            except EngineError as e:
                return self._error(call, f"cannot render observation: {e}", "render_error", route="rule")
        else:
            obs = proposal.observation if proposal.observation is not None else json.dumps(
                normalise(decision.state_after), ensure_ascii=False)
        rule_id = proposal.rule_ids[0] if proposal.rule_ids else (support[0].id if route == "evidence" else None)
        return self._finish(call, StepResult(obs, True, route, rule_id,
                                             warnings=decision.warnings, outcome=proposal.outcome), decision.state_after)


# ----------------------------------------------------------------------------------------------- gym API


@dataclass(frozen=True)
class Verdict:
    reward: float
    done: bool
    source: str


class Verifier(Protocol):
    """Grounded reward: a state predicate, a replay in the real environment, or an LLM judge (labelled)."""

    def verify(self, state: Any, memory: Memory) -> Verdict | None: ...


@dataclass(frozen=True)
class StatePredicateVerifier:
    """Reward 1 and done when every condition holds on the committed state; else no verdict."""

    conditions: tuple[Condition, ...]

    def verify(self, state: Any, memory: Memory) -> Verdict | None:
        if all(eval_condition(c, {}, state) for c in self.conditions):
            return Verdict(1.0, True, "state_predicate")
        return None


class WorldbookEnv:
    """Gym-style simulator over a worldbook: ``reset(task, seed)`` and ``step(action)``.

    ``task`` may carry ``initial_state`` (a partial state), ``initial_state_id`` (the identity the
    applicability gate compares with the traces'), ``instruction`` (returned as the first observation), ``max_steps`` and ``conditions`` (a goal as :class:`Condition` dicts, checked by a
    :class:`StatePredicateVerifier` unless a verifier is passed)."""

    def __init__(self, worldbook: Worldbook, *, proposer: Proposer | None = None, verifier: Verifier | None = None,
                 max_steps: int = 50, min_rule_confidence: float = 0.9, use_evidence: bool = True):
        self.worldbook = worldbook
        self.use_evidence = use_evidence
        self.proposer = proposer
        self.verifier = verifier
        self.max_steps = max_steps
        self.min_rule_confidence = min_rule_confidence
        self.session: Session | None = None
        self._verifier: Verifier | None = None
        self._max_steps = max_steps

    def reset(self, task: Mapping[str, Any] | None = None, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        task = dict(task or {})
        self.session = Session.start(self.worldbook, task.get("initial_state"), proposer=self.proposer, seed=seed,
                                     min_rule_confidence=self.min_rule_confidence,
                                     context=task.get("initial_state_id"), use_evidence=self.use_evidence)
        self._max_steps = int(task.get("max_steps", self.max_steps))
        conds = tuple(Condition.model_validate(c) for c in task.get("conditions", ()))
        self._verifier = self.verifier or (StatePredicateVerifier(conds) if conds else None)
        return str(task.get("instruction", "")), {"seed": seed, "environment_id": self.worldbook.manifest.environment_id}

    def fork(self) -> WorldbookEnv:
        """A copy sharing the worldbook and the current session state (O(1)), for group rollouts."""
        if self.session is None:
            raise RuntimeError("reset() first")
        env = WorldbookEnv(self.worldbook, proposer=self.proposer, verifier=self.verifier, max_steps=self.max_steps,
                           min_rule_confidence=self.min_rule_confidence, use_evidence=self.use_evidence)
        env.session, env._verifier, env._max_steps = self.session.fork(), self._verifier, self._max_steps
        return env

    def step(self, action: Any) -> tuple[str, bool, dict[str, Any]]:
        if self.session is None:
            raise RuntimeError("reset() first")
        res = self.session.step(action)
        info: dict[str, Any] = {"route": res.route, "accepted": res.accepted, "rule_id": res.rule_id,
                                "errors": list(res.errors), "warnings": list(res.warnings), "outcome": res.outcome,
                                "step": self.session.step_count}
        done = self.session.step_count >= self._max_steps
        if self._verifier is not None:
            verdict = self._verifier.verify(self.session.state, self.session.memory)
            if verdict is not None:
                info["reward"], info["reward_source"] = verdict.reward, verdict.source
                done = done or verdict.done
        info["truncated"] = done and "reward" not in info
        return res.observation, done, info
