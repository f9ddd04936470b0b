"""The dependency combination the remote pools stand on, which upstream never declared: ``openenv`` 0.10.0 (installed
without its dependencies: it declares ``fastmcp<4`` and pulls in gradio) on ``fastmcp-slim`` 4.2.3 and ``mcp`` 2.3.0.
These tests pin that it imports and serves, that gradio stays out, and that the installed versions are the locks'."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
FIXTURE = Path(__file__).with_name("openenv_fixture.py")
LOCKS = ("cpu.lock", "gpu-cu12.lock", "gpu-cu13.lock")


def pins(path: Path) -> dict[str, str]:
    found = (re.match(r"^([A-Za-z0-9_.-]+)==(\S+)", line) for line in path.read_text().splitlines())
    return {m.group(1).lower(): m.group(2) for m in found if m}


@pytest.mark.parametrize(("dist", "expected", "files"), [
    ("openenv", "0.10.0", ("no-deps.txt",)),
    ("fastmcp-slim", "4.2.3", LOCKS),
    ("mcp", "2.3.0", LOCKS),
])
def test_the_installed_versions_are_the_locks(dist, expected, files):
    for name in files:
        assert pins(ROOT / "requirements" / name).get(dist) == expected, f"requirements/{name}: {dist}"
    assert version(dist) == expected


def run_python(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_importing_openenv_core_leaves_gradio_out():
    out = run_python("import sys, openenv.core, openenv.core.env_server\n"
                     "print('gradio' in sys.modules, 'pandas' in sys.modules)")
    assert out.split() == ["False", "False"]


SERVE = f"""
import sys
sys.path.insert(0, {str(FIXTURE.parent)!r})
from starlette.testclient import TestClient
from openenv_fixture import kv_app, mcp_app

with TestClient(kv_app()) as client:
    assert client.get("/health").status_code == 200
    with client.websocket_connect("/ws") as ws:
        ws.send_json({{"type": "reset", "data": {{"task_id": "kv/t0"}}}})
        print(ws.receive_json()["data"]["observation"]["messages"][-1]["content"])
        ws.send_json({{"type": "step", "data": {{"kind": "call", "name": "put",
                                                "arguments": {{"key": "colour", "value": "blue"}}}}}})
        print(ws.receive_json()["data"]["observation"]["text"])
with TestClient(mcp_app()) as client:
    with client.websocket_connect("/ws") as ws:
        ws.send_json({{"type": "reset", "data": {{"task_id": "kv/t0"}}}})
        ws.receive_json()
        ws.send_json({{"type": "step", "data": {{"type": "list_tools"}}}})
        print(",".join(t["name"] for t in ws.receive_json()["data"]["observation"]["tools"]))
        ws.send_json({{"type": "step", "data": {{"type": "call_tool", "tool_name": "put",
                                                "arguments": {{"key": "k", "value": "v"}}}}}})
        print(ws.receive_json()["data"]["observation"]["result"]["content"][0]["text"])
print("gradio" in sys.modules)
"""


def test_openenv_serves_a_plain_and_an_mcp_environment_on_fastmcp_4():
    """``create_app`` with a plain ``Environment`` and with an ``MCPEnvironment`` (FastMCP 4 tools), one WebSocket
    session each, in a fresh interpreter: the undeclared combination works end to end, still without gradio."""
    assert run_python(SERVE).split("\n")[:5] == ["Store colour=blue.", "stored colour", "put,get,submit",
                                                 "stored k", "False"]


def test_the_private_openenv_methods_the_pool_overrides_are_the_pinned_ones():
    """envace.envs.remote.openenv_pool's client overrides openenv 0.10.0's private ``EnvClient._ensure_connected`` (it
    reconnects a closed socket before every send: a fresh, un-reset server environment) and reads ``_ws.state``.
    Pinned here, version and lines, so an upgrade that moves them fails fast rather than in the kill test."""
    import inspect
    from importlib.metadata import version

    from openenv.core.env_client import EnvClient

    assert version("openenv") == "0.10.0"
    send = inspect.getsource(EnvClient._send)
    assert "await self._ensure_connected()" in send and "self._ws.send(" in send
    assert "await self._connect_async()" in inspect.getsource(EnvClient._ensure_connected)
