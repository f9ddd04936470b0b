"""``latency:POOL``: pool ``POOL`` with a simulated latency on every tool call, so that a CPU run sees what a
cluster's slow tools and long tails do to a training step.

Each episode of the wrapper is its inner pool's episode. A tool call first waits the latency, then runs the inner
call. The wait is ``await asyncio.sleep`` in :meth:`LatencyEpisode.aexecute` and ``time.sleep`` in ``execute``.
Nothing else changes: tools, user turns, verification, forks, ``replay``, gold actions and the task views come
from the inner pool, so observations and scores are the inner pool's own. The one field that differs is
``TaskSpec.pool``, which names the wrapper. The data rows built from it (``extra_info.pool``) then run their rollouts
through the wrapper.

The wrapped episode is ``remote``, so a rollout awaits its calls (:class:`envace.agents.sources.RealSource`).
Without that it would run ``execute`` in one of the event loop's default worker threads (about six on two cores),
and those threads would serialise the sleeps. Being ``remote`` also means two things:

* the tool bounds' forked dry run (``limits.tool_timeout_s`` / ``tool_memory_mb``) is skipped, as for every
  remote episode, so only ``env_timeout_s`` bounds a call of the wrapped pool, and the delay counts against it.
  This is harmless for ``synthetic``, whose calls cost what their few arguments cost. A pool with compute-heavy
  tools (BFCL's math API) loses that guard;
* verification is awaited (:meth:`Episode.averify`: the inner ``verify`` in a worker thread) instead of running in
  a thread of its own. A verifier that never returns would then hold a worker thread.

The verifier is the inner one; a rollout's verification gets no delay.

Latency of call ``i`` (0-based, counted per episode; a fork continues its parent's count) of task ``t``:

* ``fixed``: ``ms`` milliseconds;
* ``longtail``: ``ms``, or ``ms × factor`` with probability ``p``.

The draw is a pure function of ``(seed, t, i)``: a ``random.Random`` seeded with that string, hashed by SHA-512,
so it is the same in every process and run. Runs of different trainers at one seed therefore meet the same slow
calls. The K rollouts of a GRPO group share their task, so their ``i``-th calls draw the same latency: a slow call
is a property of a (task, call position), like a slow tool behind one step. Every call of a task in ``slow_tasks``
takes ``ms × factor``, in either distribution; this serves deterministic tests.

The pool counts its calls, the slow ones, and the latency it injected (:attr:`LatencyPool.stats`). With
``stats_dir``, each pool instance also keeps its totals in ``stats_dir/latency-<pid>-<id>.json``, rewritten after
every call. A training run's rollouts run in several Ray worker processes, and :func:`collect_stats` sums those
files (``benchmarks/async_throughput.py``).

The wrapper is named ``NAME:ARG``, the way ``worldbook:DIR`` is (:func:`register_pool`'s ``argument``). The rows
then say which pool their rollouts run through, the inner pool stays addressable unwrapped in the same config, and
the wrapper's options sit under their own key in ``envace.agent.pool_kwargs``, with the inner pool's options passed
through in ``pool_kwargs``. The inner pool's chat-model arguments (τ²'s simulated user) would not be connected to
endpoints there (:func:`envace.agents.client.connect_endpoints` looks them up by the wrapper's name), so giving one
is refused. Hydra's dotted keys cannot hold the colon, but its dict keys can, escaped:
``envace.data.pools=[latency:synthetic]`` with ``++envace.agent.pool_kwargs={latency\\:synthetic: {dist: longtail,
ms: 200, p: 0.05, seed: 0, pool_kwargs: {tasks_per_env: 65}}}``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import random
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from envace.envs.base import (
    EnvironmentPool,
    Episode,
    TaskSpec,
    ToolCall,
    Verdict,
    chat_model_args,
    get_pool,
    register_pool,
)

__all__ = ["DISTRIBUTIONS", "LatencyEpisode", "LatencyModel", "LatencyPool", "LatencyStats", "collect_stats"]

POOL_NAME = "latency"
DISTRIBUTIONS = ("fixed", "longtail")
_KEYS = ("pool_kwargs", "dist", "ms", "p", "factor", "seed", "slow_tasks", "stats_dir")

#: the two waits, module attributes so that a test can replace them with a fake clock
_sleep = time.sleep
_asleep = asyncio.sleep


def _number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"latency pool key {key!r}: a finite number, got {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class LatencyModel:
    """The latency distribution (module docstring); its checks raise ``ValueError`` naming the key."""

    dist: str = "fixed"  # fixed | longtail
    ms: float = 0.0  # every call's latency, in milliseconds (longtail: the fast calls')
    p: float | None = None  # longtail: probability that a call is slow (needed there, refused with fixed)
    factor: float = 10.0  # a slow call takes ms × factor
    seed: int = 0  # the draw's seed
    slow_tasks: frozenset[str] = frozenset()  # tasks whose every call is slow

    def __post_init__(self) -> None:
        if self.dist not in DISTRIBUTIONS:
            raise ValueError(f"latency pool key 'dist': one of {', '.join(DISTRIBUTIONS)}, got {self.dist!r}")
        if _number("ms", self.ms) < 0:
            raise ValueError(f"latency pool key 'ms': milliseconds >= 0, got {self.ms!r}")
        if _number("factor", self.factor) < 1:
            raise ValueError(f"latency pool key 'factor': a slow call's multiple of ms, >= 1, got {self.factor!r}")
        if self.dist == "fixed" and self.p is not None:
            raise ValueError(f"latency pool key 'p': only dist=longtail draws slow calls (dist=fixed, p={self.p!r})")
        if self.dist == "longtail" and (self.p is None or not 0 < _number("p", self.p) <= 1):
            raise ValueError(f"latency pool key 'p': dist=longtail needs a probability in (0, 1], got {self.p!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"latency pool key 'seed': an integer, got {self.seed!r}")  # noqa: TRY004 - a config value

    def slow(self, task_id: str, index: int) -> bool:
        """Whether call ``index`` of an episode of ``task_id`` is slow (deterministic in the seed)."""
        if task_id in self.slow_tasks:
            return True
        if self.dist == "fixed":
            return False
        return random.Random(f"{self.seed}/{task_id}/{index}").random() < self.p

    def draw(self, task_id: str, index: int) -> tuple[bool, float]:
        """(slow, latency in seconds) of call ``index`` of an episode of ``task_id``."""
        slow = self.slow(task_id, index)
        return slow, self.ms / 1000.0 * (self.factor if slow else 1.0)



class LatencyStats:
    """Calls, slow calls and injected seconds of one pool instance (thread-safe); with ``path``, the totals are
    rewritten there (atomically) after every call."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self.calls = 0
        self.slow_calls = 0
        self.injected_s = 0.0
        self._lock = threading.Lock()

    def record(self, delay_s: float, slow: bool) -> None:
        with self._lock:
            self.calls += 1
            self.slow_calls += int(slow)
            self.injected_s += delay_s
            if self.path is not None:
                tmp = self.path.with_name(self.path.name + ".tmp")
                tmp.write_text(json.dumps(self.as_dict()))
                tmp.replace(self.path)

    def as_dict(self) -> dict[str, float]:
        return {"calls": self.calls, "slow_calls": self.slow_calls, "injected_s": self.injected_s}


def collect_stats(stats_dir: str | Path) -> dict[str, float]:
    """The sum of the totals every pool instance wrote under ``stats_dir`` (zeros when none did)."""
    total = {"calls": 0, "slow_calls": 0, "injected_s": 0.0}
    for path in sorted(Path(stats_dir).glob("latency-*.json")):
        for key, value in json.loads(path.read_text()).items():
            total[key] = total.get(key, 0) + value
    return total


class LatencyEpisode(Episode):
    """The inner episode, with each tool call delayed by the pool's latency model (module docstring)."""

    remote = True

    def __init__(self, inner: Episode, pool: LatencyPool, spec: TaskSpec, calls: int = 0) -> None:
        self.inner, self.pool, self.spec = inner, pool, spec
        self.executable = inner.executable
        self.calls = calls  # calls made so far: the index of the next one

    def _next_delay(self) -> float:
        index, self.calls = self.calls, self.calls + 1
        slow, delay = self.pool.model.draw(self.spec.task_id, index)
        self.pool.stats.record(delay, slow)
        return delay

    def execute(self, call: ToolCall) -> str:
        _sleep(self._next_delay())
        return self.inner.execute(call)

    async def aexecute(self, call: ToolCall) -> str:
        await _asleep(self._next_delay())
        return await self.inner.aexecute(call)

    def tools(self) -> list[dict[str, Any]]:
        return self.inner.tools()

    def initial_messages(self) -> list[dict[str, Any]]:
        return self.inner.initial_messages()

    def end_turn(self, assistant_text: str) -> str | None:
        return self.inner.end_turn(assistant_text)

    def verify(self) -> Verdict:
        return self.inner.verify()

    async def averify(self) -> Verdict:
        return await self.inner.averify()

    def fork(self) -> LatencyEpisode:
        return LatencyEpisode(self.inner.fork(), self.pool, self.spec, self.calls)

    @property
    def done(self) -> bool:
        return self.inner.done

    def close(self) -> None:
        self.inner.close()

    async def aclose(self) -> None:
        await self.inner.aclose()

    def __getattr__(self, name: str) -> Any:  # the inner episode's extras (a synthetic episode's state, turn, ...)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


@register_pool(POOL_NAME, argument="pool")
class LatencyPool(EnvironmentPool):
    """Pool ``pool`` (built with ``pool_kwargs``) whose tool calls wait a simulated latency (module docstring).

    Args:
        pool: the inner pool's name (``latency:synthetic`` passes ``synthetic``).
        pool_kwargs: the inner pool's constructor options.
        dist, ms, p, factor, seed, slow_tasks: the :class:`LatencyModel`; ``slow_tasks`` must be tasks of the pool.
        stats_dir: a folder where the pool keeps its call counts (:func:`collect_stats`); None: in memory only.

    Any other key, or a bad value, raises ``ValueError`` with one line naming the key.
    """

    def __init__(self, pool: str = "", *, pool_kwargs: Mapping[str, Any] | None = None, dist: str = "fixed",
                 ms: float = 0.0, p: float | None = None, factor: float = 10.0, seed: int = 0,
                 slow_tasks: Sequence[str] | None = None, stats_dir: str | None = None, **unknown: Any) -> None:
        if unknown:
            raise ValueError(f"latency pool: unknown key {min(unknown)!r} (known: {', '.join(_KEYS)})")
        if not pool:
            raise ValueError("latency pool key 'pool': name the inner pool, as in latency:synthetic")
        if pool_kwargs is not None and not isinstance(pool_kwargs, Mapping):
            raise ValueError(f"latency pool key 'pool_kwargs': the inner pool's options as a mapping, got {pool_kwargs!r}")
        if slow_tasks is not None and (isinstance(slow_tasks, str) or not isinstance(slow_tasks, Iterable)):
            raise ValueError(f"latency pool key 'slow_tasks': a list of task ids, got {slow_tasks!r}")
        needs_client = [arg for arg in chat_model_args(pool) if isinstance((pool_kwargs or {}).get(arg), Mapping)]
        if needs_client:
            raise ValueError(f"latency pool key 'pool_kwargs': {pool}'s chat-model argument {needs_client[0]!r} is not "
                             "connected to its endpoint through the wrapper")
        self.model = LatencyModel(dist=dist, ms=ms, p=p, factor=factor, seed=seed,
                                  slow_tasks=frozenset(map(str, slow_tasks or ())))
        self.name = f"{POOL_NAME}:{pool}"
        self.inner = get_pool(pool, **dict(pool_kwargs or {}))
        if self.model.slow_tasks:
            missing = sorted(self.model.slow_tasks - set(self.inner.task_ids()))
            if missing:
                raise ValueError(f"latency pool key 'slow_tasks': not tasks of pool {pool!r}: {', '.join(missing[:3])}")
        path = None
        if stats_dir is not None:
            Path(stats_dir).mkdir(parents=True, exist_ok=True)
            path = Path(stats_dir) / f"latency-{os.getpid()}-{id(self):x}.json"
        self.stats = LatencyStats(path)

    def task_ids(self, split: str | None = None) -> list[str]:
        return self.inner.task_ids(split)

    def task(self, task_id: str) -> TaskSpec:
        """The inner task, its ``pool`` naming this wrapper (so that rows built from it come back here)."""
        return dataclasses.replace(self.inner.task(task_id), pool=self.name)

    def start(self, task_id: str, **kwargs: Any) -> LatencyEpisode:
        return LatencyEpisode(self.inner.start(task_id, **kwargs), self, self.task(task_id))

    async def astart(self, task_id: str, **kwargs: Any) -> LatencyEpisode:
        return LatencyEpisode(await self.inner.astart(task_id, **kwargs), self, self.task(task_id))

    def gold_actions(self, task_id: str) -> list[list[ToolCall]]:
        return self.inner.gold_actions(task_id)

    def replay(self, task_id: str, actions: Sequence[Sequence[ToolCall]], *args: Any, **kwargs: Any) -> Verdict:
        """The inner pool's replay, without latency (gold replay and EnvSched's filter measure the task)."""
        return self.inner.replay(task_id, actions, *args, **kwargs)

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:  # the inner pool's extras (synthetic: environments(), gold_replies())
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
