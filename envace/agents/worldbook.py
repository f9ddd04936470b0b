"""The Trace2Env simulator as an observation source (``observation_source=simulator`` with a ``worldbook``).

With ``envace.agent.observation_source=simulator envace.agent.worldbook=PATH`` the agent's tool calls are
answered by a Trace2Env session (:mod:`trace2env.runtime`) over an immutable worldbook built from recorded
traces, instead of by an external LLM writing free text: the deterministic rule fast path first, then a
recorded observation that the applicability gate labels ``supporting`` (same action, same initial state,
same history on its operands), then — when ``envace.agent.simulator`` names an endpoint — the world-model
agent (:class:`trace2env.agent.WorldModelAgent` over :class:`trace2env.llm.OpenAIProvider`). Every step
passes the validation gate; state is kept per rollout in memory.

``PATH`` is one worldbook package (used for every task) or a directory of packages, matched to a task by
``manifest.environment_id == TaskSpec.env_id`` (``scripts/build_worldbook.sh`` builds one per environment).
The session starts from the worldbook's declared defaults with the task's ``initial_state_id``
(:func:`envace.envs.gold_trace.initial_state_id`) as its context.

Reward never comes from the simulator: like the LLM simulator, every call is also executed in the task's
real environment, unseen by the agent (the shadow), and the pool's official verifier scores that replay;
each simulated observation is compared with the real one (:func:`envace.agents.sources.fidelity`,
``Observation.meta["fidelity"]``). That reward is the task's W2R outcome (the actions chosen inside the
simulator, replayed in the real environment); with the same tasks run with ``observation_source=real``
(Real) it gives the paper's Real / W2R / CR columns (:func:`trace2env.consistency.w2r_consistency`; WM
needs a verdict of the simulator itself, which this source does not form). Observation kinds: an accepted
step is ``result`` / ``tool_error`` (by its text); an invalid or unknown action is ``tool_error`` (the
model's mistake); a step the simulator cannot answer (no rule, no supporting evidence, the world model gave
up) is ``simulator_gap`` — the agent reads the error, the count is in ``meta``, and the shadow still
executed the call. A call the shadow could not run (time-out, environment unavailable or at fault) takes the
shadow's kind and ends the rollout, masked, as with the rehearsal source.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from envace.agents.engine import CallContext, Observation, ObservationKind
from envace.agents.sources import RealSource, _answer_kind, fidelity
from envace.envs.base import ToolCall
from envace.envs.gold_trace import initial_state_id
from envllm import EndpointConfig
from trace2env import Session, Worldbook, load_worldbooks
from trace2env.agent import WorldModelAgent
from trace2env.runtime import Proposer

__all__ = ["WorldbookLibrary", "WorldbookSource", "provider_from_endpoint", "world_model_from_endpoint"]

#: error observation types of trace2env that are the agent's own mistake
_AGENT_ERRORS = ("invalid_action", "unknown_action")


class WorldbookLibrary:
    """Loaded, verified worldbooks under one path, by environment id (loaded once per process)."""

    _cache: ClassVar[dict[str, WorldbookLibrary]] = {}
    _lock = threading.Lock()

    def __init__(self, path: str | Path) -> None:
        """All or nothing (:func:`trace2env.load_worldbooks`): a folder with any broken or unexpected entry, or two
        books for one environment, raises :class:`trace2env.WorldbookIntegrityError` naming the entry."""
        root = Path(path)
        if not root.exists():
            raise FileNotFoundError(f"worldbook path {root} does not exist (build one with scripts/build_worldbook.sh)")
        self.path = root
        single, self.by_env = load_worldbooks(root)
        self.single: Worldbook | None = next(iter(self.by_env.values())) if single else None

    @classmethod
    def shared(cls, path: str | Path) -> WorldbookLibrary:
        key = str(Path(path).resolve())
        with cls._lock:
            if key not in cls._cache:
                cls._cache[key] = cls(path)
            return cls._cache[key]

    def for_env(self, env_id: str, pool: str | None = None) -> Worldbook:
        """The book for ``env_id``; with ``pool``, a book built from another pool's traces is refused
        (ValueError): it would simulate another benchmark's world."""
        if self.single is not None:
            wb = self.single
        else:
            try:
                wb = self.by_env[env_id]
            except KeyError:
                raise KeyError(f"no worldbook for environment {env_id!r} under {self.path} "
                               f"(have {len(self.by_env)}: {sorted(self.by_env)[:5]}...)") from None
        if pool is not None and wb.manifest.source_pool is not None and wb.manifest.source_pool != pool:
            raise ValueError(f"{wb.root}: built from traces of pool {wb.manifest.source_pool!r}, not of {pool!r} "
                             f"(environment {env_id!r})")
        return wb


def provider_from_endpoint(endpoint: EndpointConfig | Mapping[str, Any]):
    """A :class:`trace2env.llm.OpenAIProvider` from ``envace.agent.simulator`` (the shared endpoint config).

    The provider talks to the first base URL; ``use_json_schema: false`` selects its ``json_object`` output mode.
    """
    from trace2env.llm import OpenAIProvider, OpenAIProviderConfig

    ep = EndpointConfig.from_mapping(endpoint, "envace.agent.simulator")
    shared = {f.name: getattr(ep, f.name) for f in dataclasses.fields(EndpointConfig)}
    if ep.max_tokens is not None:
        shared["max_tokens"] = int(ep.max_tokens)
    else:
        shared.pop("max_tokens")
    cap = max(int(shared.get("max_tokens", 2048)), 16384)
    fmt = "json_object" if ep.use_json_schema is False else "json_schema"
    return OpenAIProvider(OpenAIProviderConfig(**shared, max_tokens_cap=cap, response_format=fmt))


_AGENTS: dict[str, WorldModelAgent] = {}


def world_model_from_endpoint(endpoint: EndpointConfig | Mapping[str, Any] | None) -> WorldModelAgent | None:
    """One world-model agent per endpoint and process (None without an endpoint: rules and evidence only)."""
    if not endpoint:
        return None
    ep = EndpointConfig.from_mapping(endpoint, "envace.agent.simulator")
    key = json.dumps(dataclasses.asdict(ep), sort_keys=True, default=str)
    if key not in _AGENTS:
        _AGENTS[key] = WorldModelAgent(provider_from_endpoint(ep))
    return _AGENTS[key]


class WorldbookSource:
    """One rollout's Trace2Env session as the engine's observation source (see the module docstring)."""

    name = "simulator"

    def __init__(self, worldbook: Worldbook, *, context: str | None = None, proposer: Proposer | None = None,
                 shadow: RealSource | None = None, min_rule_confidence: float = 0.9) -> None:
        self.session = Session.start(worldbook, proposer=proposer, context=context,
                                     min_rule_confidence=min_rule_confidence)
        self.shadow = shadow
        self.routes: dict[str, int] = {}

    @classmethod
    def for_episode(cls, path: str | Path, episode: Any, *, proposer: Proposer | None = None,
                    shadow: RealSource | None = None) -> WorldbookSource:
        spec = episode.spec
        wb = WorldbookLibrary.shared(path).for_env(spec.env_id, spec.pool)
        return cls(wb, context=initial_state_id(spec), proposer=proposer, shadow=shadow)

    async def observe(self, call: ToolCall, ctx: CallContext) -> Observation:
        res = await asyncio.to_thread(self.session.step, {"name": call.name, "arguments": call.arguments})
        self.routes[res.route] = self.routes.get(res.route, 0) + 1
        meta: dict[str, Any] = {"route": res.route, "rule_id": res.rule_id}
        if res.accepted:
            kind = _answer_kind(res.observation)
        else:
            err_type = json.loads(res.observation).get("type", "")
            kind = ObservationKind.TOOL_ERROR if err_type in _AGENT_ERRORS else ObservationKind.SIMULATOR_GAP
            meta["simulator_error"] = err_type
        obs = Observation(text=res.observation, kind=kind, meta=meta)
        if self.shadow is not None:
            real = await self.shadow.execute(call, ctx)
            obs.real_text, obs.executed = real.text, real.executed
            obs.meta["fidelity"] = fidelity(res.observation, real.text)
            if real.masked:  # the shadow failed (time-out, unavailable, fault): the rollout cannot be scored
                obs.kind, obs.masked, obs.terminate = real.kind, True, True  # named and counted as the shadow's
                obs.meta["reason"] = real.meta.get("reason", "environment time-out")
        return obs
