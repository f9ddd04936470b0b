"""EnvSched inside verl: the verl-free half of the ``envsched_*`` trainers (:class:`envace.verl.trainers.EnvSchedMixin`).

verl 0.9.1 removed its curriculum-sampler hook, so the integration is a trainer mixin registered with verl's own
``register_trainer`` (``trainer.v1.trainer_mode=envsched_sync`` and its async kinds):

* every prompt verl dispatches comes from ``_next_train_batch``, which asks :class:`envsched.EnvScheduler` for task
  ids and collates those rows of verl's training dataset (instead of drawing from the dataloader);
* after each step, every trained group's K rewards (verl's ``rm_scores``, read back from TransferQueue in envace's
  one post-step read) go to ``observe`` (:func:`collect_groups`), with the rollouts' actions and validity from the
  rollout contract (:class:`envace.agents.contract.RolloutFields`); the scheduler's metrics join verl's;
* the scheduler's ``state_dict`` is saved inside verl's checkpoint folder (``envsched.pt``, written before verl marks
  the checkpoint complete) and restored on resume. Its numpy arrays are stored as tensors and every other value as a
  plain Python container, so the file loads with ``torch.load(weights_only=True)``: resuming never unpickles
  arbitrary objects (:func:`save_scheduler_state` / :func:`load_scheduler_state`);
* ``envsched.scheduler=random`` is the paper's random baseline through the same path.

The scheduler's task pool is built from the environment pools of the training rows
(:func:`envace.data.records.task_records`); its identifier filter replays action sequences through the pools
(:func:`envace.data.records.make_replay`).
"""

from __future__ import annotations

import json
import logging
import os
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from envace.agents.contract import RolloutFields, key_trajectory
from envace.config import envsched_config_from
from envace.data.records import make_replay, task_key, task_records
from envace.envs.base import get_pool

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
    """An :class:`envsched.EnvScheduler` over the tasks of ``dataset_rows`` (their ``extra_info``), configured by
    ``cfg.envsched``, whose batch size and group size must equal ``data.train_batch_size`` and
    ``actor_rollout_ref.rollout.n`` (the training config interpolates them; a disagreement is a ValueError)."""
    from envsched import EnvScheduler

    refs = []
    for row in dataset_rows:
        info = row.get("extra_info") or {}
        if not info.get("pool") or not info.get("task_id"):
            raise ValueError("envsched needs extra_info.pool/task_id in every training row (python -m envace.data build)")
        refs.append((str(info["pool"]), str(info["task_id"])))
    pools = {name: get_pool(name, **dict((pool_kwargs or {}).get(name, {}) or {})) for name in {p for p, _ in refs}}
    sched_cfg = envsched_config_from(cfg)  # B and K are the trainer's keys, interpolated (envace.config)
    records = task_records(pools, refs)
    return EnvScheduler(records, sched_cfg, replay=make_replay(pools)), [task_key(p, t) for p, t in refs]


def log_selection(run_dir: Path, record: dict[str, Any]) -> None:
    """Append one selection (JSON) to ``<run_dir>/envsched_selections.jsonl``: which tasks were dispatched when."""
    path = run_dir / SELECTIONS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")
