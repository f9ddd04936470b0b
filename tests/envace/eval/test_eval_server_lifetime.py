"""A model server launched for ``--checkpoint`` never outlives its evaluation, and envace's ``transformers
serve`` entry point answers a malformed tool call with text instead of HTTP 500.

The lifetime tests use a stand-in server (a stdlib HTTP server that answers ``GET /v1/models``) in place
of vLLM / transformers, and kill the evaluating process the two ways a scheduler does: SIGTERM and SIGKILL.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

FAKE_SERVER = textwrap.dedent(
    """
    import json, os, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    open(sys.argv[2], "w").write(str(os.getpid()))
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a): pass
        def do_GET(self):
            raw = json.dumps({"data": [{"id": "ckpt"}]}).encode()
            self.send_response(200); self.send_header("Content-Length", str(len(raw))); self.end_headers()
            self.wfile.write(raw)
    HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
    """
)

EVALUATOR = textwrap.dedent(
    """
    import contextlib, sys, time
    from envace.eval import server
    fake, pidfile, ckpt = sys.argv[1:4]
    server.server_command = lambda kind, checkpoint, host, port, extra=(): [sys.executable, fake, str(port), pidfile]
    with getattr(server, "terminate_on_sigterm", contextlib.nullcontext)():  # what `python -m envace.eval` does
        with server.launch_server(ckpt, "transformers", startup_timeout=120, log_path=ckpt + "/server.log"):
            print("ready", flush=True)
            time.sleep(600)
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purpose
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_the_server_dies_with_the_evaluation(tmp_path, sig):
    """Old behaviour: the server ran in its own session and the clean-up ran only on a normal exit or Ctrl-C;
    SIGTERM or SIGKILL of the evaluation left it running (holding its GPUs) forever."""
    fake = tmp_path / "fake_server.py"
    fake.write_text(FAKE_SERVER)
    pidfile = tmp_path / "server.pid"
    evaluator = subprocess.Popen([sys.executable, "-c", EVALUATOR, str(fake), str(pidfile), str(tmp_path)],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    server_pid = None
    try:
        assert evaluator.stdout.readline().strip() == "ready", evaluator.stdout.read()
        server_pid = int(pidfile.read_text())
        assert _alive(server_pid)
        evaluator.send_signal(sig)
        evaluator.wait(timeout=60)
        deadline = time.monotonic() + 30
        while _alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(server_pid), f"the model server outlived its evaluation ({sig.name})"
    finally:
        if evaluator.poll() is None:
            evaluator.kill()
        if server_pid is not None and _alive(server_pid):
            os.kill(server_pid, signal.SIGKILL)


def _serve_and_stop(tmp_path, monkeypatch, script: str) -> tuple[int, int, float]:
    """Launch ``script`` as the server through :func:`launch_server`, leave the block at once; return the
    server's pid, the process group's id and the seconds the shutdown took."""
    from envace.eval import server

    fake = tmp_path / "fake_server.py"
    fake.write_text(script)
    pidfile = tmp_path / "server.pid"
    monkeypatch.setattr(server, "server_command",
                        lambda kind, checkpoint, host, port, extra=(): [sys.executable, str(fake), str(port), str(pidfile)])
    with server.launch_server(str(tmp_path), "transformers", startup_timeout=120) as launched:
        server_pid = int(pidfile.read_text())
        assert _alive(server_pid)
        t0 = time.monotonic()
    return server_pid, launched.pid, time.monotonic() - t0


def test_a_clean_stop_does_not_wait_out_the_grace_period(tmp_path, monkeypatch):
    """Old behaviour: the guard waited for the server inside its SIGTERM handler with ``server.poll()``, which
    always answered None (the main thread's ``server.wait()`` held the waitpid lock), so a server that exited
    at once still kept its group alive for the whole grace period (20 s) before the SIGKILL."""
    from envace.eval.server import _group_alive

    monkeypatch.delenv("ENVACE_SERVER_GRACE_S", raising=False)  # the default: 20 s
    server_pid, pgid, took = _serve_and_stop(tmp_path, monkeypatch, FAKE_SERVER)
    assert not _alive(server_pid) and not _group_alive(pgid)
    assert took < 10.0, f"stopping a server that exits on SIGTERM took {took:.1f}s (grace period 20 s)"


def test_a_server_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path, monkeypatch):
    from envace.eval.server import _group_alive

    monkeypatch.setenv("ENVACE_SERVER_GRACE_S", "2")
    hung = "import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + FAKE_SERVER
    server_pid, pgid, took = _serve_and_stop(tmp_path, monkeypatch, hung)
    assert not _alive(server_pid) and not _group_alive(pgid)
    assert took >= 1.5, f"the server was killed after {took:.1f}s, before its 2 s grace period"


def test_transformers_serve_returns_text_for_a_malformed_tool_call():
    """Stock ``transformers serve`` lets the tool-call parser's exception escape (HTTP 500: an infrastructure
    error, retried forever); envace's entry point returns no structured calls, so the raw block stays in the
    text and envace's parser reports the malformed call to the model."""
    from transformers.cli.serving import chat_completion

    from envace.eval import tfserve
    from envace.eval.server import server_command

    class Processor:
        def parse_response(self, ids, schema):
            return json.loads('{"name": "cd", bad}')  # what parse_response does with an invalid block

    from transformers.cli.serving import response

    stock, stock_response = chat_completion.parse_tool_calls, response.parse_tool_calls
    with pytest.raises(json.JSONDecodeError):
        stock(Processor(), [1, 2], {})
    try:
        tfserve.install()
        wrapped = chat_completion.parse_tool_calls
        assert wrapped(Processor(), [1, 2], {}) is None
        assert response.parse_tool_calls(Processor(), [1, 2], {}) is None
        tfserve.install()  # idempotent: not wrapped twice
        assert chat_completion.parse_tool_calls is wrapped
    finally:
        chat_completion.parse_tool_calls, response.parse_tool_calls = stock, stock_response
    cmd = server_command("transformers", "/ckpt", "127.0.0.1", 8000)
    assert cmd[1:3] == ["-m", "envace.eval.tfserve"] and "serve" in cmd


def test_vllm_on_cpu_is_served_without_chunked_prefill_and_with_a_bounded_kv_cache(monkeypatch):
    """vLLM 0.29's CPU runner cannot rewind a seeded request's generator after a split prefill (the pinned line
    below raises "CPU Generator does not use offset" and kills the engine), and the evaluation seeds every request:
    on a machine without CUDA ``vllm serve`` gets ``--no-enable-chunked-prefill`` and a 1 GiB KV cache unless the
    user chose."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    import inspect

    import torch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from envace.eval.server import server_command

    assert "gen.set_offset(gen.get_offset() - 4)" in inspect.getsource(GPUModelRunner._bookkeeping_sync)
    with pytest.raises(RuntimeError, match="offset"):
        torch.Generator().get_offset()
    cmd = server_command("vllm", "/ckpt", "127.0.0.1", 8000)
    cpu = not torch.cuda.is_available()
    assert cmd.count("--no-enable-chunked-prefill") == cmd.count(f"--kv-cache-memory-bytes={2**30}") == int(cpu)
    chosen = server_command("vllm", "/ckpt", "127.0.0.1", 8000, ["--enable-chunked-prefill",
                                                                "--kv-cache-memory-bytes=5"])
    assert not [a for a in chosen if a.startswith(("--no-enable-chunked", "--kv-cache-memory-bytes=1"))]
    assert chosen[-2:] == ["--enable-chunked-prefill", "--kv-cache-memory-bytes=5"]
