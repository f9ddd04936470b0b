"""Resumable evaluation: interrupted runs lose nothing, reruns skip finished tasks and give the same
table; infrastructure failures are retried; settings mismatches are refused."""

from __future__ import annotations

import contextlib
import json
import linecache
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from envace.envs.base import EnvironmentPool, TaskSpec, ToolCall
from envace.eval.driver import EvalAborted, evaluate, select_tasks
from envace.eval.report import BENCHMARKS, format_table, summarize
from envace.eval.runner import TaskRecord
from envace.eval.store import ResultStore, RunConfigMismatch
from envace.rewards.llm import ConfigurationError, InfrastructureError
from trace2env.cliargs import InfrastructureFailure

BENCH = BENCHMARKS["bfcl"]
CATS = ("multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param", "multi_turn_long_context")


class CatalogPool(EnvironmentPool):
    """12 tasks over the four BFCL categories; nothing runs (the runner fakes everything)."""

    name = "catalog"

    def task_ids(self, split: str | None = None) -> list[str]:
        return [f"t{i:02d}" for i in range(12)]

    def task(self, task_id: str) -> TaskSpec:
        i = int(task_id[1:])
        return TaskSpec(
            pool="catalog",
            task_id=task_id,
            env_id="e",
            category=CATS[i % 4],
            split="test",
            system_prompt=None,
            first_user_message="q",
            tools=[],
        )

    def start(self, task_id: str, **kwargs: Any) -> Any:
        raise AssertionError("the fake runner never starts episodes")

    def gold_actions(self, task_id: str) -> list[list[ToolCall]]:
        return []


def blocked_in_wait(thread: threading.Thread) -> bool:
    """``thread`` is blocked inside ``concurrent.futures.wait`` (on the lock of its ``Condition.wait``)."""
    frame = sys._current_frames().get(thread.ident or -1)
    if frame is None or frame.f_code.co_name != "wait" or not frame.f_code.co_filename.endswith("threading.py"):
        return False
    if linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip() != "waiter.acquire()":
        return False
    outer = frame.f_back
    while outer is not None and not (outer.f_code.co_name == "wait" and "concurrent" in outer.f_code.co_filename):
        outer = outer.f_back
    return outer is not None


class CtrlC:
    """A terminal's Ctrl-C for the main thread, pressed from a worker thread: SIGINT, once the main thread is
    blocked waiting for running tasks (the driver's usual state), turned into exactly one KeyboardInterrupt.

    ``_thread.interrupt_main()`` (the old form) only sets a flag that the main thread reads when it next runs
    Python code, i.e. after some task has finished: the interrupt raced the tasks. A real SIGINT interrupts
    the blocked wait; it is sent again until the handler has run, because one that lands just before the main
    thread blocks is handled only when it wakes up; the handler raises once and ignores repeats (the driver's
    "Ctrl-C again" is not what this test is about)."""

    def __init__(self) -> None:
        self.handled = threading.Event()

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if not self.handled.is_set():
            self.handled.set()
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        previous = signal.signal(signal.SIGINT, self._on_sigint)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    def press_while_the_driver_waits(self, timeout: float = 30.0) -> None:
        main = threading.main_thread()
        deadline = time.monotonic() + timeout
        while not blocked_in_wait(main) and time.monotonic() < deadline:  # (another Python: pressed after timeout)
            time.sleep(0.001)
        deadline = time.monotonic() + timeout
        while not self.handled.is_set() and time.monotonic() < deadline:
            signal.pthread_kill(main.ident, signal.SIGINT)  # type: ignore[arg-type]
            self.handled.wait(0.05)


class FakeRunner:
    """Deterministic rewards; can interrupt or fail on chosen tasks; counts what it ran."""

    def __init__(self, interrupt_at: str | None = None, fail: set[str] = frozenset(),  # type: ignore[assignment]
                 misconfigured: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        self.ran: list[str] = []
        self.interrupt_at, self.fail, self.misconfigured = interrupt_at, set(fail), set(misconfigured)
        self.ctrl_c = CtrlC()
        self.release = threading.Event()  # set by the test once the interrupted run has returned
        self.interrupted_task_ended = threading.Event()

    def __call__(self, pool: EnvironmentPool, task_id: str) -> TaskRecord:
        if task_id == self.interrupt_at:  # Ctrl-C arrives while this task is in flight
            try:
                self.ctrl_c.press_while_the_driver_waits()
                # in flight until the driver has given up on it: it can neither finish nor fail before the driver
                # handled the interrupt, however the threads are scheduled (no sleep racing the main thread)
                if not self.release.wait(timeout=60):
                    raise AssertionError("the interrupted run never returned")
                raise RuntimeError("killed with the process")
            finally:
                self.interrupted_task_ended.set()
        if task_id in self.fail:
            raise InfrastructureError("connection refused")
        if task_id in self.misconfigured:
            raise ConfigurationError("HTTP 404: The model `nope` does not exist.", status_code=404)
        self.ran.append(task_id)
        i = int(task_id[1:])
        reward = 1.0 if i % 3 == 0 else 0.0
        spec = pool.task(task_id)
        return TaskRecord(
            task_id=task_id,
            category=spec.category,
            split=spec.split,
            reward=reward,
            passed=reward == 1.0,
            turns=i % 4 + 1,
            messages=[{"role": "user", "content": "q"}],
        )


def run(out: Path, runner: FakeRunner, concurrency: int = 1, **sel: Any) -> tuple[Any, str]:
    pool = CatalogPool()
    selected = select_tasks(pool, BENCH, **sel)
    outcome = evaluate(pool, BENCH, selected, runner, ResultStore(out), concurrency=concurrency, progress=False)
    return outcome, format_table([("fake", {"bfcl": outcome.summary})])


def strip(records: list[TaskRecord]) -> list[dict[str, Any]]:
    return [{**r.to_json(), "elapsed_s": None} for r in records]


def test_selection_limit_is_per_category_and_deterministic() -> None:
    pool = CatalogPool()
    sel = select_tasks(pool, BENCH, limit=2)
    assert list(sel) == ["t00", "t01", "t02", "t03", "t04", "t05", "t06", "t07"]
    assert set(sel.values()) == set(BENCH.categories)
    assert list(select_tasks(pool, BENCH, categories=["miss_func", "multi_turn_long_context"], limit=1)) == [
        "t01",
        "t03",
    ]
    with pytest.raises(ValueError, match="unknown bfcl categories"):
        select_tasks(pool, BENCH, categories=["web_search"])


def test_interrupted_run_resumes_to_the_same_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    full, full_table = run(tmp_path / "full", FakeRunner())
    assert full.summary["complete"] and full.ran == 12
    # 4 of 12 tasks pass (i % 3 == 0); per category: base t00,t04,t08 → 1 of 3 ...
    assert full.summary["categories"]["base"]["passed"] == 1

    out = tmp_path / "interrupted"
    interrupted = FakeRunner(interrupt_at="t05")
    with interrupted.ctrl_c.installed(), pytest.raises(KeyboardInterrupt):
        run(out, interrupted)
    assert interrupted.ran == ["t00", "t01", "t02", "t03", "t04"] and not interrupted.interrupted_task_ended.is_set()
    assert "letting 1 running task(s) finish" in capsys.readouterr().err
    interrupted.release.set()  # the interrupted task ends (with the process, in real life); nothing of it is saved
    assert interrupted.interrupted_task_ended.wait(timeout=60)
    saved = ResultStore(out).completed()
    assert sorted(saved) == ["t00", "t01", "t02", "t03", "t04"]  # every finished task was persisted
    with (out / "results.jsonl").open("a") as fh:  # and the process died mid-write of another record
        fh.write('{"task_id": "t05", "category": "multi_')

    resumed_runner = FakeRunner()
    with pytest.warns(UserWarning, match="unreadable record set aside"):
        resumed, resumed_table = run(out, resumed_runner)
    assert (out / "results.jsonl.corrupt").read_text().startswith('{"task_id": "t05"')
    assert resumed_runner.ran == [f"t{i:02d}" for i in range(5, 12)]
    assert (resumed.ran, resumed.skipped) == (7, 5)
    assert resumed_table == full_table
    assert strip(resumed.records) == strip(full.records)
    assert resumed.summary == full.summary

    again_runner = FakeRunner()
    _, again_table = run(out, again_runner)  # everything done: nothing runs
    assert again_runner.ran == [] and again_table == full_table


def test_concurrency_gives_the_same_results(tmp_path: Path) -> None:
    _, serial = run(tmp_path / "serial", FakeRunner())
    outcome, parallel = run(tmp_path / "parallel", FakeRunner(), concurrency=4)
    assert parallel == serial and outcome.ran == 12
    lines = (tmp_path / "parallel" / "results.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["task_id"] for line in lines) == [f"t{i:02d}" for i in range(12)]


def test_infrastructure_errors_are_logged_and_retried(tmp_path: Path) -> None:
    first, _ = run(tmp_path, FakeRunner(fail={"t02", "t07"}))
    assert first.errors == 2 and not first.summary["complete"] and first.summary["finished"] == 10
    errors = [json.loads(line) for line in (tmp_path / "errors.jsonl").read_text().splitlines()]
    assert {e["task_id"] for e in errors} == {"t02", "t07"} and "connection refused" in errors[0]["error"]
    retry = FakeRunner()
    second, _ = run(tmp_path, retry)
    assert retry.ran == ["t02", "t07"] and second.summary["complete"]


def test_consecutive_failures_abort_as_infrastructure(tmp_path: Path) -> None:
    """Issue 43 finding 5: the abort is an outage (exit 3 in the CLI), not a configuration error (EvalAborted)."""
    pool = CatalogPool()
    sel = select_tasks(pool, BENCH)
    with pytest.raises(InfrastructureFailure, match="3 tasks in a row failed .*connection refused.*rerun"):
        evaluate(
            pool, BENCH, sel, FakeRunner(fail=set(sel)), ResultStore(tmp_path), progress=False, max_consecutive_errors=3
        )


def test_a_configuration_error_aborts_at_once_and_is_not_logged_as_a_task_error(tmp_path: Path) -> None:
    """Old behaviour: an unknown model (HTTP 404) was an infrastructure error per task, logged and retried on
    every rerun (10 in a row abort). It can never succeed: the run stops at the first one, with the reason."""
    runner = FakeRunner(misconfigured={"t03"})
    with pytest.raises(EvalAborted, match=r"configuration error \(t03\).*does not exist"):
        run(tmp_path, runner)
    assert runner.ran == ["t00", "t01", "t02"]
    assert not (tmp_path / "errors.jsonl").exists()


def test_run_config_mismatch_is_refused(tmp_path: Path) -> None:
    store = ResultStore(tmp_path)
    store.check_run_config({"model": "a", "temperature": 0.6})
    store.check_run_config({"model": "a", "temperature": 0.6})
    with pytest.raises(RunConfigMismatch, match="temperature: 0.6 -> 0.0"):
        store.check_run_config({"model": "a", "temperature": 0.0})
    store.check_run_config({"model": "a", "temperature": 0.0}, force=True)


def test_table_layout() -> None:
    recs = [
        TaskRecord(task_id=f"{d}/{i}", category=d, split="test", reward=float(i == 0), passed=i == 0)
        for d in ("airline", "retail", "telecom")
        for i in range(2)
    ]
    tau = summarize(BENCHMARKS["tau2"], recs, {r.task_id: r.category for r in recs})
    assert tau["average"] == 50.0
    table = format_table([("m", {"tau2": tau})])
    header = table.splitlines()[1].split()
    assert header == [
        "Airline",
        "Retail",
        "Telecom",
        "Avg.",
        "Base",
        "Miss",
        "Func.",
        "Miss",
        "Param.",
        "Long",
        "Ctx.",
        "Avg.",
    ]
    row = table.splitlines()[-1].split()
    assert row == ["m", "50.0", "50.0", "50.0", "50.0", "–", "–", "–", "–", "–", "–"]
    md = format_table([("m", {"tau2": tau})], markdown=True)
    assert md.splitlines()[0].startswith("| Model | τ²-bench (%) |") and "Overall (%)" in md
