"""benchmarks/tts_rehearsal.py in its smoke mode, end to end: the evaluation CLI (``python -m envace.eval synthetic``)
against a scripted OpenAI-compatible endpoint (tests/conftest.py) that acts with each held-out task's gold calls and
replies; the table's figures are recomputed here from the run's own records, and a rerun resumes (no request)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import tts_rehearsal as bench

from envace.envs.base import get_pool
from envace.eval.store import ResultStore
from envace.toolcall import render_tool_call


def test_cells_put_the_no_rehearsal_run_first_and_name_each_setting():
    plan = bench.cells(["parallel", "sequential"], [0, 1, 2, 4], ["summary", "verbatim"])
    assert [c.name for c in plan[:3]] == ["n0", "parallel-n1-summary", "parallel-n1-verbatim"]
    # sequential N = 1 plays what parallel N = 1 plays (one attempt sees no earlier one): planned only without it
    assert len(plan) == 1 + 2 + 2 * 2 * 2 and plan[-1].name == "sequential-n4-verbatim"
    assert not any(c.n == 1 and c.mode == "sequential" for c in plan)
    assert [c.name for c in bench.cells(["sequential"], [1], ["verbatim"])] == ["sequential-n1-verbatim"]
    assert plan[0].flags(1.0, 0.6) == ["--temperature", "1.0", "--top-p", "1.0"]
    flags = plan[-1].flags(1.0, 0.6)
    assert flags[:6] == ["--tts", "sequential", "--rehearsals", "4", "--tts-memory", "verbatim"]
    assert flags[flags.index("--rehearse-temperature") + 1] == "0.6"


def test_checkpoints_are_served_once_per_policy_in_fp32_unless_told_otherwise(tmp_path: Path):
    """A Hugging Face directory is used as it is (a verl run would be exported first); its server gets
    ``--dtype=float32`` for both policies unless a ``--server-arg`` names a dtype; the recorded command of a cell is
    its stand-alone form (``--checkpoint`` with the same server and arguments)."""
    trained, warm = tmp_path / "trained", tmp_path / "warm"
    for d in (trained, warm):
        d.mkdir()
        (d / "config.json").write_text("{}")
    args, _ = bench.parse_args(["--trained", str(trained), "--warm", str(warm), "--out", str(tmp_path / "o"),
                                "--server", "vllm"])
    assert [(p.name, p.flags()) for p in bench.policies(args)] == [
        (name, ["--checkpoint", str(d), "--server", "vllm", "--server-arg=--dtype=float32"])
        for name, d in (("trained", trained), ("warm", warm))]
    args, _ = bench.parse_args(["--trained", str(trained), "--warm", str(warm), "--server-arg=--dtype=bfloat16"])
    assert bench.policies(args)[1].server_args == ("--dtype=bfloat16",)
    assert not (tmp_path / "o").exists()


def scripted(pool: Any, replies: Any) -> Any:
    """The policy: the gold calls of the task its first user message names, then the gold reply; the rehearsal role
    imagines ``{"ok": true}``; nothing else is expected with verbatim memory."""
    by_instruction = {}
    for tid in pool.task_ids("test"):
        if pool.task(tid).category == "query":
            episode = pool.start(tid)
            first = next(m["content"] for m in episode.initial_messages() if m["role"] == "user")
            by_instruction[first] = (pool.gold_actions(tid), pool.gold_replies(tid))

    def answer(body: dict[str, Any], n: int) -> Any:
        msgs = body["messages"]
        if not body.get("tools"):
            assert msgs[0]["content"].startswith("You are the environment"), msgs[0]["content"][:200]
            return replies.chat('<execution_result>\n{"ok": true}\n</execution_result>')
        gold, texts = by_instruction[next(m["content"] for m in msgs if m["role"] == "user")]
        turn = sum(m["role"] == "user" for m in msgs) - 1
        if msgs[-1]["role"] == "user":
            return replies.chat("\n".join(render_tool_call(c) for c in gold[turn]))
        return replies.chat(texts[turn])

    return answer


def test_smoke_runs_one_cell_through_the_cli_tabulates_its_records_and_resumes(fake_openai, replies, tmp_path: Path,
                                                                             capsys: pytest.CaptureFixture[str]):
    flags, _, _ = bench.recipe_flags([])
    pool = get_pool("synthetic", **json.loads(flags[flags.index("--pool-kwargs") + 1]))
    fake = fake_openai(scripted(pool, replies))
    out = tmp_path / "tts"
    argv = ["--smoke", "--base-url", fake.base_url, "--model", "m", "--out", str(out)]
    assert bench.main(argv) == 0
    printed = capsys.readouterr().out
    data = json.loads((out / "tts_rehearsal.json").read_text())

    (cmd,) = data["commands"]
    assert " -m envace.eval synthetic " in cmd and "--tts parallel --rehearsals 1 --tts-memory verbatim" in cmd
    assert "--split test" in cmd and "--categories query" in cmd and "--limit 2" in cmd
    run_dir = out / "endpoint" / "parallel-n1-verbatim"
    records = list(ResultStore(run_dir, create=False).completed().values())
    assert len(records) == 2 and all(pool.split_of(r.task_id) == "test" for r in records)
    (row,) = data["rows"]
    assert (row["policy"], row["cell"], row["shape"], row["tasks"]) == ("endpoint", "Par. N=1 verbatim", "query", 2)
    assert row["success"] == sum(r.passed for r in records) / 2 == 1.0 and row["se"] == 0.0
    assert row["real_calls"] == sum(sum(map(len, pool.gold_actions(r.task_id))) for r in records) / 2
    texts = [r.extra["tts"]["memory_text"] for r in records]
    assert all(t.startswith("# Rehearsal memory") and '"ok": true' in t for t in texts)
    assert row["memory_chars"] == sum(map(len, texts)) / 2
    tokens = [sum(v["prompt_tokens"] + v["completion_tokens"] for v in r.extra["tts"]["cost"].values()) for r in records]
    assert row["tokens"] == sum(tokens) / 2 and set(records[0].extra["tts"]["cost"]) == {"act", "rehearse", "commit"}
    assert "1.000 ± 0.000" in printed
    md = (out / "tts_rehearsal.md").read_text()
    assert "| endpoint | Par. N=1 verbatim | query | 2/2 | 1.000 ± 0.000 |" in md and cmd in md
    assert "Synthetic (%)" in md and "verbatim memory" in md  # the CLI's tts-table of the run

    n = fake.n_requests
    assert bench.main(argv) == 0 and fake.n_requests == n  # resumed: the CLI reran nothing


def test_each_checkpoint_is_served_once_for_all_of_its_runs(fake_openai, replies, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch):
    """Both policies' runs go to the server the benchmark started for that policy (here the scripted endpoint stands
    in for ``launch_server``'s), one start per policy however many cells it has, and each recorded command is the
    cell's stand-alone ``--checkpoint`` form."""
    import contextlib

    from envace.eval import server

    flags, _, _ = bench.recipe_flags([])
    pool = get_pool("synthetic", **json.loads(flags[flags.index("--pool-kwargs") + 1]))
    fake = fake_openai(scripted(pool, replies))
    started: list[tuple[str, str, tuple[str, ...]]] = []

    @contextlib.contextmanager
    def launch(checkpoint, kind="vllm", *, extra_args=(), log_path=None, **_):
        started.append((Path(checkpoint).name, kind, tuple(extra_args)))
        yield server.LaunchedServer(base_url=fake.base_url, model=checkpoint, pid=0, log_path=Path(log_path))

    monkeypatch.setattr(server, "launch_server", launch)
    ckpts = {}
    for name in ("trained", "warm"):
        ckpts[name] = tmp_path / name
        ckpts[name].mkdir()
        (ckpts[name] / "config.json").write_text("{}")
    out = tmp_path / "tts"
    argv = ["--trained", str(ckpts["trained"]), "--warm", str(ckpts["warm"]), "--out", str(out), "--server", "vllm",
            "--modes", "parallel", "sequential", "--budgets", "1", "2", "--memories", "verbatim", "--shapes", "query",
            "--limit", "1"]
    assert bench.main(argv) == 0
    assert started == [("trained", "vllm", ("--dtype=float32",)), ("warm", "vllm", ("--dtype=float32",))]
    data = json.loads((out / "tts_rehearsal.json").read_text())
    assert [(r["policy"], r["cell"]) for r in data["rows"]] == [
        (p, c) for p in ("trained", "warm") for c in ("Par. N=1 verbatim", "Par. N=2 verbatim", "Seq. N=2 verbatim")]
    assert all(r["success"] == 1.0 for r in data["rows"])
    assert len(data["commands"]) == 6 and fake.base_url not in "".join(data["commands"])
    assert f"--checkpoint {ckpts['warm']} --server vllm --server-arg=--dtype=float32" in data["commands"][-1]


def test_a_server_that_does_not_start_stops_the_benchmark_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]):
    """As the CLI reports it for ``--checkpoint``: exit 2, one line naming the policy and the server's log; no run."""
    import contextlib

    from envace.eval import server

    @contextlib.contextmanager
    def launch(checkpoint, kind="vllm", **_):
        raise server.ServerLaunchError("server exited with code 1 before serving http://x/v1/models\nlog tail:\n...")
        yield  # pragma: no cover

    monkeypatch.setattr(server, "launch_server", launch)
    for name in ("trained", "warm"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    out = tmp_path / "tts"
    with pytest.raises(SystemExit) as stop:
        bench.main(["--trained", str(tmp_path / "trained"), "--warm", str(tmp_path / "warm"), "--out", str(out)])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("[tts_rehearsal] serving trained (") and "server.log" in err[0]
    assert not list(out.glob("*/n0"))
