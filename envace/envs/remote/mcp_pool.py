"""The ``mcp`` pool: tasks on real MCP tool servers (stdio or streamable HTTP), the reference one ``mcp-server-git``.

A task file (:mod:`envace.envs.remote.taskfile`) names, per task, the server, the instruction, the tool subset the
model sees, the workspace the episode starts from, the verifier and the gold calls. The pool's kwargs::

    tasks: path/to/tasks.jsonl            # or a directory of *.jsonl (default: the shipped git tasks)
    servers:                              # named; a task names one (default: "git" below)
      git: {command: [mcp-server-git, --repository, "{root}"], scope: worker, bind: {repo_path: "{workspace}"},
            workspace: {kind: git}}
      kv: {url: "http://host:8000/mcp", headers: {Authorization: "Bearer ${KV_TOKEN}"}, scope: session}
    call_timeout_s: 30                    # per tool call (and per verifier call)
    connect_timeout_s: 60                 # starting a server and its MCP handshake

``scope: worker`` runs one server per pool and process, confined to a per-process root directory (``{root}``, a git
repository: mcp-server-git's ``--repository`` must be one), and gives every episode its own repository under it
(``{workspace}``). The model never names the repository: ``bind`` injects ``repo_path`` on every call and removes it
from the schemas the model reads, so one rollout cannot reach another's repository. ``scope: episode`` starts a
server per episode with ``{root}`` = ``{workspace}`` (a server start each: docs/results/env_serving.md). A ``url:``
server (streamable HTTP) gets a session per episode (``scope: session``); it has no workspace here, so its tasks use
``tool`` verifiers, its fork opens a new session and replays the episode's calls, and a 401/403/404 stops the run
(:class:`~envllm.ConfigurationError`). A relative ``command[0]`` or ``cwd`` in a
server resolves against the task file's folder; a bare ``command[0]`` is looked up on ``PATH``, then beside the
running Python (a venv's console scripts). Every client lives on the process's remote-I/O loop
(:mod:`envace.envs.remote.runtime`): a lost server raises :class:`~envace.envs.base.EnvironmentUnavailable` (the
rollout is masked) and the pool starts a new server for the next episode.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
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
    replay_replying,
)
from envace.envs.remote.runtime import Session, run_async, run_sync
from envace.envs.remote.taskfile import TaskRecord, check_tools, describe_check, load_tasks, task_files
from envllm import ConfigurationError

__all__ = ["DEFAULT_TASKS", "MAX_OUTPUT_CHARS", "MCPEpisode", "MCPPool", "ServerConfig", "build_git_workspace",
           "git_checks", "openai_tool"]

POOL_NAME = "mcp"
#: observation text cut (the agent loop cuts at the same length)
MAX_OUTPUT_CHARS = 65536
#: the shipped git tasks
DEFAULT_TASKS = Path(__file__).with_name("tasks") / "mcp_git.jsonl"
DEFAULT_SERVERS: dict[str, dict[str, Any]] = {
    "git": {"command": ["mcp-server-git", "--repository", "{root}"], "scope": "worker",
            "bind": {"repo_path": "{workspace}"}, "workspace": {"kind": "git"}},
}
_SERVER_KEYS = {"command", "scope", "bind", "workspace", "env", "cwd"}
_URL_KEYS = {"url", "scope", "bind", "headers"}
_ENV_REF = re.compile(r"\$\{(\w+)\}")
_INVALID_PARAMS = -32602  # JSON-RPC: the model's arguments (or tool name) were rejected
_CONNECTION_CLOSED = -32000  # the MCP SDK: the transport closed (the server exited or was killed)
_REQUEST_TIMEOUT = -32001  # the MCP SDK's own read time-out (read_timeout_seconds)
#: tool lists per server command (one listing per process, whatever the number of pools)
_TOOL_CACHE: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
_GIT_CONFIG = "[user]\n\tname = envace\n\temail = envace@example.invalid\n[commit]\n\tgpgsign = false\n"


# -- servers --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerConfig:
    """One named server of the pool's ``servers`` kwarg, checked."""

    name: str
    command: tuple[str, ...]
    scope: str = "worker"
    bind: Mapping[str, str] = field(default_factory=dict)
    workspace: str = "git"
    env: Mapping[str, str] | None = None
    cwd: str | None = None
    url: str | None = None
    headers: Mapping[str, str] | None = None

    @classmethod
    def parse(cls, name: str, raw: Any, folder: Path) -> ServerConfig:
        """Check ``servers.NAME`` (``ValueError`` naming the key) and resolve its executable."""
        key = f"servers.{name}"
        if not isinstance(raw, Mapping):
            raise ValueError(f"{key} must be a mapping")  # noqa: TRY004  (a pool-kwargs mistake)
        if "url" in raw:
            return cls._parse_url(name, raw, key)
        unknown = sorted(set(raw) - _SERVER_KEYS)
        if unknown:
            raise ValueError(f"{key}: unknown key(s) {unknown}; known: {sorted(_SERVER_KEYS)}")
        command = raw.get("command")
        if not isinstance(command, Sequence) or isinstance(command, str) or not command or not all(
                isinstance(a, str) for a in command):
            raise ValueError(f"{key}.command must be a non-empty list of strings")
        scope = raw.get("scope", "worker")
        if scope not in ("worker", "episode"):
            raise ValueError(f"{key}.scope must be 'worker' or 'episode', got {scope!r}")
        bind = raw.get("bind", {})
        if not isinstance(bind, Mapping) or not all(isinstance(v, str) for v in bind.values()):
            raise ValueError(f"{key}.bind must map argument names to strings")
        workspace = raw.get("workspace", {"kind": "git"})
        if not isinstance(workspace, Mapping) or workspace.get("kind") != "git" or set(workspace) != {"kind"}:
            raise ValueError(f"{key}.workspace must be {{kind: git}} (the only workspace kind so far)")
        cwd = raw.get("cwd")
        if cwd is not None:
            cwd = str(folder / cwd)
        env = raw.get("env")
        if env is not None and not (isinstance(env, Mapping) and all(isinstance(v, str) for v in env.values())):
            raise ValueError(f"{key}.env must map names to strings")
        argv = (_executable(str(command[0]), folder, key), *map(str, command[1:]))
        return cls(name, argv, scope, dict(bind), "git", dict(env) if env else None, cwd)

    @classmethod
    def _parse_url(cls, name: str, raw: Mapping[str, Any], key: str) -> ServerConfig:
        """A streamable-HTTP server: a session per episode, no workspace (``${VAR}`` in headers read from the
        environment, so tokens stay out of config files)."""
        unknown = sorted(set(raw) - _URL_KEYS)
        if unknown:
            raise ValueError(f"{key}: unknown key(s) {unknown} for a url server; known: {sorted(_URL_KEYS)}")
        url = raw["url"]
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"{key}.url must be an http(s) URL, got {url!r}")
        if raw.get("scope", "session") != "session":
            raise ValueError(f"{key}.scope must be 'session' for a url server (a session per episode)")
        bind, headers = raw.get("bind", {}), raw.get("headers", {})
        for sub, value in (("bind", bind), ("headers", headers)):
            if not isinstance(value, Mapping) or not all(isinstance(v, str) for v in value.values()):
                raise ValueError(f"{key}.{sub} must map names to strings")
        if any("{workspace}" in v or "{root}" in v for v in bind.values()):
            raise ValueError(f"{key}.bind: a url server has no workspace or root")
        return cls(name, (), "session", dict(bind), "none", url=url,
                   headers={h: _expand_env(v, f"{key}.headers.{h}") for h, v in headers.items()})

    def argv(self, root: str, workspace: str = "") -> list[str]:
        return [a.replace("{root}", root).replace("{workspace}", workspace) for a in self.command]


def _expand_env(value: str, key: str) -> str:
    def var(match: re.Match[str]) -> str:
        if match.group(1) not in os.environ:
            raise ValueError(f"{key}: environment variable {match.group(1)} is not set")
        return os.environ[match.group(1)]

    return _ENV_REF.sub(var, value)


def _executable(cmd: str, folder: Path, key: str) -> str:
    if "/" in cmd:
        path = Path(cmd) if os.path.isabs(cmd) else folder / cmd
        if not path.exists():
            raise ValueError(f"{key}.command: {path} does not exist")
        return str(path)
    found = shutil.which(cmd) or shutil.which(cmd, path=os.path.dirname(sys.executable))
    if not found:
        raise ValueError(f"{key}.command: {cmd!r} is neither on PATH nor beside {sys.executable}")
    return found


def _stdio_opener(argv: list[str], env: Mapping[str, str] | None, cwd: str | None) -> Any:
    """The :class:`Session` opener of a stdio server: spawn it, open an MCP client session, initialize."""

    async def opener(stack: contextlib.AsyncExitStack) -> Any:
        from mcp import ClientSession, StdioServerParameters
        from mcp.client.stdio import stdio_client

        errlog = stack.enter_context(open(os.devnull, "w"))  # noqa: SIM115, ASYNC230  (/dev/null; closed by the stack)
        params = StdioServerParameters(command=argv[0], args=argv[1:], env=dict(env) if env else None, cwd=cwd)
        read, write, *_ = await stack.enter_async_context(stdio_client(params, errlog=errlog))
        client = await stack.enter_async_context(ClientSession(read, write))
        await client.initialize()
        return client

    return opener


def _http_opener(url: str, headers: Mapping[str, str] | None, timeout: float) -> Any:
    """The :class:`Session` opener of a streamable-HTTP server. The SDK reports a refused ``initialize`` as a bare
    "Server returned an error response": the HTTP status is recorded on the way so that a 401/403/404 stops the run
    as a :class:`~envllm.ConfigurationError` naming it."""

    async def opener(stack: contextlib.AsyncExitStack) -> Any:
        import httpx2
        from mcp import ClientSession
        from mcp.client.streamable_http import streamable_http_client

        refused: list[int] = []

        async def record(response: Any) -> None:
            if response.status_code in (401, 403, 404):
                refused.append(response.status_code)

        http = await stack.enter_async_context(httpx2.AsyncClient(
            headers=dict(headers or {}), timeout=timeout, event_hooks={"response": [record]}))
        read, write, *_ = await stack.enter_async_context(streamable_http_client(url, http_client=http))
        client = await stack.enter_async_context(ClientSession(read, write))
        try:
            await client.initialize()
        except Exception as exc:
            if refused:
                raise ConfigurationError(f"the MCP server {url} refused the session: HTTP {refused[0]}",
                                         status_code=refused[0]) from exc
            raise
        return client

    return opener


class _Server:
    """A running server (or, for a url server, a session on it) and its client session; ``broken`` once a call lost
    the transport (the pool then starts a new one for the next episode; the episodes on this one get
    EnvironmentUnavailable)."""

    def __init__(self, cfg: ServerConfig, root: str, workspace: str = "", timeout: float = 30.0) -> None:
        self.cfg = cfg
        self.root = root
        opener = (_http_opener(cfg.url, cfg.headers, timeout) if cfg.url else
                  _stdio_opener(cfg.argv(root, workspace), cfg.env, cfg.cwd))
        self.session: Session[Any] = Session(opener, f"mcp-{cfg.name}")
        self.broken = False

    def open(self, timeout: float) -> _Server:
        self.session.open(timeout)
        return self

    @property
    def client(self) -> Any:
        client = self.session.client
        if client is None or self.session.closed:
            raise EnvironmentUnavailable(f"the {self.cfg.name} server's session is closed")
        return client

    def close(self) -> None:
        self.session.close()

    async def aclose(self) -> None:
        await self.session.aclose()


async def _list_tools(server: _Server) -> list[dict[str, Any]]:
    tools, cursor = [], None
    while True:
        page = await server.client.list_tools(cursor=cursor) if cursor else await server.client.list_tools()
        tools += [{"name": t.name, "description": t.description or "", "input_schema": dict(t.input_schema)}
                  for t in page.tools]
        cursor = getattr(page, "next_cursor", None)
        if not cursor:
            return tools


# -- tool schemas and results ---------------------------------------------------------------------------------------

_VERBATIM = {"default", "const", "enum", "examples"}


def _strip_titles(schema: Any) -> Any:
    """A JSON schema without its ``title`` annotations (property names called "title" stay)."""
    if isinstance(schema, list):
        return [_strip_titles(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "title" and isinstance(value, str):
            continue
        if key in _VERBATIM:
            out[key] = value
        elif key in ("properties", "patternProperties", "$defs", "definitions") and isinstance(value, dict):
            out[key] = {name: _strip_titles(s) for name, s in value.items()}
        else:
            out[key] = _strip_titles(value)
    return out


def openai_tool(tool: Mapping[str, Any], bound: Sequence[str] = ()) -> dict[str, Any]:
    """An MCP tool (``name``, ``description``, ``input_schema``) in OpenAI function form, without ``title`` keys and
    without the arguments the pool binds (they leave ``properties`` and ``required``)."""
    params = _strip_titles(dict(tool["input_schema"]))
    props = {k: v for k, v in (params.get("properties") or {}).items() if k not in bound}
    params["properties"] = props
    if "required" in params:
        params["required"] = [r for r in params["required"] if r not in bound]
    params.setdefault("type", "object")
    return {"type": "function",
            "function": {"name": tool["name"], "description": tool["description"], "parameters": params}}


def _result_text(result: Any) -> str:
    """A tool result as the observation: text contents joined, other contents named, ``Error: `` on an error."""
    content = getattr(result, "content", None)
    if not isinstance(content, list):
        raise EnvironmentFault(f"tool result without a content list: {type(result).__name__}")
    parts = [c.text if getattr(c, "type", None) == "text" else f"[{getattr(c, 'type', 'unknown')} omitted]"
             for c in content]
    text = "\n".join(parts)
    if getattr(result, "is_error", False) and not text.startswith("Error"):
        text = "Error: " + (text or "the tool failed")
    return text[:MAX_OUTPUT_CHARS]


async def _call_tool(server: _Server, name: str, arguments: dict[str, Any], timeout: float) -> str:
    from mcp.shared.exceptions import MCPError

    try:
        result = await server.client.call_tool(name, arguments, read_timeout_seconds=timeout)
    except MCPError as exc:
        if exc.code == _CONNECTION_CLOSED or "connection closed" in str(exc).lower():
            raise EnvironmentUnavailable(f"{server.cfg.name} server: connection closed ({exc.message})") from exc
        if exc.code == _REQUEST_TIMEOUT:
            raise EnvironmentUnavailable(f"{server.cfg.name} server: {name}: no answer within {timeout:g}s") from exc
        if exc.code == _INVALID_PARAMS:  # the model's arguments: an observation it reads
            return f"Error: {exc.message}"[:MAX_OUTPUT_CHARS]
        raise EnvironmentFault(f"{server.cfg.name} server: JSON-RPC error {exc.code}: {exc.message}") from exc
    return _result_text(result)


# -- git workspaces and checks ---------------------------------------------------------------------------------------


def _git(repo: str | Path, *args: str) -> str:
    proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"git {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")
    return proc.stdout


def _write(repo: Path, files: Mapping[str, str]) -> None:
    for rel, text in files.items():
        path = repo / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def build_git_workspace(path: str | Path, steps: Sequence[Mapping[str, Any]]) -> None:
    """A git repository at ``path`` (branch ``main``, its own user.name/email) after the task's workspace steps."""
    repo = Path(path)
    _git(repo.parent, "init", "-q", "-b", "main", str(repo))
    with open(repo / ".git" / "config", "a", encoding="utf-8") as fh:
        fh.write(_GIT_CONFIG)
    for step in steps:
        if "commit" in step:
            _write(repo, step.get("files", {}))
            _git(repo, "add", "-A")
            _git(repo, "commit", "-q", "--allow-empty", "-m", step["commit"])
        elif "branch" in step:
            _git(repo, "branch", step["branch"])
        elif "checkout" in step:
            _git(repo, "checkout", "-q", step["checkout"])
        elif "write" in step:
            _write(repo, step["write"])
        elif "stage" in step:
            _git(repo, "add", "--", *step["stage"])


def _ref_ok(repo: Path, ref: str) -> bool:
    proc = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"],
                          capture_output=True, check=False)
    return proc.returncode == 0


def _git_check(repo: Path, check: Mapping[str, Any], replies: Sequence[str]) -> bool:
    on = check.get("on", "HEAD")
    if "branch" in check:
        return _ref_ok(repo, f"refs/heads/{check['branch']}") == check.get("exists", True)
    if "head_branch" in check:
        return _git(repo, "symbolic-ref", "-q", "--short", "HEAD").strip() == check["head_branch"]
    if "reply_contains" in check:
        return check["reply_contains"].lower() in "\n".join(replies).lower()
    if "clean" in check:
        return (not _git(repo, "status", "--porcelain", "--untracked-files=all").strip()) == check["clean"]
    if "staged" in check:
        return set(_git(repo, "diff", "--cached", "--name-only").split("\n")) - {""} == set(check["staged"])
    if "file_exists" in check:
        return (repo / check["file_exists"]).exists()
    if not _ref_ok(repo, on):
        return False
    if "commit_message" in check:
        return _git(repo, "log", "-1", "--format=%B", on).strip() == check["commit_message"].strip()
    if "commits" in check:
        return int(_git(repo, "rev-list", "--count", on)) == check["commits"]
    path = check.get("tracked", check.get("not_tracked"))
    present = bool(_git(repo, "ls-tree", "-r", "--name-only", on, "--", path).strip())
    return present if "tracked" in check else not present


def git_checks(repo: str | Path, checks: Sequence[Mapping[str, Any]], replies: Sequence[str] = ()
               ) -> list[tuple[str, bool]]:
    """Every git check (in words) with its outcome on the repository's end state and the replies. Reads the
    repository with the ``git`` CLI; never compares hashes or authors."""
    return [(describe_check(c), _git_check(Path(repo), c, replies)) for c in checks]


def _verdict(task_id: str, results: list[tuple[str, bool]], reward: str) -> Verdict:
    n_ok = sum(ok for _, ok in results)
    passed = n_ok == len(results)
    failed = [text for text, ok in results if not ok]
    return Verdict(
        reward=float(passed) if reward == "binary" else n_ok / len(results),
        passed=passed,
        details={"task_id": task_id, "checks": [{"check": t, "passed": ok} for t, ok in results],
                 "passed_checks": n_ok, "total_checks": len(results),
                 "error_type": None if passed else "mcp:check_failed",
                 "reason": "" if passed else "failed: " + "; ".join(failed)},
    )


# -- the per-process part of a pool ----------------------------------------------------------------------------------


class _ProcessState:
    """What a pool holds in one process: its temp dir (workspaces under ``root``, a git repository, task templates
    under ``templates``) and its worker-scope servers. A forked child makes its own on first use."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.tmp = tempfile.mkdtemp(prefix="envace-mcp-")
        self.root = os.path.join(self.tmp, "root")
        os.mkdir(self.root)
        _git(self.root, "init", "-q")
        self.templates: dict[str, str] = {}
        self.servers: dict[str, _Server] = {}
        self.lock = threading.Lock()
        self.count = 0
        self._finalizer = weakref.finalize(self, _remove_tmp, self.tmp, self.pid)

    def new_dir(self, prefix: str) -> str:
        with self.lock:
            self.count += 1
            return os.path.join(self.root, f"{prefix}-{self.count:06d}")

    def close(self) -> None:
        for server in list(self.servers.values()):
            server.close()
        self.servers.clear()
        self._finalizer()


def _remove_tmp(path: str, pid: int) -> None:
    if os.getpid() == pid:
        shutil.rmtree(path, ignore_errors=True)


def _safe(task_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", task_id)


# -- the pool --------------------------------------------------------------------------------------------------------


@register_pool(POOL_NAME)
class MCPPool(EnvironmentPool):
    """Tasks on MCP tool servers (module docstring). Constructing it checks the task files and lists the tools of
    every server a task names (one server start per distinct command and process, cached)."""

    name = POOL_NAME

    def __init__(self, tasks: str | os.PathLike[str] | None = None, servers: Mapping[str, Any] | None = None,
                 call_timeout_s: float = 30.0, connect_timeout_s: float = 60.0) -> None:
        files = task_files(tasks if tasks is not None else DEFAULT_TASKS)
        folder = files[0].parent
        if servers is not None and not isinstance(servers, Mapping):
            raise ValueError("servers must map server names to their configs")
        raw = {**DEFAULT_SERVERS, **dict(servers or {})}
        self.servers = {name: ServerConfig.parse(str(name), cfg, folder) for name, cfg in raw.items()}
        for key, value in (("call_timeout_s", call_timeout_s), ("connect_timeout_s", connect_timeout_s)):
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{key} must be a positive number of seconds, got {value!r}")
        self.call_timeout_s, self.connect_timeout_s = float(call_timeout_s), float(connect_timeout_s)
        self._records = {r.task_id: r for r in load_tasks(files, self.servers)}
        for rec in self._records.values():
            if self.servers[rec.data["server"]].url and (rec.data["verifier"]["kind"] != "tool" or rec.steps):
                raise ValueError(f"{rec.where}: a task on the url server {rec.data['server']!r} has no workspace and "
                                 "needs a 'tool' verifier (its state is not on this machine)")
        self._state: _ProcessState | None = None
        self._state_lock = threading.Lock()
        used = sorted({r.data["server"] for r in self._records.values()})
        try:
            self._tools = {name: self._server_tools(self.servers[name]) for name in used}
            check_tools(list(self._records.values()), {n: [t["name"] for t in ts] for n, ts in self._tools.items()})
        except BaseException:
            self.close()  # the worker servers started to list the tools
            raise
        self._specs: dict[str, TaskSpec] = {}

    # -- per process -------------------------------------------------------------------------------------------

    def _proc(self) -> _ProcessState:
        with self._state_lock:
            if self._state is None or self._state.pid != os.getpid():
                self._state = _ProcessState()
            return self._state

    def _worker_server(self, cfg: ServerConfig) -> _Server:
        """The process's server of ``cfg`` (worker scope), started (again, when the last one broke) on demand."""
        st = self._proc()
        with st.lock:
            server = st.servers.get(cfg.name)
            if server is not None and (server.broken or server.session.closed):
                server.close()
                server = None
            if server is None:
                server = st.servers[cfg.name] = _Server(cfg, st.root).open(self.connect_timeout_s)
            return server

    def _server_tools(self, cfg: ServerConfig) -> list[dict[str, Any]]:
        key = (cfg.url, cfg.command, cfg.cwd, tuple(sorted((cfg.env or {}).items())))
        if key not in _TOOL_CACHE:
            if cfg.url:
                server = self._session_server(cfg)
                try:
                    _TOOL_CACHE[key] = run_sync(_list_tools(server), self.connect_timeout_s)
                finally:
                    server.close()
            elif cfg.scope == "worker":
                _TOOL_CACHE[key] = run_sync(_list_tools(self._worker_server(cfg)), self.connect_timeout_s)
            else:
                with tempfile.TemporaryDirectory(prefix="envace-mcp-list-") as tmp:
                    build_git_workspace(os.path.join(tmp, "ws"), [])
                    server = _Server(cfg, os.path.join(tmp, "ws"), os.path.join(tmp, "ws"))
                    try:
                        server.open(self.connect_timeout_s)
                        _TOOL_CACHE[key] = run_sync(_list_tools(server), self.connect_timeout_s)
                    finally:
                        server.close()
        return _TOOL_CACHE[key]

    def _template(self, rec: TaskRecord) -> str:
        """The task's initial workspace, built once per process: episodes copy it instead of running its git steps,
        which take longer (docs/results/env_serving.md)."""
        st = self._proc()
        path = st.templates.get(rec.task_id)
        if path is None:
            path = os.path.join(st.tmp, "templates", _safe(rec.task_id))
            if os.path.exists(path):
                shutil.rmtree(path)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            build_git_workspace(path, rec.steps)
            st.templates[rec.task_id] = path
        return path

    # -- protocol ----------------------------------------------------------------------------------------------

    def _record(self, task_id: str) -> TaskRecord:
        try:
            return self._records[task_id]
        except KeyError:
            raise KeyError(f"unknown {self.name} task {task_id!r}") from None

    def task_ids(self, split: str | None = None) -> list[str]:
        if split in (None, "all"):
            return list(self._records)
        if split not in ("train", "test"):
            raise ValueError(f"unknown split {split!r}; use 'train', 'test' or None")
        return [t for t, r in self._records.items() if r.data["split"] == split]

    def task(self, task_id: str) -> TaskSpec:
        spec = self._specs.get(task_id)
        if spec is None:
            spec = self._specs[task_id] = self._make_spec(self._record(task_id))
        return spec

    def _make_spec(self, rec: TaskRecord) -> TaskSpec:
        data = rec.data
        cfg = self.servers[data["server"]]
        by_name = {t["name"]: t for t in self._tools[cfg.name]}
        workspace = data.get("workspace") or {}
        return TaskSpec(
            pool=self.name, task_id=rec.task_id, env_id=data.get("env_id") or f"mcp-{cfg.name}",
            category=data["category"], split=data["split"], system_prompt=data.get("system_prompt"),
            first_user_message=data["instruction"],
            tools=[openai_tool(by_name[n], tuple(cfg.bind)) for n in data["tools"]],
            initial_state_summary=workspace.get("description", "") if isinstance(workspace, dict) else "",
            verifier_text="; ".join(describe_check(c) for c in data["verifier"]["checks"]),
            metadata={"server": cfg.name, "turns": 1 + len(data.get("turns", [])), "source": rec.where},
        )

    def start(self, task_id: str, **kwargs: Any) -> MCPEpisode:
        """A fresh episode: a copy of the task's workspace and a session on its server."""
        if kwargs:
            raise TypeError(f"unexpected start options {sorted(kwargs)}")
        rec = self._record(task_id)
        cfg = self.servers[rec.data["server"]]
        if cfg.url:
            return MCPEpisode(self, rec, self.task(task_id), self._session_server(cfg), None)
        st = self._proc()
        workspace = st.new_dir("ep")
        shutil.copytree(self._template(rec), workspace, symlinks=True)
        try:
            server = self._episode_server(cfg, workspace)
        except BaseException:
            shutil.rmtree(workspace, ignore_errors=True)
            raise
        return MCPEpisode(self, rec, self.task(task_id), server, workspace)

    def _episode_server(self, cfg: ServerConfig, workspace: str) -> _Server:
        if cfg.scope == "worker":
            return self._worker_server(cfg)
        return _Server(cfg, workspace, workspace).open(self.connect_timeout_s)

    def _session_server(self, cfg: ServerConfig) -> _Server:
        """A new session on a url server (one per episode: the server keeps each session's state apart)."""
        return _Server(cfg, "", "", self.call_timeout_s).open(self.connect_timeout_s)

    def gold_actions(self, task_id: str) -> list[list[ToolCall]]:
        gold = self._record(task_id).data.get("gold") or []
        return [[ToolCall(c["name"], dict(c.get("arguments", {}))) for c in turn] for turn in gold]

    def user_messages(self, task_id: str) -> list[str]:
        """The task's user messages, one per turn."""
        data = self._record(task_id).data
        return [data["instruction"], *(t["user"] for t in data.get("turns", []))]

    def replay(self, task_id: str, actions: Sequence[Sequence[ToolCall]],
               replies: Sequence[str] | None = None) -> Verdict:
        """Execute ``actions`` (one list per user turn), end each turn with a reply, verify, close.

        ``replies[t]`` ends turn ``t``; by default it is the turn's observations joined by newlines, so a reply check
        passes iff the turn's calls retrieved what was asked."""
        return replay_replying(self.start(task_id), actions, replies)

    def close(self) -> None:
        """Stop this process's servers of the pool and remove its workspaces."""
        with self._state_lock:
            state, self._state = self._state, None
        if state is not None and state.pid == os.getpid():
            state.close()


# -- the episode -----------------------------------------------------------------------------------------------------


class MCPEpisode(Episode):
    """A live task on an MCP server: its own workspace (a git repository), a session on its server, the turn
    pointer and the replies.

    Calls outside the task's tool subset are refused without a round trip. The pool's bound arguments are injected
    on every call (a value the model passes for one is overwritten). ``fork`` copies the workspace (``cp -a``
    equivalent) and shares the worker server (an episode-scope server starts a new one, which costs far more:
    docs/results/env_serving.md)."""

    remote = True

    def __init__(self, pool: MCPPool, rec: TaskRecord, spec: TaskSpec, server: _Server, workspace: str | None
                 ) -> None:
        self.spec = spec
        self._pool = pool
        self._rec = rec
        self._server = server
        self._owns_server = server.cfg.scope != "worker"
        self.workspace = workspace
        self.calls: list[ToolCall] = []  # the calls sent to the server (a url episode's fork replays them)
        self._subset = set(rec.data["tools"])
        self._turns = [t["user"] for t in rec.data.get("turns", [])]
        self.replies: list[str] = []
        self._turn = 0
        self._done = False
        self.closed = False

    @property
    def done(self) -> bool:
        return self._done

    def tools(self) -> list[dict[str, Any]]:
        return list(self.spec.tools)

    # -- calls ---------------------------------------------------------------------------------------------------

    def _refusal(self, call: ToolCall | Mapping[str, Any]) -> tuple[ToolCall | None, str | None]:
        if self.closed:
            return None, "Error: the episode is closed"
        if not isinstance(call, ToolCall):
            try:
                call = ToolCall.from_dict(call)
            except ValueError as exc:
                return None, f"Error: {exc}"
        if call.name not in self._subset:
            return None, f"Error: unknown tool {call.name!r}; available: {', '.join(self.spec_tool_names())}"
        return call, None

    def spec_tool_names(self) -> list[str]:
        return [t["function"]["name"] for t in self.spec.tools]

    def _arguments(self, call: ToolCall) -> dict[str, Any]:
        bound = {k: v.replace("{workspace}", self.workspace or "").replace("{root}", self._server.root)
                 for k, v in self._server.cfg.bind.items()}
        return {**call.arguments, **bound}

    def _call(self, call: ToolCall | Mapping[str, Any]) -> tuple[Any, str]:
        """The server call for ``call`` (a coroutine, recorded as executed), or None and the refusal's text."""
        checked, refusal = self._refusal(call)
        if refusal is not None or checked is None:
            return None, refusal or ""
        self.calls.append(checked)
        timeout = self._pool.call_timeout_s
        return _call_tool(self._server, checked.name, self._arguments(checked), timeout), ""

    @contextlib.contextmanager
    def _marking_a_lost_server(self) -> Any:
        try:
            yield
        except EnvironmentUnavailable:  # the next episode starts a new server
            self._server.broken = True
            raise

    def execute(self, call: ToolCall | Mapping[str, Any]) -> str:
        coro, refusal = self._call(call)
        if coro is None:
            return refusal
        with self._marking_a_lost_server():
            return run_sync(coro, self._pool.call_timeout_s)

    async def aexecute(self, call: ToolCall | Mapping[str, Any]) -> str:
        coro, refusal = self._call(call)
        if coro is None:
            return refusal
        with self._marking_a_lost_server():
            return await run_async(coro, self._pool.call_timeout_s)

    # -- turns, verifier -----------------------------------------------------------------------------------------

    def end_turn(self, assistant_text: str) -> str | None:
        if self._done:
            return None
        self.replies.append(assistant_text or "")
        self._turn += 1
        if self._turn > len(self._turns):
            self._done = True
            return None
        return self._turns[self._turn - 1]

    def verify(self) -> Verdict:
        if self.closed:
            raise RuntimeError("verify after close: the workspace is gone")
        verifier = self._rec.data["verifier"]
        if verifier["kind"] == "git":
            assert self.workspace is not None  # the pool allows git verifiers only on workspace servers
            results = git_checks(self.workspace, verifier["checks"], self.replies)
        else:
            results = [self._tool_check(c) for c in verifier["checks"]]
        return _verdict(self.spec.task_id, results, verifier.get("reward", "binary"))

    def _tool_check(self, check: Mapping[str, Any]) -> tuple[str, bool]:
        call = ToolCall(check["call"]["name"], dict(check["call"].get("arguments", {})))
        timeout = self._pool.call_timeout_s
        text = run_sync(_call_tool(self._server, call.name, self._arguments(call), timeout), timeout)
        ok = check["contains"] in text if "contains" in check else check["absent"] not in text
        return describe_check(check), ok and not text.startswith("Error")

    # -- fork, close ---------------------------------------------------------------------------------------------

    def fork(self) -> MCPEpisode:
        """An independent copy: the workspace copied (``cp -a``), the same worker server (or a new episode server);
        on a url server, a new session and a replay of this episode's calls (one session plus n calls)."""
        if self.closed:
            raise RuntimeError("fork after close")
        if self.workspace is None:
            return self._fork_by_replay()
        workspace = self._pool._proc().new_dir("fork")
        shutil.copytree(self.workspace, workspace, symlinks=True)
        try:
            server = self._server if not self._owns_server else self._pool._episode_server(self._server.cfg,
                                                                                            workspace)
        except BaseException:
            shutil.rmtree(workspace, ignore_errors=True)
            raise
        ep = MCPEpisode(self._pool, self._rec, self.spec, server, workspace)
        ep.replies, ep._turn, ep._done, ep.calls = list(self.replies), self._turn, self._done, list(self.calls)
        return ep

    def _fork_by_replay(self) -> MCPEpisode:
        ep = MCPEpisode(self._pool, self._rec, self.spec, self._pool._session_server(self._server.cfg), None)
        try:
            for call in self.calls:
                ep.execute(call)
        except BaseException:
            ep.close()
            raise
        ep.replies, ep._turn, ep._done = list(self.replies), self._turn, self._done
        return ep

    def close(self) -> None:
        """Remove the workspace and stop an episode-scope server (idempotent)."""
        if self.closed:
            return
        self.closed = True
        if self._owns_server:
            self._server.close()
        if self.workspace is not None:
            shutil.rmtree(self.workspace, ignore_errors=True)

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._owns_server:
            await self._server.aclose()
        if self.workspace is not None:
            await asyncio.to_thread(shutil.rmtree, self.workspace, True)
