"""Static dual-relation graph (EnvSched §2.2, Eq. 1, Appendix D) and sparse neighbour search.

Six concrete TF-IDF views h^(a) (scikit-learn ``TfidfVectorizer``, min_df 1, 35,000-feature cap, sublinear tf,
L2-normalised rows) and one abstract view g (TF-IDF of the App. E abstraction).  Because every view is
L2-normalised, ``cos(h_i, h_j) = h_i . h_j`` and EnvSched Eq. 1 becomes one sparse dot product:

    S_full_ij = sum_a alpha_a cos(h_i^(a), h_j^(a)) = x_i . x_j,   x_i = [sqrt(alpha_a) h_i^(a)]_a
    S_abs_ij  = g_i . g_j

No N x N matrix is ever formed: similarities are computed for the rows and columns that are needed
(new observed nodes, batch members, environment members).  ``NeighborIndex`` keeps, for each node, the
K_within / K_cross most similar *observed* nodes in fixed-capacity arrays and merges newly observed nodes in
O(N * (K + Delta)) per step (the incremental scheme of §3.3.2).
"""

from __future__ import annotations

import ast
import hashlib
import io
import json
import logging
import os
import re
import shutil
import tempfile
import time
import tokenize
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp

from .config import EnvSchedConfig
from .operations import (
    DeterministicExtractor,
    Extraction,
    LLMExtractor,
    OperationDescription,
    abstract_text,
    concrete_text,
    extract_all,
)
from .pool import Task, TaskPool
from .tfidf import CHUNK_ROWS, DiskCSR, DiskCSRWriter, tfidf_chunks

log = logging.getLogger(__name__)

VIEW_NAMES = ("instruction_words", "instruction_chars", "verifier_checks", "verifier_code", "initial_context", "operations")


def code_structure(code: str) -> str:
    """Structural tokens of verifier code (view 4): AST node types, called names, attributes, operators.

    Python is parsed with ``ast``; anything else falls back to the token stream with literals replaced by
    type placeholders.
    """
    if not code.strip():
        return ""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return " ".join(_fallback_code_tokens(code))
    toks: list[str] = []
    for node in ast.walk(tree):
        toks.append(type(node).__name__)
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name:
                toks.append(f"call:{name}")
        elif isinstance(node, ast.Attribute):
            toks.append(f"attr:{node.attr}")
        elif isinstance(node, ast.Name):
            toks.append(f"name:{node.id}")
        elif isinstance(node, ast.Compare):
            toks.extend(f"cmp:{type(op).__name__}" for op in node.ops)
        elif isinstance(node, ast.Constant):
            toks.append(f"const:{type(node.value).__name__}")
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
            toks.append(f"key:{node.slice.value}")
    return " ".join(toks)


def _fallback_code_tokens(code: str) -> list[str]:
    out = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(code).readline):
            if tok.type == tokenize.NAME:
                out.append(tok.string)
            elif tok.type == tokenize.OP:
                out.append(f"op:{tok.string}")
            elif tok.type == tokenize.NUMBER:
                out.append("const:num")
            elif tok.type == tokenize.STRING:
                out.append("const:str")
    except (tokenize.TokenError, IndentationError, SyntaxError):
        out = re.findall(r"[A-Za-z_]\w*|[=!<>]=|[<>]", code)
    return out


def _tfidf_kwargs(cfg: EnvSchedConfig, **kw: Any) -> dict[str, Any]:
    dtype = np.float32 if cfg.tfidf_float32 else np.float64
    return {"min_df": cfg.tfidf_min_df, "max_features": cfg.tfidf_max_features, "sublinear_tf": cfg.tfidf_sublinear_tf, "dtype": dtype, **kw}


def _tfidf_row_chunks(texts: Sequence[str], cfg: EnvSchedConfig, chunk_rows: int = CHUNK_ROWS, **kw: Any) -> list[sp.csr_matrix] | Any:
    """One view's TF-IDF encoder (App. D settings) in row chunks: ``TfidfVectorizer.fit_transform`` of all texts
    (``tfidf.tfidf_chunks``); rows are L2-normalised, empty rows stay zero.  A view without any term is one
    zero column."""
    args = _tfidf_kwargs(cfg, **kw)
    n = len(texts)
    empty = [sp.csr_matrix((min(chunk_rows, n - a), 1), dtype=args["dtype"]) for a in range(0, n, chunk_rows)]
    if not any(t.strip() for t in texts):
        return empty
    gen = tfidf_chunks(texts, chunk_rows=chunk_rows, **args)
    try:
        first = next(gen)
    except ValueError:  # e.g. only stop-word-like tokens
        return empty
    return _chain(first, gen)


def _chain(first: sp.csr_matrix, rest: Any) -> Any:
    yield first
    yield from rest


def _tfidf(texts: Sequence[str], cfg: EnvSchedConfig, **kw: Any) -> sp.csr_matrix:
    """The whole view as one matrix (``_tfidf_row_chunks`` stacked)."""
    return sp.vstack(list(_tfidf_row_chunks(texts, cfg, **kw)), format="csr")


@dataclass
class StaticGraph:
    """Fixed representations of the pool: S_full via ``x_full`` and S_abs via ``x_abs`` (Eq. 1)."""

    x_full: sp.csr_matrix
    x_abs: sp.csr_matrix
    env: np.ndarray
    env_members: list[np.ndarray]
    descriptions: list[OperationDescription]
    extractor_counts: dict[str, int]
    fallback_reasons: dict[str, str] = field(default_factory=dict)
    build_seconds: float = 0.0
    view_shapes: dict[str, tuple[int, int]] = field(default_factory=dict)
    abstraction: dict[str, float] = field(default_factory=dict)  # abstraction_report (resolution of S_abs)
    cache: str = "off"  # graph cache: "off" (no graph_cache_dir), "miss" (built and stored), "hit" (loaded), "skip"
    disk: DiskCSR | None = field(default=None, repr=False)  # x_full memory-mapped from disk (built graphs)
    _rep_score: np.ndarray | None = field(default=None, repr=False)
    _fmap: np.ndarray | None = field(default=None, repr=False)
    _block_values: np.ndarray | None = field(default=None, repr=False)
    _abs_groups: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False)

    @property
    def n(self) -> int:
        return self.x_full.shape[0]

    def report(self) -> dict[str, Any]:
        """Which extractor produced the operation descriptions, view sizes, build time."""
        return {
            "extractors": dict(self.extractor_counts),
            "fallbacks": len(self.fallback_reasons),
            "views": {k: list(v) for k, v in self.view_shapes.items()},
            "abstract_features": int(self.x_abs.shape[1]),
            "nnz_full": int(self.x_full.nnz),
            "build_seconds": self.build_seconds,
            "abstraction": dict(self.abstraction),
            "cache": self.cache,
        }

    # ---- similarities (Eq. 1), never N x N ------------------------------------------------------
    def sim_full(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """Dense |rows| x |cols| block of S_full (Eq. 1), computed from the sparse rows."""
        return sparse_row_block_dot(self.x_full, np.asarray(rows, dtype=np.int64), np.asarray(cols, dtype=np.int64))

    def sim_abs(self, rows: np.ndarray | None, cols: np.ndarray) -> np.ndarray:
        """Dense |rows| x |cols| block of S_abs (rows=None: all nodes)."""
        left = self.x_abs if rows is None else self.x_abs[rows]
        right = self.x_abs[cols].T.toarray()
        return np.asarray(left @ right, dtype=np.float64)

    def sim_abs32(self, cols: np.ndarray) -> np.ndarray:
        """N x |cols| block of S_abs in the dtype of the abstract view (float32 by default); equals
        ``sim_abs(None, cols)`` before its cast to float64."""
        return np.asarray(self.x_abs @ self.x_abs[cols].T.toarray())

    def abs_groups(self) -> tuple[np.ndarray, np.ndarray]:
        """(first node of each distinct row of x_abs, group of every node): nodes whose abstract view rows are
        identical (same stored indices and values in the same order) have bit-identical S_abs products."""
        if self._abs_groups is None:
            x = self.x_abs
            first: dict[bytes, int] = {}
            group = np.empty(self.n, dtype=np.int64)
            ind, dat, ptr = x.indices, x.data, x.indptr
            for i in range(self.n):
                a, b = ptr[i], ptr[i + 1]
                group[i] = first.setdefault(ind[a:b].tobytes() + dat[a:b].tobytes(), len(first))
            reps = np.zeros(len(first), dtype=np.int64)
            reps[group[::-1]] = np.arange(self.n)[::-1]  # the lowest node of each group
            self._abs_groups = (reps, group)
        return self._abs_groups

    def release_pages(self) -> None:
        """Drop the pages of the memory-mapped x_full read so far from the resident set (a no-op in memory)."""
        if self.disk is not None:
            self.disk.release()

    def mean_within_env_similarity(self) -> np.ndarray:
        """mean_{j in env(i), j != i} S_full_ij for every i (static; computed once, then cached)."""
        if self._rep_score is None:
            out = np.zeros(self.n)
            rows_read = 0
            for members in self.env_members:
                if len(members) < 2:
                    continue
                rows_read += len(members)
                if rows_read >= CHUNK_ROWS:  # a memory-mapped x_full is read once: keep it out of the resident set
                    self.release_pages()
                    rows_read = 0
                xe = self.x_full[members]
                total = np.asarray(xe.sum(axis=0), dtype=np.float64).ravel()  # environment centroid * n_e
                dots = np.asarray(xe @ total).ravel()
                self_sim = np.asarray(xe.multiply(xe).sum(axis=1)).ravel()
                out[members] = (dots - self_sim) / (len(members) - 1)
            self.release_pages()
            self._rep_score = out
        return self._rep_score

    def feature_block(self, capacity: int) -> FeatureBlock:
        """A FeatureBlock over x_full that reuses this graph's scratch buffers (release with close_block)."""
        return FeatureBlock(self.x_full, self.scratch_map(), capacity, self._block_values)

    def close_block(self, block: FeatureBlock) -> None:
        self._block_values = block.close()

    def scratch_map(self) -> np.ndarray:
        """A reusable feature -> slot map (all -1 between uses) for ``FeatureBlock``."""
        if self._fmap is None:
            self._fmap = np.full(self.x_full.shape[1], -1, dtype=np.int64)
        return self._fmap


class FeatureBlock:
    """Dense copy of a few rows of a sparse matrix, addressable by feature id through a scratch map.

    ``dot(rows)`` returns x[rows] @ block.T for many small calls without scipy conversions: the cost is the
    number of stored entries of ``rows``.  Call ``close()`` to reset the scratch map.
    """

    def __init__(self, x: sp.csr_matrix, fmap: np.ndarray, capacity: int, values: np.ndarray | None = None):
        self.x, self.fmap = x, fmap
        self.used: list[np.ndarray] = []
        self.n_feat = 0
        self.values = values if values is not None and values.shape[1] >= capacity else np.zeros((1024, capacity))
        self.m = 0

    def add(self, j: int) -> None:
        cols = self.x.indices[self.x.indptr[j] : self.x.indptr[j + 1]]
        vals = self.x.data[self.x.indptr[j] : self.x.indptr[j + 1]]
        new = cols[self.fmap[cols] < 0]
        if len(new):
            self.fmap[new] = np.arange(self.n_feat, self.n_feat + len(new))
            self.used.append(new)
            self.n_feat += len(new)
            if self.n_feat > self.values.shape[0]:
                grown = np.zeros((max(2 * self.values.shape[0], self.n_feat), self.values.shape[1]))
                grown[: self.values.shape[0]] = self.values
                self.values = grown
        if self.m >= self.values.shape[1]:
            self.values = np.concatenate([self.values, np.zeros_like(self.values)], axis=1)
        self.values[self.fmap[cols], self.m] = vals
        self.m += 1

    def dot(self, rows: np.ndarray, start: int = 0, stop: int | None = None) -> np.ndarray:
        """x[rows] @ (block columns start..stop).T as a dense |rows| x (stop - start) array."""
        stop = self.m if stop is None else stop
        out = np.zeros((len(rows), stop - start))
        if len(rows) == 0 or stop <= start:
            return out
        rc, rv, own = _gather_rows(self.x, rows)
        slot = self.fmap[rc]
        hit = slot >= 0
        if not hit.any():
            return out
        prod = rv[hit, None].astype(np.float64) * self.values[slot[hit], start:stop]
        owner = own[hit]  # sorted
        starts = np.searchsorted(owner, np.arange(len(rows)))
        counts = np.diff(np.append(starts, len(owner)))
        res = np.add.reduceat(prod, np.minimum(starts, len(owner) - 1), axis=0)
        res[counts == 0] = 0.0
        return res

    def close(self) -> np.ndarray:
        """Reset the scratch map and zero the used values; returns the value buffer for reuse."""
        for u in self.used:
            self.fmap[u] = -1
        self.used = []
        self.values[: self.n_feat, : self.m] = 0.0
        self.n_feat = self.m = 0
        return self.values


def _gather_rows(x: sp.csr_matrix, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(column indices, values, owning row position) of the stored entries of ``rows``, in row order."""
    starts = x.indptr[rows]
    lens = x.indptr[rows + 1] - starts
    total = int(lens.sum())
    offs = np.cumsum(lens) - lens
    pos = np.repeat(starts - offs, lens) + np.arange(total)
    owner = np.repeat(np.arange(len(rows)), lens)
    return x.indices[pos], x.data[pos], owner


def sparse_row_block_dot(x: sp.csr_matrix, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """Dense block (x[rows] @ x[cols].T) without scipy's per-call conversions (small blocks, many calls)."""
    out = np.zeros((len(rows), len(cols)))
    if len(rows) == 0 or len(cols) == 0:
        return out
    cc, cv, cown = _gather_rows(x, cols)
    if len(cc) == 0:
        return out
    feats, inv = np.unique(cc, return_inverse=True)
    dense = np.zeros((len(feats), len(cols)))
    dense[inv, cown] = cv
    rc, rv, rown = _gather_rows(x, rows)
    pos = np.searchsorted(feats, rc)
    pos_c = np.minimum(pos, len(feats) - 1)
    hit = feats[pos_c] == rc
    if not hit.any():
        return out
    prod = rv[hit, None].astype(np.float64) * dense[pos_c[hit]]
    owner = rown[hit]
    uniq, first = np.unique(owner, return_index=True)
    out[uniq] = np.add.reduceat(prod, first, axis=0)
    return out


def view_texts(pool: TaskPool, descriptions: Sequence[OperationDescription]) -> dict[str, list[str]]:
    ops = [concrete_text(d) for d in descriptions]
    return {name: view_text(name, pool.tasks, ops) for name in VIEW_NAMES}


def view_text(name: str, tasks: Sequence[Task], operations: Sequence[str]) -> list[str]:
    """The texts of one of the six concrete views (``operations``: the concrete operation descriptions)."""
    if name in ("instruction_words", "instruction_chars"):
        return [t.instruction for t in tasks]
    if name == "verifier_checks":
        return ["\n".join(t.verifier_checks) for t in tasks]
    if name == "verifier_code":
        return [code_structure(t.verifier_code) for t in tasks]
    if name == "initial_context":
        return [t.initial_state for t in tasks]
    if name == "operations":
        return list(operations)
    raise KeyError(name)


_VIEW_KWARGS: dict[str, dict[str, Any]] = {
    "instruction_words": {"ngram_range": (1, 2)},
    "instruction_chars": {"analyzer": "char_wb", "ngram_range": (3, 5)},
    "verifier_checks": {"ngram_range": (1, 2)},
    "verifier_code": {"token_pattern": r"\S+", "lowercase": False, "ngram_range": (1, 2)},
    "initial_context": {"ngram_range": (1, 2)},
    "operations": {"ngram_range": (1, 2)},
}


class DescribedTasks(Sequence):
    """The operation descriptions of a pool, derived on access from the tasks by a deterministic extractor
    (a million descriptions would take gigabytes; scheduling never reads them)."""

    def __init__(self, tasks: Sequence[Task], extractor: Any):
        self.tasks, self.extractor = tasks, extractor

    def __len__(self) -> int:
        return len(self.tasks)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self.extractor.describe(t) for t in self.tasks[i]]
        return self.extractor.describe(self.tasks[i])


def _env_members(pool: TaskPool) -> list[np.ndarray]:
    """Node indices of each environment, ascending."""
    order = np.argsort(pool.env, kind="stable")
    bounds = np.searchsorted(pool.env[order], np.arange(pool.n_envs + 1))
    return [order[bounds[e] : bounds[e + 1]] for e in range(pool.n_envs)]


def abstraction_report(pool: TaskPool, abstract: Sequence[str], members: Sequence[np.ndarray], min_fraction: float) -> dict[str, float]:
    """How much the App. E abstraction distinguishes the tasks of each environment (S_abs of Eq. 1).

    Without gold call sequences the deterministic extractor describes a task from the tool schemas its
    instruction / verifier name (else all of its environment's tools), which can collapse an environment's
    tasks onto a handful of descriptions; cross-environment neighbours are then chosen among near-ties.
    Logs a warning (with the figures and the remedies) when tasks lack gold calls and the median share of
    distinct abstract descriptions per environment is below ``min_fraction``
    (config ``abstraction_min_distinct_fraction``).
    """
    distinct = np.array([len({abstract[i] for i in m}) / len(m) for m in members if len(m)])
    no_gold = sum(1 for t in pool.tasks if not t.gold_actions)
    out = {
        "tasks_without_gold_actions": float(no_gold),
        "distinct_abstract_fraction_median": float(np.median(distinct)) if len(distinct) else 1.0,
        "distinct_abstract_per_env_median": float(np.median([len({abstract[i] for i in m}) for m in members if len(m)])) if len(distinct) else 0.0,
    }
    out["low_resolution"] = float(no_gold > 0 and out["distinct_abstract_fraction_median"] < min_fraction)
    if out["low_resolution"]:
        log.warning(
            "envsched: %d of %d tasks have no gold_actions, and the operation abstraction (App. E) gives a median of "
            "%.0f distinct descriptions per environment (%.0f%% of its tasks, below abstraction_min_distinct_fraction="
            "%.2f): those tasks are described from the tool schemas their instruction / verifier name, so "
            "cross-environment (S_abs) neighbours are coarse.  Add gold_actions to the pool or use "
            "operation_extractor: llm.",
            no_gold, len(pool), out["distinct_abstract_per_env_median"], 100 * out["distinct_abstract_fraction_median"], min_fraction,
        )
    return out


def make_extractor(cfg: EnvSchedConfig, client: Any = None) -> Any:
    if cfg.operation_extractor == "llm":
        return LLMExtractor.from_config(cfg.llm, client=client)
    return DeterministicExtractor()


def build_static_graph(
    pool: TaskPool,
    cfg: EnvSchedConfig,
    *,
    extractor: Any = None,
    extractions: Sequence[Extraction] | None = None,
    store: Path | None = None,
    chunk_rows: int = CHUNK_ROWS,
) -> StaticGraph:
    """Build the six concrete views and the abstract view (EnvSched Eq. 1, App. D–E).

    Memory stays bounded by one chunk of ``chunk_rows`` tasks plus one view's texts: operation descriptions are
    extracted chunk by chunk and only their texts kept (a deterministic extractor's descriptions are derived
    again on access, ``DescribedTasks``); each view's TF-IDF is computed in row chunks (``tfidf.tfidf_chunks``,
    equal to ``TfidfVectorizer.fit_transform``) and spilled to disk; x_full is written row chunk by row chunk
    to ``store`` (default: a temporary folder, removed once the files are mapped) and memory-mapped.  x_abs
    (about 25 entries a row) stays in memory: every step multiplies all of it (``NeighborIndex._add_cross``).
    """
    t0 = time.perf_counter()
    n = len(pool)
    if extractions is not None and len(extractions) != n:
        raise ValueError(f"{len(extractions)} extractions for {n} tasks")
    if extractions is None:
        extractor = extractor if extractor is not None else make_extractor(cfg)
    derive = extractions is None and type(extractor) is DeterministicExtractor
    counts: Counter[str] = Counter()
    fallbacks: dict[str, str] = {}
    kept: list[OperationDescription] = []
    ops_texts: list[str] = []
    abstract: list[str] = []
    for a in range(0, n, chunk_rows):
        part = extractions[a : a + chunk_rows] if extractions is not None else extract_all(pool.tasks[a : a + chunk_rows], extractor)
        for k, e in enumerate(part):
            counts[e.extractor] += 1
            if e.reason:
                fallbacks[pool.task_ids[a + k]] = e.reason
            ops_texts.append(concrete_text(e.description))
            abstract.append(abstract_text(e.description))
            if not derive:
                kept.append(e.description)
    descriptions: Sequence[OperationDescription] = DescribedTasks(pool.tasks, extractor) if derive else kept
    log.info("envsched: operation descriptions by extractor: %s", dict(counts))
    members = _env_members(pool)
    abstraction = abstraction_report(pool, abstract, members, cfg.abstraction_min_distinct_fraction)
    x_abs = _tfidf(abstract, cfg, token_pattern=r"\S+", lowercase=False)
    del abstract

    own = store is None
    folder = Path(tempfile.mkdtemp(prefix="envsched-graph-")) if own else Path(store)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        shapes: dict[str, tuple[int, int]] = {}
        chunk_nnz = np.zeros(-(-n // chunk_rows), dtype=np.int64)
        # the operations view first, so that its texts (one new string a task) are freed before the others
        order = sorted(range(len(VIEW_NAMES)), key=lambda v: VIEW_NAMES[v] != "operations")
        for v in order:
            name, weight = VIEW_NAMES[v], cfg.view_weights[v]
            texts = view_text(name, pool.tasks, ops_texts)
            if name == "operations":
                ops_texts = []
            width = 0
            for c, h in enumerate(_tfidf_row_chunks(texts, cfg, chunk_rows, **_VIEW_KWARGS[name])):
                h = sp.csr_matrix(h * np.sqrt(weight))  # x_i = [sqrt(alpha_a) h_i^(a)]_a
                width = h.shape[1]
                chunk_nnz[c] += h.nnz
                np.save(folder / f"view{v}_c{c}_data.npy", h.data)
                np.save(folder / f"view{v}_c{c}_indices.npy", h.indices)
                np.save(folder / f"view{v}_c{c}_indptr.npy", h.indptr)
            shapes[name] = (n, width)
            del texts
        shapes = {name: shapes[name] for name in VIEW_NAMES}
        writer = DiskCSRWriter(folder, "x_full", n, sum(w for _, w in shapes.values()), int(chunk_nnz.sum()), np.float64)
        for c in range(len(chunk_nnz)):
            blocks = []
            for v, name in enumerate(VIEW_NAMES):
                parts = [np.load(folder / f"view{v}_c{c}_{p}.npy") for p in ("data", "indices", "indptr")]
                blocks.append(sp.csr_matrix(tuple(parts), shape=(len(parts[2]) - 1, shapes[name][1])))
                for p in ("data", "indices", "indptr"):
                    (folder / f"view{v}_c{c}_{p}.npy").unlink()
            writer.append(sp.hstack(blocks, format="csr"))
        writer.finish()
        disk = DiskCSR(folder, "x_full")
    finally:
        if own:
            shutil.rmtree(folder, ignore_errors=True)  # the mappings stay valid
    graph = StaticGraph(
        x_full=disk.matrix, x_abs=x_abs.tocsr(), env=pool.env, env_members=members, descriptions=descriptions,  # type: ignore[arg-type]
        extractor_counts=dict(counts), fallback_reasons=fallbacks, build_seconds=time.perf_counter() - t0,
        view_shapes=shapes, abstraction=abstraction, disk=disk,
    )
    graph.mean_within_env_similarity()  # cold-start representatives use static structure only
    graph.build_seconds = time.perf_counter() - t0
    return graph


# ---------------------------------------------------------------------------------------------------
# On-disk cache of the static graph (a restart with the same pool and config does not rebuild)
# ---------------------------------------------------------------------------------------------------

GRAPH_CACHE_VERSION = 2  # 2: x_full as memory-mappable .npy files, derived descriptions not stored
# config fields the static graph depends on (Eq. 1 views and the operation extractor of App. E)
_GRAPH_FIELDS = ("view_weights", "tfidf_min_df", "tfidf_max_features", "tfidf_sublinear_tf", "tfidf_float32", "operation_extractor")
# LLM settings that can change the extracted descriptions (not the transport: workers, timeout, key, cache)
_LLM_FIELDS = ("base_url", "model", "temperature", "max_retries", "on_invalid")
_ARRAYS = "graph.npz"
_META = "graph.json"
_DESCRIPTIONS = "descriptions.jsonl"


def graph_cache_key(pool: TaskPool, cfg: EnvSchedConfig) -> str:
    """SHA-256 of everything the static graph is a function of: the pool's content (``TaskPool.content_hash``),
    the graph's config fields, the scikit-learn version (TF-IDF) and the source of this module, ``operations``
    and ``tfidf`` (so a code change never reuses a stale graph)."""
    import sklearn

    from . import operations, tfidf

    settings = {k: getattr(cfg, k) for k in _GRAPH_FIELDS}
    if cfg.operation_extractor == "llm":
        settings["llm"] = {k: getattr(cfg.llm, k) for k in _LLM_FIELDS}
    code = hashlib.sha256()
    for mod_file in (__file__, operations.__file__, tfidf.__file__):
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
        x_full=disk.matrix, x_abs=x_abs, env=pool.env, env_members=_env_members(pool), descriptions=descriptions,  # type: ignore[arg-type]
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


# ---------------------------------------------------------------------------------------------------
# Observed-neighbour sets N_t^in(i), N_t^cross(i) (§2.2)
# ---------------------------------------------------------------------------------------------------

_IDX_BITS = 23  # node indices < 2^23 (8.4 M tasks)
_SIM_SCALE = float(2**30)
_SIM_RES = 1.0 / _SIM_SCALE
_ENV_BLOCK_BYTES = 256 * 2**20  # cache every environment's S_full block when all of them fit in this
_CROSS_BLOCK = 1 << 16  # rows per block of the N x Delta cross-environment update (bounded memory)


def merge_topk(idx: np.ndarray, sim: np.ndarray, cand_idx: np.ndarray, cand_sim: np.ndarray, k: int, min_sim: float) -> tuple[np.ndarray, np.ndarray]:
    """Row-wise top-k of the union of existing and candidate neighbours.

    Total order: similarity (quantised to 2^-30) descending, then node index ascending, so the result does
    not depend on the order in which nodes became observed.  Entries with sim <= min_sim are dropped
    (index -1, similarity -inf).
    """
    all_idx = np.concatenate([idx, cand_idx], axis=1)
    all_sim = np.concatenate([sim, cand_sim], axis=1)
    valid = (all_idx >= 0) & (all_sim > min_sim)
    q = np.where(valid, np.floor(np.clip(all_sim, 0.0, 1.0) * _SIM_SCALE), -1.0).astype(np.int64)
    key = q * (1 << _IDX_BITS) + ((1 << _IDX_BITS) - 1 - np.maximum(all_idx, 0))
    if all_idx.shape[1] > k:
        part = np.argpartition(-key, k - 1, axis=1)[:, :k]
    else:
        part = np.broadcast_to(np.arange(all_idx.shape[1]), all_idx.shape).copy()
    pkey = np.take_along_axis(key, part, 1)
    order = np.argsort(-pkey, axis=1, kind="stable")
    part = np.take_along_axis(part, order, 1)
    out_idx = np.take_along_axis(all_idx, part, 1)
    out_sim = np.take_along_axis(all_sim, part, 1)
    ok = np.take_along_axis(valid, part, 1)
    out_idx = np.where(ok, out_idx, -1)
    out_sim = np.where(ok, out_sim, -np.inf)
    if out_idx.shape[1] < k:  # pad
        pad = k - out_idx.shape[1]
        out_idx = np.pad(out_idx, ((0, 0), (0, pad)), constant_values=-1)
        out_sim = np.pad(out_sim, ((0, 0), (0, pad)), constant_values=-np.inf)
    return out_idx, out_sim


class NeighborIndex:
    """Fixed-capacity arrays of the K most similar observed neighbours of every node, per relation."""

    def __init__(self, graph: StaticGraph, k_within: int, k_cross: int, min_sim: float = 0.0):
        n = graph.n
        self.graph, self.min_sim = graph, min_sim
        self.k = {"in": k_within, "cross": k_cross}
        self.idx = {r: np.full((n, k), -1, dtype=np.int64) for r, k in self.k.items()}
        self.sim = {r: np.full((n, k), -np.inf) for r, k in self.k.items()}
        self.observed = np.zeros(n, dtype=bool)
        self.kernel_cache: dict[str, Any] = {}  # Eq. 7 kernels of the last prediction (estimate.predict_all)
        # within-environment S_full: every entry is the same value whichever nodes are observed together
        # (see ``within_sim``)
        x = graph.x_full
        self._x64 = x if x.dtype == np.float64 else x.astype(np.float64)
        self._pos = np.zeros(n, dtype=np.int64)  # position of each node in its environment's member list
        block_bytes = 8 * sum(len(m) ** 2 for m in graph.env_members)
        self._env_sim: dict[int, np.ndarray] | None = {} if block_bytes <= _ENV_BLOCK_BYTES else None
        for members in graph.env_members:
            self._pos[members] = np.arange(len(members))

    def add_observed(self, nodes: np.ndarray) -> None:
        """Merge nodes that became observed this step into every target's neighbour arrays."""
        nodes = np.unique(np.asarray(nodes, dtype=np.int64))
        nodes = nodes[~self.observed[nodes]]
        if len(nodes) == 0:
            return
        self.observed[nodes] = True
        g, env = self.graph, self.graph.env
        # within-environment relation: S_full, only rows of the new nodes' environments
        if self.k["in"] > 0:
            nodes_by_env = nodes[np.argsort(env[nodes], kind="stable")]
            envs, first = np.unique(env[nodes_by_env], return_index=True)
            bounds = np.append(first, len(nodes_by_env))
            width = int(np.diff(bounds).max())
            rows_l, ci_l, cs_l = [], [], []
            for e, a, b in zip(envs.tolist(), bounds[:-1].tolist(), bounds[1:].tolist()):
                rows = g.env_members[e]
                new_e = nodes_by_env[a:b]
                pos = self._pos[new_e]
                s = np.full((len(rows), width), -np.inf)
                s[:, : b - a] = self.within_sim(e, pos)
                s[pos, np.arange(b - a)] = -np.inf  # no self edges
                ci = np.full((len(rows), width), -1, dtype=np.int64)
                ci[:, : b - a] = new_e
                rows_l.append(rows), ci_l.append(ci), cs_l.append(s)
            self._merge("in", np.concatenate(rows_l), np.concatenate(ci_l), np.concatenate(cs_l))
        # cross-environment relation: S_abs, rows in other environments
        if self.k["cross"] > 0:
            self._add_cross(nodes)

    def within_sim(self, e: int, pos: np.ndarray) -> np.ndarray:
        """S_full (Eq. 1) between all members of environment ``e`` and its members at positions ``pos``
        (dense |members| x |pos|, float64).

        Each entry is scipy's CSR product x_i . x_j, summed in x_i's stored feature order, so it does not
        depend on which other nodes are in the same call: only the |pos| columns of the step's new nodes are
        computed.  Whole n_e x n_e blocks are cached (computed once per environment, then sliced) only when all
        of them together fit in _ENV_BLOCK_BYTES (a block costs n_e^2 products where a step needs n_e |pos|, and
        2,000 blocks of 500 tasks would hold 4 GB); either way the entries are the same values.
        """
        members = self.graph.env_members[e]
        if self._env_sim is not None:
            blk = self._env_sim.get(e)
            if blk is None:
                xe = self._x64[members]
                blk = self._env_sim[e] = np.asarray((xe @ xe.T).toarray(), dtype=np.float64)
            return blk[:, pos]
        return np.asarray((self._x64[members] @ self._x64[members[pos]].T).toarray(), dtype=np.float64)

    def _add_cross(self, nodes: np.ndarray) -> None:
        """Merge ``nodes`` into N^cross of every node of another environment.

        This is the part of a step whose cost must grow with N: any node's top-K may gain a newly observed node,
        so S_abs of the Delta new nodes to all N nodes is needed (O(N Delta)).  It is kept cheap: S_abs is
        computed once per distinct row of the abstract view (``StaticGraph.abs_groups``: identical rows give
        bit-identical products; App. E abstractions repeat across tasks) and gathered, in blocks of rows.  Only
        rows whose top-K changes are merged: a candidate enters a row exactly when its key in ``merge_topk``'s
        total order (quantised similarity, then lower index) beats the row's K-th entry (or the row is not
        full); the other rows would come back unchanged.  Values stay float32 (the precision of the S_abs
        product) until they are compared, as float64, exactly as ``merge_topk`` compares them.
        """
        g, env = self.graph, self.graph.env
        k = self.k["cross"]
        reps, group = g.abs_groups()
        s_rep = np.asarray(g.x_abs[reps] @ g.x_abs[nodes].T.toarray())  # distinct rows x Delta, float32
        node_env = env[nodes]
        cand_tie = (1 << _IDX_BITS) - 1 - nodes  # the index part of merge_topk's key
        for start in range(0, g.n, _CROSS_BLOCK):
            rows = np.arange(start, min(g.n, start + _CROSS_BLOCK))
            s = s_rep[group[rows]].astype(np.float64)
            s[env[rows][:, None] == node_env[None, :]] = -np.inf  # same environment -> not a cross edge
            valid = s > self.min_sim
            key = np.where(valid, np.floor(np.clip(s, 0.0, 1.0) * _SIM_SCALE), -1.0).astype(np.int64) * (1 << _IDX_BITS) + cand_tie
            kth_idx, kth_sim = self.idx["cross"][rows, k - 1], self.sim["cross"][rows, k - 1]
            kth_key = np.floor(np.clip(np.where(kth_idx >= 0, kth_sim, 0.0), 0.0, 1.0) * _SIM_SCALE).astype(np.int64) * (1 << _IDX_BITS) + (
                (1 << _IDX_BITS) - 1 - np.maximum(kth_idx, 0))
            enter = valid & ((kth_idx < 0)[:, None] | (key > kth_key[:, None]))
            hit = np.flatnonzero(enter.any(axis=1))
            if len(hit):
                self._merge("cross", rows[hit], np.broadcast_to(nodes, (len(hit), len(nodes))), s[hit])

    def _merge(self, rel: str, rows: np.ndarray, cand_idx: np.ndarray, s: np.ndarray) -> None:
        self.idx[rel][rows], self.sim[rel][rows] = merge_topk(self.idx[rel][rows], self.sim[rel][rows], cand_idx, s, self.k[rel], self.min_sim)

    def state_dict(self) -> dict[str, Any]:
        return {
            "observed": self.observed.copy(),
            **{f"idx_{r}": a.copy() for r, a in self.idx.items()},
            **{f"sim_{r}": a.copy() for r, a in self.sim.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.kernel_cache = {}
        self.observed = np.asarray(state["observed"], dtype=bool).copy()
        for r in self.idx:
            self.idx[r] = np.asarray(state[f"idx_{r}"], dtype=np.int64).copy()
            self.sim[r] = np.asarray(state[f"sim_{r}"], dtype=np.float64).copy()
