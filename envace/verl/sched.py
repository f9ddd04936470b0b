"""EnvSched inside verl: a V1 sync trainer whose batches the scheduler chooses.

verl 0.9.1 removed its curriculum-sampler hook, so the integration is a trainer subclass registered
with verl's own ``register_trainer`` (select it with ``trainer.v1.trainer_mode=envsched_sync``):

* before each step, ``_next_train_batch`` asks :class:`envsched.EnvScheduler` for the step's task
  ids and collates those rows of verl's training dataset (instead of drawing from the dataloader);
* after the step, every completed group's K rewards (verl's ``rm_scores``, read back from
  TransferQueue in envace's one post-step read) go to ``observe``, with the rollouts' actions and validity from the
  rollout contract (:class:`envace.agents.contract.RolloutFields`); the scheduler's per-step metrics join verl's;
* the scheduler's ``state_dict`` is saved inside verl's checkpoint folder (``envsched.pt``, written
  before verl marks the checkpoint complete) and restored on resume, so the batch chosen after a
  resume equals the one an uninterrupted run chooses. Its numpy arrays are stored as tensors and every
  other value as a plain Python container, so the file loads with ``torch.load(weights_only=True)``:
  resuming never unpickles arbitrary objects (:func:`save_scheduler_state` / :func:`load_scheduler_state`);
* ``envsched.scheduler=random`` is the paper's random baseline through the same path.

The scheduler's task pool is built from the environment pools of the training rows
(:func:`envace.envs.records.task_records`); its identifier filter replays action sequences through the pools
(:func:`envace.envs.records.make_replay`).
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from envace.agents.contract import RolloutFields, key_trajectory
from envace.envs.base import get_pool
from envace.envs.records import make_replay, task_key, task_records

logger = logging.getLogger(__name__)

STATE_FILE = "envsched.pt"
SELECTIONS_FILE = "envsched_selections.jsonl"


def encode_state(value: Any) -> Any:
    """A scheduler state with numpy arrays as tensors and numpy scalars as Python scalars: only types
    ``torch.load(weights_only=True)`` accepts (tensors, str/int/float/bool/None, lists, tuples, dicts)."""
    import torch

    if isinstance(value, np.ndarray):
        if value.dtype == object:
            return [encode_state(v) for v in value.tolist()]
        return torch.from_numpy(np.ascontiguousarray(value).copy())
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {encode_state(k): encode_state(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(encode_state(v) for v in value)
    return value


def decode_state(value: Any) -> Any:
    """Inverse of :func:`encode_state`: tensors back to numpy arrays (the scheduler state holds no tensors)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.numpy().copy()
    if isinstance(value, dict):
        return {k: decode_state(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(decode_state(v) for v in value)
    return value


def save_scheduler_state(scheduler: Any, path: str | os.PathLike[str]) -> None:
    """Write ``scheduler.state_dict()`` to ``path`` atomically, loadable with ``weights_only=True``."""
    import torch

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(encode_state(scheduler.state_dict()), tmp)
    os.replace(tmp, path)


def load_scheduler_state(scheduler: Any, path: str | os.PathLike[str]) -> None:
    """Restore ``scheduler`` from :func:`save_scheduler_state`'s file (``torch.load(weights_only=True)``)."""
    import torch

    scheduler.load_state_dict(decode_state(torch.load(path, weights_only=True)))


def collect_groups(
    keys: Sequence[str],
    uids: Sequence[Any],
    scores: Sequence[Any],
    rows: Sequence[RolloutFields],
    uid_task: Mapping[str, str],
    tags: Sequence[Mapping[str, Any]] | None = None,
) -> tuple[dict[str, list[float]], dict[str, list[list[dict[str, Any]]]], int]:
    """Per-task rewards (one per rollout) and action sequences from a trained batch.

    TransferQueue keys are ``{uid}_{session}_{output index}``; a rollout with several outputs counts
    once. Rollouts whose verifier failed (``verify_failed`` in the rollout contract, ``rows``) are left out rather
    than observed as reward 0, and so are the no-op rows verl appends to make the batch divisible
    (``tags[i]["is_padding"]``). Returns (rewards, trajectories, number of unscored rollouts).
    """
    rewards: dict[str, list[float]] = defaultdict(list)
    trajectories: dict[str, list[list[dict[str, Any]]]] = defaultdict(list)
    seen: set[str] = set()
    unscored = 0
    for i, key in enumerate(keys):
        if tags is not None and tags[i].get("is_padding", False):
            continue
        rollout = key_trajectory(key)
        if rollout in seen:
            continue
        seen.add(rollout)
        row = rows[i]
        if row.verify_failed:
            unscored += 1
            continue
        task = uid_task[str(uids[i])]
        rewards[task].append(float(scores[i].sum()))
        if row.actions is not None:
            trajectories[task].append(list(row.actions))
    # the identifier filter needs trajectories aligned with rewards, for every rollout of a task
    aligned = {t: trajectories[t] for t in rewards if len(trajectories.get(t, ())) == len(rewards[t])}
    return dict(rewards), aligned, unscored


def build_scheduler(cfg: Any, dataset_rows: Sequence[Mapping[str, Any]], pool_kwargs: Mapping[str, Any] | None = None):
    """An :class:`envsched.EnvScheduler` over the tasks of ``dataset_rows`` (their ``extra_info``)."""
    from omegaconf import OmegaConf

    from envsched import EnvSchedConfig, EnvScheduler

    refs = []
    for row in dataset_rows:
        info = row.get("extra_info") or {}
        if not info.get("pool") or not info.get("task_id"):
            raise ValueError("envsched needs extra_info.pool/task_id in every training row (envace.envs build-data)")
        refs.append((str(info["pool"]), str(info["task_id"])))
    pools = {name: get_pool(name, **dict((pool_kwargs or {}).get(name, {}) or {})) for name in {p for p, _ in refs}}
    raw = OmegaConf.to_container(cfg.envsched, resolve=True) if hasattr(cfg, "envsched") else {}
    sched_cfg = EnvSchedConfig.from_dict(
        {**raw, "batch_size": int(cfg.data.train_batch_size), "rollouts_per_task": int(cfg.actor_rollout_ref.rollout.n)}
    )
    records = task_records(pools, refs)
    return EnvScheduler(records, sched_cfg, replay=make_replay(pools)), [task_key(p, t) for p, t in refs]


def _register() -> None:
    from verl.trainer.ppo.v1.trainer_base import register_trainer
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.rl_dataset import collate_fn

    from envace.verl.trainer import envace_trainer_class

    @register_trainer("envsched_sync")
    class EnvSchedTrainer(envace_trainer_class()):
        """envace's sync trainer (role labels, per-role metrics) with EnvSched choosing every training batch."""

        STEP_FIELDS = ("uid", "rm_scores")  # read with the advantages by envace's step

        def _init_dataloader(self) -> None:
            super()._init_dataloader()
            rows = self.train_dataset.dataframe.select_columns(["extra_info"]).to_list()
            pool_kwargs = (self.config.get("envace", {}) or {}).get("agent", {}).get("pool_kwargs", {})
            t0 = time.perf_counter()
            self.scheduler, keys = build_scheduler(self.config, rows, pool_kwargs)
            self._row_of = {k: i for i, k in enumerate(keys)}
            self._uid_task: dict[str, str] = {}
            self._sched_build_s: float | None = time.perf_counter() - t0
            logger.info("envsched: %d tasks, graph built in %.2fs", len(keys), self._sched_build_s)

        def _next_train_batch(self, num_prompts: int | None = None):
            bs = int(self.config.data.train_batch_size)
            if num_prompts not in (None, bs):
                raise ValueError(f"envsched chooses whole batches of data.train_batch_size={bs}, asked {num_prompts}")
            task_ids = self.scheduler.select(self.global_steps)
            batch_dict = collate_fn([self.train_dataset[self._row_of[t]] for t in task_ids])
            uids = [str(uuid.uuid4()) for _ in task_ids]
            self._uid_task.update(zip(uids, task_ids))
            batch_dict["uid"] = np.array(uids, dtype=object)
            batch = tu.get_tensordict(batch_dict)
            tu.assign_non_tensor_data(batch, "global_steps", self.global_steps)
            self._log_selection(task_ids)
            return batch

        def _log_selection(self, task_ids: list[str]) -> None:
            path = Path(self.config.trainer.default_local_dir) / SELECTIONS_FILE
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as f:
                f.write(json.dumps({"step": self.global_steps, "task_ids": task_ids}) + "\n")

        def step(self, metrics: dict, timing_raw: dict):
            batch = super().step(metrics, timing_raw)
            # envace's step read uid and rm_scores with the advantages (STEP_FIELDS), and holds the step's rows
            data = self._step_data
            uids = [str(u) for u in data["uid"]]
            rewards, trajectories, unscored = collect_groups(
                batch.keys, uids, data["rm_scores"], self._rows(batch), self._uid_task, batch.tags
            )
            for uid in set(uids):  # this step's prompts are done
                self._uid_task.pop(uid, None)
            metrics["envsched/unscored_rollouts"] = float(unscored)
            if not rewards:
                logger.warning("envsched: step %d produced no scored rollout; nothing to observe", self.global_steps)
                metrics.update(self.scheduler.metrics(self.global_steps))  # the step's selection metrics still count
                return batch
            t0 = time.perf_counter()
            # all-or-nothing: an ObservationError (naming the task) leaves the scheduler unchanged
            self.scheduler.observe(self.global_steps, rewards, trajectories or None)
            # every ``envsched/*`` key of the step: selection (envs_per_batch, selected_<evidence type>, ...),
            # observation (realized_var_*, short_groups, missing_rewards, ...) and the prediction diagnostics
            # (spearman_q_<evidence type>, spearman_v_<evidence type>, scored_<evidence type>)
            metrics.update(self.scheduler.metrics(self.global_steps))
            metrics["envsched/trainer_observe_time_s"] = time.perf_counter() - t0
            if self._sched_build_s is not None:  # once per process (also after a resume)
                metrics["envsched/static_build_time_s"] = self._sched_build_s
                self._sched_build_s = None
            return batch

        def _save_checkpoint(self) -> None:
            # written before verl's own save, which marks the checkpoint complete last
            folder = Path(self.config.trainer.default_local_dir) / f"global_step_{self.global_steps}"
            folder.mkdir(parents=True, exist_ok=True)
            save_scheduler_state(self.scheduler, folder / STATE_FILE)
            super()._save_checkpoint()

        def _load_checkpoint(self) -> None:
            super()._load_checkpoint()
            if self.global_steps <= 0:
                return
            path = Path(self.config.trainer.default_local_dir) / f"global_step_{self.global_steps}" / STATE_FILE
            if self.config.trainer.resume_mode == "resume_path":
                path = Path(self.config.trainer.resume_from_path) / STATE_FILE
            if not path.is_file():
                raise FileNotFoundError(
                    f"resuming at step {self.global_steps} but {path} is missing: the checkpoint was not written "
                    "by the envsched trainer, so the scheduler state cannot be restored"
                )
            load_scheduler_state(self.scheduler, path)
            logger.info("envsched: restored scheduler state from %s", path)


_registered = False


def register_envsched_trainer() -> None:
    """Register ``envsched_sync`` with verl's trainer registry (idempotent)."""
    global _registered
    if not _registered:
        _register()
        _registered = True
