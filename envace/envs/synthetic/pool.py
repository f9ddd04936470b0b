"""The ``synthetic`` pool: ``n_envs`` generated environments, built lazily, with gold actions, replies and
trajectories."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from typing import Any

from envace.envs.base import EnvironmentPool, TaskSpec, ToolCall, Verdict, register_pool, replay_replying
from envace.envs.synthetic.domains import DOMAINS, SHAPES
from envace.envs.synthetic.episode import SyntheticEpisode
from envace.envs.synthetic.tasks import Task
from envace.envs.synthetic.world import Env

POOL_NAME = "synthetic"


@register_pool(POOL_NAME)
class SyntheticPool(EnvironmentPool):
    """``n_envs`` generated environments × ``tasks_per_env`` tasks (default 51 × 50), deterministic in ``seed``.

    Args:
        n_envs: number of environments (domain ``i mod 9`` for environment ``i``).
        tasks_per_env: tasks generated per environment.
        seed: generator seed (entities, tools, renamings, tasks) and split seed.
        reward: ``"binary"`` (1.0 iff every check passes) or ``"partial"`` (fraction of checks passed).
        test_fraction: share of tasks in the ``"test"`` split.
        shapes: keep only these task shapes (a subset of :data:`SHAPES`; ``None``: all). Each
            environment cycles through the kept shapes its tools allow (``act``, ``query``,
            ``lookup_act``, ``lookup_query`` and ``multiturn`` are allowed everywhere; an environment
            that allows none of the kept shapes gets ``query`` tasks). Task ids and splits do not
            depend on ``shapes``; the tasks themselves do.
        renamings: each environment draws its own tool and parameter names from its domain's variants
            (``True``, the default: environments of one domain look different, related only by their
            abstract operations) or uses the domain's first variant everywhere (``False``: the pool the
            warm-started tiny policy learns on, see ``envace.models.warmstart``).
    """

    name = POOL_NAME

    def __init__(
        self,
        n_envs: int = 51,
        tasks_per_env: int = 50,
        seed: int | str = 0,
        reward: str = "binary",
        test_fraction: float = 0.2,
        shapes: Sequence[str] | None = None,
        renamings: bool = True,
    ) -> None:
        if shapes is not None:
            if isinstance(shapes, str):
                shapes = (shapes,)
            unknown = [s for s in shapes if s not in SHAPES]
            if unknown or not shapes:
                raise ValueError(f"shapes must be a non-empty subset of {SHAPES}, got {shapes!r}")
            shapes = tuple(s for s in SHAPES if s in set(shapes))
        self.shapes: tuple[str, ...] | None = shapes
        self.renamings = bool(renamings)
        if int(n_envs) < 1 or int(tasks_per_env) < 1:
            raise ValueError(f"n_envs and tasks_per_env must be positive, got {n_envs}, {tasks_per_env}")
        if reward not in ("binary", "partial"):
            raise ValueError(f"reward must be 'binary' or 'partial', got {reward!r}")
        if not 0.0 <= test_fraction <= 1.0:
            raise ValueError(f"test_fraction must be in [0, 1], got {test_fraction}")
        self.n_envs, self.tasks_per_env = int(n_envs), int(tasks_per_env)
        self.seed, self.reward, self.test_fraction = seed, reward, float(test_fraction)
        self._env_ids = [f"syn-{DOMAINS[i % len(DOMAINS)].name}-{i:02d}" for i in range(self.n_envs)]
        self._env_index = {eid: i for i, eid in enumerate(self._env_ids)}
        width = max(2, len(str(self.tasks_per_env - 1)))
        self._ids = [f"{e}/t{j:0{width}d}" for e in self._env_ids for j in range(self.tasks_per_env)]
        self._split = {tid: self.split_of(tid) for tid in self._ids}
        self._envs: dict[int, Env] = {}
        self._lock = threading.Lock()

    # -- construction -----------------------------------------------------------------------------------

    def split_of(self, task_id: str) -> str:
        h = int.from_bytes(hashlib.sha256(f"{self.seed}:{task_id}".encode()).digest()[:8], "big") / 2**64
        return "test" if h < self.test_fraction else "train"

    def _env(self, index: int) -> Env:
        env = self._envs.get(index)
        if env is None:
            with self._lock:
                env = self._envs.get(index)
                if env is None:
                    env = Env(self, index)
                    env.build_tasks(self)
                    self._envs[index] = env
        return env

    def _lookup(self, task_id: str) -> tuple[Env, Task]:
        env_id, _, rest = task_id.partition("/t")
        index = self._env_index.get(env_id)
        if index is None or not rest.isdigit() or int(rest) >= self.tasks_per_env or task_id not in self._split:
            raise KeyError(f"unknown {self.name} task {task_id!r}")
        env = self._env(index)
        return env, env.tasks[int(rest)]

    # -- protocol ---------------------------------------------------------------------------------------

    def task_ids(self, split: str | None = None) -> list[str]:
        if split in (None, "all"):
            return list(self._ids)
        if split not in ("train", "test"):
            raise ValueError(f"unknown split {split!r}; use 'train', 'test' or None")
        return [t for t in self._ids if self._split[t] == split]

    def task(self, task_id: str) -> TaskSpec:
        return self._lookup(task_id)[1].spec

    def start(self, task_id: str, reward: str | None = None) -> SyntheticEpisode:
        """A fresh episode; ``reward`` overrides the pool's reward variant for this episode."""
        if reward not in (None, "binary", "partial"):
            raise ValueError(f"reward must be 'binary' or 'partial', got {reward!r}")
        env, task = self._lookup(task_id)
        return SyntheticEpisode(env, task, reward or self.reward)

    def gold_actions(self, task_id: str) -> list[list[ToolCall]]:
        _, task = self._lookup(task_id)
        return [[ToolCall(c.name, dict(c.arguments)) for c in t.calls] for t in task.turns]

    def replay(
        self, task_id: str, actions: Sequence[Sequence[ToolCall]], replies: Sequence[str] | None = None
    ) -> Verdict:
        """Execute ``actions`` (one list per user turn), end each turn with a reply and verify.

        ``replies[t]`` is the reply that ends turn ``t``; by default (and for turns ``replies`` does
        not cover) it is the turn's observations joined by newlines, so answer checks pass iff the
        turn's calls retrieved the asked value. Turns beyond the task's are ignored.
        """
        return replay_replying(self.start(task_id), actions, replies)

    # -- extras -----------------------------------------------------------------------------------------

    def environments(self) -> list[str]:
        """The environment ids, in order."""
        return list(self._env_ids)

    def env_tools(self, env_id: str) -> list[dict[str, Any]]:
        """The tool schemas of an environment."""
        return list(self._env(self._env_index[env_id]).tools)

    def user_messages(self, task_id: str) -> list[str]:
        """The task's user messages, one per turn."""
        return [t.user for t in self._lookup(task_id)[1].turns]

    def gold_replies(self, task_id: str) -> list[str]:
        """The gold assistant reply closing each turn (``"Done."`` unless the turn asks a question)."""
        return [t.reply for t in self._lookup(task_id)[1].turns]

    def gold_observations(self, task_id: str) -> list[list[str]]:
        """The observation of every gold call, one list per turn."""
        return [list(t.observations) for t in self._lookup(task_id)[1].turns]

    def gold_trajectory(self, task_id: str) -> list[dict[str, Any]]:
        """The full gold chat: user messages, assistant tool calls, tool observations and replies (OpenAI form)."""
        _, task = self._lookup(task_id)
        msgs = task.spec.initial_messages()
        for t, turn in enumerate(task.turns):
            if t:
                msgs.append({"role": "user", "content": turn.user})
            for call, obs in zip(turn.calls, turn.observations, strict=True):
                msgs.append(
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [
                            {"type": "function", "function": {"name": call.name, "arguments": dict(call.arguments)}}
                        ],
                    }
                )
                msgs.append({"role": "tool", "content": obs})
            msgs.append({"role": "assistant", "content": turn.reply})
        return msgs
