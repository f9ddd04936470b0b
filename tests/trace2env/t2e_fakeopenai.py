"""A real OpenAI-compatible HTTP server for tests (stdlib ``http.server`` on 127.0.0.1, in a thread);
``responder(body, n)`` returns ``(status, payload)`` for the n-th ``POST /v1/chat/completions``."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Responder = Callable[[dict[str, Any], int], tuple[int, Any]]


def chat(text: str, finish_reason: str = "stop", prompt_tokens: int = 10, completion_tokens: int = 5) -> tuple[int, Any]:
    return 200, {"id": "x", "object": "chat.completion", "created": 0, "model": "m",
                 "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                              "finish_reason": finish_reason}],
                 "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}}


def http_error(status: int, message: str = "boom") -> tuple[int, Any]:
    return status, {"error": {"message": message, "type": "error", "code": status}}


class FakeOpenAI:
    def __init__(self, responder: Responder) -> None:
        self.bodies: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                with fake._lock:
                    n = len(fake.bodies)
                    fake.bodies.append(body)
                status, payload = (responder(body, n) if self.path == "/v1/chat/completions"
                                   else http_error(404, f"no route {self.path}"))
                raw = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


