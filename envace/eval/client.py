"""Chat-completions client for evaluation: one OpenAI-compatible endpoint, robust tool-call parsing.

Servers differ in how much of the model's output they parse:

* vLLM with ``--enable-auto-tool-choice --tool-call-parser hermes`` and ``transformers serve``
  (5.10, model types qwen2/qwen3/...) return structured ``tool_calls``; ``transformers serve`` also
  leaves the raw ``<tool_call>...</tool_call>`` text in ``content``.
* A server without a tool parser returns only text.

:func:`parse_assistant_output` turns either form into the same :class:`ChatReply`: text for the other
party (``<think>`` spans and tool-call blocks removed), well-formed :class:`~envace.envs.base.ToolCall`
objects, and the malformed blocks with the reason they could not be used. Malformed calls are data,
never exceptions: the agent loop feeds them back to the model as error observations and counts them.
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from envace.envs.base import ToolCall, ToolCallError

__all__ = [
    "ChatClient",
    "ChatReply",
    "EndpointConfig",
    "MalformedToolCall",
    "ModelRequestError",
    "parse_assistant_output",
    "strip_think",
]

_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_THINK_RE = re.compile(r"<think>.*?(?:</think>|\Z)", re.DOTALL)


@dataclass(frozen=True)
class MalformedToolCall:
    """A tool call the model attempted but that cannot be executed."""

    raw: str
    error: str
    id: str = field(default_factory=lambda: f"malformed_{uuid.uuid4().hex[:12]}")

    def observation(self) -> str:
        return (
            f"Error: your tool call could not be parsed ({self.error}). "
            'Emit each call as <tool_call>{"name": <tool name>, "arguments": {<JSON object>}}</tool_call>.'
        )


@dataclass
class ChatReply:
    """One assistant (or simulated-user) completion, normalised."""

    content: str  # text meant for the other party; no <think> spans, no tool-call blocks
    tool_calls: list[ToolCall] = field(default_factory=list)
    malformed: list[MalformedToolCall] = field(default_factory=list)
    raw_content: str = ""  # what the server returned as content, untouched
    reasoning: str | None = None
    finish_reason: str | None = None
    usage: dict[str, int] | None = None

    @property
    def wants_tools(self) -> bool:
        """True when the completion tried to call tools (even if every call was malformed)."""
        return bool(self.tool_calls or self.malformed)

    def assistant_message(self) -> dict[str, Any]:
        """The OpenAI-form assistant message to append to the conversation history."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.malformed:
            # Keep the broken text visible so the model can see what it emitted.
            broken = "\n".join(f"<tool_call>{m.raw}</tool_call>" for m in self.malformed)
            msg["content"] = f"{self.content}\n{broken}".strip()
        if self.tool_calls:
            msg["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)},
                }
                for call in self.tool_calls
            ]
        return msg


class ModelRequestError(RuntimeError):
    """The endpoint failed to answer (connection, timeout, server error after retries).

    ``retryable`` is False for errors the model itself caused (e.g. the context is too long),
    which count as a failed task rather than an infrastructure problem.
    """

    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


def strip_think(text: str) -> tuple[str, str | None]:
    """Split ``text`` into (visible text, reasoning). Handles a prefilled ``<think>`` (only ``</think>``
    in the output) and an unterminated ``<think>`` (generation budget spent while thinking)."""
    reasoning: list[str] = []
    if "</think>" in text and "<think>" not in text.split("</think>", 1)[0]:
        head, text = text.split("</think>", 1)
        reasoning.append(head)

    def _take(match: re.Match[str]) -> str:
        reasoning.append(match.group(0).removeprefix("<think>").removesuffix("</think>"))
        return ""

    text = _THINK_RE.sub(_take, text)
    joined = "\n".join(r.strip() for r in reasoning if r.strip())
    return text.strip(), (joined or None)


def _new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:16]}"


def _parse_block(block: str) -> ToolCall | MalformedToolCall:
    body = block.strip()
    if not body:
        return MalformedToolCall(raw=block, error="empty <tool_call> block")
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return MalformedToolCall(raw=block, error=f"invalid JSON: {exc}")
    if isinstance(obj, dict) and "arguments" not in obj and "parameters" in obj:
        obj = {**obj, "arguments": obj["parameters"]}  # a frequent Qwen slip
    try:
        call = ToolCall.from_dict(obj)
    except ToolCallError as exc:
        return MalformedToolCall(raw=block, error=str(exc))
    return ToolCall(name=call.name, arguments=call.arguments, id=call.id or _new_call_id())


def parse_assistant_output(content: str | None, api_tool_calls: Sequence[Any] | None = None) -> ChatReply:
    """Normalise one completion.

    ``api_tool_calls`` are the server-parsed calls (OpenAI objects or dicts). When present they are
    authoritative and tool-call blocks left in ``content`` are dropped; otherwise Qwen/Hermes
    ``<tool_call>{json}</tool_call>`` blocks are parsed from ``content``. Unterminated blocks
    (generation cut by ``max_tokens``) and invalid JSON become :class:`MalformedToolCall`.
    """
    raw = content or ""
    visible, reasoning = strip_think(raw)
    calls: list[ToolCall] = []
    malformed: list[MalformedToolCall] = []

    if api_tool_calls:
        for item in api_tool_calls:
            obj = item.model_dump() if hasattr(item, "model_dump") else item
            try:
                call = ToolCall.from_dict(obj)
            except ToolCallError as exc:
                malformed.append(MalformedToolCall(raw=json.dumps(obj, default=str), error=str(exc)))
                continue
            calls.append(ToolCall(name=call.name, arguments=call.arguments, id=call.id or _new_call_id()))
        visible = _TOOL_CALL_RE.sub("", visible)
    else:
        for match in _TOOL_CALL_RE.finditer(visible):
            terminated = match.group(0).endswith("</tool_call>")
            parsed = _parse_block(match.group(1))
            if isinstance(parsed, ToolCall) and not terminated:
                parsed = MalformedToolCall(raw=match.group(1), error="unterminated <tool_call> block")
            (calls if isinstance(parsed, ToolCall) else malformed).append(parsed)  # type: ignore[arg-type]
        visible = _TOOL_CALL_RE.sub("", visible)
    visible = visible.replace("</tool_call>", "").strip()
    return ChatReply(content=visible, tool_calls=calls, malformed=malformed, raw_content=raw, reasoning=reasoning)


@dataclass(frozen=True)
class EndpointConfig:
    """Where and how to call an OpenAI-compatible chat endpoint."""

    base_url: str
    model: str
    api_key: str = "EMPTY"
    temperature: float | None = 0.0
    top_p: float | None = None
    max_tokens: int | None = None
    seed: int | None = None
    timeout: float = 600.0
    max_retries: int = 3
    extra_body: dict[str, Any] = field(default_factory=dict)

    def with_overrides(self, **changes: Any) -> EndpointConfig:
        from dataclasses import replace

        return replace(self, **{k: v for k, v in changes.items() if v is not None})


class ChatClient:
    """Synchronous chat-completions client (thread-safe: one ``openai.OpenAI`` shared by threads).

    ``complete`` never raises for model-side formatting problems; it raises
    :class:`ModelRequestError` when the endpoint itself fails.
    """

    def __init__(self, config: EndpointConfig) -> None:
        import openai

        self.config = config
        self._openai = openai
        self._client = openai.OpenAI(
            base_url=config.base_url,
            api_key=config.api_key or "EMPTY",
            timeout=config.timeout,
            max_retries=config.max_retries,
        )
        self._lock = threading.Lock()
        self.requests = 0

    def complete(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        **overrides: Any,
    ) -> ChatReply:
        cfg = self.config
        kwargs: dict[str, Any] = {"model": cfg.model, "messages": list(messages)}
        if tools:
            kwargs["tools"] = list(tools)
        for key in ("temperature", "top_p", "max_tokens", "seed"):
            value = overrides.pop(key, getattr(cfg, key))
            if value is not None:
                kwargs[key] = value
        if cfg.extra_body:
            kwargs["extra_body"] = dict(cfg.extra_body)
        kwargs.update(overrides)
        try:
            response = self._client.chat.completions.create(**kwargs)
        except self._openai.BadRequestError as exc:  # e.g. context length exceeded: the model's problem
            raise ModelRequestError(f"endpoint rejected the request: {exc}", retryable=False) from exc
        except self._openai.APIError as exc:  # connection, timeout, 5xx after the client's retries
            raise ModelRequestError(f"endpoint {cfg.base_url} failed: {exc}", retryable=True) from exc
        with self._lock:
            self.requests += 1
        if not response.choices:
            raise ModelRequestError(f"endpoint {cfg.base_url} returned no choices", retryable=True)
        choice = response.choices[0]
        message = choice.message
        reply = parse_assistant_output(message.content, message.tool_calls)
        server_reasoning = getattr(message, "reasoning_content", None) or getattr(message, "reasoning", None)
        if server_reasoning and not reply.reasoning:
            reply.reasoning = server_reasoning
        reply.finish_reason = choice.finish_reason
        if response.usage is not None:
            reply.usage = {
                "prompt_tokens": response.usage.prompt_tokens,
                "completion_tokens": response.usage.completion_tokens,
            }
        return reply

    def list_models(self) -> list[str]:
        return [m.id for m in self._client.models.list().data]
