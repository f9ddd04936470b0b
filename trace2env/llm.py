"""The OpenAI-compatible provider of the model stages (construction and the world-model agent).

Paper §4.1 / Appendix C.2 (construction with a model ``phi``) and §4.3 (the world-model agent). Every stage
is one :meth:`OpenAIProvider.complete` call ``(stage, payload, response_model)``:

* the request is a chat completion against any OpenAI-compatible endpoint (vLLM, SGLang, ``transformers
  serve``, a hosted API) through the ``openai`` client; the system message is the stage's instruction
  (:data:`STAGE_INSTRUCTIONS`), the user message the JSON payload (clipped to ``max_payload_chars``);
* structured output: ``response_format`` ``json_schema`` (non-strict: pydantic's schemas are not all
  strict-mode schemas) built from the response model, or ``json_object`` with the schema in the prompt, or
  none (the schema in the prompt only) for servers without structured output;
* the reply is validated **locally** with pydantic (a ``<think>`` block, code fences and prose around one
  JSON object are tolerated); an invalid reply gets up to ``repair_rounds`` follow-ups that show the model
  its reply and the validation errors; a reply cut off at ``max_tokens`` is retried once per round at
  twice the budget (up to ``max_tokens_cap``) — the loop is :class:`envllm.RepairLoop`, shared
  with envace's judge pool;
* errors follow the project's one taxonomy (:mod:`envllm`, the classes envace and envsched catch too):
  infrastructure failures are retried with exponential backoff and then raised as
  :class:`InfrastructureError`, configuration errors are raised at once as :class:`ConfigurationError`,
  and a stage that never validates raises :class:`ModelOutputError`;
* accounting per stage (:class:`StageUsage`): logical calls, HTTP requests, repairs, failures, prompt and
  completion tokens and the cost from configured prices (:meth:`OpenAIProvider.usage_table`);
* an optional content-addressed cache (``cache_dir``): key = sha256 of the canonical JSON (sorted keys) of
  everything sent that can change the answer: the stage, the first request's whole body (model, messages
  with the stage instruction and the schema, temperature, ``max_tokens``, ``response_format``,
  ``extra_body``, which the ``openai`` client merges into the body), the parameters of the follow-up
  requests (``repair_rounds``, ``max_tokens_cap``) and :data:`CACHE_VERSION`; a hit returns the validated
  answer without a request, so an interrupted build resumes without paying twice. The endpoint's URL, key
  and time-outs are not part of it (a resumed build may reach the same model on another port).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import openai
from pydantic import BaseModel, ValidationError

from envllm import (
    ConfigurationError,
    EndpointConfig,
    InfrastructureError,
    ModelOutputError,
    RepairLoop,
    backoff_delay,
    clip_middle,
    extract_json_object,
    is_retryable_status,
    not_found_hint,
    retry_after_s,
)

__all__ = ["STAGE_INSTRUCTIONS", "OpenAIProvider", "OpenAIProviderConfig", "StageUsage", "extract_json_object"]

T = TypeVar("T", bound=BaseModel)

#: part of every cache key; bump it when the wording sent by the code (the JSON instruction appended to the
#: stage's system message, the repair message) changes, so answers to the old wording are asked again
#: (3: the repair message quotes the shared extractor's reasons, e.g. "invalid JSON: ... at char N")
CACHE_VERSION = 3

#: the system message of each stage (paper Appendix C.2 / C.3 roles; wording our own)
STAGE_INSTRUCTIONS: dict[str, str] = {
    "extract_transition": (
        "You read one recorded action and the environment's observation. Report the state preconditions, the "
        "state changes the action caused, the outcome and the facts the observation states. Cite only what the "
        "observation supports; mark anything uncertain."),
    "induce_schema": (
        "You induce an environment's interface from recorded transitions: the actions with their arguments "
        "(types, which are required) and the state variables the environment must keep to explain the "
        "observations. State paths start with world., session., surface. or epistemic."),
    "induce_rules": (
        "You induce transition rules from recorded transitions: for an action, the conditions on the state "
        "and arguments under which it has an outcome, its effects on declared state paths (set, create, "
        "delete, increment, decrement, append, merge, remove) and a template that renders the observation "
        "exactly. Contrast successes with failures of the same action. Propose invariants the state always "
        "satisfies. Every rule is checked by replaying the recorded traces; wrong rules are discarded."),
    "falsify_rules": (
        "You review candidate rules against the recorded evidence and report every transition that "
        "contradicts a rule."),
    "induce_renderers": (
        "You describe how the environment formats its observations per action: JSON or text, the fields "
        "every observation carries, and a template when one fits."),
    "induce_notes": (
        "You write short notes on the environment's conventions, formats, constraints and facts, each "
        "citing the recorded transitions that support it."),
    "world_model_step": (
        "You are the world model of an environment reconstructed from recorded traces. For the action given, "
        "inspect the worldbook, the episode state and the episode memory with the tools offered, then submit "
        "the transition: the effects on declared state paths and the exact observation the real environment "
        "would return. Stay consistent with earlier turns of this episode. Evidence labelled format_only or "
        "uncertain shows the shape of an observation, not its values. Answer with one JSON object: "
        '{"thought": ..., "tool": <tool name or "submit">, "arguments": {...}}.'),
    "predict_observation": (
        "You predict the observation a software environment returns for an action (an evaluation baseline: "
        "the payload's instructions say what context you are given). Answer with the observation exactly as "
        "the environment would return it."),
    "judge_observation": (
        "You judge a simulator's predicted observation against the reference observation the real environment "
        "returned, with the rubric in the payload's instructions."),
}


@dataclass
class OpenAIProviderConfig(EndpointConfig):
    """The endpoint (:class:`envllm.EndpointConfig`: URL, model, key, time-out, retries, sampling)
    plus the model stages' own knobs. The provider talks to the first of ``base_urls``; the async pool's
    ``concurrency``, ``routing``, ``unhealthy_cooldown_s`` and ``use_json_schema`` do not apply here."""

    # the budget is doubled (up to this cap) when a reply is cut off at max_tokens
    max_tokens_cap: int = 16384
    # follow-up requests showing the model its invalid reply (the reference uses 2)
    repair_rounds: int = 2
    # structured output: json_schema | json_object | none (schema in the prompt only)
    response_format: str = "json_schema"
    # characters of the JSON payload sent (the middle is cut beyond it)
    max_payload_chars: int = 60000
    # USD per 1M prompt tokens, for the cost column
    usd_per_m_prompt: float = 0.0
    # USD per 1M completion tokens
    usd_per_m_completion: float = 0.0
    # content-addressed answer cache directory (None: no cache)
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.repair_rounds < 0:
            raise ValueError(f"repair_rounds must be >= 0, got {self.repair_rounds}")
        if self.max_tokens is None or self.max_tokens_cap < self.max_tokens:
            raise ValueError("need 1 <= max_tokens <= max_tokens_cap")
        if self.response_format not in ("json_schema", "json_object", "none"):
            raise ValueError(f"response_format must be json_schema, json_object or none, got {self.response_format!r}")


@dataclass
class StageUsage:
    """Accounting of one stage."""

    calls: int = 0  # logical complete() calls
    requests: int = 0  # HTTP attempts
    repairs: int = 0  # follow-up requests after an invalid or truncated reply
    retries: int = 0  # attempts after an infrastructure error
    failures: int = 0  # calls that raised
    cache_hits: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    usd: float = 0.0


class OpenAIProvider:
    """:class:`~trace2env.providers.Provider` over an OpenAI-compatible chat endpoint (synchronous,
    thread-safe: the accounting is locked; the ``openai`` client is shared)."""

    def __init__(self, config: OpenAIProviderConfig, *, client: openai.OpenAI | None = None,
                 rng: random.Random | None = None) -> None:
        self.config = config
        self.client = client or openai.OpenAI(base_url=config.base_url, api_key=config.resolved_api_key(),
                                              timeout=config.timeout_s, max_retries=0)
        self._rng = rng or random.Random(0)
        self._lock = threading.Lock()
        self.usage: dict[str, StageUsage] = {}

    # -- accounting -----------------------------------------------------------------------------------
    def _count(self, stage: str, **inc: float) -> None:
        with self._lock:
            u = self.usage.setdefault(stage, StageUsage())
            for k, v in inc.items():
                setattr(u, k, getattr(u, k) + v)

    def totals(self) -> StageUsage:
        out = StageUsage()
        for u in self.usage.values():
            for k, v in asdict(u).items():
                setattr(out, k, getattr(out, k) + v)
        return out

    def usage_table(self) -> list[dict[str, Any]]:
        """One row per stage plus ``total`` (for the CLI's cost report)."""
        rows = [{"stage": s, **asdict(u)} for s, u in sorted(self.usage.items())]
        return [*rows, {"stage": "total", **asdict(self.totals())}]

    # -- one HTTP request with retries ----------------------------------------------------------------
    def _request(self, stage: str, kwargs: dict[str, Any]) -> tuple[str, str | None]:
        cfg = self.config
        last = ""
        for attempt in range(cfg.max_retries + 1):
            if attempt:
                self._count(stage, retries=1)
            self._count(stage, requests=1)
            retry_after: float | None = None
            timed_out = False
            try:
                resp = self.client.chat.completions.create(**kwargs)
            except openai.APITimeoutError:
                last, timed_out = f"no reply within {cfg.timeout_s:g}s", True
            except openai.APIConnectionError as e:
                last = f"connection failed ({e.__cause__ or e})"
            except openai.APIStatusError as e:
                status = e.status_code
                if is_retryable_status(status):
                    last = f"HTTP {status}: {str(e)[:200]}"
                    retry_after = retry_after_s(e)
                else:
                    raise ConfigurationError(f"{cfg.base_url} rejected the request for model {cfg.model!r}: "
                                             f"HTTP {status}: {str(e)[:300]}{not_found_hint(status)}",
                                             status_code=status, base_url=cfg.base_url) from e
            except openai.APIError as e:
                last = f"bad response: {str(e)[:200]}"
            else:
                choices = getattr(resp, "choices", None)
                if choices:
                    usage = getattr(resp, "usage", None)
                    pt = int(getattr(usage, "prompt_tokens", 0) or 0)
                    ct = int(getattr(usage, "completion_tokens", 0) or 0)
                    self._count(stage, prompt_tokens=pt, completion_tokens=ct,
                                usd=pt * cfg.usd_per_m_prompt / 1e6 + ct * cfg.usd_per_m_completion / 1e6)
                    return choices[0].message.content or "", choices[0].finish_reason
                last = "the response has no choices"
            if attempt < cfg.max_retries:
                time.sleep(backoff_delay(attempt, cfg.backoff_base_s, cfg.backoff_max_s, self._rng.random(),
                                         retry_after))
        raise InfrastructureError(f"{cfg.base_url} model {cfg.model!r}: {cfg.max_retries + 1} attempt(s) failed; "
                                  f"last: {last}", attempts=cfg.max_retries + 1, timed_out=timed_out)

    # -- the Provider interface -----------------------------------------------------------------------
    def messages(self, stage: str, payload: Mapping[str, Any], response_model: type[BaseModel]) -> list[dict[str, str]]:
        """The chat a stage sends (exposed for tests and for inspection)."""
        system = STAGE_INSTRUCTIONS.get(stage, f"You perform the construction stage {stage!r}.")
        schema = json.dumps(response_model.model_json_schema(), ensure_ascii=False, separators=(",", ":"))
        system += ("\nAnswer with exactly one JSON object and nothing else. It must match this JSON Schema:\n" + schema)
        body = clip_middle(json.dumps(payload, ensure_ascii=False, default=str, separators=(",", ":")),
                     self.config.max_payload_chars)
        return [{"role": "system", "content": system}, {"role": "user", "content": body}]

    def _request_body(self, messages: list[dict[str, str]], response_model: type[BaseModel]) -> dict[str, Any]:
        """The keyword arguments of a stage's first request (``extra_body`` as the client's own argument)."""
        cfg = self.config
        kwargs: dict[str, Any] = {"model": cfg.model, "messages": messages, "max_tokens": cfg.max_tokens}
        for key in ("temperature", "top_p", "seed"):
            if getattr(cfg, key) is not None:
                kwargs[key] = getattr(cfg, key)
        if cfg.extra_body:
            kwargs["extra_body"] = dict(cfg.extra_body)
        if cfg.response_format == "json_schema":
            kwargs["response_format"] = {"type": "json_schema", "json_schema": {
                "name": response_model.__name__, "schema": response_model.model_json_schema(), "strict": False}}
        elif cfg.response_format == "json_object":
            kwargs["response_format"] = {"type": "json_object"}
        return kwargs

    def cache_key(self, stage: str, request: Mapping[str, Any]) -> str:
        """sha256 of the canonical JSON of everything sent for a stage that can change its answer: the first
        request's body (``request``, as :meth:`_request_body` builds it) and the follow-ups' parameters."""
        cfg = self.config
        try:
            canonical = json.dumps({"version": CACHE_VERSION, "stage": stage, "request": request,
                                    "repair_rounds": cfg.repair_rounds, "max_tokens_cap": cfg.max_tokens_cap},
                                   sort_keys=True, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ConfigurationError(f"the request of stage {stage!r} is not plain JSON (check extra_body): {e}") from e
        return hashlib.sha256(canonical.encode()).hexdigest()

    def complete(self, stage: str, payload: Mapping[str, Any], response_model: type[T]) -> T:
        """One stage answer, validated by ``response_model`` (see the module docstring)."""
        cfg = self.config
        self._count(stage, calls=1)
        messages = self.messages(stage, payload, response_model)
        kwargs = self._request_body(messages, response_model)
        cpath = Path(cfg.cache_dir) / stage / f"{self.cache_key(stage, kwargs)}.json" if cfg.cache_dir else None
        if cpath is not None and cpath.is_file():
            try:
                out = response_model.model_validate_json(cpath.read_text(encoding="utf-8"))
                self._count(stage, cache_hits=1)
                return out
            except ValidationError:
                pass  # a stale entry (the model changed): ask again and overwrite it
        loop = RepairLoop(messages, response_model, cfg.repair_rounds, repair_prompt=_repair_prompt,
                          max_tokens=cfg.max_tokens, max_tokens_cap=cfg.max_tokens_cap)
        try:
            while loop.pending:
                if loop.rounds:
                    self._count(stage, repairs=1)
                request = {**kwargs, "messages": loop.messages, "max_tokens": loop.max_tokens}
                text, finish = self._request(stage, request)
                out = loop.feed(text, finish)
                if out is None:
                    continue
                if cpath is not None:
                    cpath.parent.mkdir(parents=True, exist_ok=True)
                    tmp = cpath.with_suffix(f".{os.getpid()}.tmp")
                    tmp.write_text(out.model_dump_json(), encoding="utf-8")
                    os.replace(tmp, cpath)
                return out
        except (InfrastructureError, ConfigurationError):
            self._count(stage, failures=1)
            raise
        self._count(stage, failures=1)
        raise ModelOutputError(f"stage {stage!r}: no valid {response_model.__name__} after {loop.rounds} request(s): "
                               f"{loop.reason}; last reply: {(loop.text or '')[:300]!r}", text=loop.text,
                               rounds=loop.rounds)


def _repair_prompt(reason: str) -> str:
    return (f"Your previous reply could not be used: {reason}. Reply again with exactly one JSON object matching "
            "the schema, nothing else.")
