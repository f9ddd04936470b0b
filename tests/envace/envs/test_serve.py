"""``python -m envace.envs serve``: envace pools served over OpenEnv and MCP, consumed through the SDKs' own clients.

The round trip (issue 45's "must show"): for each protocol and a sample of tasks of ``synthetic``,
``bfcl_multi_turn`` and ``tau2``, the gold actions and one perturbation of them are played in process and against
the served app, step by step (the same driver over an in-process episode and over the client) and through the
server-side replay action (against ``pool.replay``); every verdict must agree. The synthetic servers run as
subprocesses of the real CLI (with a bearer token); the others as uvicorn servers in a thread of this process.
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
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from envace.envs.base import EnvironmentPool, Episode, ToolCall, get_pool
from envace.envs.serve import bind_socket, gold_turns, make_server, parse_turns, verdict_dict

REPO = Path(__file__).resolve().parents[3]
TOKEN = "s3cret-token"
PROTOCOLS = ("openenv", "mcp")
#: tasks sampled per pool, and how each turn of stepwise play is ended (None: turns are not ended; τ² served without
#: a user simulator cannot answer, and its replay ends the conversation itself)
SAMPLES = {"synthetic": 16, "bfcl_multi_turn": 4, "tau2": 2, "worldbook": 6}
CLOSING = {"synthetic": "observations", "bfcl_multi_turn": "", "tau2": None, "worldbook": "observations"}
POOL_KWARGS: dict[str, dict[str, Any]] = {"synthetic": {}, "bfcl_multi_turn": {}, "tau2": {"domains": ["airline"]}}


def _load(name: str) -> EnvironmentPool:
    with contextlib.redirect_stdout(sys.stderr):  # τ² prints its registry at import
        return get_pool(name, **POOL_KWARGS[name])


# --------------------------------------------------------------------------------------------------
# servers
# --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def served_in_thread(pool: EnvironmentPool, protocol: str, **kwargs: Any) -> Iterator[str]:
    """A real uvicorn server for ``pool`` in a thread of this process; yields its URL once it has started."""
    sock = bind_socket("127.0.0.1", 0)
    ready = threading.Event()
    urls: list[str] = []
    server = make_server(pool, protocol, sock, on_ready=lambda u: (urls.append(u), ready.set()), **kwargs)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        assert ready.wait(120), "the server did not start"
        yield urls[0]
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()


class CliServer:
    """``python -m envace.envs serve`` as a subprocess; ``url`` from the one line it prints when ready."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        cmd = [sys.executable, "-m", "envace.envs", *args]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, **(env or {})})
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        match = re.search(r"(http://\S+)", line)
        if match is None:
            self.stop()
            raise AssertionError(f"no URL line: {line!r}; stderr: {self.stderr}")
        self.ready_line = line.strip()
        self.url = match.group(1)
        self.stderr = ""

    def rss_mb(self) -> float:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024  # type: ignore[union-attr]

    def stop(self) -> int:
        self.proc.terminate()
        try:
            _, self.stderr = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, self.stderr = self.proc.communicate()
        return self.proc.returncode


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("serve") / "token"
    path.write_text(TOKEN + "\n")
    return str(path)


@pytest.fixture(scope="module")
def cli_servers(token_file: str) -> Iterator[dict[str, CliServer]]:
    """The synthetic pool served by the real CLI over both protocols, behind a bearer token."""
    servers: dict[str, CliServer] = {}
    try:
        for protocol in PROTOCOLS:
            servers[protocol] = CliServer("serve", "--pool", "synthetic", "--protocol", protocol, "--port", "0",
                                          "--token-file", token_file)
        yield servers
    finally:
        for server in servers.values():
            # SIGTERM: uvicorn shuts down cleanly, then re-raises the signal (the exit status says what stopped it)
            assert server.stop() in (0, -signal.SIGTERM), server.stderr
            assert "Traceback" not in server.stderr, server.stderr


# --------------------------------------------------------------------------------------------------
# the same play over an in-process episode and over each protocol's client
# --------------------------------------------------------------------------------------------------


class InProcess:
    def __init__(self, pool: EnvironmentPool, task_id: str) -> None:
        self.pool, self.task_id, self.ep = pool, task_id, pool.start(task_id)

    async def call(self, call: dict[str, Any]) -> str:
        return self.ep.execute(ToolCall.from_dict(call))

    async def end_turn(self, text: str) -> bool:
        return self.ep.end_turn(text) is None

    async def verify(self) -> dict[str, Any]:
        return verdict_dict(self.ep.verify())

    async def replay(self, turns: list[list[dict[str, Any]]]) -> dict[str, Any]:
        return verdict_dict(self.pool.replay(self.task_id, parse_turns(turns)))


class OpenEnvClient:
    def __init__(self, env: Any) -> None:
        self.env = env

    async def call(self, call: dict[str, Any]) -> str:
        result = await self.env.step({"kind": "call", "name": call["name"], "arguments": call.get("arguments", {})})
        return result.observation["text"]

    async def end_turn(self, text: str) -> bool:
        result = await self.env.step({"kind": "end_turn", "text": text})
        return bool(result.observation["metadata"].get("ended"))

    async def verify(self) -> dict[str, Any]:
        return await self._verdict({"kind": "verify"})

    async def replay(self, turns: list[list[dict[str, Any]]]) -> dict[str, Any]:
        return await self._verdict({"kind": "replay", "actions": turns})

    async def _verdict(self, action: dict[str, Any]) -> dict[str, Any]:
        result = await self.env.step(action)
        verdict = result.observation["metadata"]["verdict"]
        assert result.done and result.reward == verdict["reward"]
        return verdict


class McpClient:
    def __init__(self, session: Any) -> None:
        self.s = session

    async def call(self, call: dict[str, Any]) -> str:
        result = await self.s.call_tool(call["name"], call.get("arguments", {}))
        return "\n".join(c.text for c in result.content)

    async def end_turn(self, text: str) -> bool:
        return bool((await self._json("__end_turn__", {"text": text}))["ended"])

    async def verify(self) -> dict[str, Any]:
        return await self._json("__verify__", {})

    async def replay(self, turns: list[list[dict[str, Any]]]) -> dict[str, Any]:
        return await self._json("__replay__", {"actions": turns})

    async def _json(self, name: str, args: dict[str, Any]) -> dict[str, Any]:
        result = await self.s.call_tool(name, args)
        assert not result.is_error, result.content
        return json.loads(result.content[0].text)


def _headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


@contextlib.asynccontextmanager
async def openenv_session(url: str, task_id: str, token: str | None = None) -> AsyncIterator[Any]:
    from openenv.core import GenericEnvClient

    async with GenericEnvClient(base_url=url, headers=_headers(token)) as env:
        first = await env.reset(task_id=task_id)
        yield env, first


@contextlib.asynccontextmanager
async def mcp_session(url: str, task_id: str | None, token: str | None = None, control: bool = True,
                      terminate_on_close: bool = True, statuses: list[int] | None = None) -> AsyncIterator[Any]:
    """An initialized MCP client session on ``url?task_id=...``; ``statuses`` collects the HTTP status codes."""
    import httpx2
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    headers = {**_headers(token), **({"X-Envace-Control": "1"} if control else {})}
    target = f"{url}?task_id={task_id}" if task_id else url

    async def record(response: Any) -> None:
        if statuses is not None:
            statuses.append(response.status_code)

    async with (
        httpx2.AsyncClient(headers=headers, timeout=120, event_hooks={"response": [record]}) as http,
        streamable_http_client(target, http_client=http, terminate_on_close=terminate_on_close) as (r, w, *_),
        ClientSession(r, w) as session,
    ):
        await session.initialize()
        yield session


@contextlib.asynccontextmanager
async def served(protocol: str, url: str, task_id: str, token: str | None) -> AsyncIterator[Any]:
    if protocol == "openenv":
        async with openenv_session(url, task_id, token) as (env, _):
            yield OpenEnvClient(env)
    else:
        async with mcp_session(url, task_id, token) as session:
            yield McpClient(session)


async def play(side: Any, turns: list[list[dict[str, Any]]], closing: str | None) -> dict[str, Any]:
    """Stepwise play: each turn's calls, the turn ended (with ``closing``, or the turn's observations joined when
    ``closing == "observations"``; not at all when ``None``), then the verifier."""
    for turn in turns:
        observations = [await side.call(call) for call in turn]
        if closing is not None:
            reply = "\n".join(observations) if closing == "observations" else closing
            if await side.end_turn(reply):
                break
    return await side.verify()


def perturb(turns: list[list[dict[str, Any]]], rng: random.Random) -> list[list[dict[str, Any]]]:
    """The turns with one call's argument changed (a number + 1, a string + "x") or, without arguments, dropped."""
    out = [[dict(c) for c in turn] for turn in turns]
    where = [(t, c) for t, turn in enumerate(out) for c in range(len(turn))]
    if not where:
        return out
    t, c = rng.choice(where)
    args = dict(out[t][c].get("arguments") or {})
    keys = [k for k, v in sorted(args.items()) if isinstance(v, (int, float, str)) and not isinstance(v, bool)]
    if keys and rng.random() < 0.7:
        k = rng.choice(keys)
        args[k] = args[k] + 1 if not isinstance(args[k], str) else args[k] + "x"
        out[t][c]["arguments"] = args
    else:
        del out[t][c]
    return out


class Cases:
    """A pool's sampled tasks, each with its gold turns and one perturbation, and their in-process verdicts (by way
    of playing: ``stepwise`` and ``replay``), computed once for both protocols."""

    def __init__(self, pool: EnvironmentPool) -> None:
        self.pool, self.closing = pool, CLOSING[pool.name]
        rng = random.Random(f"serve-{pool.name}")
        shuffled = sorted(pool.task_ids())
        rng.shuffle(shuffled)
        self.task_ids: list[str] = []
        self.cases = []
        for tid in shuffled:  # tasks whose gold makes calls (an empty one has nothing to perturb)
            gold = gold_turns(pool, tid)
            if gold and any(gold):
                self.task_ids.append(tid)
                self.cases += [(tid, "gold", gold), (tid, "perturbed", perturb(gold, rng))]
            if len(self.task_ids) == SAMPLES[pool.name]:
                break
        self.expected = [asyncio.run(self._in_process(tid, turns)) for tid, _, turns in self.cases]

    async def _in_process(self, task_id: str, turns: list[list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
        local = InProcess(self.pool, task_id)
        try:
            return {"stepwise": await play(local, turns, self.closing), "replay": await local.replay(turns)}
        finally:
            local.ep.close()

    async def _served(self, protocol: str, url: str, token: str | None) -> list[dict[str, dict[str, Any]]]:
        out = []
        for tid, _, turns in self.cases:
            async with served(protocol, url, tid, token) as remote:
                out.append({"stepwise": await play(remote, turns, self.closing), "replay": await remote.replay(turns)})
        return out

    def roundtrip(self, protocol: str, url: str, token: str | None = None) -> tuple[int, int, list[Any]]:
        """Play every case against the served app; print and return (agreeing verdicts, verdicts, mismatches)."""
        start = time.perf_counter()
        got = asyncio.run(self._served(protocol, url, token))
        per_task = (time.perf_counter() - start) / len(self.task_ids)
        agree = total = 0
        mismatches = []
        for (tid, label, _), want, have in zip(self.cases, self.expected, got, strict=True):
            for way in ("stepwise", "replay"):
                ok = want[way] == have[way]  # the whole verdict: reward, passed and the checker's details
                agree, total = agree + ok, total + 1
                if not ok:
                    mismatches.append((tid, label, way, want[way], have[way]))
        replays = [(label, want["replay"]["passed"]) for (_, label, _), want in zip(self.cases, self.expected,
                                                                                     strict=True)]
        print(f"serve roundtrip {protocol} {self.pool.name}: {agree}/{total} "
              f"({per_task * 1000:.0f} ms per task served, gold and perturbed, stepwise and replayed; in process "
              f"{sum(p for lab, p in replays if lab == 'gold')} gold replays pass, "
              f"{sum(not p for lab, p in replays if lab == 'perturbed')} perturbed fail, of {len(self.task_ids)})")
        return agree, total, mismatches


@pytest.fixture(scope="module")
def synthetic() -> EnvironmentPool:
    return _load("synthetic")


@pytest.fixture(scope="module")
def synthetic_cases(synthetic: EnvironmentPool) -> Cases:
    return Cases(synthetic)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_roundtrip_synthetic_through_the_cli(protocol: str, synthetic_cases: Cases,
                                             cli_servers: dict[str, CliServer]) -> None:
    server = cli_servers[protocol]
    agree, total, bad = synthetic_cases.roundtrip(protocol, server.url, TOKEN)
    print(f"serve rss {protocol} synthetic after {len(synthetic_cases.cases)} sessions: {server.rss_mb():.0f} MB")
    assert agree == total, bad[:3]


@pytest.mark.parametrize("pool_name", ["bfcl_multi_turn", "tau2"])
def test_roundtrip_benchmarks(pool_name: str) -> None:
    cases = Cases(_load(pool_name))
    for protocol in PROTOCOLS:
        with served_in_thread(cases.pool, protocol) as url:
            agree, total, bad = cases.roundtrip(protocol, url)
        assert agree == total, bad[:3]


def test_sample_discriminates(synthetic_cases: Cases) -> None:
    """The round trip is not vacuous: every gold sequence passes in process and most perturbations fail."""
    gold = [e["replay"]["passed"] for (_, label, _), e in zip(synthetic_cases.cases, synthetic_cases.expected,
                                                                strict=True) if label == "gold"]
    perturbed = [e["replay"]["passed"] for (_, label, _), e in zip(synthetic_cases.cases, synthetic_cases.expected,
                                                                     strict=True) if label == "perturbed"]
    assert all(gold)
    assert sum(not p for p in perturbed) >= len(perturbed) // 2


# --------------------------------------------------------------------------------------------------
# auth
# --------------------------------------------------------------------------------------------------


def _http_get(url: str, token: str | None = None) -> tuple[int, Any]:
    request = urllib.request.Request(url, headers=_headers(token))
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, None


def _base(url: str) -> str:
    return url.removesuffix("/mcp")


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_http_needs_the_token(protocol: str, cli_servers: dict[str, CliServer]) -> None:
    base = _base(cli_servers[protocol].url)
    assert _http_get(f"{base}/health")[0] == 401
    assert _http_get(f"{base}/health", "wrong")[0] == 401
    assert _http_get(f"{base}/health", TOKEN)[0] == 200


def test_openenv_websocket_needs_the_token(synthetic: EnvironmentPool, cli_servers: dict[str, CliServer]) -> None:
    url, tid = cli_servers["openenv"].url, synthetic.task_ids()[0]

    async def reset(token: str | None) -> Any:
        async with openenv_session(url, tid, token) as (_, first):
            return first

    for token in (None, "wrong"):
        with pytest.raises(ConnectionError, match="403"):
            asyncio.run(reset(token))
    first = asyncio.run(reset(TOKEN))
    assert first.observation["messages"] == synthetic.start(tid).initial_messages()


def test_mcp_needs_the_token(synthetic: EnvironmentPool, cli_servers: dict[str, CliServer]) -> None:
    url, tid = cli_servers["mcp"].url, synthetic.task_ids()[0]
    statuses: list[int] = []

    async def tool_names(token: str | None) -> list[str]:
        async with mcp_session(url, tid, token, control=False, statuses=statuses) as session:
            return [t.name for t in (await session.list_tools()).tools]

    for token in (None, "wrong"):
        statuses.clear()
        with pytest.raises(BaseException):  # noqa: B017 - the SDK wraps the refusal in a generic error (group)
            asyncio.run(tool_names(token))
        assert statuses == [401]
    statuses.clear()
    assert asyncio.run(tool_names(TOKEN)) == [t["function"]["name"] for t in synthetic.task(tid).tools]
    assert 401 not in statuses


# --------------------------------------------------------------------------------------------------
# the CLI's usage errors and warnings
# --------------------------------------------------------------------------------------------------


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "envace.envs", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})}, check=False)


def _usage_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0] and result.stdout == "", result.stderr
    return lines[0]


def test_cli_unknown_pool() -> None:
    assert "unknown environment pool 'nope'" in _usage_error(_cli("serve", "--pool", "nope", "--protocol", "mcp",
                                                                  "--port", "0"))


def test_cli_bad_protocol() -> None:
    assert "--protocol" in _usage_error(_cli("serve", "--pool", "synthetic", "--protocol", "grpc"))


def test_cli_port_in_use() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = str(busy.getsockname()[1])
        line = _usage_error(_cli("serve", "--pool", "synthetic", "--protocol", "openenv", "--port", port))
    assert f"--port {port}" in line and "in use" in line


def test_cli_empty_token_file(tmp_path: Path) -> None:
    empty = tmp_path / "token"
    empty.write_text("\n")
    assert "--token-file" in _usage_error(_cli("serve", "--pool", "synthetic", "--protocol", "mcp", "--port", "0",
                                               "--token-file", str(empty)))


def test_cli_warns_when_exposed_without_a_token() -> None:
    server = CliServer("serve", "--pool", "synthetic", "--protocol", "mcp", "--host", "0.0.0.0", "--port", "0",
                       env={"ENVACE_SERVE_TOKEN": ""})
    server.stop()
    warnings = [line for line in server.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "without a token" in warnings[0], server.stderr
    assert server.ready_line.startswith("serving synthetic over mcp at http://0.0.0.0:")


# --------------------------------------------------------------------------------------------------
# sessions and episodes
# --------------------------------------------------------------------------------------------------


class SpyPool(EnvironmentPool):
    """The synthetic pool, recording which of its (real) episodes were closed."""

    def __init__(self, base: EnvironmentPool) -> None:
        self.base, self.name = base, base.name
        self.started: list[Episode] = []
        self.closed: list[Episode] = []

    def task_ids(self, split: str | None = None) -> list[str]:
        return self.base.task_ids(split)

    def task(self, task_id: str) -> Any:
        return self.base.task(task_id)

    def gold_actions(self, task_id: str) -> list[list[ToolCall]]:
        return self.base.gold_actions(task_id)

    def start(self, task_id: str, **kwargs: Any) -> Episode:
        episode = self.base.start(task_id, **kwargs)
        close = episode.close

        def closing() -> None:
            self.closed.append(episode)
            close()

        episode.close = closing  # type: ignore[method-assign]
        self.started.append(episode)
        return episode

    def wait_closed(self, n: int, timeout: float = 60) -> bool:
        deadline = time.monotonic() + timeout
        while len(self.closed) < n and time.monotonic() < deadline:
            time.sleep(0.02)
        return len(self.closed) == n


def test_openenv_session_end_closes_the_episode(synthetic: EnvironmentPool) -> None:
    spy = SpyPool(synthetic)
    tid = synthetic.task_ids()[0]

    async def one_session() -> None:
        async with openenv_session(url, tid) as (env, _):
            await env.step({"kind": "call", "name": "nope", "arguments": {}})
            await env.reset(task_id=tid)  # a second reset closes the first episode
            assert len(spy.started) == 2 and spy.closed == spy.started[:1]

    with served_in_thread(spy, "openenv") as url:
        asyncio.run(one_session())
        assert spy.wait_closed(2), (spy.started, spy.closed)


def test_openenv_idle_session_closes_the_episode(synthetic: EnvironmentPool) -> None:
    spy = SpyPool(synthetic)
    tid = synthetic.task_ids()[0]

    async def idle_session() -> None:
        async with openenv_session(url, tid) as (env, _):
            assert await asyncio.to_thread(spy.wait_closed, 1)  # openenv's reaper ends the idle session
            with pytest.raises(RuntimeError, match="idle past the server's session time-out"):
                await env.step({"kind": "call", "name": "x"})

    with served_in_thread(spy, "openenv", session_timeout_s=0.5) as url:
        asyncio.run(idle_session())


def test_mcp_session_end_and_idle_close_the_episode(synthetic: EnvironmentPool) -> None:
    spy = SpyPool(synthetic)
    tid = synthetic.task_ids()[0]

    async def one_session(terminate: bool) -> None:
        async with mcp_session(url, tid, terminate_on_close=terminate) as session:
            await session.list_tools()

    with served_in_thread(spy, "mcp") as url:
        asyncio.run(one_session(terminate=True))  # DELETE at the end of the session
        assert spy.wait_closed(1) and spy.closed == spy.started
        assert _http_get(f"{_base(url)}/health")[1]["episodes"] == 0
    with served_in_thread(spy, "mcp", session_timeout_s=0.5) as url:
        asyncio.run(one_session(terminate=False))  # the client vanishes: the idle reaper closes it
        assert spy.wait_closed(2) and spy.closed == spy.started


def test_mcp_control_tools_only_for_control_sessions(synthetic: EnvironmentPool,
                                                     cli_servers: dict[str, CliServer]) -> None:
    url, tid = cli_servers["mcp"].url, synthetic.task_ids()[0]

    async def session_view(control: bool) -> tuple[list[str], str]:
        async with mcp_session(url, tid, TOKEN, control=control) as session:
            names = [t.name for t in (await session.list_tools()).tools]
            verify = await session.call_tool("__verify__", {})
            return names, verify.content[0].text

    agent_names, agent_verify = asyncio.run(session_view(control=False))
    control_names, control_verify = asyncio.run(session_view(control=True))
    assert not any(n.startswith("__") for n in agent_names)
    assert set(control_names) - set(agent_names) == {"__end_turn__", "__verify__", "__replay__"}
    assert agent_verify == synthetic.start(tid).execute(ToolCall("__verify__"))  # the episode's unknown-tool answer
    assert set(json.loads(control_verify)) == {"reward", "passed", "details"}


def test_mcp_task_comes_from_the_url(synthetic: EnvironmentPool, cli_servers: dict[str, CliServer]) -> None:
    from mcp.shared.exceptions import MCPError

    url = cli_servers["mcp"].url

    async def list_tools(task_id: str | None) -> Any:
        async with mcp_session(url, task_id, TOKEN) as session:
            return await session.list_tools()

    for task_id, reason in ((None, "?task_id="), ("no-such-task", "no-such-task")):
        with pytest.raises(BaseException) as info:  # the client raises it inside exception groups
            asyncio.run(list_tools(task_id))
        errors = [e for e in _leaves(info.value) if isinstance(e, MCPError)]
        assert errors and reason in errors[0].message, info.value


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in _leaves(sub)]
    return [exc]


# --------------------------------------------------------------------------------------------------
# catalogue: OpenEnv's extra routes and metadata, MCP's resources
# --------------------------------------------------------------------------------------------------


def test_openenv_catalogue_routes(synthetic: EnvironmentPool, cli_servers: dict[str, CliServer]) -> None:
    base = cli_servers["openenv"].url
    status, train = _http_get(f"{base}/envace/tasks?split=train", TOKEN)
    assert status == 200 and [t["task_id"] for t in train] == synthetic.task_ids("train")
    assert len(_http_get(f"{base}/envace/tasks", TOKEN)[1]) == len(synthetic.task_ids())
    tid = train[0]["task_id"]
    spec = synthetic.task(tid)
    assert train[0]["first_user_message"] == spec.first_user_message and train[0]["tools"] == spec.tools
    assert _http_get(f"{base}/envace/gold/{tid}", TOKEN) == (200, gold_turns(synthetic, tid))
    assert _http_get(f"{base}/envace/gold/no-such-task", TOKEN)[0] == 404
    status, meta = _http_get(f"{base}/metadata", TOKEN)
    assert status == 200 and meta["name"] == "envace-synthetic" and meta["version"]


def test_mcp_resources(synthetic: EnvironmentPool, cli_servers: dict[str, CliServer]) -> None:
    url, tid = cli_servers["mcp"].url, synthetic.task_ids()[0]

    async def read() -> tuple[set[str], Any, Any]:
        async with mcp_session(url, tid, TOKEN, control=False) as session:
            uris = {str(r.uri) for r in (await session.list_resources()).resources}
            task = json.loads((await session.read_resource("envace://task")).contents[0].text)
            meta = json.loads((await session.read_resource("envace://metadata")).contents[0].text)
            return uris, task, meta

    uris, task, meta = asyncio.run(read())
    assert uris == {"envace://task", "envace://metadata"}
    assert task["task_id"] == tid and task["initial_messages"] == synthetic.start(tid).initial_messages()
    assert meta["pool"] == "synthetic" and sum(meta["tasks"].values()) == len(synthetic.task_ids())


def test_openenv_mistakes_are_one_line_server_errors(synthetic: EnvironmentPool,
                                                     cli_servers: dict[str, CliServer]) -> None:
    url, tid = cli_servers["openenv"].url, synthetic.task_ids()[0]

    async def run() -> None:
        with pytest.raises(RuntimeError, match="unknown synthetic task 'no-such-task'"):
            async with openenv_session(url, "no-such-task", TOKEN):
                pass
        async with openenv_session(url, tid, TOKEN) as (env, _):
            with pytest.raises(RuntimeError, match="turn 0, call 0"):
                await env.step({"kind": "replay", "actions": [[{"nam": 1}]]})
            result = await env.step({"kind": "call", "name": "x"})  # the session survives the mistake
            assert result.observation["text"] == synthetic.start(tid).execute(ToolCall("x"))

    asyncio.run(run())


def test_mcp_malformed_replay_is_a_tool_error(synthetic: EnvironmentPool, cli_servers: dict[str, CliServer]) -> None:
    url, tid = cli_servers["mcp"].url, synthetic.task_ids()[0]

    async def run() -> Any:
        async with mcp_session(url, tid, TOKEN) as session:
            bad = await session.call_tool("__replay__", {"actions": [[{"nam": 1}]]})
            good = await session.call_tool("__replay__", {"actions": gold_turns(synthetic, tid)})  # session survives
            return bad, good

    bad, good = asyncio.run(run())
    assert bad.is_error and "turn 0, call 0" in bad.content[0].text
    assert json.loads(good.content[0].text) == verdict_dict(synthetic.replay(tid, synthetic.gold_actions(tid)))


# --------------------------------------------------------------------------------------------------
# worldbook:DIR, a pool answered by Trace2Env worldbooks, served like any other
# --------------------------------------------------------------------------------------------------

BOOK_KW = {"n_envs": 2, "tasks_per_env": 40, "seed": 3}


@pytest.fixture(scope="module")
def worldbook(tmp_path_factory: pytest.TempPathFactory) -> EnvironmentPool:
    """``worldbook:DIR`` over one book built from gold replays of one synthetic environment's train tasks."""
    from envace.data.__main__ import main as data_main
    from envace.envs.synthetic import SyntheticPool
    from trace2env import build_worldbook, load_traces

    env_id = SyntheticPool(**BOOK_KW).environments()[0]
    d = tmp_path_factory.mktemp("book")
    assert data_main(["--pool-kwargs", json.dumps({"synthetic": BOOK_KW}), "record-traces", "--pool", "synthetic",
                      "--split", "train", "--env-id", env_id, "--out", str(d / "train.jsonl")]) == 0
    build_worldbook(load_traces([d / "train.jsonl"]), d / "books" / "env0", environment_id=env_id)
    return get_pool(f"worldbook:{d / 'books'}", pool_kwargs=BOOK_KW)


def test_worldbook_pool(worldbook: EnvironmentPool) -> None:
    base = worldbook.base  # type: ignore[attr-defined]
    env_id = next(iter(worldbook.books))  # type: ignore[attr-defined]
    assert worldbook.task_ids() == [t for t in base.task_ids() if base.task(t).env_id == env_id]
    tid = worldbook.task_ids("test")[0]
    episode, real = worldbook.start(tid), base.start(tid)
    calls = worldbook.gold_actions(tid)[0]
    for call in calls:
        episode.execute(call)
        real.execute(call)
    assert sum(episode.routes.values()) == len(calls)  # type: ignore[attr-defined] - the simulator answered each
    verdict, shadow = episode.verify(), real.verify()  # the verdict is the real environment's (W2R)
    assert (verdict.reward, verdict.passed) == (shadow.reward, shadow.passed)
    fidelity = worldbook.fidelity[env_id]  # type: ignore[attr-defined]
    assert fidelity["traces"] > 0 and 0 <= fidelity["exact"] <= 1 and len(fidelity["exact_ci95"]) == 2
    with pytest.raises(KeyError):
        worldbook.task(next(t for t in base.task_ids() if base.task(t).env_id != env_id))


def test_roundtrip_worldbook(worldbook: EnvironmentPool) -> None:
    cases = Cases(worldbook)
    for protocol in PROTOCOLS:
        with served_in_thread(worldbook, protocol) as url:
            agree, total, bad = cases.roundtrip(protocol, url)
            if protocol == "openenv":
                meta = _http_get(f"{url}/metadata")[1]
                assert "worldbook fidelity" in meta["description"], meta
            else:
                async def metadata() -> Any:
                    async with mcp_session(url, cases.task_ids[0], control=False) as session:
                        return json.loads((await session.read_resource("envace://metadata")).contents[0].text)

                assert asyncio.run(metadata())["fidelity"] == worldbook.fidelity  # type: ignore[attr-defined]
        assert agree == total, bad[:3]


def test_cli_worldbook_without_books(tmp_path: Path) -> None:
    line = _usage_error(_cli("serve", "--pool", f"worldbook:{tmp_path / 'none'}", "--protocol", "mcp", "--port", "0"))
    assert "no such worldbook" in line


def test_consumed_through_the_openenv_pool(synthetic_cases: Cases) -> None:
    """The ``openenv`` client pool (``tasks: server``) reads the served catalogue and gold and replays with the same
    verdicts as in process."""
    pool = synthetic_cases.pool
    with served_in_thread(pool, "openenv") as url:
        client = get_pool("openenv", urls=[url], tasks="server")
        try:
            assert client.task_ids() == pool.task_ids()
            for (tid, _, turns), want in zip(synthetic_cases.cases, synthetic_cases.expected, strict=True):
                mine, theirs = client.task(tid), pool.task(tid)
                for name in ("task_id", "split", "category", "env_id", "system_prompt", "first_user_message", "tools"):
                    assert getattr(mine, name) == getattr(theirs, name), name
                assert [[c.to_dict() for c in t] for t in client.gold_actions(tid)] == gold_turns(pool, tid)
                got = client.replay(tid, parse_turns(turns))
                assert (got.reward, got.passed, got.details) == (want["replay"]["reward"], want["replay"]["passed"],
                                                                 want["replay"]["details"])
        finally:
            client.close()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_max_sessions(protocol: str, synthetic: EnvironmentPool) -> None:
    """A session beyond --max-sessions is refused (OpenEnv: CAPACITY_REACHED; MCP: HTTP 503); an ended session
    frees its place."""
    tid = synthetic.task_ids()[0]
    statuses: list[int] = []

    async def second_session(url: str) -> None:
        if protocol == "openenv":
            async with openenv_session(url, tid):
                pass
        else:
            async with mcp_session(url, tid, statuses=statuses) as session:
                await session.list_tools()

    async def run(url: str) -> None:
        async with served(protocol, url, tid, None) as first:
            await first.call({"name": "x"})
            with pytest.raises(BaseException) as info:  # the MCP client raises inside exception groups
                await second_session(url)
            assert "CAPACITY_REACHED" in str(info.value) if protocol == "openenv" else statuses[-1] == 503
        await second_session(url)

    with served_in_thread(synthetic, protocol, max_sessions=1) as url:
        asyncio.run(run(url))
