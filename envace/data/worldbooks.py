"""Which training environments Trace2Env's simulator serves (``envace.agent.simulated_envs``), and their books.

A run may mix environments: those a user can execute stay with ``envace.agent.observation_source`` (EnvACE's
rehearsal, or the real environment), those they only have recorded traces of are served by a Trace2Env worldbook
built from those traces (the ``envace_simulator`` loop over :class:`envace.agents.worldbook.WorldbookSource`). The
choice is per environment and made at data-build time: a training row of a simulated environment names the
simulator's loop in its ``agent_name`` column, every other row the observation source's loop, so the one turn engine
and the one scoring path run both (reward: the pool's verifier on the real environment's shadow replay).

:func:`simulated_environments` resolves the entries (env ids or fnmatch patterns) against the environments of the
training split of the pools, refusing an entry that matches none (a typo) and an env id two pools share; with
explicit ``envace.data.train_task_ids`` only the matched environments that have training rows are simulated. :func:`build_worldbooks`
(``worldbook: auto``) records the gold replays of each simulated environment's train-split tasks
(:func:`envace.data.traces.record_pool`) and builds one book per environment model-free (deterministic: the same
traces and code give the same books), cached under ``worldbooks/<digest>`` of the folder the caller names
(:func:`envace.train.generated_dir`: ``$ENVACE_CACHE``, or a multi-node run's directory) where the digest covers
the traces and trace2env's source, and published by one rename, so concurrent or interrupted builds never leave a
half-built folder under the final name. One book per environment of one pool: trace2env refuses traces of several
pools in one book, so traces are grouped by (pool, environment). :func:`check_coverage` checks a given
folder: every simulated environment has a book, built from its own pool's traces.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["WorldbookSelectionError", "build_worldbooks", "check_coverage", "simulated_environments",
           "training_environments"]


class WorldbookSelectionError(ValueError):
    """``simulated_envs`` or the books do not fit the training data; the message is one line naming the entry."""


def training_environments(pools: Sequence[str], pool_kwargs: Mapping[str, Mapping[str, Any]], split: str,
                          task_ids: Sequence[str] | None = None) -> dict[str, tuple[str, list[str]]]:
    """``{env_id: (pool, [task ids])}`` of the tasks of ``split`` in ``pools`` (``task_ids``: only those, e.g.
    the explicit ``train_task_ids``)."""
    from envace.envs.base import get_pool

    keep = set(task_ids) if task_ids is not None else None
    out: dict[str, tuple[str, list[str]]] = {}
    for name in dict.fromkeys(pools):
        pool = get_pool(name, **dict(pool_kwargs.get(name, {}) or {}))
        for tid in pool.task_ids(split):
            if keep is not None and tid not in keep:
                continue
            env = pool.task(tid).env_id
            have = out.setdefault(env, (name, []))
            if have[0] != name:
                raise WorldbookSelectionError(f"environment {env!r} is in pools {have[0]!r} and {name!r}; "
                                              "envace.agent.simulated_envs cannot tell them apart")
            have[1].append(tid)
    return out


def simulated_environments(entries: Sequence[str], envs: Mapping[str, Any]) -> list[str]:
    """The environments of ``envs`` that ``entries`` (env ids or fnmatch patterns) select, sorted; an entry that
    selects none is an error naming it (a typo must not silently train everything in the real environment)."""
    chosen: set[str] = set()
    for entry in entries:
        hit = [e for e in envs if fnmatch.fnmatchcase(e, entry)]
        if not hit:
            have = sorted(envs)
            raise WorldbookSelectionError(
                f"envace.agent.simulated_envs: {entry!r} matches no training environment (they are {len(have)}: "
                f"{', '.join(have[:6])}{' ...' if len(have) > 6 else ''})")
        chosen.update(hit)
    return sorted(chosen)


def check_coverage(path: str | Path, envs: Sequence[str], pools: Mapping[str, str]) -> None:
    """Every environment of ``envs`` has a book under ``path`` (a folder of books, or one book for one
    environment), built from traces of its own pool (``pools[env]``)."""
    from trace2env import load_worldbooks

    _, books = load_worldbooks(path)
    missing = [e for e in envs if e not in books]
    if missing:
        raise WorldbookSelectionError(
            f"envace.agent.worldbook={path}: no book for simulated environment(s) {', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''} (it has {len(books)}: {', '.join(sorted(books)[:5])}); "
            "build them with scripts/build_worldbook.sh or set envace.agent.worldbook=auto")
    for env in envs:
        built = books[env].manifest.source_pool
        if built is not None and built != pools[env]:
            raise WorldbookSelectionError(f"envace.agent.worldbook={path}: the book of {env!r} was built from "
                                          f"traces of pool {built!r}, not of {pools[env]!r}")


def _safe(env_id: str) -> str:
    return "".join(c if c.isalnum() or c in "-_.+" else "_" for c in env_id)


def _code_digest() -> str:
    """sha256 of the code that turns traces into books (trace2env) and records them (:mod:`envace.data.traces`,
    :mod:`envace.envs.gold_trace`)."""
    import trace2env
    from envace.envs import gold_trace

    h = hashlib.sha256()
    files = sorted(Path(trace2env.__file__).parent.glob("*.py")) + [Path(__file__).with_name("traces.py"),
                                                                      Path(gold_trace.__file__)]
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def build_worldbooks(envs: Sequence[str], pools: Mapping[str, str],
                     pool_kwargs: Mapping[str, Mapping[str, Any]], cache: str | Path, split: str = "train") -> Path:
    """One book per environment of ``envs`` from gold replays of its ``split`` tasks; returns the folder of books.

    Model-free and deterministic; reused when ``cache/worldbooks/<digest>`` exists (the digest covers every
    recorded trace and the code that builds the books)."""
    from envace.data.traces import record_pool
    from envace.envs.base import get_pool
    from trace2env import parse_trace
    from trace2env.build import build_worldbook

    traces: dict[str, list[dict[str, Any]]] = {}
    for env in envs:
        name = pools[env]
        pool = get_pool(name, **dict(pool_kwargs.get(name, {}) or {}))
        ids = [t for t in pool.task_ids(split) if pool.task(t).env_id == env]
        traces[env] = record_pool(pool, ids)
        if not traces[env]:
            raise WorldbookSelectionError(f"envace.agent.simulated_envs: environment {env!r} of pool {name!r} has "
                                          f"no recorded {split}-split trace to build its worldbook from")
    h = hashlib.sha256(_code_digest().encode())
    for env in sorted(traces):
        h.update(json.dumps([env, pools[env], traces[env]], sort_keys=True, ensure_ascii=True).encode())
    root = Path(cache) / "worldbooks" / h.hexdigest()[:16]
    books = root / "books"
    if books.is_dir():
        return books
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".books.partial.", dir=root))
    try:
        for env in sorted(traces):
            build_worldbook([parse_trace(t) for t in traces[env]], tmp / _safe(env), environment_id=env)
        (root / "traces.jsonl").write_text("".join(json.dumps(t, ensure_ascii=False) + "\n"
                                                   for env in sorted(traces) for t in traces[env]), encoding="utf-8")
        try:
            os.rename(tmp, books)
        except OSError:  # another process published the same build first: its books are these books
            if not books.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return books
