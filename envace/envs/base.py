"""The environment protocol every task pool implements.

A *pool* holds the tasks of one benchmark (BFCL multi-turn, τ²-bench, ...). Starting a task
gives an :class:`Episode`: private, mutable state that nothing else shares, so the K rollouts
of a GRPO group each get their own (``Episode.fork`` copies a live one cheaply). An episode

* exposes the task's tools in OpenAI function-schema form (they may change between user turns,
  e.g. BFCL ``miss_func`` reveals a withheld function later),
* executes tool calls and returns the observation text (bad calls give an error observation,
  never an exception: the model must be able to read its mistake),
* hands out the next user message when the agent ends its turn,
* runs the benchmark's *official* verifier over what happened (:class:`Verdict`).

``EnvironmentPool.replay`` runs a fixed action sequence from the initial state and verifies it:
gold replay, the identifier filter of EnvSched and the CLI all go through it.
"""

from __future__ import annotations

import abc
import asyncio
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "END_TURN",
    "EnvironmentFault",
    "EnvironmentPool",
    "EnvironmentUnavailable",
    "Episode",
    "TaskSpec",
    "ToolCall",
    "ToolCallError",
    "Verdict",
    "available_pools",
    "configuration_needed",
    "flatten_turns",
    "get_pool",
    "register_pool",
    "replay_replying",
    "scrub_surrogates",
    "split_turns",
]


class EnvironmentUnavailable(RuntimeError):
    """The environment could not answer (infrastructure): its server is down, the connection dropped, it answered a
    5xx or it did not answer within its time-out. Raised by remote episodes after their own retries of what is safe
    to retry (never a tool call: it may have had an effect). A rollout that meets it is masked, never scored as the
    model's failure."""


class EnvironmentFault(RuntimeError):
    """The environment broke its protocol (the server's fault, not the model's): a malformed tool result, a
    response that does not validate. The rollout is masked and the fault is named and counted."""


#: name of the marker action separating user turns in a flat action sequence (replays stay multi-turn)
END_TURN = "__end_turn__"


class ToolCallError(ValueError):
    """A tool call that cannot be parsed or does not match any tool."""


_SURROGATE = re.compile("[\ud800-\udfff]")


def scrub_surrogates(value: Any) -> Any:
    """``value`` with every lone UTF-16 surrogate in its strings (keys included) replaced by U+FFFD.

    JSON allows ``"\\ud800"``, and ``json.loads`` turns it into a Python string that cannot be encoded as
    UTF-8: written anywhere (a result file, an HTTP request, a parquet column, the rollout dump) it
    raises ``UnicodeEncodeError``. Model output is scrubbed where it enters envace (tool calls here, chat
    text in the evaluation client), so nothing downstream ever sees one. Returns ``value`` itself when
    there is nothing to replace.
    """
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value) if _SURROGATE.search(value) else value
    if isinstance(value, dict):
        items = [(scrub_surrogates(k), scrub_surrogates(v)) for k, v in value.items()]
        if all(k is k0 and v is v0 for (k, v), (k0, v0) in zip(items, value.items(), strict=True)):
            return value
        return dict(items)
    if isinstance(value, (list, tuple)):
        out = [scrub_surrogates(v) for v in value]
        if all(a is b for a, b in zip(out, value, strict=True)):
            return value
        return type(value)(out) if isinstance(value, tuple) else out
    return value


@dataclass(frozen=True)
class ToolCall:
    """One tool call: ``name`` plus JSON-object ``arguments``.

    Lone surrogates in the name or the arguments (a model's ``"\\ud800"`` escape) are replaced by U+FFFD
    on construction (:func:`scrub_surrogates`).
    """

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    id: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", scrub_surrogates(self.name))
        object.__setattr__(self, "arguments", scrub_surrogates(self.arguments))

    @classmethod
    def from_dict(cls, obj: Any) -> ToolCall:
        """Build from ``{"name": ..., "arguments": {...} | "<json>"}`` (OpenAI or Qwen form).

        Raises :class:`ToolCallError` with the reason for anything else.
        """
        if isinstance(obj, dict) and "function" in obj and isinstance(obj["function"], dict):
            call_id = obj.get("id")
            obj = obj["function"]
        else:
            call_id = obj.get("id") if isinstance(obj, dict) else None
        if not isinstance(obj, dict):
            raise ToolCallError(f"tool call must be a JSON object, got {type(obj).__name__}")
        name = obj.get("name")
        if not isinstance(name, str) or not name:
            raise ToolCallError("tool call has no string 'name'")
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as exc:
                raise ToolCallError(f"arguments of {name!r} are not valid JSON: {exc}") from exc
        if args is None:
            args = {}
        if not isinstance(args, dict):
            raise ToolCallError(f"arguments of {name!r} must be a JSON object, got {type(args).__name__}")
        return cls(name=name, arguments=args, id=call_id)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": self.arguments}


def flatten_turns(turns: Sequence[Sequence[ToolCall]]) -> list[dict[str, Any]]:
    """``[[call, ...], ...]`` → a flat list of ``{"name", "arguments"}`` with END_TURN markers between turns."""
    flat: list[dict[str, Any]] = []
    for t, turn in enumerate(turns):
        if t:
            flat.append({"name": END_TURN, "arguments": {}})
        flat.extend(c.to_dict() for c in turn)
    return flat


def split_turns(actions: Sequence[Mapping[str, Any]]) -> list[list[ToolCall]]:
    """Inverse of :func:`flatten_turns`; malformed actions raise :class:`ToolCallError`."""
    turns: list[list[ToolCall]] = [[]]
    for a in actions:
        if isinstance(a, Mapping) and a.get("name") == END_TURN:
            turns.append([])
        else:
            turns[-1].append(ToolCall.from_dict(dict(a) if isinstance(a, Mapping) else a))
    return turns


@dataclass
class Verdict:
    """Outcome of the official verifier: a reward in [0, 1] plus the checker's details."""

    reward: float
    passed: bool
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TaskSpec:
    """Static description of one environment–task pair."""

    pool: str  # pool name, e.g. "bfcl_multi_turn"
    task_id: str  # unique within the pool
    env_id: str  # environment identity (BFCL: sorted involved classes; τ²: domain)
    category: str  # benchmark category / domain (the paper's table columns)
    split: str  # "train" | "test" | "all"
    system_prompt: str | None  # domain policy etc.; None when the benchmark has none
    first_user_message: str
    tools: list[dict[str, Any]]  # OpenAI function schemas visible at the start
    initial_state_summary: str = ""  # short text of the initial state (for EnvSched views)
    verifier_text: str = ""  # what the verifier checks, in words (EnvSched view)
    metadata: dict[str, Any] = field(default_factory=dict)

    def initial_messages(self) -> list[dict[str, Any]]:
        msgs: list[dict[str, Any]] = []
        if self.system_prompt:
            msgs.append({"role": "system", "content": self.system_prompt})
        msgs.append({"role": "user", "content": self.first_user_message})
        return msgs


class Episode(abc.ABC):
    """A live task instance with its own state."""

    spec: TaskSpec

    @abc.abstractmethod
    def tools(self) -> list[dict[str, Any]]:
        """Tools available now (OpenAI function schemas)."""

    @abc.abstractmethod
    def execute(self, call: ToolCall) -> str:
        """Run one tool call against this episode's state and return the observation text."""

    @abc.abstractmethod
    def end_turn(self, assistant_text: str) -> str | None:
        """The agent ended its turn with ``assistant_text``; return the next user message,
        or ``None`` when the episode is over."""

    @abc.abstractmethod
    def verify(self) -> Verdict:
        """Run the benchmark's official verifier over everything this episode did."""

    @abc.abstractmethod
    def fork(self) -> Episode:
        """An independent copy of this episode in its current state."""

    def initial_messages(self) -> list[dict[str, Any]]:
        """The chat messages the agent sees before its first action.

        Defaults to ``spec.initial_messages()``. Episodes whose opening is produced at start time
        (τ²: the agent's greeting answered by the simulated user) override this.
        """
        return self.spec.initial_messages()

    @property
    def done(self) -> bool:
        return False

    #: False for tasks without an executable environment (e.g. checklist-scored dialogues): their tool
    #: calls can only be rehearsed or simulated, and their reward comes from a judge, not ``verify``
    executable: bool = True

    #: True for an episode whose state lives in another process (an MCP or OpenEnv server): its calls are I/O, so the
    #: rollout awaits :meth:`aexecute` / :meth:`averify` instead of holding a worker thread, and the tool bounds'
    #: forked dry run is skipped (a forked copy of a connection would send the call twice, and the server bounds its
    #: own work). Its calls have a time-out of their own and raise :class:`EnvironmentUnavailable` or
    #: :class:`EnvironmentFault` for what is not the model's doing.
    remote: bool = False

    async def aexecute(self, call: ToolCall) -> str:
        """:meth:`execute` for an event loop (default: in a worker thread; remote episodes await their I/O)."""
        return await asyncio.to_thread(self.execute, call)

    async def averify(self) -> Verdict:
        """:meth:`verify` for an event loop (default: in a worker thread)."""
        return await asyncio.to_thread(self.verify)

    def close(self) -> None:
        """Release what the episode holds outside this process (a server session, a server, a workspace); later
        calls are errors. In-process episodes hold nothing: a no-op. Called once the rollout is scored."""

    async def aclose(self) -> None:
        """:meth:`close` for an event loop (default: the in-process no-op, inline; remote episodes await it)."""
        self.close()


class EnvironmentPool(abc.ABC):
    """All tasks of one benchmark."""

    name: str

    @abc.abstractmethod
    def task_ids(self, split: str | None = None) -> list[str]:
        """Task ids, optionally restricted to ``split`` ("train" / "test")."""

    @abc.abstractmethod
    def task(self, task_id: str) -> TaskSpec: ...

    @abc.abstractmethod
    def start(self, task_id: str, **kwargs: Any) -> Episode:
        """A fresh episode in the task's initial state."""

    @abc.abstractmethod
    def gold_actions(self, task_id: str) -> list[list[ToolCall]]:
        """Ground-truth tool calls, one list per user turn."""

    async def astart(self, task_id: str, **kwargs: Any) -> Episode:
        """:meth:`start` for an event loop (default: in a worker thread; remote pools await their connection)."""
        return await asyncio.to_thread(self.start, task_id, **kwargs)

    def replay(self, task_id: str, actions: Sequence[Sequence[ToolCall]]) -> Verdict:
        """Execute ``actions`` (one list per user turn) from the initial state and verify.

        Pools whose verifier needs more than the executed calls (e.g. a closing message)
        override this.
        """
        ep = self.start(task_id)
        try:
            for turn in actions:
                for call in turn:
                    ep.execute(call)
                if ep.end_turn("") is None:
                    break
            return ep.verify()
        finally:
            ep.close()

    def close(self) -> None:
        """Release what the pool holds outside this process (servers it started). In-process pools: a no-op."""

    def tasks(self, split: str | None = None) -> Iterable[TaskSpec]:
        for tid in self.task_ids(split):
            yield self.task(tid)


def replay_replying(episode: Episode, actions: Sequence[Sequence[ToolCall]],
                    replies: Sequence[str] | None = None) -> Verdict:
    """Execute ``actions`` in a started ``episode``, one list per user turn, end turn ``t`` with ``replies[t]`` (by
    default the turn's observations joined by newlines, so that a check of the reply passes iff the turn's calls
    retrieved what was asked), verify, and close the episode: the replay of pools whose verifier reads replies."""
    try:
        for t, turn in enumerate(actions):
            observations = [episode.execute(call) for call in turn]
            reply = replies[t] if replies is not None and t < len(replies) else "\n".join(observations)
            if episode.end_turn(reply) is None:
                break
        return episode.verify()
    finally:
        episode.close()


_POOLS: dict[str, Callable[..., EnvironmentPool]] = {}
#: pools named with an argument, ``PREFIX:ARGUMENT`` (e.g. ``worldbook:DIR``): the factory's keyword for it
_PREFIX_ARG: dict[str, str] = {}


def register_pool(name: str, *, argument: str | None = None
                  ) -> Callable[[Callable[..., EnvironmentPool]], Callable[..., EnvironmentPool]]:
    """Class decorator: make a pool constructible by name through :func:`get_pool`. With ``argument``, the pool is
    also named ``NAME:VALUE``, and ``VALUE`` is passed to the factory as that keyword (``worldbook:DIR``)."""

    def deco(factory: Callable[..., EnvironmentPool]) -> Callable[..., EnvironmentPool]:
        if name in _POOLS and _POOLS[name] is not factory:
            raise ValueError(f"environment pool {name!r} registered twice")
        _POOLS[name] = factory
        if argument:
            _PREFIX_ARG[name] = argument
        return factory

    return deco


def available_pools() -> list[str]:
    _import_builtin_pools()
    return sorted(_POOLS)


def get_pool(name: str, **kwargs: Any) -> EnvironmentPool:
    _import_builtin_pools()
    base, sep, value = name.partition(":")
    if sep and base in _PREFIX_ARG:
        return _POOLS[base](**{_PREFIX_ARG[base]: value}, **kwargs)
    try:
        factory = _POOLS[name]
    except KeyError:
        raise KeyError(f"unknown environment pool {name!r}; available: {sorted(_POOLS)}") from None
    return factory(**kwargs)


def configuration_needed(name: str) -> str | None:
    """What pool ``name`` cannot be built without (its ``NAME:ARG`` argument, or the factory's
    ``NEEDS_CONFIGURATION``: e.g. the servers of a remote pool), in words; None when its defaults build it."""
    _import_builtin_pools()
    if name in _PREFIX_ARG:
        return f"its {_PREFIX_ARG[name]}: {name}:{_PREFIX_ARG[name].upper()}"
    return getattr(_POOLS.get(name), "NEEDS_CONFIGURATION", None)


def chat_model_args(name: str) -> tuple[str, ...]:
    """The constructor arguments of pool ``name`` that take a chat model (e.g. τ²'s simulated user); given as
    endpoint configs they are connected by the caller (:func:`envace.agents.client.connect_endpoints`)."""
    _import_builtin_pools()
    return tuple(getattr(_POOLS.get(name), "CHAT_MODEL_ARGS", ()))


def _import_builtin_pools() -> None:
    # Imported lazily: each pool pulls in its benchmark package.
    import importlib

    for mod in ("envace.envs.bfcl", "envace.envs.tau2", "envace.envs.synthetic", "envace.envs.remote",
                "envace.envs.worldbook_pool", "envace.envs.latency"):
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as exc:  # pool module not written yet / package absent
            if exc.name not in (mod, "bfcl_eval", "tau2"):
                raise
