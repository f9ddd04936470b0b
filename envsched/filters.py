"""Candidate-eligibility filters (EnvSched §2.4, Appendix C).

* ``ProgressFilter`` — a ridge predictor (scikit-learn ``Ridge``) of the later mean reward of adjacent
  observations of the same task from (earlier mean, earlier mean squared, earlier variance, training step,
  observation count, environment category).  Each transition is scored by a model fit only on transitions
  that ended at earlier training steps.  A task's residual history is shrunk toward its environment's and
  its graph neighbours' mean residuals; a task with >= 3 scorable transitions and a non-positive estimate is
  removed from exploitation (it stays eligible for coverage).
* ``IdentifierFilter`` — for high-reward trajectories with suspicious actions (identifiers not obtainable
  from the permitted context, or created objects that duplicate existing records), replay the saved fixed
  action sequence through a user-supplied ``replay(task_id, actions) -> reward``; require agreement within
  1e-4; remove the suspicious action and its dependent edits, replay again, and filter the task (from both
  phases) only if the reward drops.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.sparse as sp
from scipy import linalg
from sklearn.linear_model import Ridge

from .config import EnvSchedConfig
from .operations import MUTATING, _flat_values, _is_id_key, _looks_like_id, tool_operation_type
from .pool import Task

log = logging.getLogger(__name__)

ReplayFn = Callable[[str, list], float]


# ---------------------------------------------------------------------------------------------------
# Progress filter
# ---------------------------------------------------------------------------------------------------

_TCOLS = ("node", "env", "step_prev", "step_next", "m_prev", "v_prev", "count_prev", "m_next", "residual")


_FLOAT_COLS = ("m_prev", "v_prev", "m_next", "residual")
_DENSE_MAX_ENVS = 256  # up to this many environments the Ridge design matrix is dense


def ridge_fit_dense(X: np.ndarray, y: np.ndarray, alpha: float) -> tuple[np.ndarray, float]:
    """scikit-learn ``Ridge(alpha, fit_intercept=True, solver="auto").fit(X, y)`` for dense float64 X,
    without the estimator's validation overhead: the same operations in the same order (centering, then the
    Cholesky solve of the primal normal equations, or of the kernel ones when features > samples).
    Returns (coef, intercept)."""
    X = np.array(X, dtype=np.float64, order="C")  # copy, as Ridge does
    y = np.array(y, dtype=np.float64)
    n, p = X.shape
    x_off = np.average(X, axis=0)
    X -= x_off
    y_off = np.average(y, axis=0)
    y -= y_off
    y2 = y.reshape(-1, 1)
    try:
        if p > n:
            K = X @ X.T
            K.flat[:: n + 1] += alpha
            dual = linalg.solve(K, y2, assume_a="pos", overwrite_a=False)
            coef = (X.T @ dual).T
        else:
            A = X.T @ X
            Xy = X.T @ y2
            A.flat[:: p + 1] += alpha
            coef = linalg.solve(A, Xy, assume_a="pos", overwrite_a=True).T
    except linalg.LinAlgError:  # singular (alpha = 0): the estimator itself, with its SVD fallback
        model = Ridge(alpha=alpha, solver="auto").fit(X + x_off, y + y_off)
        return model.coef_, float(model.intercept_)
    coef = coef.ravel()
    return coef, y_off - x_off @ coef


class ProgressFilter:
    """Ridge-based progress estimate per task (App. C)."""

    def __init__(self, cfg: EnvSchedConfig, env: np.ndarray, n_envs: int):
        self.cfg, self.env, self.n_envs = cfg, env, n_envs
        n = len(env)
        self.last_m = np.full(n, np.nan)  # latest observation of each task
        self.last_v = np.full(n, np.nan)
        self.last_step = np.full(n, -1, dtype=np.int64)
        self.count = np.zeros(n, dtype=np.int64)
        self._set_columns({k: np.zeros(0, dtype=np.float64 if k in _FLOAT_COLS else np.int64) for k in _TCOLS})

    # ---- transition storage: preallocated columns that grow by doubling ---------------------------------
    def _set_columns(self, cols: Mapping[str, np.ndarray]) -> None:
        self._n = len(cols["node"])
        cap = max(256, 2 * self._n)
        self._cols = {}
        for k in _TCOLS:
            a = np.empty(cap, dtype=np.float64 if k in _FLOAT_COLS else np.int64)
            a[: self._n] = cols[k]
            self._cols[k] = a

    def _append(self, new: Mapping[str, np.ndarray]) -> None:
        add = len(new["node"])
        if self._n + add > len(self._cols["node"]):
            cap = max(2 * len(self._cols["node"]), self._n + add)
            for k, a in self._cols.items():
                grown = np.empty(cap, dtype=a.dtype)
                grown[: self._n] = a[: self._n]
                self._cols[k] = grown
        for k in _TCOLS:
            self._cols[k][self._n : self._n + add] = new[k]
        self._n += add

    def _view(self) -> dict[str, np.ndarray]:
        return {k: a[: self._n] for k, a in self._cols.items()}

    @staticmethod
    def features(m_prev: np.ndarray, v_prev: np.ndarray, step_prev: np.ndarray, count_prev: np.ndarray, env: np.ndarray, n_envs: int) -> sp.csr_matrix:
        """Earlier mean, its square, earlier variance, training step, observation count, one-hot environment."""
        num = np.column_stack([m_prev, m_prev**2, v_prev, step_prev, count_prev]).astype(np.float64)
        onehot = sp.csr_matrix((np.ones(len(env)), (np.arange(len(env)), env)), shape=(len(env), n_envs))
        return sp.hstack([sp.csr_matrix(num), onehot], format="csr")

    @staticmethod
    def features_dense(m_prev: np.ndarray, v_prev: np.ndarray, step_prev: np.ndarray, count_prev: np.ndarray, env: np.ndarray, n_envs: int) -> np.ndarray:
        """``features(...).toarray()`` built directly."""
        X = np.zeros((len(env), 5 + n_envs))
        X[:, 0] = m_prev
        X[:, 1] = np.asarray(m_prev, dtype=np.float64) ** 2
        X[:, 2] = v_prev
        X[:, 3] = step_prev
        X[:, 4] = count_prev
        X[np.arange(len(env)), 5 + np.asarray(env, dtype=np.int64)] = 1.0
        return X

    def observe(self, step: int, nodes: np.ndarray, m: np.ndarray, v: np.ndarray) -> int:
        """Record the observations of ``step``; score the transitions that end here.  Returns #scored."""
        nodes = np.asarray(nodes, dtype=np.int64)
        m, v = np.asarray(m, dtype=np.float64), np.asarray(v, dtype=np.float64)
        if len(np.unique(nodes)) != len(nodes):  # a task twice in one step: one after the other
            return sum(self.observe(step, nodes[k : k + 1], m[k : k + 1], v[k : k + 1]) for k in range(len(nodes))) if len(nodes) else 0
        old = nodes[self.count[nodes] > 0]
        first_new = self._n
        if len(old):
            self._append({
                "node": old, "env": self.env[old], "step_prev": self.last_step[old], "step_next": np.full(len(old), int(step)),
                "m_prev": self.last_m[old], "v_prev": self.last_v[old], "count_prev": self.count[old],
                "m_next": m[self.count[nodes] > 0], "residual": np.full(len(old), np.nan),
            })
        self.last_m[nodes], self.last_v[nodes], self.last_step[nodes] = m, v, step
        self.count[nodes] += 1
        if not len(old):
            return 0
        arr = self._view()
        train = np.flatnonzero(arr["step_next"] < step)  # only transitions from earlier completed training steps
        if len(train) < self.cfg.progress_min_fit_transitions:
            return 0
        rows = np.arange(first_new, self._n)
        alpha = self.cfg.progress_ridge_alpha
        if self.n_envs <= _DENSE_MAX_ENVS:
            feats = lambda r: self.features_dense(arr["m_prev"][r], arr["v_prev"][r], arr["step_prev"][r], arr["count_prev"][r], arr["env"][r], self.n_envs)
            coef, intercept = ridge_fit_dense(feats(train), arr["m_next"][train], alpha)
            pred = feats(rows) @ coef + intercept
        else:
            X = self._X(arr)
            model = Ridge(alpha=alpha, solver="auto")
            model.fit(X[train], arr["m_next"][train])
            pred = model.predict(X[rows])
        self._cols["residual"][rows] = arr["m_next"][rows] - pred
        return len(rows)

    def _X(self, arr: dict[str, np.ndarray]) -> sp.csr_matrix:
        return self.features(arr["m_prev"], arr["v_prev"], arr["step_prev"], arr["count_prev"], arr["env"], self.n_envs)

    def arrays(self) -> dict[str, np.ndarray]:
        """The scored and unscored transitions (copies), one array per column of ``_TCOLS``."""
        return {k: a.copy() for k, a in self._view().items()}

    def blocked(self, nbr_idx: Sequence[np.ndarray]) -> np.ndarray:
        """Bool mask of tasks removed from exploitation: >= min transitions and estimated residual <= 0."""
        n = len(self.env)
        arr = self._view()
        ok = np.isfinite(arr["residual"])
        node, res = arr["node"][ok], arr["residual"][ok]
        cnt = np.bincount(node, minlength=n)
        cand = np.flatnonzero(cnt >= self.cfg.progress_min_transitions)
        out = np.zeros(n, dtype=bool)
        if len(cand) == 0:
            return out
        task_mean = np.bincount(node, weights=res, minlength=n) / np.maximum(cnt, 1)
        env_cnt = np.bincount(self.env[node], minlength=self.n_envs)
        env_mean = np.bincount(self.env[node], weights=res, minlength=self.n_envs) / np.maximum(env_cnt, 1)
        refs = []
        ref_env = np.where(env_cnt[self.env[cand]] > 0, env_mean[self.env[cand]], np.nan)
        refs.append(ref_env)
        if nbr_idx:
            nb = np.concatenate([a[cand] for a in nbr_idx], axis=1)
            has = (nb >= 0) & (cnt[np.maximum(nb, 0)] > 0)
            s = np.where(has, task_mean[np.maximum(nb, 0)], 0.0).sum(axis=1)
            c = has.sum(axis=1)
            refs.append(np.where(c > 0, s / np.maximum(c, 1), np.nan))
        ref_stack = np.vstack(refs)
        avail = np.isfinite(ref_stack)
        ref = np.where(avail.any(axis=0), np.where(avail, ref_stack, 0).sum(axis=0) / np.maximum(avail.sum(axis=0), 1), 0.0)
        k, s = cnt[cand], self.cfg.progress_shrinkage
        est = (k * task_mean[cand] + s * ref) / (k + s)
        out[cand[est <= 0.0]] = True
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"last_m": self.last_m.copy(), "last_v": self.last_v.copy(), "last_step": self.last_step.copy(), "count": self.count.copy(), **{f"t_{k}": v for k, v in self.arrays().items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.last_m = np.asarray(state["last_m"], dtype=np.float64).copy()
        self.last_v = np.asarray(state["last_v"], dtype=np.float64).copy()
        self.last_step = np.asarray(state["last_step"], dtype=np.int64).copy()
        self.count = np.asarray(state["count"], dtype=np.int64).copy()
        self._set_columns({k: np.asarray(state[f"t_{k}"], dtype=np.float64 if k in _FLOAT_COLS else np.int64) for k in _TCOLS})


# ---------------------------------------------------------------------------------------------------
# Identifier filter
# ---------------------------------------------------------------------------------------------------


def _action_name(a: Mapping[str, Any]) -> str:
    return str(a.get("name") or a.get("function", {}).get("name") or "")


def _action_args(a: Mapping[str, Any]) -> dict[str, Any]:
    args = a.get("arguments")
    if args is None and isinstance(a.get("function"), Mapping):
        args = a["function"].get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return {}
    return dict(args) if isinstance(args, Mapping) else {}


def _output_text(a: Mapping[str, Any]) -> str:
    out = a.get("output", a.get("observation", ""))
    return out if isinstance(out, str) else json.dumps(out, default=str)


def find_suspicious_actions(task: Task, actions: Sequence[Mapping[str, Any]]) -> list[int]:
    """Default detector (App. C): indices of actions that use an identifier not obtainable from the permitted
    context (instruction, initial state, outputs of earlier actions), or that create an object duplicating an
    existing record (all its non-identifier values already present in the initial state)."""
    context = f"{task.instruction} {task.initial_state}".lower()
    seen_outputs = ""
    bad = []
    for k, a in enumerate(actions):
        args = _action_args(a)
        typ = tool_operation_type(_action_name(a))
        ids = [str(v).lower() for key, v in args.items() if v is not None and not isinstance(v, (bool, dict, list)) and (_is_id_key(key) or (isinstance(v, str) and _looks_like_id(v)))]
        if typ != "create" and any(i and i not in context and i not in seen_outputs for i in ids):
            bad.append(k)
        elif typ == "create":
            vals = [str(v).lower() for key, v in args.items() if not _is_id_key(key) and isinstance(v, str) and len(v) >= 3]
            state = task.initial_state.lower()
            if len(vals) >= 2 and all(v in state for v in vals):
                bad.append(k)
        seen_outputs += " " + _output_text(a).lower()
    return bad


def dependent_edits(actions: Sequence[Mapping[str, Any]], suspicious: Sequence[int]) -> set[int]:
    """The suspicious actions plus later state-changing actions that reuse their identifiers or output ids."""
    drop = set(suspicious)
    for k in sorted(suspicious):
        args = _action_args(actions[k])
        tainted = {str(v).lower() for key, v in args.items() if isinstance(v, (str, int)) and not isinstance(v, bool) and (_is_id_key(key) or (isinstance(v, str) and _looks_like_id(v)))}
        out = _output_text(actions[k]).lower()
        tainted |= set(re.findall(r"[a-z]{0,6}[-_]?\d[\w-]+", out))
        for j in range(k + 1, len(actions)):
            if tool_operation_type(_action_name(actions[j])) not in MUTATING:
                continue
            vals = {v.lower() for v in _flat_values(_action_args(actions[j]))}
            if vals & tainted:
                drop.add(j)
    return drop


@dataclass
class IdentifierCheck:
    task_id: str
    outcome: str  # "filtered" | "kept" | "replay_mismatch" | "replay_error" | "clean"
    stored_reward: float
    replay_reward: float | None = None
    reduced_reward: float | None = None
    removed: tuple[int, ...] = ()


class IdentifierFilter:
    def __init__(self, cfg: EnvSchedConfig, replay: ReplayFn | None, detector: Callable[[Task, Sequence[Mapping[str, Any]]], list[int]] | None = None):
        self.cfg, self.replay = cfg, replay
        self.detector = detector or find_suspicious_actions

    def check(self, task: Task, reward: float, actions: Sequence[Mapping[str, Any]]) -> IdentifierCheck:
        """App. C procedure for one saved trajectory."""
        sus = self.detector(task, actions)
        if not sus or self.replay is None:
            return IdentifierCheck(task.task_id, "clean", reward)
        tol = self.cfg.replay_tolerance
        try:
            r0 = float(self.replay(task.task_id, list(actions)))
        except Exception as exc:  # noqa: BLE001 - user replay code may raise anything; counted, never fatal
            log.warning("envsched: replay of %s failed: %s", task.task_id, exc)
            return IdentifierCheck(task.task_id, "replay_error", reward)
        if not abs(r0 - reward) <= tol:
            return IdentifierCheck(task.task_id, "replay_mismatch", reward, r0)
        drop = dependent_edits(actions, sus)
        reduced = [a for k, a in enumerate(actions) if k not in drop]
        try:
            r1 = float(self.replay(task.task_id, reduced))
        except Exception as exc:  # noqa: BLE001 - user replay code may raise anything; counted, never fatal
            log.warning("envsched: reduced replay of %s failed: %s", task.task_id, exc)
            return IdentifierCheck(task.task_id, "replay_error", reward, r0)
        outcome = "filtered" if r1 < r0 - tol else "kept"
        return IdentifierCheck(task.task_id, outcome, reward, r0, r1, tuple(sorted(drop)))
