"""``python -m envace.data``: the real CLI as a subprocess (parquet from a pool, CM2 conversion; ``record-traces``
is in test_traces.py and tests/envace/envs/test_cli_conventions.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[3]


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "envace.data", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_build_data(tmp_path):
    res = cli(
        "build",
        "--pools",
        "bfcl_multi_turn",
        "--out",
        str(tmp_path),
        "--limit-per-pool",
        "3",
        "--agent-name",
        "my_loop",
    )
    assert res.returncode == 0, res.stdout + res.stderr
    train, val = pq.read_table(tmp_path / "train.parquet"), pq.read_table(tmp_path / "val.parquet")
    assert train.num_rows == val.num_rows == 3
    assert set(train.column("agent_name").to_pylist()) == {"my_loop"}
    ids = lambda t: {e["task_id"] for e in t.column("extra_info").to_pylist()}
    assert not ids(train) & ids(val)


def test_a_pool_option_the_pool_does_not_take_is_one_line_and_writes_nothing(tmp_path):
    res = cli("--pool-kwargs", '{"synthetic": {"no_such": 1}}', "build", "--pools", "synthetic",
              "--out", str(tmp_path / "out"))
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.strip().splitlines() == [
        ("python -m envace.data: error: pool 'synthetic' with options {'no_such': 1}: "
         "SyntheticPool.__init__() got an unexpected keyword argument 'no_such'")]
    assert not (tmp_path / "out").exists()


def test_convert_cm2(tmp_path):
    good = {
        "id": "x",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [],
        "checklist_list": [
            [[{"id": "a", "question": "q", "focus_on": "assistant.content", "pass_condition": "p", "weight": 1}]]
        ],
    }
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(good) + "\n" + json.dumps({**good, "id": "y", "tools": 5}) + "\n")
    res = cli("convert-cm2", str(src), str(tmp_path / "out"))
    assert res.returncode == 2
    assert "record 1 at $.tools: 5 is not of type 'array', 'string'" in res.stderr
    res = cli("convert-cm2", str(src), str(tmp_path / "out"), "--skip-invalid")
    assert res.returncode == 0, res.stderr
    assert "2 record(s): 1 converted" in res.stdout and "1 rejected" in res.stdout
    assert (tmp_path / "out" / "rejects.jsonl").exists()


def test_pool_kwargs_before_the_command_reach_the_build(tmp_path):
    res = cli("--pool-kwargs", '{"synthetic": {"n_envs": 2, "tasks_per_env": 10}}', "build", "--pools", "synthetic",
              "--out", str(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert sum(manifest["rows"].values()) == 20  # 2 environments of 10 tasks, not the default pool's
