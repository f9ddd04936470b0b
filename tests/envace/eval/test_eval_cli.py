"""The evaluation CLI (envace/eval/cli.py): argument parsing (one flag per loop limit, same defaults, values
checked before anything runs) and a tiny end-to-end run through ``main`` against a real local
OpenAI-compatible HTTP server (tests/envace/conftest.py) answering with BFCL's gold calls: results, summary,
report and table files, a resume that sends no request, a refused resume with other settings, and the
``table`` subcommand over the run."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from envace.agents.engine import LoopLimits
from envace.envs.base import get_pool
from envace.eval.args import limits_from_args
from envace.eval.cli import build_parser, main
from envace.toolcall import render_tool_call

ENDPOINT = ["--base-url", "http://127.0.0.1:9/v1", "--model", "m"]


def test_every_loop_limit_has_a_flag_with_the_loop_default():
    args = build_parser().parse_args(["bfcl", *ENDPOINT])
    assert limits_from_args(args) == LoopLimits()
    # a value other than the default for every field, through its flag
    changed: dict[str, Any] = {}
    for f in dataclasses.fields(LoopLimits):
        choices = LoopLimits.CHOICES.get(f.name)
        if choices:
            changed[f.name] = next(c for c in choices if c != f.default)
        elif isinstance(f.default, float):
            changed[f.name] = f.default * 2 + 0.5
        else:
            changed[f.name] = f.default + 3
    argv = [a for name, v in changed.items() for a in ("--" + name.replace("_", "-"), str(v))]
    for bench in ("bfcl", "tau2"):
        args = build_parser().parse_args([bench, *ENDPOINT, *argv])
        assert limits_from_args(args) == LoopLimits(**changed)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bfcl"], "give --base-url and --model"),
        (["bfcl", "--base-url", "http://x/v1"], "give --base-url and --model"),
        (["bfcl", *ENDPOINT, "--checkpoint", "/ckpt"], "not both"),
        (["bfcl", *ENDPOINT, "--concurrency", "0"], "argument --concurrency: expected an integer >= 1, got '0'"),
        (["bfcl", *ENDPOINT, "--limit", "0"], "argument --limit: expected an integer >= 1"),
        (["bfcl", *ENDPOINT, "--env-timeout", "0"], "argument --env-timeout: expected a number > 0"),
        # issue 33 finding 10: NaN would make every task an infrastructure error that no rerun can finish
        (["bfcl", *ENDPOINT, "--env-timeout", "nan"], "argument --env-timeout: expected a number > 0, got 'nan'"),
        (["bfcl", *ENDPOINT, "--temperature", "nan"], "argument --temperature: expected a number >= 0, got 'nan'"),
        (["bfcl", *ENDPOINT, "--temperature", "-1"], "argument --temperature: expected a number >= 0"),
        (["bfcl", *ENDPOINT, "--top-p", "2"], "argument --top-p: expected a number > 0 and <= 1"),
        (["bfcl", *ENDPOINT, "--max-tokens", "0"], "argument --max-tokens: expected an integer >= 1"),
        (["bfcl", *ENDPOINT, "--tool-timeout-s", "inf"], "argument --tool-timeout-s: expected a number"),
        (["bfcl", *ENDPOINT, "--rehearsals", "5"], "--rehearsals has no effect without --tts"),
        (["tau2", *ENDPOINT, "--rehearsal-model", "x"], "--rehearsal-model has no effect without --tts"),
        (["bfcl", *ENDPOINT, "--tts", "parallel", "--tts-max-memory-chars", "100"],
         "--tts-max-memory-chars has no effect without --tts-memory verbatim"),
        (["sweep", "bfcl", "--out", "s", "--budgets", "0"], "argument --budgets: expected an integer >= 1"),
        (["bfcl", *ENDPOINT, "--chat-template-kwargs", "[1]"], "expected a JSON object"),
        (["sweep", "bfcl", "--out", "s", "--", *ENDPOINT, "--temperature", "nan"], "argument --temperature"),
        (["sweep", "bfcl", "--out", "s", "--"], "give --base-url and --model"),
        (["bfcl", *ENDPOINT, "--max-user-turns", "0"], "limits.max_user_turns must be >= 1"),
        (["bfcl", *ENDPOINT, "--max-calls-per-message", "0"], "limits.max_calls_per_message must be >= 1"),
        (["bfcl", *ENDPOINT, "--tool-timeout-s", "-1"], "limits.tool_timeout_s must be >= 0"),
        (["bfcl", *ENDPOINT, "--on-step-limit", "retry"], "invalid choice"),
        (["tau2", *ENDPOINT, "--categories", "base"], "unrecognized arguments"),
        (["table"], "required: runs"),
    ],
)
def test_bad_arguments_exit_2_before_anything_runs(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # no output directory, no request


def test_out_naming_a_file_is_a_clean_error(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    with pytest.raises(SystemExit) as exc:
        main(["bfcl", *ENDPOINT, "--out", str(tmp_path / "f")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"--out {tmp_path / 'f'} is a file" in err and len(err.splitlines()) == 1


def test_a_refused_endpoint_writes_nothing_so_the_corrected_command_runs(fake_openai, replies, tmp_path, capsys):
    """Finding 12: a wrong --model exits 2 before run.json exists; the corrected command is not refused."""
    server = fake_openai(lambda body, n: replies.chat("Done."))
    server.models = ["m"]
    out = tmp_path / "o"
    argv = ["bfcl", "--base-url", server.base_url, "--categories", "base", "--limit", "1", "--no-progress",
            "--out", str(out)]
    assert main([*argv, "--model", "not-served"]) == 2
    assert "not-served" in capsys.readouterr().err
    assert not out.exists()
    (out).mkdir()  # an existing, empty --out (e.g. made by the user) is left as it was too
    assert main([*argv, "--model", "not-served"]) == 2
    assert list(out.iterdir()) == []
    assert main([*argv, "--model", "m"]) in (0, 1)  # runs (the reply scores 0, so 1 is fine): not refused
    assert "different settings" not in capsys.readouterr().err and (out / "run.json").exists()


def test_unknown_category_is_a_clean_error(tmp_path, capsys):
    assert main(["bfcl", *ENDPOINT, "--categories", "web_search", "--out", str(tmp_path / "o")]) == 2
    assert "unknown bfcl categories" in capsys.readouterr().err


TASK = "multi_turn_base_0"  # the first base task: --categories base --limit 1


def gold_texts() -> list[str]:
    texts = []
    for turn in get_pool("bfcl_multi_turn").gold_actions(TASK):
        texts.extend(render_tool_call(c) for c in turn)
        texts.append("Done.")
    return texts


def test_a_tiny_run_writes_every_output_and_resumes(fake_openai, replies, tmp_path, capsys):
    server = fake_openai(replies.script(*[replies.chat(t) for t in gold_texts()]))
    out = tmp_path / "run"
    argv = ["bfcl", "--base-url", server.base_url, "--model", "gold", "--categories", "base", "--limit", "1",
            "--no-progress", "--max-steps-per-turn", "8", "--label", "gold-policy", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert server.n_requests == len(gold_texts())  # one request per assistant message
    assert all(b["model"] == "gold" and b["temperature"] == 0.6 and b["top_p"] == 0.95 for b in server.bodies)
    assert all(b["tools"] for b in server.bodies)  # the task's tools go with every request

    (rec,) = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert rec["task_id"] == TASK and rec["reward"] == 1.0 and rec["passed"] is True
    assert rec["tool_calls"] == sum(len(t) for t in get_pool("bfcl_multi_turn").gold_actions(TASK))
    assert rec["messages"][0]["role"] in ("system", "user")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["label"] == "gold-policy" and summary["benchmark"] == "bfcl"
    assert summary["summary"]["complete"] and summary["summary"]["categories"]["base"]["score"] == 100.0
    assert summary["identity"]["limits"] == dataclasses.asdict(LoopLimits(max_steps_per_turn=8))
    report = json.loads((out / "report.json").read_text())
    assert [r["task_id"] for r in report["records"]] == [TASK] and report["records"][0]["messages"] is None
    table_md = (out / "table.md").read_text()
    assert "gold-policy" in table_md and "100.0" in table_md
    row = [ln for ln in printed.splitlines() if ln.startswith("gold-policy")]
    assert row and "100.0" in row[0]

    # rerun: the finished task is skipped, nothing is requested, the table is the same
    assert main(argv) == 0
    assert server.n_requests == len(gold_texts()) and capsys.readouterr().out == printed
    # other settings into the same directory: refused, nothing requested
    assert main([*argv, "--temperature", "0.0"]) == 2
    assert "different settings (temperature: 0.6 -> 0.0)" in capsys.readouterr().err
    assert server.n_requests == len(gold_texts())

    # the table subcommand over the run directory
    assert main(["table", str(out)]) == 0
    assert [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("gold-policy")] == row


def test_no_transcripts_keeps_the_records_without_messages(fake_openai, replies, tmp_path):
    server = fake_openai(replies.script(*[replies.chat(t) for t in gold_texts()]))
    out = tmp_path / "run"
    assert main(["bfcl", "--base-url", server.base_url, "--model", "gold", "--categories", "base", "--limit", "1",
                 "--no-progress", "--no-transcripts", "--out", str(out)]) == 0
    (rec,) = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert rec["messages"] is None and rec["reward"] == 1.0


def test_table_of_a_directory_without_a_run_is_an_error(tmp_path: Path, capsys):
    assert main(["table", str(tmp_path)]) == 2
    assert "summary.json not found" in capsys.readouterr().err
    (tmp_path / "summary.json").write_bytes(b"\xff{")
    assert main(["tts-table", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "summary.json: not a readable summary.json" in err and len(err.splitlines()) == 1


def test_the_loop_limit_flags_reach_the_run(fake_openai, replies, tmp_path):
    """The flags are not only parsed and recorded: with ``--max-user-turns 1`` the gold policy's episode on a
    multi-turn task ends after its first user turn, having sent one request per gold call of that turn plus
    one for the turn's closing reply (len(turn 0) + 1), with stop reason max_user_turns and no pass."""
    turns = get_pool("bfcl_multi_turn").gold_actions(TASK)
    assert len(turns) > 1
    server = fake_openai(replies.script(*[replies.chat(t) for t in gold_texts()]))
    out = tmp_path / "run"
    main(["bfcl", "--base-url", server.base_url, "--model", "gold", "--categories", "base", "--limit", "1",
          "--no-progress", "--max-user-turns", "1", "--out", str(out)])
    (rec,) = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert server.n_requests == len(turns[0]) + 1
    assert rec["stop_reason"] == "max_user_turns" and rec["turns"] == 1 and rec["passed"] is False


# issue 43 finding 5: an endpoint outage is infrastructure (exit 3, one line), not a usage mistake (2) or a
# negative verdict (1). The fake answers every chat request with HTTP 500 and asks for a 1 ms retry delay, so the
# client's retries cost nothing.
def _outage(fake_openai, replies):
    server = fake_openai(lambda body, n: replies.error(500, "boom", headers={"retry-after-ms": "1"}))
    server.models = ["m"]
    return server


def _last_line(err: str) -> str:
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_an_outage_that_leaves_tasks_without_a_result_exits_3_and_the_rerun_resumes(
        fake_openai, replies, tmp_path, capsys):
    server = _outage(fake_openai, replies)
    out = tmp_path / "run"
    argv = ["bfcl", "--base-url", server.base_url, "--model", "m", "--categories", "base", "--limit", "3",
            "--no-progress", "--out", str(out)]
    assert main(argv) == 3
    line = _last_line(capsys.readouterr().err)
    assert line.startswith("python -m envace.eval: error: the endpoint or the environment is failing: 3 of 3 task(s) "
                           "failed (last: ") and f"{server.base_url}: HTTP 500" in line and "boom" in line
    assert line.endswith(f"saved in {out / 'results.jsonl'}: rerun the same command to resume once it answers")
    assert not json.loads((out / "summary.json").read_text())["summary"]["complete"]
    server.responder = lambda body, n: replies.chat("Done.")  # the endpoint is back: the rerun finishes the run
    assert main(argv) in (0, 1)  # "Done." solves nothing: a negative verdict, not an outage
    assert "3 task(s) selected, 0 already done" in capsys.readouterr().err
    assert json.loads((out / "summary.json").read_text())["summary"]["complete"]


def test_ten_failures_in_a_row_stop_the_run_with_exit_3(fake_openai, replies, tmp_path, capsys):
    server = _outage(fake_openai, replies)
    out = tmp_path / "run"
    assert main(["bfcl", "--base-url", server.base_url, "--model", "m", "--limit", "12", "--no-progress",
                 "--out", str(out)]) == 3
    line = _last_line(capsys.readouterr().err)
    assert line.startswith("python -m envace.eval: error: the endpoint or the environment is failing: 10 tasks in a "
                           "row failed (last: ") and f"{server.base_url}: HTTP 500" in line and "rerun the same command" in line
    assert len((out / "errors.jsonl").read_text().splitlines()) == 10


def test_an_endpoint_down_at_preflight_exits_3_and_writes_nothing(dead_url, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["bfcl", "--base-url", dead_url, "--model", "m", "--categories", "base", "--limit", "1",
                 "--no-progress", "--out", str(out)]) == 3
    line = _last_line(capsys.readouterr().err)
    assert line.startswith(f"python -m envace.eval: error: the endpoint is failing: {dead_url}: GET /models failed")
    assert line.endswith("(rerun the same command once it answers; finished tasks are kept)")
    assert not out.exists()
