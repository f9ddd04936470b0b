"""Async client pool for OpenAI-compatible chat endpoints (judges, simulators, ...).

:class:`LLMPool` spreads requests of one model over one or several base URLs (vLLM / SGLang servers,
a hosted API), bounds the requests in flight with an :class:`asyncio.Semaphore`, applies a per-request
timeout and retries infrastructure failures with exponential backoff and jitter.

Every failure belongs to one taxonomy (:class:`LLMError` and its subclasses):

* :class:`InfrastructureError` - the endpoint did not answer usefully: connection refused/reset, timeout,
  HTTP 408/409/429/5xx, a malformed response body. Retried ``max_retries`` times (each retry may go to
  another base URL), then raised. Callers treat it as "no result" (a judge masks the sample).
* :class:`ConfigurationError` - the request can never succeed as configured: HTTP 400/401/403/404/422
  (bad request, bad API key, unknown model, wrong base URL). Raised at once, never retried: retrying a
  wrong model name for an hour helps no one.
* :class:`ModelOutputError` - the endpoint answered but the text is unusable; :class:`JudgeFormatError`
  is the case of :meth:`LLMPool.complete_json` (no valid JSON object even after the repair rounds).

The taxonomy, the JSON extraction (:func:`extract_json_object`) and the repair loop of
:meth:`LLMPool.complete_json` are :mod:`envllm`'s, re-exported here: the classes envace catches
are the ones trace2env's provider raises (``trace2env.providers.ProviderError`` is :class:`LLMError`).

Counters (:meth:`LLMPool.counters`) are plain floats for metrics. The pool binds its HTTP clients and
semaphore to the running event loop and rebuilds them when it is used from another loop (e.g. a
synchronous caller that runs ``asyncio.run`` per batch).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Self, TypeVar

import openai
import pydantic

from envllm import (
    ConfigurationError,
    EndpointConfig,
    InfrastructureError,
    JudgeFormatError,
    LLMError,
    ModelOutputError,
    RepairLoop,
    backoff_delay,
    extract_json_object,
    is_retryable_status,
    not_found_hint,
    retry_after_s,
)
from envllm import short as _short

__all__ = [
    "Completion",
    "ConfigurationError",
    "EndpointConfig",
    "InfrastructureError",
    "JudgeFormatError",
    "LLMEndpointConfig",
    "LLMError",
    "LLMPool",
    "ModelOutputError",
    "extract_json_object",
]

T = TypeVar("T", bound=pydantic.BaseModel)


# -- configuration --------------------------------------------------------------------------------------
#: the pool's endpoint config is the project's one endpoint config (envllm.EndpointConfig), under the name envace
#: has always imported it by
LLMEndpointConfig = EndpointConfig


@dataclass
class Completion:
    """One successful chat completion."""

    text: str  # message content ("" when the server sent none)
    finish_reason: str | None  # "stop", "length", ...
    base_url: str  # the endpoint that answered
    latency_s: float  # seconds of the successful attempt
    attempts: int  # HTTP attempts this call took (1 = no retry)
    reasoning: str | None = None  # server-side reasoning_content, when the server splits it off
    usage: dict[str, int] = field(default_factory=dict)


# -- the pool -------------------------------------------------------------------------------------------
_COUNTER_NAMES = (
    "calls",  # logical calls (complete / complete_text / each complete_json round)
    "requests",  # HTTP attempts sent
    "successes",  # attempts that returned a completion
    "retries",  # attempts after an infrastructure error
    "failures",  # logical calls that ended in an exception (any class)
    "timeouts",  # attempts that hit timeout_s
    "connection_errors",  # attempts that could not connect / lost the connection
    "server_errors",  # attempts answered by HTTP 408/409/425/429/5xx or a malformed body
    "config_errors",  # calls aborted by a ConfigurationError
    "format_errors",  # complete_json calls that failed validation after all repair rounds
    "repairs",  # repair requests sent by complete_json
    "latency_sum_s",  # seconds, summed over successful attempts
)


class _Endpoint:
    __slots__ = ("base_url", "down_until", "failures", "in_flight", "index", "requests")

    def __init__(self, base_url: str, index: int) -> None:
        self.base_url = base_url
        self.index = index
        self.in_flight = 0
        self.requests = 0
        self.failures = 0
        self.down_until = 0.0


class _LoopState:
    """What must belong to one event loop: the HTTP clients and the semaphore."""

    def __init__(self, loop: asyncio.AbstractEventLoop, config: LLMEndpointConfig) -> None:
        self.loop = loop
        self.semaphore = asyncio.Semaphore(config.concurrency)
        key = config.resolved_api_key()
        self.clients = [
            openai.AsyncOpenAI(base_url=url, api_key=key, timeout=config.timeout_s, max_retries=0)
            for url in config.base_urls
        ]


class LLMPool:
    """Async chat-completion client over one model served at one or several base URLs.

    Use ``async with LLMPool(cfg) as pool`` or call :meth:`aclose` at the end. Share one pool between the
    coroutines of one event loop (that is what makes the concurrency limit global); it is not thread-safe.
    """

    def __init__(self, config: LLMEndpointConfig, *, rng: random.Random | None = None) -> None:
        self.config = config
        self._endpoints = [_Endpoint(url, i) for i, url in enumerate(config.base_urls)]
        self._rr = 0
        self._rng = rng or random.Random()
        self._state: _LoopState | None = None
        self._counters: dict[str, float] = dict.fromkeys(_COUNTER_NAMES, 0.0)
        self.max_in_flight = 0  # highest number of requests in flight seen so far

    # -- lifecycle ------------------------------------------------------------------------------------
    def _loop_state(self) -> _LoopState:
        loop = asyncio.get_running_loop()
        if self._state is None or self._state.loop is not loop:
            # A different (or the first) loop: clients and the semaphore of a previous loop cannot be reused.
            self._state = _LoopState(loop, self.config)
        return self._state

    async def aclose(self) -> None:
        state, self._state = self._state, None
        if state is not None and state.loop is asyncio.get_running_loop():
            await asyncio.gather(*(c.close() for c in state.clients), return_exceptions=True)

    async def __aenter__(self) -> Self:
        self._loop_state()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- metrics --------------------------------------------------------------------------------------
    def counters(self) -> dict[str, float]:
        """Counters since creation (or :meth:`reset_counters`), plus live gauges, as floats."""
        out = dict(self._counters)
        out["in_flight"] = float(sum(e.in_flight for e in self._endpoints))
        out["max_in_flight"] = float(self.max_in_flight)
        ok = self._counters["successes"]
        out["latency_mean_s"] = self._counters["latency_sum_s"] / ok if ok else 0.0
        return out

    def endpoint_stats(self) -> list[dict[str, Any]]:
        """Per base URL: requests sent, failed attempts, in flight, whether it is in its cooldown."""
        now = time.monotonic()
        return [
            {
                "base_url": e.base_url,
                "requests": e.requests,
                "failures": e.failures,
                "in_flight": e.in_flight,
                "healthy": e.down_until <= now,
            }
            for e in self._endpoints
        ]

    def reset_counters(self) -> None:
        self._counters = dict.fromkeys(_COUNTER_NAMES, 0.0)
        self.max_in_flight = 0

    # -- routing --------------------------------------------------------------------------------------
    def _pick(self, tried: set[int]) -> _Endpoint:
        now = time.monotonic()
        eps = self._endpoints
        order = [eps[(self._rr + i) % len(eps)] for i in range(len(eps))]
        self._rr = (self._rr + 1) % len(eps)
        # Prefer healthy endpoints this call has not tried yet, then healthy ones, then anything.
        for pool in (
            [e for e in order if e.down_until <= now and e.index not in tried],
            [e for e in order if e.down_until <= now],
            sorted(order, key=lambda e: e.down_until),
        ):
            if pool:
                if self.config.routing == "least_busy":
                    return min(pool, key=lambda e: e.in_flight)  # min() keeps the round-robin order on ties
                return pool[0]
        raise AssertionError("unreachable: there is always at least one endpoint")

    def _backoff(self, retry: int, retry_after: float | None) -> float:
        cfg = self.config
        return backoff_delay(retry, cfg.backoff_base_s, cfg.backoff_max_s, self._rng.random(), retry_after)

    # -- requests -------------------------------------------------------------------------------------
    def _request_kwargs(self, messages: Sequence[Mapping[str, Any]], sampling: dict[str, Any]) -> dict[str, Any]:
        cfg = self.config
        kwargs: dict[str, Any] = {"model": cfg.model, "messages": [dict(m) for m in messages]}
        for key in ("temperature", "top_p", "max_tokens", "seed"):
            value = sampling.pop(key, getattr(cfg, key))
            if value is not None:
                kwargs[key] = value
        extra = {**cfg.extra_body, **(sampling.pop("extra_body", None) or {})}
        if extra:
            kwargs["extra_body"] = extra
        kwargs.update({k: v for k, v in sampling.items() if v is not None})
        return kwargs

    async def complete(self, messages: Sequence[Mapping[str, Any]], **sampling: Any) -> Completion:
        """One chat completion, retried on infrastructure errors.

        ``sampling`` overrides ``temperature`` / ``top_p`` / ``max_tokens`` of the config and passes any
        other chat-completions argument through (``stop``, ``seed``, ``response_format``, ``extra_body``).
        Raises :class:`InfrastructureError` after the retries, :class:`ConfigurationError` at once.
        """
        kwargs = self._request_kwargs(messages, dict(sampling))
        self._counters["calls"] += 1
        try:
            return await self._complete_with_retries(kwargs)
        except Exception:
            self._counters["failures"] += 1
            raise

    async def _complete_with_retries(self, kwargs: dict[str, Any]) -> Completion:
        cfg = self.config
        state = self._loop_state()
        tried: set[int] = set()
        last_reason = ""
        timed_out = False
        attempts = 0
        for attempt in range(cfg.max_retries + 1):
            if attempt:
                self._counters["retries"] += 1
            async with state.semaphore:
                ep = self._pick(tried)
                tried.add(ep.index)
                attempts += 1
                outcome = await self._attempt(state, ep, kwargs)
            if isinstance(outcome, Completion):
                outcome.attempts = attempts
                return outcome
            last_reason, timed_out, retry_after = outcome
            if attempt < cfg.max_retries:
                await asyncio.sleep(self._backoff(attempt, retry_after))
        raise InfrastructureError(
            f"model {cfg.model!r}: {attempts} attempt(s) failed; last: {last_reason}",
            attempts=attempts,
            timed_out=timed_out,
        )

    async def _attempt(
        self, state: _LoopState, ep: _Endpoint, kwargs: dict[str, Any]
    ) -> Completion | tuple[str, bool, float | None]:
        """One HTTP attempt: a Completion, or (reason, timed_out, retry_after) of an infrastructure error."""
        cfg = self.config
        client = state.clients[ep.index]
        ep.in_flight += 1
        ep.requests += 1
        self._counters["requests"] += 1
        self.max_in_flight = max(self.max_in_flight, sum(e.in_flight for e in self._endpoints))
        start = time.perf_counter()
        try:
            async with asyncio.timeout(cfg.timeout_s):
                response = await client.chat.completions.create(**kwargs)
        except (TimeoutError, openai.APITimeoutError):
            return self._infra(ep, "timeouts", f"{ep.base_url}: no reply within {cfg.timeout_s:g}s", True, down=True)
        except openai.APIConnectionError as exc:
            reason = f"{ep.base_url}: connection failed ({exc.__cause__ or exc})"
            return self._infra(ep, "connection_errors", reason, False, down=True)
        except openai.APIStatusError as exc:
            status = exc.status_code
            detail = _short(getattr(exc, "message", None) or str(exc))
            if is_retryable_status(status):
                reason = f"{ep.base_url}: HTTP {status}: {detail}"
                return self._infra(ep, "server_errors", reason, False, retry_after_s(exc))
            self._counters["config_errors"] += 1
            ep.failures += 1
            raise ConfigurationError(
                f"{ep.base_url} rejected the request for model {cfg.model!r}: HTTP {status}: {detail}"
                f"{not_found_hint(status)}",
                status_code=status,
                base_url=ep.base_url,
            ) from exc
        except openai.APIError as exc:  # e.g. a body that is not a chat completion
            return self._infra(ep, "server_errors", f"{ep.base_url}: bad response: {_short(str(exc))}", False)
        finally:
            ep.in_flight -= 1
        latency = time.perf_counter() - start
        choices = getattr(response, "choices", None)
        if not choices:
            return self._infra(ep, "server_errors", f"{ep.base_url}: the response has no choices", False)
        choice = choices[0]
        message = choice.message
        ep.down_until = 0.0
        self._counters["successes"] += 1
        self._counters["latency_sum_s"] += latency
        usage = {}
        if getattr(response, "usage", None) is not None:
            usage = {
                k: int(v)
                for k in ("prompt_tokens", "completion_tokens")
                if isinstance(v := getattr(response.usage, k, None), int)
            }
        reasoning = getattr(message, "reasoning_content", None) or getattr(message, "reasoning", None)
        return Completion(
            text=message.content or "",
            finish_reason=choice.finish_reason,
            base_url=ep.base_url,
            latency_s=latency,
            attempts=1,
            reasoning=reasoning if isinstance(reasoning, str) else None,
            usage=usage,
        )

    def _infra(
        self,
        ep: _Endpoint,
        counter: str,
        reason: str,
        timed_out: bool,
        retry_after: float | None = None,
        *,
        down: bool = False,
    ) -> tuple[str, bool, float | None]:
        self._counters[counter] += 1
        ep.failures += 1
        if down and len(self._endpoints) > 1:
            ep.down_until = time.monotonic() + self.config.unhealthy_cooldown_s
        return reason, timed_out, retry_after

    async def complete_text(self, messages: Sequence[Mapping[str, Any]], **sampling: Any) -> str:
        """The reply text of one chat completion (see :meth:`complete` for ``sampling`` and errors)."""
        return (await self.complete(messages, **sampling)).text

    async def complete_json(
        self,
        messages: Sequence[Mapping[str, Any]],
        schema: type[T],
        repair_rounds: int = 1,
        *,
        use_json_schema: bool | None = None,
        **sampling: Any,
    ) -> T:
        """A reply parsed as one JSON object and validated by ``schema``.

        The object may sit after a ``<think>`` block, inside ```` ```json ```` fences or amid prose. When it
        is missing or invalid, up to ``repair_rounds`` follow-up requests show the model its reply and
        what was wrong. Raises :class:`JudgeFormatError` if no reply validates, and the errors of
        :meth:`complete` for endpoint failures. ``use_json_schema`` (default: the config's) also sends
        ``response_format={"type": "json_schema", ...}`` built from ``schema``.
        """
        loop = RepairLoop(messages, schema, repair_rounds, repair_prompt=lambda r: self._repair_prompt(schema, r))
        if use_json_schema is None:
            use_json_schema = self.config.use_json_schema
        if use_json_schema and "response_format" not in sampling:
            sampling["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": schema.__name__, "schema": schema.model_json_schema(), "strict": True},
            }
        while loop.pending:
            if loop.rounds:
                self._counters["repairs"] += 1
            completion = await self.complete(loop.messages, **sampling)
            value = loop.feed(completion.text, completion.finish_reason)
            if value is not None:
                return value
        self._counters["format_errors"] += 1
        raise JudgeFormatError(
            f"no valid {schema.__name__} JSON after {loop.rounds} request(s): {loop.reason}; "
            f"last reply: {_short(loop.text)}",
            text=loop.text,
            rounds=loop.rounds,
        )

    @staticmethod
    def _repair_prompt(schema: type[pydantic.BaseModel], reason: str) -> str:
        return (
            f"Your previous reply could not be used: {reason}.\n"
            "Reply again with exactly one JSON object and nothing else (no code fences, no commentary). "
            "It must match this JSON Schema:\n" + json.dumps(schema.model_json_schema(), ensure_ascii=False)
        )
