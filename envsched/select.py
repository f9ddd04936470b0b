"""Coverage-aware batch construction (EnvSched §2.4, Eq. 5, Appendix C) and cold start.

``BatchBuilder`` grows one shared batch.  Every pick is the arg-max of Eq. 5,

    i* = argmax_{i in A} [ a_i^phase - lambda_sim * max_{j in B} S_full_ij ],

evaluated lazily: the penalty max_{j in B} S_full_ij only grows as the batch grows, so a cached penalty
gives an upper bound of each candidate's score and only the top candidates are refreshed (exact arg-max,
no N x B similarity matrix).  Hard caps (C1 per batch, C3 over a rolling window, C_task consecutive
selections) restrict A; the coverage phase further restricts A lexicographically.

A tie of more than ``eq5_max_tied`` nodes with equal a_i (unobserved tasks while the relations are faded) is the
one place the arg-max is not exact: there the penalties of ``eq5_max_tied`` of them are compared (``ScanOrder``),
since the exact arg-max over a tie needs every tied node's penalty and a tie can hold most of the pool.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import scipy.sparse as sp

from .config import EnvSchedConfig
from .graph import StaticGraph, _gather_rows

try:  # scipy's compiled CSR x dense kernels, called without building matrix objects (many tiny products)
    from scipy.sparse._sparsetools import csr_matvec as _csr_matvec
    from scipy.sparse._sparsetools import csr_matvecs as _csr_matvecs
except ImportError:  # pragma: no cover - private module moved: same kernels through the public API
    _csr_matvec = _csr_matvecs = None
try:  # scipy's compiled row gather (what x[rows] runs): one pass over the rows' entries
    from scipy.sparse._sparsetools import csr_row_index as _csr_row_index
except ImportError:  # pragma: no cover
    _csr_row_index = None

_CHUNK = 16  # first lazy-evaluation chunk; later chunks grow x4 up to _ROW_BLOCK
_ROW_BLOCK = 8192  # rows whose penalties are computed at once: bounds the temporaries (gathered entries, products)
# rows read between releases of a memory-mapped x_full's pages: each page fault maps the 64 KiB around it (the
# kernel's fault-around), so every scattered row read brings its surroundings into the resident set; fewer rows
# between releases lower the peak at the same CPU (docs/results/envsched_scale.md)
_RELEASE_ROWS = 2048
_FEW_MEMBERS = 4  # nodes missing at most this many members are refreshed member by member
# RowCache: x_full rows kept in memory, at most this many bytes and an eighth of x_full (a batch's tied candidates
# are about one abstract row's tasks: docs/results/envsched_scale.md)
_ROW_CACHE_BYTES = 512 * 2**20
_ROW_CACHE_SHARE = 8
# descending_order: arrays from this length whose sample of _RANK_SAMPLE values is at least half repeats are
# sorted by rank (a hash and a radix sort); below it the float sort is faster (256 tied values: 12 against 31 us,
# even at 1,024, 4,096: 175 against 137 us)
_RANK_SORT_MIN = 1024
_RANK_SAMPLE = 4096


def descending_order(x: np.ndarray) -> np.ndarray:
    """``np.argsort(-x, kind="stable")`` for a 1-D array: the nodes by descending value, ties by ascending index
    (the order the Eq. 5 picks scan), the same permutation by the faster of two routes.

    A pool's scores take few distinct values (a million tasks' scores: 48-1,300 at the start of training, one run
    of a million under ``predictor: paper``; docs/results/envsched_scale.md), and numpy's unstable float sort is
    at its slowest on such runs.  Where a sample says the values repeat, each value is numbered by its descending
    rank (``pandas.factorize``, a hash: O(N)) and the nodes are put in rank order by a stable sort of 16-bit ranks
    (numpy's radix sort: O(N)).  Otherwise, or with more than 65,536 distinct values: one unstable sort, then each
    run of equal values ordered by index with one sort of integer keys (run << bits | index).  NaN goes to numpy."""
    x = np.asarray(x, dtype=np.float64)
    n = len(x)
    if x.ndim != 1 or n < 2 or np.isnan(x).any():
        return np.argsort(-x, kind="stable")
    sample = x[:: max(1, n // _RANK_SAMPLE)]
    if n >= _RANK_SORT_MIN and len(np.unique(sample)) * 2 <= len(sample):
        codes, values = pd.factorize(x + 0.0)  # + 0.0: -0.0 becomes 0.0, equal as in the float sort
        if len(values) <= 1 << 16:
            rank = np.empty(len(values), dtype=np.uint16)
            rank[np.argsort(-values, kind="stable")] = np.arange(len(values), dtype=np.uint16)
            return np.argsort(rank[codes], kind="stable")
    s = np.argsort(-x)
    xs = x[s]
    new_run = xs[1:] != xs[:-1]
    if new_run.all():
        return s
    run = np.zeros(n, dtype=np.int64)
    np.cumsum(new_run, out=run[1:])
    bits = (n - 1).bit_length()
    if int(run[-1]).bit_length() + bits > 62:  # pragma: no cover - over 2^31 nodes
        return np.argsort(-x, kind="stable")
    return np.sort((run << bits) | s) & ((1 << bits) - 1)


def spread_key(nodes: np.ndarray) -> np.ndarray:
    """A fixed pseudo-random order of node indices (Fibonacci hashing: index x 0x9E3779B97F4A7C15 mod 2^64, a
    bijection on uint64). Node indices run environment by environment, so a prefix of a tie in this order spreads
    over the tie's environments where a prefix in index order holds the first few."""
    return np.asarray(nodes, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)


@dataclass(frozen=True)
class ScanOrder:
    """The nodes in the order the Eq. 5 picks scan them: by descending value, ties by ascending index, except the
    runs of more than ``max_tied`` equal values (``long_runs``: their [start, end) positions in ``nodes``), which are
    ordered by :func:`spread_key`; a pick compares the first ``max_tied`` eligible nodes of such a run."""

    nodes: np.ndarray
    long_runs: tuple[tuple[int, int], ...] = ()
    max_tied: int | None = None


@functools.lru_cache(maxsize=4)
def _spread_permutation(n: int) -> np.ndarray:
    """All of ``range(n)`` in :func:`spread_key` order (computed once per pool size; read-only)."""
    perm = np.argsort(spread_key(np.arange(n)))
    perm.flags.writeable = False
    return perm


def scan_order(x: np.ndarray, max_tied: int | None) -> ScanOrder:
    """:func:`descending_order` of ``x``, each run of more than ``max_tied`` equal values (None: none is) put in
    :func:`spread_key` order (one sort per batch; the picks scan its head).  The long runs are ordered by filtering
    the pool's spread order to their nodes, all runs in one pass (O(N): at a million tasks a run is most of the pool)."""
    x = np.asarray(x, dtype=np.float64)
    nodes = descending_order(x)
    if max_tied is None or len(nodes) <= max_tied:
        return ScanOrder(nodes, (), max_tied)
    xs = x[nodes]
    starts = np.flatnonzero(np.r_[True, xs[1:] != xs[:-1]])
    ends = np.r_[starts[1:], len(nodes)]
    long_ = ends - starts > max_tied
    if long_.any():
        # every long run in one pass: the pool's spread order filtered to their nodes, then grouped by run (a stable
        # sort keeps the spread order within each run); the runs lie in position order, so the groups fill them in turn
        n_long = int(long_.sum())
        run_of = np.zeros(len(nodes), dtype=np.uint16 if n_long < 1 << 16 else np.int64)  # 0: in no long run
        in_long = np.zeros(len(nodes), dtype=bool)
        for r, (a, b) in enumerate(zip(starts[long_], ends[long_], strict=True), 1):
            run_of[nodes[a:b]] = r
            in_long[a:b] = True
        perm = _spread_permutation(len(nodes))
        spread = perm[run_of[perm] > 0]
        nodes[in_long] = spread[np.argsort(run_of[spread], kind="stable")]
    return ScanOrder(nodes, tuple(zip(starts[long_].tolist(), ends[long_].tolist(), strict=True)), max_tied)


class RowCache:
    """Rows of x_full read for Eq. 5 penalties, kept in memory (their stored entries, copied as read).

    A batch re-reads about half of the rows it refreshes (a tied candidate is refreshed again whenever its
    penalty is still among the lowest), and the next batch often refreshes the same tied candidates; a re-read
    from a memory-mapped x_full maps the pages around the row again (docs/results/envsched_scale.md counts them).
    Cached row k holds a row's entries at ``cols/vals[ptr[k]:ptr[k + 1]]``; when a block of rows does not fit,
    the cache is emptied first (the rows read last are kept).  x_full never changes, so the cache changes no value;
    ``EnvScheduler`` keeps one across batches.
    """

    def __init__(self, x: sp.csr_matrix, max_bytes: int | None = None, reader: Callable[[np.ndarray, np.ndarray, np.ndarray], None] | None = None):
        self.x = x
        # reader(rows, cols, vals): fills the rows' entries in place of a gather from x (StaticGraph.row_reader:
        # pread from x_full's files at a million tasks); None: csr_row_index from x
        self.reader = reader
        entry = x.indices.itemsize + x.data.itemsize
        if max_bytes is None:
            max_bytes = min(_ROW_CACHE_BYTES, entry * x.nnz // _ROW_CACHE_SHARE)
        self.capacity = int(max_bytes // entry)
        self._a: dict[str, np.ndarray] | None = None  # allocated on first use
        self.rows = self.used = 0

    def lookup(self, rows: np.ndarray) -> np.ndarray:
        """Cache position of each row (-1: not cached)."""
        if self._a is None:
            return np.full(len(rows), -1, dtype=np.int64)
        return self._a["id"][rows].astype(np.int64)

    def gather(self, cid: np.ndarray, total: int) -> tuple[np.ndarray, np.ndarray]:
        """(columns, values) of the cached rows at positions ``cid``, in order (``total``: their entry count)."""
        a = self._a
        assert a is not None
        rc, rv = np.empty(total, dtype=a["cols"].dtype), np.empty(total, dtype=a["vals"].dtype)
        _csr_row_index(len(cid), cid.astype(a["ptr"].dtype), a["ptr"], a["cols"], a["vals"], rc, rv)
        return rc, rv

    def read(self, rows: np.ndarray, indptr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(columns, values) of x[rows] in row order (``indptr``: their CSR offsets), read from x straight into the
        cache's buffers and kept there (emptying the cache first when they do not fit): no second copy.  Too many
        entries for the whole cache: read into new arrays, not kept.  The returned arrays may be views of the
        cache: valid until the next ``read``."""
        x, total = self.x, int(indptr[-1])
        if total > self.capacity:
            rc, rv = np.empty(total, dtype=x.indices.dtype), np.empty(total, dtype=x.data.dtype)
            self._fill(rows, rc, rv)
            return rc, rv
        if self._a is None:
            n = x.shape[0]
            self._a = {"id": np.full(n, -1, dtype=np.int32 if n < 2**31 else np.int64), "row": np.zeros(n, dtype=np.int64),
                       "ptr": np.zeros(n + 1, dtype=x.indptr.dtype), "cols": np.empty(self.capacity, dtype=x.indices.dtype),
                       "vals": np.empty(self.capacity, dtype=x.data.dtype)}
        if self.used + total > self.capacity:
            self.clear()
        a, k, used = self._a, self.rows, self.used
        rc, rv = a["cols"][used : used + total], a["vals"][used : used + total]
        self._fill(rows, rc, rv)
        a["ptr"][k + 1 : k + 1 + len(rows)] = used + indptr[1:]
        a["id"][rows] = np.arange(k, k + len(rows))
        a["row"][k : k + len(rows)] = rows
        self.rows, self.used = k + len(rows), used + total
        return rc, rv

    def _fill(self, rows: np.ndarray, rc: np.ndarray, rv: np.ndarray) -> None:
        x = self.x
        if self.reader is not None:
            self.reader(rows, rc, rv)
        else:
            _csr_row_index(len(rows), rows.astype(x.indptr.dtype), x.indptr, x.indices, x.data, rc, rv)

    def clear(self) -> None:
        if self._a is not None:
            self._a["id"][self._a["row"][: self.rows]] = -1
        self.rows = self.used = 0


def _all_columns(entries: int, cap: int, needed: int, width: int) -> bool:
    """Whether a block refresh multiplies all ``cap`` member columns as they lie (``entries`` x ``cap - needed``
    products wasted) rather than copy the ``needed`` ones contiguous (``width`` x ``needed`` values copied)."""
    return entries * (cap - needed) < width * needed


class PenaltyBlock:
    """Batch members' rows of S_full's feature matrix, for the Eq. 5 penalties max_{j in B} S_full_ij.

    Member features are mapped to compact slots through the graph's scratch map (slot 0 stands for features
    no member has and is always zero).  The members are stored twice, member-major (one contiguous vector per
    member: a node's similarity to the newest member is one sparse mat-vec) and slot-major (all members at once
    for nodes that have not seen several members).  Both paths sum x_ik x_jk in the node's stored feature
    order, so a similarity does not depend on which path or which other nodes computed it.
    """

    def __init__(self, x: sp.csr_matrix, fmap: np.ndarray, capacity: int, release: Callable[[], None] | None = None, cache_bytes: int | None = None, row_cache: RowCache | None = None):
        self.x, self.fmap = x, fmap
        # rows read from x, for re-reads (a cache kept by the caller, or one for this block)
        self.row_cache = row_cache if row_cache is not None else RowCache(x, cache_bytes)
        # a memory-mapped x_full's pages read by max_sim leave the resident set every _RELEASE_ROWS rows
        self.release, self.rows_read = release, 0
        self.cap = max(int(capacity), 1)
        self.used: list[np.ndarray] = []
        self.n_feat = 0
        lens = np.diff(x.indptr)
        # room for every feature the batch can bring (no regrowth); np.zeros pages are touched only when written
        width = min(x.shape[1], self.cap * int(lens.max() if len(lens) else 0)) + 1
        self.by_member = np.zeros((self.cap, width))  # [member, slot]
        self.by_slot = np.zeros((width, self.cap))  # [slot, member]
        self.m = 0
        # slot + 1 of every feature (0: no member has it), int32: the lookup a refresh does per gathered entry
        self.slot_of = np.zeros(x.shape[1], dtype=np.int32)

    def add(self, j: int) -> None:
        x = self.x
        cols = x.indices[x.indptr[j] : x.indptr[j + 1]]
        vals = x.data[x.indptr[j] : x.indptr[j + 1]]
        new = cols[self.fmap[cols] < 0]
        if len(new):
            self.fmap[new] = np.arange(self.n_feat, self.n_feat + len(new))
            self.slot_of[new] = np.arange(self.n_feat + 1, self.n_feat + 1 + len(new))
            self.used.append(new)
            self.n_feat += len(new)
        if self.n_feat + 1 > self.by_member.shape[1]:
            size = max(2 * self.by_member.shape[1], self.n_feat + 1)
            grown = np.zeros((self.by_member.shape[0], size))
            grown[:, : self.by_member.shape[1]] = self.by_member
            self.by_member = grown
            grown = np.zeros((size, self.by_slot.shape[1]))
            grown[: self.by_slot.shape[0]] = self.by_slot
            self.by_slot = grown
        if self.m >= self.cap:
            self.cap *= 2
            self.by_member = np.concatenate([self.by_member, np.zeros_like(self.by_member)], axis=0)
            self.by_slot = np.concatenate([self.by_slot, np.zeros_like(self.by_slot)], axis=1)
        slots = self.fmap[cols] + 1
        self.by_member[self.m, slots] = vals
        self.by_slot[slots, self.m] = vals
        self.m += 1

    def cached(self, rows: np.ndarray) -> np.ndarray:
        """Position of each row in the row cache (-1: not cached)."""
        return self.row_cache.lookup(rows)

    def _rows(self, rows: np.ndarray, cid: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """CSR (indptr, slot, value) of x[rows] in slot space (features of no member -> slot 0); ``cid``: the rows'
        cache positions when all are cached (the same entries, copied from the cache instead of x)."""
        x = self.x
        lens = x.indptr[rows + 1] - x.indptr[rows]
        total = int(lens.sum())
        indptr = np.zeros(len(rows) + 1, dtype=np.int32 if total < 2**31 else np.int64)
        np.cumsum(lens, out=indptr[1:])
        if cid is not None:
            rc, rv = self.row_cache.gather(cid, total)
        elif self.row_cache.reader is not None or (_csr_row_index is not None and x.indptr.dtype == x.indices.dtype):
            # the entries of x[rows] in row order, as scipy's x[rows] copies them (no position arrays), read into
            # the row cache
            rc, rv = self.row_cache.read(rows, indptr)
        else:
            rc, rv, _ = _gather_rows(x, rows)
        return indptr, self.slot_of[rc].astype(indptr.dtype, copy=False), np.asarray(rv, dtype=np.float64)

    def max_sim(self, rows: np.ndarray, start: np.ndarray) -> np.ndarray:
        """max_{start_r <= j < m} x_r . x_(member j) for each row r (-inf where start_r >= m), in blocks of
        ``_ROW_BLOCK`` rows (each row's value is computed on its own, so the blocking does not change it)."""
        if len(rows) <= _ROW_BLOCK:
            return self._max_sim(rows, start)
        return np.concatenate([self._max_sim(rows[a : a + _ROW_BLOCK], start[a : a + _ROW_BLOCK]) for a in range(0, len(rows), _ROW_BLOCK)])

    def _max_sim(self, rows: np.ndarray, start: np.ndarray) -> np.ndarray:
        n_rows, m, width = len(rows), self.m, self.n_feat + 1
        out = np.full(n_rows, -np.inf)
        if n_rows == 0 or m == 0:
            return out
        cid = self.cached(rows) if _csr_row_index is not None else np.full(n_rows, -1)
        hit = cid >= 0
        if self.row_cache.reader is None:  # rows read through x's mapping (a reader maps nothing)
            self.rows_read += n_rows - int(hit.sum())
        if self.release is not None and self.rows_read >= _RELEASE_ROWS:
            self.release()
            self.rows_read = 0
        few = start >= m - _FEW_MEMBERS  # seen all but the newest few members: one mat-vec per member
        groups = [(few & (start < m), True), (~few, False)]
        # cached rows first: reading the others may empty the cache
        for grp, per_member in [(np.flatnonzero(g & h), pm) for h in (hit, ~hit) for g, pm in groups]:
            if len(grp) == 0:
                continue
            indptr, slots, vals = self._rows(rows[grp], cid[grp] if hit[grp[0]] else None)
            st = start[grp]
            if per_member:
                best = np.full(len(grp), -np.inf)
                y = np.empty(len(grp))
                for j in range(int(st.min()), m):
                    vec = self.by_member[j, :width]
                    if _csr_matvec is not None:
                        y.fill(0.0)
                        _csr_matvec(len(grp), width, indptr, slots, vals, vec, y)
                    else:
                        y = sp.csr_matrix((vals, slots, indptr), shape=(len(grp), width)) @ vec
                    np.maximum(best, np.where(st <= j, y, -np.inf), out=best)
                out[grp] = best
            else:
                lo = int(st.min())  # the members some row of the group has not seen, lo..m-1, all at once
                # the members' columns lo..m-1, copied contiguous, or all the block's columns as they lie when
                # multiplying the unused ones costs less than the copy (each column's sums are the same either way)
                if _all_columns(len(vals), self.cap, m - lo, width):
                    lo, hi, mat = 0, self.cap, self.by_slot[:width]
                else:
                    hi, mat = m, np.ascontiguousarray(self.by_slot[:width, lo:m])
                if _csr_matvecs is not None:
                    y2 = np.zeros((len(grp), hi - lo))
                    _csr_matvecs(len(grp), width, hi - lo, indptr, slots, vals, mat.ravel(), y2.ravel())
                else:
                    y2 = sp.csr_matrix((vals, slots, indptr), shape=(len(grp), width)) @ mat
                cols = np.arange(lo, hi)[None, :]
                y2 = np.where((cols >= st[:, None]) & (cols < m), y2, -np.inf)
                out[grp] = y2.max(axis=1)
        return out

    def close(self) -> None:
        """Reset the scratch map (all -1 again) and empty the block for the next batch: the entries its members
        wrote are zeroed in place, so a block kept across batches (``EnvScheduler``'s) reuses memory already paged
        in instead of faulting fresh zero pages for every member (most of a small pool's step before)."""
        width = self.n_feat + 1
        self.by_member[: self.m, :width] = 0.0
        self.by_slot[:width, : self.m] = 0.0
        for u in self.used:
            self.fmap[u] = -1
            self.slot_of[u] = 0
        self.used = []
        self.m = self.n_feat = 0


@dataclass
class CapState:
    """What the hard caps of App. C need from earlier steps."""

    window_env_count: np.ndarray  # selections per environment in the previous (window - 1) steps (C3)
    blocked_tasks: np.ndarray  # bool: selected in each of the previous C_task steps (C_task)


@dataclass
class BatchBuilder:
    graph: StaticGraph
    cfg: EnvSchedConfig
    caps: CapState
    available: np.ndarray  # bool: not removed by the identifier filter
    selected: list[int] = field(default_factory=list)
    phases: list[str] = field(default_factory=list)
    relaxations: int = 0
    row_cache: RowCache | None = None  # x_full rows kept across batches (EnvScheduler's); None: one per batch
    block: PenaltyBlock | None = None  # an empty penalty block kept across batches (EnvScheduler's); None: a new one

    def __post_init__(self) -> None:
        n = self.graph.n
        self.env = self.graph.env
        self.batch_env_count = np.zeros(len(self.graph.env_members), dtype=np.int64)
        self.in_batch = np.zeros(n, dtype=bool)
        self.pen = np.zeros(n)
        self.pen_upto = np.zeros(n, dtype=np.int64)
        if self.block is None:
            self.block = PenaltyBlock(self.graph.x_full, self.graph.scratch_map(), max(self.cfg.batch_size, 1),
                                      self.graph.release_pages, row_cache=self.row_cache)
        assert self.block.m == 0, "a penalty block is reused only once closed"
        # per environment: members not yet in the batch that are available (level >= 1) and, in addition, not
        # blocked by C_task (level 0); kept up to date by add(), so the coverage phase works on environments
        n_env = len(self.graph.env_members)
        free = self.available & ~self.in_batch
        self.env_free = np.bincount(self.env[free], minlength=n_env)
        self.env_free_unblocked = np.bincount(self.env[free & ~self.caps.blocked_tasks], minlength=n_env)
        self._min_obs: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # coverage: least observation count per env
        self._q_order: tuple[np.ndarray, ScanOrder] | None = None  # coverage: nodes by descending q

    # ---- eligibility ---------------------------------------------------------------------------
    def eligible(self, level: int = 0, extra: np.ndarray | None = None) -> np.ndarray:
        """Candidates under the hard caps; ``level`` relaxes C_task (>=1), C3 (>=2), C1 (>=3)."""
        ok = self.available & ~self.in_batch
        if extra is not None:
            ok &= extra
        cfg = self.cfg
        if level < 1:
            ok &= ~self.caps.blocked_tasks
        if level < 2:
            ok &= (self.caps.window_env_count + self.batch_env_count)[self.env] < cfg.cap_env_window
        if level < 3:
            ok &= self.batch_env_count[self.env] < cfg.cap_env_round
        return ok

    def eligible_nodes(self, nodes: np.ndarray, level: int = 0, extra: np.ndarray | None = None) -> np.ndarray:
        """``eligible(level, extra)[nodes]``, computed for ``nodes`` only."""
        ok = self.available[nodes] & ~self.in_batch[nodes]
        if extra is not None:
            ok &= extra[nodes]
        cfg, env = self.cfg, self.env[nodes]
        if level < 1:
            ok &= ~self.caps.blocked_tasks[nodes]
        if level < 2:
            ok &= (self.caps.window_env_count[env] + self.batch_env_count[env]) < cfg.cap_env_window
        if level < 3:
            ok &= self.batch_env_count[env] < cfg.cap_env_round
        return ok

    def eligible_envs(self, level: int = 0) -> np.ndarray:
        """Environments with at least one member in ``eligible(level)`` (the caps C1 and C3 are per environment,
        C_task and batch membership per task: ``env_free_unblocked`` / ``env_free`` count what is left)."""
        cfg = self.cfg
        ok = (self.env_free_unblocked if level < 1 else self.env_free) > 0
        if level < 2:
            ok &= (self.caps.window_env_count + self.batch_env_count) < cfg.cap_env_window
        if level < 3:
            ok &= self.batch_env_count < cfg.cap_env_round
        return ok

    def candidates(self, extra: np.ndarray | None = None) -> np.ndarray:
        """Eligible candidates, relaxing caps only when none is left and relaxation is enabled."""
        top = 3 if self.cfg.relax_caps_when_short else 0
        for level in range(top + 1):
            c = np.flatnonzero(self.eligible(level, extra))
            if len(c):
                self.relaxations += level > 0
                return c
        return np.zeros(0, dtype=np.int64)

    # ---- Eq. 5 ---------------------------------------------------------------------------------
    def _refresh(self, nodes: np.ndarray) -> None:
        """Bring the cached penalty max_{j in B} S_full_ij of ``nodes`` up to date (each node is compared only
        with the batch members added since its last refresh)."""
        m = len(self.selected)
        start = self.pen_upto[nodes]
        todo = start < m
        if not todo.any():
            return
        nodes, start = nodes[todo], start[todo]
        self.pen[nodes] = np.maximum(self.pen[nodes], self.block.max_sim(nodes, start))
        self.pen_upto[nodes] = m

    def pick(self, cands: np.ndarray, score: np.ndarray) -> int:
        """EnvSched Eq. 5: arg-max of score - lambda_sim * max_{j in B} S_full_ij over ``cands``; ties go to
        the lowest node index (as with an empty batch or lambda_sim = 0).

        Lazy evaluation: the cached penalty is a lower bound of the current one (it only grows with the batch),
        so score - lambda_sim * cached penalty bounds each candidate's value from above.  Candidates are
        refreshed in chunks of the highest bounds (16, 64, 256, ... up to 8,192) until no unrefreshed bound reaches the best
        value; the result is the exact arg-max whatever the chunking.
        """
        lam = self.cfg.lambda_sim
        if not self.selected or lam == 0.0:
            return int(cands[np.argmax(score)])
        return self._lazy_best(cands, score, -1, -np.inf)[0]

    def scan_pick(self, order: ScanOrder, score: np.ndarray, level: int, extra: np.ndarray | Callable[[np.ndarray], np.ndarray] | None = None) -> int | None:
        """EnvSched Eq. 5 over ``eligible(level, extra)`` with a = ``score``, scanning the nodes in ``order`` (every
        node, by descending score; see :class:`ScanOrder`): the same node ``pick`` returns over
        ``flatnonzero(eligible(level, extra))`` where no run of ``order.long_runs`` is reached, and otherwise over
        those candidates with each long run's cut to its first ``order.max_tied`` eligible nodes; None when no node
        is eligible (``extra``: a mask over all nodes, or a function giving the mask of the nodes it is passed).

        Candidate pruning, exact: a value score - lambda_sim * penalty never exceeds its score (penalties are
        similarities of non-negative TF-IDF rows, >= 0), so once the next score in the order is below the best
        value found, no later node can reach it.  Only the nodes scanned so far are checked against the caps
        and refreshed, not all N.
        """
        lam = self.cfg.lambda_sim
        best, best_val = -1, -np.inf
        nodes, n = order.nodes, len(order.nodes)
        runs = iter(order.long_runs)
        run = next(runs, (n, n))
        pos, size = 0, _CHUNK * 16
        while pos < n:
            if pos == run[0]:  # a long tie: its first max_tied eligible nodes in spread_key order
                start, pos = run
                run = next(runs, (n, n))
                if best >= 0 and score[nodes[start]] < best_val:
                    break
                cand = self._tie_sample(nodes[start:pos], order.max_tied, level, extra)
                if not len(cand):
                    continue
                if not self.selected or lam == 0.0:
                    return int(cand.min())  # values = the tie's score: ties go to the lowest index
                best, best_val = self._lazy_best(cand, score[cand], best, best_val)
                continue
            blk = nodes[pos : min(pos + size, run[0])]
            pos, size = pos + len(blk), min(size * 4, 1 << 16)
            # no later node can beat the best: a value never exceeds its score, and a later node whose score equals
            # the best value has a higher index than blk[0] (ties are ordered by index), so it loses the tie
            if best >= 0 and (score[blk[0]] < best_val or (score[blk[0]] == best_val and blk[0] > best)):
                break
            cand = blk[self._eligible_in(blk, level, extra)]
            if not len(cand):
                continue
            if not self.selected or lam == 0.0:
                return int(cand[0])  # value = score: the first eligible node in the order
            best, best_val = self._lazy_best(cand, score[cand], best, best_val)
        return best if best >= 0 else None

    def _eligible_in(self, nodes: np.ndarray, level: int, extra: np.ndarray | Callable[[np.ndarray], np.ndarray] | None) -> np.ndarray:
        """``eligible(level, extra)[nodes]`` (``extra``: a mask over all nodes or a function of the nodes)."""
        if callable(extra):
            ok = self.eligible_nodes(nodes, level)
            ok &= extra(nodes)
            return ok
        return self.eligible_nodes(nodes, level, extra)

    def _tie_sample(self, run: np.ndarray, max_tied: int, level: int, extra: np.ndarray | Callable[[np.ndarray], np.ndarray] | None) -> np.ndarray:
        """The first ``max_tied`` eligible nodes of ``run`` (a long tie in spread_key order), read in blocks of
        the number still missing (at least 256, at most 65,536): where most of the tie is eligible about
        ``max_tied`` nodes are checked (blocks growing from 256 read 87,296 nodes for 32,768)."""
        taken: list[np.ndarray] = []
        count, pos = 0, 0
        while pos < len(run) and count < max_tied:
            blk = run[pos : pos + min(max(max_tied - count, _CHUNK * 16), 1 << 16)]
            pos += len(blk)
            cand = blk[self._eligible_in(blk, level, extra)][: max_tied - count]
            taken.append(cand)
            count += len(cand)
        return np.concatenate(taken) if taken else np.zeros(0, dtype=np.int64)

    def _lazy_best(self, cands: np.ndarray, score: np.ndarray, best: int, best_val: float) -> tuple[int, float]:
        """The lazy arg-max of :meth:`pick` over ``cands`` (``score``: their scores, aligned with them), starting
        from a best (node, value) found elsewhere (-1, -inf: none): candidates are refreshed in chunks of the
        highest upper bounds (16, 64, 256, ... up to ``_ROW_BLOCK``) until no unrefreshed bound reaches the best value."""
        lam = self.cfg.lambda_sim
        ub = score - lam * self.pen[cands]  # the cached penalty only grows: an upper bound
        open_ = np.ones(len(cands), dtype=bool) if best < 0 else (ub > best_val) | ((ub == best_val) & (cands < best))
        rest = np.flatnonzero(open_)
        if len(rest) > _CHUNK:  # highest bounds first (a first chunk that takes all needs no order)
            rest = rest[descending_order(ub[rest])]
        size, pos = _CHUNK, 0
        while pos < len(rest):
            top = rest[pos : pos + size]
            pos += size
            nodes = cands[top]
            self._refresh(nodes)
            val = score[top] - lam * self.pen[nodes]
            vmax = float(val.max())
            if vmax >= best_val:
                i = int(nodes[val == vmax].min())
                best = i if vmax > best_val or best < 0 else min(best, i)
                best_val = vmax
            if pos >= len(rest) or ub[rest[pos]] < best_val:  # no unrefreshed bound reaches the best value
                break
            size = min(size * 4, _ROW_BLOCK)
        return best, best_val

    def add(self, i: int, phase: str) -> None:
        self.selected.append(int(i))
        self.phases.append(phase)
        if self.available[i] and not self.in_batch[i]:
            self.env_free[self.env[i]] -= 1
            if not self.caps.blocked_tasks[i]:
                self.env_free_unblocked[self.env[i]] -= 1
        self.in_batch[i] = True
        e = self.env[i]
        for lvl, (obs_count, env_min) in self._min_obs.items():
            if obs_count[i] == env_min[e]:  # the environment's least count may have left with i
                members = self.graph.env_members[e]
                free = self.available[members] & ~self.in_batch[members]
                if lvl == 0:
                    free &= ~self.caps.blocked_tasks[members]
                env_min[e] = np.asarray(obs_count, dtype=np.int64)[members][free].min() if free.any() else np.iinfo(np.int64).max
        self.batch_env_count[self.env[i]] += 1
        self.block.add(int(i))

    def close(self) -> None:
        """Release the scratch map of the penalty block and empty it for the next batch."""
        self.block.close()

    # ---- phases (§2.4) -----------------------------------------------------------------------------
    def coverage_pick(self, q: np.ndarray, env_exposure: np.ndarray, obs_count: np.ndarray) -> int | None:
        """Coverage: restrict lexicographically by (batch env coverage, cumulative env exposure, task
        observation count), then Eq. 5 with a = q.

        The candidates are those of ``candidates()`` (lowest cap-relaxation level with any); the first two keys
        are per environment, so they are minimised over the environments with an eligible member, and the third
        over per-environment minima kept up to date by ``add()``; the Eq. 5 arg-max over the remaining set is a
        ``scan_pick`` of the nodes by descending q (one sort per batch), not a pass over all N nodes."""
        top = 3 if self.cfg.relax_caps_when_short else 0
        for level in range(top + 1):
            envs = np.flatnonzero(self.eligible_envs(level))
            if not len(envs):
                continue
            self.relaxations += level > 0
            for key in (self.batch_env_count, env_exposure):
                envs = envs[key[envs] == key[envs].min()]
            env_min = self._env_min_obs(obs_count, level)
            m3 = env_min[envs].min()  # the third key's minimum over the eligible members of those environments
            in_envs = np.zeros(len(self.graph.env_members), dtype=bool)
            in_envs[envs] = True
            if self._q_order is None or self._q_order[0] is not q:
                self._q_order = (q, scan_order(q, self.cfg.eq5_max_tied))
            return self.scan_pick(self._q_order[1], q, level, lambda nodes, in_envs=in_envs, m3=m3: in_envs[self.env[nodes]] & (obs_count[nodes] == m3))
        return None

    def _env_min_obs(self, obs_count: np.ndarray, level: int) -> np.ndarray:
        """Per environment, the least observation count of its members that are available, not in the batch
        and (level 0) not blocked by C_task; kept up to date by add()."""
        lvl = min(level, 1)
        if self._min_obs.get(lvl) is None or self._min_obs[lvl][0] is not obs_count:
            free = self.available & ~self.in_batch
            if lvl == 0:
                free &= ~self.caps.blocked_tasks
            env_min = np.full(len(self.graph.env_members), np.iinfo(np.int64).max, dtype=np.int64)
            np.minimum.at(env_min, self.env[free], np.asarray(obs_count, dtype=np.int64)[free])
            self._min_obs[lvl] = (obs_count, env_min)
        return self._min_obs[lvl][1]

    def exploitation_pick(self, score: np.ndarray, progress_ok: np.ndarray, order: ScanOrder | None = None) -> tuple[int | None, bool]:
        """Exploitation: Eq. 5 with a = q * omega over candidates that pass the progress filter.
        Returns (node, used_filtered) where used_filtered says the progress filter had to be ignored.

        ``order``: ``scan_order(score, cfg.eq5_max_tied)``, computed once per batch by the caller; the pick scans
        it (``scan_pick``)."""
        if order is None:
            order = scan_order(score, self.cfg.eq5_max_tied)
        top = 3 if self.cfg.relax_caps_when_short else 0
        for extra in (progress_ok, None):
            for level in range(top + 1):
                i = self.scan_pick(order, score, level, extra)
                if i is not None:
                    self.relaxations += level > 0
                    return i, extra is None
        return None, False


def cold_start_batch(graph: StaticGraph, cfg: EnvSchedConfig, batch_size: int, available: np.ndarray) -> list[int]:
    """App. C cold start: one representative per environment (highest mean within-environment similarity),
    then fill by combined global (S_abs) and within-environment (S_full) novelty, <= cap per environment."""
    rep_score = graph.mean_within_env_similarity()
    reps = []
    for members in graph.env_members:
        m = members[available[members]]
        if len(m):
            reps.append(int(m[np.argmax(rep_score[m])]))  # ties -> lowest index (members are sorted)
    reps_arr = np.asarray(reps, dtype=np.int64)
    n = graph.n
    chosen: list[int] = []
    glob_max = np.zeros(n)  # max S_abs to the batch
    env_max = np.zeros(n)  # max S_full to batch members of the same environment
    env_count = np.zeros(len(graph.env_members), dtype=np.int64)
    in_batch = np.zeros(n, dtype=bool)

    def add(i: int) -> None:
        chosen.append(i)
        in_batch[i] = True
        env_count[graph.env[i]] += 1
        np.maximum(glob_max, graph.sim_abs(None, np.array([i]))[:, 0], out=glob_max)
        members = graph.env_members[graph.env[i]]
        env_max[members] = np.maximum(env_max[members], graph.sim_full(members, np.array([i]))[:, 0])

    w = cfg.cold_start_global_weight
    if len(reps_arr) <= batch_size:
        for i in reps_arr:
            add(int(i))
    else:  # more environments than slots: representatives chosen by global novelty
        add(int(reps_arr[np.argmax(rep_score[reps_arr])]))
        while len(chosen) < batch_size:
            left = reps_arr[~in_batch[reps_arr]]
            add(int(left[np.argmax(1.0 - glob_max[left])]))
    while len(chosen) < batch_size:
        ok = available & ~in_batch & (env_count[graph.env] < cfg.cold_start_env_cap)
        if not ok.any():
            ok = available & ~in_batch
            if not ok.any():
                break
        c = np.flatnonzero(ok)
        novelty = w * (1.0 - glob_max[c]) + (1.0 - w) * (1.0 - env_max[c])
        add(int(c[np.argmax(novelty)]))
    return chosen
