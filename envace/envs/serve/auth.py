"""Bearer-token check for served pools, as a pure ASGI middleware.

It reads ``Authorization: Bearer <token>`` from the scope's headers for both ``http`` and ``websocket`` scopes:
Starlette's ``BaseHTTPMiddleware`` sees only HTTP requests, so it would leave OpenEnv's ``/ws`` sessions open.
A request without the token is answered 401; a WebSocket handshake without it is closed with code 1008 (policy
violation) before it is accepted, which the client sees as a refused handshake (HTTP 403). Lifespan events pass
through untouched.
"""

from __future__ import annotations

import hmac
from typing import Any

from envace.envs.serve.wire import header

__all__ = ["BearerAuth"]

Scope = dict[str, Any]


class BearerAuth:
    """Wrap ``app``: only requests carrying ``Authorization: Bearer <token>`` reach it."""

    def __init__(self, app: Any, token: str) -> None:
        if not token:
            raise ValueError("BearerAuth needs a non-empty token")
        self.app = app
        self._expected = f"Bearer {token}".encode()

    def _authorized(self, scope: Scope) -> bool:
        given = header(scope, b"authorization")
        return given is not None and hmac.compare_digest(given.encode("latin-1"), self._expected)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or self._authorized(scope):
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                                    (b"www-authenticate", b'Bearer realm="envace"')]})
            await send({"type": "http.response.body", "body": b"unauthorized: a bearer token is required\n"})
        else:
            await receive()  # websocket.connect
            await send({"type": "websocket.close", "code": 1008, "reason": "unauthorized"})
