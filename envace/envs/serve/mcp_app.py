"""An envace pool as an MCP server (streamable HTTP, the MCP SDK's lowlevel ``Server``).

* **One MCP session is one episode.** The session is opened on ``/mcp?task_id=<task id>``; its episode starts at
  the session's first request that needs it and is keyed by the ``mcp-session-id`` header (the SDK's session object
  is not the same object from one request to the next, so it cannot be the key).
* **Tools** are the episode's tools, as they are now (BFCL reveals some only in a later turn). A call runs
  ``episode.execute`` and answers its observation text.
* **Control plane**, listed and callable only in sessions opened with the header ``X-Envace-Control: 1`` (an agent
  connected to the server never sees them): ``__end_turn__(text)`` (``{"text": next user message, "ended"}``),
  ``__verify__()`` and ``__replay__(actions)`` (``{"reward", "passed", "details"}``; replay runs the served pool's
  own ``pool.replay`` for the session's task).
* **Resources**: ``envace://task`` (the TaskSpec as a dict, plus the episode's ``initial_messages``) and
  ``envace://metadata`` (pool name, version, task counts per split, and the pool's ``fidelity`` figures when it
  has them).
* Pool calls block (a verifier, τ²'s environment), so they run in worker threads (``anyio.to_thread``) and one
  slow call does not stall other sessions; one session's calls run one at a time.
* The episode is closed when the client ends the session (``DELETE /mcp``), when the session has been idle for the
  session time-out (the SDK ends the session itself then, and a reaper here closes its episode) and at shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from envace.envs.base import EnvironmentPool, Episode, ToolCall
from envace.envs.serve.wire import header, jsonable, parse_turns, pool_version, task_dict, verdict_dict

__all__ = ["CONTROL_HEADER", "EpisodeRegistry", "create_pool_app"]

#: the request header that opens a session with the control tools (value "1")
CONTROL_HEADER = "x-envace-control"
TASK_URI, METADATA_URI = "envace://task", "envace://metadata"
_ENDED_KEPT = 65536

_ACTIONS_SCHEMA = {
    "type": "array",
    "description": "one list of calls per user turn",
    "items": {"type": "array", "items": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string"}, "arguments": {"type": "object"}}}},
}
CONTROL_TOOLS: dict[str, tuple[str, dict[str, Any]]] = {
    "__end_turn__": ("End the agent's turn with `text`; answers the next user message and whether the episode ended.",
                     {"type": "object", "properties": {"text": {"type": "string"}}}),
    "__verify__": ("Run the benchmark's official verifier over the episode.", {"type": "object", "properties": {}}),
    "__replay__": ("Replay `actions` from the task's initial state through the served pool and verify.",
                   {"type": "object", "properties": {"actions": _ACTIONS_SCHEMA}, "required": ["actions"]}),
}


@dataclass
class _Entry:
    episode: Episode
    task_id: str
    control: bool
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_used: float = field(default_factory=time.monotonic)
    closed: bool = False


class EpisodeRegistry:
    """The live episodes of an MCP server, by session id. Everything runs on the server's event loop."""

    def __init__(self, pool: EnvironmentPool, idle_timeout_s: float | None) -> None:
        self.pool = pool
        self.idle_timeout_s = idle_timeout_s
        self._entries: dict[str, _Entry] = {}
        self._opening: dict[str, asyncio.Lock] = {}
        # sessions whose episode was closed (the most recent ones): a late request is refused, never given a fresh
        # episode that would silently lose the state (the reaper may close one moments before the SDK ends it)
        self._ended: dict[str, None] = {}

    def __len__(self) -> int:
        return len(self._entries)

    async def entry(self, request: Any) -> _Entry:
        """The episode of the request's session, started on its first use."""
        from mcp.shared.exceptions import MCPError
        from mcp.types import INVALID_PARAMS, INVALID_REQUEST

        sid = request.headers.get("mcp-session-id") if request is not None else None
        if not sid:
            raise MCPError(INVALID_REQUEST, "no mcp-session-id: the episode needs a stateful session")
        if sid in self._ended:
            raise MCPError(INVALID_REQUEST, f"session {sid}'s episode has ended; open a new session")
        async with self._opening.setdefault(sid, asyncio.Lock()):
            entry = self._entries.get(sid)
            if entry is None:
                task_id = request.query_params.get("task_id")
                try:
                    if not task_id:
                        raise KeyError(f"open the session on /mcp?task_id=<a task of {self.pool.name}>")
                    episode = await _in_thread(self.pool.start, task_id)
                except BaseException as exc:
                    self._opening.pop(sid, None)
                    if isinstance(exc, KeyError):
                        raise MCPError(INVALID_PARAMS, str(exc.args[0] if exc.args else exc)) from None
                    raise
                control = request.headers.get(CONTROL_HEADER, "") == "1"
                entry = self._entries[sid] = _Entry(episode, task_id, control)
        entry.last_used = time.monotonic()
        return entry

    @contextlib.asynccontextmanager
    async def use(self, entry: _Entry) -> AsyncIterator[Episode]:
        """The entry's episode, for one operation at a time; refused once the episode was closed meanwhile."""
        from mcp.shared.exceptions import MCPError
        from mcp.types import INVALID_REQUEST

        async with entry.lock:
            if entry.closed:
                raise MCPError(INVALID_REQUEST, "this session's episode has ended; open a new session")
            try:
                yield entry.episode
            finally:
                entry.last_used = time.monotonic()

    async def drop(self, sid: str) -> None:
        """Close the session's episode (after its call in flight, if any)."""
        self._opening.pop(sid, None)
        entry = self._entries.pop(sid, None)
        if entry is None:
            return
        self._ended[sid] = None
        if len(self._ended) > _ENDED_KEPT:
            del self._ended[next(iter(self._ended))]
        async with entry.lock:
            entry.closed = True
            await _in_thread(entry.episode.close)

    async def reap_idle(self) -> None:
        """Close the episodes idle for longer than the session time-out, forever (cancelled at shutdown)."""
        if self.idle_timeout_s is None:
            return
        while True:
            await asyncio.sleep(max(0.05, min(30.0, self.idle_timeout_s / 4)))
            cutoff = time.monotonic() - self.idle_timeout_s
            for sid in [s for s, e in self._entries.items() if e.last_used < cutoff and not e.lock.locked()]:
                await self.drop(sid)

    async def close_all(self) -> None:
        for sid in list(self._entries):
            await self.drop(sid)


async def _in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    import anyio

    return await anyio.to_thread.run_sync(fn, *args)


def _text_result(text: str, structured: dict[str, Any] | None = None, *, is_error: bool = False) -> Any:
    import mcp.types as T

    return T.CallToolResult(content=[T.TextContent(type="text", text=text)], structured_content=structured,
                            is_error=is_error)


def _json_result(obj: dict[str, Any]) -> Any:
    return _text_result(json.dumps(obj), obj)


def _mcp_tool(schema: dict[str, Any]) -> Any:
    import mcp.types as T

    fn = schema.get("function", schema)
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return T.Tool(name=fn["name"], description=fn.get("description") or "", input_schema=jsonable(params))


def _control_tools() -> list[Any]:
    import mcp.types as T

    return [T.Tool(name=name, description=desc, input_schema=schema) for name, (desc, schema) in CONTROL_TOOLS.items()]


class _Handlers:
    """The MCP request handlers over one registry."""

    def __init__(self, registry: EpisodeRegistry) -> None:
        self.reg = registry
        self.pool = registry.pool
        self.metadata = pool_metadata(self.pool)  # the catalogue does not change while served

    async def list_tools(self, ctx: Any, params: Any) -> Any:
        import mcp.types as T

        entry = await self.reg.entry(ctx.request)
        async with self.reg.use(entry) as episode:
            tools = [_mcp_tool(t) for t in episode.tools()]
        return T.ListToolsResult(tools=tools + (_control_tools() if entry.control else []))

    async def call_tool(self, ctx: Any, params: Any) -> Any:
        entry = await self.reg.entry(ctx.request)
        args = dict(params.arguments or {})
        async with self.reg.use(entry) as episode:
            if entry.control and params.name in CONTROL_TOOLS:
                return await self._control(entry, episode, params.name, args)
            return _text_result(await _in_thread(episode.execute, ToolCall(params.name, args)))

    async def _control(self, entry: _Entry, episode: Episode, name: str, args: dict[str, Any]) -> Any:
        if name == "__end_turn__":
            nxt = await _in_thread(episode.end_turn, str(args.get("text") or ""))
            return _json_result({"text": nxt or "", "ended": nxt is None})
        if name == "__verify__":
            return _json_result(verdict_dict(await _in_thread(episode.verify)))
        try:
            turns = parse_turns(args.get("actions"))
        except ValueError as exc:
            return _text_result(f"Error: {exc}", is_error=True)
        return _json_result(verdict_dict(await _in_thread(self.pool.replay, entry.task_id, turns)))

    async def list_resources(self, ctx: Any, params: Any) -> Any:
        import mcp.types as T

        return T.ListResourcesResult(resources=[
            T.Resource(uri=TASK_URI, name="task", mime_type="application/json",
                       description="this session's task (TaskSpec) and its initial messages"),
            T.Resource(uri=METADATA_URI, name="metadata", mime_type="application/json",
                       description="the served pool: name, version, task counts"),
        ])

    async def read_resource(self, ctx: Any, params: Any) -> Any:
        import mcp.types as T
        from mcp.shared.exceptions import MCPError

        uri = str(params.uri)
        if uri == TASK_URI:
            entry = await self.reg.entry(ctx.request)
            async with self.reg.use(entry) as episode:
                body = {**task_dict(episode.spec), "initial_messages": jsonable(episode.initial_messages())}
        elif uri == METADATA_URI:
            body = self.metadata
        else:
            raise MCPError(T.INVALID_PARAMS, f"unknown resource {uri!r}; known: {[TASK_URI, METADATA_URI]}")
        return T.ReadResourceResult(contents=[T.TextResourceContents(uri=uri, mime_type="application/json",
                                                                     text=json.dumps(body))])


def pool_metadata(pool: EnvironmentPool) -> dict[str, Any]:
    """Name, version, task counts per split and (worldbook pools) the fidelity figures of the served pool."""
    splits: dict[str, int] = {}
    for spec in pool.tasks():
        splits[spec.split] = splits.get(spec.split, 0) + 1
    out = {"name": f"envace-{pool.name}", "pool": pool.name, "version": pool_version(), "tasks": splits}
    fidelity = getattr(pool, "fidelity", None)
    if fidelity is not None:
        out["fidelity"] = jsonable(fidelity)
    return out


class _EndOnDelete:
    """ASGI wrapper: a ``DELETE`` of a session (the SDK client's ``terminate_on_close``) closes its episode."""

    def __init__(self, app: Any, registry: EpisodeRegistry) -> None:
        self.app, self.registry = app, registry

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)
        if scope["type"] == "http" and scope.get("method") == "DELETE":
            sid = header(scope, b"mcp-session-id")
            if sid:
                await self.registry.drop(sid)


def create_pool_app(pool: EnvironmentPool, *, host: str = "127.0.0.1", max_sessions: int = 256,
                    session_timeout_s: float | None = 1800.0) -> Any:
    """The ASGI app serving ``pool`` over MCP at ``/mcp`` (plus ``GET /health``). ``host`` is the bound address:
    on loopback the SDK's DNS-rebinding protection accepts only loopback ``Host`` headers."""
    from mcp.server.lowlevel import Server
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    registry = EpisodeRegistry(pool, session_timeout_s)
    h = _Handlers(registry)
    server = Server(f"envace-{pool.name}", version=pool_version(),
                    instructions=f"Tools of one {pool.name} task; the session's URL names it (?task_id=...).",
                    on_list_tools=h.list_tools, on_call_tool=h.call_tool,
                    on_list_resources=h.list_resources, on_read_resource=h.read_resource)

    async def health(request: Any) -> Any:
        return JSONResponse({"status": "ok", "pool": pool.name, "episodes": len(registry)})

    app = server.streamable_http_app(session_idle_timeout=session_timeout_s, max_sessions=max_sessions, host=host,
                                     custom_starlette_routes=[Route("/health", health, methods=["GET"])])
    app.router.lifespan_context = _with_reaper(app.router.lifespan_context, registry)
    return _EndOnDelete(app, registry)


def _with_reaper(inner: Callable[[Any], Any], registry: EpisodeRegistry
                 ) -> Callable[[Any], contextlib.AbstractAsyncContextManager[Any]]:
    """The app's lifespan plus the idle reaper, and every episode closed at shutdown."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[Any]:
        async with inner(app) as state:
            reaper = asyncio.create_task(registry.reap_idle())
            try:
                yield state
            finally:
                reaper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reaper
                await registry.close_all()

    return lifespan

