"""A task's gold replay in the real environment, recorded as a Trace2Env ``messages`` trace, and the identity of
its initial state.

Trace2Env (seed paper 002, §3) builds a simulator from recorded interaction traces alone. :func:`record_gold_trace`
executes a task's gold actions in a fresh episode of the pool and writes the chat in the format
:func:`trace2env.parse_trace` reads (assistant ``tool_calls`` with ids, ``tool`` messages with ``tool_call_id``; the
observation text exactly as the environment returned it). The worldbook pool scores its books against such replays
(:mod:`envace.envs.worldbook_pool`), and :mod:`envace.data.traces` records whole splits of them for building books.

τ²-bench needs no user simulator here: its gold actions form one turn (τ² gold has no turn structure), so the replay
never reaches a turn boundary; the trace opens with the agent's greeting and the scenario's reason for call (what the
pool shows without a user model), and the user-side gold actions (telecom: the user toggling their phone) are
executed on the user tools and recorded under their dict name ``user:<tool>``
(:meth:`envace.envs.tau2.Tau2ToolCall.to_dict`), so a worldbook keeps the two sides apart.

Trace metadata: ``pool``, ``task_id``, ``env_id``, ``category``, ``split``, ``trajectory_group`` (the task, so a split
manifest never separates replays of one task) and ``initial_state_id`` (:func:`initial_state_id`), which the
applicability gate compares before it lets a recorded observation stand in for a simulated one; the simulator starts
a session from the same identity.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from collections.abc import Sequence
from typing import Any

from envace.envs.base import EnvironmentPool, TaskSpec

__all__ = ["initial_state_id", "record_gold_trace"]

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
