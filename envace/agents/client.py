"""Chat-completions client for one OpenAI-compatible endpoint, with robust tool-call parsing: the evaluation
policy's transport, and the chat models an environment needs (τ²'s simulated user and judge, connected by
:func:`connect_endpoints`).

Servers differ in how much of the model's output they parse:

* vLLM with ``--enable-auto-tool-choice --tool-call-parser hermes`` and ``transformers serve``
  (5.10, model types qwen2/qwen3/...) return structured ``tool_calls``; ``transformers serve`` also
  leaves the raw ``<tool_call>...</tool_call>`` text in ``content``.
* A server without a tool parser returns only text.

:func:`parse_assistant_output` turns either form into the same :class:`ChatReply`, splitting the text
with the project's parser :func:`envace.toolcall.parse_tool_calls`: text for the other party
(reasoning and tool-call blocks removed), well-formed :class:`~envace.envs.base.ToolCall`
objects, and the malformed blocks with the reason they could not be used. Malformed calls are data,
never exceptions: the agent loop feeds them back to the model as error observations and counts them.
Text from the server passes :func:`~envace.envs.base.scrub_surrogates` (a ``"\\ud800"`` escape in the
JSON body would otherwise leave an unencodable lone surrogate in the conversation).

Failed requests raise exceptions of the project's one error taxonomy (:mod:`envllm`, re-exported by
:mod:`envace.rewards.llm`; the status classification and :func:`is_context_too_long` are that module's too):

* :class:`~envace.rewards.llm.InfrastructureError` - connection refused/reset, time-out, HTTP
  408/409/425/429/5xx, a malformed body (after the client's retries): the caller retries the task later;
* :class:`~envace.rewards.llm.ConfigurationError` - HTTP 400/401/403/404/405/422 that no retry can fix
  (unknown model, bad key, wrong base URL, a parameter the server rejects): the caller aborts the run;
* :class:`~envace.agents.engine.ModelError` - the request failed because of what the model produced
  (HTTP 400/413/422 saying the context or the prompt is too long): scored as the model's failure.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from envace.agents.engine import ModelError
from envace.envs.base import ToolCall, ToolCallError, chat_model_args, scrub_surrogates
from envace.rewards.llm import ConfigurationError, InfrastructureError
from envace.toolcall import THINK_END, parse_tool_calls
from envllm import EndpointConfig, is_context_too_long, is_retryable_status, not_found_hint

__all__ = [
    "ChatClient",
    "ChatReply",
    "EndpointConfig",
    "MalformedToolCall",
    "check_model_served",
    "classify_http_error",
    "connect_endpoints",
    "is_context_too_long",
    "parse_assistant_output",
]


@dataclass(frozen=True)
class MalformedToolCall:
    """A tool call the model attempted but that cannot be executed.

    ``raw`` is the server's call object as JSON for a bad server-parsed call; for a block parsed from
    the text it is empty (the untouched text is :attr:`ChatReply.raw_content`, and ``error`` quotes
    the start of the broken block).
    """

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
        # Malformed blocks are not echoed: each gets an error observation that says what was wrong.
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
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


def classify_http_error(status: int | None, message: str, *, base_url: str = "", model: str = "") -> Exception:
    """The taxonomy error for a failed chat request (``status`` None: no HTTP answer at all)."""
    where = f"{base_url}: " if base_url else ""
    if status is None or is_retryable_status(status):
        code = f"HTTP {status}: " if status is not None else ""
        return InfrastructureError(f"{where}{code}{message}")
    if is_context_too_long(status, message):
        return ModelError(f"{where}HTTP {status}: {message}")
    return ConfigurationError(
        f"{where}the request for model {model!r} was rejected: HTTP {status}: {message}{not_found_hint(status)}",
        status_code=status,
        base_url=base_url or None,
    )


def _new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:16]}"


def _with_id(call: ToolCall) -> ToolCall:
    return call if call.id else ToolCall(name=call.name, arguments=call.arguments, id=_new_call_id())


def parse_assistant_output(content: str | None, api_tool_calls: Sequence[Any] | None = None) -> ChatReply:
    """Normalise one completion.

    Reasoning, visible text and Qwen/Hermes ``<tool_call>{json}</tool_call>`` blocks are split by
    :func:`envace.toolcall.parse_tool_calls` (the project's one parser). ``api_tool_calls`` are the
    server-parsed calls (OpenAI objects or dicts): when present they are authoritative and the blocks
    left in ``content`` are only dropped from the text. Otherwise each malformed block (invalid JSON,
    not an object, no name, non-object arguments, unterminated, stray ``</tool_call>``) becomes a
    :class:`MalformedToolCall` carrying the parser's message. A ``<think>`` block cut off by
    ``max_tokens`` is reasoning with no visible text, not a malformed tool call.
    """
    raw = scrub_surrogates(content or "")
    parsed = parse_tool_calls(raw)
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
            calls.append(_with_id(call))
    else:
        calls = [_with_id(call) for call in parsed.calls]
        # An unterminated <think> swallows the whole rest of the text, so it is the only error then;
        # it is truncated reasoning, not a tool call the model attempted.
        truncated_think = parsed.reasoning is not None and THINK_END not in raw
        errors = [] if truncated_think else parsed.errors
        malformed = [MalformedToolCall(raw="", error=error) for error in errors]
    return ChatReply(
        content=parsed.content, tool_calls=calls, malformed=malformed, raw_content=raw, reasoning=parsed.reasoning
    )


class ChatClient:
    """Synchronous chat-completions client (thread-safe: one ``openai.OpenAI`` shared by threads).

    ``complete`` never raises for model-side formatting problems; a failed request raises
    :class:`~envace.rewards.llm.InfrastructureError`, :class:`~envace.rewards.llm.ConfigurationError` or
    :class:`~envace.agents.engine.ModelError` (see the module docstring).
    """

    def __init__(self, config: EndpointConfig) -> None:
        import openai

        if len(config.base_urls) != 1:
            raise ValueError(f"ChatClient calls one base URL, got {len(config.base_urls)}: {config.base_urls}")
        self.config = config
        self._openai = openai
        self._client = openai.OpenAI(
            base_url=config.base_url,
            api_key=config.resolved_api_key(),
            timeout=config.timeout_s,
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
        except self._openai.APIStatusError as exc:
            detail = getattr(exc, "message", None) or str(exc)
            raise classify_http_error(exc.status_code, detail, base_url=cfg.base_url, model=cfg.model) from exc
        except self._openai.APIError as exc:  # connection, timeout, malformed body (after the client's retries)
            raise classify_http_error(None, f"{type(exc).__name__}: {exc}", base_url=cfg.base_url) from exc
        with self._lock:
            self.requests += 1
        if not response.choices:
            raise InfrastructureError(f"{cfg.base_url}: the response has no choices")
        choice = response.choices[0]
        message = choice.message
        reply = parse_assistant_output(message.content, message.tool_calls)
        server_reasoning = getattr(message, "reasoning_content", None) or getattr(message, "reasoning", None)
        if server_reasoning and not reply.reasoning:
            reply.reasoning = scrub_surrogates(server_reasoning)
        reply.finish_reason = choice.finish_reason
        if response.usage is not None:
            reply.usage = {
                "prompt_tokens": response.usage.prompt_tokens,
                "completion_tokens": response.usage.completion_tokens,
            }
        return reply

    def list_models(self) -> list[str]:
        return [m.id for m in self._client.models.list().data]


def check_model_served(config: EndpointConfig) -> None:
    """Fail fast on a wrong ``--model`` / ``--base-url``: the endpoint's ``GET /models`` must list the model.

    Raises :class:`~envace.rewards.llm.ConfigurationError` when the endpoint answers and does not serve
    the model (or answers 401/403/404 to the listing), :class:`~envace.rewards.llm.InfrastructureError`
    when it cannot be reached. An endpoint without a model listing (other 4xx) is not judged here: its
    chat requests are classified one by one.
    """
    import openai

    client = openai.OpenAI(base_url=config.base_url, api_key=config.resolved_api_key(),
                           timeout=min(config.timeout_s, 60.0), max_retries=config.max_retries)
    try:
        served = [m.id for m in client.models.list().data]
    except openai.APIStatusError as exc:
        if exc.status_code in (401, 403, 404) or is_retryable_status(exc.status_code):
            detail = getattr(exc, "message", None) or str(exc)
            raise classify_http_error(exc.status_code, f"GET /models: {detail}", base_url=config.base_url,
                                      model=config.model) from exc
        return
    except openai.APIError as exc:
        raise InfrastructureError(f"{config.base_url}: GET /models failed: {type(exc).__name__}: {exc}") from exc
    finally:
        client.close()
    if served and config.model not in served:
        raise ConfigurationError(
            f"{config.base_url} does not serve model {config.model!r}; it serves {served[:20]}",
            status_code=404,
            base_url=config.base_url,
        )


def connect_endpoints(pool: str, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``kwargs`` for ``get_pool(pool, ...)`` with each chat-model argument of the pool
    (:func:`~envace.envs.base.chat_model_args`) given as an endpoint config (an :class:`EndpointConfig` or its
    keyword dict, as ``envace.agent.pool_kwargs`` carries it) replaced by a :class:`ChatClient` on it."""
    out = dict(kwargs)
    for arg in chat_model_args(pool):
        value = out.get(arg)
        if isinstance(value, Mapping):
            value = EndpointConfig.from_mapping(dict(value), f"envace.agent.pool_kwargs.{pool}.{arg}")
        if isinstance(value, EndpointConfig):
            out[arg] = ChatClient(value)
    return out
