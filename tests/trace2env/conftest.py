"""Fixtures of the trace2env tests (stdlib only: trace2env tests never import envace)."""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from t2e_fakeopenai import FakeOpenAI, Responder


@pytest.fixture
def fake_openai() -> Iterator[Callable[[Responder], FakeOpenAI]]:
    servers: list[FakeOpenAI] = []

    def start(responder: Responder) -> FakeOpenAI:
        servers.append(FakeOpenAI(responder))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


@pytest.fixture
def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"
