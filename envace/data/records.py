"""Environment tasks as EnvSched pool records: the one builder the trainer's scheduler and the JSONL export share.

:func:`task_records` turns ``(pool, task_id)`` pairs into the records ``envsched.TaskPool`` reads (``task_id`` is
``"<pool>/<task id>"``, :func:`task_key`); :func:`make_replay` is the scheduler's identifier-filter replay through
the pools' official verifiers; :func:`export_envsched_jsonl` writes any pool's tasks as EnvSched JSONL. They need
only the :class:`~envace.envs.base.EnvironmentPool` API; the verl trainer (:mod:`envace.verl.sched`) builds its
scheduler's pool from them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from envace.envs.base import EnvironmentPool, ToolCall, flatten_turns, split_turns

__all__ = ["export_envsched_jsonl", "make_replay", "task_key", "task_records"]


def task_key(pool: str, task_id: str) -> str:
    return f"{pool}/{task_id}"


def _render_calls(turns: Sequence[Sequence[ToolCall]]) -> str:
    lines = []
    for t, turn in enumerate(turns):
        lines.append(f"# turn {t}")
        for call in turn:
            args = ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in call.arguments.items())
            lines.append(f"{call.name}({args})")
    return "\n".join(lines)


def task_records(pools: Mapping[str, EnvironmentPool], refs: Sequence[tuple[str, str]]) -> list[dict[str, Any]]:
    """EnvSched pool records (see ``envsched.pool``) for ``(pool, task_id)`` pairs.

    The verifier-code view gets the task's ground-truth call program: BFCL's checker replays it and
    compares states, τ²'s evaluator replays it and compares database hashes, so it is the per-task
    part of the verifier. Turn boundaries are kept as ``__end_turn__`` actions so replays stay
    multi-turn.
    """
    records = []
    for pool_name, task_id in refs:
        pool = pools[pool_name]
        spec = pool.task(task_id)
        turns = pool.gold_actions(task_id)
        records.append(
            {
                "task_id": task_key(pool_name, task_id),
                "env_id": spec.env_id,
                "instruction": spec.first_user_message,
                "initial_state": spec.initial_state_summary,
                "tools": spec.tools,
                "verifier_checks": [spec.verifier_text] if spec.verifier_text else [],
                "verifier_code": _render_calls(turns),
                "gold_actions": flatten_turns(turns),
                "meta": {"pool": pool_name, "category": spec.category},
            }
        )
    return records


def make_replay(pools: Mapping[str, EnvironmentPool]):
    """``replay(task_key, actions) -> reward`` through the pools' official verifiers (identifier filter)."""

    def replay(key: str, actions: Sequence[Mapping[str, Any]]) -> float:
        pool_name, task_id = key.split("/", 1)
        return float(pools[pool_name].replay(task_id, split_turns(actions)).reward)

    return replay


def export_envsched_jsonl(pool: EnvironmentPool, path: str | Path, split: str | None = None) -> int:
    """Write the tasks of ``pool`` (any pool, optionally one split) as EnvSched JSONL; returns the task count.

    Records come from :func:`task_records` (``task_id`` is ``"<pool>/<task id>"``). Each
    environment's tools and shared metadata are written once, in an environment record before its first
    task (``envsched.write_pool_jsonl``); task lines keep their own fields. ``envsched.TaskPool.from_jsonl(path)``
    loads the file (and still loads files of the older one-self-contained-line-per-task layout).
    """
    from envsched import write_pool_jsonl

    records = task_records({pool.name: pool}, [(pool.name, tid) for tid in pool.task_ids(split)])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_pool_jsonl(records, path)
