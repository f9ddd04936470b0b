"""Serve any envace pool to other frameworks: as an OpenEnv server or as an MCP server (``python -m envace.envs
serve``).

One connection's session is one :class:`~envace.envs.base.Episode`: an OpenEnv WebSocket session
(:mod:`envace.envs.serve.openenv_app`) or an MCP streamable-HTTP session (:mod:`envace.envs.serve.mcp_app`). Both
protocols offer the same operations: start a task, run a tool call, end the agent's turn (the next user message),
run the pool's official verifier, and *replay*: the served pool's own ``pool.replay(task_id, turns)``, because a
pool's replay may close each turn with a reply of its own (the synthetic pool answers with the turn's
observations, τ² ends the conversation as its gold replay does), which a client ending turns with ``""`` cannot
reproduce.

This module binds the socket and runs an app under uvicorn (:func:`serve`, :func:`make_server`) behind the
bearer-token check of :mod:`envace.envs.serve.auth`; :mod:`envace.envs.serve.wire` holds the JSON forms both apps
share (verdicts, task specs, action lists), re-exported here. The SDKs (openenv, mcp, uvicorn) are imported inside
the functions that need them.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable
from typing import Any

from envace.envs.base import EnvironmentPool
from envace.envs.serve.wire import gold_turns, jsonable, parse_turns, task_dict, verdict_dict

__all__ = [
    "DEFAULT_MAX_SESSIONS",
    "DEFAULT_SESSION_TIMEOUT_S",
    "PROTOCOLS",
    "bind_socket",
    "build_app",
    "gold_turns",
    "is_loopback",
    "jsonable",
    "make_server",
    "parse_turns",
    "serve",
    "task_dict",
    "verdict_dict",
]

PROTOCOLS = ("openenv", "mcp")
DEFAULT_MAX_SESSIONS = 256
DEFAULT_SESSION_TIMEOUT_S = 1800.0  # the MCP SDK's own idle default (30 minutes)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only (binding anywhere else without a token is warned)."""
    return host in ("localhost", "::1") or host.startswith("127.")


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``port`` 0: a free one). Bound before the server starts, so that a
    port in use is the caller's one-line error rather than a server's failed start. Raises ``OSError``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def build_app(pool: EnvironmentPool, protocol: str, *, host: str = "127.0.0.1", token: str | None = None,
              max_sessions: int = DEFAULT_MAX_SESSIONS,
              session_timeout_s: float = DEFAULT_SESSION_TIMEOUT_S) -> Any:
    """The ASGI app serving ``pool`` over ``protocol`` (``"openenv"`` or ``"mcp"``), behind the bearer check when
    ``token`` is given."""
    if protocol == "openenv":
        from envace.envs.serve.openenv_app import create_pool_app
    elif protocol == "mcp":
        from envace.envs.serve.mcp_app import create_pool_app
    else:
        raise ValueError(f"unknown protocol {protocol!r}; expected one of {list(PROTOCOLS)}")
    app = create_pool_app(pool, host=host, max_sessions=max_sessions, session_timeout_s=session_timeout_s)
    if token:
        from envace.envs.serve.auth import BearerAuth

        app = BearerAuth(app, token)
    return app


def url_of(sock: socket.socket, protocol: str) -> str:
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}" + ("/mcp" if protocol == "mcp" else "")


def make_server(pool: EnvironmentPool, protocol: str, sock: socket.socket, *, token: str | None = None,
                max_sessions: int = DEFAULT_MAX_SESSIONS, session_timeout_s: float = DEFAULT_SESSION_TIMEOUT_S,
                on_ready: Callable[[str], None] | None = None, log_level: str = "warning") -> Any:
    """A ``uvicorn.Server`` for ``pool`` on the bound ``sock``: run it with ``.run(sockets=[sock])`` (stop it with
    ``should_exit = True``). ``on_ready(url)`` is called once the app has started (default: print one line with
    the URL)."""
    import uvicorn

    app = build_app(pool, protocol, host=sock.getsockname()[0], token=token, max_sessions=max_sessions,
                    session_timeout_s=session_timeout_s)
    url = url_of(sock, protocol)
    ready = on_ready or (lambda u: print(f"serving {pool.name} over {protocol} at {u}", flush=True))

    class _Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if not self.should_exit:
                ready(url)

    return _Server(uvicorn.Config(app, log_level=log_level, lifespan="on"))


def serve(pool: EnvironmentPool, protocol: str, sock: socket.socket, **kwargs: Any) -> None:
    """Serve ``pool`` on ``sock`` until the process is told to stop (SIGINT/SIGTERM), then close the pool.
    ``kwargs``: those of :func:`make_server`."""
    try:
        make_server(pool, protocol, sock, **kwargs).run(sockets=[sock])
    finally:
        pool.close()


def warn(message: str) -> None:
    print(f"python -m envace.envs: warning: {message}", file=sys.stderr, flush=True)
