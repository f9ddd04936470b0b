"""The LLM-client core that envace, trace2env and envsched share: one error taxonomy and one way to read a reply.

trace2env's :class:`~trace2env.llm.OpenAIProvider` (synchronous, per-stage accounting, answer cache),
envace's :class:`envace.rewards.llm.LLMPool` (asynchronous, several base URLs, a semaphore), envace's evaluation
client :class:`envace.agents.client.ChatClient` and envsched's App. E operation extractor
(:class:`envsched.operations.LLMExtractor`) send requests differently; everything else about a structured call is
here, once:

* the taxonomy (:class:`LLMError` and its subclasses; ``trace2env.providers.ProviderError`` is
  :class:`LLMError` under its trace2env name):

  - :class:`InfrastructureError` — the endpoint did not answer usefully: connection refused/reset, time-out,
    HTTP 408/409/425/429/5xx (:func:`is_retryable_status`), a malformed body. Retried with backoff
    (:func:`backoff_delay`), then raised; callers treat it as "no result";
  - :class:`ConfigurationError` — the request can never succeed as configured (HTTP 400/401/403/404/422: bad
    key, unknown model, wrong base URL). Raised at once, never retried;
  - :class:`ModelOutputError` — the endpoint answered but the text is unusable (nothing validated after the
    repair rounds); :class:`JudgeFormatError` is that case for a judge. A rejection caused by the
    conversation's length (:func:`is_context_too_long`) is the model's failure too — envace's turn engine
    scores it as such;

* reading a reply: :func:`extract_json_object` (a ``<think>`` block, code fences and prose around one JSON
  object are tolerated; a :class:`ValueError` says why there is none) and :func:`validation_reason`
  (pydantic's errors in one line, for the model to read);
* :class:`RepairLoop` — the bounded repair of one structured call, independent of how the requests are sent:
  validate each reply, show the model its invalid reply with the reason, and (when a token budget and a cap
  are given) double the budget after a reply cut off at it.

This module imports only ``pydantic`` (no other module of :mod:`envllm`, nor envace, envsched or trace2env).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

import pydantic

__all__ = [
    "RETRYABLE_STATUS",
    "ConfigurationError",
    "InfrastructureError",
    "JudgeFormatError",
    "LLMError",
    "ModelOutputError",
    "RepairLoop",
    "backoff_delay",
    "clip_middle",
    "extract_json_object",
    "is_context_too_long",
    "is_retryable_status",
    "not_found_hint",
    "retry_after_s",
    "short",
    "strip_reasoning",
    "validation_reason",
]

T = TypeVar("T", bound=pydantic.BaseModel)


# -- error taxonomy -----------------------------------------------------------------------------------
class LLMError(Exception):
    """Base of every error of the taxonomy (and of a scripted provider's missing answer)."""


class InfrastructureError(LLMError):
    """The endpoint failed (connection, time-out, HTTP 408/409/425/429/5xx, malformed body) on every attempt."""

    def __init__(self, message: str, *, attempts: int = 1, timed_out: bool = False) -> None:
        super().__init__(message)
        self.attempts = attempts  # HTTP attempts made, retries included
        self.timed_out = timed_out  # the last attempt ended in a time-out


class ConfigurationError(LLMError):
    """The request can never succeed as configured (HTTP 400/401/403/404/422, unknown model). Not retried."""

    def __init__(self, message: str, *, status_code: int | None = None, base_url: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.base_url = base_url


class ModelOutputError(LLMError):
    """The endpoint answered, but the model's text is unusable (no reply validated after the repair rounds)."""

    def __init__(self, message: str, *, text: str | None = None, rounds: int = 1) -> None:
        super().__init__(message)
        self.text = text  # the last reply (None when there was none)
        self.rounds = rounds  # requests made (first try + repairs)


class JudgeFormatError(ModelOutputError):
    """No judge reply validated against the expected JSON schema, repair rounds included."""


# -- HTTP status classification -----------------------------------------------------------------------
#: HTTP statuses of a server that may answer the same request later (besides every 5xx)
RETRYABLE_STATUS = frozenset({408, 409, 425, 429})

#: a rejection caused by the conversation's length, i.e. by what the model generated
_CONTEXT_TOO_LONG = re.compile(
    r"context[ _-]?length|context window|maximum context|prompt is too long|input is too long|too many tokens"
    r"|longer than the model|exceeds? the (model|maximum)|(input|prompt|context|conversation)[^.]{0,40}too long",
    re.IGNORECASE,
)


def is_retryable_status(status: int) -> bool:
    """Whether an HTTP status is an infrastructure failure (408/409/425/429 or any 5xx), worth retrying."""
    return status in RETRYABLE_STATUS or status >= 500


def is_context_too_long(status: int | None, message: str) -> bool:
    """Whether a rejected request failed on the conversation's length (the model's failure, not a configuration
    error): a 400/413/422 whose message says so, in the wording of vLLM, transformers serve or OpenAI."""
    return status in (400, 413, 422) and bool(_CONTEXT_TOO_LONG.search(message))


def not_found_hint(status: int | None) -> str:
    """The hint appended to a configuration error: a 404 is usually a wrong model name or base URL."""
    return " (is the model name served there, and does the base URL end in /v1?)" if status == 404 else ""


def retry_after_s(exc: Any) -> float | None:
    """The ``Retry-After`` header (seconds) of an HTTP error's response, None when absent or not a number."""
    try:
        return float(exc.response.headers.get("retry-after", ""))
    except (AttributeError, TypeError, ValueError):
        return None


def backoff_delay(retry: int, base_s: float, max_s: float, jitter: float, retry_after: float | None = None) -> float:
    """Seconds to wait before retry ``retry`` + 1: ``base_s * 2**retry`` capped at ``max_s``, times the jitter
    factor ``0.5 + jitter`` (``jitter`` uniform in [0, 1)); at least the server's ``Retry-After`` (capped too)."""
    delay = min(max_s, base_s * (2**retry)) * (0.5 + jitter)
    if retry_after is not None:
        delay = max(delay, min(retry_after, max_s))
    return delay


# -- reading a reply ----------------------------------------------------------------------------------
_FENCE_RE = re.compile(r"```[ \t]*(?:json|JSON)?[ \t]*\n?(.*?)```", re.DOTALL)


def strip_reasoning(text: str) -> str:
    """Drop a leading ``<think>...</think>`` block (or everything up to a lone ``</think>``).

    Raises :class:`ValueError` for an unterminated ``<think>`` block."""
    if "</think>" in text:
        return text.rsplit("</think>", 1)[1]
    if text.lstrip().startswith("<think>"):
        raise ValueError("the reply is an unterminated <think> block (cut off before any answer?)")
    return text


def _first_object(text: str) -> dict[str, Any] | None:
    decoder = json.JSONDecoder()
    for match in re.finditer(r"\{", text):
        try:
            obj, _ = decoder.raw_decode(text, match.start())
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            return obj
    return None


def extract_json_object(text: str | None) -> dict[str, Any]:
    """The JSON object in a model reply.

    Tolerates a leading ``<think>...</think>`` block, ```` ```json ```` fences and prose around one object
    (the first fenced object, else the whole text, else its first object). Raises :class:`ValueError` with
    the reason when there is no JSON object.
    """
    if text is None or not text.strip():
        raise ValueError("the reply is empty")
    body = strip_reasoning(text).strip()
    if not body:
        raise ValueError("the reply has no text after the </think> block")
    candidates = [m.group(1).strip() for m in _FENCE_RE.finditer(body)] + [body]
    for cand in candidates:
        try:
            obj = json.loads(cand)
        except json.JSONDecodeError:
            obj = _first_object(cand)
        if isinstance(obj, dict):
            return obj
    try:
        json.loads(body)
    except json.JSONDecodeError as exc:
        raise ValueError(f"no JSON object found in the reply (invalid JSON: {exc.msg} at char {exc.pos})") from None
    raise ValueError("the reply is JSON but not a JSON object")


def validation_reason(exc: Exception) -> str:
    """Why a reply was refused, in one line: pydantic's first eight errors as ``loc: msg``, else ``str(exc)``."""
    if isinstance(exc, pydantic.ValidationError):
        parts = []
        for err in exc.errors()[:8]:
            loc = ".".join(str(p) for p in err.get("loc", ())) or "<root>"
            parts.append(f"{loc}: {err.get('msg')}")
        return "; ".join(parts)
    return str(exc)


def clip_middle(text: str, limit: int) -> str:
    """``text`` cut to about ``limit`` characters by dropping its middle (a marker says how many characters);
    unchanged when it fits or ``limit <= 0``. For long payloads sent to a model: both ends usually matter."""
    if limit <= 0 or len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n...({len(text) - 2 * half} characters omitted)...\n{text[len(text) - half:]}"


def short(text: str | None, limit: int = 300) -> str:
    """``text`` on one line (newlines escaped), cut to ``limit`` characters; ``<none>`` for None."""
    if text is None:
        return "<none>"
    text = text.replace("\n", "\\n")
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- the bounded repair of one structured call --------------------------------------------------------
class RepairLoop(Generic[T]):
    """The repair rounds of one structured call, whatever sends the requests (sync or async)::

        loop = RepairLoop(messages, Schema, repair_rounds=2, repair_prompt=lambda reason: ...)
        while loop.pending:
            text, finish_reason = send(loop.messages, loop.max_tokens)   # loop.rounds > 0: a repair request
            if loop.feed(text, finish_reason) is not None:
                return loop.value
        raise ModelOutputError(f"... after {loop.rounds} request(s): {loop.reason}", text=loop.text, rounds=loop.rounds)

    A reply is valid when :func:`extract_json_object` finds an object that ``schema`` validates. After an
    invalid reply the next request's chat is the previous one plus the reply (as the assistant) and
    ``repair_prompt(reason)`` (as the user). A reply cut off at the token budget (``finish_reason ==
    "length"``) says so in the reason — "at N tokens" when ``max_tokens`` is given, else "at max_tokens" —
    and, when ``max_tokens_cap`` is given too, the next request gets twice the budget (at most the cap).
    """

    def __init__(
        self,
        messages: Sequence[Mapping[str, Any]],
        schema: type[T],
        repair_rounds: int,
        *,
        repair_prompt: Callable[[str], str],
        max_tokens: int | None = None,
        max_tokens_cap: int | None = None,
    ) -> None:
        if repair_rounds < 0:
            raise ValueError(f"repair_rounds must be >= 0, got {repair_rounds}")
        self.schema = schema
        self.repair_rounds = repair_rounds
        self.repair_prompt = repair_prompt
        self.messages: list[dict[str, Any]] = [dict(m) for m in messages]  # the chat of the next request
        self.max_tokens = max_tokens  # the token budget of the next request (None: the caller's own)
        self.max_tokens_cap = max_tokens_cap
        self.rounds = 0  # replies fed so far (= requests made)
        self.text: str | None = None  # the last reply
        self.reason = ""  # why the last reply was refused
        self.value: T | None = None  # the validated answer, once there is one

    @property
    def pending(self) -> bool:
        """Whether another request is due: no valid reply yet and repair rounds left."""
        return self.value is None and self.rounds <= self.repair_rounds

    def feed(self, text: str | None, finish_reason: str | None = None) -> T | None:
        """Take the reply of the request just sent: the validated answer, or None (the reason is in
        :attr:`reason`; when :attr:`pending`, :attr:`messages` and :attr:`max_tokens` are the next request's)."""
        if not self.pending:
            raise RuntimeError("RepairLoop.feed after the last round")
        self.rounds += 1
        self.text = text
        try:
            self.value = self.schema.model_validate(extract_json_object(text))
            return self.value
        except ValueError as exc:  # pydantic.ValidationError is a ValueError too
            reason = validation_reason(exc)
        if finish_reason == "length":
            if self.max_tokens is None:
                reason += " (the reply was cut off at max_tokens)"
            else:
                reason += f" (the reply was cut off at {self.max_tokens} tokens)"
                if self.max_tokens_cap is not None:
                    self.max_tokens = min(self.max_tokens_cap, self.max_tokens * 2)
        self.reason = reason
        if self.pending:
            self.messages = [
                *self.messages,
                {"role": "assistant", "content": text or ""},
                {"role": "user", "content": self.repair_prompt(reason)},
            ]
        return None
