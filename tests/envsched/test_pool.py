"""The task pool (``envsched/pool.py``): the per-task and the environment-record JSONL formats, errors that name
the line and the reason, round trips, and the content hash."""

from __future__ import annotations

import json

import pytest

from envsched import PoolFormatError, TaskPool, write_pool_jsonl
from envsched.synthetic import synthetic_records


@pytest.fixture(scope="module")
def records():
    recs = synthetic_records(4, 5, seed=2)
    recs[1] = {**recs[1], "tools": recs[1]["tools"][:2]}  # one task with its own (smaller) tool list
    recs[2] = {**recs[2], "tools": []}  # one with none
    for r in recs:
        r["meta"] = {**r["meta"], "pool": "demo", "domain": r["env_id"][-1]}  # env-level items
    return recs


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_old_per_task_format_still_loads(tmp_path, records):
    path = tmp_path / "old.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))  # the original format, written by hand
    pool = TaskPool.from_jsonl(path)
    assert len(pool) == len(records) and pool.n_envs == 4
    assert pool[0].tools and pool[0].meta == records[0]["meta"] and pool[1].tools == pool[0].tools[:2] and pool[2].tools == ()
    assert pool[0].tools is pool[3].tools  # equal tool lists share one tuple in memory
    pool.to_jsonl(tmp_path / "old_again.jsonl", env_level=False)
    assert _lines(tmp_path / "old_again.jsonl") == [TaskPool.from_records([r])[0].to_record() for r in records]


def test_env_level_format_stores_tools_and_metadata_once_and_reads_back_the_same_tasks(tmp_path, records):
    pool = TaskPool.from_records(records)
    old, new = tmp_path / "old.jsonl", tmp_path / "new.jsonl"
    pool.to_jsonl(old, env_level=False)
    pool.to_jsonl(new)
    lines = _lines(new)
    envs = [rec for rec in lines if rec.get("record_type") == "environment"]
    tasks = [rec for rec in lines if "task_id" in rec]
    assert [e["env_id"] for e in envs] == pool.env_names and len(tasks) == len(pool)
    assert all(e["meta"] == {"pool": "demo", "domain": e["env_id"][-1]} and len(e["tools"]) > 2 for e in envs)
    assert "tools" not in tasks[0] and tasks[1]["tools"] == records[1]["tools"] and tasks[2]["tools"] == []
    assert all(set(t["meta"]) == {"archetype"} for t in tasks)  # per-task metadata stays on the task line
    assert tasks[0]["instruction"] == records[0]["instruction"]  # task lines stay self-describing
    assert new.stat().st_size < 0.6 * old.stat().st_size
    again = TaskPool.from_jsonl(new)
    assert again.tasks == pool.tasks == TaskPool.from_jsonl(old).tasks
    assert again.fingerprint() == pool.fingerprint() and again.content_hash() == pool.content_hash()
    assert again[0].tools is again[3].tools


def test_environment_record_may_follow_its_tasks_and_task_fields_override_it(tmp_path):
    env = {"record_type": "environment", "env_id": "bank", "tools": ["freeze_card", "get_user"], "meta": {"pool": "p", "tier": 1}}
    t1 = {"task_id": "a", "env_id": "bank", "instruction": "freeze card 1"}
    t2 = {"task_id": "b", "env_id": "bank", "instruction": "freeze card 2", "tools": ["get_user"], "meta": {"tier": 2}, "record_type": "task"}
    t3 = {"task_id": "c", "env_id": "shop", "instruction": "buy"}
    for order in ([env, t1, t2, t3], [t1, t2, t3, env]):
        path = tmp_path / "p.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in order))
        for pool in (TaskPool.from_jsonl(path), TaskPool.from_records(order)):
            a, b, c = pool.tasks
            assert [t.name for t in a.tools] == ["freeze_card", "get_user"] and a.meta == {"pool": "p", "tier": 1}
            assert [t.name for t in b.tools] == ["get_user"] and b.meta == {"pool": "p", "tier": 2}
            assert c.tools == () and c.meta == {}
    out = tmp_path / "out.jsonl"
    assert write_pool_jsonl([env, t1, t2, t3], out) == 3
    assert TaskPool.from_jsonl(out).tasks == TaskPool.from_records([env, t1, t2, t3]).tasks


@pytest.mark.parametrize(
    "lines, reason",
    [
        (['{"record_type": "environment", "env_id": "e"}', '{"record_type": "environment", "env_id": "e"}'], "duplicate environment record 'e' (first on line 1)"),
        (['{"record_type": "environment", "env_id": "e", "tols": []}'], "unknown key(s) ['tols'] in an environment record"),
        (['{"record_type": "environment", "env_id": ""}'], "'env_id' must be a non-empty string"),
        (['{"record_type": "environment", "env_id": "e", "tools": [{"description": "x"}]}'], "environment 'e': tools[0] has no string 'name'"),
        (['{"record_type": "env", "env_id": "e"}'], "'record_type' must be 'task' or 'environment'"),
        (['{"record_type": "environment", "env_id": "e"}'], "no task records"),
    ],
)
def test_environment_record_errors_name_line_and_reason(tmp_path, lines, reason):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(PoolFormatError) as exc:
        TaskPool.from_jsonl(path)
    assert reason in str(exc.value)
    if "duplicate" in reason:
        assert exc.value.line == 2


def test_content_hash_sees_every_field():
    recs = synthetic_records(2, 3, seed=0)
    base = TaskPool.from_records(recs).content_hash()
    assert TaskPool.from_records(recs).content_hash() == base
    changed_tool = [dict(r) for r in recs]
    changed_tool[4] = {**recs[4], "tools": [{**recs[4]["tools"][0], "description": "other"}, *recs[4]["tools"][1:]]}
    changed_code = [dict(r) for r in recs]
    changed_code[0] = {**recs[0], "verifier_code": recs[0]["verifier_code"] + "\n"}
    for variant in (changed_tool, changed_code, recs[::-1]):
        assert TaskPool.from_records(variant).content_hash() != base


def test_a_latin1_pool_names_the_file_and_the_line(tmp_path, records):
    """Issue 43 finding 8: a pool saved as Latin-1 (a non-ASCII instruction) is refused with the project's input
    error naming the file and the line of the first byte that is not UTF-8, not a bare UnicodeDecodeError."""
    utf8 = tmp_path / "pool.jsonl"
    recs = [dict(r) for r in records]
    recs[2]["instruction"] = "réserve un café pour 2 personnes"
    write_pool_jsonl(TaskPool.from_records(recs).tasks, utf8, env_level=False)
    text = utf8.read_text(encoding="utf-8")
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(text.encode("latin-1"))
    with pytest.raises(PoolFormatError) as exc:
        TaskPool.from_jsonl(latin1)
    line = next(n for n, row in enumerate(text.splitlines(), 1) if "café" in row)
    assert (exc.value.source, exc.value.line) == (str(latin1), line)
    assert str(exc.value).startswith(f"{latin1}:{line}: not UTF-8 text")
    assert TaskPool.from_jsonl(utf8).tasks[2].instruction == recs[2]["instruction"]  # the same pool in UTF-8 loads


@pytest.fixture(scope="module")
def records_8x10():
    return synthetic_records(8, 10, seed=5)


# ---- pool -------------------------------------------------------------------------------------------
def _write(tmp_path, lines):
    p = tmp_path / "pool.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


GOOD = json.dumps({"task_id": "a", "env_id": "e", "instruction": "do it"})


@pytest.mark.parametrize(
    "line, reason",
    [
        ('{"task_id": "b", "env_id": "e", "instruction": "x"', "invalid JSON"),
        ('{"task_id": "b", "env_id": "e"}', "missing required key 'instruction'"),
        ('{"task_id": "b", "env_id": "e", "instruction": "x", "verifer_code": "1"}', "unknown key(s) ['verifer_code']"),
        ('{"task_id": "b", "env_id": "e", "instruction": "x", "tools": [{"description": "no name"}]}', "tools[0] has no string 'name'"),
        ('{"task_id": "b", "env_id": "e", "instruction": "x", "gold_actions": [{"name": "f", "arguments": "{bad"}]}', "gold_actions[0].arguments is not valid JSON"),
        ('{"task_id": "a", "env_id": "e", "instruction": "x"}', "duplicate task_id 'a' (first on line 1)"),
        ('[1, 2]', "record must be a JSON object"),
        ('{"task_id": "", "env_id": "e", "instruction": "x"}', "'task_id' must be a non-empty string"),
    ],
)
def test_jsonl_errors_name_line_and_reason(tmp_path, line, reason):
    p = _write(tmp_path, [GOOD, "", line])
    with pytest.raises(PoolFormatError) as exc:
        TaskPool.from_jsonl(p)
    assert exc.value.line == 3
    assert f"{p}:3: " in str(exc.value) and reason in str(exc.value)


def test_jsonl_round_trip(tmp_path, records_8x10):
    pool = TaskPool.from_records(records_8x10[:5])
    pool.to_jsonl(tmp_path / "p.jsonl")
    again = TaskPool.from_jsonl(tmp_path / "p.jsonl")
    assert again.tasks == pool.tasks and again.fingerprint() == pool.fingerprint()
