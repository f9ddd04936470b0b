"""``worldbook:DIR``: a pool whose tool calls are answered by Trace2Env worldbooks instead of the real environment.

``DIR`` is one worldbook package or a folder of them (``scripts/build_worldbook.sh``), loaded all or nothing. The
books record the pool their traces came from (``manifest.source_pool``); that *base* pool (built with
``pool_kwargs``) gives the tasks, and the pool serves those of its tasks whose environment has a book (a single
book serves every task).

An episode runs a :class:`trace2env.Session` over the task's book (rules, then supporting recorded evidence; no
language model) from the task's initial state (:func:`envace.envs.gold_trace.initial_state_id`) and, unseen by the
agent, the same calls in a real episode of the base pool (the shadow). The agent reads the simulator's
observations; the verdict is the base pool's official verifier over the shadow: the W2R outcome (actions chosen
inside the simulator, replayed in the real environment), as :class:`envace.agents.worldbook.WorldbookSource`
scores it. ``replay`` is the base pool's replay for the same reason.

``fidelity`` holds, per book, how well the book predicts held-out recordings: :func:`trace2env.evaluate.evaluate`
in ``evidence`` mode over gold replays of up to ``fidelity_tasks`` base-pool tasks of the book's environment that
were not among the book's sources (exact and key-overlap agreement with bootstrap intervals, the share answered),
computed when the pool is built. Served pools publish it in their metadata.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from envace.envs.base import EnvironmentPool, Episode, TaskSpec, ToolCall, Verdict, get_pool, register_pool
from envace.envs.gold_trace import initial_state_id, record_gold_trace

__all__ = ["WorldbookEpisode", "WorldbookPool"]


class WorldbookEpisode(Episode):
    """The simulator's session (what the agent sees) plus the real episode it shadows (what is verified)."""

    def __init__(self, session: Any, real: Episode) -> None:
        self.session, self.real, self.spec = session, real, real.spec
        self.routes: dict[str, int] = {}

    def tools(self) -> list[dict[str, Any]]:
        return self.real.tools()

    def initial_messages(self) -> list[dict[str, Any]]:
        return self.real.initial_messages()

    def execute(self, call: ToolCall) -> str:
        result = self.session.step({"name": call.name, "arguments": call.arguments})
        self.routes[result.route] = self.routes.get(result.route, 0) + 1
        self.real.execute(call)  # the shadow: the verdict is the real environment's
        return result.observation

    def end_turn(self, assistant_text: str) -> str | None:
        return self.real.end_turn(assistant_text)

    def verify(self) -> Verdict:
        verdict = self.real.verify()
        return Verdict(verdict.reward, verdict.passed, {**verdict.details, "simulator_routes": dict(self.routes)})

    def fork(self) -> WorldbookEpisode:
        copy = WorldbookEpisode(self.session.fork(), self.real.fork())
        copy.routes = dict(self.routes)
        return copy

    @property
    def done(self) -> bool:
        return self.real.done

    def close(self) -> None:
        self.real.close()


@register_pool("worldbook", argument="path")
class WorldbookPool(EnvironmentPool):
    """The tasks of the books' source pool that have a book, answered by the books (see the module docstring).

    Args:
        path: a worldbook package or a folder of packages.
        pool_kwargs: constructor options of the source pool (the books do not record them).
        min_rule_confidence: the simulator's fast-path gate.
        fidelity_tasks: held-out tasks per book for the fidelity figures (0: none computed).
    """

    name = "worldbook"

    def __init__(self, path: str, *, pool_kwargs: Mapping[str, Any] | None = None, min_rule_confidence: float = 0.9,
                 fidelity_tasks: int = 20) -> None:
        from trace2env import load_worldbooks

        root = Path(path)
        if not path or not root.exists():
            raise ValueError(f"worldbook:{path}: no such worldbook or folder of worldbooks")
        single, self.books = load_worldbooks(root)
        pools = {wb.manifest.source_pool for wb in self.books.values()}
        if len(pools) != 1 or None in pools:
            raise ValueError(f"worldbook:{path}: the books must come from one pool's traces, got {sorted(map(str, pools))}")
        self.path, self.min_rule_confidence = root, min_rule_confidence
        self.base = get_pool(pools.pop(), **dict(pool_kwargs or {}))
        self._single = next(iter(self.books.values())) if single else None
        self._ids = [t for t in self.base.task_ids() if self._book_of(self.base.task(t).env_id) is not None]
        if not self._ids:
            raise ValueError(f"worldbook:{path}: no task of pool {self.base.name!r} has a book here "
                             f"(books for {sorted(self.books)})")
        self.fidelity = self._fidelity(fidelity_tasks) if fidelity_tasks > 0 else None

    def _book_of(self, env_id: str) -> Any:
        return self._single if self._single is not None else self.books.get(env_id)

    def task_ids(self, split: str | None = None) -> list[str]:
        wanted = set(self.base.task_ids(split))
        return [t for t in self._ids if t in wanted]

    def task(self, task_id: str) -> TaskSpec:
        if task_id not in self._ids:
            raise KeyError(f"task {task_id!r} of pool {self.base.name!r} has no worldbook under {self.path}")
        return self.base.task(task_id)

    def gold_actions(self, task_id: str) -> list[list[ToolCall]]:
        self.task(task_id)
        return self.base.gold_actions(task_id)

    def start(self, task_id: str, **kwargs: Any) -> WorldbookEpisode:
        from trace2env import Session

        spec = self.task(task_id)
        session = Session.start(self._book_of(spec.env_id), context=initial_state_id(spec),
                                min_rule_confidence=self.min_rule_confidence)
        return WorldbookEpisode(session, self.base.start(task_id, **kwargs))

    def replay(self, task_id: str, actions: Sequence[Sequence[ToolCall]]) -> Verdict:
        """The base pool's replay: a worldbook episode's verdict is the real environment's (W2R)."""
        self.task(task_id)
        return self.base.replay(task_id, actions)

    def close(self) -> None:
        self.base.close()

    def _fidelity(self, per_book: int) -> dict[str, Any]:
        """Per book: evidence-mode agreement with gold replays of held-out tasks of its environment."""
        from trace2env.evaluate import evaluate
        from trace2env.ingest import parse_trace

        out: dict[str, Any] = {}
        for env_id, book in self.books.items():
            sources = {s.get("source_id") for s in book.sources} | {t.trace_id for t in book.transitions}
            traces = []
            for tid in self._ids:
                if len(traces) == per_book:
                    break
                if self._book_of(self.base.task(tid).env_id) is book:
                    with warnings.catch_warnings():  # a τ² trace cut at a user turn warns; it is still a trace
                        warnings.simplefilter("ignore")
                        trace = parse_trace(record_gold_trace(self.base, tid))
                    if trace.trace_id not in sources:
                        traces.append(trace)
            if not traces:
                out[env_id] = None
                continue
            summary = evaluate(book, traces, mode="evidence", min_rule_confidence=self.min_rule_confidence,
                               n_boot=200)["summary"]
            out[env_id] = {k: _finite(v) for k, v in summary.items() if k in _FIDELITY_KEYS or k.startswith(
                ("exact", "key_overlap", "answered"))}
        return out


_FIDELITY_KEYS = ("traces", "steps", "routes")


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
