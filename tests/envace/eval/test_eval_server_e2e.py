"""End to end: ``scripts/eval_tau2.sh`` and ``scripts/eval_bfcl.sh`` against a real OpenAI-compatible
server (``transformers serve`` on CPU) serving the tiny random Qwen3 built by ``envace.models``; the
official scorers run through the pools. Scores are ~0 (random weights); the point is the whole path:
server, chat template with tools, tool-call parsing, simulated τ² user, checkers, table, resume.

Generation is kept short (32 new tokens, a few turns) so the runs take about a minute each on CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from envace.eval.server import LaunchedServer, launch_server

pytestmark = pytest.mark.slow

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
