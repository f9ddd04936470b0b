"""envace's verl V1 trainer: role labels to the advantage estimator, per-role metrics, role-tagged dumps.

verl 0.9.1's V1 trainer passes a registered advantage estimator only ``token_level_rewards``,
``response_mask``, ``config`` and ``index`` (the prompt uid); the role of each output lives in the
agent loop's ``extra_fields`` in TransferQueue, written and read as the rollout contract
(:class:`envace.agents.contract.RolloutFields`). :class:`EnvaceTrainer` (``trainer.v1.trainer_mode=
envace_sync``, registered with verl's ``register_trainer``) reads those labels for the step's batch, in
batch order, and hands them to ``grpo_rolewise`` through :func:`envace.advantage.role_labels` around
verl's own ``_compute_advantage`` — KL-in-reward, rollout correction and the write-back stay verl's.

Each row's ``extra_fields`` are read from TransferQueue once per step (``EnvaceTrainer._rows``): by
``_compute_advantage`` under ``grpo_rolewise``, otherwise together with the advantages after the update; the
per-role metrics, the rollout dump and EnvSched's observation use that one read.

It also adds, every step:

* ``envace/act/*`` and ``envace/rehearse/*``: outputs, tokens, advantage mean/std, format-error and
  empty-output rates; trajectory-level calls per trajectory, stop reasons and the masked (unscored) rate;
* ``envace/rehearsal_fidelity/*``: for rehearsed responses whose real counterpart is known, the share
  that equals the real environment's response (normalised JSON), key overlap and error agreement;
* ``role``, ``trajectory_id``, ``advantage`` (the row's advantage), ``env_id``, ``observation_source`` and
  ``simulated_calls`` (calls the Trace2Env simulator answered) columns in the per-step rollout dump
  (``rollouts/N.jsonl``).

:class:`envace.verl.sched.EnvSchedTrainer` (``envsched_sync``) derives from it, so EnvSched and role-wise
GRPO combine.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from envace.agents.contract import RolloutFields, key_trajectory
from envace.roles import Role

logger = logging.getLogger(__name__)

#: envace's columns in the per-step rollout dump, from each row's rollout contract
DUMP_COLUMNS = ("role", "trajectory_id", "advantage", "env_id", "observation_source", "simulated_calls")


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
        "roles": np.array([row.role.value for row in rows], dtype=object),
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


def _register() -> type:
    import transfer_queue as tq
    from verl.trainer.ppo.v1.trainer_base import register_trainer
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    from envace.advantage import ESTIMATOR_NAME, role_labels

    @register_trainer("envace_sync")
    class EnvaceTrainer(PPOTrainerSync):
        """verl's sync trainer + role labels for ``grpo_rolewise``, per-role metrics, role-tagged dumps."""

        def _build_replay_buffer(self):
            # verl keys sync-only behaviour (replay buffer class, resume of in-flight prompts, dataloader
            # refill) on the literal mode name "sync": a sync trainer registered under another name must
            # present itself as "sync", or it silently runs the async code paths.
            self.trainer_mode = "sync"
            self.parameter_sync_step = self.config.trainer.v1.get("sync", {}).get("parameter_sync_step", 1)
            buffer = super()._build_replay_buffer()
            # the buffer's documented constructor argument, which verl's builder does not expose
            buffer.poll_interval = float((self.config.get("envace") or {}).get("replay_poll_s", buffer.poll_interval))
            return buffer

        #: TransferQueue fields a subclass needs after each step besides ``advantages``: read in the same call
        STEP_FIELDS: tuple[str, ...] = ()

        def _rows(self, batch) -> list[RolloutFields]:
            """The rollout contract of ``batch``'s rows, in batch order: each row's ``extra_fields`` is read from
            TransferQueue once per step (on the first call that needs it) and kept for the rest of the step."""
            cache = self.__dict__.setdefault("_row_cache", {})
            missing = [k for k in batch.keys if k not in cache]
            if missing:
                data = tq.kv_batch_get(keys=missing, partition_id=batch.partition_id, select_fields=["extra_fields"])
                cache.update(zip(missing, read_rows(missing, list(data["extra_fields"])), strict=True))
            return [cache[k] for k in batch.keys]

        def _compute_advantage(self, batch, metrics: dict):
            if self.config.algorithm.adv_estimator != ESTIMATOR_NAME:
                return super()._compute_advantage(batch, metrics)
            labels = batch_labels(batch.keys, self._rows(batch), batch.tags)
            opts = (self.config.get("envace", {}) or {}).get("advantage", {}) or {}
            with role_labels(**labels, options=dict(opts)):
                return super()._compute_advantage(batch, metrics)

        def step(self, metrics: dict, timing_raw: dict):
            self._row_cache = {}  # the rows of this step only
            batch = super().step(metrics, timing_raw)
            # one read after the update: the advantages, the subclass's fields, and the extra_fields of any row
            # that _compute_advantage did not already read (all of them when the estimator is not grpo_rolewise)
            missing = [k for k in batch.keys if k not in self._row_cache]
            fields = ["advantages", *self.STEP_FIELDS, *(["extra_fields"] if missing else [])]
            data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
            if missing:
                self._row_cache.update(zip(batch.keys, read_rows(batch.keys, list(data["extra_fields"])), strict=True))
            rows = [self._row_cache[k] for k in batch.keys]
            first = [float(a[0]) if a.numel() else 0.0 for a in data["advantages"].unbind(0)]
            metrics.update(role_metrics(batch.keys, rows, first, batch.tags))
            self._step_data = data  # for the subclass's step (STEP_FIELDS)
            self._step_rows = {
                key: (row.role.value, row.trajectory_id or key_trajectory(key), adv, row.env_id,
                      row.observation_source, row.counters.get("simulated_calls", 0.0))
                for key, row, adv in zip(batch.keys, rows, first, strict=True)
            }
            return batch

        def _log_rollout_data(self, batch, timing_raw: dict, rollout_data_dir: str):
            # called by verl's fit() right after step() for the same batch (before the rows are cleared)
            self._dump_labels = getattr(self, "_step_rows", None)
            try:
                super()._log_rollout_data(batch, timing_raw, rollout_data_dir)
            finally:
                self._dump_labels = self._step_rows = None

        def _dump_generations(self, inputs, outputs, gts, scores, reward_extra_infos_dict, dump_path):
            labels = getattr(self, "_dump_labels", None)
            keys = reward_extra_infos_dict.get("uid")
            if labels and keys:
                reward_extra_infos_dict = dict(reward_extra_infos_dict)
                rows = [labels.get(k, (Role.ACT.value, key_trajectory(k), 0.0, "", "", 0.0)) for k in keys]
                for i, name in enumerate(DUMP_COLUMNS):
                    reward_extra_infos_dict[name] = [r[i] for r in rows]
            return super()._dump_generations(inputs, outputs, gts, scores, reward_extra_infos_dict, dump_path)

    return EnvaceTrainer


_TRAINER: type | None = None


def envace_trainer_class() -> type:
    """Register ``envace_sync`` with verl's trainer registry (idempotent) and return the class."""
    global _TRAINER
    if _TRAINER is None:
        _TRAINER = _register()
    return _TRAINER
