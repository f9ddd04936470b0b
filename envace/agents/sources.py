"""Observation sources: who answers the agent's tool calls (``envace.agent.observation_source``).

``real``
    The task's environment executes the call (:class:`RealSource`): today's behaviour, and the paper's
    "standard GRPO" baseline.
``rehearse``
    EnvACE world rehearsal (§4.1; :class:`RehearseSource`): the *policy itself*, in its REHEARSE role,
    writes the tool's response from a rehearsal prompt (:func:`rehearsal_messages`; its system prompt is the versioned
    file ``envace/prompts/rehearsal_<version>.txt``, ``envace.agent.rehearsal.version``) and must answer in
    the strict ``<execution_result>{json}</execution_result>`` format (:func:`parse_rehearsal`). The
    parsed response is what the acting role reads next. When a real environment exists the same call is
    also executed there, unseen by the agent ("shadow" execution), so that the final state can be scored
    by the pool's official verifier — exactly a replay of the actor's calls, in order — and each
    rehearsed response can be compared with the real one (:func:`fidelity`).
``simulator``
    An external OpenAI-compatible LLM writes the response (:class:`SimulatorSource`; the paper's
    "Simulator" baseline), from the same prompt and with the same parser.

Every source returns an :class:`~envace.agents.engine.Observation`; none raises for anything the model
did. Environment exceptions become ``env_error`` observations (the model's failure: its arguments broke
the tool). A call that computes or allocates past the tool bounds (``limits.tool_timeout_s`` /
``tool_memory_mb``) is stopped in a forked copy of the episode before it ever runs for real
(:mod:`envace.envs.sandbox`): the model reads a ``bound_exceeded`` error observation and the rollout goes
on, with the episode unchanged. Environment time-outs of the real execution (``env_timeout_s``, e.g. an
environment waiting on the network) mask the rollout (it cannot be scored) and end it, as do an unavailable
environment (:class:`~envace.envs.base.EnvironmentUnavailable`: ``env_unavailable``) and one that broke its protocol
(:class:`~envace.envs.base.EnvironmentFault`: ``env_fault``). A remote episode (an MCP or OpenEnv server) skips the
forked dry run and is awaited (``Episode.aexecute``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from envace.agents.engine import CallContext, Observation, ObservationKind, Policy, Role, assistant_message
from envace.envs.base import EnvironmentFault, EnvironmentUnavailable, ToolCall, scrub_surrogates
from envace.envs.sandbox import BoundExceeded, Bounds, ChildFailed, run_bounded
from envace.loop_config import RehearsalPrompt
from envace.toolcall import THINK_END, THINK_START, render_tool_call

logger = logging.getLogger(__name__)

__all__ = [
    "RESULT_END",
    "RESULT_START",
    "GeneratedSource",
    "RealSource",
    "RehearsalFormatError",
    "RehearsalPrompt",
    "RehearseSource",
    "SimulatorSource",
    "fidelity",
    "parse_rehearsal",
    "rehearsal_messages",
    "render_rehearsal",
]

RESULT_START = "<execution_result>"
RESULT_END = "</execution_result>"
#: bound on what one environment call may return before it is cut (protects dumps and memory)
MAX_OUTPUT_CHARS = 65536


# -- the real environment ------------------------------------------------------------------------
class RealSource:
    """The task's own environment executes each call (in a worker thread, under a time bound).

    Each call first runs in a forked copy of the episode under the rollout's tool bounds
    (``ctx.limits.tool_timeout_s`` / ``tool_memory_mb``); only a call that finishes within them runs for
    real. ``timeout_s`` bounds the real execution (a time-out there masks the rollout).
    """

    name = "real"

    def __init__(self, timeout_s: float | None = 60.0) -> None:
        self.timeout_s = timeout_s

    async def execute(self, call: ToolCall, ctx: CallContext) -> Observation:
        if not ctx.episode.remote:
            probe = await self._probe(call, ctx)
            if probe is not None:
                return probe
        try:
            run = (ctx.episode.aexecute(call) if ctx.episode.remote
                   else asyncio.to_thread(ctx.episode.execute, call))
            text = await asyncio.wait_for(run, self.timeout_s)
        except TimeoutError:
            return Observation(
                text=f"Error: the environment did not answer '{call.name}' within {self.timeout_s:g}s.",
                kind=ObservationKind.TIMEOUT,
                terminate=True,
                masked=True,
                meta={"reason": f"environment time-out on {call.name}"},
            )
        except EnvironmentUnavailable as exc:  # infrastructure (a server down, a dropped connection): never scored
            return Observation(
                text=f"Error: the environment is unavailable ('{call.name}').",
                kind=ObservationKind.ENV_UNAVAILABLE,
                terminate=True,
                masked=True,
                meta={"reason": f"environment unavailable on {call.name}: {_safe_str(exc)}"},
            )
        except EnvironmentFault as exc:  # the server broke its protocol: named, never scored as the model's
            return Observation(
                text=f"Error: the environment answered '{call.name}' with a malformed result.",
                kind=ObservationKind.ENV_FAULT,
                terminate=True,
                masked=True,
                meta={"reason": f"environment fault on {call.name}: {_safe_str(exc)}"},
            )
        except Exception as exc:
            logger.debug("environment raised on %s", call.name, exc_info=True)
            return Observation(
                text=f"Error: the environment failed on '{call.name}': {type(exc).__name__}: {_safe_str(exc)}",
                kind=ObservationKind.ENV_ERROR,
            )
        text = _safe_str(text)[:MAX_OUTPUT_CHARS]
        return Observation(text=text, kind=_answer_kind(text))

    @staticmethod
    async def _probe(call: ToolCall, ctx: CallContext) -> Observation | None:
        """The call's dry run in a forked copy of the episode under the tool bounds: the error observation when it
        exceeds them or crashes (it then never runs for real), else None."""
        bounds = Bounds(timeout_s=float(ctx.limits.tool_timeout_s), memory_mb=int(ctx.limits.tool_memory_mb))
        try:
            await asyncio.to_thread(run_bounded, lambda: ctx.episode.execute(call), bounds)
        except BoundExceeded as exc:
            return Observation(
                text=f"Error: the tool call '{call.name}' {exc}; it had no effect. Use smaller arguments.",
                kind=ObservationKind.BOUND_EXCEEDED,
                executed=False,
                meta={"bound": exc.what},
            )
        except ChildFailed as exc:
            return Observation(
                text=f"Error: the environment crashed on '{call.name}'; it had no effect.",
                kind=ObservationKind.BOUND_EXCEEDED,
                executed=False,
                meta={"bound": "crash", "reason": str(exc)},
            )
        return None

    async def observe(self, call: ToolCall, ctx: CallContext) -> Observation:
        return await self.execute(call, ctx)


def _safe_str(obj: Any) -> str:
    """``str(obj)`` that survives int→str digit limits and lone surrogates."""
    try:
        text = str(obj)
    except Exception as exc:  # noqa: BLE001  (e.g. ValueError: exceeds the limit for integer string conversion)
        text = f"<unprintable {type(obj).__name__}: {type(exc).__name__}>"
    return scrub_surrogates(text)


def _looks_like_error(text: str) -> bool:
    head = text.lstrip()[:200].lower()
    if head.startswith("error"):
        return True
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return False
    return isinstance(obj, dict) and ("error" in obj or "error_tool_call" in obj)


def _answer_kind(text: str) -> ObservationKind:
    """The kind of a tool's answer: ``tool_error`` when it reads as an error, else ``result``."""
    return ObservationKind.TOOL_ERROR if _looks_like_error(text) else ObservationKind.RESULT


# -- the rehearsal prompt and its strict output format --------------------------------------------
# the system prompt is the versioned file envace/prompts/rehearsal_<version>.txt (RehearsalPrompt.version)


def _tool_schema(tools: Sequence[Mapping[str, Any]], name: str) -> dict[str, Any] | None:
    for tool in tools:
        fn = tool.get("function", tool)
        if fn.get("name") == name:
            return dict(fn)
    return None


def _tool_names(tools: Sequence[Mapping[str, Any]]) -> list[str]:
    return [str(t.get("function", t).get("name")) for t in tools]


def render_history(messages: Sequence[Mapping[str, Any]], max_chars: int) -> str:
    """A role-prefixed transcript (system prompt omitted), cut from the oldest end to ``max_chars``."""
    lines: list[str] = []
    pending: list[str] = []  # names of the calls awaiting tool messages, in order
    for msg in messages:
        role = msg.get("role")
        if role == "system":
            continue
        if role == "user":
            lines.append(f"User: {msg.get('content') or ''}")
        elif role == "assistant":
            calls = msg.get("tool_calls") or []
            body = (msg.get("content") or "").strip()
            rendered = "\n".join(render_tool_call(c) for c in calls)
            lines.append("Assistant: " + "\n".join(x for x in (body, rendered) if x))
            pending = [c.get("function", c).get("name") for c in calls]
        elif role == "tool":
            name = pending.pop(0) if pending else "tool"
            lines.append(f"Tool[{name}]: {msg.get('content') or ''}")
    text = "\n".join(lines)
    if max_chars > 0 and len(text) > max_chars:
        text = "...(earlier conversation omitted)...\n" + text[len(text) - max_chars :]
    return text


def rehearsal_messages(
    call: ToolCall,
    history: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]],
    examples: Sequence[Mapping[str, Any]] = (),
    cfg: RehearsalPrompt | None = None,
) -> list[dict[str, str]]:
    """The chat the REHEARSE role answers: tools, real example responses, history, the call.

    ``history`` is the conversation up to and including the assistant message that issued ``call``
    (tool responses to its earlier calls included). ``examples`` are ``{"name", "arguments", "result"}``
    records of real responses (e.g. from gold replays of training tasks in the same environment).
    """
    cfg = cfg or RehearsalPrompt()
    schema = _tool_schema(tools, call.name)
    sections = []
    if cfg.all_schemas:
        sections.append("# Tools\n" + json.dumps([t.get("function", t) for t in tools], ensure_ascii=False))
    else:
        sections.append("# Tools\n" + ", ".join(_tool_names(tools)))
    shots = [e for e in examples if e.get("name") == call.name][: cfg.max_examples]
    if shots:
        sections.append(
            "# Real responses of this tool\n"
            + "\n".join(
                f"{e['name']}({json.dumps(e.get('arguments', {}), ensure_ascii=False)}) -> {e.get('result', '')}"
                for e in shots
            )
        )
    sections.append("# Conversation\n" + render_history(history, cfg.max_history_chars))
    sections.append(
        "# Call to answer\n"
        + json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
        + "\n# Its schema\n"
        + (json.dumps(schema, ensure_ascii=False) if schema else "(no such tool)")
    )
    return [{"role": "system", "content": cfg.system_prompt()}, {"role": "user", "content": "\n\n".join(sections)}]


def render_rehearsal(result: str) -> str:
    """The exact text a well-formed rehearsal is (what supervised warm-starting teaches)."""
    return f"{RESULT_START}\n{result.strip()}\n{RESULT_END}"


class RehearsalFormatError(ValueError):
    """A rehearsal that does not follow the strict format."""


def parse_rehearsal(text: str | None) -> str:
    """The JSON text inside ``<execution_result>…</execution_result>``; raises :class:`RehearsalFormatError`.

    Reasoning before ``</think>`` is ignored; an unterminated ``<think>`` is an error. Exactly one result
    block is required, with nothing but whitespace around it, holding one JSON object or array.
    """
    if not isinstance(text, str):
        raise RehearsalFormatError(f"expected text, got {type(text).__name__}")
    body = text.lstrip()
    if body.startswith(THINK_START):
        end = body.find(THINK_END)
        if end < 0:
            raise RehearsalFormatError("unterminated <think> block")
        body = body[end + len(THINK_END) :]
    else:
        # reasoning whose <think> was in the prompt ends at a </think> before the result block; a </think> inside
        # the result (a JSON string or key) is data
        end, start = body.find(THINK_END), body.find(RESULT_START)
        if end >= 0 and (start < 0 or end < start):
            body = body[end + len(THINK_END) :]
    body = body.strip()
    if not body.startswith(RESULT_START):
        raise RehearsalFormatError(f"the response must start with {RESULT_START}")
    if not body.endswith(RESULT_END):
        raise RehearsalFormatError(f"the response must end with {RESULT_END}")
    inner = body[len(RESULT_START) : len(body) - len(RESULT_END)]
    if RESULT_START in inner or RESULT_END in inner:
        raise RehearsalFormatError("more than one <execution_result> block")
    inner = inner.strip()
    try:
        value = json.loads(inner)
    except (json.JSONDecodeError, RecursionError) as exc:
        msg = getattr(exc, "msg", type(exc).__name__)
        raise RehearsalFormatError(f"the result is not valid JSON ({msg})") from None
    if not isinstance(value, (dict, list)):
        raise RehearsalFormatError(f"the result must be a JSON object or array, got {type(value).__name__}")
    return inner


def _key_paths(value: Any, prefix: str = "") -> set[str]:
    if isinstance(value, dict):
        out: set[str] = set()
        for k, v in value.items():
            path = f"{prefix}.{k}"
            out.add(path)
            out |= _key_paths(v, path)
        return out
    if isinstance(value, list):
        out = set()
        for v in value:
            out |= _key_paths(v, prefix + "[]")
        return out
    return set()


def fidelity(rehearsed: str, real: str) -> dict[str, float]:
    """How well a rehearsed response matches the real one for the same call in the same state.

    ``exact``: 1.0 when both parse as JSON and are equal after normalisation (key order, whitespace),
    or when both are identical text; ``key_overlap``: Jaccard overlap of their key paths (1.0 when
    neither has keys and ``exact``); ``error_agree``: both are errors or both are not.
    """
    try:
        a = json.loads(rehearsed)
    except (json.JSONDecodeError, RecursionError, TypeError):
        a = None
    try:
        b = json.loads(real)
    except (json.JSONDecodeError, RecursionError, TypeError):
        b = None
    if a is not None and b is not None:
        exact = float(json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True))
        ka, kb = _key_paths(a), _key_paths(b)
        overlap = len(ka & kb) / len(ka | kb) if (ka or kb) else exact
    else:
        exact = float(rehearsed.strip() == real.strip())
        overlap = exact
    return {"exact": exact, "key_overlap": float(overlap), "error_agree": float(_looks_like_error(rehearsed) == _looks_like_error(real))}


def _malformed_rehearsal_text(reason: str) -> str:
    return json.dumps({"error_tool_call": {"code": "MALFORMED_REHEARSAL", "message": reason}})


Examples = Callable[[CallContext], Sequence[Mapping[str, Any]]]


class GeneratedSource:
    """A tool response written by a model: rehearsal prompt → text → strict parse → observation.

    ``generate(messages) -> text`` is the writer: the policy in its REHEARSE role (:func:`RehearseSource`)
    or an external LLM (:func:`SimulatorSource`). With a ``shadow`` the call also runs in the real
    environment (its response is recorded, never shown to the agent).
    """

    def __init__(
        self,
        name: str,
        generate: Callable[[list[dict[str, str]]], Awaitable[str]],
        prompt: RehearsalPrompt | None = None,
        on_malformed: str = "end",
        shadow: RealSource | None = None,
        examples: Examples | None = None,
    ) -> None:
        self.name = name
        self.generate = generate
        self.prompt = prompt or RehearsalPrompt()
        self.on_malformed = on_malformed
        self.shadow = shadow
        self.examples = examples

    async def observe(self, call: ToolCall, ctx: CallContext) -> Observation:
        history = list(ctx.messages)
        history.append(assistant_message(ctx.reply, [f"c{i}" for i in range(len(ctx.reply.calls))]))
        examples = self.examples(ctx) if self.examples else ()
        text = await self.generate(rehearsal_messages(call, history, ctx.tools, examples, self.prompt))
        real: Observation | None = await self.shadow.execute(call, ctx) if self.shadow is not None else None
        try:
            result = parse_rehearsal(text)
        except RehearsalFormatError as exc:
            obs = Observation(
                text=_malformed_rehearsal_text(str(exc)),
                kind=ObservationKind.MALFORMED_REHEARSAL,
                terminate=self.on_malformed == "end",
                meta={"reason": str(exc)},
            )
        else:
            obs = Observation(text=result, kind=_answer_kind(result))
            if real is not None and not real.masked:
                obs.meta["fidelity"] = fidelity(result, real.text)
        if real is not None:
            obs.real_text = real.text
            obs.executed = real.executed
            if real.masked:  # the shadow environment failed (time-out, unavailable, fault): the state cannot be scored
                obs.kind, obs.masked, obs.terminate = real.kind, True, True  # named and counted as the shadow's
                obs.meta["reason"] = real.meta.get("reason", "environment time-out")
        return obs


def RehearseSource(policy: Policy, prompt: RehearsalPrompt | None = None, on_malformed: str = "end",
                   shadow: RealSource | None = None, examples: Examples | None = None) -> GeneratedSource:
    """The policy answers its own tool calls in the REHEARSE role (EnvACE world rehearsal)."""

    async def generate(messages: list[dict[str, str]]) -> str:
        return (await policy.respond(messages, None, Role.REHEARSE)).text

    return GeneratedSource("rehearse", generate, prompt, on_malformed, shadow, examples)


def SimulatorSource(complete: Callable[[list[dict[str, str]]], Awaitable[str]],
                    prompt: RehearsalPrompt | None = None, on_malformed: str = "end",
                    shadow: RealSource | None = None, examples: Examples | None = None) -> GeneratedSource:
    """An external LLM answers the calls (``complete(messages) -> text``, e.g. an OpenAI-compatible endpoint)."""
    return GeneratedSource("simulator", complete, prompt, on_malformed, shadow, examples)
