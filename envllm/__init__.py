"""envllm: the LLM-client core that envace, trace2env and envsched share.

One endpoint config and one error taxonomy for every client of an OpenAI-compatible chat endpoint in the project:

* :mod:`envllm.endpoint` — :class:`EndpointConfig`, where and how to call a model (base URLs, model, key, time-out,
  retries, sampling), with one spelling per key (:meth:`EndpointConfig.from_mapping`);
* :mod:`envllm.core` — the error taxonomy (:class:`LLMError`: :class:`InfrastructureError`,
  :class:`ConfigurationError`, :class:`ModelOutputError`, :class:`JudgeFormatError`), the HTTP status
  classification and backoff, reading a model's reply (:func:`extract_json_object`, :func:`validation_reason`)
  and :class:`RepairLoop`, the bounded repair of one structured call.

Its users: envace's judge and simulator pool (``envace.rewards.llm``), evaluation client (``envace.agents.client``),
typed config (``envace.config``) and environment pools (``envace.envs``); trace2env's model provider
(``trace2env.llm``, ``trace2env.providers``) and judge; envsched's LLM operation extractor
(``envsched.config.LLMExtractorConfig``). Each client sends its requests its own way; what a failure means and
how an endpoint is configured is decided here, once.

It imports none of envace, envsched and trace2env — only the standard library and ``pydantic`` — so each of the
three may import it and each stays usable alone (``tests/test_dependency_direction.py``). Its modules form layers
(the same test), lowest first:

1. ``core``, ``endpoint`` — import no other envllm module;
2. ``envllm`` (this package root) — re-exports their public names.
"""

from .core import (
    RETRYABLE_STATUS,
    ConfigurationError,
    InfrastructureError,
    JudgeFormatError,
    LLMError,
    ModelOutputError,
    RepairLoop,
    backoff_delay,
    clip_middle,
    extract_json_object,
    is_context_too_long,
    is_retryable_status,
    not_found_hint,
    retry_after_s,
    short,
    strip_reasoning,
    validation_reason,
)
from .endpoint import RENAMED_KEYS, ROUTINGS, EndpointConfig

__all__ = [
    "RENAMED_KEYS",
    "RETRYABLE_STATUS",
    "ROUTINGS",
    "ConfigurationError",
    "EndpointConfig",
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
