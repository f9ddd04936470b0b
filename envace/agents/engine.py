"""The turn engine: the one multi-turn loop behind training, evaluation and rehearsal.

Everything that runs a tool-use conversation goes through :class:`TurnEngine`: verl's agent loops
(``envace/agents/verl_loop.py``, token in / token out), the evaluation runner (``envace/eval/runner.py``,
an OpenAI-compatible chat endpoint) and EnvACE's act–rehearse loop. The engine imports neither verl
nor any HTTP client; it talks to two strategies:

* a :class:`Policy` — ``await policy.respond(messages, tools, role)`` returns one :class:`Reply`
  (the verl adapter generates tokens, the OpenAI adapter calls chat completions). ``role`` is
  :attr:`Role.ACT` for the agent's messages and :attr:`Role.REHEARSE` when the policy writes a tool
  response (EnvACE §4.1);
* an :class:`ObservationSource` — who answers a tool call (``envace/agents/sources.py``): the real
  environment (``real``), the policy itself (``rehearse``), or an external LLM simulator (``simulator``).

The user side of the conversation (next user message, the tool list, whether the episode is over) is
always the task's :class:`~envace.envs.base.Episode`. One rollout::

    messages = episode.initial_messages()
    per user turn (≤ limits.max_user_turns):
        per step (≤ limits.max_steps_per_turn):
            reply = policy.respond(messages, tools, ACT)          # one assistant message
            malformed calls   → an error observation each (on_malformed_call: feedback | end)
            calls over the cap → an error observation each (limits.max_calls_per_message)
            each call          → source.observe(call) → ``role: tool`` message (truncated); a call
                                 past the tool bounds (limits.tool_timeout_s / tool_memory_mb) is
                                 stopped before it runs and answered with an error (``bound_hits``)
            no call at all     → the user turn ends
        episode.end_turn(final text) → next user message, or None (completed)
    → :class:`Transcript` (messages, per-step records, executed actions, counters, stop reason)

Why a rollout stopped is a :class:`~envace.agents.outcomes.StopReason` and what answered each call an
:class:`~envace.agents.outcomes.ObservationKind` (both in ``envace/agents/outcomes.py``, re-exported here). An
observation that ends the rollout (``terminate``) stops it under its own kind (``timeout``, ``env_unavailable``,
``malformed_rehearsal`` ...). Infrastructure failures of the policy's endpoint are not stop reasons: they raise, so
the caller can retry the rollout instead of scoring it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from envace.agents.outcomes import ObservationKind, StopReason
from envace.envs.base import END_TURN, Episode, ToolCall
from envace.loop_config import LoopLimits
from envace.roles import Role  # the one Role enum (envace/roles.py), re-exported here

__all__ = [
    "CallContext",
    "LoopLimits",
    "ModelError",
    "Observation",
    "ObservationKind",
    "ObservationSource",
    "Policy",
    "Reply",
    "Role",
    "StepRecord",
    "StopReason",
    "Transcript",
    "TurnEngine",
    "assistant_message",
    "malformed_call_observation",
    "truncate_middle",
]


class ModelError(RuntimeError):
    """The endpoint refused a request because of what the model produced (e.g. the context grew past
    the model's window). Scored as the model's failure (stop reason ``model_error``), never retried."""


@dataclass
class Reply:
    """One policy message, already split by the project's tool-call parser."""

    text: str  # the raw generated text (special tokens removed)
    content: str = ""  # visible text: no reasoning, no tool-call blocks
    calls: list[ToolCall] = field(default_factory=list)  # well-formed tool calls, in order
    errors: list[str] = field(default_factory=list)  # one parser message per malformed call block
    reasoning: str | None = None
    finish_reason: str | None = None  # "stop" | "length" | ...
    # the policy cannot generate any more in this rollout (token budget spent); when ``generated`` is
    # False nothing was produced by this call and the reply is not part of the conversation
    budget_exhausted: bool = False
    generated: bool = True
    prompt_tokens: int = 0
    completion_tokens: int = 0


class Policy(Protocol):
    async def respond(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, role: Role) -> Reply:
        """One message from the policy in ``role`` given the chat so far. Raises :class:`ModelError`
        for a model-caused request failure; any other exception is an infrastructure failure."""
        ...


@dataclass
class Observation:
    """What a source answered for one tool call."""

    text: str  # the tool message content the agent sees
    kind: ObservationKind = ObservationKind.RESULT
    real_text: str | None = None  # the real environment's response to the same call (fidelity), if known
    terminate: bool = False  # end the episode after this observation (malformed rehearsal with on_malformed=end)
    masked: bool = False  # the rollout cannot be scored (e.g. an environment time-out): never reward it
    # False: the call never ran in the environment (it exceeded a tool bound); it stays out of the
    # replayable actions, so no replay or verifier runs it again
    executed: bool = True
    meta: dict[str, Any] = field(default_factory=dict)  # source-specific (e.g. rehearsal fidelity scores)


@dataclass
class CallContext:
    """What a source may look at when answering ``call``."""

    messages: list[dict[str, Any]]  # the conversation before the current assistant message
    tools: list[dict[str, Any]]
    reply: Reply  # the assistant message that issued the call
    call_index: int  # position of the call within that message
    episode: Episode
    limits: LoopLimits = field(default_factory=LoopLimits)  # the rollout's limits (tool bounds)


class ObservationSource(Protocol):
    name: str

    async def observe(self, call: ToolCall, ctx: CallContext) -> Observation: ...


@dataclass
class StepRecord:
    """One assistant message and what answered its calls."""

    turn: int  # 1-based user turn
    reply: Reply
    observations: list[Observation] = field(default_factory=list)  # one per tool message that followed


@dataclass
class Transcript:
    """The outcome of one rollout (no reward: scoring is the caller's)."""

    messages: list[dict[str, Any]]
    steps: list[StepRecord] = field(default_factory=list)
    # executed calls with their observations, END_TURN markers between user turns (replayable)
    actions: list[dict[str, Any]] = field(default_factory=list)
    stop_reason: StopReason = StopReason.COMPLETED
    error: str | None = None  # the model_error text
    user_turns: int = 0
    tool_calls: int = 0  # calls answered by the source
    malformed_calls: int = 0
    skipped_calls: int = 0  # calls over max_calls_per_message
    malformed_rehearsals: int = 0
    env_errors: int = 0  # the environment raised while executing a call
    bound_hits: int = 0  # calls stopped at a tool bound (time or memory)
    env_unavailable: int = 0  # calls the environment could not answer (server down, connection lost): masked
    env_faults: int = 0  # calls the environment answered against its protocol (the server's fault): masked
    masked: bool = False  # some part of the rollout could not be judged (time-out ...): do not score it
    mask_reason: str = ""
    final_text: str = ""

    def counters(self) -> dict[str, float]:
        return {
            "user_turns": float(self.user_turns),
            "assistant_messages": float(len(self.steps)),
            "tool_calls": float(self.tool_calls),
            "malformed_calls": float(self.malformed_calls),
            "skipped_calls": float(self.skipped_calls),
            "malformed_rehearsals": float(self.malformed_rehearsals),
            "env_errors": float(self.env_errors),
            "bound_hits": float(self.bound_hits),
            "env_unavailable": float(self.env_unavailable),
            "env_faults": float(self.env_faults),
        }


def truncate_middle(text: str, limit: int) -> str:
    """``text`` cut to about ``limit`` characters, keeping both ends (0: no limit)."""
    if limit <= 0 or len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n...({len(text) - 2 * half} characters truncated)...\n{text[len(text) - half:]}"


def malformed_call_observation(error: str) -> str:
    """The error observation for a tool-call block the parser rejected (one wording everywhere)."""
    return (
        f"Error: your tool call could not be parsed ({error}). "
        'Emit each call as <tool_call>{"name": <tool name>, "arguments": {<JSON object>}}</tool_call>.'
    )


def skipped_call_observation(name: str, cap: int) -> str:
    return f"Error: at most {cap} tool calls are answered per message; '{name}' was skipped."


def assistant_message(reply: Reply, call_ids: Sequence[str]) -> dict[str, Any]:
    """The canonical assistant message of a reply (arguments as JSON objects; adapters convert)."""
    msg: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.calls:
        msg["tool_calls"] = [
            {"id": cid, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for cid, c in zip(call_ids, reply.calls, strict=True)
        ]
    return msg


class TurnEngine:
    """Runs one rollout of ``episode`` with ``policy`` acting and ``source`` answering tool calls.

    Episode methods are synchronous (environments, verifiers, simulated users); they run in worker
    threads so that many rollouts share one event loop.
    """

    def __init__(self, limits: LoopLimits) -> None:
        self.limits = limits

    async def run(self, episode: Episode, policy: Policy, source: ObservationSource) -> Transcript:
        limits = self.limits
        messages = list(await asyncio.to_thread(episode.initial_messages))
        tools = await asyncio.to_thread(episode.tools)
        t = Transcript(messages=messages)
        n_ids = 0
        try:
            while True:
                t.user_turns += 1
                final_text: str | None = None
                for _step in range(limits.max_steps_per_turn):
                    if episode.done:
                        t.stop_reason = StopReason.EPISODE_DONE
                        return t
                    reply = await policy.respond(messages, tools, Role.ACT)
                    if not reply.generated:
                        t.stop_reason = StopReason.TOKEN_BUDGET
                        return t
                    call_ids = [f"call_{n_ids + i}" for i in range(len(reply.calls))]
                    n_ids += len(reply.calls)
                    step = StepRecord(turn=t.user_turns, reply=reply)
                    t.steps.append(step)
                    before = list(messages)
                    messages.append(assistant_message(reply, call_ids))
                    if reply.budget_exhausted:
                        t.stop_reason = StopReason.TOKEN_BUDGET
                        return t
                    if not reply.calls and not reply.errors:
                        final_text = reply.content
                        break
                    stop = await self._answer(t, step, before, tools, reply, call_ids, episode, source)
                    if stop:
                        t.stop_reason = stop
                        return t
                if final_text is None:
                    if limits.on_step_limit == "end_episode":
                        t.stop_reason = StopReason.MAX_STEPS_PER_TURN
                        return t
                    final_text = ""
                t.final_text = final_text
                next_user = await asyncio.to_thread(episode.end_turn, final_text)
                if next_user is None:
                    t.stop_reason = StopReason.COMPLETED
                    return t
                if t.user_turns >= limits.max_user_turns:
                    t.stop_reason = StopReason.MAX_USER_TURNS
                    return t
                t.actions.append({"name": END_TURN, "arguments": {}})
                messages.append({"role": "user", "content": next_user})
                tools = await asyncio.to_thread(episode.tools)  # e.g. BFCL miss_func reveals a function
        except ModelError as exc:
            t.stop_reason, t.error = StopReason.MODEL_ERROR, str(exc)
            return t

    async def _answer(
        self,
        t: Transcript,
        step: StepRecord,
        before: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        reply: Reply,
        call_ids: list[str],
        episode: Episode,
        source: ObservationSource,
    ) -> StopReason | None:
        """Answer every call of ``reply``; append the tool messages. Returns a stop reason or None."""
        limits = self.limits
        messages = t.messages
        stop: StopReason | None = None
        for error in reply.errors:
            t.malformed_calls += 1
            text = malformed_call_observation(error)
            step.observations.append(Observation(text=text, kind=ObservationKind.MALFORMED_CALL))
            messages.append({"role": "tool", "content": text})
            if limits.on_malformed_call == "end":
                stop = StopReason.MALFORMED_CALL
        if stop:
            return stop
        for i, (call, cid) in enumerate(zip(reply.calls, call_ids, strict=True)):
            if i >= limits.max_calls_per_message:
                t.skipped_calls += 1
                obs = Observation(text=skipped_call_observation(call.name, limits.max_calls_per_message),
                                  kind=ObservationKind.SKIPPED)
            else:
                ctx = CallContext(messages=before, tools=tools, reply=reply, call_index=i, episode=episode,
                                  limits=limits)
                obs = await source.observe(call, ctx)
                t.tool_calls += 1
                if obs.executed:
                    output = obs.real_text if obs.real_text is not None else obs.text
                    t.actions.append({**call.to_dict(), "output": output})
                else:
                    t.bound_hits += 1
                if obs.kind == ObservationKind.ENV_ERROR:
                    t.env_errors += 1
                if obs.kind == ObservationKind.ENV_UNAVAILABLE:
                    t.env_unavailable += 1
                if obs.kind == ObservationKind.ENV_FAULT:
                    t.env_faults += 1
                if obs.kind == ObservationKind.MALFORMED_REHEARSAL:
                    t.malformed_rehearsals += 1
                if obs.masked and not t.masked:
                    t.masked, t.mask_reason = True, obs.meta.get("reason", str(obs.kind))
            step.observations.append(obs)
            messages.append(
                {"role": "tool", "tool_call_id": cid, "content": truncate_middle(obs.text, limits.max_observation_chars)}
            )
            if obs.terminate:
                return StopReason.ending(obs.kind)
        return None

