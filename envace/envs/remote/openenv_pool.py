"""The ``openenv`` pool: episodes played on OpenEnv servers through the ``openenv`` package's own client.

Each episode is one WebSocket session of OpenEnv's ``GenericEnvClient`` (one server-side environment instance,
destroyed when the socket closes), opened by an owner task on the process's remote-I/O loop
(:mod:`envace.envs.remote.runtime`). Servers are given as replicas (``urls``) or started here (``launch``):

.. code-block:: yaml

    openenv:
      urls: [http://127.0.0.1:8001, http://127.0.0.1:8002]   # or: launch: {command: [python, -m, srv, --port, "{port}"],
      headers: {Authorization: "Bearer TOKEN"}               #                  replicas: 2}
      tasks: server            # an envace-served server's task list, or a JSONL task file (generic servers)
      action: envace           # how a tool call becomes an action: envace | mcp | {template: {...}}
      call_timeout_s: 60
      connect_timeout_s: 10

Two kinds of server:

* **envace-served** (``python -m envace.envs serve --protocol openenv``, ``tasks: server``): the tasks come from
  ``GET {url}/envace/tasks`` (read once, at construction) and the gold calls from ``GET {url}/envace/gold/{id}``.
  ``reset(task_id=, seed=)`` answers the chat's ``messages`` and ``tools``; the actions are ``{"kind": "call",
  "name", "arguments"}``, ``{"kind": "end_turn", "text"}`` (the next user message; ``metadata.ended`` when the
  episode is over), ``{"kind": "verify"}`` (``metadata.verdict``) and ``{"kind": "replay", "actions"}``: the served
  pool's own ``replay`` verdict, which :meth:`OpenEnvPool.replay` uses because a pool's replay may close turns with
  replies of its own that a client ending turns with "" would not give.
* **generic** (any OpenEnv environment, a JSONL task file): one task per line with ``task_id``, ``split``,
  ``instruction`` and optionally ``category``, ``system_prompt``, ``env_id``, ``tools`` (OpenAI function schemas;
  with ``action: mcp`` tool names or nothing, the server's tool list being read once at construction),
  ``reset`` (keyword arguments of ``reset``; default ``{"task_id": ID}``), ``reward_mode`` (``last|sum|max`` of the
  step rewards), ``require_done`` (default true), ``pass_reward`` (default 1.0) and ``gold`` (turns of calls).
  Generic episodes are single-turn: ``end_turn`` gives ``None``. With ``action: mcp`` (an OpenEnv
  ``MCPEnvironment``) a call is a ``call_tool`` action, and a name outside the task's tools is answered here.
  With ``action: {template: T}`` (a classic single-action environment: a shell, a coding or an echo env) a call is
  ``T`` with ``"{name}"`` and ``"{arguments.X}"`` filled in (a placeholder that is a whole string keeps the
  argument's JSON type), and the observation text is its ``text`` field, else the observation as JSON.

Failures follow the taxonomy: a refused, dropped or timed-out connection raises
:class:`~envace.envs.base.EnvironmentUnavailable` (connect and reset are retried on another replica, a step never:
it may have had an effect; after a lost step the episode stays lost instead of letting the client reconnect to a
fresh server-side session), a handshake refused with HTTP 401/403 a
:class:`~envllm.ConfigurationError`, a malformed observation an
:class:`~envace.envs.base.EnvironmentFault`. A server's own error frame for a call (its step raised, or the action
did not validate) is an ``Error: ...`` observation the model reads, as an in-process tool's exception would be.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from envace.envs.base import (
    EnvironmentFault,
    EnvironmentPool,
    EnvironmentUnavailable,
    Episode,
    TaskSpec,
    ToolCall,
    Verdict,
    register_pool,
)
from envace.envs.remote import runtime
from envllm import ConfigurationError

__all__ = ["OpenEnvEpisode", "OpenEnvPool"]

POOL_NAME = "openenv"
#: bound on one observation's text (as in-process tool outputs are cut)
MAX_OUTPUT_CHARS = 65536
#: how long a replica that raised EnvironmentUnavailable is passed over
COOLDOWN_S = 5.0
#: attempts at connect + reset (each on the least busy replica not cooling down)
CONNECT_TRIES = 3
#: the WebSocket message cap given to the client (MB)
MAX_MESSAGE_MB = 4
ACTION_STYLES = ("envace", "mcp")
REWARD_MODES = ("last", "sum", "max")
_SERVER_ERROR = re.compile(r"^Server error: (?P<message>.*) \(code: (?P<code>[A-Z_]+)\)$", re.DOTALL)
_HTTP_STATUS = re.compile(r"\bHTTP (\d{3})\b")


# -- errors ------------------------------------------------------------------------------------------------------


def _status(exc: BaseException) -> int | None:
    """The HTTP status of a refused handshake: websockets' ``InvalidStatus.response.status`` anywhere in the cause
    chain, else ``HTTP NNN`` in a message (openenv re-raises it as ``ConnectionError("... HTTP 403")``)."""
    seen: BaseException | None = exc
    while seen is not None:
        code = getattr(getattr(seen, "response", None), "status", None)
        if isinstance(code, int):
            return code
        seen = seen.__cause__ or seen.__context__
    match = _HTTP_STATUS.search(str(exc))
    return int(match.group(1)) if match else None


def _translate(exc: BaseException) -> BaseException:
    """The taxonomy's exception for what the OpenEnv client raised (see the module docstring)."""
    err = runtime.leaf(exc)
    if isinstance(err, (EnvironmentUnavailable, EnvironmentFault, ConfigurationError)):
        return err
    frame = _SERVER_ERROR.match(str(err)) if type(err) is RuntimeError else None
    if frame:
        message, code = frame["message"], frame["code"]
        if code == "CAPACITY_REACHED":
            return EnvironmentUnavailable(f"the OpenEnv server is at capacity: {message}")
        return EnvironmentFault(f"the OpenEnv server answered an error ({code}): {message}")
    status = _status(err)
    if status in (401, 403, 404):
        return ConfigurationError(f"the OpenEnv server refused the connection: HTTP {status} (check the pool's "
                                  f"urls and headers)", status_code=status)
    if status is not None and (status >= 500 or status == 429):
        return EnvironmentUnavailable(f"HTTP {status} from the OpenEnv server: {err}")
    return runtime.classify(err)


def _call_error(exc: BaseException) -> str | None:
    """The ``Error: ...`` observation for a server's error frame answering a call (its step raised, or the action
    did not validate): the model's to read, and the session stays usable. None for anything else."""
    frame = _SERVER_ERROR.match(str(exc)) if type(exc) is RuntimeError else None
    if frame and frame["code"] in ("EXECUTION_ERROR", "VALIDATION_ERROR"):
        return f"Error: {frame['message']}"
    return None


_PLACEHOLDER = re.compile(r"\{(name|arguments\.[^{}]+)\}")


def _placeholder(match: re.Match[str], call: ToolCall) -> Any:
    key = match.group(1)
    return call.name if key == "name" else call.arguments.get(key.partition(".")[2])


def fill_template(template: Any, call: ToolCall) -> Any:
    """``template`` with ``{name}`` / ``{arguments.X}`` replaced from ``call`` (recursively; a placeholder that is
    the whole string keeps the value's type, one inside a longer string is formatted into it)."""
    if isinstance(template, str):
        whole = _PLACEHOLDER.fullmatch(template)
        if whole:
            return _placeholder(whole, call)
        return _PLACEHOLDER.sub(lambda m: str(_placeholder(m, call)), template)
    if isinstance(template, dict):
        return {k: fill_template(v, call) for k, v in template.items()}
    if isinstance(template, list):
        return [fill_template(v, call) for v in template]
    return template


# -- replicas and local servers ----------------------------------------------------------------------------------


class Replicas:
    """Server URLs an episode is placed on: the one with the fewest episodes in flight in this process, ties broken
    by a per-process random offset (so that workers do not all start on the first), passing over a replica that
    raised :class:`EnvironmentUnavailable` in the last ``cooldown_s`` seconds unless every one did."""

    def __init__(self, urls: Sequence[str], cooldown_s: float = COOLDOWN_S) -> None:
        self.urls = list(urls)
        self.cooldown_s = cooldown_s
        self._offset = random.randrange(len(self.urls))
        self._in_flight = [0] * len(self.urls)
        self._cool_until = [0.0] * len(self.urls)
        self._lock = threading.Lock()

    def acquire(self) -> str:
        with self._lock:
            now, n = time.monotonic(), len(self.urls)
            i = min(range(n), key=lambda j: (self._cool_until[j] > now, self._in_flight[j], (j - self._offset) % n))
            self._in_flight[i] += 1
            return self.urls[i]

    def release(self, url: str) -> None:
        with self._lock:
            i = self.urls.index(url)
            self._in_flight[i] = max(0, self._in_flight[i] - 1)

    def cool(self, url: str) -> None:
        with self._lock:
            self._cool_until[self.urls.index(url)] = time.monotonic() + self.cooldown_s

    def in_flight(self) -> dict[str, int]:
        with self._lock:
            return dict(zip(self.urls, self._in_flight, strict=True))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop_processes(procs: list[subprocess.Popen[bytes]], grace_s: float = 5.0) -> None:
    """SIGTERM each server's process group, then SIGKILL what is left after ``grace_s``."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class LocalServers:
    """``replicas`` server subprocesses from ``command`` (``{port}`` substituted by a free port), each in its own
    process group, ready once ``GET /health`` answers 200. Stopped by :meth:`stop`, when garbage-collected and at
    exit (a finalizer holding only the processes)."""

    def __init__(self, command: Sequence[str], replicas: int, headers: Mapping[str, str],
                 timeout_s: float = 60.0) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.urls: list[str] = []
        self._logs: list[Any] = []
        self._finalizer = weakref.finalize(self, _stop_processes, self.procs)
        try:
            for _ in range(replicas):
                port = _free_port()
                log = tempfile.TemporaryFile()  # noqa: SIM115  (kept open while the server runs; closed by stop)
                argv = [str(a).replace("{port}", str(port)) for a in command]
                self.procs.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                                   stderr=subprocess.STDOUT, start_new_session=True))
                self._logs.append(log)
                self.urls.append(f"http://127.0.0.1:{port}")
            for proc, url, log in zip(self.procs, self.urls, self._logs, strict=True):
                self._wait_healthy(proc, url, log, headers, timeout_s)
        except BaseException:
            self.stop()
            raise

    @staticmethod
    def _wait_healthy(proc: subprocess.Popen[bytes], url: str, log: Any, headers: Mapping[str, str],
                      timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                log.seek(0)
                tail = log.read().decode(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
                raise ConfigurationError(f"openenv launch: {proc.args[0]} exited with {proc.returncode} before "
                                         f"{url}/health answered: {tail[0]}")
            try:
                _get_json(f"{url}/health", headers, 2.0)
                return
            except EnvironmentUnavailable:
                if time.monotonic() > deadline:
                    raise EnvironmentUnavailable(f"openenv launch: {url}/health did not answer within "
                                                 f"{timeout_s:g}s") from None
            time.sleep(0.1)

    def stop(self) -> None:
        self._finalizer()
        for log in self._logs:
            log.close()


def _get_json(url: str, headers: Mapping[str, str], timeout: float) -> Any:
    """``GET url`` as JSON; None on 404. 401/403 raise ConfigurationError, an unreachable server or a 5xx
    EnvironmentUnavailable, a body that is not JSON EnvironmentFault."""
    request = urllib.request.Request(url, headers=dict(headers))
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read()
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        if exc.code in (401, 403):
            raise ConfigurationError(f"GET {url}: HTTP {exc.code} (check the pool's headers)",
                                     status_code=exc.code) from None
        raise EnvironmentUnavailable(f"GET {url}: HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise EnvironmentUnavailable(f"GET {url}: {getattr(exc, 'reason', exc)}") from None
    try:
        return json.loads(body)
    except json.JSONDecodeError:
        raise EnvironmentFault(f"GET {url}: the answer is not JSON") from None


# -- tasks -------------------------------------------------------------------------------------------------------


@dataclass
class FileTask:
    """One line of a generic server's task file: how to reset and how to score from the step rewards."""

    spec: TaskSpec
    reset: dict[str, Any]
    reward_mode: str = "last"
    require_done: bool = True
    pass_reward: float = 1.0
    tool_names: list[str] | None = None  # ``action: mcp`` with names: the subset of the server's tools
    gold: list[list[ToolCall]] = field(default_factory=list)


_TASK_KEYS = {"task_id", "split", "category", "instruction", "system_prompt", "env_id", "tools", "reset",
              "reward_mode", "require_done", "pass_reward", "gold"}


def _require(ok: bool, where: str, message: str) -> None:
    """A user's mistake in a task file or the pool kwargs: one line, naming where."""
    if not ok:
        raise ValueError(f"{where}: {message}")


def _file_task(obj: Any, where: str, action: str) -> FileTask:
    """A task file line, checked; every mistake is a one-line ValueError naming ``where`` (file:line)."""
    _require(isinstance(obj, dict), where, "a task is a JSON object")
    unknown = sorted(set(obj) - _TASK_KEYS)
    _require(not unknown, where, f"unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(_TASK_KEYS))}")
    for key in ("task_id", "instruction"):
        _require(isinstance(obj.get(key), str) and bool(obj[key]), where, f"{key!r} must be a non-empty string")
    _require(obj.get("split") in ("train", "test"), where, "'split' must be 'train' or 'test'")
    mode, require_done, pass_reward = obj.get("reward_mode", "last"), obj.get("require_done", True), obj.get(
        "pass_reward", 1.0)
    _require(mode in REWARD_MODES, where, f"'reward_mode' must be one of {', '.join(REWARD_MODES)}")
    _require(isinstance(require_done, bool), where, "'require_done' must be true or false")
    _require(isinstance(pass_reward, (int, float)) and not isinstance(pass_reward, bool), where,
             "'pass_reward' must be a number")
    _require(isinstance(obj.get("reset", {}), dict), where, "'reset' must be an object of reset() keyword arguments")
    for key in ("category", "system_prompt", "env_id"):
        _require(obj.get(key) is None or isinstance(obj[key], str), where, f"{key!r} must be a string")
    tools, names = _task_tools(obj.get("tools"), where, action)
    try:
        gold = [[ToolCall.from_dict(c) for c in turn] for turn in obj.get("gold") or []]
    except (ValueError, TypeError, AttributeError) as exc:
        raise ValueError(f"{where}: 'gold' must be a list of turns of {{name, arguments}} calls ({exc})") from None
    verifier = f"the {mode} step reward reaches {pass_reward}" + (" and the episode is done" if require_done else "")
    spec = TaskSpec(pool=POOL_NAME, task_id=obj["task_id"], env_id=obj.get("env_id") or POOL_NAME,
                    category=obj.get("category") or POOL_NAME, split=obj["split"],
                    system_prompt=obj.get("system_prompt"), first_user_message=obj["instruction"], tools=tools,
                    verifier_text=verifier)
    return FileTask(spec=spec, reset=obj.get("reset") or {"task_id": obj["task_id"]}, reward_mode=mode,
                    require_done=require_done, pass_reward=float(pass_reward), tool_names=names, gold=gold)


def _task_tools(tools: Any, where: str, action: str) -> tuple[list[dict[str, Any]], list[str] | None]:
    """(function schemas, the names to take from the server's tool list (all of it when empty) or None)."""
    if tools is None:
        _require(action == "mcp", where, "'tools' (OpenAI function schemas) is required unless action is 'mcp'")
        return [], []
    _require(isinstance(tools, list), where, "'tools' must be a list")
    if all(isinstance(t, str) for t in tools):
        _require(action == "mcp", where, "tool names need action 'mcp' (the server's tool list); give schemas")
        return [], list(tools)
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        _require(isinstance(fn, dict) and isinstance(fn.get("name"), str), where,
                 "each tool must be {'type': 'function', 'function': {'name', ...}}")
    return list(tools), None


def load_task_file(path: str | os.PathLike[str], action: str) -> dict[str, FileTask]:
    """The tasks of a JSONL task file, by id (blank lines skipped)."""
    tasks: dict[str, FileTask] = {}
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ValueError(f"openenv tasks: cannot read {p}: {exc.strerror or exc}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{p}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not JSON ({exc.msg})") from None
        task = _file_task(obj, where, action)
        if task.spec.task_id in tasks:
            raise ValueError(f"{where}: task_id {task.spec.task_id!r} appears twice")
        tasks[task.spec.task_id] = task
    if not tasks:
        raise ValueError(f"{p}: no tasks")
    return tasks


def _function_schema(tool: Any) -> dict[str, Any]:
    """An MCP tool (``name``, ``description``, ``input_schema``) as an OpenAI function schema (``title`` dropped)."""
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
        raise EnvironmentFault(f"the server listed a malformed tool: {str(tool)[:200]}")
    schema = tool.get("input_schema", tool.get("inputSchema")) or {"type": "object", "properties": {}}
    if not isinstance(schema, dict):
        raise EnvironmentFault(f"tool {tool['name']!r}: input_schema is not an object")
    params = {k: v for k, v in schema.items() if k != "title"}
    return {"type": "function", "function": {"name": tool["name"], "description": tool.get("description") or "",
                                             "parameters": params}}


# -- observations ------------------------------------------------------------------------------------------------


def _observation(result: Any) -> dict[str, Any]:
    obs = getattr(result, "observation", None)
    if not isinstance(obs, dict):
        raise EnvironmentFault(f"the observation is not an object: {type(obs).__name__}")
    return obs


def _metadata(result: Any, obs: Mapping[str, Any]) -> dict[str, Any]:
    meta = getattr(result, "metadata", None) or obs.get("metadata") or {}
    if not isinstance(meta, dict):
        raise EnvironmentFault("the observation's metadata is not an object")
    return meta


def _verdict(result: Any) -> Verdict:
    """The ``metadata.verdict`` of an envace-served ``verify``/``replay`` answer."""
    v = _metadata(result, _observation(result)).get("verdict")
    ok = (isinstance(v, dict) and isinstance(v.get("reward"), (int, float)) and isinstance(v.get("passed"), bool)
          and isinstance(v.get("details", {}), dict))
    if not ok:
        raise EnvironmentFault(f"the server's verdict is malformed: {str(v)[:200]}")
    return Verdict(reward=float(v["reward"]), passed=v["passed"], details=dict(v.get("details") or {}))


def _mcp_text(obs: Mapping[str, Any]) -> str:
    """The text of a ``CallToolObservation``: the result's text contents, or the error the model must read."""
    error = obs.get("error")
    if error:
        kind = error.get("error_type") if isinstance(error, dict) else None
        message = error.get("message") if isinstance(error, dict) else str(error)
        if kind == "timeout":
            raise EnvironmentUnavailable(f"the tool timed out on the server: {message}")
        if kind == "transport_error" or kind is None:
            raise EnvironmentFault(f"the server failed to run the tool: {message}")
        return f"Error: {message}"
    result = obs.get("result")
    if isinstance(result, str):
        return result
    if not isinstance(result, dict) or not isinstance(result.get("content"), list):
        raise EnvironmentFault(f"call_tool result without a content list: {str(result)[:200]}")
    parts = []
    for item in result["content"]:
        if not isinstance(item, dict):
            raise EnvironmentFault("call_tool content item is not an object")
        if item.get("type") == "text":
            if not isinstance(item.get("text"), str):
                raise EnvironmentFault("call_tool text content is not a string")
            parts.append(item["text"])
        else:
            parts.append(f"[{item.get('type')} omitted]")
    text = "\n".join(parts)
    if result.get("is_error") and not text.lstrip().lower().startswith("error"):
        text = f"Error: {text}"
    return text


def _plain_text(obs: Mapping[str, Any]) -> str:
    """A classic environment's observation as text: its ``text`` field, else the fields (no metadata) as JSON."""
    text = obs.get("text")
    if isinstance(text, str):
        return text
    try:
        return json.dumps({k: v for k, v in obs.items() if k != "metadata"}, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise EnvironmentFault(f"the observation is not JSON: {exc}") from None


# -- the episode -------------------------------------------------------------------------------------------------


class OpenEnvEpisode(Episode):
    """One task on one replica, over one OpenEnv WebSocket session (the server's own environment instance).

    Every call runs on the remote-I/O loop: the sync methods wait for it (:func:`runtime.run_sync`), the async ones
    await it (:func:`runtime.run_async`). After a lost connection the episode raises
    :class:`EnvironmentUnavailable` for every later call without touching the client, which would otherwise
    reconnect to a fresh, un-reset server session.
    """

    remote = True

    def __init__(self, pool: OpenEnvPool, spec: TaskSpec, seed: int | None = None) -> None:
        self.pool, self.spec, self.seed = pool, spec, seed
        self._file_task = pool._file_tasks.get(spec.task_id) if pool._file_tasks else None
        self._tools = list(spec.tools)
        self._messages = spec.initial_messages()
        self._history: list[tuple[str, Any]] = []  # ("call", ToolCall) / ("end_turn", text): what fork replays
        self._rewards: list[float] = []
        self._done = False
        self._url: str | None = None
        self._session: runtime.Session[Any] | None = None
        self._lost: str | None = None
        self._closed = False
        self._release: weakref.finalize | None = None

    # -- the session on the I/O loop ---------------------------------------------------------------------------

    def _reset_kwargs(self) -> dict[str, Any]:
        kwargs = dict(self._file_task.reset) if self._file_task else {"task_id": self.spec.task_id}
        if self.seed is not None:
            kwargs["seed"] = self.seed
        return kwargs

    async def _open(self) -> None:
        """Connect and reset, on another replica after an unavailable one: at least :data:`CONNECT_TRIES` times,
        and while every replica is unavailable, for up to ``connect_timeout_s`` more with a growing pause (a
        server that restarts takes seconds: the episodes that start meanwhile wait for it instead of failing)."""
        replicas, error = self.pool.replicas, None
        deadline, pause, tries = time.monotonic() + self.pool.connect_timeout_s, 0.2, 0
        while tries < CONNECT_TRIES or time.monotonic() < deadline:
            if tries >= CONNECT_TRIES:
                await asyncio.sleep(pause)
                pause = min(2 * pause, 2.0)
            tries += 1
            url = replicas.acquire()
            session = runtime.Session(self.pool._opener(url), name=f"openenv {self.spec.task_id}")
            try:
                client = await session.aopen(self.pool.connect_timeout_s + 5.0)
                result = await client.reset(**self._reset_kwargs())
            except asyncio.CancelledError:
                await session.aclose()
                replicas.release(url)
                raise
            except Exception as exc:  # closed and released, then retried on another replica or raised
                await session.aclose()
                replicas.release(url)
                error = _translate(exc)
                if not isinstance(error, EnvironmentUnavailable):
                    raise error from exc
                replicas.cool(url)
                continue
            try:
                self._take_reset(result)
            except EnvironmentFault:
                await session.aclose()
                replicas.release(url)
                raise
            self._url, self._session = url, session
            # an episode dropped without close still gives its replica slot back (its session closes at exit)
            self._release = weakref.finalize(self, replicas.release, url)
            return
        assert error is not None
        raise error

    def _take_reset(self, result: Any) -> None:
        obs = _observation(result)
        if self.pool.server_tasks:
            messages, tools = obs.get("messages"), obs.get("tools")
            if not isinstance(messages, list) or not messages or not isinstance(tools, list):
                raise EnvironmentFault("the reset observation lacks 'messages' or 'tools'")
            self._messages, self._tools = messages, tools

    async def _step(self, action: dict[str, Any], call: bool = False) -> Any:
        """One step; a call answered by the server's error frame gives its ``Error: ...`` text instead."""
        if self._lost is not None:
            raise EnvironmentUnavailable(f"the episode's session was lost earlier: {self._lost}")
        if self._closed or self._session is None or self._session.client is None:
            raise RuntimeError(f"openenv episode {self.spec.task_id} is closed")
        try:
            return await self._session.client.step(action)
        except asyncio.CancelledError:  # a time-out: the client dropped its socket, a next step would reconnect
            self._lose("a step was cancelled (time-out)")
            raise
        except Exception as exc:
            text = _call_error(exc) if call else None
            if text is not None:
                return text
            error = _translate(exc)
            self._lose(str(error))
            raise error from exc

    def _lose(self, reason: str) -> None:
        self._lost = reason
        if self._url is not None:
            self.pool.replicas.cool(self._url)

    async def _execute(self, call: ToolCall) -> str:
        names = {t.get("function", t).get("name") for t in self._tools}
        if self.pool.action == "mcp" and call.name not in names:
            return f"Error: unknown tool {call.name!r}; available: {', '.join(sorted(map(str, names)))}"
        self._history.append(("call", call))
        if self.pool.action == "mcp":
            action = {"type": "call_tool", "tool_name": call.name, "arguments": dict(call.arguments)}
        elif self.pool.action == "template":
            action = fill_template(self.pool.template, call)
        else:
            action = {"kind": "call", "name": call.name, "arguments": dict(call.arguments)}
        result = await self._step(action, call=True)
        if isinstance(result, str):
            return result[:MAX_OUTPUT_CHARS]
        obs = _observation(result)
        if self.pool.action == "mcp":
            text = _mcp_text(obs)
        elif self.pool.action == "template":
            text = _plain_text(obs)
        else:
            text = obs.get("text")
            if not isinstance(text, str):
                raise EnvironmentFault(f"the observation's text is not a string: {type(text).__name__}")
            tools = obs.get("tools")
            if tools:
                if not isinstance(tools, list):
                    raise EnvironmentFault("the observation's tools are not a list")
                self._tools = tools
        self._take_reward(result)
        return text[:MAX_OUTPUT_CHARS]

    def _take_reward(self, result: Any) -> None:
        reward = getattr(result, "reward", None)
        if isinstance(reward, (int, float)) and not isinstance(reward, bool):
            self._rewards.append(float(reward))
        self._done = self._done or bool(getattr(result, "done", False))

    async def _end_turn(self, text: str) -> str | None:
        if not self.pool.server_tasks:
            return None  # generic OpenEnv environments are single-turn
        self._history.append(("end_turn", text))
        result = await self._step({"kind": "end_turn", "text": text})
        obs = _observation(result)
        if _metadata(result, obs).get("ended"):
            return None
        nxt = obs.get("text")
        if not isinstance(nxt, str):
            raise EnvironmentFault(f"end_turn's next user message is not a string: {type(nxt).__name__}")
        tools = obs.get("tools")
        if isinstance(tools, list) and tools:
            self._tools = tools
        return nxt

    async def _verify(self) -> Verdict:
        if self.pool.server_tasks:
            return _verdict(await self._step({"kind": "verify"}))
        task = self._file_task
        assert task is not None
        rewards = self._rewards
        value = {"last": rewards[-1:], "sum": [sum(rewards)], "max": [max(rewards, default=0.0)]}[task.reward_mode]
        raw = value[0] if value else 0.0
        done_ok = self._done or not task.require_done
        reward = min(1.0, max(0.0, raw)) if done_ok else 0.0
        details: dict[str, Any] = {"rewards": list(rewards), "done": self._done, "reward_mode": task.reward_mode}
        with contextlib.suppress(Exception):  # the server's state() is informative only
            if self._lost is None and self._session is not None and self._session.client is not None:
                details["state"] = await self._session.client.state()
        return Verdict(reward=reward, passed=done_ok and raw >= task.pass_reward, details=details)

    async def _replay_on_server(self, actions: Sequence[Sequence[ToolCall]]) -> Verdict:
        turns = [[c.to_dict() for c in turn] for turn in actions]
        return _verdict(await self._step({"kind": "replay", "actions": turns}))

    async def _fork(self) -> OpenEnvEpisode:
        twin = OpenEnvEpisode(self.pool, self.spec, self.seed)
        await twin._open()
        try:
            for kind, item in list(self._history):
                await (twin._execute(item) if kind == "call" else twin._end_turn(item))
        except BaseException:
            await twin._close()
            raise
        return twin

    async def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        session, self._session = self._session, None
        if session is not None:
            await session.aclose()
        if self._release is not None:
            self._release()

    # -- the Episode protocol ----------------------------------------------------------------------------------

    def tools(self) -> list[dict[str, Any]]:
        return list(self._tools)

    def initial_messages(self) -> list[dict[str, Any]]:
        return [dict(m) for m in self._messages]

    @property
    def done(self) -> bool:
        """True once a step answered ``done`` (a generic environment finished: the rollout stops there)."""
        return self._done

    def execute(self, call: ToolCall) -> str:
        return runtime.run_sync(self._execute(call), self.pool.call_budget_s)

    async def aexecute(self, call: ToolCall) -> str:
        return await runtime.run_async(self._execute(call), self.pool.call_budget_s)

    def end_turn(self, assistant_text: str) -> str | None:
        if not self.pool.server_tasks:
            return None
        return runtime.run_sync(self._end_turn(assistant_text), self.pool.call_budget_s)

    def verify(self) -> Verdict:
        return runtime.run_sync(self._verify(), self.pool.call_budget_s)

    async def averify(self) -> Verdict:
        return await runtime.run_async(self._verify(), self.pool.call_budget_s)

    def fork(self) -> OpenEnvEpisode:
        """A new session on the task (any replica) with this episode's calls and turn ends replayed in order:
        OpenEnv 0.10.0 has no snapshot API. It costs one connect + reset plus one round trip per replayed action
        (docs/results/env_serving.md). The replayed outputs are not compared: a server that is not deterministic may
        drift."""
        budget = self.pool.open_budget_s + len(self._history) * self.pool.call_budget_s
        return runtime.run_sync(self._fork(), budget)

    def close(self) -> None:
        runtime.run_sync(self._close(), 20.0)

    async def aclose(self) -> None:
        await runtime.run_async(self._close(), 20.0)


# -- the pool ----------------------------------------------------------------------------------------------------


@register_pool(POOL_NAME)
class OpenEnvPool(EnvironmentPool):
    """Tasks played on OpenEnv servers (see the module docstring for the kwargs and both kinds of server).

    Args:
        urls: the servers' base URLs (replicas of one environment); or
        launch: ``{"command": [...], "replicas": N, "timeout_s": 60}``: start N local servers on free ports
            (``{port}`` in the command), stopped by :meth:`close` and at exit.
        headers: HTTP headers of every connection and request (e.g. ``Authorization: Bearer ...``).
        tasks: ``"server"`` (an envace-served server's task list) or the path of a JSONL task file.
        action: ``"envace"`` (``{"kind": "call", ...}`` actions), ``"mcp"`` (an OpenEnv ``MCPEnvironment``) or
            ``{"template": {...}}`` (the action object with ``{name}`` / ``{arguments.X}`` placeholders).
        call_timeout_s: the time-out of one step (a lost answer: :class:`EnvironmentUnavailable`).
        connect_timeout_s: the WebSocket handshake's time-out, and how long an episode's start waits for an
            unavailable server to come back (a restart).
    """

    name = POOL_NAME
    #: ``python -m envace.envs list`` names the pool without building it (it has no default servers)
    NEEDS_CONFIGURATION = "its servers: --pool-kwargs '{\"openenv\": {\"urls\": [URL]}}' (or \"launch\")"

    def __init__(self, urls: Sequence[str] | str | None = None, launch: Mapping[str, Any] | None = None,
                 headers: Mapping[str, str] | None = None, tasks: str = "server",
                 action: str | Mapping[str, Any] = "envace",
                 call_timeout_s: float = 60.0, connect_timeout_s: float = 10.0) -> None:
        self._check_kwargs(urls, launch, headers, tasks, action, call_timeout_s, connect_timeout_s)
        _import_client()
        self.headers = {str(k): str(v) for k, v in (headers or {}).items()}
        self.template = action.get("template") if isinstance(action, Mapping) else None
        self.action: str = "template" if isinstance(action, Mapping) else action
        self.server_tasks = tasks == "server"
        self.call_timeout_s, self.connect_timeout_s = float(call_timeout_s), float(connect_timeout_s)
        self.servers: LocalServers | None = None
        self._file_tasks: dict[str, FileTask] | None = None
        if not self.server_tasks:
            self._file_tasks = load_task_file(tasks, self.action)
        if launch is not None:
            self.servers = LocalServers(launch["command"], int(launch.get("replicas", 1)), self.headers,
                                        float(launch.get("timeout_s", 60.0)))
            urls = self.servers.urls
        assert urls is not None
        self.replicas = Replicas([str(u).rstrip("/") for u in ([urls] if isinstance(urls, str) else urls)])
        self._gold: dict[str, list[list[ToolCall]]] = {}
        try:
            self._specs = self._server_specs() if self.server_tasks else self._file_specs()
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _check_kwargs(urls: Any, launch: Any, headers: Any, tasks: Any, action: Any, call_timeout_s: Any,
                      connect_timeout_s: Any) -> None:
        """One-line ValueErrors naming the key for every malformed kwarg."""
        if (urls is None) == (launch is None):
            raise ValueError("openenv: give exactly one of 'urls' and 'launch'")
        if urls is not None and (not urls or not all(isinstance(u, str) and u for u in
                                                     ([urls] if isinstance(urls, str) else urls))):
            raise ValueError("openenv: 'urls' must be a non-empty list of server URLs")
        if launch is not None:
            cmd = launch.get("command") if isinstance(launch, Mapping) else None
            if not isinstance(cmd, (list, tuple)) or not cmd or not all(isinstance(a, (str, int)) for a in cmd):
                raise ValueError("openenv: 'launch.command' must be a non-empty list of arguments")
            if not isinstance(launch.get("replicas", 1), int) or launch.get("replicas", 1) < 1:
                raise ValueError("openenv: 'launch.replicas' must be a positive integer")
            unknown = sorted(set(launch) - {"command", "replicas", "timeout_s"})
            if unknown:
                raise ValueError(f"openenv: unknown launch key(s) {', '.join(unknown)}")
        if headers is not None and not isinstance(headers, Mapping):
            raise ValueError("openenv: 'headers' must be a mapping of header names to values")
        if not isinstance(tasks, str) or not tasks:
            raise ValueError("openenv: 'tasks' must be 'server' or the path of a JSONL task file")
        if isinstance(action, Mapping):
            if set(action) != {"template"} or not isinstance(action["template"], (dict, list)):
                raise ValueError("openenv: 'action' as a mapping is {template: <the action object>}")
        elif action not in ACTION_STYLES:
            raise ValueError(f"openenv: 'action' must be one of {', '.join(ACTION_STYLES)} or {{template: ...}}, "
                             f"got {action!r}")
        if tasks == "server" and action != "envace":
            raise ValueError("openenv: tasks 'server' (an envace-served server) needs action 'envace'")
        for key, value in (("call_timeout_s", call_timeout_s), ("connect_timeout_s", connect_timeout_s)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"openenv: {key!r} must be a positive number")

    # -- construction ------------------------------------------------------------------------------------------

    def _opener(self, url: str) -> Any:
        """The session opener of one episode: OpenEnv's ``GenericEnvClient`` (connecting once) entered on the
        owner's stack."""

        async def open_client(stack: contextlib.AsyncExitStack) -> Any:
            client = _client_class()(base_url=url, connect_timeout_s=self.connect_timeout_s,
                                      message_timeout_s=self.call_timeout_s, max_message_size_mb=MAX_MESSAGE_MB,
                                      headers=self.headers or None)
            try:
                return await stack.enter_async_context(client)
            except Exception as exc:
                raise _translate(exc) from exc

        return open_client

    @property
    def call_budget_s(self) -> float:
        """The bound on one step as awaited from a rollout (the client's own message time-out fires first)."""
        return self.call_timeout_s + 5.0

    @property
    def open_budget_s(self) -> float:
        """The bound on an episode's start: its tries, and the wait for an unavailable server to come back."""
        return CONNECT_TRIES * (self.connect_timeout_s + self.call_timeout_s + 5.0) + self.connect_timeout_s

    def _server_specs(self) -> dict[str, TaskSpec]:
        url = self.replicas.urls[0]
        listed = _get_json(f"{url}/envace/tasks", self.headers, self.connect_timeout_s + self.call_timeout_s)
        if listed is None:
            raise ConfigurationError(f"openenv: {url} has no /envace/tasks (not an envace-served server?); "
                                     f"give 'tasks' a task file")
        if not isinstance(listed, list):
            raise EnvironmentFault(f"GET {url}/envace/tasks: not a list")
        specs: dict[str, TaskSpec] = {}
        for item in listed:
            try:
                spec = TaskSpec(**item)
            except TypeError as exc:
                raise EnvironmentFault(f"GET {url}/envace/tasks: a malformed task ({exc})") from None
            served = {"served_pool": spec.pool, **spec.metadata}
            specs[spec.task_id] = TaskSpec(**{**spec.__dict__, "pool": POOL_NAME, "metadata": served})
        return specs

    def _file_specs(self) -> dict[str, TaskSpec]:
        assert self._file_tasks is not None
        if self.action == "mcp" and any(t.tool_names is not None for t in self._file_tasks.values()):
            listed = runtime.run_sync(self._list_mcp_tools(), self.open_budget_s)
            by_name = {t["function"]["name"]: t for t in listed}
            for task_id, task in self._file_tasks.items():
                if task.tool_names is None:
                    continue
                missing = [n for n in task.tool_names if n not in by_name]
                if missing:
                    raise ValueError(f"openenv task {task_id}: the server has no tool(s) {', '.join(missing)}")
                tools = [by_name[n] for n in task.tool_names] or list(listed)
                task.spec = TaskSpec(**{**task.spec.__dict__, "tools": tools})
        return {task_id: task.spec for task_id, task in self._file_tasks.items()}

    async def _list_mcp_tools(self) -> list[dict[str, Any]]:
        """The tool list of an ``MCPEnvironment`` (a ``list_tools`` action needs no reset)."""
        session = runtime.Session(self._opener(self.replicas.urls[0]), name="openenv list_tools")
        try:
            client = await session.aopen(self.connect_timeout_s + 5.0)
            result = await client.step({"type": "list_tools"})
        except Exception as exc:
            raise _translate(exc) from exc
        finally:
            await session.aclose()
        tools = _observation(result).get("tools")
        if not isinstance(tools, list):
            raise EnvironmentFault("list_tools answered no tool list")
        return [_function_schema(t) for t in tools]

    # -- the pool protocol -------------------------------------------------------------------------------------

    def task_ids(self, split: str | None = None) -> list[str]:
        if split in (None, "all"):
            return list(self._specs)
        if split not in ("train", "test"):
            raise ValueError(f"unknown split {split!r}; use 'train', 'test' or None")
        return [t for t, spec in self._specs.items() if spec.split == split]

    def task(self, task_id: str) -> TaskSpec:
        try:
            return self._specs[task_id]
        except KeyError:
            raise KeyError(f"unknown {self.name} task {task_id!r}") from None

    def start(self, task_id: str, seed: int | None = None) -> OpenEnvEpisode:
        """A fresh episode: a new session on the least busy replica, reset to the task."""
        episode = OpenEnvEpisode(self, self.task(task_id), seed)
        runtime.run_sync(episode._open(), self.open_budget_s)
        return episode

    async def astart(self, task_id: str, seed: int | None = None) -> OpenEnvEpisode:
        episode = OpenEnvEpisode(self, self.task(task_id), seed)
        await runtime.run_async(episode._open(), self.open_budget_s)
        return episode

    def gold_actions(self, task_id: str) -> list[list[ToolCall]]:
        self.task(task_id)
        if self._file_tasks is not None:
            return [list(turn) for turn in self._file_tasks[task_id].gold]
        if task_id not in self._gold:
            url = f"{self.replicas.urls[0]}/envace/gold/{urllib.parse.quote(task_id, safe='/')}"
            turns = _get_json(url, self.headers, self.connect_timeout_s + self.call_timeout_s) or []
            try:
                self._gold[task_id] = [[ToolCall.from_dict(c) for c in turn] for turn in turns]
            except (ValueError, TypeError, AttributeError) as exc:
                raise EnvironmentFault(f"GET {url}: malformed gold ({exc})") from None
        return [list(turn) for turn in self._gold[task_id]]

    def replay(self, task_id: str, actions: Sequence[Sequence[ToolCall]]) -> Verdict:
        """envace-served: the served pool's own ``replay`` (server-side, one round trip); generic: a fresh session,
        the calls, verify."""
        if not self.server_tasks:
            return super().replay(task_id, actions)
        episode = self.start(task_id)
        try:
            return runtime.run_sync(episode._replay_on_server(actions), self.call_budget_s)
        finally:
            episode.close()

    def close(self) -> None:
        """Stop the servers this pool launched (episodes still open lose their server)."""
        if self.servers is not None:
            self.servers.stop()


_CLIENT: type | None = None


def _client_class() -> type:
    """``GenericEnvClient`` that never reconnects. Its ``_send`` reconnects a closed socket, and a new socket is a
    new server-side environment, not reset: after a server restart between two calls, the episode's next call would
    run on a fresh environment and come back as the model's error. Here a closed socket raises ``ConnectionError``
    (:class:`EnvironmentUnavailable`) instead."""
    global _CLIENT
    if _CLIENT is None:
        from openenv.core import GenericEnvClient
        from websockets.protocol import State

        class OneSessionClient(GenericEnvClient):
            async def _ensure_connected(self) -> None:
                if self._ws is None or self._ws.state is not State.OPEN:
                    raise ConnectionError("the episode's WebSocket session is closed (a new one would be a fresh, "
                                          "un-reset environment)")
                await super()._ensure_connected()

        _CLIENT = OneSessionClient
    return _CLIENT


def _import_client() -> None:
    """Import OpenEnv's client here (a slow import: docs/results/env_serving.md), not on the I/O loop; a missing
    package is one line."""
    try:
        import openenv.core  # noqa: F401
    except ModuleNotFoundError as exc:
        raise ConfigurationError(f"the openenv pool needs the 'openenv' package ({exc}); it is installed "
                                 f"without its dependencies from requirements/no-deps.txt") from None
