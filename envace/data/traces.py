"""Gold replays of a pool's tasks, recorded as Trace2Env traces: the material worldbooks are built from.

:func:`record_pool` records the gold replay of each task (:func:`envace.envs.gold_trace.record_gold_trace`: the real
environment's observations, the task's initial-state identity in the metadata) and :func:`write_traces` writes them
as JSONL, optionally also one file per environment (one worldbook per environment, ``scripts/build_worldbook.sh``).
``python -m envace.data record-traces`` is the command (:mod:`envace.data.cli.traces`); the training run's
``worldbook: auto`` records through the same function (:mod:`envace.data.worldbooks`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from envace.envs.base import EnvironmentPool
from envace.envs.gold_trace import record_gold_trace

__all__ = ["record_pool", "write_traces"]

logger = logging.getLogger(__name__)


def record_pool(pool: EnvironmentPool, task_ids: Sequence[str]) -> list[dict[str, Any]]:
    """Gold traces of ``task_ids`` (tasks whose replay raises are skipped with a warning, never silently)."""
    out = []
    for tid in task_ids:
        try:
            out.append(record_gold_trace(pool, tid))
        except Exception as exc:  # noqa: BLE001  (one broken task must not lose the others; it is reported)
            logger.warning("%s/%s: gold replay failed: %s: %s", pool.name, tid, type(exc).__name__, exc)
    return out


def _jsonl(traces: Iterable[dict[str, Any]]) -> str:
    return "".join(json.dumps(t, ensure_ascii=False) + "\n" for t in traces)


def write_traces(traces: Sequence[dict[str, Any]], out: str | Path, by_env: str | Path | None = None) -> None:
    """``traces`` as JSONL in ``out``; with ``by_env``, also one ``<env_id>.jsonl`` per environment in that folder
    (characters outside ``[A-Za-z0-9-_.+]`` of the env id become ``_``)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(_jsonl(traces), encoding="utf-8")
    if by_env is None:
        return
    groups: dict[str, list[dict[str, Any]]] = {}
    for t in traces:
        groups.setdefault(t["metadata"]["env_id"], []).append(t)
    folder = Path(by_env)
    folder.mkdir(parents=True, exist_ok=True)
    for env_id, ts in sorted(groups.items()):
        safe = "".join(c if c.isalnum() or c in "-_.+" else "_" for c in env_id)
        (folder / f"{safe}.jsonl").write_text(_jsonl(ts), encoding="utf-8")
