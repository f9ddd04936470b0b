"""Hard time and memory bounds on what a tool call makes the environment compute.

A tool call's arguments are the model's. ``power(base=10, exponent=10**9)`` spends minutes inside one
C-level big-integer multiplication that never releases the GIL: a thread with a time-out cannot stop it,
and the event loop of the whole rollout worker (every other rollout of the batch) stalls until it ends.
Only a separate process can be stopped at a deadline.

:func:`run_bounded` runs a function in a ``fork()`` of the calling process — a copy-on-write snapshot
that holds the episode exactly as it is, so no environment needs to be picklable or rebuilt — under a
CPU-time limit (``RLIMIT_CPU``; CPU time, so that a busy machine does not stop an innocent call), a
wall-clock deadline of a few times as long (a call that blocks without computing) and a limit on the memory
the function may allocate. The child reports only how the function ended (returned, raised, hit the memory
limit); its result and its side effects stay in the child, which then exits. The caller kills it at the
deadline.

:class:`envace.agents.sources.RealSource` uses it as a *probe*: a call that finishes within the bounds
in the copy is then executed for real (environments are deterministic given their state, so it
finishes within the bounds again); a call that does not is never executed, and the model reads an error
observation saying which bound it hit. So the episode's state, its replayable action list and the
verifier's replay of the actions only ever contain calls known to be bounded.

Limits: POSIX only (``os.fork``); elsewhere :data:`AVAILABLE` is False and functions run unbounded.
The child closes nothing it inherited and exits with ``os._exit`` (no ``atexit``, no ``finally`` of the
caller's stack); it never uses the parent's sockets.
"""

from __future__ import annotations

import gc
import math
import os
import pickle
import resource
import select
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["AVAILABLE", "BoundExceeded", "Bounds", "ChildFailed", "run_bounded"]

#: whether hard bounds are enforced on this platform
AVAILABLE = hasattr(os, "fork") and sys.platform != "win32"


#: the wall-clock deadline is this many times the time bound (plus a second): the bound itself is CPU time,
#: so a busy machine does not stop an innocent call; the deadline catches calls that block without computing
WALL_CLOCK_FACTOR = 3.0


@dataclass(frozen=True)
class Bounds:
    """Bounds of one bounded run (0 disables a bound)."""

    # CPU seconds the function may compute (whole seconds, rounded up); it is also stopped after
    # WALL_CLOCK_FACTOR times as many wall-clock seconds
    timeout_s: float = 30.0
    # MiB of memory the function may allocate on top of what the process already holds
    memory_mb: int = 2048

    @property
    def active(self) -> bool:
        return self.timeout_s > 0 or self.memory_mb > 0


class BoundExceeded(Exception):
    """The function ran past a bound (``what``: ``time`` or ``memory``) and was stopped."""

    def __init__(self, what: str, limit: str) -> None:
        super().__init__(f"exceeded the {what} limit ({limit}) and was stopped")
        self.what = what
        self.limit = limit


class ChildFailed(Exception):
    """The bounded child died without reporting (a crash in native code, the OOM killer)."""


def _address_space() -> int:
    """Bytes of virtual address space this process maps now (Linux: /proc/self/statm)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[0]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _watch_memory_errors(hits: list[bool]) -> None:
    """Record any MemoryError raised below this point, even one the environment catches and formats
    into an ordinary error text (BFCL: ``Error during execution: ``): hitting the limit is the bound."""

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "exception" and isinstance(arg, tuple) and isinstance(arg[1], MemoryError):
            hits.append(True)
        return local

    def on_call(frame: Any, event: str, arg: Any) -> Any:
        frame.f_trace_lines = False  # exception events only: no per-line cost
        return local

    sys.settrace(on_call)


def _child(fn: Callable[[], Any], bounds: Bounds, write_fd: int) -> None:
    """Body of the forked child; never returns."""
    status: tuple[Any, ...] = ("crash",)
    try:
        gc.disable()  # no finalizer of an inherited object runs here
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        hits: list[bool] = []
        if bounds.timeout_s > 0:  # a fresh child has used no CPU time yet; past the soft limit: SIGXCPU
            _soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
            cpu = max(1, math.ceil(bounds.timeout_s))
            resource.setrlimit(resource.RLIMIT_CPU, (cpu if hard == resource.RLIM_INFINITY else min(cpu, hard), hard))
        if bounds.memory_mb > 0:
            limit = _address_space() + int(bounds.memory_mb) * 2**20
            _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
            if hard != resource.RLIM_INFINITY:
                limit = min(limit, hard)
            resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
            _watch_memory_errors(hits)
        try:
            fn()
            status = ("ok",)
        except MemoryError:
            hits.append(True)
            status = ("ok",)
        except BaseException as exc:  # noqa: BLE001 - reported, the caller re-runs and sees it itself
            status = ("raised", type(exc).__name__)
        sys.settrace(None)
        if hits:
            status = ("memory",)
        data = pickle.dumps(status)
        view = memoryview(data)
        while view:
            n = os.write(write_fd, view)
            view = view[n:]
    finally:
        os._exit(0)


def run_bounded(fn: Callable[[], Any], bounds: Bounds) -> str:
    """Run ``fn()`` in a forked child under ``bounds``; return ``"ok"`` or ``"raised"`` (how it ended).

    Raises :class:`BoundExceeded` when it runs past the deadline (the child is killed) or allocates past
    the memory bound, :class:`ChildFailed` when the child dies without a report. Without ``fork``
    (:data:`AVAILABLE` False) or with no active bound, nothing runs and ``"ok"`` is returned: the caller
    runs the function itself, unbounded.
    """
    if not AVAILABLE or not bounds.active:
        return "ok"
    read_fd, write_fd = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(read_fd)
        os.close(write_fd)
        raise
    if pid == 0:  # pragma: no cover - runs in the child, which exits through os._exit
        os.close(read_fd)
        _child(fn, bounds, write_fd)
    os.close(write_fd)
    wall = bounds.timeout_s * WALL_CLOCK_FACTOR + 1.0
    deadline = time.monotonic() + wall if bounds.timeout_s > 0 else None
    chunks: list[bytes] = []
    timed_out = False
    try:
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([read_fd], [], [], wait)
            if not ready:
                timed_out = True
                break
            chunk = os.read(read_fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(read_fd)
        if timed_out:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _, wstatus = os.waitpid(pid, 0)
    if timed_out:
        raise BoundExceeded("time", f"{bounds.timeout_s:g}s")
    try:
        status = pickle.loads(b"".join(chunks)) if chunks else ("crash",)
    except Exception:  # noqa: BLE001 - a torn report is a crash
        status = ("crash",)
    if status[0] == "memory":
        raise BoundExceeded("memory", f"{bounds.memory_mb} MiB")
    if status[0] == "crash":
        if os.WIFSIGNALED(wstatus) and os.WTERMSIG(wstatus) == signal.SIGXCPU:  # the CPU-time bound
            raise BoundExceeded("time", f"{bounds.timeout_s:g}s")
        if os.WIFSIGNALED(wstatus) and os.WTERMSIG(wstatus) == signal.SIGKILL:  # the kernel's OOM killer
            raise BoundExceeded("memory", f"{bounds.memory_mb} MiB")
        raise ChildFailed(f"the bounded child exited without a report (wait status {wstatus})")
    return str(status[0])
