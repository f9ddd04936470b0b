"""A live synthetic task: a private copy of the environment's state, the turn pointer, the replies and the
verifier's checks."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from envace.envs.base import Episode, ToolCall, ToolCallError, Verdict
from envace.envs.synthetic.domains import copy_state, error_obs
from envace.envs.synthetic.tasks import Task
from envace.envs.synthetic.world import Env


class SyntheticEpisode(Episode):
    """A live task: a private copy of the environment's state, the turn pointer and the replies."""

    def __init__(self, env: Env, task: Task, reward: str, state: dict[str, dict[str, Any]] | None = None) -> None:
        self.spec = task.spec
        self._env = env
        self._task = task
        self._reward = reward
        self.state = copy_state(env.initial) if state is None else state
        self.replies: list[str] = []
        self._turn = 0
        self._done = False

    @property
    def done(self) -> bool:
        return self._done

    @property
    def turn(self) -> int:
        return self._turn

    @property
    def num_turns(self) -> int:
        return len(self._task.turns)

    def tools(self) -> list[dict[str, Any]]:
        return list(self._env.tools)

    def execute(self, call: ToolCall | Mapping[str, Any]) -> str:
        if self._done:
            return error_obs("the episode is over")
        if not isinstance(call, ToolCall):
            try:
                call = ToolCall.from_dict(call)
            except ToolCallError as exc:
                return error_obs(str(exc))
        return self._env.execute(self.state, call)

    def end_turn(self, assistant_text: str) -> str | None:
        if self._done:
            return None
        self.replies.append(assistant_text or "")
        self._turn += 1
        if self._turn >= len(self._task.turns):
            self._done = True
            return None
        return self._task.turns[self._turn].user

    def checks(self) -> list[tuple[str, bool]]:
        """Every verifier check in words with its outcome on the current state and replies."""
        state, initial = self.state, self._env.initial
        out = []
        for c in self._task.checks:
            if c.kind == "entity":
                ok = state.get(c.eid) == dict(c.fields)
            elif c.kind == "deleted":
                ok = c.eid not in state
            elif c.kind == "created":
                ok = any(eid not in initial and e == dict(c.fields) for eid, e in state.items())
            elif c.kind == "unchanged":
                ok = all(state.get(eid) == e for eid, e in initial.items() if eid not in c.touched) and (
                    sum(eid not in initial for eid in state) == c.n_created
                )
            else:
                reply = self.replies[c.turn] if c.turn < len(self.replies) else ""
                ok = re.search(rf"(?<!\w){re.escape(c.token)}(?!\w)", reply, re.IGNORECASE) is not None
            out.append((c.text, ok))
        return out

    def verify(self) -> Verdict:
        checks = self.checks()
        n_ok = sum(ok for _, ok in checks)
        passed = n_ok == len(checks)
        reward = (1.0 if passed else 0.0) if self._reward == "binary" else n_ok / len(checks)
        failed = [text for text, ok in checks if not ok]
        return Verdict(
            reward=float(reward),
            passed=passed,
            details={
                "task_id": self.spec.task_id,
                "checks": [{"check": text, "passed": ok} for text, ok in checks],
                "passed_checks": n_ok,
                "total_checks": len(checks),
                "error_type": None if passed else "synthetic:check_failed",
                "reason": "" if passed else "failed: " + "; ".join(failed),
            },
        )

    def fork(self) -> SyntheticEpisode:
        ep = SyntheticEpisode(self._env, self._task, self._reward, state=copy_state(self.state))
        ep.replies = list(self.replies)
        ep._turn, ep._done = self._turn, self._done
        return ep
