"""Gold replays of any environment pool, recorded as Trace2Env traces (``python -m envace.envs.traces``).

Trace2Env (seed paper 002, §3) builds a simulator from recorded interaction traces alone. This module
produces those traces from envace's real pools (BFCL multi-turn, τ²-bench, the synthetic pool): each task's
gold actions are executed in a fresh episode of the real environment, and the chat is written in the
``messages`` format :func:`trace2env.parse_trace` reads (assistant ``tool_calls`` with ids, ``tool`` messages
with ``tool_call_id``; the observation text exactly as the environment returned it).

τ²-bench needs no user simulator here: its gold actions form one turn (τ² gold has no turn structure), so
the replay never reaches a turn boundary; the trace opens with the agent's greeting and the scenario's
reason for call (what the pool shows without a user model), and the user-side gold actions (telecom: the
user toggling their phone) are executed on the user tools and recorded under their dict name
``user:<tool>`` (:meth:`envace.envs.tau2.Tau2ToolCall.to_dict`), so a worldbook keeps the two sides apart.

Trace metadata: ``pool``, ``task_id``, ``env_id``, ``category``, ``split``, ``trajectory_group`` (the task,
so a split manifest never separates replays of one task) and ``initial_state_id``
(:func:`initial_state_id`), which the applicability gate compares before it lets a recorded observation
stand in for a simulated one.

Usage::

    python -m envace.envs.traces --pool synthetic --split train --max-tasks 200 --out traces/train.jsonl \
        [--by-env DIR]     # also one JSONL per env_id under DIR (one worldbook per environment)
    python -m envace.envs.traces --pool tau2 --pool-kwargs '{"domains": ["airline"]}' --split train \
        --out traces/tau2-airline-train.jsonl
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from envace.envs.base import EnvironmentPool, TaskSpec, get_pool

__all__ = ["initial_state_id", "main", "record_gold_trace", "record_pool"]

logger = logging.getLogger(__name__)


def initial_state_id(spec: TaskSpec) -> str:
    """Identity of a task's initial state: sha256 of (pool, env_id, the pool's initial-state summary).

    The synthetic pool's tasks of one environment share it; BFCL's and τ²'s differ per task whenever their
    summaries differ. A summary that omits part of the state would make two different states look alike:
    the pools' summaries list every entity they start from."""
    raw = json.dumps([spec.pool, spec.env_id, spec.initial_state_summary], ensure_ascii=False)
    return "init_" + hashlib.sha256(raw.encode("utf-8")).hexdigest()[:24]


def record_gold_trace(pool: EnvironmentPool, task_id: str, replies: Sequence[str] | None = None) -> dict[str, Any]:
    """One gold replay of ``task_id`` in the real environment, as a ``messages`` trace.

    ``replies[t]`` closes user turn ``t`` (default: the synthetic pool's gold replies when it has them,
    else an empty reply). A turn boundary the pool cannot serve without a user model (τ² without a user
    simulator) ends the trace there, with a warning."""
    spec = pool.task(task_id)
    if replies is None and hasattr(pool, "gold_replies"):
        replies = pool.gold_replies(task_id)
    episode = pool.start(task_id)
    messages: list[dict[str, Any]] = [dict(m) for m in episode.initial_messages()]
    turns = pool.gold_actions(task_id)
    n = 0
    for t, turn in enumerate(turns):
        for call in turn:
            cid = f"call_{n}"
            n += 1
            name = call.to_dict()["name"]  # τ²'s user-side calls: "user:<tool>"
            messages.append({"role": "assistant", "content": "", "tool_calls": [
                {"id": cid, "type": "function", "function": {"name": name, "arguments": dict(call.arguments)}}]})
            messages.append({"role": "tool", "tool_call_id": cid, "content": episode.execute(call)})
        reply = replies[t] if replies is not None and t < len(replies) else ""
        messages.append({"role": "assistant", "content": reply})
        if t + 1 < len(turns):
            try:
                nxt = episode.end_turn(reply)
            except RuntimeError as exc:  # e.g. τ²'s UserSimulatorRequired
                logger.warning("%s/%s: trace ends after turn %d: %s", pool.name, task_id, t + 1, exc)
                break
            if nxt is None:
                break
            messages.append({"role": "user", "content": nxt})
    return {
        "episode_id": f"{pool.name}/{task_id}",
        "messages": messages,
        "metadata": {"pool": pool.name, "task_id": task_id, "env_id": spec.env_id, "category": spec.category,
                     "split": spec.split, "trajectory_group": f"{pool.name}/{task_id}",
                     "initial_state_id": initial_state_id(spec)},
    }


def record_pool(pool: EnvironmentPool, task_ids: Sequence[str]) -> list[dict[str, Any]]:
    """Gold traces of ``task_ids`` (tasks whose replay raises are skipped with a warning, never silently)."""
    out = []
    for tid in task_ids:
        try:
            out.append(record_gold_trace(pool, tid))
        except Exception as exc:  # noqa: BLE001  (one broken task must not lose the others; it is reported)
            logger.warning("%s/%s: gold replay failed: %s: %s", pool.name, tid, type(exc).__name__, exc)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m envace.envs.traces", description=__doc__.split("\n\n")[0])
    ap.add_argument("--pool", required=True, help="pool name (python -m envace.envs list)")
    ap.add_argument("--pool-kwargs", default="{}", help="JSON object of pool constructor arguments")
    ap.add_argument("--split", default="train", help="train | test | all")
    ap.add_argument("--max-tasks", type=int, default=None, help="first N task ids of the split")
    ap.add_argument("--env-id", action="append", default=None, help="only tasks of these env_ids (repeatable)")
    ap.add_argument("--out", required=True, help="JSONL file of traces")
    ap.add_argument("--by-env", default=None, help="also write one JSONL per env_id into this directory")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    pool = get_pool(args.pool, **json.loads(args.pool_kwargs))
    ids = pool.task_ids(None if args.split == "all" else args.split)
    if args.env_id:
        ids = [t for t in ids if pool.task(t).env_id in set(args.env_id)]
    if args.max_tasks is not None:
        ids = ids[: args.max_tasks]
    traces = record_pool(pool, ids)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(t, ensure_ascii=False) + "\n" for t in traces), encoding="utf-8")
    if args.by_env:
        groups: dict[str, list[dict[str, Any]]] = {}
        for t in traces:
            groups.setdefault(t["metadata"]["env_id"], []).append(t)
        d = Path(args.by_env)
        d.mkdir(parents=True, exist_ok=True)
        for env_id, ts in sorted(groups.items()):
            safe = "".join(c if c.isalnum() or c in "-_.+" else "_" for c in env_id)
            (d / f"{safe}.jsonl").write_text("".join(json.dumps(t, ensure_ascii=False) + "\n" for t in ts),
                                             encoding="utf-8")
    print(f"{len(traces)} of {len(ids)} task(s) recorded -> {out}")
    return 0 if traces or not ids else 1


if __name__ == "__main__":
    raise SystemExit(main())
