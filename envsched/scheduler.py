"""The EnvSched scheduler: rollout -> update -> propagation -> selection (EnvSched §2.1, Figure 2).

    sched = EnvScheduler(TaskPool.from_jsonl("pool.jsonl"), EnvSchedConfig())
    for step in range(steps):
        ids = sched.select(step)                       # B task ids
        rewards = {tid: run_k_rollouts(tid) for tid in ids}
        metrics = sched.observe(step, rewards)         # {"envsched/...": float}
    state = sched.state_dict(); sched2.load_state_dict(state)   # exact resume

Asynchronously (several selections in flight, each observed in pieces, in any order), ``step`` is a monotonic
selection id and in-flight tasks are kept out of new selections:

    ids = sched.select(sel_id, size=k, exclude=sched.in_flight_mask())
    sched.observe(sel_id, {tid: rewards})              # any subset of a selection, each (selection, task) once
    sched.drop(sel_id, [tid])                          # evicted groups: never observed, no longer in flight

``config.scheduler == "random"`` gives the seeded uniform baseline with the same API and metrics.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from .config import ConfigError, EnvSchedConfig
from .estimate import (
    EVIDENCE_TYPES,
    ObservationLog,
    Prediction,
    evidence_types,
    exposure_factor,
    group_statistics,
    predict_all,
    prediction_diagnostics,
)
from .filters import IdentifierCheck, IdentifierFilter, ProgressFilter, ReplayFn
from .graph import StaticGraph
from .graph_cache import load_or_build_graph
from .neighbors import NeighborIndex
from .pool import Task, TaskPool
from .predictor import design_matrix, predict_additive_logit
from .relations import RelationWeights
from .select import BatchBuilder, CapState, PenaltyBlock, RowCache, cold_start_batch, scan_order

log = logging.getLogger(__name__)

STATE_VERSION = 2  # 2: the tasks in flight per selection (version-1 states load with none in flight)
PREFIX = "envsched/"


class ObservationError(ValueError):
    """``observe()`` or ``drop()`` refused its input; nothing was recorded.  ``task_id`` names the offending task
    (None when the whole call is at fault) and ``step`` the selection."""

    def __init__(self, message: str, *, step: int | None = None, task_id: str | None = None):
        super().__init__(message)
        self.step, self.task_id = step, task_id


class UnknownTaskError(ObservationError, KeyError):
    """A task id that is not in the pool (also a KeyError, as before the guards)."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0])


def _preview(ids: Sequence[str], k: int = 3) -> str:
    head = ", ".join(repr(t) for t in list(ids)[:k])
    return head + (f", ... ({len(ids)} tasks)" if len(ids) > k else "")


class EnvScheduler:
    """Chooses each batch of environment–task pairs (EnvSched §2.4) from predicted informativeness (§2.3).

    Args:
        pool: a TaskPool, or plain records in the JSONL record format (see ``envsched.pool``).
        config: an EnvSchedConfig or a plain dict (unknown keys raise ConfigError).
        graph: a prebuilt StaticGraph (otherwise built from the pool; lazily in random mode).
        extractor: operation extractor for the graph build (default from ``config.operation_extractor``).
        replay: ``replay(task_id, actions) -> reward`` used by the identifier filter (optional).
        identifier_detector: ``detector(task, actions) -> [suspicious action indices]`` (optional).
    """

    def __init__(
        self,
        pool: TaskPool | Iterable[Mapping[str, Any] | Task],
        config: EnvSchedConfig | Mapping[str, Any] | None = None,
        *,
        graph: StaticGraph | None = None,
        extractor: Any = None,
        replay: ReplayFn | None = None,
        identifier_detector: Callable[..., list[int]] | None = None,
    ):
        self.pool = pool if isinstance(pool, TaskPool) else TaskPool.from_records(pool)
        if config is None:
            config = EnvSchedConfig()
        elif not isinstance(config, EnvSchedConfig):
            config = EnvSchedConfig.from_dict(dict(config))
        self.cfg = config
        n = len(self.pool)
        if self.cfg.batch_size > n:
            raise ConfigError(f"config key 'batch_size': {self.cfg.batch_size} exceeds the pool size {n}")
        self._extractor = extractor
        self._graph = graph
        self._neighbors: NeighborIndex | None = None
        self.env = self.pool.env
        self.log = ObservationLog()
        self.obs_count = np.zeros(n, dtype=np.int64)
        self.sel_count = np.zeros(n, dtype=np.int64)
        self.available = np.ones(n, dtype=bool)  # False: removed by the identifier filter
        self.selections: dict[int, np.ndarray] = {}
        self.selection_phases: dict[int, list[str]] = {}
        # per selection: the nodes observed (derived from the log: each observation is logged under its selection)
        self.observed: dict[int, set[int]] = {}
        # per selection with tasks in flight: the nodes selected and neither observed nor dropped (a selected node
        # that is neither observed nor open was dropped)
        self._open: dict[int, set[int]] = {}
        # per selection with tasks in flight: q, v-hat and evidence code of each selected task at selection, in
        # selection order (the prediction diagnostics compare them with the variance realised when the tasks are
        # observed); dropped once every task of the selection is observed or dropped
        self.selection_predictions: dict[int, dict[str, np.ndarray]] = {}
        # per selection with tasks in flight: the (environment, tool) pairs its observed trajectories called so far
        self._tools_used: dict[int, set[tuple[int, str]]] = {}
        self.rng = np.random.Generator(np.random.PCG64(self.cfg.seed))
        self.progress = ProgressFilter(self.cfg, self.env, self.pool.n_envs)
        self.identifier = IdentifierFilter(self.cfg, replay, identifier_detector)
        self.counters = {"identifier_checked": 0, "identifier_filtered": 0, "replay_mismatch": 0, "replay_error": 0}
        self._metrics: dict[int, dict[str, float]] = {}
        self._pred_cache: tuple[int, int, Prediction] | None = None
        self._design = None  # predictor: additive_logit's design matrix (predictor.design_matrix), built once
        self._row_cache: RowCache | None = None  # x_full rows read by the Eq. 5 penalties, kept across batches
        self._block: PenaltyBlock | None = None  # the Eq. 5 penalty block, emptied and kept across batches
        # relation_weights: measured (beyond the paper, envsched/relations.py): the relations' Eq. 3 weights
        # (used by the paper's predictor only: predictor: additive_logit has no relation sums to weight)
        self.relation_weights = (RelationWeights(self.cfg) if self.cfg.relation_weights == "measured"
                                 and self.cfg.predictor == "paper" else None)
        if self.cfg.scheduler == "envsched":
            _ = self.neighbors  # build the graph now (a cost paid once, before training)

    # ---- static structure ----------------------------------------------------------------------
    @property
    def graph(self) -> StaticGraph:
        if self._graph is None:
            self._graph = load_or_build_graph(self.pool, self.cfg, extractor=self._extractor)
        return self._graph

    @property
    def neighbors(self) -> NeighborIndex:
        if self._neighbors is None:
            nb = NeighborIndex(self.graph, self.cfg.k_within, self.cfg.k_cross, self.cfg.min_neighbor_similarity)
            observed = np.flatnonzero(self.obs_count > 0)
            if len(observed):
                nb.add_observed(observed)  # order-independent: merge_topk uses a total order
            self._neighbors = nb
        return self._neighbors

    def graph_report(self) -> dict[str, Any]:
        """Which operation extractor was used (counts), view sizes, build time."""
        return self.graph.report()

    # ---- prediction (§2.3) ---------------------------------------------------------------------
    def predict(self, step: int | None = None) -> Prediction:
        """Per-task predicted variance v, mean m, dispersion d and score q for selection ``step`` (default: the
        step after the last observed/selected one), from the observations of earlier selections.

        Observations are logged under the selection that chose them (``observe()``), so for a selection being
        made these are exactly the observations received so far (§2.2's "observed before t").  Asked again after
        observations of earlier selections arrived late, it includes them: the prediction then differs from the
        one the selection was made with (which ``selection_predictions`` keeps)."""
        if step is None:
            last = [max(self.selections, default=-1)]
            if len(self.log):
                last.append(int(self.log.arrays()["step"].max()))
            step = max(last) + 1
        key = (step, len(self.log))
        if self._pred_cache is not None and self._pred_cache[:2] == key:
            return self._pred_cache[2]
        if self.cfg.predictor == "additive_logit":  # beyond the paper: envsched/predictor.py
            if self._design is None:  # a function of the pool and the config alone: built once
                self._design = design_matrix(self.env, self.graph.x_abs, self.pool.n_envs, self.cfg)
            pred = predict_additive_logit(self.log, step, self.pool.task_ids, self.env, self.graph.x_abs, self.cfg,
                                          self.pool.n_envs, self._design)
            self._pred_cache = (*key, pred)
            return pred
        nb = self.neighbors
        steps = self.log.arrays()["step"]
        if len(steps) and step <= int(steps.max()):
            # a past step: N_t(i) holds the most similar nodes observed *before* t (§2.2), not a top-K over
            # the nodes observed since, with the later ones masked out (that would leave fewer than K)
            nb = NeighborIndex(self.graph, self.cfg.k_within, self.cfg.k_cross, self.cfg.min_neighbor_similarity)
            nb.add_observed(np.unique(self.log.arrays()["node"][steps < step]))
        rw = self.relation_weights.weights() if self.relation_weights is not None else None
        pred = predict_all(self.log, nb.idx, nb.sim, step, self.pool.task_ids, self.cfg, self.env, nb.kernel_cache, rw, nb.cross_classes())
        self._pred_cache = (*key, pred)
        return pred

    # ---- selection (§2.4) ----------------------------------------------------------------------
    def select(self, step: int, size: int | None = None, exclude: Iterable[str] | np.ndarray | None = None) -> list[str]:
        """Task ids of the batch for selection ``step`` (a step already selected returns the same batch, whatever
        ``size`` and ``exclude`` say: the first call decided it).

        ``step`` is the selection key: the training step for a synchronous caller, a monotonic selection id for an
        asynchronous one (several selections per training step: warm-up, per-step batches, refills of evicted
        groups).  It must be an integer (a bool, float or string is refused with ValueError, as ``observe()``
        refuses it: ``select(1.5)`` would otherwise become step 1 and the step observed later would not match) and
        must not go below an earlier selection's.

        ``size``: how many tasks to choose (default ``batch_size``; 1 <= size <= the pool size); every path (the
        random baseline, the cold start, the Eq. 5 fill) chooses ``size`` tasks, fewer only when fewer tasks are
        available (the identifier filter removed the rest).

        ``exclude``: tasks that must not be chosen, normally those still in flight (``in_flight_mask()``): an
        iterable of task ids, or a bool mask over the pool (``True``: excluded).  When fewer than ``size`` available
        tasks are outside it, the batch is completed from the excluded tasks by the same rule (in-flight tasks
        are chosen again only where the pool is too small to avoid it): a warning is logged once for the
        selection, and the selection's metric ``inflight_reselected`` counts them (the metric is present
        whenever ``exclude`` is given)."""
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
            raise ValueError(f"select(): step must be an integer, got {step!r}")  # noqa: TRY004 - as observe()
        step = int(step)
        if step in self.selections:
            return [self.pool.task_ids[i] for i in self.selections[step]]
        if self.selections and step < max(self.selections):
            raise ValueError(f"select({step}) after select({max(self.selections)}): steps must not go backwards")
        size = self._selection_size(step, size)
        excluded = self._exclude_mask(step, exclude)
        t0 = time.perf_counter()
        free = self.available if excluded is None else self.available & ~excluded
        metrics: dict[str, float] = {}
        if self.cfg.scheduler == "random" or (not self.selections and len(self.log) == 0 and self.cfg.cold_start == "random"):
            chosen = self._random_choice(free, size)
            if len(chosen) < size and excluded is not None:
                chosen += self._random_choice(self.available & excluded, size - len(chosen))
            phases = ["random" if self.cfg.scheduler == "random" else "cold_start"] * len(chosen)
        elif not self.selections and len(self.log) == 0:
            chosen = cold_start_batch(self.graph, self.cfg, size, free)
            if len(chosen) < size and excluded is not None:  # the cold-start order over every available task
                taken = set(chosen)
                rest = [i for i in cold_start_batch(self.graph, self.cfg, size, self.available) if i not in taken]
                chosen += rest[: size - len(chosen)]
            phases = ["cold_start"] * len(chosen)
        else:
            chosen, phases, metrics = self._select_envsched(step, size, free)
        sel = np.asarray(chosen, dtype=np.int64)
        if excluded is not None:
            reselected = int(excluded[sel].sum())
            metrics["inflight_reselected"] = float(reselected)
            if reselected:
                log.warning("envsched: select(%d): only %d of the %d tasks asked for are not in flight; %d in-flight tasks chosen again",
                            step, len(sel) - reselected, size, reselected)
        self.selections[step] = sel
        self.selection_phases[step] = phases
        if len(sel):
            self._open[step] = set(sel.tolist())
        np.add.at(self.sel_count, sel, 1)
        if self.cfg.scheduler == "envsched":
            pred = self.predict(step)
            nb = self.neighbors
            code = evidence_types(self.log, nb.idx, step, sel, len(self.pool))
            self.selection_predictions[step] = {"q": pred.q[sel].copy(), "v": pred.v[sel].copy(), "evidence": code}
            if pred.sources is not None:  # what the relation weights are measured on when the step is observed
                self.selection_predictions[step].update({f"src:{k}": a[sel].copy() for k, a in pred.sources.items()})
            metrics.update({f"selected_{name}": float(np.sum(code == c)) for c, name in enumerate(EVIDENCE_TYPES)})
        metrics.update(self._selection_metrics(step, sel, phases))
        if self._graph is not None:
            self._graph.release_pages()  # rows of a memory-mapped x_full read by this selection leave the resident set
        metrics["select_time_s"] = time.perf_counter() - t0
        self._metrics[step] = {**self._metrics.get(step, {}), **metrics}
        return [self.pool.task_ids[i] for i in sel]

    def _selection_size(self, step: int, size: Any) -> int:
        if size is None:
            return self.cfg.batch_size
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
            raise ValueError(f"select({step}): size must be an integer, got {size!r}")  # noqa: TRY004 - as step
        if not 1 <= int(size) <= len(self.pool):
            raise ValueError(f"select({step}): size must be between 1 and the pool size {len(self.pool)}, got {int(size)}")
        return int(size)

    def _exclude_mask(self, step: int, exclude: Any) -> np.ndarray | None:
        """``exclude`` as a bool mask over the pool (None: nothing excluded)."""
        if exclude is None:
            return None
        n = len(self.pool)
        if isinstance(exclude, np.ndarray) and exclude.dtype == bool:
            if exclude.shape != (n,):
                raise ValueError(f"select({step}): an exclude mask must have the pool's shape ({n},), got {exclude.shape}")
            return exclude.copy()
        if isinstance(exclude, (str, bytes, Mapping)) or not isinstance(exclude, Iterable):
            raise ValueError(f"select({step}): exclude must be task ids or a bool mask over the pool, got {type(exclude).__name__}")  # noqa: TRY004
        mask = np.zeros(n, dtype=bool)
        for tid in exclude:
            i = self.pool.index.get(tid) if isinstance(tid, str) else None
            if i is None:
                raise ValueError(f"select({step}): exclude holds {tid!r}, which is not a task id of the pool")
            mask[i] = True
        return mask

    def _random_choice(self, mask: np.ndarray, size: int) -> list[int]:
        """``size`` distinct nodes of ``mask`` uniformly at random (all of them when fewer): the random baseline."""
        idx = np.flatnonzero(mask)
        return self.rng.choice(idx, size=min(size, len(idx)), replace=False).tolist()

    def _cap_state(self, step: int) -> CapState:
        cfg, n = self.cfg, len(self.pool)
        window = np.zeros(self.pool.n_envs, dtype=np.int64)
        for s in range(step - cfg.cap_env_window_steps + 1, step):
            if s in self.selections:
                window += np.bincount(self.env[self.selections[s]], minlength=self.pool.n_envs)
        blocked = np.ones(n, dtype=bool)
        for s in range(step - cfg.cap_task_consecutive, step):
            mask = np.zeros(n, dtype=bool)
            if s in self.selections:
                mask[self.selections[s]] = True
            blocked &= mask
        return CapState(window_env_count=window, blocked_tasks=blocked)

    def _select_envsched(self, step: int, size: int, free: np.ndarray) -> tuple[list[int], list[str], dict[str, float]]:
        """Coverage then exploitation (§2.4) over ``free``; when that leaves the batch short of ``size``, the fill
        goes on over every available task (the in-flight tasks ``free`` left out), after the picks made so far."""
        cfg = self.cfg
        pred = self.predict(step)
        if self._row_cache is None:
            self._row_cache = RowCache(self.graph.x_full, reader=self.graph.row_reader())
        caps = self._cap_state(step)
        builder = BatchBuilder(self.graph, cfg, caps, free.copy(), row_cache=self._row_cache, block=self._block)
        self._block = builder.block  # the first builder makes it; closed, the next batch's builders reuse it
        try:
            chosen, phases, metrics = self._fill(builder, step, pred.q, size)
        finally:
            builder.close()
        if len(chosen) >= size or np.array_equal(free, self.available):
            return chosen, phases, metrics
        builder = BatchBuilder(self.graph, cfg, caps, self.available.copy(), row_cache=self._row_cache,
                               block=self._block)
        try:
            for i, phase in zip(chosen, phases):
                builder.add(i, phase)
            chosen, phases, more = self._fill(builder, step, pred.q, size)
        finally:
            builder.close()
        more["progress_filter_ignored"] += metrics["progress_filter_ignored"]
        more["cap_relaxations"] += metrics["cap_relaxations"]
        return chosen, phases, more

    def _fill(self, builder: BatchBuilder, step: int, q: np.ndarray, size: int | None = None) -> tuple[list[int], list[str], dict[str, float]]:
        """Fill ``builder`` up to ``size`` tasks (default ``batch_size``): floor(rho size) coverage picks (less those
        it already holds), then Eq. 5 exploitation picks."""
        cfg = self.cfg
        size = cfg.batch_size if size is None else size
        b_cov = int(np.floor(cfg.rho * size))
        env_exposure = np.bincount(self.env, weights=self.sel_count, minlength=self.pool.n_envs)
        for _ in range(b_cov - builder.phases.count("coverage")):
            i = builder.coverage_pick(q, env_exposure, self.obs_count)
            if i is None:
                break
            builder.add(i, "coverage")
        progress_block = np.zeros(len(self.pool), dtype=bool)
        if cfg.progress_filter:
            nb = self.neighbors
            progress_block = self.progress.blocked([nb.idx["in"], nb.idx["cross"]])
        score = q * exposure_factor(self.sel_count, cfg.exposure_c0)
        order = scan_order(score, cfg.eq5_max_tied)  # one O(N log N) sort per batch; each pick scans its head
        ignored_progress = 0
        while len(builder.selected) < size:
            i, used_filtered = builder.exploitation_pick(score, ~progress_block, order)
            if i is None:
                break
            ignored_progress += used_filtered
            builder.add(i, "exploitation")
        metrics = {
            "progress_filtered": float(progress_block.sum()),
            "progress_filter_ignored": float(ignored_progress),
            "cap_relaxations": float(builder.relaxations),
        }
        return builder.selected, builder.phases, metrics

    # ---- observation ---------------------------------------------------------------------------
    @property
    def observed_steps(self) -> set[int]:
        """The selections with at least one observed task."""
        return {s for s, nodes in self.observed.items() if nodes}

    def in_flight(self) -> dict[int, list[str]]:
        """``{selection: [task id, ...]}``: the tasks selected and neither observed nor dropped, in selection order
        (selections with none are left out)."""
        return {s: [self.pool.task_ids[i] for i in self.selections[s].tolist() if i in self._open[s]] for s in sorted(self._open)}

    def in_flight_mask(self) -> np.ndarray:
        """Bool mask over the pool of the tasks in flight in any selection: ``select(..., exclude=in_flight_mask())``."""
        mask = np.zeros(len(self.pool), dtype=bool)
        for nodes in self._open.values():
            mask[list(nodes)] = True
        return mask

    def observe(
        self,
        step: int,
        rewards: Mapping[str, Sequence[float]],
        trajectories: Mapping[str, Sequence[Sequence[Mapping[str, Any]]]] | None = None,
    ) -> dict[str, float]:
        """Record the rewards of rolled-out tasks of selection ``step`` (Eq. 2); optionally the saved action
        sequences (aligned with the rewards) for the identifier filter.  Returns the selection's metrics.

        A selection may be observed in any number of calls, in any order across selections (an asynchronous trainer
        trains groups of several selections in one step, and one selection's groups over several steps), each
        (selection, task) exactly once.  All or nothing: the whole call is validated before any state changes, and
        a refused call raises ``ObservationError`` (``UnknownTaskError`` for an id outside the pool) naming the task,
        leaving the scheduler exactly as it was; retrying with the corrected input gives the state a correct first
        call gives.  Refused: a step never selected, a task outside that step's batch, a task already observed or
        dropped (``drop()``) for that step, a group that is not a list of numbers (e.g. a scalar), an empty group,
        more than K = ``rollouts_per_task`` rewards, non-finite rewards, rewards outside ``reward_range`` (beyond
        ``reward_range_tolerance``; within it they are clipped), trajectories of a task without rewards.  Accepted:
        a subset of the batch, and fewer than K rewards per task (unscored rollouts are skipped), counted in
        ``short_groups`` / ``missing_rewards``.

        Observations are logged under the selection that chose them, whenever they arrive: the half-life decay
        (Eq. 4, 6) ages them from that selection, since their rollouts came from the policy of about that time.
        The paper's N_t(i), the nodes observed before t (§2.2), is what the log holds when selection t is made:
        every logged selection precedes t.  An observation arriving after t was chosen counts for later selections;
        ``predict(t)`` asked afterwards rebuilds N_t(i) from the observations of the selections before t, so it
        includes it and may differ from the prediction t was chosen with (the diagnostics use the one remembered at
        selection).  The progress filter (App. C) records a task's observations in selection order: one whose
        selection precedes the task's latest recorded observation (a task chosen again while in flight, observed
        late) is left out of it and counted in ``progress_out_of_order``.

        The metrics of the selection cover every observation of it so far: the realised statistics and the
        prediction diagnostics (Spearman of q and v-hat with the realised variance, per evidence type) over all its
        observed groups, ``short_groups`` / ``missing_rewards`` / ``observe_time_s`` summed over the calls.  With
        ``relation_weights: measured`` each call's groups are one update of the relation weights.
        """
        t0 = time.perf_counter()
        groups = self._validate_observation(step, rewards, trajectories)
        step = int(step)
        checks = self._identifier_checks(step, groups, trajectories) if trajectories and self.cfg.identifier_filter else []
        # ---- commit (nothing below raises on caller input) ----
        nodes, ms, vs, ds = [], [], [], []
        for _tid, i, r in groups:
            m, v, d = group_statistics(r, self.cfg.dispersion_floor)
            self.log.add(i, step, m, v, d)
            nodes.append(i), ms.append(m), vs.append(v), ds.append(d)
        self.observed.setdefault(step, set()).update(nodes)
        nodes_a = np.asarray(nodes, dtype=np.int64)
        self.obs_count[nodes_a] += 1
        if self._neighbors is not None:
            self._neighbors.add_observed(nodes_a)
            self.graph.release_pages()
        out_of_order = self._progress_observe(step, nodes_a, np.asarray(ms), np.asarray(vs))
        self._apply_identifier_checks(checks)
        self._pred_cache = None
        K = self.cfg.rollouts_per_task
        sizes = np.asarray([len(r) for _, _, r in groups])
        before = self._metrics.get(step, {})
        metrics = self._realised_metrics(step)
        metrics.update({
            "short_groups": before.get("short_groups", 0.0) + float(np.sum(sizes < K)),
            "missing_rewards": before.get("missing_rewards", 0.0) + float(np.sum(K - sizes)),
            "identifier_filtered": float(self.counters["identifier_filtered"]),
            "identifier_checked": float(self.counters["identifier_checked"]),
            "replay_mismatch": float(self.counters["replay_mismatch"]),
        })
        if out_of_order:
            metrics["progress_out_of_order"] = before.get("progress_out_of_order", 0.0) + float(out_of_order)
        metrics.update(self._prediction_metrics(step, nodes_a, {"v": np.asarray(vs), "m": np.asarray(ms), "d": np.asarray(ds)}))
        if trajectories:
            used = self._tools_used.setdefault(step, set())
            used.update((int(self.env[self.pool.index[t]]), a.get("name")) for t, trajs in trajectories.items() for traj in trajs for a in traj)
            metrics["tools_used_per_batch"] = float(len(used))
        self._close_resolved(step, nodes_a)
        metrics["observe_time_s"] = before.get("observe_time_s", 0.0) + time.perf_counter() - t0
        merged = {**before, **metrics}
        merged["schedule_time_s"] = merged.get("select_time_s", 0.0) + merged["observe_time_s"]
        self._metrics[step] = merged
        return self.metrics(step)

    def drop(self, step: int, task_ids: Iterable[str]) -> dict[str, float]:
        """Tasks of selection ``step`` that will never be observed (e.g. groups an asynchronous trainer evicted):
        they leave the in-flight set without an observation (nothing is logged: an evicted group says nothing
        about the task's informativeness).  Returns the selection's metrics (``dropped_groups`` counts them).

        All or nothing, as ``observe()``: refused with ``ObservationError`` (``UnknownTaskError`` for an id outside
        the pool) and no state change: a step never selected, task ids given as a string or a non-iterable, a
        task outside the step's batch, a task already observed or dropped for the step, a task twice in the call.
        An empty ``task_ids`` changes nothing."""
        nodes = self._validate_drop(step, task_ids)
        step = int(step)
        if nodes:
            self._close_resolved(step, np.asarray(nodes, dtype=np.int64))
            metrics = self._metrics.setdefault(step, {})
            metrics["dropped_groups"] = metrics.get("dropped_groups", 0.0) + float(len(nodes))
        return self.metrics(step)

    def _validate_drop(self, step: Any, task_ids: Any) -> list[int]:
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
            raise ObservationError(f"drop(): step must be an integer, got {step!r}")
        step = int(step)
        where = f"drop(step={step})"
        if isinstance(task_ids, (str, bytes, Mapping)) or not isinstance(task_ids, Iterable):
            raise ObservationError(f"{where}: task_ids must be a list of task ids, got {type(task_ids).__name__}", step=step)
        ids = list(task_ids)
        if not ids:
            return []
        if step not in self.selections:
            raise ObservationError(f"{where}: step {step} was never selected; task ids given: {_preview(ids)}", step=step, task_id=ids[0])
        batch = set(self.selections[step].tolist())
        nodes: list[int] = []
        for tid in ids:
            i = self.pool.index.get(tid) if isinstance(tid, str) else None
            if i is None:
                raise UnknownTaskError(f"{where}: unknown task_id {tid!r} (not in the pool)", step=step, task_id=tid)
            if i not in batch:
                raise ObservationError(f"{where}: task {tid!r} is not in step {step}'s batch", step=step, task_id=tid)
            if i in nodes:
                raise ObservationError(f"{where}: task {tid!r} is given twice", step=step, task_id=tid)
            self._refuse_resolved(where, step, tid, i)
            nodes.append(i)
        return nodes

    def _refuse_resolved(self, where: str, step: int, tid: str, i: int) -> None:
        """Raise when task ``tid`` (node ``i``) of selection ``step`` is no longer in flight."""
        if i in self.observed.get(step, ()):
            raise ObservationError(f"{where}: task {tid!r} of step {step} was already observed; each (step, task) is observed once", step=step, task_id=tid)
        if i not in self._open.get(step, ()):
            raise ObservationError(f"{where}: task {tid!r} of step {step} was dropped; a dropped task is not observed", step=step, task_id=tid)

    def _close_resolved(self, step: int, nodes: np.ndarray) -> None:
        """``nodes`` of selection ``step`` are no longer in flight; a selection with none left loses its selection
        record and tool set (nothing more of it can be observed)."""
        still = self._open.get(step)
        if still is None:
            return
        still.difference_update(nodes.tolist())
        if not still:
            del self._open[step]
            self.selection_predictions.pop(step, None)
            self._tools_used.pop(step, None)

    def _progress_observe(self, step: int, nodes: np.ndarray, m: np.ndarray, v: np.ndarray) -> int:
        """Feed the progress filter (App. C) the observations that come after each task's latest recorded one (its
        transitions run forward in selection order); returns how many were left out for arriving out of order."""
        pf = self.progress
        keep = (pf.count[nodes] == 0) | (pf.last_step[nodes] < step)
        if keep.any():
            pf.observe(step, nodes[keep], m[keep], v[keep])
        return int((~keep).sum())

    def _realised_metrics(self, step: int) -> dict[str, float]:
        """Eq. 2 statistics over every observed group of selection ``step`` (from the log)."""
        obs = self.log.arrays()
        at = obs["step"] == step
        va, ma = obs["v"][at], obs["m"][at]
        return {
            "realized_var_mean": float(va.mean()),
            "realized_var_median": float(np.median(va)),
            "realized_reward_mean": float(np.mean(ma)),
            "realized_reward_median": float(np.median(ma)),
            "zero_var_fraction": float(np.mean(va <= 1e-12)),
            "observed_groups": float(at.sum()),
            "unobserved_selected": float(len(self.selections[step]) - int(at.sum())),
        }

    def _validate_observation(
        self,
        step: Any,
        rewards: Any,
        trajectories: Any,
    ) -> list[tuple[str, int, np.ndarray]]:
        """Check a whole observe() call without changing state; returns (task id, node, rewards) per group.

        Rewards within ``reward_range_tolerance`` outside ``reward_range`` come back clipped into it.
        """
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
            raise ObservationError(f"observe(): step must be an integer, got {step!r}")
        step = int(step)
        where = f"observe(step={step})"
        if not isinstance(rewards, Mapping):
            raise ObservationError(f"{where}: rewards must be a mapping {{task_id: [r_1, ..., r_K]}}, got {type(rewards).__name__}", step=step)
        if not rewards:
            raise ObservationError(f"{where}: needs at least one task's rewards", step=step)
        ids = [str(t) for t in rewards]
        if step not in self.selections:
            raise ObservationError(f"{where}: step {step} was never selected (call select({step}) first); rewards given for {_preview(ids)}", step=step, task_id=ids[0])
        batch = set(self.selections[step].tolist())
        K = self.cfg.rollouts_per_task
        lo, hi = self.cfg.reward_range
        tol = self.cfg.reward_range_tolerance
        out = []
        for tid, group in rewards.items():
            i = self.pool.index.get(tid) if isinstance(tid, str) else None
            if i is None:
                raise UnknownTaskError(f"{where}: unknown task_id {tid!r} (not in the pool)", step=step, task_id=tid)
            if i not in batch:
                raise ObservationError(f"{where}: task {tid!r} is not in step {step}'s batch", step=step, task_id=tid)
            self._refuse_resolved(where, step, tid, i)
            if isinstance(group, (str, bytes, Mapping)) or not isinstance(group, (Sequence, np.ndarray)):
                kind = "a scalar" if isinstance(group, (int, float, np.number)) else f"a {type(group).__name__}"
                raise ObservationError(f"{where}: task {tid!r}: rewards must be a list of 1..{K} numbers, got {kind} ({group!r})", step=step, task_id=tid)
            missing = [k for k, x in enumerate(group) if x is None] if not isinstance(group, np.ndarray) else []
            if missing:
                raise ObservationError(f"{where}: task {tid!r}: reward {missing[0]} is missing (None); leave an "
                                       "unscored rollout out of the group rather than passing None",
                                       step=step, task_id=tid)
            try:
                r = np.asarray(group, dtype=np.float64)
            except (TypeError, ValueError):
                raise ObservationError(f"{where}: task {tid!r}: rewards must be numbers, got {list(group)!r}", step=step, task_id=tid) from None
            if r.ndim != 1:
                raise ObservationError(f"{where}: task {tid!r}: rewards must be a flat list of numbers, got shape {r.shape}", step=step, task_id=tid)
            if r.size == 0:
                raise ObservationError(f"{where}: task {tid!r}: empty reward group (leave a task without scored rollouts out)", step=step, task_id=tid)
            if r.size > K:
                raise ObservationError(f"{where}: task {tid!r}: {r.size} rewards, more than K = rollouts_per_task = {K}", step=step, task_id=tid)
            if not np.all(np.isfinite(r)):
                raise ObservationError(f"{where}: task {tid!r}: non-finite reward in {r.tolist()}", step=step, task_id=tid)
            if r.min() < lo - tol or r.max() > hi + tol:
                bad = r[(r < lo - tol) | (r > hi + tol)]
                raise ObservationError(
                    f"{where}: task {tid!r}: reward {float(bad[0])!r} outside reward_range [{lo}, {hi}] (tolerance {tol})", step=step, task_id=tid
                )
            out.append((tid, int(i), np.clip(r, lo, hi)))
        if trajectories is not None:
            self._validate_trajectories(where, step, rewards, trajectories)
        return out

    @staticmethod
    def _validate_trajectories(where: str, step: int, rewards: Mapping[str, Any], trajectories: Any) -> None:
        if not isinstance(trajectories, Mapping):
            raise ObservationError(f"{where}: trajectories must be a mapping {{task_id: [actions, ...]}}, got {type(trajectories).__name__}", step=step)
        for tid, trajs in trajectories.items():
            if tid not in rewards:
                raise ObservationError(f"{where}: trajectories given for task {tid!r}, which has no rewards in this call", step=step, task_id=tid)
            if isinstance(trajs, (str, bytes, Mapping)) or not isinstance(trajs, Sequence):
                raise ObservationError(f"{where}: task {tid!r}: trajectories must be a list of action sequences", step=step, task_id=tid)
            for k, traj in enumerate(trajs):
                if isinstance(traj, (str, bytes, Mapping)) or not isinstance(traj, Sequence) or not all(isinstance(a, Mapping) for a in traj):
                    raise ObservationError(f"{where}: task {tid!r}: trajectory {k} must be a list of action objects", step=step, task_id=tid)

    def _identifier_checks(self, step: int, groups: list[tuple[str, int, np.ndarray]], trajectories: Mapping[str, Sequence[Sequence[Mapping[str, Any]]]]) -> list[tuple[int, IdentifierCheck]]:
        """App. C identifier filter, computed before the commit (no state changes): for each task with
        trajectories, replay its highest-reward ones (at most ``identifier_max_checks_per_task`` that are
        not clean) until one is filtered.  Returns (node, check) per examined non-clean trajectory."""
        cfg = self.cfg
        out: list[tuple[int, IdentifierCheck]] = []
        for tid, i, r in groups:
            trajs = trajectories.get(tid)
            if not trajs or not self.available[i]:
                continue
            rs = r.tolist()
            order = sorted(range(min(len(rs), len(trajs))), key=lambda k: -rs[k])
            checked = 0
            for k in order:
                if rs[k] < cfg.identifier_min_reward or checked >= cfg.identifier_max_checks_per_task:
                    break
                res = self.identifier.check(self.pool[i], float(rs[k]), trajs[k])
                if res.outcome == "clean":
                    continue
                checked += 1
                out.append((i, res))
                if res.outcome == "filtered":
                    break
        return out

    def _apply_identifier_checks(self, checks: list[tuple[int, IdentifierCheck]]) -> None:
        for i, res in checks:
            self.counters["identifier_checked"] += 1
            if res.outcome == "filtered":
                self.available[i] = False
                self.counters["identifier_filtered"] += 1
                log.info("envsched: identifier filter removed %s (replay %.4f -> %.4f)", res.task_id, res.replay_reward, res.reduced_reward)
            elif res.outcome in ("replay_mismatch", "replay_error"):
                self.counters[res.outcome] += 1

    def _prediction_metrics(self, step: int, nodes: np.ndarray, realised: dict[str, np.ndarray]) -> dict[str, float]:
        """Prediction diagnostics of selection ``step`` (see ``estimate.prediction_diagnostics``) over all of its
        groups observed so far: Spearman correlation of the score q (Eq. 13) and of v-hat (Eq. 4) remembered at
        selection with the realised variance v (Eq. 2), per evidence type.  With ``relation_weights: measured``
        this call's groups (``nodes``, ``realised``) update the relation weights (``relations.RelationWeights.update``)."""
        rec = self.selection_predictions.get(step)
        if rec is None:
            return {}
        pos = {int(n): k for k, n in enumerate(self.selections[step].tolist())}
        obs = self.log.arrays()
        mine = obs["step"] == step
        at_all = np.asarray([pos[int(n)] for n in obs["node"][mine]], dtype=np.int64)
        out = prediction_diagnostics(rec["q"][at_all], obs["v"][mine], rec["evidence"][at_all], rec["v"][at_all])
        if self.relation_weights is not None:
            at = np.asarray([pos[int(n)] for n in nodes], dtype=np.int64)
            sources = {k[4:]: a[at] for k, a in rec.items() if k.startswith("src:")}
            if sources:
                self.relation_weights.update(step, sources, realised)
            out.update(self.relation_weights.metrics())
        return out

    # ---- metrics ---------------------------------------------------------------------------------
    def _selection_metrics(self, step: int, sel: np.ndarray, phases: list[str]) -> dict[str, float]:
        tools = set()
        for i in sel:
            t = self.pool[int(i)]
            names = [a.name for a in t.gold_actions] or [tl.name for tl in t.tools]
            tools.update((t.env_id, nm) for nm in names)
        out = {
            "step": float(step),
            "batch_size": float(len(sel)),
            "envs_per_batch": float(len(np.unique(self.env[sel]))) if len(sel) else 0.0,
            "tools_per_batch": float(len(tools)),
            "coverage_count": float(phases.count("coverage")),
            "exploitation_count": float(phases.count("exploitation")),
            "cold_start_count": float(phases.count("cold_start")),
            "random_count": float(phases.count("random")),
            "identifier_filtered": float(self.counters["identifier_filtered"]),
        }
        if self.cfg.scheduler == "envsched" and len(sel):
            pred = self.predict(step)
            out["predicted_var_mean"] = float(pred.v[sel].mean())
            out["predicted_q_mean"] = float(pred.q[sel].mean())
        return out

    def metrics(self, step: int | None = None) -> dict[str, float]:
        """Flat ``{"envsched/<name>": float}`` metrics of ``step`` (default: latest)."""
        if not self._metrics:
            return {}
        step = max(self._metrics) if step is None else step
        return {PREFIX + k: float(v) for k, v in self._metrics.get(step, {}).items()}

    # ---- checkpointing -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything select() and observe() depend on, the tasks in flight included (numpy arrays and plain Python
        values; pickle/torch.save-able)."""
        steps = sorted(self.selections)
        state: dict[str, Any] = {
            "version": STATE_VERSION,
            "pool_fingerprint": self.pool.fingerprint(),
            "config": self.cfg.to_dict(),
            "log": self.log.state_dict(),
            "obs_count": self.obs_count.copy(),
            "sel_count": self.sel_count.copy(),
            "available": self.available.copy(),
            "selection_steps": np.asarray(steps, dtype=np.int64),
            "selections": [self.selections[s].copy() for s in steps],
            "selection_phases": [list(self.selection_phases[s]) for s in steps],
            "rng": self.rng.bit_generator.state,
            "progress": self.progress.state_dict(),
            "counters": dict(self.counters),
            "metrics": {int(k): dict(v) for k, v in self._metrics.items()},
            "neighbors": self._neighbors.state_dict() if self._neighbors is not None else None,
            "selection_predictions": {int(s): {k: a.copy() for k, a in rec.items()} for s, rec in self.selection_predictions.items()},
            "relation_weights": self.relation_weights.state_dict() if self.relation_weights is not None else None,
            # in flight: per selection with tasks neither observed nor dropped, those nodes in selection order (the
            # observed ones are the log's; the others of a selection were dropped)
            "open_steps": np.asarray(sorted(self._open), dtype=np.int64),
            "open": [np.asarray([i for i in self.selections[s].tolist() if i in self._open[s]], dtype=np.int64) for s in sorted(self._open)],
            "tools_used": {int(s): sorted(([int(e), name] for e, name in used), key=repr) for s, used in self._tools_used.items()},
        }
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict()``'s output.  A version-1 state (saved before the in-flight record, by a synchronous
        trainer after observing its step) loads with nothing in flight: its selections count as resolved, their
        unobserved tasks as dropped, so its selection records are not kept."""
        if state.get("version") not in (1, STATE_VERSION):
            raise ValueError(f"unsupported envsched state version {state.get('version')!r}")
        if state["pool_fingerprint"] != self.pool.fingerprint():
            raise ValueError("envsched state was saved for a different task pool (task ids / environments differ)")
        saved = EnvSchedConfig.from_dict(state["config"])
        if saved != self.cfg:
            diff = sorted(k for k, v in saved.to_dict().items() if self.cfg.to_dict().get(k) != v)
            log.warning("envsched: loading state saved with different config values for %s", diff)
        self.log.load_state_dict(state["log"])
        self.obs_count = np.asarray(state["obs_count"], dtype=np.int64).copy()
        self.sel_count = np.asarray(state["sel_count"], dtype=np.int64).copy()
        self.available = np.asarray(state["available"], dtype=bool).copy()
        steps = [int(s) for s in state["selection_steps"]]
        self.selections = {s: np.asarray(a, dtype=np.int64).copy() for s, a in zip(steps, state["selections"])}
        self.selection_phases = {s: list(p) for s, p in zip(steps, state["selection_phases"])}
        self.rng = np.random.Generator(np.random.PCG64())
        self.rng.bit_generator.state = state["rng"]
        self.progress.load_state_dict(state["progress"])
        self.counters = dict(state["counters"])
        self._metrics = {int(k): dict(v) for k, v in state["metrics"].items()}
        self.observed = self._observed_from_log()
        in_flight = state["version"] >= 2
        open_steps = [int(s) for s in state["open_steps"]] if in_flight else []
        self._open = {s: set(np.asarray(a, dtype=np.int64).tolist()) for s, a in zip(open_steps, state["open"] if in_flight else [])}
        saved_pred = (state.get("selection_predictions") or {}) if in_flight else {}  # absent before the diagnostics
        self.selection_predictions = {int(s): {k: np.asarray(a).copy() for k, a in rec.items()} for s, rec in saved_pred.items()}
        self._tools_used = {int(s): {(int(e), name) for e, name in used} for s, used in state["tools_used"].items()} if in_flight else {}
        if self.relation_weights is not None:
            rw_state = state.get("relation_weights")  # absent or None: saved without measured weights, start afresh
            self.relation_weights = RelationWeights(self.cfg)
            if rw_state is not None:
                self.relation_weights.load_state_dict(rw_state)
        self._pred_cache = None
        if state.get("neighbors") is not None and saved == self.cfg:
            nb = NeighborIndex(self.graph, self.cfg.k_within, self.cfg.k_cross, self.cfg.min_neighbor_similarity)
            nb.load_state_dict(state["neighbors"])
            self._neighbors = nb
        else:
            # rebuilt from the observed set on first use, under this config: a state saved with other neighbour
            # counts or graph settings holds neighbour lists of another width or graph
            self._neighbors = None

    def _observed_from_log(self) -> dict[int, set[int]]:
        """The observed nodes of each selection: the log's nodes grouped by their step."""
        obs = self.log.arrays()
        order = np.argsort(obs["step"], kind="stable")
        steps, nodes = obs["step"][order], obs["node"][order]
        keys, starts = np.unique(steps, return_index=True)
        return {int(k): set(part.tolist()) for k, part in zip(keys, np.split(nodes, starts[1:]))}
