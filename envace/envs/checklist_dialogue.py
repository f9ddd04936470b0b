"""CM2 checklist-scored dialogues as episodes: what the agent loop starts for a row of the ``cm2`` pool.

A row that :func:`envace.data.cm2.convert_cm2` wrote carries its whole task (the prompt, the tools, the reference
dialogue in ``extra_info.metadata``), so its episode is built from the row itself, not from a registered pool. There
is no executable environment behind it: tool calls can only be rehearsed or simulated, the user side replays the
reference dialogue's user turns, and the reward is the checklist judge's (:mod:`envace.rewards.checklist`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from envace.envs.base import Episode, TaskSpec, ToolCall, Verdict

__all__ = ["POOL", "CM2Episode", "episode_from_row"]

#: the ``pool`` of every converted CM2 row (``extra_info.pool``)
POOL = "cm2"


class CM2Episode(Episode):
    """A checklist-scored dialogue as an episode. There is no executable environment: tool calls can only
    be rehearsed or simulated (``executable = False``), and the reward is the checklist judge's. The user
    side replays the reference dialogue's user turns in order (the EnvACE reference's scripted user)."""

    executable = False

    def __init__(self, spec: TaskSpec, user_turns: list[str]) -> None:
        self.spec = spec
        self._later_turns = list(user_turns)

    def tools(self) -> list[dict[str, Any]]:
        return list(self.spec.tools)

    def execute(self, call: ToolCall) -> str:
        raise RuntimeError(
            f"CM2 task {self.spec.task_id} has no executable environment; use observation_source "
            "rehearse or simulator"
        )

    def end_turn(self, assistant_text: str) -> str | None:
        return self._later_turns.pop(0) if self._later_turns else None

    def verify(self) -> Verdict:
        raise RuntimeError(f"CM2 task {self.spec.task_id} is scored by the checklist judge, not a verifier")

    def fork(self) -> CM2Episode:
        return CM2Episode(self.spec, list(self._later_turns))


def episode_from_row(row: Mapping[str, Any]) -> CM2Episode:
    """The episode of one converted row (the verl dataset row: ``prompt``/``raw_prompt``, ``tools``,
    ``extra_info`` with the reference dialogue in ``metadata``)."""
    info = row.get("extra_info") or {}
    metadata = info.get("metadata") or {}
    if isinstance(metadata, str):
        metadata = json.loads(metadata)
    reference = metadata.get("reference_messages")
    if not reference:
        raise ValueError(f"CM2 row {info.get('task_id')!r} has no extra_info.metadata.reference_messages")
    tools = row.get("tools") or []
    if isinstance(tools, str):
        tools = json.loads(tools) if tools.strip() else []
    users = [m["content"] for m in reference if m.get("role") == "user"]
    system = next((m["content"] for m in reference if m.get("role") == "system"), None)
    spec = TaskSpec(
        pool=POOL,
        task_id=str(info.get("task_id")),
        env_id=str(info.get("env_id", "cm2")),
        category=str(info.get("category", POOL)),
        split=str(info.get("split", "train")),
        system_prompt=system,
        first_user_message=users[0],
        tools=list(tools),
    )
    return CM2Episode(spec, users[1:])
