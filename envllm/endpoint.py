"""The one endpoint config: where and how to call a model behind OpenAI-compatible base URLs.

Every client of a chat endpoint in the project takes this dataclass: Trace2Env's model stages
(:class:`trace2env.llm.OpenAIProviderConfig` extends it with the stages' own knobs), envace's async judge and
simulator pool (``envace.rewards.llm.LLMPool``; ``envace.reward.judge`` and ``envace.agent.simulator`` in the
Hydra config), envace's synchronous evaluation client (``envace.agents.client.ChatClient``) and envsched's App. E
operation extractor (:class:`envsched.config.LLMExtractorConfig` extends it). This module imports only the standard
library (no other module of :mod:`envllm`, nor envace, envsched or trace2env).

Keys have one spelling. A mapping built by hand or read from a config goes through
:meth:`EndpointConfig.from_mapping`, which names an unknown key, and for a spelling of an older endpoint config
(``timeout``, ``base_url``) the key that replaced it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = ["RENAMED_KEYS", "ROUTINGS", "EndpointConfig"]

#: keys of the endpoint configs this one replaced, and the key to write instead
RENAMED_KEYS: dict[str, str] = {"timeout": "timeout_s", "base_url": "base_urls"}

#: how a request picks its base URL (:attr:`EndpointConfig.routing`)
ROUTINGS = ("least_busy", "round_robin")


@dataclass
class EndpointConfig:
    """Where and how to call one model behind one or several OpenAI-compatible base URLs."""

    #: older spellings of this config's keys, and the key to write instead (a subclass adds its own)
    renamed_keys: ClassVar[dict[str, str]] = RENAMED_KEYS

    # OpenAI-compatible base URLs, all serving ``model`` (e.g. [http://judge-0:8000/v1]); in Python one string is
    # accepted. Clients that talk to one server (the evaluation client, Trace2Env's stages) use the first
    base_urls: list[str]
    # model name sent with every request (the served name, e.g. "Qwen/Qwen3-30B-A3B-Instruct-2507")
    model: str
    # API key; "EMPTY" for local servers that do not check it
    api_key: str = "EMPTY"
    # name of an environment variable holding the API key; when set and present it wins over ``api_key``
    api_key_env: str | None = None
    # wall-clock limit of one HTTP attempt, seconds (connect + generation)
    timeout_s: float = 120.0
    # retries after an infrastructure error (so at most 1 + max_retries attempts per call)
    max_retries: int = 3
    # first backoff delay, seconds; doubles every retry, times a random jitter factor in [0.5, 1.5)
    backoff_base_s: float = 0.5
    # upper bound of one backoff delay (also caps a server's Retry-After), seconds
    backoff_max_s: float = 30.0
    # most requests in flight over all base URLs together (the async pool's semaphore size)
    concurrency: int = 64
    # sampling temperature (None: the server's default)
    temperature: float | None = 0.0
    # nucleus sampling (None: the server's default)
    top_p: float | None = None
    # completion-token limit per reply (None: the server's default)
    max_tokens: int | None = 2048
    # sampling seed sent with every request (None: none sent)
    seed: int | None = None
    # send response_format={"type": "json_schema", ...} built from the expected reply's pydantic schema (true), or
    # not (false: the async pool sends none, Trace2Env's world model asks for a json_object); null: each client's
    # default (the pool: none; the world model: json_schema)
    use_json_schema: bool | None = None
    # how the async pool picks a base URL: "least_busy" (fewest in flight, ties round-robin) or "round_robin"
    routing: str = "least_busy"
    # seconds a base URL that refused a connection or timed out is skipped while another one is healthy
    unhealthy_cooldown_s: float = 10.0
    # extra JSON merged into every request body (e.g. {"chat_template_kwargs": {"enable_thinking": False}})
    extra_body: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        urls = [self.base_urls] if isinstance(self.base_urls, str) else list(self.base_urls or [])
        self.base_urls = [str(u).rstrip("/") for u in urls]
        name = type(self).__name__
        if not self.base_urls or not all(self.base_urls):
            raise ValueError(f"{name}.base_urls needs at least one non-empty URL")
        if not self.model:
            raise ValueError(f"{name}.model is empty")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.backoff_base_s < 0 or self.backoff_max_s < 0:
            raise ValueError("backoff delays must be >= 0")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 or None, got {self.max_tokens}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {list(ROUTINGS)}, got {self.routing!r}")

    @property
    def base_url(self) -> str:
        """The first base URL (the one server of a single-server client)."""
        return self.base_urls[0]

    def resolved_api_key(self) -> str:
        """The API key: ``$api_key_env`` when that variable is set and non-empty, else ``api_key``."""
        if self.api_key_env:
            value = os.environ.get(self.api_key_env)
            if value:
                return value
        return self.api_key or "EMPTY"

    def with_overrides(self, **changes: Any) -> Any:
        """A copy with the given fields replaced; ``None`` values leave a field as it is."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], where: str = "endpoint") -> Any:
        """The config from a mapping (a config file's section, keyword arguments from a pool's options).

        Raises :class:`ValueError`, one line naming ``where`` and the key, for an unknown key (with the key that
        replaced it for an older spelling) or a missing ``base_urls`` / ``model`` (:meth:`check_keys`).
        """
        if isinstance(data, cls):
            return data
        cls.check_keys(data, where)
        return cls(**dict(data))

    @classmethod
    def check_keys(cls, data: Mapping[str, Any], where: str = "endpoint") -> None:
        """Refuse, naming ``where`` and the key, an unknown key (with the key that replaced it for an older
        spelling, :attr:`renamed_keys`) or a missing ``base_urls`` / ``model``; the values are not checked."""
        names = {f.name for f in dataclasses.fields(cls)}
        for key in data:
            if key in names:
                continue
            renamed = cls.renamed_keys
            hint = f" (renamed {renamed[key]!r})" if key in renamed else f"; keys: {sorted(names)}"
            raise ValueError(f"{where}: unknown endpoint key {key!r}{hint}")
        missing = [k for k in ("base_urls", "model") if not data.get(k)]
        if missing:
            raise ValueError(f"{where}: the endpoint needs {' and '.join(missing)}")
