"""Per-task runners and the OpenAI adapter of the turn engine, used for evaluation.

A *task runner* is any callable ``runner(pool, task_id) -> TaskRecord``. The evaluation driver only
knows this signature, so alternative strategies (e.g. test-time rehearsal before acting) plug in by
registering a factory with :func:`register_runner` and selecting it with ``--runner NAME``
(options through ``--runner-arg KEY=VALUE``); test-time rehearsal is the runner ``tts``, chosen by ``--tts`` and
configured by the typed :class:`~envace.loop_config.TTSConfig` (:attr:`RunContext.tts`). The default,
``agent_loop``, is :class:`AgentLoopRunner`: one rollout through :class:`envace.agents.engine.TurnEngine` — the
same turn logic, limits and error observations as training — with :class:`ChatPolicy` (an OpenAI-compatible
endpoint) acting and the real environment answering tool calls; then the benchmark's official verifier, scored by
:func:`envace.rewards.score.score_episode` as training scores it (a rollout that could not be judged raises
:class:`~envace.rewards.llm.InfrastructureError`: the task is retried on the next run).
"""

from __future__ import annotations

import asyncio
import json
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from envace.agents.client import ChatClient
from envace.agents.engine import LoopLimits, ObservationSource, Reply, Role, StopReason, TurnEngine
from envace.agents.sources import RealSource
from envace.envs.base import EnvironmentPool, TaskSpec, scrub_surrogates
from envace.loop_config import TTSConfig
from envace.rewards.llm import InfrastructureError
from envace.rewards.score import score_episode

__all__ = [
    "AgentLoopRunner",
    "ChatPolicy",
    "LoopLimits",
    "RunContext",
    "TaskRecord",
    "TaskRunner",
    "available_runners",
    "build_runner",
    "register_runner",
    "to_api_messages",
]


@dataclass
class TaskRecord:
    """Everything recorded about one evaluated task (one line of ``results.jsonl``)."""

    task_id: str
    category: str
    split: str
    reward: float
    passed: bool
    reason: str = ""  # the checker's explanation
    stop_reason: StopReason = StopReason.COMPLETED  # why the turn engine stopped
    error: str | None = None  # model-side request error (e.g. context too long), if any
    bound_hits: int = 0  # tool calls stopped at a tool bound (time / memory); scored as the model's failure
    unjudged: list[str] = field(default_factory=list)  # verifier components that could not be judged
    turns: int = 0
    completions: int = 0
    tool_calls: int = 0
    malformed_tool_calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    elapsed_s: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)  # the verifier's details
    messages: list[dict[str, Any]] | None = None  # the agent's transcript (unless disabled)
    extra: dict[str, Any] = field(default_factory=dict)  # runner-specific data

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "stop_reason": str(self.stop_reason)}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> TaskRecord:
        """The record of one ``results.jsonl`` line (unknown keys ignored; ValueError for an unknown stop reason)."""
        known = {f for f in cls.__dataclass_fields__}
        kept = {k: v for k, v in obj.items() if k in known}
        if "stop_reason" in kept:
            kept["stop_reason"] = StopReason.parse(kept["stop_reason"])
        return cls(**kept)


class TaskRunner(Protocol):
    """Runs one task end to end and returns its record; whatever the model causes is in the record.

    Raise only what the record cannot hold: :class:`~envace.rewards.llm.ConfigurationError` (wrong model
    name, bad key: the run aborts at once) or any other exception for an infrastructure failure (endpoint
    down, ...): such tasks are logged to ``errors.jsonl`` and retried on the next run."""

    def __call__(self, pool: EnvironmentPool, task_id: str) -> TaskRecord: ...


def to_api_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Canonical engine messages → OpenAI request form (tool-call arguments as JSON strings)."""
    out = []
    for msg in messages:
        if msg.get("tool_calls"):
            msg = dict(msg)
            msg["tool_calls"] = [
                {
                    **c,
                    "function": {
                        "name": c["function"]["name"],
                        "arguments": c["function"]["arguments"]
                        if isinstance(c["function"]["arguments"], str)
                        else json.dumps(c["function"]["arguments"], ensure_ascii=False),
                    },
                }
                for c in msg["tool_calls"]
            ]
        out.append(msg)
    return out


class ChatPolicy:
    """The engine's :class:`~envace.agents.engine.Policy` over an OpenAI-compatible chat endpoint.

    ``sampling`` maps a role to per-request overrides (e.g. ``{Role.REHEARSE: {"temperature": 1.0}}``).
    The client's errors pass through unchanged: :class:`~envace.agents.engine.ModelError` (the engine scores
    it), :class:`~envace.rewards.llm.ConfigurationError` and :class:`~envace.rewards.llm.InfrastructureError`.
    """

    def __init__(self, client: ChatClient, sampling: dict[Role, dict[str, Any]] | None = None) -> None:
        self.client = client
        self.sampling = dict(sampling or {})
        self.prompt_tokens = self.completion_tokens = self.requests = 0

    async def respond(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, role: Role) -> Reply:
        overrides = dict(self.sampling.get(role, {}))
        chat = await asyncio.to_thread(
            self.client.complete, to_api_messages(messages), tools=tools if role is Role.ACT else None, **overrides
        )
        self.requests += 1
        usage = chat.usage or {}
        self.prompt_tokens += usage.get("prompt_tokens") or 0
        self.completion_tokens += usage.get("completion_tokens") or 0
        return Reply(
            text=chat.raw_content,
            content=chat.content,
            calls=list(chat.tool_calls),
            errors=[m.error for m in chat.malformed],
            reasoning=chat.reasoning,
            finish_reason=chat.finish_reason,
            prompt_tokens=usage.get("prompt_tokens") or 0,
            completion_tokens=usage.get("completion_tokens") or 0,
        )


class AgentLoopRunner:
    """One task through the turn engine against the real environment (see module docstring)."""

    def __init__(
        self,
        client: ChatClient,
        limits: LoopLimits | None = None,
        *,
        start_kwargs: dict[str, Any] | None = None,
        keep_transcript: bool = True,
        env_timeout_s: float | None = 60.0,
    ) -> None:
        self.client = client
        self.limits = limits or LoopLimits()
        self.start_kwargs = dict(start_kwargs or {})
        self.keep_transcript = keep_transcript
        self.env_timeout_s = env_timeout_s

    def __call__(self, pool: EnvironmentPool, task_id: str) -> TaskRecord:
        started = time.monotonic()
        spec: TaskSpec = pool.task(task_id)
        episode = pool.start(task_id, **self.start_kwargs)
        try:
            return self.run_episode(spec, episode, ChatPolicy(self.client), started=started)
        finally:  # a remote episode's session ends with its task
            episode.close()

    def run_episode(
        self, spec: TaskSpec, episode: Any, policy: ChatPolicy, *, started: float | None = None,
        source: ObservationSource | None = None,
    ) -> TaskRecord:
        """One rollout of a started ``episode`` against the real environment, then its official verdict.

        ``policy`` acts (its token counts go into the record); ``started`` (``time.monotonic()``) is when the
        task began, for ``elapsed_s``. Other runners (test-time rehearsal) reuse it for their committed run.
        ``source`` answers the tool calls instead of the real environment (W2R, :mod:`envace.eval.w2r`: the
        Trace2Env simulator, which executes every call in ``episode`` too, so the verdict scores that replay).
        """
        started = time.monotonic() if started is None else started
        task_id = spec.task_id
        source = RealSource(self.env_timeout_s) if source is None else source
        transcript = asyncio.run(TurnEngine(self.limits).run(episode, policy, source))
        rec = TaskRecord(task_id=task_id, category=spec.category, split=spec.split, reward=0.0, passed=False)
        rec.stop_reason, rec.error = transcript.stop_reason, transcript.error
        rec.turns = transcript.user_turns
        rec.completions = len(transcript.steps)
        rec.tool_calls = transcript.tool_calls
        rec.malformed_tool_calls = transcript.malformed_calls
        rec.bound_hits = transcript.bound_hits
        rec.prompt_tokens, rec.completion_tokens = policy.prompt_tokens, policy.completion_tokens
        score = asyncio.run(score_episode(episode, transcript, timeout_s=self.env_timeout_s))
        if score.masked:  # not judged (environment or verifier time-out, verifier crash): retried on the next run
            raise InfrastructureError(f"task {task_id} could not be scored: {score.reason}")
        verdict = score.verdict
        rec.reward, rec.passed = score.reward, bool(verdict.passed)
        rec.details = _json_safe(verdict.details)
        rec.reason = str(verdict.details.get("reason", "")) if isinstance(verdict.details, dict) else ""
        rec.unjudged = list(verdict.details.get("unjudged", [])) if isinstance(verdict.details, dict) else []
        rec.messages = _json_safe(to_api_messages(transcript.messages)) if self.keep_transcript else None
        rec.elapsed_s = round(time.monotonic() - started, 3)
        return rec


def _json_safe(obj: Any) -> Any:
    """A JSON-round-tripped copy (odd objects stringified, lone surrogates replaced)."""
    return scrub_surrogates(json.loads(json.dumps(obj, default=str, ensure_ascii=True)))


# --------------------------------------------------------------------------------------------
# Runner registry: the hook for alternative per-task strategies (e.g. test-time rehearsal)
# --------------------------------------------------------------------------------------------


@dataclass
class RunContext:
    """What a runner factory gets to build its runner."""

    client: ChatClient  # the agent's endpoint
    limits: LoopLimits
    start_kwargs: dict[str, Any]  # forwarded to pool.start (τ²: user / judge)
    keep_transcript: bool
    options: dict[str, str]  # --runner-arg KEY=VALUE pairs
    # seconds the real execution of one call, or the verification, may take (then: infrastructure, retried)
    env_timeout_s: float = 60.0
    # test-time rehearsal settings (--tts ...; the runner "tts" reads them); None: none given
    tts: TTSConfig | None = None


RunnerFactory = Callable[[RunContext], TaskRunner]
_RUNNERS: dict[str, RunnerFactory] = {}


def register_runner(name: str) -> Callable[[RunnerFactory], RunnerFactory]:
    """Decorator: make a runner factory selectable with ``--runner NAME``."""

    def deco(factory: RunnerFactory) -> RunnerFactory:
        if name in _RUNNERS and _RUNNERS[name] is not factory:
            raise ValueError(f"task runner {name!r} registered twice")
        _RUNNERS[name] = factory
        return factory

    return deco


def available_runners() -> list[str]:
    return sorted(_RUNNERS)


def build_runner(name: str, ctx: RunContext) -> TaskRunner:
    try:
        factory = _RUNNERS[name]
    except KeyError:
        raise KeyError(f"unknown task runner {name!r}; available: {available_runners()}") from None
    return factory(ctx)


@register_runner("agent_loop")
def _agent_loop(ctx: RunContext) -> TaskRunner:
    if ctx.options:
        raise ValueError(f"runner 'agent_loop' takes no --runner-arg options, got {sorted(ctx.options)}")
    return AgentLoopRunner(ctx.client, ctx.limits, start_kwargs=ctx.start_kwargs, keep_transcript=ctx.keep_transcript,
                           env_timeout_s=ctx.env_timeout_s)


def format_exception(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()
