"""The ``openenv`` pool against real OpenEnv servers: the fixture's environments served by the ``openenv`` package's own
``create_app`` under uvicorn, each in a subprocess started once per module (``openenv_fixture.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from envace.agents.engine import LoopLimits, Reply, TurnEngine
from envace.agents.sources import RealSource
from envace.envs.base import EnvironmentFault, EnvironmentUnavailable, ToolCall, get_pool
from envace.envs.remote import runtime
from envace.envs.remote.openenv_pool import OpenEnvPool, Replicas, _translate, fill_template
from envace.eval.server import free_port
from envace.toolcall import parse_tool_calls, render_tool_call
from envllm import ConfigurationError

FIXTURE = Path(__file__).with_name("openenv_fixture.py")
sys.path.insert(0, str(FIXTURE.parent))
from openenv_fixture import MALFORMED, SLOW

TOKEN = "s3cret"
READY_S = 300.0  # a server starts in about 1.5 s; niced on 2 busy shared cores it has taken 60-100 s


class Server:
    """One fixture server subprocess (its own process group) on a fixed port."""

    def __init__(self, *args: str) -> None:
        self.args, self.port = args, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Server:
        self.proc = subprocess.Popen([sys.executable, str(FIXTURE), "--port", str(self.port), *self.args],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     start_new_session=True)
        return self

    def wait_ready(self) -> Server:
        """Until ``GET /health`` answers (401 counts for the token server: it is up)."""
        assert self.proc is not None
        deadline = time.monotonic() + READY_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"fixture server exited: {self.proc.stderr.read().decode()[-2000:]}")
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=2).close()
                return self
            except urllib.error.HTTPError as exc:
                if exc.code == 401:
                    return self
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"fixture server {self.url} not ready within {READY_S:g}s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture(scope="module")
def servers():
    started = {"a": Server(), "b": Server(), "mcp": Server("--mcp"), "token": Server("--token", TOKEN)}
    try:
        for s in started.values():
            s.start()
        for s in started.values():
            s.wait_ready()
        yield started
    finally:
        for s in started.values():
            s.kill()


@pytest.fixture
def no_leak():
    yield
    assert runtime.open_sessions() == 0


PUT = {"name": "put", "arguments": {"key": "colour", "value": "blue"}}


def put(key: str, value: str) -> ToolCall:
    return ToolCall("put", {"key": key, "value": value})


def write_tasks(path: Path, *tasks: dict) -> str:
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    return str(path)


# -- envace-served servers (tasks: server) --------------------------------------------------------------------------


def test_reset_step_end_turn_verify_through_the_pool(servers, no_leak):
    pool = OpenEnvPool(urls=[servers["a"].url])
    assert pool.task_ids() == ["kv/t0", "kv/t1", "kv/t2", "kv/t3"] and pool.task_ids("test") == ["kv/t3"]
    spec = pool.task("kv/t3")
    assert spec.pool == "openenv" and spec.metadata["served_pool"] == "kvstore" and spec.category == "two_turn"
    assert pool.gold_actions("kv/t3") == [[put("a", "1")], [ToolCall("delete", {"key": "a"}), put("b", "2")]]
    ep = pool.start("kv/t3")
    try:
        assert ep.remote and ep.initial_messages()[-1] == {"role": "user", "content": "Store a=1."}
        assert [t["function"]["name"] for t in ep.tools()] == ["put", "get", "delete"]
        assert ep.execute(put("a", "1")) == "stored a"
        assert ep.execute(ToolCall("get", {"key": "zz"})) == "Error: no key 'zz'"
        assert ep.end_turn("stored") == "Now delete a and store b=2."
        assert ep.execute(ToolCall("delete", {"key": "a"})) == "deleted"
        assert ep.verify().passed is False  # b is missing
        ep.execute(put("b", "2"))
        assert ep.end_turn("done") is None
        verdict = ep.verify()
        assert verdict.passed and verdict.reward == 1.0 and verdict.details == {"store": {"b": "2"}}
    finally:
        ep.close()
    with pytest.raises(RuntimeError, match="closed"):
        ep.execute(put("a", "1"))


def test_the_async_path_and_a_malformed_observation(servers, no_leak):
    pool = OpenEnvPool(urls=[servers["a"].url])

    async def main():
        ep = await pool.astart("kv/t0")
        try:
            assert await ep.aexecute(ToolCall(**PUT)) == "stored colour"
            assert (await ep.averify()).passed
            await ep.aexecute(put("big", "x" * 100_000))
            assert len(await ep.aexecute(ToolCall("get", {"key": "big"}))) == 65536  # cut like in-process outputs
            with pytest.raises(EnvironmentFault, match="text is not a string"):
                await ep.aexecute(ToolCall(MALFORMED, {}))
        finally:
            await ep.aclose()

    asyncio.run(main())


def test_a_call_past_its_time_out_is_unavailable_and_the_episode_lost(servers, no_leak):
    pool = OpenEnvPool(urls=[servers["a"].url], call_timeout_s=2.0)
    ep = pool.start("kv/t0")
    try:
        with pytest.raises(EnvironmentUnavailable):
            ep.execute(ToolCall(SLOW, {"seconds": 30}))
        with pytest.raises(EnvironmentUnavailable, match="lost earlier"):
            ep.execute(ToolCall(**PUT))  # never retried, never sent on a fresh session
    finally:
        ep.close()


def test_replay_is_the_servers_own_and_agrees_with_stepwise_play(servers, no_leak):
    pool = OpenEnvPool(urls=[servers["a"].url])
    for task_id in pool.task_ids():
        gold = pool.gold_actions(task_id)
        assert pool.replay(task_id, gold).passed, task_id
        assert not pool.replay(task_id, gold[:-1] + [gold[-1][:-1]]).passed, task_id  # the last call dropped


def test_fork_is_a_new_session_with_the_calls_replayed(servers, no_leak):
    pool = OpenEnvPool(urls=[servers["a"].url])
    ep = pool.start("kv/t3")
    twin = None
    try:
        ep.execute(put("a", "1"))
        ep.end_turn("ok")
        twin = ep.fork()
        twin.execute(ToolCall("delete", {"key": "a"}))
        twin.execute(put("b", "2"))
        assert twin.verify().passed
        assert ep.verify().details == {"store": {"a": "1"}}  # the original is untouched
    finally:
        ep.close()
        if twin is not None:
            twin.close()


def test_four_concurrent_episodes_are_isolated(servers, no_leak):
    pool = OpenEnvPool(urls=[servers["a"].url])
    values = ["blue", "red", "green", "blue-ish"]

    async def one(value):
        ep = await pool.astart("kv/t0")
        try:
            await ep.aexecute(put("colour", value))
            await ep.aexecute(put(f"only-{value}", "x"))
            return await ep.averify()
        finally:
            await ep.aclose()

    async def main():
        return await asyncio.gather(*(one(v) for v in values))

    verdicts = asyncio.run(main())
    assert [v.details["store"] for v in verdicts] == [{"colour": v, f"only-{v}": "x"} for v in values]


def test_replicas_share_the_episodes_and_a_dead_one_is_passed_over(servers, no_leak):
    pool = OpenEnvPool(urls=[servers["a"].url, servers["b"].url])
    episodes = [pool.start("kv/t0") for _ in range(4)]
    try:
        assert sorted(pool.replicas.in_flight().values()) == [2, 2]
        assert {ep._url for ep in episodes} == {servers["a"].url, servers["b"].url}
    finally:
        for ep in episodes[:3]:
            ep.close()
    episodes[3]._session.close()
    del episodes  # dropped without close: its replica slot comes back when it is collected
    gc.collect()
    assert sorted(pool.replicas.in_flight().values()) == [0, 0]
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    pool = OpenEnvPool(urls=[servers["a"].url, dead], tasks="server")
    for _ in range(3):
        ep = pool.start("kv/t0")  # a connect refused on the dead replica is retried on the live one
        assert ep._url == servers["a"].url
        ep.close()


def test_replica_choice_least_busy_then_offset_and_cooldown():
    r = Replicas(["u0", "u1", "u2"])
    first = r.acquire()
    second, third = r.acquire(), r.acquire()
    assert sorted([first, second, third]) == ["u0", "u1", "u2"]  # each gets one before any gets two
    r.release("u1")
    assert r.acquire() == "u1"
    r.release("u0")
    r.cool("u0")
    assert r.acquire() != "u0"  # the least busy, but cooling down
    r = Replicas(["only"])
    r.cool("only")
    assert r.acquire() == "only"  # every replica cooling: still one is chosen


class KillingPolicy:
    """Puts, then kills the server before asking for its second put; then ends the turn."""

    def __init__(self, kill) -> None:
        self.kill, self.n = kill, 0

    async def respond(self, messages, tools, role):
        self.n += 1
        if self.n == 2:
            self.kill()
        text = render_tool_call(PUT) if self.n <= 2 else "Done."
        p = parse_tool_calls(text)
        return Reply(text=text, content=p.content, calls=p.calls, errors=p.errors, reasoning=p.reasoning)


def test_a_killed_server_masks_the_rollout_and_a_restarted_one_serves(servers):
    server = servers["b"]
    pool = OpenEnvPool(urls=[server.url], connect_timeout_s=1.0)
    waiting = OpenEnvPool(urls=[server.url], connect_timeout_s=READY_S)  # its task list read while the server is up

    async def rollout():
        ep = await pool.astart("kv/t0")
        return await TurnEngine(LoopLimits()).run(ep, KillingPolicy(server.kill), RealSource()), ep

    idle = pool.start("kv/t0")  # makes no call while the server is down
    assert idle.execute(ToolCall(**PUT)) == "stored colour"
    try:
        t, lost = asyncio.run(rollout())
        assert t.masked and t.counters()["env_unavailable"] == 1 and t.counters()["env_errors"] == 0
        assert t.stop_reason != "completed"
        with pytest.raises(EnvironmentUnavailable):
            pool.start("kv/t0")  # still down: connect refused, retried for connect_timeout_s, raised
    finally:
        # an episode that starts while the server restarts waits for it (up to connect_timeout_s) instead of failing
        restart = threading.Timer(0.5, server.start)
        restart.start()
        try:
            ep = waiting.start("kv/t0")
        finally:
            restart.join()
            server.wait_ready()
        assert ep.execute(ToolCall(**PUT)) == "stored colour"
        ep.close()
    with pytest.raises(EnvironmentUnavailable, match="lost earlier"):
        lost.execute(ToolCall(**PUT))  # no silent reconnect to a fresh, un-reset session on the restarted server
    with pytest.raises(EnvironmentUnavailable, match="session is closed"):
        idle.execute(ToolCall(**PUT))  # nor for an episode that was between calls when the server died
    lost.close()
    idle.close()
    assert runtime.open_sessions() == 0
    ep = pool.start("kv/t0")
    try:
        assert ep.execute(ToolCall(**PUT)) == "stored colour" and ep.verify().passed
    finally:
        ep.close()
    assert runtime.open_sessions() == 0


# -- generic servers (a task file) ----------------------------------------------------------------------------------


def test_mcp_environment_with_a_task_file(servers, tmp_path, no_leak):
    tasks = write_tasks(tmp_path / "tasks.jsonl",
                        {"task_id": "kv/t0", "split": "train", "instruction": "Store colour=blue, then submit.",
                         "tools": ["put", "submit"], "gold": [[PUT, {"name": "submit", "arguments": {}}]]},
                        {"task_id": "kv/t2", "split": "test", "instruction": "Store pet=cat, then submit."})
    pool = get_pool("openenv", urls=[servers["mcp"].url], tasks=tasks, action="mcp")
    assert [t["function"]["name"] for t in pool.task("kv/t0").tools] == ["put", "submit"]
    assert [t["function"]["name"] for t in pool.task("kv/t2").tools] == ["put", "get", "submit"]  # all listed
    assert "title" not in json.dumps(pool.task("kv/t0").tools)
    assert pool.replay("kv/t0", pool.gold_actions("kv/t0")).passed
    ep = pool.start("kv/t0")
    try:
        assert ep.execute(ToolCall("get", {"key": "colour"})).startswith("Error: unknown tool 'get'")  # not in subset
        assert ep.execute(ToolCall("put", {"key": 1})).startswith("Error: ")  # invalid arguments: the model's
        assert ep.execute(put("colour", "red")) == "stored colour"
        assert not ep.done
        assert ep.execute(ToolCall("submit", {})) == "submitted"
        assert ep.done and ep.end_turn("ok") is None
        verdict = ep.verify()
        assert not verdict.passed and verdict.reward == 0.0 and verdict.details["state"]["kv"] == {"colour": "red"}
    finally:
        ep.close()


def test_step_rewards_scored_by_the_task_file(servers, tmp_path, no_leak):
    from openenv_fixture import TOOLS

    line = {"task_id": "kv/t0", "split": "train", "instruction": "Store colour=blue.", "tools": TOOLS,
            "require_done": False}
    tasks = write_tasks(tmp_path / "t.jsonl", {**line, "reward_mode": "last"},
                        {**line, "task_id": "max", "reset": {"task_id": "kv/t0"}, "reward_mode": "max"},
                        {**line, "task_id": "done", "reset": {"task_id": "kv/t0"}, "require_done": True})
    pool = OpenEnvPool(urls=[servers["a"].url], tasks=tasks, action="envace")
    results = {}
    for task_id in ("kv/t0", "max", "done"):
        ep = pool.start(task_id)
        try:
            ep.execute(put("colour", "blue"))  # step reward 1.0
            ep.execute(put("colour", "red"))   # step reward 0.0
            assert ep.end_turn("x") is None
            results[task_id] = ep.verify()
        finally:
            ep.close()
    assert results["kv/t0"].reward == 0.0 and results["kv/t0"].details["rewards"] == [1.0, 0.0]
    assert results["max"].passed and results["max"].reward == 1.0
    assert not results["done"].passed and results["done"].reward == 0.0  # the server never said done


def test_template_actions_for_a_classic_environment(servers, tmp_path, no_leak):
    store = {"type": "function", "function": {"name": "store", "description": "Store v under k.", "parameters": {
        "type": "object", "properties": {"k": {"type": "string"}, "v": {"type": "string"}}}}}
    tasks = write_tasks(tmp_path / "t.jsonl", {"task_id": "kv/t0", "split": "train", "instruction": "Store colour.",
                                              "tools": [store], "require_done": False,
                                              "gold": [[{"name": "store", "arguments": {"k": "colour", "v": "blue"}}]]})
    template = {"kind": "call", "name": "put", "arguments": {"key": "{arguments.k}", "value": "{arguments.v}"}}
    pool = OpenEnvPool(urls=[servers["a"].url], tasks=tasks, action={"template": template})
    assert pool.replay("kv/t0", pool.gold_actions("kv/t0")).passed
    assert not pool.replay("kv/t0", [[ToolCall("store", {"k": "colour", "v": "red"})]]).passed


def test_fill_template_keeps_types_and_formats_inside_strings():
    call = ToolCall("run", {"cmd": "ls", "n": 3, "opts": {"a": [1]}})
    template = {"command": "{arguments.cmd}", "count": "{arguments.n}", "opts": ["{arguments.opts}"],
                "label": "{name}:{arguments.n}", "port": "{port}", "missing": "{arguments.nope}"}
    assert fill_template(template, call) == {"command": "ls", "count": 3, "opts": [{"a": [1]}], "label": "run:3",
                                              "port": "{port}", "missing": None}


# -- auth, launch, configuration ------------------------------------------------------------------------------------


def test_a_wrong_bearer_token_is_a_configuration_error(servers, tmp_path, no_leak):
    from openenv_fixture import TOOLS

    url = servers["token"].url
    good = {"Authorization": f"Bearer {TOKEN}"}
    bad = {"Authorization": "Bearer nope"}
    assert OpenEnvPool(urls=[url], headers=good).replay("kv/t0", [[ToolCall(**PUT)]]).passed
    with pytest.raises(ConfigurationError, match="HTTP 401"):
        OpenEnvPool(urls=[url], headers=bad)  # the task list over HTTP
    tasks = write_tasks(tmp_path / "t.jsonl", {"task_id": "kv/t0", "split": "train", "instruction": "x",
                                              "tools": TOOLS})
    pool = OpenEnvPool(urls=[url], headers=bad, tasks=tasks)
    with pytest.raises(ConfigurationError, match="HTTP 403"):
        pool.start("kv/t0")  # the WebSocket handshake; not retried
    assert pool.replicas.in_flight() == {url: 0}


def test_launch_starts_servers_and_close_stops_them(no_leak):
    command = [sys.executable, str(FIXTURE), "--port", "{port}"]
    pool = OpenEnvPool(launch={"command": command, "replicas": 1, "timeout_s": READY_S})
    try:
        (proc,) = pool.servers.procs
        assert proc.poll() is None and pool.replay("kv/t1", pool.gold_actions("kv/t1")).passed
    finally:
        pool.close()
    assert proc.poll() is not None
    code = ("import sys; from envace.envs.remote.openenv_pool import OpenEnvPool\n"
            f"pool = OpenEnvPool(launch={{'command': {command!r}, 'timeout_s': {READY_S}}})\n"
            "print(pool.servers.procs[0].pid, flush=True)")  # exits without close
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=READY_S)
    with pytest.raises(ProcessLookupError):
        os.killpg(int(out.stdout), 0)  # the server's process group is gone: stopped at exit
    with pytest.raises(ConfigurationError, match="exited with 3"):
        OpenEnvPool(launch={"command": [sys.executable, "-c", "raise SystemExit(3)", "{port}"]})


@pytest.mark.parametrize(("kwargs", "message"), [
    ({}, "exactly one of 'urls' and 'launch'"),
    ({"urls": ["http://x"], "launch": {"command": ["x"]}}, "exactly one of 'urls' and 'launch'"),
    ({"urls": []}, "'urls' must be a non-empty list"),
    ({"launch": {"command": []}}, "'launch.command'"),
    ({"launch": {"command": ["x"], "replicas": 0}}, "'launch.replicas'"),
    ({"urls": ["http://x"], "action": "template"}, "'action' must be one of envace, mcp"),
    ({"urls": ["http://x"], "action": {"template": "x"}}, "'action' as a mapping is"),
    ({"urls": ["http://x"], "action": "mcp"}, "tasks 'server'"),
    ({"urls": ["http://x"], "call_timeout_s": 0}, "'call_timeout_s'"),
])
def test_bad_kwargs_are_one_line_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        OpenEnvPool(**kwargs)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("line", "message"), [
    ("not json", "not JSON"),
    ('{"task_id": "t", "split": "dev", "instruction": "x", "tools": []}', "'split' must be"),
    ('{"task_id": "t", "split": "train", "instruction": "x"}', "'tools' .* is required"),
    ('{"task_id": "t", "split": "train", "instruction": "x", "tools": [], "reward_mode": "mean"}', "reward_mode"),
    ('{"task_id": "t", "split": "train", "instruction": "x", "tools": [], "colour": 1}', "unknown key"),
    ('{"task_id": "t", "split": "train", "instruction": "x", "tools": ["put"]}', "tool names need action 'mcp'"),
])
def test_task_file_mistakes_name_the_line(tmp_path, line, message):
    path = tmp_path / "t.jsonl"
    path.write_text("\n" + line + "\n")
    with pytest.raises(ValueError, match=message) as info:
        OpenEnvPool(urls=["http://127.0.0.1:9"], tasks=str(path))
    assert str(info.value).startswith(f"{path}:2: ") and "\n" not in str(info.value)


def test_what_the_client_raises_maps_onto_the_taxonomy():
    refused = ConnectionError("Failed to connect to ws://h/ws: server rejected WebSocket connection: HTTP 403")
    assert isinstance(_translate(refused), ConfigurationError)
    assert isinstance(_translate(ConnectionRefusedError(111, "refused")), EnvironmentUnavailable)
    capacity = RuntimeError("Server error: Server at capacity (code: CAPACITY_REACHED)")
    assert isinstance(_translate(capacity), EnvironmentUnavailable)
    assert isinstance(_translate(RuntimeError("Server error: boom (code: FACTORY_ERROR)")), EnvironmentFault)
    with contextlib.suppress(ImportError):
        from websockets.exceptions import ConnectionClosedError

        assert isinstance(_translate(ConnectionClosedError(None, None)), EnvironmentUnavailable)
