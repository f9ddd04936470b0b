"""envace's verl V1 trainer: role labels to the advantage estimator, per-role metrics, role-tagged dumps.

verl 0.9.1's V1 trainer passes a registered advantage estimator only ``token_level_rewards``,
``response_mask``, ``config`` and ``index`` (the prompt uid); the role of each output lives in the
agent loop's ``extra_fields`` in TransferQueue. :class:`EnvaceTrainer` (``trainer.v1.trainer_mode=
envace_sync``, registered with verl's ``register_trainer``) reads those labels for the step's batch, in
batch order, and hands them to ``grpo_rolewise`` through :func:`envace.advantage.role_labels` around
verl's own ``_compute_advantage`` — KL-in-reward, rollout correction and the write-back stay verl's.

It also adds, every step:

* ``envace/act/*`` and ``envace/rehearse/*``: outputs, tokens, advantage mean/std, format-error and
  empty-output rates; trajectory-level calls per trajectory, stop reasons and the masked (unscored) rate;
* ``envace/rehearsal_fidelity/*``: for rehearsed responses whose real counterpart is known, the share
  that equals the real environment's response (normalised JSON), key overlap and error agreement;
* ``role``, ``trajectory_id`` and ``advantage`` (the row's advantage) columns in the per-step rollout dump
  (``rollouts/N.jsonl``).

:class:`envace.verl.sched.EnvSchedTrainer` (``envsched_sync``) derives from it, so EnvSched and role-wise
GRPO combine.
"""

from __future__ import annotations

import json
import logging
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

ROLES = ("act", "rehearse")


def _key_traj(key: str) -> str:
    """TransferQueue key ``{uid}_{session}_{index}`` → trajectory ``{uid}_{session}``."""
    return key.rsplit("_", 1)[0]


def batch_labels(keys: Sequence[str], extra_fields: Sequence[Mapping[str, Any] | None],
                 tags: Sequence[Mapping[str, Any]] | None = None) -> dict[str, np.ndarray]:
    """Per-row role, trajectory, validity and emptiness, in batch order.

    Rows that verl added as padding, or whose reward failed (``reward_extra_info.verify_failed``), are
    not valid: they stay out of every baseline. Rows without a role (verl's own loops) are ``act``.
    """
    roles, trajs, valid, empty = [], [], [], []
    for i, key in enumerate(keys):
        ef = extra_fields[i] or {}
        info = ef.get("reward_extra_info") or {}
        padding = bool(tags[i].get("is_padding", False)) if tags is not None else False
        roles.append(str(ef.get("role", "act")))
        trajs.append(_key_traj(key))
        valid.append(not padding and not info.get("verify_failed"))
        empty.append(bool(ef.get("empty", 0.0)))
    return {
        "roles": np.array(roles, dtype=object),
        "traj_index": np.array(trajs, dtype=object),
        "valid": np.array(valid, dtype=bool),
        "empty": np.array(empty, dtype=bool),
    }


def role_metrics(
    keys: Sequence[str],
    extra_fields: Sequence[Mapping[str, Any] | None],
    advantages: Sequence[float] | None,
    tags: Sequence[Mapping[str, Any]] | None = None,
) -> dict[str, float]:
    """The per-role and rehearsal-fidelity metrics of one trained batch (see module docstring).

    ``advantages`` holds one value per row (the advantage of the row's first response token).
    """
    by_role: dict[str, dict[str, list[float]]] = {r: defaultdict(list) for r in ROLES}
    trajectories: dict[str, Mapping[str, Any]] = {}
    for i, key in enumerate(keys):
        if tags is not None and tags[i].get("is_padding", False):
            continue
        ef = extra_fields[i] or {}
        role = str(ef.get("role", "act"))
        acc = by_role.setdefault(role, defaultdict(list))
        acc["tokens"].append(float(ef.get("num_tokens", 0.0)))
        acc["format_error"].append(float(ef.get("format_error", 0.0)))
        acc["empty"].append(float(ef.get("empty", 0.0)))
        if advantages is not None and not (ef.get("reward_extra_info") or {}).get("verify_failed"):
            acc["advantage"].append(float(advantages[i]))
        trajectories.setdefault(_key_traj(key), ef)
    out: dict[str, float] = {}
    for role, acc in by_role.items():
        n = len(acc["tokens"])
        out[f"envace/{role}/outputs"] = float(n)
        if not n:
            continue
        out[f"envace/{role}/tokens"] = float(np.sum(acc["tokens"]))
        out[f"envace/{role}/tokens_mean"] = float(np.mean(acc["tokens"]))
        out[f"envace/{role}/format_error_rate"] = float(np.mean(acc["format_error"]))
        out[f"envace/{role}/empty_rate"] = float(np.mean(acc["empty"]))
        if acc["advantage"]:
            out[f"envace/{role}/advantage_mean"] = float(np.mean(acc["advantage"]))
            out[f"envace/{role}/advantage_std"] = float(np.std(acc["advantage"]))
    if trajectories:
        infos = [(ef.get("reward_extra_info") or {}) for ef in trajectories.values()]
        n_traj = len(infos)
        out["envace/trajectories"] = float(n_traj)
        out["envace/act/calls_per_trajectory"] = float(np.mean([i.get("tool_calls", 0.0) for i in infos]))
        out["envace/act/malformed_calls_per_trajectory"] = float(np.mean([i.get("malformed_calls", 0.0) for i in infos]))
        out["envace/rehearse/malformed_per_trajectory"] = float(
            np.mean([i.get("malformed_rehearsals", 0.0) for i in infos])
        )
        out["envace/masked_rate"] = float(np.mean([bool(i.get("verify_failed")) for i in infos]))
        stops = Counter(str(ef.get("stop_reason", "unknown")) for ef in trajectories.values())
        for reason, count in stops.items():
            out[f"envace/stop_reason/{reason}"] = count / n_traj
        fid: list[dict[str, float]] = []
        for ef in trajectories.values():
            try:
                fid.extend(json.loads(ef.get("fidelity") or "[]"))
            except (TypeError, json.JSONDecodeError):
                continue
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

        def _extra_fields(self, batch) -> list[Mapping[str, Any]]:
            data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["extra_fields"])
            return list(data["extra_fields"])

        def _compute_advantage(self, batch, metrics: dict):
            if self.config.algorithm.adv_estimator != ESTIMATOR_NAME:
                return super()._compute_advantage(batch, metrics)
            labels = batch_labels(batch.keys, self._extra_fields(batch), batch.tags)
            opts = (self.config.get("envace", {}) or {}).get("advantage", {}) or {}
            with role_labels(**labels, options=dict(opts)):
                return super()._compute_advantage(batch, metrics)

        def step(self, metrics: dict, timing_raw: dict):
            batch = super().step(metrics, timing_raw)
            # one read of the trained rows serves the per-role metrics and the rollout dump of this step
            data = tq.kv_batch_get(
                keys=batch.keys, partition_id=batch.partition_id, select_fields=["extra_fields", "advantages"]
            )
            extra = list(data["extra_fields"])
            first = [float(a[0]) if a.numel() else 0.0 for a in data["advantages"].unbind(0)]
            metrics.update(role_metrics(batch.keys, extra, first, batch.tags))
            self._step_rows = {
                key: (str((ef or {}).get("role", "act")), str((ef or {}).get("trajectory_id", _key_traj(key))), adv)
                for key, ef, adv in zip(batch.keys, extra, first, strict=True)
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
                rows = [labels.get(k, ("act", _key_traj(k), 0.0)) for k in keys]
                reward_extra_infos_dict["role"] = [r[0] for r in rows]
                reward_extra_infos_dict["trajectory_id"] = [r[1] for r in rows]
                reward_extra_infos_dict["advantage"] = [r[2] for r in rows]
            return super()._dump_generations(inputs, outputs, gts, scores, reward_extra_infos_dict, dump_path)

    return EnvaceTrainer


_TRAINER: type | None = None


def envace_trainer_class() -> type:
    """Register ``envace_sync`` with verl's trainer registry (idempotent) and return the class."""
    global _TRAINER
    if _TRAINER is None:
        _TRAINER = _register()
    return _TRAINER
