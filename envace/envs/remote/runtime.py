"""The I/O runtime of remote environments (MCP and OpenEnv servers): one background event loop per process.

A remote episode's calls arrive from several threads and event loops: verl's agent-loop workers await them on their
own loop, the evaluation CLIs and ``EnvironmentPool.replay`` call them synchronously from a worker thread. The
clients (the MCP SDK, OpenEnv's ``GenericEnvClient``) hold anyio cancel scopes and sockets that belong to the loop
they were opened on. So every client lives on one daemon loop thread per process (:func:`io_loop`):

* :class:`Session` opens a client's async contexts in an *owner task* on that loop and exits them in the same task
  at :meth:`Session.close` (anyio requires it), while calls on the client run as other tasks on the same loop;
* :func:`run_sync` runs a coroutine there and waits from a plain thread; :func:`run_async` awaits it from another
  event loop without holding a worker thread (64 rollouts' calls overlap instead of queueing on the default
  executor's 6 threads on 2 cores);
* :func:`classify` maps what a client raises onto the error taxonomy: a refused or dropped connection, a 5xx or a
  time-out is :class:`~envace.envs.base.EnvironmentUnavailable` (infrastructure: the rollout is masked), a 401/403/404
  a :class:`~envllm.ConfigurationError` (the run stops with the reason), a protocol violation an
  :class:`~envace.envs.base.EnvironmentFault`. anyio wraps errors in exception groups: the leaf is what counts.

Every open session is registered, and the process closes what is left at exit, so a crashed server or a rollout
that never reached ``close`` leaks no session, subprocess or socket past its process.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Generic, TypeVar

from envace.envs.base import EnvironmentFault, EnvironmentUnavailable
from envllm import ConfigurationError

__all__ = ["Session", "classify", "io_loop", "leaf", "open_sessions", "run_async", "run_sync"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

_LOCK = threading.Lock()
_LOOP: asyncio.AbstractEventLoop | None = None
_THREAD: threading.Thread | None = None
_SESSIONS: set[Session[Any]] = set()  # open sessions (strong references: one dropped unclosed closes at exit)

#: exception class names (from httpx/httpx2, websockets, anyio, the MCP SDK) that mean the server is unreachable or
#: the connection was lost: matched by name so that this module imports none of those clients
_UNAVAILABLE_NAMES = frozenset({
    "ConnectError", "ConnectTimeout", "ReadError", "ReadTimeout", "WriteError", "WriteTimeout", "PoolTimeout",
    "RemoteProtocolError", "NetworkError", "TransportError", "ConnectionClosed", "ConnectionClosedError",
    "ConnectionClosedOK", "InvalidHandshake", "ClosedResourceError", "BrokenResourceError", "EndOfStream",
})


def io_loop() -> asyncio.AbstractEventLoop:
    """The process's remote-I/O event loop (a daemon thread, started on first use; a forked child starts its own)."""
    global _LOOP, _THREAD
    with _LOCK:
        if _LOOP is None or _THREAD is None or not _THREAD.is_alive():
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="envace-remote-io", daemon=True)
            thread.start()
            _LOOP, _THREAD = loop, thread
        return _LOOP


def _on_io_loop() -> bool:
    return _THREAD is not None and threading.current_thread() is _THREAD


def run_sync(coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """Run ``coro`` on the I/O loop and wait for it from this (non-loop) thread. Past ``timeout`` seconds it is
    cancelled and :class:`EnvironmentUnavailable` raised; its own errors come back through :func:`classify`."""
    if _on_io_loop():
        coro.close()
        raise RuntimeError("run_sync called on the remote-I/O loop itself: await the coroutine instead")
    future = asyncio.run_coroutine_threadsafe(coro, io_loop())
    try:
        return future.result(timeout)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise EnvironmentUnavailable(f"no answer within {timeout:g}s") from None
    except BaseException as exc:  # classified, then raised
        raise classify(exc) from exc


async def run_async(coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """Await ``coro`` run on the I/O loop, from any event loop (on the I/O loop itself it is awaited directly).
    Past ``timeout`` seconds it is cancelled and :class:`EnvironmentUnavailable` raised; errors are classified."""
    try:
        if _on_io_loop():
            return await asyncio.wait_for(coro, timeout)
        future = asyncio.run_coroutine_threadsafe(coro, io_loop())
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout)
        except (TimeoutError, asyncio.CancelledError):
            future.cancel()
            raise
    except TimeoutError:
        raise EnvironmentUnavailable(f"no answer within {timeout:g}s") from None
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # classified, then raised
        raise classify(exc) from exc


def leaf(exc: BaseException) -> BaseException:
    """The first non-group exception inside (nested) exception groups; ``exc`` itself when it is not a group."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _status(exc: BaseException) -> int | None:
    """The HTTP status an exception carries (httpx's ``response.status_code``, websockets' ``response.status``)."""
    response = getattr(exc, "response", None)
    for attr in ("status_code", "status"):
        code = getattr(response, attr, None)
        if isinstance(code, int):
            return code
    code = getattr(exc, "status_code", None)
    return code if isinstance(code, int) else None


def classify(exc: BaseException) -> BaseException:
    """The taxonomy's exception for what a remote client raised (see the module docstring). Exceptions that are
    none of these (a bug in the pool, a ``KeyboardInterrupt``) are returned as they are."""
    err = leaf(exc)
    if isinstance(err, (EnvironmentUnavailable, EnvironmentFault, ConfigurationError)):
        return err
    status = _status(err)
    if status in (401, 403, 404):
        return ConfigurationError(f"the environment server refused the request: HTTP {status} ({err})",
                                  status_code=status)
    if status is not None and (status >= 500 or status in (408, 425, 429)):
        return EnvironmentUnavailable(f"HTTP {status} from the environment server: {err}")
    names = {cls.__name__ for cls in type(err).__mro__}
    if isinstance(err, (ConnectionError, TimeoutError, EOFError, OSError)) or names & _UNAVAILABLE_NAMES:
        return EnvironmentUnavailable(f"{type(err).__name__}: {err}")
    if type(err).__name__ == "MCPError" and "connection closed" in str(err).lower():
        return EnvironmentUnavailable(f"MCPError: {err}")
    return err


class Session(Generic[T]):
    """A client's async contexts, opened and closed by one owner task on the I/O loop.

    ``opener(stack)`` enters what the client needs on ``stack`` (a :class:`contextlib.AsyncExitStack`) and returns
    the client; :meth:`open` / :meth:`aopen` wait until it has (errors classified), :meth:`close` / :meth:`aclose`
    exit the stack in the owner task. Calls on :attr:`client` are made with :func:`run_sync` / :func:`run_async`.
    """

    def __init__(self, opener: Callable[[contextlib.AsyncExitStack], Awaitable[T]], name: str = "session") -> None:
        self._opener = opener
        self.name = name
        self.client: T | None = None
        self._stop: asyncio.Event | None = None
        self._owner: asyncio.Task[None] | None = None
        self.closed = False

    async def _start(self) -> T:
        ready: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._stop = asyncio.Event()
        self._owner = asyncio.get_running_loop().create_task(self._own(ready), name=f"envace-{self.name}")
        return await ready

    async def _own(self, ready: asyncio.Future[T]) -> None:
        try:
            async with contextlib.AsyncExitStack() as stack:
                client = await self._opener(stack)
                self.client = client
                ready.set_result(client)
                assert self._stop is not None
                await self._stop.wait()
        except BaseException as exc:  # noqa: BLE001  (handed to the opener's waiter, or logged after it)
            if not ready.done():
                ready.set_exception(exc)
            elif not isinstance(exc, asyncio.CancelledError):
                logger.debug("%s: error while closing: %r", self.name, exc)
        finally:
            self.client = None

    def open(self, timeout: float | None = None) -> T:
        """Open the session (from a plain thread); raises the classified error when it cannot."""
        client = run_sync(self._start(), timeout)
        _SESSIONS.add(self)
        return client

    async def aopen(self, timeout: float | None = None) -> T:
        """Open the session (from any event loop)."""
        client = await run_async(self._start(), timeout)
        _SESSIONS.add(self)
        return client

    async def _close(self) -> None:
        if self._stop is not None:
            self._stop.set()
        if self._owner is not None:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(self._owner), 10.0)
            if not self._owner.done():
                self._owner.cancel()

    def close(self, timeout: float = 15.0) -> None:
        """Exit the session's contexts in its owner task (idempotent; errors while closing are logged, not raised)."""
        if self.closed:
            return
        self.closed = True
        _SESSIONS.discard(self)
        if _on_io_loop():
            io_loop().create_task(self._close())
            return
        with contextlib.suppress(Exception):
            run_sync(self._close(), timeout)

    async def aclose(self, timeout: float = 15.0) -> None:
        """:meth:`close` from any event loop."""
        if self.closed:
            return
        self.closed = True
        _SESSIONS.discard(self)
        with contextlib.suppress(Exception):
            await run_async(self._close(), timeout)


def open_sessions() -> int:
    """How many sessions of this process are open (tests check that nothing leaks)."""
    return sum(not s.closed for s in list(_SESSIONS))


@atexit.register
def _close_all() -> None:
    if _LOOP is None or _THREAD is None or not _THREAD.is_alive():
        return
    for session in list(_SESSIONS):
        session.close(timeout=5.0)
    _LOOP.call_soon_threadsafe(_LOOP.stop)
