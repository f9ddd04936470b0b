"""Launch an OpenAI-compatible server for a checkpoint, wait until it serves, shut it down.

* ``vllm``: ``vllm serve CKPT --enable-auto-tool-choice --tool-call-parser hermes`` (GPU nodes).
* ``transformers``: ``transformers serve CKPT`` (CPU or small GPUs). In transformers 5.10 it serves
  ``/v1/chat/completions``, renders ``tools`` with the model's chat template and, for model types
  qwen2/qwen3/..., parses ``<tool_call>{json}</tool_call>`` into ``tool_calls`` (the raw blocks also
  stay in ``content``; :mod:`envace.agents.client` handles both). Stock ``transformers serve`` fails the
  whole request (HTTP 500, retried as an infrastructure error) when the model writes a block with invalid
  JSON; envace starts it through :mod:`envace.eval.tfserve`, which answers with the text instead, so the
  malformed call is the model's, fed back to it like in training.

The server runs on 127.0.0.1 with a free port, in its own session led by a small guard process; its output
goes to a log file whose tail is shown if it fails to start. The guard reads a pipe whose other end only
the evaluation process holds: when that process ends in any way (SIGTERM, SIGKILL, a crash) the pipe
closes and the guard stops the server's whole process group, so no server outlives its evaluation.
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

__all__ = [
    "LaunchedServer",
    "ServerLaunchError",
    "free_port",
    "launch_server",
    "terminate_on_sigterm",
    "wait_for_models",
]

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
            *_vllm_cpu_args(extra), *extra,
        ]  # fmt: skip
    if kind == "transformers":
        if importlib.util.find_spec("fastapi") is None or importlib.util.find_spec("uvicorn") is None:
            raise ServerLaunchError(
                "--server transformers needs fastapi and uvicorn (pip install 'transformers[serving]')"
            )
        return [
            sys.executable, "-m", "envace.eval.tfserve", "serve", checkpoint,
            "--host", host, "--port", str(port), "--log-level", "warning",
            *extra,
        ]  # fmt: skip
    raise ServerLaunchError(f"unknown server kind {kind!r}; choose from {SERVER_KINDS}")


def _vllm_cpu_args(extra: Sequence[str]) -> list[str]:
    """On a machine without CUDA (vLLM's CPU build), unless ``extra`` (or ``VLLM_CPU_KVCACHE_SPACE``) says otherwise:

    * no chunked prefill: vLLM 0.29's model runner rewinds a seeded request's generator after a partial prefill with
      ``Generator.set_offset``, which CPU generators do not have, so the engine dies on the first seeded request
      whose prompt is longer than ``--max-num-batched-tokens`` (the evaluation seeds every request);
    * a 1 GiB KV cache: without one vLLM reserves ``--gpu-memory-utilization`` (0.9) of the machine's memory and
      refuses to start where less is free.

    Pinned by tests/envace/eval/test_eval_server_lifetime.py."""
    import torch

    if torch.cuda.is_available():
        return []
    args = [] if any("chunked-prefill" in a for a in extra) else ["--no-enable-chunked-prefill"]
    if not any("kv-cache-memory" in a for a in extra) and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        args.append(f"--kv-cache-memory-bytes={2**30}")
    return args


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
    lifeline_r, lifeline_w = os.pipe()  # only this process holds the write end
    os.set_inheritable(lifeline_w, False)
    try:
        with open(log, "ab") as log_fh:
            proc = subprocess.Popen(
                [sys.executable, "-c", _GUARD, *cmd], stdin=lifeline_r, stdout=log_fh, stderr=subprocess.STDOUT,
                start_new_session=True, env=proc_env,
            )
    except BaseException:
        os.close(lifeline_w)
        raise
    finally:
        os.close(lifeline_r)
    base_url = f"http://{host}:{port}/v1"
    try:
        try:
            wait_for_models(base_url, timeout=startup_timeout, proc=proc)
        except ServerLaunchError as exc:
            raise ServerLaunchError(f"{exc}\ncommand: {' '.join(cmd)}\nlog tail ({log}):\n{_tail(log)}") from None
        yield LaunchedServer(base_url=base_url, model=checkpoint, pid=proc.pid, log_path=log)
    finally:
        _stop(proc)
        os.close(lifeline_w)


# The guard (python -c _GUARD CMD...): leader of the server's session; runs CMD as its child in its process
# group; stdin is the lifeline pipe. EOF on it (the evaluation process is gone, however it ended) or a
# SIGTERM stops the whole group: SIGTERM, then SIGKILL once the server has exited or the grace period
# (ENVACE_SERVER_GRACE_S, default 20 s) has passed, whichever comes first; the SIGKILL also ends the guard
# and any process the server left behind. The wait runs in its own thread, never in the signal handler: the
# main thread sits in server.wait(), which holds the Popen's waitpid lock, so a poll() from the handler (or
# from another thread) never sees the exit and a clean stop used to take the whole grace period. The main
# thread's wait sets `exited`; the stopper thread is not a daemon, so the interpreter finishes it before
# exiting. Plain stdlib: starts in milliseconds.
_GUARD = r"""
import os, signal, subprocess, sys, threading
server = subprocess.Popen(sys.argv[1:], stdin=subprocess.DEVNULL)
exited = threading.Event()
stopping = threading.Event()

def stop_group():
    try:
        os.killpg(0, signal.SIGTERM)
    except ProcessLookupError:
        pass
    exited.wait(float(os.environ.get("ENVACE_SERVER_GRACE_S", "20")))
    os.killpg(0, signal.SIGKILL)

def request_stop(*_):
    if not stopping.is_set():
        stopping.set()
        threading.Thread(target=stop_group).start()

def lifeline():
    while os.read(0, 4096):
        pass
    request_stop()

signal.signal(signal.SIGTERM, request_stop)
threading.Thread(target=lifeline, daemon=True).start()
code = server.wait()
exited.set()
sys.exit(code)
"""


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stop(proc: subprocess.Popen[bytes], grace: float = 20.0) -> None:
    """Stop the guard and with it the server's whole process group (SIGTERM, then SIGKILL)."""
    pgid = proc.pid
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while _group_alive(pgid) and time.monotonic() < deadline:
        if proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.2)
        else:
            time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace)


@contextlib.contextmanager
def terminate_on_sigterm() -> Iterator[None]:
    """Within the block, SIGTERM raises ``SystemExit(143)`` in the main thread, so ``finally`` clauses and
    context managers (a launched server's shutdown) run as they do on Ctrl-C. Elsewhere a no-op."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
