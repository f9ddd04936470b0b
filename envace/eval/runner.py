"""Per-task runners and the agent loop used for evaluation.

A *task runner* is any callable ``runner(pool, task_id) -> TaskRecord``. The evaluation driver only
knows this signature, so alternative strategies (e.g. test-time rehearsal before acting) plug in by
registering a factory with :func:`register_runner` and selecting it with ``--runner NAME``
(options through ``--runner-arg KEY=VALUE``). The default, ``agent_loop``, is :class:`AgentLoopRunner`:

    messages = episode.initial_messages()
    per user turn (≤ max_turns):
        per step (≤ max_steps_per_turn):
            reply = chat(messages, tools=episode.tools())
            tool calls → episode.execute(...) → ``role: tool`` messages; malformed calls → error
            observations (counted); no tool calls → the turn ends
        episode.end_turn(reply text) → next user message (BFCL: next question; τ²: simulated user)
    episode.verify()  → official checker

Hitting ``max_steps_per_turn`` or ``max_turns`` stops the episode (as BFCL's own inference loop does
when a turn runs away); the verifier then scores what happened.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from envace.envs.base import EnvironmentPool, TaskSpec
from envace.eval.client import ChatClient, ModelRequestError

__all__ = [
    "AgentLoopRunner",
    "LoopLimits",
    "RunContext",
    "TaskRecord",
    "TaskRunner",
    "available_runners",
    "build_runner",
    "register_runner",
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
    stop_reason: str = "completed"  # completed | max_turns | max_steps_per_turn | model_error
    error: str | None = None  # model-side request error (e.g. context too long), if any
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
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> TaskRecord:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in obj.items() if k in known})


class TaskRunner(Protocol):
    """Runs one task end to end and returns its record. Raise only for infrastructure failures
    (endpoint down, ...): such tasks are logged to ``errors.jsonl`` and retried on the next run."""

    def __call__(self, pool: EnvironmentPool, task_id: str) -> TaskRecord: ...


@dataclass(frozen=True)
class LoopLimits:
    max_turns: int = 50
    max_steps_per_turn: int = 20


class AgentLoopRunner:
    """The plain agent loop (see module docstring)."""

    def __init__(
        self,
        client: ChatClient,
        limits: LoopLimits = LoopLimits(),
        *,
        start_kwargs: dict[str, Any] | None = None,
        keep_transcript: bool = True,
    ) -> None:
        self.client = client
        self.limits = limits
        self.start_kwargs = dict(start_kwargs or {})
        self.keep_transcript = keep_transcript

    def __call__(self, pool: EnvironmentPool, task_id: str) -> TaskRecord:
        started = time.monotonic()
        spec: TaskSpec = pool.task(task_id)
        episode = pool.start(task_id, **self.start_kwargs)
        messages = episode.initial_messages()
        rec = TaskRecord(task_id=task_id, category=spec.category, split=spec.split, reward=0.0, passed=False)
        try:
            self._converse(episode, messages, rec)
        except ModelRequestError as exc:
            if exc.retryable:
                raise
            rec.stop_reason, rec.error = "model_error", str(exc)
        verdict = episode.verify()
        rec.reward, rec.passed = float(verdict.reward), bool(verdict.passed)
        rec.details = _json_safe(verdict.details)
        rec.reason = str(verdict.details.get("reason", "")) if isinstance(verdict.details, dict) else ""
        rec.unjudged = list(verdict.details.get("unjudged", [])) if isinstance(verdict.details, dict) else []
        rec.messages = _json_safe(messages) if self.keep_transcript else None
        rec.elapsed_s = round(time.monotonic() - started, 3)
        return rec

    def _converse(self, episode: Any, messages: list[dict[str, Any]], rec: TaskRecord) -> None:
        limits = self.limits
        while not episode.done:
            if rec.turns >= limits.max_turns:
                rec.stop_reason = "max_turns"
                return
            rec.turns += 1
            final_text: str | None = None
            for _ in range(limits.max_steps_per_turn):
                reply = self.client.complete(messages, tools=episode.tools())
                rec.completions += 1
                if reply.usage:
                    rec.prompt_tokens += reply.usage.get("prompt_tokens") or 0
                    rec.completion_tokens += reply.usage.get("completion_tokens") or 0
                messages.append(reply.assistant_message())
                if not reply.wants_tools:
                    final_text = reply.content
                    break
                for call in reply.tool_calls:
                    observation = episode.execute(call)
                    rec.tool_calls += 1
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": observation})
                for bad in reply.malformed:
                    rec.malformed_tool_calls += 1
                    messages.append({"role": "tool", "tool_call_id": bad.id, "content": bad.observation()})
                if episode.done:
                    return
            if final_text is None:
                rec.stop_reason = "max_steps_per_turn"
                return
            user_message = episode.end_turn(final_text)
            if user_message is None:
                return
            messages.append({"role": "user", "content": user_message})


def _json_safe(obj: Any) -> Any:
    import json

    return json.loads(json.dumps(obj, default=str, ensure_ascii=False))


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
    return AgentLoopRunner(ctx.client, ctx.limits, start_kwargs=ctx.start_kwargs, keep_transcript=ctx.keep_transcript)


def format_exception(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()
