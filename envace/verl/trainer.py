"""envace's verl V1 trainer, the verl-free parts: the per-step view of a trained batch, role labels for the
advantage estimator, per-role metrics, role-tagged dumps, held-out validation.

verl 0.9.1's V1 trainer passes a registered advantage estimator only ``token_level_rewards``,
``response_mask``, ``config`` and ``index`` (the prompt uid); the role of each output lives in the
agent loop's ``extra_fields`` in TransferQueue, written and read as the rollout contract
(:class:`envace.agents.contract.RolloutFields`). envace's trainers (:mod:`envace.verl.trainers`, registered with
verl's ``register_trainer``) read those fields for the step's batch, in batch order, and hand the role labels to
``grpo_rolewise`` through :func:`envace.advantage.role_labels` around verl's own ``_compute_advantage`` —
KL-in-reward, rollout correction and the write-back stay verl's.

One :class:`StepView` per step holds what the trainer's hooks know about the batch: each row's ``extra_fields`` are
read from TransferQueue once (by ``_compute_advantage`` under ``grpo_rolewise``, otherwise together with the
advantages after the update), the fields the update wrote in one more read; the advantage labels, the per-role
metrics, the rollout dump and EnvSched's observation all use it.

It also adds, every step:

* ``envace/act/*`` and ``envace/rehearse/*``: outputs, tokens, advantage mean/std, format-error and
  empty-output rates; trajectory-level calls per trajectory, stop reasons and the masked (unscored) rate;
* ``envace/rehearsal_fidelity/*``: for rehearsed responses whose real counterpart is known, the share
  that equals the real environment's response (normalised JSON), key overlap and error agreement;
* ``envace/staleness/*``, ``envace/groups/version_span_*`` (:func:`staleness_metrics`) and, under rollout
  correction, ``envace/{act,rehearse}/is_weight_mean`` (:func:`role_is_metrics`);
* the :data:`DUMP_COLUMNS` in the per-step rollout dump (``rollouts/N.jsonl``): ``role``, ``trajectory_id``,
  ``advantage`` (the row's advantage), ``env_id``, ``observation_source``, ``simulated_calls`` (calls the
  Trace2Env simulator answered), ...

and, at every validation (:class:`HeldoutValidation`):

* ``val-core/heldout/success/mean@N`` and ``.../sem@N``: held-out success over all validation tasks, sampled as
  ``rollout.val_kwargs`` says (the CPU default: the training temperature, several samples a task), with its
  standard error (:func:`envace.metrics.heldout_estimate`);
* ``val-aux/heldout/success/change`` and ``.../change_sem``: the change since the run's first validation, paired by
  task (:func:`envace.metrics.heldout_change`);
* with ``envace.validation.greedy``, a second, greedy pass over the same tasks (one sample each): verl's own
  per-category metrics under ``val-core/greedy/<pool>/<category>/...`` and ``val-core/heldout_greedy/success/...``;
* each validation's per-task scores in ``<trainer.default_local_dir>/validation/step_<N>.json``: what the change is
  computed from, so a resumed run still compares against its first validation.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from envace.agents.contract import GREEDY_FIELD, RolloutFields, key_group, key_trajectory
from envace.metrics import HELDOUT, HELDOUT_GREEDY, heldout_change, heldout_estimate
from envace.roles import Role
from envace.verl.prompts import Settled

logger = logging.getLogger(__name__)

#: envace's columns in the per-step rollout dump, from each row's rollout contract
DUMP_COLUMNS = ("role", "trajectory_id", "advantage", "env_id", "observation_source", "simulated_calls",
                "rollout_probs_diff_max", "task_id", "dispatch_step", "min_global_steps", "max_global_steps")
#: what the per-row ``rollout_probs_diff_max`` is computed from (present when verl recomputes the old log-probs)
SYNC_FIELDS = ("old_log_probs", "rollout_log_probs", "response_mask")
#: verl's rollout-correction weights, written back with the advantages when ``algorithm.rollout_correction`` sets
#: ``rollout_is`` outside bypass mode
IS_FIELDS = ("rollout_is_weights", "response_mask")


def row_probs_diff_max(old_log_probs: Any, rollout_log_probs: Any, response_mask: Any) -> list[float | None]:
    """Per row, the largest |p_actor - p_rollout| over its response tokens: verl's
    ``training/rollout_probs_diff_max`` (a batch maximum) resolved to the row that sets it, so a failed weight-sync
    check names the role, environment and observation source of the tokens that differ. None: no token."""
    out: list[float | None] = []
    for old, roll, mask in zip(old_log_probs.unbind(0), rollout_log_probs.unbind(0), response_mask.unbind(0),
                               strict=True):
        old, roll = response_tokens(mask, old, roll)
        out.append(float((old.exp() - roll.exp()).abs().max()) if old.numel() else None)
    return out


def response_tokens(mask: Any, *values: Any) -> list[Any]:
    """One row's per-token ``values`` (float) at its response tokens (``mask`` set), over the length all of them
    cover: a row's nested tensors can differ in length by verl's padding."""
    n = min(v.numel() for v in (mask, *values))
    keep = mask.reshape(-1)[:n].bool()
    return [v.reshape(-1)[:n].float()[keep] for v in values]


def read_rows(keys: Sequence[str], extra_fields: Sequence[Mapping[str, Any] | None]) -> list[RolloutFields]:
    """The rollout contract of every row (:meth:`RolloutFields.from_extra_fields`), in batch order; a row that
    breaks it raises :class:`~envace.agents.contract.RolloutFieldsError` naming its key."""
    return [RolloutFields.from_extra_fields(ef, row=key) for key, ef in zip(keys, extra_fields, strict=True)]


def batch_labels(keys: Sequence[str], rows: Sequence[RolloutFields],
                 tags: Sequence[Mapping[str, Any]] | None = None) -> dict[str, np.ndarray]:
    """Per-row role, trajectory, validity and emptiness, in batch order.

    Rows that verl added as padding, or whose reward failed (``verify_failed``), are not valid: they stay out of
    every baseline. Rows of verl's own loops (foreign rows) are ``act``.
    """
    padding = [bool(tags[i].get("is_padding", False)) if tags is not None else False for i in range(len(keys))]
    return {
        "roles": np.array([row.role for row in rows], dtype=object),
        "traj_index": np.array([key_trajectory(key) for key in keys], dtype=object),
        "valid": np.array([not pad and not row.verify_failed for row, pad in zip(rows, padding, strict=True)],
                          dtype=bool),
        "empty": np.array([row.empty for row in rows], dtype=bool),
    }


def role_metrics(
    keys: Sequence[str],
    rows: Sequence[RolloutFields],
    advantages: Sequence[float] | None,
    tags: Sequence[Mapping[str, Any]] | None = None,
) -> dict[str, float]:
    """The per-role and rehearsal-fidelity metrics of one trained batch (see module docstring).

    ``advantages`` holds one value per row (the advantage of the row's first response token).
    """
    by_role: dict[Role, dict[str, list[float]]] = {r: defaultdict(list) for r in Role}
    trajectories: dict[str, RolloutFields] = {}
    for i, (key, row) in enumerate(zip(keys, rows, strict=True)):
        if tags is not None and tags[i].get("is_padding", False):
            continue
        acc = by_role[row.role]
        acc["tokens"].append(float(row.num_tokens))
        acc["format_error"].append(float(row.format_error))
        acc["empty"].append(float(row.empty))
        if advantages is not None and not row.verify_failed:
            acc["advantage"].append(float(advantages[i]))
        trajectories.setdefault(key_trajectory(key), row)
    out: dict[str, float] = {}
    for role, acc in by_role.items():
        name = role.value
        n = len(acc["tokens"])
        out[f"envace/{name}/outputs"] = float(n)
        if not n:
            continue
        out[f"envace/{name}/tokens"] = float(np.sum(acc["tokens"]))
        out[f"envace/{name}/tokens_mean"] = float(np.mean(acc["tokens"]))
        out[f"envace/{name}/format_error_rate"] = float(np.mean(acc["format_error"]))
        out[f"envace/{name}/empty_rate"] = float(np.mean(acc["empty"]))
        if acc["advantage"]:
            out[f"envace/{name}/advantage_mean"] = float(np.mean(acc["advantage"]))
            out[f"envace/{name}/advantage_std"] = float(np.std(acc["advantage"]))
    if trajectories:
        counters = [row.counters for row in trajectories.values()]
        n_traj = len(counters)
        out["envace/trajectories"] = float(n_traj)
        out["envace/act/calls_per_trajectory"] = float(np.mean([c.get("tool_calls", 0.0) for c in counters]))
        out["envace/act/malformed_calls_per_trajectory"] = float(
            np.mean([c.get("malformed_calls", 0.0) for c in counters])
        )
        out["envace/rehearse/malformed_per_trajectory"] = float(
            np.mean([c.get("malformed_rehearsals", 0.0) for c in counters])
        )
        out["envace/masked_rate"] = float(np.mean([row.verify_failed for row in trajectories.values()]))
        stops = Counter(row.stop_reason for row in trajectories.values())
        for reason, count in stops.items():
            out[f"envace/stop_reason/{reason}"] = count / n_traj
        fid = [f for row in trajectories.values() for f in row.fidelity]
        if fid:
            out["envace/rehearsal_fidelity/compared"] = float(len(fid))
            for name in ("exact", "key_overlap", "error_agree"):
                out[f"envace/rehearsal_fidelity/{name}"] = float(np.mean([f[name] for f in fid]))
    return out



def role_is_metrics(rows: Sequence[RolloutFields], weights: Any, mask: Any,
                    tags: Sequence[Mapping[str, Any]] | None = None) -> dict[str, float]:
    """Per role, verl's rollout-correction importance weights over the role's response tokens: their mean
    (``envace/<role>/is_weight_mean``) and how many tokens carry one (``.../is_weighted_tokens``).

    verl computes the weights per token from the trainer's and the rollout's log-probs of every row with a response
    mask, whatever its role (``compute_rollout_correction_and_add_to_batch``); this shows they reach the rehearse
    role's tokens as they reach the act role's, and how far each role's tokens are off-policy."""
    acc: dict[str, list[float]] = defaultdict(list)
    for i, (row, w, m) in enumerate(zip(rows, weights.unbind(0), mask.unbind(0), strict=True)):
        if tags is not None and tags[i].get("is_padding", False):
            continue
        acc[row.role.value].extend(response_tokens(m, w)[0].tolist())
    out: dict[str, float] = {}
    for role, values in acc.items():
        out[f"envace/{role}/is_weighted_tokens"] = float(len(values))
        if values:
            out[f"envace/{role}/is_weight_mean"] = float(np.mean(values))
    return out

def staleness_metrics(keys: Sequence[str], tags: Sequence[Mapping[str, Any]], global_steps: int,
                      threshold: int | None) -> dict[str, float]:
    """How far behind the policy being updated the trained rollouts were generated, per trajectory and per group.

    At step ``N`` the trainer updates weights of version ``N - 1``; a trajectory generated across versions
    ``[min_global_steps, max_global_steps]`` (verl's per-row tags) lags ``(N - 1) - min_global_steps`` versions at
    worst. Each trajectory counts once, however many outputs it has (verl's own
    ``training/off_policy/trajectory_staleness_worst`` weighs rows, so a long rollout counts many times).

    * ``envace/staleness/{mean,max}``: the worst-case lag over the batch's trajectories (0 in a sync run);
    * ``envace/staleness/bound`` and ``.../violations``: ``threshold - 1``, the most a trajectory can lag under
      verl's ``max_off_policy_strategy=drop`` (a group dispatched at step ``t`` is generated on versions ``≥ t - 1``
      and trained only while ``N - t + 1 ≤ threshold``), and how many trajectories lag more: always 0 unless the
      bound is broken. Absent without a threshold.
    * ``envace/groups/version_span_{mean,max}``: how many weight versions one GRPO group's rollouts span
      (``max(max_global_steps) - min(min_global_steps) + 1`` over the group): role-wise GRPO's baselines are formed
      over the whole group whatever its versions (:mod:`envace.advantage`), so this says how mixed they are.
    """
    lag: dict[str, int] = {}
    span: dict[str, list[int]] = {}
    for key, tag in zip(keys, tags, strict=True):
        if tag.get("is_padding", False) or tag.get("min_global_steps") is None:
            continue
        lo, hi = int(tag["min_global_steps"]), int(tag["max_global_steps"])
        lag[key_trajectory(key)] = (int(global_steps) - 1) - lo
        group = span.setdefault(key_group(key), [lo, hi])
        group[0], group[1] = min(group[0], lo), max(group[1], hi)
    if not lag:
        return {}
    lags = np.asarray(list(lag.values()), dtype=np.float64)
    spans = np.asarray([hi - lo + 1 for lo, hi in span.values()], dtype=np.float64)
    out = {"envace/staleness/mean": float(lags.mean()), "envace/staleness/max": float(lags.max()),
           "envace/groups/version_span_mean": float(spans.mean()),
           "envace/groups/version_span_max": float(spans.max())}
    if threshold is not None:
        out["envace/staleness/bound"] = float(threshold - 1)
        out["envace/staleness/violations"] = float(np.sum(lags > threshold - 1))
    return out

#: reads fields of a batch's rows from TransferQueue: ``(keys, fields) -> {field: values in key order}``
Reader = Callable[[Sequence[str], Sequence[str]], Mapping[str, Any]]


@dataclass
class StepView:
    """One training step as envace's trainer hooks see it, read from TransferQueue once and handed to each hook.

    verl's ``step`` calls ``_compute_advantage`` before the update, once per sub-batch when it updates in several
    (``parameter_sync_step``), and hands the whole batch back after it. Under ``grpo_rolewise`` the advantage needs
    the roles first: :meth:`rows_of` reads a sub-batch's ``extra_fields`` then. :meth:`read_updated` takes the
    trained batch and reads what the update wrote (the advantages, and whatever else the caller asks for) in one
    more call, with the ``extra_fields`` too when some row's were not read yet. Everything after — the metrics, the
    settled prompts, the dump's columns, EnvSched's observation — comes from this object, not from TransferQueue
    again.
    """

    keys: list[str] = field(default_factory=list)  # the trained batch, in batch order (once read_updated ran)
    tags: list[Mapping[str, Any]] = field(default_factory=list)  # verl's tag of each of those rows
    known: dict[str, RolloutFields] = field(default_factory=dict)  # each row's rollout contract read so far
    updated: dict[str, Any] = field(default_factory=dict)  # the fields read after the update, by name
    settled: Settled | None = None  # where the step's prompts went (the trainer's prompt ledger)

    def rows_of(self, keys: Sequence[str], read: Reader) -> list[RolloutFields]:
        """The rollout contract of ``keys``' rows (:func:`read_rows`), reading only those not read yet."""
        missing = [k for k in keys if k not in self.known]
        if missing:
            self.known.update(zip(missing, read_rows(missing, list(read(missing, ["extra_fields"])["extra_fields"])),
                                  strict=True))
        return [self.known[k] for k in keys]

    def read_updated(self, keys: Sequence[str], tags: Sequence[Mapping[str, Any]], read: Reader,
                     fields: Sequence[str]) -> None:
        """The trained batch (``keys``, ``tags``) and its ``fields`` written by the update, read in one call (with
        the rows' ``extra_fields`` when some were not read yet)."""
        self.keys, self.tags = list(keys), list(tags)
        missing = any(k not in self.known for k in self.keys)
        want = list(dict.fromkeys([*fields, *(["extra_fields"] if missing else [])]))
        data = read(self.keys, want)
        if missing:
            self.known.update(zip(self.keys, read_rows(self.keys, list(data["extra_fields"])), strict=True))
        self.updated = {name: data[name] for name in want if name != "extra_fields"}

    @property
    def rows(self) -> list[RolloutFields]:
        """The trained batch's rollout contracts, in batch order."""
        return [self.known[k] for k in self.keys]

    def first_advantages(self) -> list[float]:
        """Each trained row's advantage (that of its first response token; 0 for a row without one)."""
        return [float(a[0]) if a.numel() else 0.0 for a in self.updated["advantages"].unbind(0)]

    def metrics(self, global_steps: int, threshold: int | None) -> dict[str, float]:
        """The step's per-role, importance-weight (when the update's weights were read) and staleness metrics."""
        rows = self.rows
        out = role_metrics(self.keys, rows, self.first_advantages(), self.tags)
        if "rollout_is_weights" in self.updated:
            out.update(role_is_metrics(rows, self.updated["rollout_is_weights"], self.updated["response_mask"],
                                       self.tags))
        out.update(staleness_metrics(self.keys, self.tags, global_steps, threshold))
        return out

    def dump_rows(self) -> dict[str, dict[str, Any]]:
        """Each trained row's :data:`DUMP_COLUMNS`, by key (``rollout_probs_diff_max`` only where the old
        log-probs were read: verl recomputed them)."""
        sync = all(f in self.updated for f in SYNC_FIELDS)
        diffs = row_probs_diff_max(*(self.updated[f] for f in SYNC_FIELDS)) if sync else [None] * len(self.keys)
        return {
            key: dict(zip(DUMP_COLUMNS, (
                row.role.value, row.trajectory_id or key_trajectory(key), adv, row.env_id, row.observation_source,
                row.counters.get("simulated_calls", 0.0), diff, row.task_id,
                tag.get("global_steps"), tag.get("min_global_steps"), tag.get("max_global_steps")), strict=True))
            for key, row, adv, diff, tag in zip(self.keys, self.rows, self.first_advantages(), diffs, self.tags,
                                                strict=True)
        }


#: data-source prefix of the greedy validation pass's rows
GREEDY_PREFIX = "greedy/"


class HeldoutValidation:
    """Held-out validation as envace reports it, around verl's own ``_validate``: the task behind each validation
    row, an optional greedy second pass over the same rows, and the held-out estimates of every validation.

    verl's ``_validate`` gives each validation row a fresh uid and reports only per-data-source means. The
    validation batches pass through :meth:`batches`, which, after verl has stamped a batch's uids, records each
    uid's task, and (``greedy``) yields the batch a second time as its greedy copy: one sample a row, data source
    ``greedy/<pool>/<category>``, and the row field the agent loop reads to decode greedily
    (:data:`envace.agents.contract.GREEDY_FIELD`). :meth:`metrics` turns verl's per-sample scores into the
    held-out estimates, and keeps each validation's per-task scores in ``out_dir`` (``step_<N>.json``).
    """

    def __init__(self, out_dir: Path, greedy: bool) -> None:
        self.out_dir = out_dir
        self.greedy = greedy
        self.tasks: dict[str, str] = {}  # uid -> "pool/task_id" of the rows validated so far

    def batches(self, loader: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for batch in loader:
            yield batch
            self._record(batch)
            if self.greedy:
                copy = self.greedy_copy(batch)
                yield copy
                self._record(copy)

    @staticmethod
    def greedy_copy(batch: Mapping[str, Any]) -> dict[str, Any]:
        """``batch``'s rows again, to be decoded greedily once each, under ``greedy/``-prefixed data sources."""
        size = len(batch["raw_prompt"])
        copy = {k: v for k, v in batch.items() if k != "uid"}
        sources = batch.get("data_source", ["unknown"] * size)
        copy["data_source"] = np.array([f"{GREEDY_PREFIX}{s}" for s in sources], dtype=object)
        copy["__rollout_n__"] = np.array([1] * size, dtype=object)
        copy[GREEDY_FIELD] = np.array([True] * size, dtype=object)
        return copy

    def _record(self, batch: Mapping[str, Any]) -> None:
        for uid, info in zip(batch["uid"], batch["extra_info"], strict=True):
            self.tasks[str(uid)] = f"{info['pool']}/{info['task_id']}"

    def metrics(self, step: int, data_sources: Sequence[str], sample_uids: Sequence[str],
                scores: Sequence[float]) -> dict[str, float]:
        per_pass: dict[str, dict[str, list[float]]] = {HELDOUT: defaultdict(list), HELDOUT_GREEDY: defaultdict(list)}
        for source, uid, score in zip(data_sources, sample_uids, scores, strict=True):
            which = HELDOUT_GREEDY if str(source).startswith(GREEDY_PREFIX) else HELDOUT
            per_pass[which][self.tasks[str(uid)]].append(float(score))
        out: dict[str, float] = {}
        for which, per_task in per_pass.items():
            if not per_task:
                continue
            est = heldout_estimate(per_task)
            n = max(len(v) for v in per_task.values())
            out[f"val-core/{which}/success/mean@{n}"] = est.mean
            out[f"val-core/{which}/success/sem@{n}"] = est.sem
            out[f"val-aux/{which}/success/tasks"] = float(est.tasks)
        first = self._first_record()
        record = {which: dict(per_task) for which, per_task in per_pass.items() if per_task}
        self._write(step, record)
        if first is not None and first[0] < step and first[1].get(HELDOUT) and per_pass[HELDOUT]:
            change = heldout_change(first[1][HELDOUT], per_pass[HELDOUT])
            out[f"val-aux/{HELDOUT}/success/change"] = change.mean
            out[f"val-aux/{HELDOUT}/success/change_sem"] = change.sem
        return out

    def _first_record(self) -> tuple[int, dict[str, dict[str, list[float]]]] | None:
        files = sorted(self.out_dir.glob("step_*.json"), key=lambda p: int(p.stem.split("_", 1)[1]))
        if not files:
            return None
        return int(files[0].stem.split("_", 1)[1]), json.loads(files[0].read_text())

    def _write(self, step: int, record: dict[str, Any]) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"step_{step}.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(record, sort_keys=True))
        os.replace(tmp, path)
