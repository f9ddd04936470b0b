"""The ``mcp`` pool on the real mcp-server-git: the shipped tasks' gold passes and a perturbation fails, K episodes of
one task are isolated, fork is independent, tools outside the subset are refused without a round trip, bad task files
give one-line errors naming file:line, a killed server masks the episode and leaks no session, schemas are clean."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
from pathlib import Path

import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envace.envs.base import EnvironmentFault, EnvironmentUnavailable, ToolCall, get_pool
from envace.envs.remote import mcp_pool, runtime
from envace.envs.remote.mcp_pool import DEFAULT_TASKS, MCPPool, git_checks, openai_tool
from envace.envs.remote.taskfile import check_tools, load_tasks

# a loaded 2-core machine (nice 19 behind a long measurement) starts mcp-server-git in up to a minute or two
SLOW = {"connect_timeout_s": 600, "call_timeout_s": 300}
SHIPPED = [json.loads(line)["task_id"] for line in DEFAULT_TASKS.read_text().splitlines() if line.strip()]
EXTRA_TASKS = [
    # the tool verifier on an episode-scope server (a server per episode)
    {"task_id": "extra/tool-verifier", "split": "test", "category": "tool", "server": "git_ep",
     "instruction": "Commit notes.txt with the message 'Add notes'.",
     "workspace": {"base": "fixtures/webapp.json", "steps": [{"write": {"notes.txt": "x\n"}}]},
     "tools": ["git_add", "git_commit", "git_log"],
     "verifier": {"kind": "tool", "checks": [{"call": {"name": "git_log", "arguments": {"max_count": 1}},
                                              "contains": "Add notes"},
                                             {"call": {"name": "git_status"}, "absent": "notes.txt"}]},
     "gold": [[{"name": "git_add", "arguments": {"files": ["notes.txt"]}},
               {"name": "git_commit", "arguments": {"message": "Add notes"}}]]},
]
SERVERS = {"git_ep": {"command": ["mcp-server-git", "--repository", "{root}"], "scope": "episode",
                      "bind": {"repo_path": "{workspace}"}, "workspace": {"kind": "git"}}}


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tasks")
    shutil.copytree(DEFAULT_TASKS.parent, folder, dirs_exist_ok=True)
    (folder / "extra.jsonl").write_text("".join(json.dumps(t) + "\n" for t in EXTRA_TASKS))
    return folder


@pytest.fixture(scope="module")
def pool(task_dir: Path):
    import envace.envs.remote.mcp_pool  # noqa: F401  (registers "mcp" until the package does)

    p = get_pool("mcp", tasks=str(task_dir), servers=SERVERS, **SLOW)
    assert isinstance(p, MCPPool)
    yield p
    p.close()


def _drop_last(turns: list[list[ToolCall]]) -> list[list[ToolCall]]:
    out = [list(t) for t in turns]
    out[-1] = out[-1][:-1]
    return out


# -- the shipped tasks -----------------------------------------------------------------------------------------------


def test_shipped_task_set(pool: MCPPool) -> None:
    ids = [t for t in pool.task_ids() if t in SHIPPED]
    assert len(ids) == 12
    assert sum(pool.task(t).split == "train" for t in ids) == 8
    assert sum(pool.task(t).split == "test" for t in ids) == 4
    assert len({pool.task(t).category for t in ids}) >= 6


@pytest.mark.parametrize("task_id", SHIPPED)
def test_gold_passes_and_perturbation_fails(pool: MCPPool, task_id: str) -> None:
    gold = pool.gold_actions(task_id)
    verdict = pool.replay(task_id, gold)
    assert verdict.passed, verdict.details["reason"]
    assert verdict.reward == 1.0
    broken = pool.replay(task_id, _drop_last(gold))
    assert not broken.passed and broken.reward == 0.0
    assert broken.details["error_type"] == "mcp:check_failed"


def test_reply_check_reads_the_reply(pool: MCPPool) -> None:
    gold = pool.gold_actions("git/log-answer-01")
    assert pool.replay("git/log-answer-01", gold, replies=["The last commit is 'Add settings module'."]).passed
    assert not pool.replay("git/log-answer-01", gold, replies=["Initial commit"]).passed


def test_multiturn_end_turn(pool: MCPPool) -> None:
    ep = pool.start("git/multiturn-fix-01")
    try:
        assert ep.end_turn("done") == pool.user_messages("git/multiturn-fix-01")[1]
        assert ep.end_turn("done") is None and ep.done
    finally:
        ep.close()


# -- schemas ---------------------------------------------------------------------------------------------------------


def test_schemas_hide_bound_arguments_and_titles(pool: MCPPool) -> None:
    spec = pool.task("git/add-commit-01")
    names = [t["function"]["name"] for t in spec.tools]
    assert names == json.loads(DEFAULT_TASKS.read_text().splitlines()[1])["tools"]
    text = json.dumps(spec.tools)
    assert "repo_path" not in text and '"title"' not in text
    add = next(t["function"] for t in spec.tools if t["function"]["name"] == "git_add")
    assert add["parameters"]["required"] == ["files"] and add["parameters"]["type"] == "object"


def test_openai_tool_keeps_a_property_named_title() -> None:
    tool = {"name": "t", "description": "d", "input_schema": {
        "type": "object", "title": "tArgs", "required": ["repo_path", "title"],
        "properties": {"title": {"type": "string", "title": "Title", "default": {"title": "kept"}},
                       "repo_path": {"type": "string"}}}}
    params = openai_tool(tool, ("repo_path",))["function"]["parameters"]
    assert params == {"type": "object", "required": ["title"],
                      "properties": {"title": {"type": "string", "default": {"title": "kept"}}}}


# -- isolation, fork, refusal ----------------------------------------------------------------------------------------


def test_group_of_four_is_isolated(pool: MCPPool) -> None:
    """K=4 episodes of one task commit different messages concurrently (aexecute): each repository holds only its
    own commit, and the model never names a repository (repo_path is bound)."""
    episodes = [pool.start("git/add-commit-01") for _ in range(4)]

    async def act(ep, k):
        await ep.aexecute(ToolCall("git_add", {"files": ["notes.txt"], "repo_path": "/tmp/elsewhere"}))
        return await ep.aexecute(ToolCall("git_commit", {"message": f"commit {k}"}))

    async def group():
        return await asyncio.gather(*(act(ep, k) for k, ep in enumerate(episodes)))

    try:
        outputs = asyncio.run(group())
        assert all(not o.startswith("Error") for o in outputs), outputs
        assert len({ep.workspace for ep in episodes}) == 4
        for k, ep in enumerate(episodes):
            mine = [{"commit_message": f"commit {k}", "on": "main"}, {"commits": 3, "on": "main"}]
            assert all(ok for _, ok in git_checks(ep.workspace, mine))
            others = [{"commit_message": f"commit {j}", "on": "main"} for j in range(4) if j != k]
            assert not any(ok for _, ok in git_checks(ep.workspace, others))
            assert not ep.verify().passed  # the task wants 'Add notes'
    finally:
        for ep in episodes:
            asyncio.run(ep.aclose())
    assert not any(os.path.exists(ep.workspace) for ep in episodes)


def test_fork_is_independent(pool: MCPPool) -> None:
    ep = pool.start("git/branch-switch-01")
    ep.execute(ToolCall("git_create_branch", {"branch_name": "feature/search", "base_branch": "main"}))
    twin = ep.fork()
    try:
        assert twin.workspace != ep.workspace
        twin.execute(ToolCall("git_checkout", {"branch_name": "feature/search"}))
        assert twin.verify().passed
        assert not ep.verify().passed  # the original is still on main
        ep.close()
        assert "feature/search" in twin.execute(ToolCall("git_branch", {"branch_type": "local"}))
        assert twin.verify().passed
    finally:
        ep.close()
        twin.close()


def test_tool_outside_subset_is_refused_without_a_call(pool: MCPPool, monkeypatch: pytest.MonkeyPatch) -> None:
    ep = pool.start("git/branch-switch-01")  # subset without git_commit / git_reset

    async def no_call(*args, **kwargs):
        raise AssertionError("the server was called")

    try:
        monkeypatch.setattr(mcp_pool, "_call_tool", no_call)
        out = ep.execute(ToolCall("git_reset", {}))
        assert out.startswith("Error: unknown tool 'git_reset'") and "git_checkout" in out
        assert asyncio.run(ep.aexecute(ToolCall("git_commit", {"message": "x"}))).startswith("Error: unknown tool")
    finally:
        ep.close()


def test_server_errors_are_observations(pool: MCPPool) -> None:
    ep = pool.start("git/checkout-existing-01")
    try:
        assert ep.execute(ToolCall("git_checkout", {"branch_name": "nope"})).startswith("Error")
        assert ep.execute(ToolCall("git_checkout", {})).startswith("Error")  # missing required argument
    finally:
        ep.close()


class _FakeClient:
    """A client whose call_tool raises or returns what the unit test says (no server)."""

    def __init__(self, outcome):
        self.outcome = outcome

    async def call_tool(self, name, arguments, read_timeout_seconds=None):
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


def _fake_server(outcome) -> mcp_pool._Server:
    server = mcp_pool._Server(mcp_pool.ServerConfig("fake", ("true",)), "/nonexistent")
    server.session.client = _FakeClient(outcome)
    return server


def test_call_results_and_protocol_errors() -> None:
    from mcp.shared.exceptions import MCPError
    from mcp.types import CallToolResult, ImageContent, TextContent

    def call(outcome):
        return runtime.run_sync(mcp_pool._call_tool(_fake_server(outcome), "t", {}, 5.0), 10.0)

    text = [TextContent(type="text", text="a"), ImageContent(type="image", data="", mime_type="image/png")]
    assert call(CallToolResult(content=text)) == "a\n[image omitted]"
    assert call(CallToolResult(content=text[:1], is_error=True)) == "Error: a"
    assert len(call(CallToolResult(content=[TextContent(type="text", text="x" * 70000)]))) == 65536
    assert call(MCPError(-32602, "bad arguments")) == "Error: bad arguments"
    with pytest.raises(EnvironmentUnavailable, match="no answer within 5s"):
        call(MCPError(-32001, "Request 'tools/call' timed out"))
    with pytest.raises(EnvironmentUnavailable, match="connection closed"):
        call(MCPError(-32000, "Connection closed"))
    with pytest.raises(EnvironmentFault, match="JSON-RPC error -32603"):
        call(MCPError(-32603, "internal"))


# -- the tool verifier on an episode-scope server --------------------------------------------------------------------


def test_tool_verifier_on_episode_scope_server(pool: MCPPool) -> None:
    before = runtime.open_sessions()
    assert pool.replay("extra/tool-verifier", pool.gold_actions("extra/tool-verifier")).passed
    assert runtime.open_sessions() == before  # the episode's own server was stopped at close
    assert not pool.replay("extra/tool-verifier", _drop_last(pool.gold_actions("extra/tool-verifier"))).passed


# -- a killed server -------------------------------------------------------------------------------------------------


def _server_pids(root: str) -> list[int]:
    return [p.pid for p in psutil.Process().children(recursive=True)
            if any(root in part for part in p.cmdline())]


def test_killed_server_raises_unavailable_and_leaks_nothing(task_dir: Path) -> None:
    before = runtime.open_sessions()
    pool = MCPPool(tasks=str(task_dir / "mcp_git.jsonl"), **SLOW)
    try:
        ep = pool.start("git/add-commit-01")
        assert "notes.txt" in ep.execute(ToolCall("git_status", {}))
        pids = _server_pids(pool._proc().root)
        assert len(pids) == 1  # one server per pool and process
        os.kill(pids[0], signal.SIGKILL)
        psutil.Process(pids[0]).wait(30) if psutil.pid_exists(pids[0]) else None
        with pytest.raises(EnvironmentUnavailable):
            ep.execute(ToolCall("git_add", {"files": ["notes.txt"]}))
        ep.close()
        assert pool.replay("git/add-commit-01", pool.gold_actions("git/add-commit-01")).passed  # a new server
        root = pool._proc().root
        assert len(_server_pids(root)) == 1
    finally:
        pool.close()
    assert runtime.open_sessions() == before
    assert not _server_pids(root) and not os.path.exists(root)  # the server stopped, the workspaces removed


# -- task files ------------------------------------------------------------------------------------------------------

GOOD = {k: v for k, v in json.loads(DEFAULT_TASKS.read_text().splitlines()[0]).items() if k != "workspace"}


def _line(**changes) -> str:
    data = {k: v for k, v in {**GOOD, **changes}.items() if v is not None}
    return json.dumps(data)


BAD_LINES = {
    "bad JSON": ("{not json", "bad JSON"),
    "unknown server": (_line(server="sqlite"), "unknown server 'sqlite'"),
    "missing gold": (_line(gold=None), "missing 'gold' on a train task"),
    "unknown check": (_line(verifier={"kind": "git", "checks": [{"head_is": "x"}]}), "unknown verifier check"),
    "unknown verifier": (_line(verifier={"kind": "sql", "checks": [{"clean": True}]}), "'verifier' must be"),
    "bad split": (_line(split="dev"), "split must be one of"),
    "unknown key": (_line(notes="x"), "unknown key(s) ['notes']"),
    "bad step": (_line(workspace={"steps": [{"merge": "x"}]}), "unknown workspace step"),
    "escaping path": (_line(workspace={"steps": [{"write": {"../x": "y"}}]}), "leaves the repository"),
    "too many gold turns": (_line(gold=[[], []]), "'gold' must be a list of at most 1 turn"),
}


@pytest.mark.parametrize("name", sorted(BAD_LINES))
def test_bad_task_line_is_one_line_naming_file_and_line(tmp_path: Path, name: str) -> None:
    text, message = BAD_LINES[name]
    path = tmp_path / "t.jsonl"
    path.write_text(_line(task_id="ok/1") + "\n\n" + text + "\n")
    with pytest.raises(ValueError) as info:
        load_tasks([path], {"git"})
    assert str(info.value).startswith(f"{path}:3: ") and "\n" not in str(info.value)
    assert message in str(info.value)


def test_duplicate_task_id(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(_line() + "\n" + _line() + "\n")
    with pytest.raises(ValueError, match=rf"^{path}:2: task_id .* already used at {path}:1$"):
        load_tasks([path], {"git"})


def test_unknown_tool_in_subset_names_the_line(tmp_path: Path, pool: MCPPool) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(_line(tools=["git_status", "git_rebase"], gold=[[]]) + "\n")
    with pytest.raises(ValueError, match=rf"^{path}:1: unknown tool 'git_rebase' in 'tools'"):
        MCPPool(tasks=str(path), **SLOW)  # the tool list is cached per command: no new server
    records = load_tasks([path], {"git"})
    with pytest.raises(ValueError, match=rf"^{path}:1: gold calls 'git_log'"):
        check_tools([type(records[0])({**records[0].data, "tools": ["git_status"],
                                        "gold": [[{"name": "git_log"}]]}, path, 1)], {"git": ["git_status", "git_log"]})


def test_bad_pool_kwargs() -> None:
    with pytest.raises(ValueError, match="^servers.git.scope must be"):
        MCPPool(servers={"git": {"command": ["mcp-server-git"], "scope": "forever"}})
    with pytest.raises(ValueError, match="^servers.x.command: 'no-such-server-bin' is neither on PATH"):
        MCPPool(servers={"x": {"command": ["no-such-server-bin"]}})
    with pytest.raises(ValueError, match="^tasks: no such file or directory"):
        MCPPool(tasks="/nonexistent/tasks.jsonl")


@settings(max_examples=60, deadline=None)
@given(st.one_of(st.text(st.characters(blacklist_categories=("Cs",)), max_size=60), st.dictionaries(st.sampled_from(sorted(GOOD) + ["x"]),
                                                      st.one_of(st.none(), st.integers(), st.text(max_size=8),
                                                                st.lists(st.text(max_size=4), max_size=2)),
                                                      max_size=8).map(json.dumps)))
def test_any_line_parses_or_fails_in_one_line(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    path = tmp_path_factory.mktemp("h") / "t.jsonl"
    path.write_text(text.replace("\n", " ").replace("\r", " ") + "\n")
    try:
        load_tasks([path], {"git"})
    except ValueError as exc:
        assert str(exc).startswith(f"{path}:1: ") and "\n" not in str(exc)


# -- a url server (streamable HTTP, a session per episode) -----------------------------------------------------------

KV_SERVER = '''
import os, sys
import uvicorn
from mcp.server.mcpserver import Context, MCPServer
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.responses import JSONResponse

srv = MCPServer(name="kv")
STATE = {}

def sid(ctx):
    return ctx.request_context.request.headers.get("mcp-session-id", "")

@srv.tool(description="Store value under key")
async def put(key: str, value: str, ctx: Context) -> str:
    STATE.setdefault(sid(ctx), {})[key] = value
    return f"stored {key}"

@srv.tool(description="Read key")
async def get(key: str, ctx: Context) -> str:
    return STATE.get(sid(ctx), {}).get(key, "<missing>")

class Bearer(BaseHTTPMiddleware):
    async def dispatch(self, request, call_next):
        if request.headers.get("authorization") != "Bearer " + os.environ["KV_TOKEN"]:
            return JSONResponse({"error": "unauthorized"}, status_code=401)
        return await call_next(request)

app = srv.streamable_http_app()
app.add_middleware(Bearer)
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
'''
KV_TASK = {"task_id": "kv/put-01", "split": "train", "category": "kv", "server": "kv",
           "instruction": "Store 'blue' under the key 'color'.", "tools": ["put", "get"],
           "verifier": {"kind": "tool", "checks": [{"call": {"name": "get", "arguments": {"key": "color"}},
                                                    "contains": "blue"}]},
           "gold": [[{"name": "put", "arguments": {"key": "color", "value": "blue"}}]]}


@pytest.fixture(scope="module")
def kv_url(tmp_path_factory: pytest.TempPathFactory):
    import subprocess
    import sys
    import time
    import urllib.error
    import urllib.request

    from envace.eval.server import free_port

    folder = tmp_path_factory.mktemp("kv")
    (folder / "kv_server.py").write_text(KV_SERVER)
    port = free_port()
    env = {**os.environ, "KV_TOKEN": "s3cret"}
    proc = subprocess.Popen([sys.executable, str(folder / "kv_server.py"), str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/mcp"
    deadline = time.monotonic() + 300
    while True:  # ready once it answers HTTP at all (401 without the token)
        try:
            urllib.request.urlopen(url, timeout=5)
            break
        except urllib.error.HTTPError:
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the kv server did not start") from None
            time.sleep(0.2)
    yield url, proc
    proc.kill()
    proc.wait()


def _kv_pool(tmp_path: Path, url: str, token: str = "${KV_TOKEN_TEST}") -> MCPPool:
    (tmp_path / "kv.jsonl").write_text(json.dumps(KV_TASK) + "\n")
    servers = {"kv": {"url": url, "headers": {"Authorization": f"Bearer {token}"}}}
    return MCPPool(tasks=str(tmp_path / "kv.jsonl"), servers=servers, **SLOW)


def test_url_server_sessions(kv_url, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url, _ = kv_url
    monkeypatch.setenv("KV_TOKEN_TEST", "s3cret")
    before = runtime.open_sessions()
    pool = _kv_pool(tmp_path, url)
    try:
        assert pool.replay("kv/put-01", pool.gold_actions("kv/put-01")).passed
        assert not pool.replay("kv/put-01", [[ToolCall("put", {"key": "color", "value": "red"})]]).passed
        a, b = pool.start("kv/put-01"), pool.start("kv/put-01")
        a.execute(ToolCall("put", {"key": "color", "value": "blue"}))
        assert b.execute(ToolCall("get", {"key": "color"})) == "<missing>"  # sessions are isolated
        twin = a.fork()  # a new session and a replay of a's calls
        twin.execute(ToolCall("put", {"key": "color", "value": "green"}))
        assert a.verify().passed and not twin.verify().passed
        for ep in (a, b, twin):
            ep.close()
    finally:
        pool.close()
    assert runtime.open_sessions() == before


def test_url_server_refusal_and_loss(kv_url, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from envllm import ConfigurationError

    url, proc = kv_url
    mcp_pool._TOOL_CACHE.clear()  # list the tools again, with the wrong token
    with pytest.raises(ConfigurationError, match="HTTP 401"):
        _kv_pool(tmp_path, url, token="wrong")
    with pytest.raises(ValueError, match="^servers.kv.headers.Authorization: environment variable KV_UNSET"):
        _kv_pool(tmp_path, url, token="${KV_UNSET}")
    monkeypatch.setenv("KV_TOKEN_TEST", "s3cret")
    pool = _kv_pool(tmp_path, url)
    try:
        ep = pool.start("kv/put-01")
        proc.kill()
        proc.wait()
        with pytest.raises(EnvironmentUnavailable):
            ep.execute(ToolCall("put", {"key": "color", "value": "blue"}))
        ep.close()
    finally:
        pool.close()
