"""Observed-neighbour sets N_t^in(i), N_t^cross(i) (EnvSched §2.2, Eq. 3, Eq. 7): for each node, the K_within /
K_cross most similar *observed* nodes in fixed-capacity arrays, with newly observed nodes merged in
O(N * (K + Delta)) per step (the incremental scheme of §3.3.2)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from .graph import StaticGraph

log = logging.getLogger(__name__)


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
        self._cross_classes: tuple[np.ndarray, np.ndarray] | None = None
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

    def cross_classes(self) -> tuple[np.ndarray, np.ndarray]:
        """(lowest node of each class, class of every node): nodes with the same abstract row
        (``StaticGraph.abs_groups``) and the same environment, whose N^cross rows are always identical.

        N^cross(i) is the top K over the observed nodes j outside env(i) in ``merge_topk``'s order of S_abs_ij;
        S_abs_ij is computed once per distinct abstract row (``_add_cross``), so it depends on i only through
        that row, and the excluded environment is env(i): every merge gives two such nodes the same inputs
        (starting from the same empty rows), hence the same rows.  ``estimate.prediction_classes`` computes the
        cross relation once per class (EnvSched Eq. 3, 7).  Static: computed once."""
        if self._cross_classes is None:
            _, group = self.graph.abs_groups()
            env = self.graph.env.astype(np.int64)
            _, first, inverse = np.unique(group * (int(env.max()) + 1 if len(env) else 1) + env, return_index=True, return_inverse=True)
            order = np.argsort(first)  # classes by their lowest node
            rank = np.empty(len(order), dtype=np.int64)
            rank[order] = np.arange(len(order))
            self._cross_classes = (first[order].astype(np.int64), rank[inverse.ravel()])
        return self._cross_classes

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

        Any node's top-K may gain a newly observed node, so S_abs of the Delta new nodes to every node is needed.
        S_abs is computed once per distinct row of the abstract view (``StaticGraph.abs_groups``: identical rows
        give bit-identical products; App. E abstractions repeat across tasks), and the rows themselves are
        updated once per cross class (``cross_classes``: same abstract row and environment, identical rows), so
        the test and the merge are O(C L) for C classes, not O(N L); only the rows of the classes that change are
        then copied (O(changed rows x K)).  Only rows whose top-K changes are merged: a candidate enters a row
        exactly when its key in ``merge_topk``'s total order (quantised similarity, then lower index) beats the
        row's K-th entry (or the row is not full); the other rows would come back unchanged.  The test needs each
        row's best candidate from another environment only, which is among the top few keys of its distinct
        row, so the per-row work is O(L) with L - 1 the most new nodes of one environment, not O(Delta); the rows
        that change merge the K + L - 1 best candidates of their distinct row, not all Delta.  Values are the
        float32 S_abs product cast to float64, compared exactly as ``merge_topk`` compares them.
        """
        g, env = self.graph, self.graph.env
        k = self.k["cross"]
        reps, group = g.abs_groups()
        s_rep = np.asarray(g.x_abs[reps] @ g.x_abs[nodes].T.toarray()).astype(np.float64)  # distinct rows x Delta
        node_env = env[nodes]
        # merge_topk's key of every (distinct row, candidate); candidates at or below min_sim never enter
        none = np.iinfo(np.int64).min
        key = np.floor(np.clip(s_rep, 0.0, 1.0) * _SIM_SCALE).astype(np.int64) * (1 << _IDX_BITS) + ((1 << _IDX_BITS) - 1 - nodes)
        key[~(s_rep > self.min_sim)] = none
        # a row's best candidate from another environment is among each distinct row's top L keys, L = one more
        # than the most candidates any one environment has (at most L - 1 of them share the row's environment)
        n_top = min(len(nodes), int(np.bincount(node_env).max()) + 1)
        # and a candidate outside a distinct row's top K + L - 1 keys never reaches a top K of its rows: K others
        # from other environments beat it, so only those are merged
        n_merge = min(len(nodes), k + n_top - 1)
        ranked = np.argsort(~key, axis=1)[:, : max(n_top, n_merge)]  # descending keys (~x = -x - 1: no overflow)
        top = ranked[:, :n_top]
        top_key, top_env = np.take_along_axis(key, top, 1), node_env[top]
        merge_idx, merge_sim = nodes[ranked[:, :n_merge]], np.take_along_axis(s_rep, ranked[:, :n_merge], 1)
        # the test and the merge run on one node per cross class (same abstract row, same environment: identical
        # N^cross rows, hence identical inputs and results), then the merged rows are copied to their classes
        crows, cinv = self.cross_classes()
        hit_cls = np.zeros(len(crows), dtype=bool)
        for start in range(0, len(crows), _CROSS_BLOCK):
            rows = crows[start : start + _CROSS_BLOCK]
            grp = group[rows]
            other = top_env[grp] != env[rows][:, None]
            best = np.where(other.any(axis=1), top_key[grp, other.argmax(axis=1)], none)
            kth_idx, kth_sim = self.idx["cross"][rows, k - 1], self.sim["cross"][rows, k - 1]
            kth_key = np.floor(np.clip(np.where(kth_idx >= 0, kth_sim, 0.0), 0.0, 1.0) * _SIM_SCALE).astype(np.int64) * (1 << _IDX_BITS) + (
                (1 << _IDX_BITS) - 1 - np.maximum(kth_idx, 0))
            hit_at = np.flatnonzero((best != none) & ((kth_idx < 0) | (best > kth_key)))
            hit = rows[hit_at]
            if len(hit):
                hit_cls[start + hit_at] = True
                cand, sim = merge_idx[group[hit]], merge_sim[group[hit]]
                sim[env[hit][:, None] == env[cand]] = -np.inf  # same environment -> not a cross edge
                self._merge("cross", hit, cand, sim)
        if hit_cls.any():
            members = np.flatnonzero(hit_cls[cinv])
            src = crows[cinv[members]]
            self.idx["cross"][members] = self.idx["cross"][src]
            self.sim["cross"][members] = self.sim["cross"][src]

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
