"""The evaluation result store (envace/eval/store.py): the last record of a task wins, and what it holds
survives every round trip: appended → read back, read back → appended to a fresh store, a torn line
repaired away. Records carry model text, so the strings include what JSON leaves unescaped (U+2028,
U+0085 ...) and lone surrogates (scrubbed on the way in)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envace.agents.outcomes import StopReason
from envace.envs.base import scrub_surrogates
from envace.eval.driver import evaluate
from envace.eval.report import BENCHMARKS
from envace.eval.runner import TaskRecord
from envace.eval.store import ResultStore


def record(task_id: str, reward: float, **kw: Any) -> TaskRecord:
    return TaskRecord(task_id=task_id, category="multi_turn_base", split="test", reward=reward, passed=reward == 1.0,
                      **kw)


def test_the_last_record_of_a_task_wins(tmp_path: Path) -> None:
    store = ResultStore(tmp_path)
    store.append(record("t0", 0.0, reason="first try"))
    store.append(record("t1", 1.0))
    store.append(record("t0", 1.0, reason="second try"))
    store.append(record("t2", 0.0))
    store.append(record("t0", 0.5, reason="third try"))
    done = ResultStore(tmp_path).completed()  # a fresh reader: what is on disk
    assert list(done) == ["t0", "t1", "t2"]
    assert (done["t0"].reward, done["t0"].reason) == (0.5, "third try")


def test_the_summary_counts_the_last_record_of_a_task(tmp_path: Path) -> None:
    """A task recorded twice (a rerun with --force-resume, two runs into one directory) is scored by its latest
    record, once."""
    from envace.envs.base import EnvironmentPool, TaskSpec

    class TwoTasks(EnvironmentPool):
        name = "two"

        def task_ids(self, split: str | None = None) -> list[str]:
            return ["a", "b"]

        def task(self, task_id: str) -> TaskSpec:
            return TaskSpec(pool="two", task_id=task_id, env_id="e", category="multi_turn_base", split="test",
                            system_prompt=None, first_user_message="q", tools=[])

        def start(self, task_id: str, **kwargs: Any) -> Any:
            raise AssertionError

        def gold_actions(self, task_id: str) -> list:
            return []

    store = ResultStore(tmp_path)
    store.append(record("a", 0.0))
    store.append(record("b", 0.0))
    store.append(record("a", 1.0))

    def never(pool: Any, task_id: str) -> TaskRecord:
        raise AssertionError("every task is already recorded")

    out = evaluate(TwoTasks(), BENCHMARKS["bfcl"], {"a": "base", "b": "base"}, never, store, progress=False)
    assert (out.ran, out.skipped) == (0, 2)
    assert [r.reward for r in out.records] == [1.0, 0.0]
    base = out.summary["categories"]["base"]
    assert (base["passed"], base["finished"], base["score"]) == (1, 2, 50.0)


def test_a_torn_line_is_set_aside_without_touching_records_with_unicode_line_separators(tmp_path: Path) -> None:
    """Old behaviour: ``repair`` numbered the lines with ``str.splitlines()``, which also breaks at U+2028 / U+0085
    (JSON writes them unescaped): a record holding one was cut in two and the wrong line was dropped, so one
    torn line lost every record after the separator."""
    store = ResultStore(tmp_path)
    store.append(record("a", 1.0, reason="line\u2028separator"))
    store.append(record("b", 0.0, messages=[{"role": "assistant", "content": "next\x85line\u2029para"}]))
    with store.results_path.open("a", encoding="utf-8") as fh:
        fh.write('{"task_id": "c", "categ')  # a killed run
    before = store.completed()
    with pytest.warns(UserWarning, match="unreadable record set aside"):
        assert store.repair() == 1
    assert store.completed() == before and sorted(before) == ["a", "b"]
    assert store.completed()["a"].reason == "line\u2028separator"
    assert (tmp_path / "results.jsonl.corrupt").read_text(encoding="utf-8") == '{"task_id": "c", "categ\n'
    store.append(record("c", 1.0))  # the torn task runs again and lands on a line of its own
    assert sorted(ResultStore(tmp_path).completed()) == ["a", "b", "c"] and store.repair() == 0


# -- round trips (hypothesis) ----------------------------------------------------------------------------------

# model text: anything, plus what JSON leaves unescaped and what UTF-8 cannot hold
tricky = st.sampled_from(["\u2028", "\u2029", "\x85", "\r", "\r\n", "\n", "\x1c", "\ud800", "\udfff", "\ufeff", "é"])
texts = st.lists(st.text(max_size=12) | tricky, max_size=4).map("".join)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.floats(allow_nan=False, allow_infinity=False) | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=8,
)
records = st.builds(
    TaskRecord,
    task_id=st.sampled_from(["t0", "t1", "t2", "t3/é", "t\u20284"]),
    category=texts,
    split=st.sampled_from(["train", "test"]),
    reward=st.floats(min_value=0.0, max_value=1.0),
    passed=st.booleans(),
    reason=texts,
    stop_reason=st.sampled_from(list(StopReason)),
    error=st.none() | texts,
    bound_hits=st.integers(0, 5),
    unjudged=st.lists(texts, max_size=2),
    turns=st.integers(0, 30),
    tool_calls=st.integers(0, 100),
    elapsed_s=st.floats(min_value=0.0, max_value=1e6),
    details=st.dictionaries(texts, json_values, max_size=3),
    messages=st.none() | st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool"]),
                                                          "content": texts}), max_size=3),
    extra=st.dictionaries(texts, json_values, max_size=2),
)


def as_stored(rec: TaskRecord) -> TaskRecord:
    """What the store can hold of ``rec``: lone surrogates replaced (they are not UTF-8)."""
    return TaskRecord.from_json(scrub_surrogates(rec.to_json()))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(records, max_size=8))
def test_store_round_trips(tmp_path_factory: pytest.TempPathFactory, recs: list[TaskRecord]) -> None:
    root = tmp_path_factory.mktemp("store")
    store = ResultStore(root / "a")
    for rec in recs:
        store.append(rec)
    want = {}
    for rec in recs:  # the last record of each task wins
        want[rec.task_id] = as_stored(rec)
    got = ResultStore(root / "a").completed()
    assert got == want
    # state → fresh store → state: the same
    copy = ResultStore(root / "b")
    for rec in got.values():
        copy.append(rec)
    assert ResultStore(root / "b").completed() == got
    # a torn line (a killed run) costs nothing but itself, before and after repair
    with store.results_path.open("ab") as fh:
        fh.write(json.dumps({"task_id": "torn", "reason": "\u2028"}, ensure_ascii=False)[:-3].encode("utf-8"))
    assert store.completed() == want
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        assert store.repair() == 1
    assert ResultStore(root / "a").completed() == want and store.repair() == 0


def test_a_stop_reason_is_its_text_on_disk_and_a_member_when_read_back() -> None:
    rec = record("t0", 0.0, stop_reason=StopReason.TOKEN_BUDGET)
    line = rec.to_json()
    assert type(line["stop_reason"]) is str and json.dumps(line["stop_reason"]) == '"token_budget"'
    assert TaskRecord.from_json(json.loads(json.dumps(line))).stop_reason is StopReason.TOKEN_BUDGET
    with pytest.raises(ValueError, match="'max_turns' is not a stop reason; stop reasons are 'completed'"):
        TaskRecord.from_json({**line, "stop_reason": "max_turns"})


def test_every_file_is_strict_json_a_non_finite_number_is_null(tmp_path: Path) -> None:
    """Issue 43: a verifier detail or a summary value that is NaN or infinite is written as null (strict JSON, as
    other tools read it), in results.jsonl, run.json and every write_json file."""
    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    store = ResultStore(tmp_path)
    store.append(record("t0", 0.0, details={"score": float("nan"), "bounds": [0.0, float("inf")]}))
    store.check_run_config({"model": "m", "temperature": 0.6})
    store.write_json("summary.json", {"average": float("nan")})
    (line,) = (tmp_path / "results.jsonl").read_text().splitlines()
    assert json.loads(line, parse_constant=refuse)["details"] == {"score": None, "bounds": [0.0, None]}
    assert json.loads((tmp_path / "summary.json").read_text(), parse_constant=refuse) == {"average": None}
    assert store.completed()["t0"].details == {"score": None, "bounds": [0.0, None]}
