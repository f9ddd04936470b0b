"""EnvSched export: any pool's tasks as EnvSched JSONL."""

from __future__ import annotations

from pathlib import Path

from envace.envs.base import EnvironmentPool


def export_envsched_jsonl(pool: EnvironmentPool, path: str | Path, split: str | None = None) -> int:
    """Write the tasks of ``pool`` (any pool, optionally one split) as EnvSched JSONL; returns the task count.

    Records come from :func:`envace.envs.records.task_records` (``task_id`` is ``"<pool>/<task id>"``). Each
    environment's tools and shared metadata are written once, in an environment record before its first
    task (``envsched.write_pool_jsonl``); task lines keep their own fields. ``envsched.TaskPool.from_jsonl(path)``
    loads the file (and still loads files of the older one-self-contained-line-per-task layout).
    """
    from envace.envs.records import task_records
    from envsched import write_pool_jsonl

    records = task_records({pool.name: pool}, [(pool.name, tid) for tid in pool.task_ids(split)])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_pool_jsonl(records, path)
