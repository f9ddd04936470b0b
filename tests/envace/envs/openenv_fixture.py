"""OpenEnv servers for the ``openenv`` pool's tests, served by the ``openenv`` package's own server code
(``create_app`` under uvicorn) in a subprocess: ``python tests/envace/envs/openenv_fixture.py --port P [--mcp]
[--token T]``.

* The default app is a key-value world that speaks envace's served protocol (what ``python -m envace.envs serve
  --protocol openenv`` exports; a stand-in until that server is in main): reset by ``task_id`` gives the task's
  ``messages`` and ``tools``; step actions are ``{"kind": "call" | "end_turn" | "verify" | "replay", ...}``;
  ``GET /envace/tasks`` and ``GET /envace/gold/{task_id}`` list the tasks and their gold calls. Each call's
  observation also carries a step reward (1.0 once the store equals the task's final target), so the same server
  doubles as a "generic" OpenEnv environment scored from step rewards by a task file.
* ``--mcp`` serves an ``MCPEnvironment`` (FastMCP tools ``put``, ``get``, ``submit``) for the pool's ``action: mcp``
  style: ``submit`` ends the episode with reward 1.0 when the store equals the task's target.
* ``--token T`` wraps the app in a pure ASGI bearer check covering HTTP routes and the ``/ws`` WebSocket (a rejected
  handshake is answered HTTP 403, as uvicorn does for a WebSocket closed before it was accepted).

Every WebSocket session gets its own environment instance (``SUPPORTS_CONCURRENT_SESSIONS``), so concurrent episodes
never share a store.
"""

from __future__ import annotations

import argparse
import time
import uuid
from typing import Any, Literal

#: the tasks: each turn's user message and the store expected once the turn is done
TASKS: dict[str, dict[str, Any]] = {
    "kv/t0": {"split": "train", "category": "store", "turns": [("Store colour=blue.", {"colour": "blue"})]},
    "kv/t1": {"split": "train", "category": "store", "turns": [("Store size=10 and shape=round.",
                                                                {"size": "10", "shape": "round"})]},
    "kv/t2": {"split": "train", "category": "store", "turns": [("Store pet=cat.", {"pet": "cat"})]},
    "kv/t3": {"split": "test", "category": "two_turn", "turns": [("Store a=1.", {"a": "1"}),
                                                                 ("Now delete a and store b=2.", {"b": "2"})]},
}
SYSTEM = "You manage a key-value store through tools."
#: a call name (not among the tools) that the envace-protocol world answers with a malformed observation
MALFORMED = "__malformed__"
#: a hidden call that sleeps ``seconds`` before answering (the client's time-out)
SLOW = "__slow__"


def _fn(name: str, description: str, **props: str) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {k: {"type": t} for k, t in props.items()},
                       "required": list(props)}}}


TOOLS = [_fn("put", "Store value under key.", key="string", value="string"),
         _fn("get", "Read the value of key.", key="string"),
         _fn("delete", "Remove key.", key="string")]


def gold(task_id: str) -> list[list[dict[str, Any]]]:
    """The gold calls of a task, one list per turn."""
    turns, before = [], {}
    for _user, target in TASKS[task_id]["turns"]:
        calls = [{"name": "delete", "arguments": {"key": k}} for k in before if k not in target]
        calls += [{"name": "put", "arguments": {"key": k, "value": v}} for k, v in target.items() if before.get(k) != v]
        turns.append(calls)
        before = target
    return turns


def task_spec(task_id: str) -> dict[str, Any]:
    """The task as the fields of ``envace.envs.base.TaskSpec``."""
    task = TASKS[task_id]
    return {"pool": "kvstore", "task_id": task_id, "env_id": "kv", "category": task["category"],
            "split": task["split"], "system_prompt": SYSTEM, "first_user_message": task["turns"][0][0],
            "tools": TOOLS, "initial_state_summary": "an empty store",
            "verifier_text": "the store equals the last turn's target", "metadata": {}}


class World:
    """One episode's store and turn; what both the envace-protocol env and its server-side replay run on."""

    def __init__(self, task_id: str) -> None:
        if task_id not in TASKS:
            raise ValueError(f"unknown task {task_id!r}")
        self.task_id, self.turn, self.kv = task_id, 0, {}

    @property
    def target(self) -> dict[str, str]:
        return TASKS[self.task_id]["turns"][-1][1]

    def execute(self, name: str, arguments: dict[str, Any]) -> str:
        key = str(arguments.get("key", ""))
        if name == "put":
            self.kv[key] = str(arguments.get("value", ""))
            return f"stored {key}"
        if name == "get":
            return self.kv.get(key, f"Error: no key {key!r}")
        if name == "delete":
            return "deleted" if self.kv.pop(key, None) is not None else f"Error: no key {key!r}"
        if name == SLOW:
            time.sleep(float(arguments.get("seconds", 0)))
            return "slept"
        return f"Error: unknown tool {name!r}"

    def end_turn(self) -> str | None:
        self.turn += 1
        turns = TASKS[self.task_id]["turns"]
        return turns[self.turn][0] if self.turn < len(turns) else None

    def verdict(self) -> dict[str, Any]:
        passed = self.kv == self.target
        return {"reward": float(passed), "passed": passed, "details": {"store": dict(self.kv)}}


def kv_app() -> Any:
    """The envace-protocol key-value world under ``create_app``, plus the task routes."""
    from fastapi import HTTPException
    from openenv.core.env_server import Environment, create_app
    from openenv.core.env_server.types import Action, Observation, State
    from pydantic import Field

    class PoolAction(Action):
        kind: Literal["call", "end_turn", "verify", "replay"] = "call"
        name: str = ""
        arguments: dict[str, Any] = Field(default_factory=dict)
        text: str = ""
        actions: list[list[dict[str, Any]]] = Field(default_factory=list)

    class PoolObservation(Observation):
        text: str | None = ""
        tools: list[dict[str, Any]] = Field(default_factory=list)
        messages: list[dict[str, Any]] = Field(default_factory=list)

    class KVEnv(Environment[PoolAction, PoolObservation, State]):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self) -> None:
            super().__init__()
            self.world: World | None = None
            self._state = State(episode_id=None, step_count=0)

        def reset(self, seed: int | None = None, episode_id: str | None = None, task_id: str | None = None,
                  **kw: Any) -> PoolObservation:
            self.world = World(task_id or "kv/t0")
            self._state = State(episode_id=episode_id or uuid.uuid4().hex, step_count=0)
            spec = task_spec(self.world.task_id)
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": spec["first_user_message"]}]
            return PoolObservation(text="", messages=messages, tools=TOOLS)

        def step(self, action: PoolAction, timeout_s: float | None = None, **kw: Any) -> PoolObservation:
            world = self.world
            if world is None:
                raise RuntimeError("reset first")
            self._state.step_count += 1
            if action.kind == "call":
                if action.name == MALFORMED:  # a protocol violation on purpose: a call observation without text
                    return PoolObservation(text=None, tools=TOOLS)
                text = world.execute(action.name, action.arguments)
                return PoolObservation(text=text, tools=TOOLS, reward=float(world.kv == world.target))
            if action.kind == "end_turn":
                nxt = world.end_turn()
                return PoolObservation(text=nxt, tools=TOOLS, metadata={"ended": nxt is None})
            if action.kind == "replay":
                world = World(world.task_id)
                for turn in action.actions:
                    for call in turn:
                        world.execute(call["name"], call.get("arguments") or {})
                    if world.end_turn() is None:
                        break
            verdict = world.verdict()
            return PoolObservation(done=True, reward=verdict["reward"], metadata={"verdict": verdict})

        @property
        def state(self) -> State:
            kv = dict(self.world.kv) if self.world else {}
            return State(**{**self._state.model_dump(), "kv": kv})

    app = create_app(KVEnv, PoolAction, PoolObservation, env_name="kvstore", max_concurrent_envs=64)

    @app.get("/envace/tasks")
    def tasks(split: str | None = None) -> list[dict[str, Any]]:
        return [task_spec(t) for t in TASKS if split in (None, "all", TASKS[t]["split"])]

    @app.get("/envace/gold/{task_id:path}")
    def gold_route(task_id: str) -> list[list[dict[str, Any]]]:
        if task_id not in TASKS:
            raise HTTPException(status_code=404, detail=f"no gold for {task_id}")
        return gold(task_id)

    return app


def mcp_app() -> Any:
    """An ``MCPEnvironment`` with FastMCP tools under ``create_app``: ``submit`` ends the episode with its reward."""
    from fastmcp import FastMCP
    from openenv.core.env_server import MCPEnvironment, create_app
    from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
    from openenv.core.env_server.types import Observation, State

    class KVMCPEnv(MCPEnvironment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self) -> None:
            mcp = FastMCP("kv")
            self.kv: dict[str, str] = {}
            self.task_id = "kv/t0"

            @mcp.tool
            def put(key: str, value: str) -> str:
                """Store value under key."""
                self.kv[key] = value
                return f"stored {key}"

            @mcp.tool
            def get(key: str) -> str:
                """Read the value of key."""
                return self.kv.get(key, f"Error: no key {key!r}")

            @mcp.tool
            def submit() -> str:
                """Finish the task."""
                return "submitted"

            super().__init__(mcp)
            self._state = State(episode_id=None, step_count=0)

        def reset(self, seed: int | None = None, episode_id: str | None = None, task_id: str | None = None,
                  **kw: Any) -> Observation:
            self.kv, self.task_id = {}, task_id or "kv/t0"
            self._state = State(episode_id=episode_id or uuid.uuid4().hex, step_count=0)
            return Observation(done=False, reward=None, metadata={"task_id": self.task_id})

        async def step_async(self, action: Any, timeout_s: float | None = None, **kw: Any) -> Observation:
            obs = await super().step_async(action, timeout_s=timeout_s, **kw)
            if isinstance(action, CallToolAction) and action.tool_name == "submit":
                obs.done, obs.reward = True, float(self.kv == TASKS[self.task_id]["turns"][-1][1])
            return obs

        def _step_impl(self, action: Any, timeout_s: float | None = None, **kw: Any) -> Observation:
            return Observation(done=False, reward=None, metadata={"error": f"unknown action {type(action).__name__}"})

        @property
        def state(self) -> State:
            return State(**{**self._state.model_dump(), "kv": dict(self.kv)})

    return create_app(KVMCPEnv, CallToolAction, CallToolObservation, env_name="kvmcp", max_concurrent_envs=64)


def with_token(app: Any, token: str) -> Any:
    """``app`` behind a bearer-token check for HTTP and WebSocket scopes (401 / a refused handshake)."""
    expected = f"Bearer {token}".encode()

    async def guarded(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket") and dict(scope["headers"]).get(b"authorization") != expected:
            if scope["type"] == "http":
                await send({"type": "http.response.start", "status": 401, "headers": [(b"content-type", b"text/plain")]})
                await send({"type": "http.response.body", "body": b"unauthorized"})
            else:
                await receive()
                await send({"type": "websocket.close", "code": 1008})
            return
        await app(scope, receive, send)

    return guarded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--mcp", action="store_true", help="serve the MCPEnvironment instead of the KV world")
    parser.add_argument("--token", default=None, help="require 'Authorization: Bearer TOKEN'")
    args = parser.parse_args()
    import uvicorn

    app = mcp_app() if args.mcp else kv_app()
    if args.token:
        app = with_token(app, args.token)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
