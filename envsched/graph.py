"""Static dual-relation graph (EnvSched §2.2, Eq. 1, Appendix D) and sparse neighbour search.

Six concrete TF-IDF views h^(a) (scikit-learn ``TfidfVectorizer``, min_df 1, 35,000-feature cap, sublinear tf,
L2-normalised rows) and one abstract view g (TF-IDF of the App. E abstraction).  Because every view is
L2-normalised, ``cos(h_i, h_j) = h_i . h_j`` and EnvSched Eq. 1 becomes one sparse dot product:

    S_full_ij = sum_a alpha_a cos(h_i^(a), h_j^(a)) = x_i . x_j,   x_i = [sqrt(alpha_a) h_i^(a)]_a
    S_abs_ij  = g_i . g_j

No N x N matrix is ever formed: similarities are computed for the rows and columns that are needed
(new observed nodes, batch members, environment members). The on-disk cache of the built graph is
:mod:`envsched.graph_cache`; the observed-neighbour sets over it are :mod:`envsched.neighbors`.
"""

from __future__ import annotations

import ast
import io
import itertools
import logging
import re
import resource
import shutil
import tempfile
import time
import tokenize
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
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
from .tfidf import (
    CHUNK_ROWS,
    ChunkCounts,
    DiskCSR,
    DiskCSRWriter,
    chunk_map,
    count_chunk,
    counter_kwargs,
    row_chunks,
    tfidf_from_counts,
    usable_cpus,
)

log = logging.getLogger(__name__)

VIEW_NAMES = ("instruction_words", "instruction_chars", "verifier_checks", "verifier_code", "initial_context", "operations")

MAX_AUTO_WORKERS = 4  # build_workers: null uses the CPUs this process may use, at most this many (memory: one chunk each)
MIN_WORKER_ROWS = 5_000  # a pool is split between workers in chunks of at least this many tasks (a fork costs ~10 ms)
# StaticGraph.row_reader: x_full's files of at least this many bytes (data + indices) are read a row at a time by
# pread instead of through the mapping (at 12 bytes an entry and ~360 entries a task: from about 250,000 tasks)
PREAD_MIN_BYTES = 1 << 30


def build_workers(cfg: EnvSchedConfig) -> int:
    """Processes of the graph build (config ``build_workers``; null: the usable CPUs, at most ``MAX_AUTO_WORKERS``)."""
    return cfg.build_workers if cfg.build_workers is not None else max(1, min(usable_cpus(), MAX_AUTO_WORKERS))


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
    nodes: list[ast.AST] = [tree]  # breadth-first, the order of ast.walk (a list instead of its generators)
    for node in nodes:
        for name in node._fields:
            child = getattr(node, name, None)
            if isinstance(child, ast.AST):
                nodes.append(child)
            elif isinstance(child, list):
                nodes.extend([c for c in child if isinstance(c, ast.AST)])
        kind = type(node)
        toks.append(kind.__name__)
        if kind is ast.Call:
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name:
                toks.append(f"call:{name}")
        elif kind is ast.Attribute:
            toks.append(f"attr:{node.attr}")
        elif kind is ast.Name:
            toks.append(f"name:{node.id}")
        elif kind is ast.Compare:
            toks.extend(f"cmp:{type(op).__name__}" for op in node.ops)
        elif kind is ast.Constant:
            toks.append(f"const:{type(node.value).__name__}")
        elif kind is ast.Subscript and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
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


def _tfidf_row_chunks(texts: Sequence[str], cfg: EnvSchedConfig, chunk_rows: int = CHUNK_ROWS, workers: int = 1, **kw: Any) -> list[sp.csr_matrix] | Any:
    """One view's TF-IDF encoder (App. D settings) in row chunks: ``TfidfVectorizer.fit_transform`` of all texts
    (``tfidf.tfidf_chunks``, counted by ``workers`` processes); rows are L2-normalised, empty rows stay zero.  A
    view without any term (also a view of empty texts) is one zero column."""
    args = _tfidf_kwargs(cfg, **kw)
    ckw = counter_kwargs(args)
    counts = chunk_map(lambda a, b: count_chunk(texts[a:b], ckw), row_chunks(len(texts), chunk_rows), workers)
    return _tfidf_counted(counts, len(texts), cfg, chunk_rows, **kw)


def _tfidf_counted(counts: Iterator[ChunkCounts], n: int, cfg: EnvSchedConfig, chunk_rows: int, **kw: Any) -> list[sp.csr_matrix] | Any:
    """``_tfidf_row_chunks`` from the view's pass 1 counts (``count_chunk`` of each of its row chunks, in order)."""
    args = _tfidf_kwargs(cfg, **kw)
    empty = [sp.csr_matrix((min(chunk_rows, n - a), 1), dtype=args["dtype"]) for a in range(0, n, chunk_rows)]
    if n == 0:
        return empty
    gen = tfidf_from_counts(counts, n, **args)
    try:
        first = next(gen)
    except ValueError:  # e.g. only stop-word-like tokens
        return empty
    return _chain(first, gen)


def _no_value_errors(counts: Iterator[ChunkCounts]) -> Iterator[ChunkCounts]:
    """``counts`` with a ValueError raised while counting turned into a RuntimeError: ``_tfidf_counted`` reads a
    ValueError as "the view has no terms", which must come from its own view's merge, never from the stream that
    the next views read from."""
    try:
        yield from counts
    except ValueError as exc:
        raise RuntimeError(f"counting a chunk of a TF-IDF view failed: {exc}") from exc


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
    # by build phase (a built graph only): {"wall": s, "cpu": this process's CPU s, "workers_cpu": the workers' CPU s}
    build_breakdown: dict[str, dict[str, float]] = field(default_factory=dict)
    build_workers: int = 0  # processes the build used (0: not built here, e.g. loaded from the graph cache)
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
            "build_breakdown": {k: dict(v) for k, v in self.build_breakdown.items()},
            "build_workers": self.build_workers,
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

    def row_reader(self) -> Callable[[np.ndarray, np.ndarray, np.ndarray], None] | None:
        """``reader(rows, cols, vals)`` reading x_full's rows from its files by ``pread`` (``DiskCSR.read_rows``)
        where x_full is on disk and at least ``PREAD_MIN_BYTES``; None: gather them from x_full itself.  Below that
        size the whole mapping stays cheap to keep resident and a gather from it is faster than a read a row."""
        if self.disk is not None and self.disk.can_pread and self.disk.nbytes >= PREAD_MIN_BYTES:
            return self.disk.read_rows
        return None

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


class ViewTexts(Sequence):
    """The texts of one concrete view, computed on access (``view_text`` of the asked tasks): the build slices it
    one chunk at a time, in a worker process when there are several, so the view's texts are never all held."""

    def __init__(self, name: str, tasks: Sequence[Task], operations: Sequence[str]):
        if name not in VIEW_NAMES:
            raise KeyError(name)
        self.name, self.tasks, self.operations = name, tasks, operations

    def __len__(self) -> int:
        return len(self.tasks)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return view_text(self.name, self.tasks[i], self.operations[i] if self.name == "operations" else ())
        return view_text(self.name, [self.tasks[i]], [self.operations[i]] if self.name == "operations" else ())[0]


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


def env_members(pool: TaskPool) -> list[np.ndarray]:
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


def _description_texts(tasks: Sequence[Task], extractor: DeterministicExtractor) -> tuple[list[str], list[str]]:
    """(concrete_text, abstract_text) of each task's deterministic description (what the build keeps of it).  Equal
    texts are one string object, so a build worker pickles each distinct text once and the parent keeps one copy
    (at 20,000 synthetic tasks 1.6 % of the concrete texts and 0.06 % of the abstract ones are distinct)."""
    texts = [extractor.texts(t) for t in tasks]
    one: dict[str, str] = {}
    return [one.setdefault(c, c) for c, _ in texts], [one.setdefault(a, a) for _, a in texts]


class _PhaseClock:
    """Wall seconds, this process's CPU seconds and its reaped children's (the build workers') CPU seconds of each
    build phase, from one ``lap(name)`` at the end of each."""

    def __init__(self) -> None:
        self.phases: dict[str, dict[str, float]] = {}
        self._last = self._now()

    @staticmethod
    def _now() -> tuple[float, float, float]:
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return time.perf_counter(), time.process_time(), kids.ru_utime + kids.ru_stime

    def lap(self, name: str) -> None:
        now = self._now()
        self.phases[name] = {k: round(b - a, 3) for k, a, b in zip(("wall", "cpu", "workers_cpu"), self._last, now)}
        self._last = now


def build_static_graph(
    pool: TaskPool,
    cfg: EnvSchedConfig,
    *,
    extractor: Any = None,
    extractions: Sequence[Extraction] | None = None,
    store: Path | None = None,
    chunk_rows: int = CHUNK_ROWS,
    workers: int | None = None,
) -> StaticGraph:
    """Build the six concrete views and the abstract view (EnvSched Eq. 1, App. D–E).

    Memory stays bounded by one chunk of ``chunk_rows`` tasks plus the operation texts: operation descriptions are
    extracted chunk by chunk and only their texts kept (a deterministic extractor's descriptions are derived
    again on access, ``DescribedTasks``); each view's texts are made chunk by chunk (``ViewTexts``) and its TF-IDF
    is computed in row chunks (``tfidf.tfidf_chunks``, equal to ``TfidfVectorizer.fit_transform``) and spilled to
    disk; x_full is written row chunk by row chunk to ``store`` (default: a temporary folder, removed once the files
    are mapped) and memory-mapped.  x_abs (about 25 entries a row) stays in memory: every step multiplies all of it
    (``NeighborIndex._add_cross``).

    The per-document work (a deterministic extractor's descriptions, each view's texts and TF-IDF counts) runs in
    ``workers`` processes (default: config ``build_workers``), one row chunk each (``tfidf.chunk_map``); what
    depends on the order of the rows (vocabulary ids, idf, pruning) is merged here in chunk order, so the graph is
    the same for any number of workers.  An LLM extractor or given ``extractions`` are read in this process.
    """
    t0 = time.perf_counter()
    clock = _PhaseClock()
    workers = build_workers(cfg) if workers is None else workers
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    n = len(pool)
    if workers > 1:  # a pool of fewer than workers x chunk_rows tasks is still shared among the workers
        chunk_rows = min(chunk_rows, max(MIN_WORKER_ROWS, -(-n // workers)))
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
    bounds = [(a, min(a + chunk_rows, n)) for a in range(0, n, chunk_rows)]
    if derive:
        for ops_part, abstract_part in chunk_map(lambda a, b: _description_texts(pool.tasks[a:b], extractor), bounds, workers):
            ops_texts.extend(ops_part)
            abstract.extend(abstract_part)
        counts[extractor.name] = n
    else:
        for a, b in bounds:
            part = extractions[a:b] if extractions is not None else extract_all(pool.tasks[a:b], extractor)
            for k, e in enumerate(part):
                counts[e.extractor] += 1
                if e.reason:
                    fallbacks[pool.task_ids[a + k]] = e.reason
                ops_texts.append(concrete_text(e.description))
                abstract.append(abstract_text(e.description))
                kept.append(e.description)
    descriptions: Sequence[OperationDescription] = DescribedTasks(pool.tasks, extractor) if derive else kept
    log.info("envsched: operation descriptions by extractor: %s", dict(counts))
    clock.lap("operations")
    members = env_members(pool)
    abstraction = abstraction_report(pool, abstract, members, cfg.abstraction_min_distinct_fraction)
    x_abs = _tfidf(abstract, cfg, chunk_rows=chunk_rows, workers=workers, token_pattern=r"\S+", lowercase=False)
    del abstract
    clock.lap("abstract_view")

    own = store is None
    folder = Path(tempfile.mkdtemp(prefix="envsched-graph-")) if own else Path(store)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        shapes: dict[str, tuple[int, int]] = {}
        chunk_nnz = np.zeros(-(-n // chunk_rows), dtype=np.int64)
        # the operations view first, so that its texts (one new string a task) are freed before the others
        order = sorted(range(len(VIEW_NAMES)), key=lambda v: VIEW_NAMES[v] != "operations")
        # every view's chunks are counted in one stream of jobs, so the workers go on with the next view's chunks
        # while this process merges and transforms a view (tfidf_from_counts reads exactly its view's chunks)
        texts = {v: ViewTexts(VIEW_NAMES[v], pool.tasks, ops_texts if VIEW_NAMES[v] == "operations" else ()) for v in order}
        kwargs = {v: counter_kwargs(_tfidf_kwargs(cfg, **_VIEW_KWARGS[VIEW_NAMES[v]])) for v in order}
        bounds = row_chunks(n, chunk_rows)
        # a worker writes its chunk's count matrix to the store folder itself (only the terms come back pickled)
        spill = (lambda v, a: folder / f"counts{v}_{a}") if workers > 1 else (lambda v, a: None)
        stream = _no_value_errors(chunk_map(lambda v, a, b: count_chunk(texts[v][a:b], kwargs[v], spill(v, a)), [(v, a, b) for v in order for a, b in bounds], workers))
        for v in order:
            name, weight = VIEW_NAMES[v], cfg.view_weights[v]
            width = 0
            for c, h in enumerate(_tfidf_counted(itertools.islice(stream, len(bounds)), n, cfg, chunk_rows, **_VIEW_KWARGS[name])):
                h = sp.csr_matrix(h * np.sqrt(weight))  # x_i = [sqrt(alpha_a) h_i^(a)]_a
                width = h.shape[1]
                chunk_nnz[c] += h.nnz
                np.save(folder / f"view{v}_c{c}_data.npy", h.data)
                np.save(folder / f"view{v}_c{c}_indices.npy", h.indices)
                np.save(folder / f"view{v}_c{c}_indptr.npy", h.indptr)
            shapes[name] = (n, width)
            if name == "operations":  # workers forked from now on do not need the texts
                del texts[v]
                ops_texts = []
            clock.lap(f"view:{name}")
        del stream
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
    clock.lap("x_full")
    graph = StaticGraph(
        x_full=disk.matrix, x_abs=x_abs.tocsr(), env=pool.env, env_members=members, descriptions=descriptions,  # type: ignore[arg-type]
        extractor_counts=dict(counts), fallback_reasons=fallbacks, build_seconds=time.perf_counter() - t0,
        view_shapes=shapes, abstraction=abstraction, disk=disk, build_breakdown=clock.phases, build_workers=workers,
    )
    graph.mean_within_env_similarity()  # cold-start representatives use static structure only
    clock.lap("representatives")
    graph.build_seconds = time.perf_counter() - t0
    return graph
