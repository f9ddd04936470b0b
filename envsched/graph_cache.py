"""On-disk cache of the static graph (EnvSched §2.2, Eq. 1): a restart with the same pool and config loads the
graph instead of rebuilding it. The key covers the pool's content, the graph's config fields, scikit-learn's version
and the source of the modules that build the graph (:mod:`envsched.graph`, ``operations``, ``tfidf``)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp

from .config import EnvSchedConfig
from .graph import DescribedTasks, StaticGraph, build_static_graph, env_members
from .operations import (
    DeterministicExtractor,
    OperationDescription,
)
from .pool import TaskPool
from .tfidf import DiskCSR, DiskCSRWriter

log = logging.getLogger(__name__)


GRAPH_CACHE_VERSION = 2  # 2: x_full as memory-mappable .npy files, derived descriptions not stored
# config fields the static graph depends on (Eq. 1 views and the operation extractor of App. E)
_GRAPH_FIELDS = ("view_weights", "tfidf_min_df", "tfidf_max_features", "tfidf_sublinear_tf", "tfidf_float32", "operation_extractor")
# LLM settings that can change the extracted descriptions (not the transport: concurrency, time-out, retries, key, cache)
_LLM_FIELDS = ("base_urls", "model", "temperature", "top_p", "max_tokens", "seed", "extra_body", "repair_rounds", "on_invalid")
_ARRAYS = "graph.npz"
_META = "graph.json"
_DESCRIPTIONS = "descriptions.jsonl"


def graph_cache_key(pool: TaskPool, cfg: EnvSchedConfig) -> str:
    """SHA-256 of everything the static graph is a function of: the pool's content (``TaskPool.content_hash``),
    the graph's config fields, the scikit-learn version (TF-IDF) and the source of :mod:`envsched.graph`, this
    module, ``operations`` and ``tfidf`` (so a code change never reuses a stale graph)."""
    import sklearn

    from . import graph, operations, tfidf

    settings = {k: getattr(cfg, k) for k in _GRAPH_FIELDS}
    if cfg.operation_extractor == "llm":
        settings["llm"] = {k: getattr(cfg.llm, k) for k in _LLM_FIELDS}
    code = hashlib.sha256()
    for mod_file in (graph.__file__, __file__, operations.__file__, tfidf.__file__):
        code.update(Path(mod_file).read_bytes())
    payload = {
        "version": GRAPH_CACHE_VERSION,
        "pool": pool.content_hash(),
        "config": settings,
        "sklearn": sklearn.__version__,
        "code": code.hexdigest(),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=list).encode()).hexdigest()


class _DescriptionFile(Sequence):
    """The operation descriptions of a cached graph, read from disk on first access (they are kept for
    inspection only; scheduling never reads them)."""

    def __init__(self, path: Path, n: int):
        self.path, self.n = path, n
        self._items: list[OperationDescription] | None = None

    def _load(self) -> list[OperationDescription]:
        if self._items is None:
            with self.path.open(encoding="utf-8") as fh:
                self._items = [OperationDescription.model_validate_json(line) for line in fh if line.strip()]
        return self._items

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: Any) -> Any:
        return self._load()[i]


def _save_csr(prefix: str, x: sp.csr_matrix, out: dict[str, np.ndarray]) -> None:
    out[f"{prefix}_data"], out[f"{prefix}_indices"], out[f"{prefix}_indptr"] = x.data, x.indices, x.indptr
    out[f"{prefix}_shape"] = np.asarray(x.shape, dtype=np.int64)


def _load_csr(prefix: str, z: Any) -> sp.csr_matrix:
    return sp.csr_matrix((z[f"{prefix}_data"], z[f"{prefix}_indices"], z[f"{prefix}_indptr"]), shape=tuple(int(s) for s in z[f"{prefix}_shape"]))


def save_graph(graph: StaticGraph, folder: Path, key: str, *, built_in: Path | None = None) -> None:
    """Write ``graph`` to ``folder/key`` atomically (a temporary folder renamed into place).

    ``built_in``: the temporary folder under ``folder`` that ``build_static_graph(store=...)`` wrote x_full's
    files to (they are kept, not copied); otherwise x_full is written from ``graph``."""
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / key
    tmp = built_in if built_in is not None else Path(tempfile.mkdtemp(prefix=f".{key[:16]}-", dir=folder))
    try:
        if built_in is None:
            x = graph.x_full
            writer = DiskCSRWriter(tmp, "x_full", x.shape[0], x.shape[1], x.nnz, x.dtype)
            writer.append(x)
            writer.finish()
        arrays: dict[str, np.ndarray] = {"env": graph.env, "rep_score": graph.mean_within_env_similarity()}
        _save_csr("x_abs", graph.x_abs, arrays)
        np.savez(tmp / _ARRAYS, **arrays)
        if not isinstance(graph.descriptions, DescribedTasks):  # derived descriptions are derived again on load
            with (tmp / _DESCRIPTIONS).open("w", encoding="utf-8") as fh:
                fh.writelines(d.model_dump_json() + "\n" for d in graph.descriptions)
        meta = {
            "key": key, "n": graph.n, "extractor_counts": graph.extractor_counts, "fallback_reasons": graph.fallback_reasons,
            "build_seconds": graph.build_seconds, "view_shapes": {k: list(v) for k, v in graph.view_shapes.items()},
            "abstraction": graph.abstraction,
        }
        (tmp / _META).write_text(json.dumps(meta))
        try:
            os.replace(tmp, final)
        except OSError:  # another process stored the same entry first
            if not (final / _META).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def load_graph(folder: Path, key: str, pool: TaskPool) -> StaticGraph | None:
    """The cached graph ``folder/key`` for ``pool``, or None when absent or unreadable (then rebuilt).

    x_full is memory-mapped from the entry's files (read on demand), the rest is read into memory."""
    entry = folder / key
    if not (entry / _META).is_file():
        return None
    try:
        meta = json.loads((entry / _META).read_text())
        if meta.get("key") != key or meta.get("n") != len(pool):
            return None
        with np.load(entry / _ARRAYS, allow_pickle=False) as z:
            x_abs = _load_csr("x_abs", z)
            rep_score, env = np.array(z["rep_score"]), np.array(z["env"])
        disk = DiskCSR(entry, "x_full")
        if disk.shape[0] != len(pool):
            return None
    except (OSError, ValueError, KeyError) as exc:
        log.warning("envsched: graph cache entry %s unreadable (%s); rebuilding it", entry, exc)
        shutil.rmtree(entry, ignore_errors=True)
        return None
    if not np.array_equal(env, pool.env):
        return None
    if (entry / _DESCRIPTIONS).is_file():
        descriptions: Sequence[OperationDescription] = _DescriptionFile(entry / _DESCRIPTIONS, len(pool))
    else:
        descriptions = DescribedTasks(pool.tasks, DeterministicExtractor())
    graph = StaticGraph(
        x_full=disk.matrix, x_abs=x_abs, env=pool.env, env_members=env_members(pool), descriptions=descriptions,  # type: ignore[arg-type]
        extractor_counts=dict(meta["extractor_counts"]), fallback_reasons=dict(meta["fallback_reasons"]),
        build_seconds=float(meta["build_seconds"]), view_shapes={k: tuple(v) for k, v in meta["view_shapes"].items()}, cache="hit",
        abstraction=dict(meta.get("abstraction", {})), disk=disk,
    )
    graph._rep_score = rep_score
    return graph


def load_or_build_graph(pool: TaskPool, cfg: EnvSchedConfig, *, extractor: Any = None) -> StaticGraph:
    """``build_static_graph``, through the on-disk cache of ``cfg.graph_cache_dir`` when it is set.

    The cache is used only when the graph is a function of (pool, config): with the config's own extractor
    (or a plain ``DeterministicExtractor``), and for the LLM extractor only when no task fell back to the
    deterministic one (a later run may get valid answers for them).  A miss builds x_full's files straight
    into the new entry's folder.
    """
    if cfg.graph_cache_dir is None:
        return build_static_graph(pool, cfg, extractor=extractor)
    if extractor is not None and type(extractor) is not DeterministicExtractor:
        graph = build_static_graph(pool, cfg, extractor=extractor)
        graph.cache = "skip"
        return graph
    if extractor is not None and cfg.operation_extractor != "deterministic":
        cfg = cfg.replace(operation_extractor="deterministic")
    t0 = time.perf_counter()
    folder = Path(cfg.graph_cache_dir).expanduser()
    key = graph_cache_key(pool, cfg)
    graph = load_graph(folder, key, pool)
    if graph is not None:
        log.info("envsched: static graph loaded from cache %s in %.2fs", folder / key, time.perf_counter() - t0)
        return graph
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp: Path | None = Path(tempfile.mkdtemp(prefix=f".{key[:16]}-", dir=folder))
    except OSError as exc:
        log.warning("envsched: could not use the graph cache folder %s (%s)", folder, exc)
        tmp = None
    try:
        graph = build_static_graph(pool, cfg, extractor=extractor, store=tmp)
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if tmp is None:
        graph.cache = "skip"
        return graph
    if graph.fallback_reasons:
        shutil.rmtree(tmp, ignore_errors=True)  # the mapping stays valid
        graph.cache = "skip"
        return graph
    try:
        save_graph(graph, folder, key, built_in=tmp)
        graph.cache = "miss"
    except OSError as exc:
        log.warning("envsched: could not store the static graph in %s (%s)", folder, exc)
        graph.cache = "skip"
    return graph
