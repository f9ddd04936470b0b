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

Every argument is checked before anything is written (an unknown pool, split or ``--env-id``, bad
``--pool-kwargs``, ``--max-tasks`` below 1, an ``--out`` that is a directory: exit 2 with one line, see
:mod:`trace2env.cliargs`); a selection with no task is refused rather than written as an empty file.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from envace.envs.base import EnvironmentPool, TaskSpec, available_pools, get_pool
from trace2env.cliargs import ArgumentParser, UsageError, json_object, number, run_cli

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
    with contextlib.closing(pool.start(task_id)) as episode:
        messages = _play_gold(pool, task_id, episode, replies)
    return {
        "episode_id": f"{pool.name}/{task_id}",
        "messages": messages,
        "metadata": {"pool": pool.name, "task_id": task_id, "env_id": spec.env_id, "category": spec.category,
                     "split": spec.split, "trajectory_group": f"{pool.name}/{task_id}",
                     "initial_state_id": initial_state_id(spec)},
    }


def _play_gold(pool: EnvironmentPool, task_id: str, episode: Any, replies: Sequence[str] | None
               ) -> list[dict[str, Any]]:
    """The messages of ``task_id``'s gold calls executed in ``episode``, each turn closed by its reply."""
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
    return messages


def record_pool(pool: EnvironmentPool, task_ids: Sequence[str]) -> list[dict[str, Any]]:
    """Gold traces of ``task_ids`` (tasks whose replay raises are skipped with a warning, never silently)."""
    out = []
    for tid in task_ids:
        try:
            out.append(record_gold_trace(pool, tid))
        except Exception as exc:  # noqa: BLE001  (one broken task must not lose the others; it is reported)
            logger.warning("%s/%s: gold replay failed: %s: %s", pool.name, tid, type(exc).__name__, exc)
    return out


def _select(args: argparse.Namespace) -> tuple[EnvironmentPool, list[str]]:
    """The pool and the task ids the arguments select; UsageError for anything that selects nothing."""
    import contextlib
    import sys

    with contextlib.redirect_stdout(sys.stderr):  # benchmark packages print at import
        known = available_pools()
        if args.pool not in known:
            raise UsageError(f"--pool {args.pool!r}: unknown pool; known: {', '.join(known)}")
        try:
            pool = get_pool(args.pool, **args.pool_kwargs)
        except (TypeError, ValueError, KeyError) as exc:
            raise UsageError(f"--pool-kwargs for {args.pool!r}: {exc}") from None
    if args.split not in ("train", "test", "all"):
        raise UsageError(f"--split {args.split!r}: expected train, test or all")
    ids = pool.task_ids(None if args.split == "all" else args.split)
    if args.env_id:
        envs = {pool.task(t).env_id for t in ids}
        unknown = sorted(set(args.env_id) - envs)
        if unknown:
            have = sorted(envs)
            raise UsageError(f"--env-id {', '.join(unknown)}: no {args.split}-split task of pool {args.pool!r} "
                             f"has it (it has {len(have)}: {', '.join(have[:6])}{' ...' if len(have) > 6 else ''})")
        ids = [t for t in ids if pool.task(t).env_id in set(args.env_id)]
    if args.max_tasks is not None:
        ids = ids[: args.max_tasks]
    if not ids:
        raise UsageError(f"no {args.split}-split task in pool {args.pool!r}")
    return pool, ids


def _main(argv: Sequence[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m envace.envs.traces", description=__doc__.split("\n\n")[0])
    ap.add_argument("--pool", required=True, help="pool name (python -m envace.envs list)")
    ap.add_argument("--pool-kwargs", type=json_object, default={}, help="JSON object of pool constructor arguments")
    ap.add_argument("--split", default="train", help="train | test | all")
    ap.add_argument("--max-tasks", type=number(int, min=1), default=None, help="first N task ids of the split")
    ap.add_argument("--env-id", action="append", default=None, help="only tasks of these env_ids (repeatable)")
    ap.add_argument("--out", required=True, help="JSONL file of traces")
    ap.add_argument("--by-env", default=None, help="also write one JSONL per env_id into this directory")
    args = ap.parse_args(argv)
    if Path(args.out).is_dir():
        raise UsageError(f"--out {args.out}: a directory, expected a JSONL file")
    if args.by_env and Path(args.by_env).exists() and not Path(args.by_env).is_dir():
        raise UsageError(f"--by-env {args.by_env}: a file, expected a directory")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    pool, ids = _select(args)
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
    return 0 if traces else 1


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI; usage and input mistakes exit 2 with one line (:mod:`trace2env.cliargs`)."""
    return run_cli("python -m envace.envs.traces", _main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
