"""End to end: ``scripts/eval_tau2.sh`` and ``scripts/eval_bfcl.sh`` against a real OpenAI-compatible
server (``transformers serve`` on CPU) serving the tiny random Qwen3 built by ``envace.models``; the
official scorers run through the pools. Scores are ~0 (random weights); the point is the whole path:
server, chat template with tools, tool-call parsing, simulated τ² user, checkers, table, resume.

Generation is kept short (32 new tokens, a few turns) so the runs take about a minute each on CPU.

The same server also answers trace2env's OpenAI provider and world-model agent (the ``test_trace2env_*``
tests at the end): real replies through repair rounds, truncation retries, token accounting and the answer cache.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from envace.eval.server import LaunchedServer, launch_server

if TYPE_CHECKING:
    from trace2env.llm import OpenAIProvider

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

ROOT = Path(__file__).resolve().parents[3]
SHORT = ["--max-tokens", "32", "--max-user-turns", "2", "--max-steps-per-turn", "2", "--seed", "0", "--no-progress"]


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from envace.models import ensure_tiny_model

    return ensure_tiny_model()


def script(name: str, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run(
        [str(ROOT / "scripts" / name), *args], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines() if line.strip()]


def test_eval_tau2_script_serves_a_checkpoint(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "tau2"
    proc = script(
        "eval_tau2.sh",
        "--checkpoint",
        str(tiny_model),
        "--server",
        "transformers",
        "--limit",
        "1",
        "--user-max-tokens",
        "32",
        "--user-temperature",
        "1.0",
        "--out",
        str(out),
        *SHORT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "server ready at http://127.0.0.1:" in proc.stderr
    assert "Airline" in proc.stdout and "tiny-qwen3" in proc.stdout
    assert "Registry info" not in proc.stdout + proc.stderr  # τ²'s loguru DEBUG output stays quiet
    recs = records(out)
    assert sorted(r["category"] for r in recs) == ["airline", "retail", "telecom"]
    for r in recs:
        assert 0.0 <= r["reward"] <= 1.0 and r["details"]["termination_reason"]
        assert r["messages"][0]["role"] == "system" and r["messages"][1]["content"] == "Hi! How can I help you today?"
        assert r["completions"] >= 1  # the simulated user answered and the agent spoke
    summary = json.loads((out / "summary.json").read_text())["summary"]
    assert summary["complete"] and summary["average"] <= 25.0
    assert (out / "table.md").read_text().startswith("| Model | τ²-bench (%)")


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaunchedServer]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    with launch_server(str(tiny_model), "transformers", startup_timeout=600, log_path=log) as srv:
        yield srv


def test_eval_bfcl_script_and_resume(server: LaunchedServer, tmp_path: Path) -> None:
    out = tmp_path / "bfcl"
    common = ["--base-url", server.base_url, "--model", server.model, "--limit", "1", "--out", str(out), *SHORT]
    first = script("eval_bfcl.sh", *common)
    assert first.returncode == 0, first.stderr[-3000:]
    recs = records(out)
    assert sorted(r["category"] for r in recs) == ["base", "long_context", "miss_func", "miss_param"]
    assert all(r["reward"] == 0.0 and r["reason"] for r in recs)  # the official checker said why
    table = (out / "table.md").read_text()
    summary = json.loads((out / "summary.json").read_text())["summary"]
    assert summary["complete"] and "Miss Func." in first.stdout

    # Interrupted run: the process died while writing the last record.
    lines = (out / "results.jsonl").read_text().splitlines()
    (out / "results.jsonl").write_text("\n".join(lines[:3]) + "\n" + lines[3][:40])
    second = script("eval_bfcl.sh", *common)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "ran 1, skipped 3" in second.stderr
    assert (out / "table.md").read_text() == table
    resumed = json.loads((out / "summary.json").read_text())["summary"]
    assert {k: v["score"] for k, v in resumed["categories"].items()} == {
        k: v["score"] for k, v in summary["categories"].items()
    }
    assert sorted(r["task_id"] for r in records(out)) == sorted(r["task_id"] for r in recs)

    # A finished run reruns nothing and needs no server.
    third = script("eval_bfcl.sh", *[a if a != server.base_url else "http://127.0.0.1:9/v1" for a in common])
    assert third.returncode == 0 and "ran 0, skipped 4" in third.stderr


def test_eval_bfcl_with_test_time_rehearsal_on_vllms_cpu_server(tiny_model: Path, tmp_path: Path) -> None:
    """The evaluation CLI serves the checkpoint with ``vllm serve`` (vLLM's CPU build, the server GPU users run,
    with its hermes tool-call parser) and plays one BFCL task with test-time rehearsal against it: rehearsals,
    self-evaluations, the summary and the committed execution all go through vLLM's OpenAI route. The BFCL prompt
    (about 4,800 tokens) is longer than vLLM's prefill chunk: the seeded requests run only because the CLI turns
    chunked prefill off on CPU (``envace.eval.server._vllm_cpu_args``)."""
    out = tmp_path / "vllm"
    proc = script("eval_bfcl.sh", "--checkpoint", str(tiny_model), "--server", "vllm",
                  "--server-arg=--enforce-eager", "--server-arg=--max-model-len=16384", "--server-timeout", "600",
                  "--categories", "base", "--limit", "1", "--tts", "parallel", "--rehearsals", "2",
                  "--out", str(out), *SHORT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (rec,) = records(out)
    assert rec["task_id"] == "multi_turn_base_0" and rec["reason"] and 0.0 <= rec["reward"] <= 1.0
    tts = rec["extra"]["tts"]
    assert [a["index"] for a in tts["attempts"]] == [1, 2]
    assert all(a["assistant_messages"] >= 1 for a in tts["attempts"])
    assert tts["cost"]["commit"]["completion_tokens"] > 0


def test_missing_vllm_is_a_clear_error(tiny_model: Path, tmp_path: Path) -> None:
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    proc = script("eval_bfcl.sh", "--checkpoint", str(tiny_model), "--out", str(tmp_path), timeout=120)
    assert proc.returncode == 2
    assert "vLLM, which is not installed" in proc.stderr and "--server transformers" in proc.stderr


@pytest.mark.parametrize("mode", ["parallel", "sequential"])
def test_eval_bfcl_script_with_test_time_rehearsal(server: LaunchedServer, tmp_path: Path, mode: str) -> None:
    """``--tts MODE --rehearsals 2`` on two BFCL tasks: rehearsals, (masked) evaluations and summary, one
    committed execution scored by the official checker, the per-role cost table; a rerun resumes."""
    out = tmp_path / f"tts-{mode}"
    argv = ["--base-url", server.base_url, "--model", server.model, "--categories", "base", "--limit", "2",
            "--concurrency", "2", "--tts", mode, "--rehearsals", "2", "--out", str(out), *SHORT]
    proc = script("eval_bfcl.sh", *argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(proc.stdout)  # the table and the per-role cost table (pytest -s shows them)
    recs = records(out)
    assert sorted(r["task_id"] for r in recs) == ["multi_turn_base_0", "multi_turn_base_1"]
    for r in recs:
        assert r["reason"] and 0.0 <= r["reward"] <= 1.0  # the official checker scored the committed execution
        tts = r["extra"]["tts"]
        assert tts["mode"] == mode and [a["index"] for a in tts["attempts"]] == [1, 2]
        assert all(a["assistant_messages"] >= 1 for a in tts["attempts"])
        # a random tiny model writes no valid JSON: every evaluation / summary failure is masked and reported
        for a in tts["attempts"]:
            assert (a["feedback"] is None) == bool(a["evaluation_error"])
        assert (tts["memory"] is None) == bool(tts["memory_error"])
        assert {"act", "rehearse", "evaluate", "summarize", "commit"} >= set(tts["cost"]) >= {"act", "evaluate",
                                                                                             "summarize", "commit"}
    cost = json.loads((out / "summary.json").read_text())["tts_cost"]
    assert cost["tasks"] == 2 and cost["attempts"] == 4 and cost["roles"]["evaluate"]["calls"] >= 4
    assert cost["roles"]["commit"]["completion_tokens"] > 0
    assert "test-time rehearsal cost per role" in proc.stdout and "summarize" in proc.stdout
    again = script("eval_bfcl.sh", *argv)
    assert again.returncode == 0 and "ran 0, skipped 2" in again.stderr


def test_tts_with_the_served_model_as_rehearsal_model(server: LaunchedServer, fake_openai, replies,
                                                      tmp_path: Path) -> None:
    """The rehearsal model is another endpoint (the paper's "Base" rows): the real server writes the imagined
    tool responses while a scripted policy acts with BFCL's gold calls and writes valid feedback and memory, so
    the memory reaches the committed execution, which the official checker scores 1.0."""
    from envace.envs.base import get_pool
    from envace.toolcall import render_tool_call

    gold = get_pool("bfcl_multi_turn").gold_actions("multi_turn_base_0")
    memory = {"facts": ["F"], "pitfalls": ["P"], "plan": ["follow the user's steps"]}

    def policy(body: dict, n: int) -> object:
        msgs = body["messages"]
        first = msgs[0]["content"] or ""
        if body.get("tools"):
            if msgs[-1]["role"] != "user":
                return replies.chat("Done.")
            return replies.chat("\n".join(render_tool_call(c) for c in gold[sum(m["role"] == "user" for m in msgs) - 1]))
        if "You are reviewing one private rehearsal" in first:
            return replies.chat(json.dumps({"assessment": "ok", "success": True, "revision": "none"}))
        return replies.chat(json.dumps(memory))

    fake = fake_openai(policy)
    out = tmp_path / "tts-base"
    argv = ["--base-url", fake.base_url, "--model", "policy", "--categories", "base", "--limit", "1",
            "--tts", "parallel", "--rehearsals", "2", "--rehearsal-base-url", server.base_url,
            "--rehearsal-model", server.model, "--max-steps-per-turn", "8", "--out", str(out),
            "--max-tokens", "32", "--seed", "0", "--no-progress"]
    proc = script("eval_bfcl.sh", *argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (rec,) = records(out)
    tts = rec["extra"]["tts"]
    assert tts["rehearsal_model"] == server.model and tts["memory"] == memory
    assert tts["cost"]["rehearse"]["calls"] >= 2 and tts["cost"]["rehearse"]["completion_tokens"] > 0
    assert all(a["malformed_rehearsals"] + a["tool_calls"] >= 1 for a in tts["attempts"])
    assert not any((b["messages"][0]["content"] or "").startswith("You are the environment")
                   for b in fake.bodies)  # the policy endpoint wrote no tool response
    assert rec["reward"] == 1.0, rec["reason"]


# -- trace2env's OpenAI provider and world-model agent against the same real server ---------------------------------
# The fake-server tests (tests/trace2env/test_llm.py, test_agent.py) script the replies; here the
# replies are the tiny random model's own. ``transformers serve`` ignores ``response_format`` (it logs "Ignoring
# unsupported fields"), so the provider's default json_schema request is answered with free text and the validation
# is the provider's own. Greedy decoding (the provider's default temperature 0) makes the replies deterministic.


class _Wire:
    """An ``openai`` client whose HTTP exchanges with the server are recorded: (request body, status, response
    body), so the provider's accounting is compared with what the server itself reported."""

    def __init__(self, base_url: str) -> None:
        import httpx
        import openai

        self.exchanges: list[tuple[dict, int, dict]] = []

        def record(resp: httpx.Response) -> None:
            resp.read()
            self.exchanges.append((json.loads(resp.request.content), resp.status_code, resp.json()))

        self.client = openai.OpenAI(base_url=base_url, api_key="EMPTY", timeout=120, max_retries=0,
                                    http_client=httpx.Client(timeout=120, event_hooks={"response": [record]}))

    def usage(self, key: str) -> int:
        return sum(resp["usage"][key] for _, _, resp in self.exchanges)


def _t2e_provider(server: LaunchedServer, **config: object) -> tuple[OpenAIProvider, _Wire]:
    from trace2env.llm import OpenAIProvider, OpenAIProviderConfig

    wire = _Wire(server.base_url)
    return OpenAIProvider(OpenAIProviderConfig(base_urls=server.base_url, model=server.model, **config),
                          client=wire.client), wire


def test_trace2env_provider_repairs_truncation_and_accounting_on_a_real_server(server: LaunchedServer,
                                                                              tmp_path: Path) -> None:
    """A stage the random model cannot answer: every request reaches the server; replies cut off at max_tokens are
    retried at twice the budget (up to the cap); the bounded repair rounds show the model its reply; the call ends in
    ModelOutputError naming the stage, the rounds and the reason (no default answer, nothing cached); the per-stage
    tokens and cost equal the server's reported usage."""
    from pydantic import BaseModel

    from trace2env.llm import STAGE_INSTRUCTIONS
    from trace2env.providers import ModelOutputError

    class Notes(BaseModel):
        notes: list[str]

    p, wire = _t2e_provider(server, max_tokens=4, max_tokens_cap=8, repair_rounds=2, cache_dir=str(tmp_path / "cache"),
                            usd_per_m_prompt=1.0, usd_per_m_completion=2.0)
    payload = {"transitions": [{"id": "t0", "action": {"name": "get", "arguments": {"key": "a"}},
                                "observation": '{"key": "a", "value": 1}'}]}
    with pytest.raises(ModelOutputError) as ei:
        p.complete("induce_notes", payload, Notes)

    assert len(wire.exchanges) == 3 and all(status == 200 for _, status, _ in wire.exchanges)
    bodies = [b for b, _, _ in wire.exchanges]
    answers = [r["choices"][0] for _, _, r in wire.exchanges]
    assert answers[0]["finish_reason"] == "length" and wire.exchanges[0][2]["usage"]["completion_tokens"] == 4
    budgets = [b["max_tokens"] for b in bodies]
    for prev, nxt, ans in zip(budgets, budgets[1:], answers):  # doubled after a cut-off reply, capped at 8
        assert nxt == (min(8, 2 * prev) if ans["finish_reason"] == "length" else prev)
    assert budgets[:2] == [4, 8]
    for b in bodies:
        assert b["model"] == server.model and b["temperature"] == 0.0
        assert b["response_format"]["json_schema"]["name"] == "Notes"
        assert b["messages"][0]["content"].startswith(STAGE_INSTRUCTIONS["induce_notes"])
        assert json.loads(b["messages"][1]["content"]) == payload
    for i in (1, 2):  # a repair round: the previous request, the model's reply, the reason it was refused
        msgs = bodies[i]["messages"]
        assert msgs[:-2] == bodies[i - 1]["messages"]
        assert msgs[-2] == {"role": "assistant", "content": answers[i - 1]["message"]["content"]}
        assert msgs[-1]["role"] == "user" and msgs[-1]["content"].startswith("Your previous reply could not be used")
        assert f"cut off at {budgets[i - 1]} tokens" in msgs[-1]["content"]

    err = ei.value
    assert err.rounds == 3 and err.text == answers[-1]["message"]["content"]
    assert "stage 'induce_notes': no valid Notes after 3 request(s)" in str(err)
    assert f"(the reply was cut off at {budgets[-1]} tokens)" in str(err)

    u = p.usage["induce_notes"]
    assert (u.calls, u.requests, u.repairs, u.retries, u.failures, u.cache_hits) == (1, 3, 2, 0, 1, 0)
    assert u.prompt_tokens == wire.usage("prompt_tokens") > 0
    assert u.completion_tokens == wire.usage("completion_tokens") > 0
    prompts = [r["usage"]["prompt_tokens"] for _, _, r in wire.exchanges]
    assert prompts == sorted(set(prompts))  # each repair round sends a longer conversation
    assert u.usd == pytest.approx(u.prompt_tokens * 1e-6 + u.completion_tokens * 2e-6)
    total = p.usage_table()[-1]
    assert total["stage"] == "total" and total["prompt_tokens"] == u.prompt_tokens

    # a failed stage is not cached: asking again goes to the server again
    assert not list((tmp_path / "cache").rglob("*.json"))
    with pytest.raises(ModelOutputError):
        p.complete("induce_notes", payload, Notes)
    assert len(wire.exchanges) == 6 and p.usage["induce_notes"].failures == 2


def test_trace2env_provider_cache_on_a_real_server(server: LaunchedServer, tiny_model: Path, tmp_path: Path) -> None:
    """A validated answer is cached: the repeat (same provider, or a new one on the same cache directory) returns
    the identical answer without a request. The random model writes no JSON by itself, so the request's standard
    ``logit_bias`` (passed through ``extra_body``) makes the server generate ``{}`` tokens, which validate."""
    from pydantic import BaseModel
    from tokenizers import Tokenizer  # not transformers: its import alone takes ~15 s on a CI core

    class Notes(BaseModel):
        notes: list[str] = []

    (brace,) = Tokenizer.from_file(str(tiny_model / "tokenizer.json")).encode("{}", add_special_tokens=False).ids
    cfg = {"max_tokens": 4, "cache_dir": str(tmp_path / "cache"),
           "extra_body": {"logit_bias": {str(brace): 100.0}}}  # a float: the server refuses an int bias (HTTP 500)
    p, wire = _t2e_provider(server, **cfg)
    payload = {"transitions": ["t0"]}
    first = p.complete("induce_notes", payload, Notes)
    assert len(wire.exchanges) == 1
    body, status, resp = wire.exchanges[0]
    assert status == 200 and body["logit_bias"] == {str(brace): 100.0}
    assert resp["choices"][0]["message"]["content"].startswith("{}")  # the server generated it
    assert first == Notes() and list((tmp_path / "cache" / "induce_notes").glob("*.json"))
    u = p.usage["induce_notes"]
    assert (u.calls, u.requests, u.repairs, u.cache_hits) == (1, 1, 0, 0)
    assert (u.prompt_tokens, u.completion_tokens) == (resp["usage"]["prompt_tokens"], resp["usage"]["completion_tokens"])

    again = p.complete("induce_notes", payload, Notes)
    resumed, wire2 = _t2e_provider(server, **cfg)  # an interrupted build restarts on the same cache
    third = resumed.complete("induce_notes", payload, Notes)
    assert again == first == third
    assert len(wire.exchanges) == 1 and not wire2.exchanges
    u = p.usage["induce_notes"]
    assert (u.calls, u.requests, u.cache_hits, u.prompt_tokens) == (2, 1, 1, resp["usage"]["prompt_tokens"])
    assert resumed.usage["induce_notes"].cache_hits == 1 and resumed.totals().requests == 0
    # another payload is another key: it goes to the server
    p.complete("induce_notes", {"transitions": ["t1"]}, Notes)
    assert len(wire.exchanges) == 2


def test_trace2env_world_model_agent_step_on_a_real_server(server: LaunchedServer, tmp_path: Path) -> None:
    """One simulator step that no rule or record covers goes to the world-model agent, whose model call reaches
    the server with the step's brief; the random model never answers a valid AgentTurn, so after the repair round
    the step is an error observation (the world model's failure), the state unchanged, never an invented one."""
    from trace2env import WorldbookEnv, build_worldbook, load_worldbook, parse_trace
    from trace2env.agent import WorldModelAgent

    def steps(*calls: tuple[str, dict, dict]) -> list[dict]:
        return [{"action": {"name": n, "arguments": a}, "observation": json.dumps(o)} for n, a, o in calls]

    traces = [parse_trace({"episode_id": f"ep{i}", "metadata": {"initial_state_id": "empty"}, "steps": steps(
        ("put", {"key": k, "value": i}, {"ok": True, "key": k}),
        ("get", {"key": k}, {"key": k, "value": i}),
        ("get", {"key": "missing"}, {"error": "not found", "key": "missing"}))}) for i, k in enumerate("abc")]
    wb = load_worldbook(build_worldbook(traces, tmp_path / "wb"))
    p, wire = _t2e_provider(server, max_tokens=8, repair_rounds=1)
    agent = WorldModelAgent(p)
    env = WorldbookEnv(wb, proposer=agent)
    env.reset({"initial_state_id": "empty"}, seed=0)
    before = env.session.state
    obs, done, info = env.step({"name": "get", "arguments": {"key": "zzz"}})

    assert info["route"] == "proposer" and not info["accepted"] and not done
    assert json.loads(obs) == {"error": "the world model proposed nothing", "type": "no_transition"}
    assert env.session.state is before and env.session.revision == 0
    st = agent.stats
    assert (st.steps, st.model_calls, st.format_failures, st.accepted, st.tool_calls) == (1, 1, 1, 0, 0)
    assert len(wire.exchanges) == 2 and all(status == 200 for _, status, _ in wire.exchanges)
    brief = json.loads(wire.exchanges[0][0]["messages"][1]["content"])
    assert brief["action"]["name"] == "get" and brief["action"]["arguments"] == {"key": "zzz"}
    assert brief["transcript"] == [] and brief["tool_calls_left"] == agent.max_tool_calls and "submit" in brief["tools"]
    assert brief["evidence"] and brief["package_applicability"]["abstained"]  # records of get, none supporting
    u = p.usage["world_model_step"]
    assert (u.calls, u.requests, u.repairs, u.failures) == (1, 2, 1, 1)
    assert (u.prompt_tokens, u.completion_tokens) == (wire.usage("prompt_tokens"), wire.usage("completion_tokens"))
