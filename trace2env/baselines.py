"""Next-observation predictors behind one interface: the simulator's modes and the paper's baselines.

Paper §5.1 compares Trace2Env with four alternatives (Appendix E has their prompts; the reference study,
``../shared/design/trace2env-reference.md`` §5, their settings):

* **Direct Prompting** (:class:`DirectPrompting`) — AgentWorldBench's layout: the recorded episode prefix
  (its messages, actions and observations) and the current action go to the model, which predicts the next
  observation. It is given nothing from the worldbook.
* **Trace RAG** (:class:`TraceRAG`) — Direct plus the top-``k`` (5) recorded construction transitions that
  the worldbook's SQLite FTS5 index ranks highest for the action's name and argument values, raw (not
  sanitised); transitions of the trace under evaluation are never retrieved.
* **Worldbook Prompting** (:class:`WorldbookPrompting`) — Direct plus a fixed dump of the worldbook
  (action and state schemas, executable rules, invariants, observation contracts, 4 demonstrations, 6
  evidence transitions) as static context: no runtime, no state, no inspection tools.
* **Harness only** (:class:`HarnessOnly`) — the Trace2Env runtime and world-model agent loop
  (:class:`trace2env.agent.WorldModelAgent`, same budget) over a worldbook stripped to its action
  interface: no rules, no evidence, no demonstrations, contracts or invariants, no declared state
  variables (so no persistent state can be committed).

and the simulator itself (:class:`SimulatorPredictor`: modes ``rules``, ``evidence``, ``agent``, see
:mod:`trace2env.evaluate`). Every predictor implements :class:`StepPredictor`: ``begin(worldbook, trace)``
once per held-out trajectory, then ``predict(step)`` for each of its steps in order, teacher-forced (the
step carries the recorded prefix; it never carries the recorded observation being predicted). Session-based
predictors advance their own session with the recorded actions; prompting baselines condition on the
recorded prefix, as AgentWorldBench does.

The prompting baselines call the provider with stage :data:`PREDICT_STAGE` and response model
:class:`ObservationPrediction`; the instructions are versioned (:data:`PREDICT_PROMPTS`) and travel in the
payload. A reply that never validates (:class:`ModelOutputError`) is the predictor's failure: the step is
answered with an error observation and ``accepted=False`` (scored 0 on ``exact``/``key_overlap``, like the
simulator's own error observations); infrastructure and configuration errors propagate.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, field_validator

from .applicability import operands
from .judge import render_history
from .models import ActionCall, Event, Trace, Transition
from .package import Worldbook
from .providers import ModelOutputError, Provider
from .runtime import Proposer, Session, error_observation

__all__ = [
    "PREDICT_PROMPTS",
    "PREDICT_STAGE",
    "SYSTEMS",
    "DirectPrompting",
    "HarnessOnly",
    "ObservationPrediction",
    "Prediction",
    "SimulatorPredictor",
    "StepInput",
    "StepPredictor",
    "TraceRAG",
    "WorldbookPrompting",
    "make_predictor",
    "step_input",
    "strip_knowledge",
    "worldbook_dump",
]

#: the provider stage of the prompting baselines
PREDICT_STAGE = "predict_observation"

DIRECT_V1 = """\
You simulate a software environment that an AI agent interacts with through tool calls (actions). You are \
given the episode so far (messages, the agent's actions and the environment's observations, oldest first) \
and the agent's next action. Predict the observation the environment returns for that action: exactly the \
text the real environment would return, in its format (JSON when its observations are JSON, with the same \
fields), including an error when the action fails. Stay consistent with everything the episode has \
established. Reply with one JSON object: {"observation": "<the observation text>"}."""

RAG_V1 = DIRECT_V1 + """
You are also given recorded transitions of this environment from other episodes (action, arguments and the \
observation returned), retrieved for their similarity to the action. Use them for the environment's formats \
and behaviour; their values belong to other episodes."""

WORLDBOOK_V1 = DIRECT_V1 + """
You are also given a worldbook of this environment, reconstructed from recorded traces: its actions, state \
variables, transition rules (conditions, effects, observation templates), invariants, observation contracts, \
demonstrations and recorded transitions. Use it to decide how the environment behaves; values in \
demonstrations and recorded transitions belong to other episodes."""

#: versioned instructions of the prompting baselines (never edit a released key in place)
PREDICT_PROMPTS: dict[str, str] = {"direct_v1": DIRECT_V1, "trace_rag_v1": RAG_V1, "worldbook_v1": WORLDBOOK_V1}

#: system names :func:`make_predictor` knows, in the order of the paper's tables
SYSTEMS: tuple[str, ...] = ("rules", "evidence", "agent", "direct", "trace_rag", "worldbook_prompt", "harness_only")


# ----------------------------------------------------------------------------------------------- interface


@dataclass(frozen=True)
class StepInput:
    """One teacher-forced step: the action and the recorded episode prefix before it (never its answer)."""

    trace_id: str
    index: int
    action: ActionCall
    #: the trace's events before the action's event, in order (messages, actions, observations)
    history: tuple[Event, ...] = ()


@dataclass(frozen=True)
class Prediction:
    observation: str
    #: the predictor produced an observation of its own (False: an error observation of the predictor)
    accepted: bool
    #: how it was produced (``rule``/``evidence``/``proposer``/``error`` for sessions, ``model`` for prompts)
    route: str


@runtime_checkable
class StepPredictor(Protocol):
    """Predicts next observations of one trajectory at a time (see the module docstring)."""

    name: str

    def begin(self, worldbook: Worldbook, trace: Trace) -> None: ...

    def predict(self, step: StepInput) -> Prediction: ...


class ObservationPrediction(BaseModel):
    """A prompting baseline's reply: the observation text (a JSON value is accepted and dumped once)."""

    model_config = ConfigDict(extra="ignore")

    observation: Any

    @field_validator("observation")
    @classmethod
    def _text(cls, v: Any) -> str:
        if v is None:
            raise ValueError("observation is missing")
        return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)


# ----------------------------------------------------------------------------------------------- simulator


@dataclass
class SimulatorPredictor:
    """The Trace2Env simulator: a fresh :class:`Session` per trajectory, started from the trace's recorded
    ``initial_state`` / ``initial_state_id``; ``mode`` ``rules`` (fast path only), ``evidence`` (plus
    supporting recorded observations) or ``agent`` (plus the proposer)."""

    mode: str = "evidence"
    proposer: Proposer | None = None
    min_rule_confidence: float = 0.9
    name: str = ""

    def __post_init__(self) -> None:
        if self.mode not in ("rules", "evidence", "agent"):
            raise ValueError(f"mode must be rules, evidence or agent, got {self.mode!r}")
        if self.mode == "agent" and self.proposer is None:
            raise ValueError("mode 'agent' needs a proposer (the world-model agent)")
        self.name = self.name or self.mode
        self._session: Session | None = None

    def _start(self, worldbook: Worldbook, trace: Trace) -> Session:
        return Session.start(worldbook, trace.metadata.get("initial_state"), context=trace.metadata.get("initial_state_id"),
                             proposer=self.proposer if self.mode == "agent" else None, use_evidence=self.mode != "rules",
                             min_rule_confidence=self.min_rule_confidence)

    def begin(self, worldbook: Worldbook, trace: Trace) -> None:
        self._session = self._start(worldbook, trace)

    def predict(self, step: StepInput) -> Prediction:
        if self._session is None:
            raise RuntimeError("begin() first")
        r = self._session.step({"name": step.action.name, "arguments": step.action.arguments})
        return Prediction(r.observation, r.accepted, r.route)


def strip_knowledge(worldbook: Worldbook) -> Worldbook:
    """The worldbook reduced to its action interface (for :class:`HarnessOnly`): no rules, candidates,
    invariants, contracts, demonstrations, evidence or state variables, and an empty lexical index."""
    kw = {f.name: getattr(worldbook, f.name) for f in dataclasses.fields(worldbook)}
    kw.update(rules=(), candidate_rules=(), invariants=(), contracts=(), demonstrations=(), transitions=(),
              state_fields=(), sources=(),
              actions=tuple(a.model_copy(update={"provenance": ()}) for a in worldbook.actions))
    return _ActionsOnly(**kw)


@dataclass(frozen=True)
class _ActionsOnly(Worldbook):
    def search_evidence(self, query: str, *, limit: int = 5) -> list[dict[str, Any]]:
        return []


@dataclass
class HarnessOnly:
    """The runtime and the world-model agent loop without the worldbook's knowledge or persistent state."""

    provider: Provider
    #: builds the proposer (default: :class:`trace2env.agent.WorldModelAgent` with its default budget)
    agent_factory: Callable[[Provider], Proposer] | None = None
    name: str = "harness_only"

    def __post_init__(self) -> None:
        from .agent import WorldModelAgent

        self.agent = (self.agent_factory or WorldModelAgent)(self.provider)
        self._cache: tuple[int, Worldbook] | None = None
        self._session: Session | None = None

    def begin(self, worldbook: Worldbook, trace: Trace) -> None:
        if self._cache is None or self._cache[0] != id(worldbook):
            self._cache = (id(worldbook), strip_knowledge(worldbook))
        # no recorded initial state: without declared state variables there is nothing to hold it
        self._session = Session.start(self._cache[1], None, proposer=self.agent, use_evidence=False)

    def predict(self, step: StepInput) -> Prediction:
        if self._session is None:
            raise RuntimeError("begin() first")
        r = self._session.step({"name": step.action.name, "arguments": step.action.arguments})
        return Prediction(r.observation, r.accepted, r.route)


# ----------------------------------------------------------------------------------------------- prompting


def _dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json", exclude={"provenance", "counterexamples"})


def worldbook_dump(worldbook: Worldbook, *, n_demonstrations: int = 4, n_evidence: int = 6) -> dict[str, Any]:
    """The fixed worldbook context of :class:`WorldbookPrompting` (the same for every step)."""
    evidence = [t for t in worldbook.transitions if t.observation is not None and t.alignment != "ambiguous"]
    return {
        "environment_id": worldbook.manifest.environment_id,
        "description": worldbook.manifest.description,
        "actions": [_dump(a) for a in worldbook.actions],
        "state_variables": [_dump(f) for f in worldbook.state_fields],
        "rules": [_dump(r) for r in worldbook.rules],
        "invariants": [_dump(i) for i in worldbook.invariants],
        "observation_contracts": [_dump(c) for c in worldbook.contracts],
        "demonstrations": [{"action": d.action.model_dump(mode="json", exclude={"call_id"}), "observation": d.observation,
                            "outcome": d.outcome} for d in worldbook.demonstrations[:n_demonstrations]],
        "recorded_transitions": [{"action": t.action.name, "arguments": t.action.arguments, "observation": t.observation}
                                 for t in evidence[:n_evidence]],
    }


@dataclass
class _Prompting:
    """Shared machinery of the prompting baselines: payload, provider call, failure handling."""

    provider: Provider
    prompt_version: str = "direct_v1"
    #: shared environment description (the benchmark's system prompt), sent to every system when given
    environment: str = ""
    max_history_events: int = 40
    max_event_chars: int = 1500
    name: str = "direct"

    def __post_init__(self) -> None:
        if self.prompt_version not in PREDICT_PROMPTS:
            raise ValueError(f"unknown prompt version {self.prompt_version!r}; known: {sorted(PREDICT_PROMPTS)}")
        self.failures = 0
        self._worldbook: Worldbook | None = None
        self._trace: Trace | None = None

    def begin(self, worldbook: Worldbook, trace: Trace) -> None:
        self._worldbook, self._trace = worldbook, trace

    def extra(self, step: StepInput) -> dict[str, Any]:
        return {}

    def payload(self, step: StepInput) -> dict[str, Any]:
        """What the model is sent for one step (exposed for tests and inspection)."""
        return {
            "instructions": PREDICT_PROMPTS[self.prompt_version],
            "prompt_version": self.prompt_version,
            "environment": self.environment,
            "history": render_history(step.history, max_events=self.max_history_events, max_chars=self.max_event_chars),
            **self.extra(step),
            "action": step.action.model_dump(mode="json", exclude={"call_id"}),
        }

    def predict(self, step: StepInput) -> Prediction:
        if self._worldbook is None:
            raise RuntimeError("begin() first")
        try:
            out = self.provider.complete(PREDICT_STAGE, self.payload(step), ObservationPrediction)
        except ModelOutputError as e:
            self.failures += 1
            return Prediction(error_observation(f"the model produced no valid observation: {str(e)[:200]}",
                                                "no_prediction"), False, "error")
        return Prediction(out.observation, True, "model")


@dataclass
class DirectPrompting(_Prompting):
    """Direct Prompting: recorded prefix + action only; nothing from the worldbook."""


@dataclass
class TraceRAG(_Prompting):
    """Trace RAG: Direct plus the top-``k`` lexical (FTS5) recorded transitions for the action."""

    prompt_version: str = "trace_rag_v1"
    k: int = 5
    name: str = "trace_rag"

    def __post_init__(self) -> None:
        super().__post_init__()
        self._index: tuple[Worldbook, dict[str, str]] | None = None

    def retrieve(self, step: StepInput) -> list[dict[str, Any]]:
        assert self._worldbook is not None and self._trace is not None
        wb, own = self._worldbook, self._trace.trace_id
        if self._index is None or self._index[0] is not wb:
            self._index = (wb, {t.id: t.trace_id for t in wb.transitions})
        words = " ".join([step.action.name, *sorted(str(v) for v in operands(step.action.arguments))])
        out = []
        # over-fetch: hits from the trace under evaluation (a leak when it was also a construction trace) are dropped
        for h in wb.search_evidence(words, limit=self.k * 3 + 5):
            if self._index[1].get(h["transition_id"], own) == own:
                continue
            out.append({"transition_id": h["transition_id"], "action": h["action"], "arguments": h["arguments"],
                        "observation": h["observation"]})
            if len(out) >= self.k:
                break
        return out

    def extra(self, step: StepInput) -> dict[str, Any]:
        return {"retrieved_transitions": self.retrieve(step)}


@dataclass
class WorldbookPrompting(_Prompting):
    """Worldbook Prompting: Direct plus a fixed dump of the worldbook as static context."""

    prompt_version: str = "worldbook_v1"
    n_demonstrations: int = 4
    n_evidence: int = 6
    name: str = "worldbook_prompt"

    def begin(self, worldbook: Worldbook, trace: Trace) -> None:
        if self._worldbook is not worldbook:
            self._dump = worldbook_dump(worldbook, n_demonstrations=self.n_demonstrations, n_evidence=self.n_evidence)
        super().begin(worldbook, trace)

    def extra(self, step: StepInput) -> dict[str, Any]:
        return {"worldbook": self._dump}


def make_predictor(system: str, *, provider: Provider | None = None, proposer: Proposer | None = None,
                   min_rule_confidence: float = 0.9, environment: str = "") -> StepPredictor:
    """The predictor of a system name (:data:`SYSTEMS`). ``agent`` uses ``proposer`` or, given a provider,
    a default :class:`~trace2env.agent.WorldModelAgent`; the prompting baselines and ``harness_only`` need
    a provider."""
    if system in ("rules", "evidence"):
        return SimulatorPredictor(system, min_rule_confidence=min_rule_confidence)
    if system == "agent":
        if proposer is None and provider is not None:
            from .agent import WorldModelAgent

            proposer = WorldModelAgent(provider)
        if proposer is None:
            raise ValueError("system 'agent' needs a proposer or a provider (the world-model agent's model)")
        return SimulatorPredictor("agent", proposer, min_rule_confidence)
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; known: {', '.join(SYSTEMS)}")
    if provider is None:
        raise ValueError(f"system {system!r} needs a model provider (--base-url/--model)")
    if system == "direct":
        return DirectPrompting(provider, environment=environment)
    if system == "trace_rag":
        return TraceRAG(provider, environment=environment)
    if system == "worldbook_prompt":
        return WorldbookPrompting(provider, environment=environment)
    return HarnessOnly(provider)


def step_input(trace: Trace, t: Transition, positions: Mapping[str, int] | None = None) -> StepInput:
    """The teacher-forced input of transition ``t`` of ``trace``: its action and the events before it."""
    pos = positions if positions is not None else {e.id: i for i, e in enumerate(trace.events)}
    if t.action_event_id not in pos:
        raise ValueError(f"event {t.action_event_id!r} is not in trace {trace.trace_id}")
    return StepInput(trace.trace_id, t.index, t.action, tuple(trace.events[: pos[t.action_event_id]]))
