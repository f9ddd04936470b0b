"""An envace pool as an OpenEnv server: openenv's own ``create_app`` over a :class:`PoolEnv` per WebSocket session.

The wire contract (the ``openenv`` client pool speaks exactly this):

* ``reset(task_id=..., seed=...)`` starts the task: the observation holds ``messages`` (the episode's initial
  messages), ``tools`` and ``text`` ``""``.
* ``step`` actions, by ``kind``:

  - ``{"kind": "call", "name": N, "arguments": {...}}``: ``text`` is the tool's observation, ``tools`` the tools
    available now;
  - ``{"kind": "end_turn", "text": T}``: ``text`` is the next user message; ``metadata.ended`` is true when the
    episode is over (no next message);
  - ``{"kind": "verify"}``: the official verifier: ``reward``, ``done`` true and ``metadata.verdict``
    (``{"reward", "passed", "details"}``);
  - ``{"kind": "replay", "actions": [[{"name", "arguments"}, ...], ...]}``: the served pool's own
    ``pool.replay(task_id, turns)`` for the task of the last reset, answered like ``verify``.

* Extra routes on the same app: ``GET /envace/tasks?split=train|test`` (no split: all) lists the TaskSpecs as
  dicts, ``GET /envace/gold/{task_id}`` the task's gold turns (404 when the pool has none). ``/metadata`` gives
  the name, description and version; openenv's Task API (``/{env_name}/splits``, ``/{env_name}/tasks``, ...)
  answers from the same catalogue.

The pool is shared (read-only) by every session; each session's episode holds its state, so sessions run
concurrently (``SUPPORTS_CONCURRENT_SESSIONS``). openenv runs the synchronous ``reset``/``step`` in a thread per
session and calls ``close`` when the session ends, which closes the episode.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from envace.envs.base import EnvironmentPool, Episode, ToolCall
from envace.envs.serve.wire import gold_turns, jsonable, parse_turns, pool_version, task_dict, verdict_dict

__all__ = ["create_pool_app"]


def create_pool_app(pool: EnvironmentPool, *, host: str = "127.0.0.1", max_sessions: int = 256,
                    session_timeout_s: float | None = None) -> Any:
    """The FastAPI app serving ``pool`` over OpenEnv (``host`` is unused here: OpenEnv has no host check)."""
    from openenv.core.env_server import create_app
    from openenv.core.env_server.types import ConcurrencyConfig

    action_cls, observation_cls, env_cls = _types(pool)
    app = create_app(env_cls, action_cls, observation_cls, env_name=f"envace-{pool.name}",
                     concurrency_config=ConcurrencyConfig(max_concurrent_envs=max_sessions,
                                                          session_timeout=session_timeout_s))
    _add_catalogue_routes(app, pool)
    return app


def _types(pool: EnvironmentPool) -> tuple[type, type, type]:
    """The pydantic action and observation classes and the Environment class bound to ``pool``."""
    from openenv.core.env_server import Environment
    from openenv.core.env_server.types import Action, EnvironmentMetadata, Observation, State
    from pydantic import Field

    description = _description(pool)

    class PoolAction(Action):
        kind: Literal["call", "end_turn", "verify", "replay"] = "call"
        name: str = ""
        arguments: dict[str, Any] = Field(default_factory=dict)
        text: str = ""
        actions: list[list[dict[str, Any]]] = Field(default_factory=list)

    class PoolObservation(Observation):
        text: str = ""
        tools: list[dict[str, Any]] = Field(default_factory=list)
        messages: list[dict[str, Any]] = Field(default_factory=list)

    class PoolEnv(Environment[PoolAction, PoolObservation, State]):
        """One session: at most one live episode of ``pool`` (a new reset closes the previous one)."""

        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self) -> None:
            super().__init__()
            self._episode: Episode | None = None
            self._task_id: str | None = None
            self._state = State(episode_id=None, step_count=0)

        def reset(self, seed: int | None = None, episode_id: str | None = None, task_id: str | None = None,
                  **kwargs: Any) -> PoolObservation:
            if not task_id:
                raise ValueError(f"reset needs a task_id of pool {pool.name!r}")
            self.close()
            self._episode, self._task_id = pool.start(task_id), task_id
            self._state = State(episode_id=episode_id or uuid.uuid4().hex, step_count=0, task_id=task_id, seed=seed)
            return PoolObservation(text="", tools=jsonable(self._episode.tools()),
                                   messages=jsonable(self._episode.initial_messages()),
                                   metadata={"pool": pool.name, "task_id": task_id})

        def step(self, action: PoolAction, timeout_s: float | None = None, **kwargs: Any) -> PoolObservation:
            if self._episode is None:
                raise RuntimeError("no episode: reset(task_id=...) first" if self._task_id is None else
                                   f"the episode of {self._task_id!r} was closed (the session was idle past the "
                                   "server's session time-out); reset(task_id=...) starts it again")
            self._state.step_count += 1
            ep = self._episode
            if action.kind == "call":
                text = ep.execute(ToolCall(action.name, dict(action.arguments)))
                return PoolObservation(text=text, tools=jsonable(ep.tools()))
            if action.kind == "end_turn":
                nxt = ep.end_turn(action.text)
                return PoolObservation(text=nxt or "", tools=jsonable(ep.tools()), metadata={"ended": nxt is None})
            verdict = ep.verify() if action.kind == "verify" else pool.replay(ep.spec.task_id,
                                                                               parse_turns(action.actions))
            v = verdict_dict(verdict)
            return PoolObservation(done=True, reward=v["reward"], metadata={"verdict": v})

        @property
        def state(self) -> State:
            return self._state

        def close(self) -> None:
            ep, self._episode = self._episode, None
            if ep is not None:
                ep.close()

        def get_metadata(self) -> EnvironmentMetadata:
            return EnvironmentMetadata(name=f"envace-{pool.name}", version=pool_version(),
                                       description=description)

        # openenv's Task API (discovery for other frameworks): the pool's catalogue
        def list_splits(self) -> list[str]:
            return sorted({spec.split for spec in pool.tasks()})

        def list_tasks(self, split: str) -> list[dict[str, Any]]:
            return [task_dict(spec) for spec in pool.tasks(split)]

        def num_tasks(self, split: str) -> int:
            return len(pool.task_ids(split))

        def get_task(self, split: str, index: int) -> dict[str, Any]:
            return task_dict(pool.task(pool.task_ids(split)[index]))  # IndexError: openenv answers 400

    return PoolAction, PoolObservation, PoolEnv


def _description(pool: EnvironmentPool) -> str:
    counts: dict[str, int] = {}
    for tid in pool.task_ids():
        split = pool.task(tid).split
        counts[split] = counts.get(split, 0) + 1
    shown = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    text = f"envace pool {pool.name!r} ({shown} tasks): tool calls, user turns and the official verifier"
    return text + _fidelity_text(getattr(pool, "fidelity", None))


def _fidelity_text(fidelity: dict[str, Any] | None) -> str:
    """The worldbook pool's fidelity figures in words (openenv's metadata has no field for them)."""
    if not fidelity:
        return ""
    parts = []
    for env_id, f in sorted(fidelity.items()):
        if not f:
            parts.append(f"{env_id}: no held-out recording")
            continue
        lo, hi = f.get("exact_ci95") or (None, None)
        ci = f" [{_num(lo)}, {_num(hi)}]" if lo is not None else ""
        parts.append(f"{env_id}: exact {_num(f.get('exact'))}{ci}, answered {_num(f.get('answered'))} over "
                     f"{f.get('steps', 0)} steps")
    return "; worldbook fidelity (evidence mode, held-out gold replays): " + "; ".join(parts)


def _num(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, (int, float)) else "n/a"


def _add_catalogue_routes(app: Any, pool: EnvironmentPool) -> None:
    from fastapi import HTTPException

    @app.get("/envace/tasks", tags=["envace"])
    def envace_tasks(split: str | None = None) -> list[dict[str, Any]]:
        try:
            return [task_dict(spec) for spec in pool.tasks(split)]
        except ValueError as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from None

    @app.get("/envace/gold/{task_id:path}", tags=["envace"])
    def envace_gold(task_id: str) -> list[list[dict[str, Any]]]:
        try:
            pool.task(task_id)
        except KeyError as exc:
            raise HTTPException(status_code=404, detail=str(exc.args[0] if exc.args else exc)) from None
        gold = gold_turns(pool, task_id)
        if gold is None:
            raise HTTPException(status_code=404, detail=f"pool {pool.name!r} has no gold actions for {task_id!r}")
        return gold
