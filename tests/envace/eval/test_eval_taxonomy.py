"""Evaluation tells its three kinds of failure apart, through the real CLI against a real local HTTP server:

* configuration errors (unknown model, other 4xx) abort the run at once, with the reason and exit code 2;
* model errors (the conversation outgrew the context, a malformed or undecodable tool call, a tool call that
  breaks or outruns the environment) are scored as the model's failure, once;
* infrastructure errors (5xx, connection) are logged and retried on the next run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from envace.eval.cli import main

BFCL = ["bfcl", "--limit", "1", "--categories", "base", "--no-progress", "--max-user-turns", "1"]


def run_cli(url: str, out: Path, model: str = "m", *extra: str) -> int:
    return main([*BFCL, "--base-url", url, "--model", model, "--out", str(out), *extra])


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def test_unknown_model_aborts_before_any_task(fake_openai, replies, tmp_path, capsys):
    """Old behaviour: ``--model`` was never checked; every request failed with HTTP 404 (or a lenient server
    answered anyway) and the run ended "complete" or with per-task errors retried on every rerun."""

    def responder(body: dict[str, Any], n: int):
        if body.get("model") != "qwen3":
            return replies.error(404, f"The model `{body.get('model')}` does not exist.")
        return replies.chat("Done.")

    server = fake_openai(responder)
    server.models = ["qwen3"]
    assert run_cli(server.base_url, tmp_path, "qwen-typo") == 2
    err = capsys.readouterr().err
    assert "configuration error" in err and "does not serve model 'qwen-typo'" in err and "qwen3" in err
    assert server.n_requests == 0  # no task ran
    assert lines(tmp_path / "results.jsonl") == [] and lines(tmp_path / "errors.jsonl") == []


@pytest.mark.parametrize(("status", "message"), [(404, "no such model"), (401, "bad key"), (400, "bad temperature")])
def test_a_4xx_during_the_run_aborts_with_the_reason(fake_openai, replies, tmp_path, capsys, status, message):
    server = fake_openai(lambda body, n: replies.error(status, message))  # no model listing: no pre-check
    assert run_cli(server.base_url, tmp_path) == 2
    err = capsys.readouterr().err
    assert f"HTTP {status}" in err and message in err
    assert server.n_requests == 1  # not retried
    assert lines(tmp_path / "results.jsonl") == [] and lines(tmp_path / "errors.jsonl") == []


def test_server_errors_are_infrastructure_retried_on_rerun(fake_openai, replies, tmp_path):
    server = fake_openai(lambda body, n: replies.error(503, "overloaded"))
    assert run_cli(server.base_url, tmp_path, "m", "--request-timeout", "5") == 3  # an outage (issue 43), rerun resumes
    assert [e["task_id"] for e in lines(tmp_path / "errors.jsonl")] == ["multi_turn_base_0"]
    assert lines(tmp_path / "results.jsonl") == []


def test_context_too_long_is_the_models_failure_scored_once(fake_openai, replies, tmp_path):
    msg = "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens."
    server = fake_openai(lambda body, n: replies.error(400, msg))
    assert run_cli(server.base_url, tmp_path) == 0
    (rec,) = lines(tmp_path / "results.jsonl")
    assert rec["stop_reason"] == "model_error" and rec["reward"] == 0.0 and "maximum context length" in rec["error"]
    assert lines(tmp_path / "errors.jsonl") == []
    assert run_cli(server.base_url, tmp_path) == 0 and server.n_requests == 1  # scored once: not run again


def test_a_lone_surrogate_in_a_tool_call_is_scored(fake_openai, replies, tmp_path):
    """Old behaviour: ``{"folder": "\\ud800"}`` made the result store raise UnicodeEncodeError; the task was
    logged as an infrastructure error and retried on every rerun."""
    call = '<tool_call>{"name": "cd", "arguments": {"folder": "\\ud800"}}</tool_call>'
    server = fake_openai(replies.script(replies.chat(call), replies.chat("Done.")))
    assert run_cli(server.base_url, tmp_path) == 0
    (rec,) = lines(tmp_path / "results.jsonl")
    assert rec["tool_calls"] == 1 and lines(tmp_path / "errors.jsonl") == []
    sent = server.bodies[1]["messages"]  # the call went back to the server as valid UTF-8 JSON
    assert any("\ufffd" in json.dumps(m, ensure_ascii=False) for m in sent)


def test_a_tool_call_that_breaks_the_environment_is_scored(fake_openai, replies, tmp_path):
    """``power(base=10, exponent=5000)``: BFCL's MathAPI returns an int too long to print (int→str digit
    limit). The model reads the error; the task is scored and stored, never retried."""
    from envace.agents.client import ChatClient, EndpointConfig
    from envace.agents.engine import LoopLimits
    from envace.envs.base import get_pool
    from envace.eval.runner import AgentLoopRunner
    from envace.eval.store import ResultStore

    call = '<tool_call>{"name": "power", "arguments": {"base": 10, "exponent": 5000}}</tool_call>'
    server = fake_openai(lambda body, n: replies.chat(call if body["messages"][-1]["role"] == "user" else "Done."))
    pool = get_pool("bfcl_multi_turn", categories=("multi_turn_base",))
    tid = "multi_turn_base_15"
    assert "MathAPI" in pool.entry(tid)["involved_classes"]
    runner = AgentLoopRunner(ChatClient(EndpointConfig(base_urls=server.base_url, model="m")),
                             LoopLimits(max_user_turns=1))
    rec = runner(pool, tid)
    ResultStore(tmp_path).append(rec)
    assert rec.tool_calls == 1 and rec.reward == 0.0 and rec.stop_reason == "max_user_turns"
    tool = [m["content"] for m in rec.messages if m["role"] == "tool"]
    assert len(tool) == 1 and "Exceeds the limit" in tool[0]
    assert lines(tmp_path / "results.jsonl")[0]["task_id"] == tid
