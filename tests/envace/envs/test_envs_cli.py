"""``python -m envace.envs``: the real CLI as a subprocess (plus one in-process failure path)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from envace.envs.base import EnvironmentPool, TaskSpec, ToolCall, Verdict, get_pool, register_pool

REPO = Path(__file__).resolve().parents[3]


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "envace.envs", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture(scope="module")
def pool():
    return get_pool("bfcl_multi_turn")


def test_gold_all_bfcl_tasks_pass():
    res = cli("gold", "bfcl_multi_turn", "--no-progress")
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    for category in ("multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param", "multi_turn_long_context"):
        assert any(line.split() == [category, "200", "200"] for line in lines), res.stdout
    assert any(line.split() == ["all", "800", "800"] for line in lines)
    assert "FAIL" not in res.stdout


def test_gold_with_workers_category_limit_and_progress_bar():
    res = cli("gold", "bfcl_multi_turn", "--category", "multi_turn_miss_func", "--limit", "6", "--workers", "2")
    assert res.returncode == 0, res.stdout + res.stderr
    assert any(line.split() == ["multi_turn_miss_func", "6", "6"] for line in res.stdout.splitlines())
    assert "gold bfcl_multi_turn" in res.stderr and "6/6" in res.stderr  # tqdm bar on stderr


def test_list_and_tasks():
    res = cli("list", "bfcl_multi_turn")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("bfcl_multi_turn: 800 tasks")
    rows = {line.split()[0]: line.split()[1:] for line in res.stdout.splitlines()[2:]}
    assert set(rows) == {"multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param", "multi_turn_long_context"}
    assert all(int(r[-1]) == 200 and int(r[0]) + int(r[1]) == 200 for r in rows.values())

    res = cli("tasks", "bfcl_multi_turn", "--split", "test", "--category", "multi_turn_base", "--json")
    assert res.returncode == 0, res.stderr
    tasks = [json.loads(line) for line in res.stdout.splitlines()]
    assert tasks and all(t["split"] == "test" and t["category"] == "multi_turn_base" for t in tasks)

    res = cli("tasks", "bfcl_multi_turn", "--category", "simple_python")
    assert res.returncode == 2 and "unknown category ['simple_python']" in res.stderr


def test_verify_good_bad_and_malformed(tmp_path, pool):
    tid = "multi_turn_base_0"
    gold = [[c.to_dict() for c in turn] for turn in pool.gold_actions(tid)]
    good = tmp_path / "good.json"
    good.write_text(json.dumps(gold))
    res = cli("verify", "bfcl_multi_turn", tid, str(good))
    assert res.returncode == 0, res.stdout + res.stderr
    out = json.loads(res.stdout)
    assert out["passed"] is True and out["reward"] == 1.0 and out["error_type"] is None

    bad = tmp_path / "bad.json"
    gold[0] = gold[0][:1]
    bad.write_text(json.dumps(gold))
    res = cli("verify", "bfcl_multi_turn", tid, str(bad))
    assert res.returncode == 1
    out = json.loads(res.stdout)
    assert out["passed"] is False and out["reward"] == 0.0
    assert out["error_type"] == "multi_turn:instance_state_mismatch" and "does not match the state" in out["reason"]

    malformed = tmp_path / "malformed.json"
    malformed.write_text('[[{"name": "cd", "arguments": {"folder": "document"}}], [{"arguments": {}}]]')
    res = cli("verify", "bfcl_multi_turn", tid, str(malformed))
    assert res.returncode == 2 and res.stdout == ""
    assert "malformed.json: turn 1, call 0: tool call has no string 'name'" in res.stderr

    res = cli("verify", "bfcl_multi_turn", "no_such_task", str(good))
    assert res.returncode == 2 and "unknown bfcl_multi_turn task 'no_such_task'" in res.stderr

    res = cli("verify", "no_such_pool", tid, str(good))
    assert res.returncode == 2 and "unknown environment pool 'no_such_pool'" in res.stderr


def test_bad_usage():
    res = cli("gold", "bfcl_multi_turn", "--workers", "0")
    assert res.returncode == 2 and "argument --workers: expected an integer >= 1, got '0'" in res.stderr
    res = cli("--pool-kwargs", "{oops", "list")
    assert res.returncode == 2 and "not valid JSON" in res.stderr
    res = cli("--pool-kwargs", '{"bfcl_multi_turn": {"no_such_option": 1}}', "tasks", "bfcl_multi_turn")
    assert res.returncode == 2 and "bad --pool-kwargs for 'bfcl_multi_turn'" in res.stderr


# -- in-process: a failing gold replay exits non-zero ------------------------------------------------------


class _BrokenGoldPool(EnvironmentPool):
    name = "test_envs_cli_broken_gold"

    def task_ids(self, split: str | None = None) -> list[str]:
        return ["ok", "bad", "boom"]

    def task(self, task_id: str) -> TaskSpec:
        return TaskSpec(
            pool=self.name,
            task_id=task_id,
            env_id="e",
            category="c",
            split="train",
            system_prompt=None,
            first_user_message="u",
            tools=[],
        )

    def start(self, task_id: str, **kwargs: Any):  # pragma: no cover - replay is overridden
        raise NotImplementedError

    def gold_actions(self, task_id: str) -> list[list[ToolCall]]:
        if task_id == "boom":
            raise RuntimeError("gold broke")
        return [[]]

    def replay(self, task_id: str, actions: Any) -> Verdict:
        ok = task_id == "ok"
        return Verdict(float(ok), ok, {"error_type": None if ok else "x:mismatch", "reason": "" if ok else "wrong"})


register_pool(_BrokenGoldPool.name)(_BrokenGoldPool)


def test_gold_failures_exit_nonzero(capsys):
    from envace.envs.__main__ import main

    assert main(["gold", _BrokenGoldPool.name, "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "FAIL bad: x:mismatch: wrong" in out
    assert "FAIL boom: exception: RuntimeError: gold broke" in out
    assert any(line.split() == ["all", "1", "3"] for line in out.splitlines())
