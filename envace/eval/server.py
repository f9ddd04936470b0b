"""Launch an OpenAI-compatible server for a checkpoint, wait until it serves, shut it down.

* ``vllm``: ``vllm serve CKPT --enable-auto-tool-choice --tool-call-parser hermes`` (GPU nodes).
* ``transformers``: ``transformers serve CKPT`` (CPU or small GPUs). In transformers 5.10 it serves
  ``/v1/chat/completions``, renders ``tools`` with the model's chat template and, for model types
  qwen2/qwen3/..., parses ``<tool_call>{json}</tool_call>`` into ``tool_calls`` (the raw blocks also
  stay in ``content``; :mod:`envace.eval.client` handles both). A block with invalid JSON makes the
  server fail the request (HTTP 500) instead of returning the text.

The server runs in its own process group on 127.0.0.1 with a free port; its output goes to a log file
whose tail is shown if it fails to start.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LaunchedServer", "ServerLaunchError", "free_port", "launch_server", "wait_for_models"]

SERVER_KINDS = ("vllm", "transformers")


class ServerLaunchError(RuntimeError):
    """The model server could not be started (not installed, crashed, or never became ready)."""


@dataclass(frozen=True)
class LaunchedServer:
    base_url: str  # ".../v1"
    model: str  # the model name to send in requests
    pid: int
    log_path: Path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def server_command(kind: str, checkpoint: str, host: str, port: int, extra: Sequence[str] = ()) -> list[str]:
    """The command line that serves ``checkpoint`` (raises :class:`ServerLaunchError` if the server
    software is missing)."""
    if kind == "vllm":
        exe = shutil.which("vllm") or (shutil.which("vllm", path=str(Path(sys.executable).parent)))
        if exe is None and importlib.util.find_spec("vllm") is None:
            raise ServerLaunchError(
                "--server vllm needs vLLM, which is not installed in this environment (GPU nodes: "
                "`pip install -e .[gpu]`). On a CPU machine use --server transformers, or point "
                "--base-url at a running OpenAI-compatible server."
            )
        prefix = [exe] if exe else [sys.executable, "-m", "vllm.entrypoints.cli.main"]
        return [
            *prefix, "serve", checkpoint,
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--host", host, "--port", str(port), "--served-model-name", checkpoint,
            *extra,
        ]  # fmt: skip
    if kind == "transformers":
        if importlib.util.find_spec("fastapi") is None or importlib.util.find_spec("uvicorn") is None:
            raise ServerLaunchError(
                "--server transformers needs fastapi and uvicorn (pip install 'transformers[serving]')"
            )
        return [
            sys.executable, "-m", "transformers.cli.transformers", "serve", checkpoint,
            "--host", host, "--port", str(port), "--log-level", "warning",
            *extra,
        ]  # fmt: skip
    raise ServerLaunchError(f"unknown server kind {kind!r}; choose from {SERVER_KINDS}")


def wait_for_models(base_url: str, *, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> list[str]:
    """Poll ``GET {base_url}/models`` until it answers 200; return the model ids."""
    deadline = time.monotonic() + timeout
    url = base_url.rstrip("/") + "/models"
    last: str = "no answer yet"
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ServerLaunchError(f"server exited with code {proc.returncode} before serving {url}")
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status == 200:
                    data = json.loads(resp.read() or b"{}")
                    return [m.get("id", "") for m in data.get("data", [])]
                last = f"HTTP {resp.status}"
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
            last = str(exc)
        time.sleep(1.0)
    raise ServerLaunchError(f"server did not serve {url} within {timeout:.0f}s (last: {last})")


def _transformers_serve_env(env: dict[str, str], scratch: Path | None) -> dict[str, str]:
    """``transformers serve`` answers ``GET /v1/models`` by scanning the Hugging Face hub cache and
    fails with HTTP 500 when that directory does not exist (fresh machines, CI). Point it at an
    empty directory in that case; serving a local checkpoint never touches the cache."""
    try:
        from huggingface_hub import constants

        cache = Path(env.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE)
    except ImportError:  # pragma: no cover - transformers depends on huggingface_hub
        return {}
    if cache.is_dir():
        return {}
    import tempfile

    empty = Path(tempfile.mkdtemp(prefix="hf-hub-cache-", dir=str(scratch) if scratch else None))
    return {"HF_HUB_CACHE": str(empty)}


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


@contextlib.contextmanager
def launch_server(
    checkpoint: str,
    kind: str = "vllm",
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    startup_timeout: float = 900.0,
    extra_args: Sequence[str] = (),
    log_path: str | os.PathLike[str] | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[LaunchedServer]:
    """Serve ``checkpoint`` for the duration of the ``with`` block."""
    if not Path(checkpoint).exists():
        raise ServerLaunchError(f"checkpoint {checkpoint} does not exist")
    port = port or free_port(host)
    cmd = server_command(kind, checkpoint, host, port, extra_args)
    log = Path(log_path) if log_path else Path(os.devnull)
    if log_path:
        log.parent.mkdir(parents=True, exist_ok=True)
    proc_env = {**os.environ, **(env or {})}
    if kind == "transformers":
        proc_env.update(_transformers_serve_env(proc_env, log.parent if log_path else None))
    with open(log, "ab") as log_fh:
        proc = subprocess.Popen(cmd, stdout=log_fh, stderr=subprocess.STDOUT, start_new_session=True, env=proc_env)
    base_url = f"http://{host}:{port}/v1"
    try:
        try:
            wait_for_models(base_url, timeout=startup_timeout, proc=proc)
        except ServerLaunchError as exc:
            raise ServerLaunchError(f"{exc}\ncommand: {' '.join(cmd)}\nlog tail ({log}):\n{_tail(log)}") from None
        yield LaunchedServer(base_url=base_url, model=checkpoint, pid=proc.pid, log_path=log)
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen[bytes], grace: float = 20.0) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=grace)
