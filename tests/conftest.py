"""Fixtures of every test package: a real, scriptable OpenAI-compatible HTTP server (stdlib ``http.server`` in a
thread, 127.0.0.1), its reply builders (``replies``) and a URL nobody listens on (``dead_url``). Stdlib only, so the
trace2env and envsched tests use it without importing envace.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest


@dataclass
class Reply:
    status: int = 200
    payload: Any = None  # dict -> JSON body; str -> raw body
    delay: float = 0.0
    headers: dict[str, str] | None = None


def chat(text: str | None, finish_reason: str = "stop", model: str = "judge", prompt_tokens: int = 10,
         completion_tokens: int = 5) -> Reply:
    """A 200 chat.completion whose message content is ``text``."""
    return Reply(
        200,
        {
            "id": "chatcmpl-test",
            "object": "chat.completion",
            "created": 0,
            "model": model,
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}
            ],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
        },
    )


def error(status: int, message: str = "boom", headers: dict[str, str] | None = None) -> Reply:
    return Reply(status, {"error": {"message": message, "type": "error", "code": status}}, headers=headers)


def verdict(answer: bool, reasoning: str = "because") -> Reply:
    return chat(json.dumps({"reasoning": reasoning, "answer": answer}))


Responder = Callable[[dict[str, Any], int], Reply]


def script(*replies: Reply) -> Responder:
    """Answer the n-th request with ``replies[n]`` (the last one repeats)."""
    return lambda body, n: replies[min(n, len(replies) - 1)]


class FakeOpenAI:
    def __init__(self, responder: Responder) -> None:
        self.responder = responder
        self.models: list[str] = []  # what GET /v1/models lists (empty: no model check possible)
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                if self.path != "/v1/models":
                    status, payload = 404, {"error": {"message": f"no route {self.path}"}}
                else:
                    status, payload = 200, {"object": "list", "data": [
                        {"id": m, "object": "model", "created": 0, "owned_by": "test"} for m in fake.models]}
                raw = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                with fake._lock:
                    n = len(fake.bodies)
                    fake.bodies.append(body)
                    fake.headers.append({k.lower(): v for k, v in self.headers.items()})
                    fake.in_flight += 1
                    fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
                try:
                    if self.path != "/v1/chat/completions":
                        reply = error(404, f"no route {self.path}")
                    else:
                        reply = fake.responder(body, n)
                    if reply.delay:
                        time.sleep(reply.delay)
                    data = reply.payload if isinstance(reply.payload, str) else json.dumps(reply.payload)
                    raw = data.encode()
                    self.send_response(reply.status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(raw)))
                    for k, v in (reply.headers or {}).items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(raw)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout test)
                finally:
                    with fake._lock:
                        fake.in_flight -= 1

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    @property
    def n_requests(self) -> int:
        return len(self.bodies)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake_openai() -> Iterator[Callable[[Responder], FakeOpenAI]]:
    servers: list[FakeOpenAI] = []

    def start(responder: Responder) -> FakeOpenAI:
        server = FakeOpenAI(responder)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


@pytest.fixture
def dead_url() -> str:
    """A base URL on which nothing listens (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


class _Replies:
    """Reply builders for the tests (``tests/`` is not a package, so they come as a fixture)."""

    Reply = Reply
    chat = staticmethod(chat)
    error = staticmethod(error)
    verdict = staticmethod(verdict)
    script = staticmethod(script)


@pytest.fixture
def replies() -> type[_Replies]:
    return _Replies

