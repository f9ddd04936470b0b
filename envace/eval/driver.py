"""Task selection and the resumable, concurrent evaluation driver."""

from __future__ import annotations

import sys
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from envace.envs.base import EnvironmentPool
from envace.envs.tau2 import UserSimulatorRequired
from envace.eval.benchmarks import Benchmark
from envace.eval.report import summarize
from envace.eval.runner import TaskRecord, TaskRunner, format_exception
from envace.eval.store import ResultStore
from envace.rewards.llm import ConfigurationError
from trace2env.cliargs import InfrastructureFailure

__all__ = ["EvalAborted", "EvalOutcome", "evaluate", "failing", "select_tasks"]

# Errors that no retry can fix (envace's configuration errors): stop the whole run at once, with the
# reason, instead of logging them per task. What the model causes is in the task's record (scored once);
# anything else is infrastructure (logged, retried on the next run).
FATAL_ERRORS: tuple[type[BaseException], ...] = (UserSimulatorRequired, ConfigurationError)


class EvalAborted(RuntimeError):
    """The run was stopped by an error no retry can fix (a configuration error)."""


@dataclass
class EvalOutcome:
    summary: dict[str, Any]
    records: list[TaskRecord]  # of the selected tasks, in selection order
    ran: int  # tasks run now
    skipped: int  # tasks already in results.jsonl
    errors: int  # infrastructure failures now (retried next run)
    last_error: str | None = None  # the last of them


def failing(failed: str, last_error: str | None, store: ResultStore) -> str:
    """The one line of a run stopped or left incomplete by infrastructure failures: what failed, the last error
    (it names the endpoint and its HTTP status, or the environment's exception), and that a rerun resumes."""
    return (f"the endpoint or the environment is failing: {failed} (last: {last_error}); finished tasks are saved "
            f"in {store.results_path}: rerun the same command to resume once it answers")


def select_tasks(
    pool: EnvironmentPool,
    benchmark: Benchmark,
    *,
    split: str | None = None,
    categories: Sequence[str] | None = None,
    limit: int | None = None,
) -> dict[str, str]:
    """Task id → normalised category, in pool order; ``limit`` caps tasks *per category*
    (the first ``limit`` of each, so reruns select the same tasks)."""
    wanted = {benchmark.normalize(c) for c in categories} if categories else None
    if wanted:
        unknown = wanted - set(benchmark.categories)
        if unknown:
            raise ValueError(
                f"unknown {benchmark.name} categories {sorted(unknown)}; choose from {list(benchmark.categories)}"
            )
    selected: dict[str, str] = {}
    per_cat: dict[str, int] = {}
    for tid in pool.task_ids(split):
        cat = benchmark.normalize(pool.task(tid).category)
        if wanted is not None and cat not in wanted:
            continue
        if cat not in benchmark.categories:
            continue
        if limit is not None and per_cat.get(cat, 0) >= limit:
            continue
        per_cat[cat] = per_cat.get(cat, 0) + 1
        selected[tid] = cat
    if not selected:
        raise ValueError(
            f"no {benchmark.name} tasks selected (split={split!r}, categories={categories}, limit={limit})"
        )
    return selected


def evaluate(
    pool: EnvironmentPool,
    benchmark: Benchmark,
    selected: Mapping[str, str],
    runner: TaskRunner,
    store: ResultStore,
    *,
    concurrency: int = 1,
    progress: bool = True,
    max_consecutive_errors: int = 10,
) -> EvalOutcome:
    """Run every selected task that ``store`` has no result for; each result is appended the moment
    it exists. Returns the summary over *all* selected tasks (old and new results)."""
    store.repair()
    done = store.completed()
    todo = [t for t in selected if t not in done]
    skipped = len(selected) - len(todo)
    ran = errors = 0
    consecutive = 0
    last_error: str | None = None
    lock = threading.Lock()
    bar = _progress(total=len(selected), initial=skipped, enabled=progress, desc=benchmark.name)

    def work(task_id: str) -> TaskRecord:
        record = runner(pool, task_id)
        record.category = selected[task_id]
        store.append(record)  # persisted by the worker, before anything else can go wrong
        return record

    pool_exec = ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="envace-eval")
    pending: dict[Future[TaskRecord], str] = {}
    queue = list(reversed(todo))
    try:
        while queue or pending:
            while queue and len(pending) < max(1, concurrency):
                tid = queue.pop()
                pending[pool_exec.submit(work, tid)] = tid
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in finished:
                tid = pending.pop(fut)
                exc = fut.exception()
                with lock:
                    if exc is None:
                        ran += 1
                        consecutive = 0
                        rec = fut.result()
                        bar.set_postfix_str(f"last={tid} reward={rec.reward:.2f}", refresh=False)
                    else:
                        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                            raise exc
                        if isinstance(exc, FATAL_ERRORS):
                            raise EvalAborted(f"configuration error ({tid}): {exc}") from exc
                        errors += 1
                        consecutive += 1
                        last_error = format_exception(exc)
                        store.append_error(tid, last_error)
                        print(f"[envace.eval] {tid}: {last_error} (logged; retried on rerun)", file=sys.stderr)
                        if consecutive >= max_consecutive_errors:
                            raise InfrastructureFailure(
                                failing(f"{consecutive} tasks in a row failed", last_error, store)) from exc
                    bar.update(1)
    except BaseException as exc:
        for fut in pending:
            fut.cancel()
        running = sum(1 for fut in pending if fut.running())
        if isinstance(exc, KeyboardInterrupt) and running:
            print(
                f"\n[envace.eval] interrupted: letting {running} running task(s) finish and save "
                "(Ctrl-C again to abandon them)",
                file=sys.stderr,
            )
        pool_exec.shutdown(wait=False, cancel_futures=True)
        raise
    finally:
        bar.close()
    pool_exec.shutdown(wait=True)
    all_done = store.completed()
    records = [all_done[t] for t in selected if t in all_done]
    summary = summarize(benchmark, records, selected)
    return EvalOutcome(summary=summary, records=records, ran=ran, skipped=skipped, errors=errors,
                       last_error=last_error)


class _NoBar:
    def update(self, n: int = 1) -> None: ...
    def set_postfix_str(self, s: str, refresh: bool = True) -> None: ...
    def close(self) -> None: ...


def _progress(*, total: int, initial: int, enabled: bool, desc: str) -> Any:
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="task", dynamic_ncols=True, file=sys.stderr)
