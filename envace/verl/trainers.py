"""envace's V1 trainers, registered with verl's ``register_trainer``: one class per (method, verl mode).

=============================  ======================  ==============================================================
``trainer.v1.trainer_mode``    verl base class         what it adds
=============================  ======================  ==============================================================
``envace_sync``                ``PPOTrainerSync``      :class:`EnvaceTrainerMixin`: role labels for ``grpo_rolewise``,
``envace_colocate_async``      ``PPOTrainerColocate``  per-role, staleness and rehearsal-fidelity metrics, role-tagged
``envace_separate_async``      ``PPOTrainerSeparate``  rollout dumps, held-out validation
``envsched_sync``              ``PPOTrainerSync``      the same, with :class:`EnvSchedMixin`: EnvSched chooses every
``envsched_colocate_async``    ``PPOTrainerColocate``  prompt verl dispatches, and observes each group's rewards when
``envsched_separate_async``    ``PPOTrainerSeparate``  the group is trained
=============================  ======================  ==============================================================

The mixins override only methods that verl's three V1 trainers inherit unchanged from ``PPOTrainer`` (pinned, with
their signatures, through every base in ``tests/envace/verl/test_verl_pins.py``); the async trainers' lifecycle
hooks (``on_*``, ``get_llm_client``, ``prepare_step``) stay verl's. verl switches behaviour on the literal mode name
(``self.trainer_mode == "sync"``: the replay buffer's class, resume of in-flight prompts, TransferQueue
checkpoints, the dataloader's batch size), so each class presents its verl base's name (:attr:`VERL_MODE`) to verl.

This module imports verl's trainer modules, which must not load while ``verl/__init__`` is still loading its plugins:
only verl's TaskRunner process imports it (:func:`envace.verl.extensions.register_trainer_extensions`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import transfer_queue as tq
from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY, register_trainer
from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync
from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils import tensordict_utils as tu
from verl.utils.dataset.rl_dataset import collate_fn

from envace.advantage import ESTIMATOR_NAME, role_labels
from envace.agents.contract import key_group
from envace.config import EnvAceConfig, validate_envace_config
from envace.verl.observation_loss import ObservationLossMixin
from envace.verl.prompts import PromptLedger, Settled
from envace.verl.sched import (
    STATE_FILE,
    build_scheduler,
    collect_groups,
    load_scheduler_state,
    log_selection,
    save_scheduler_state,
)
from envace.verl.trainer import DUMP_COLUMNS, IS_FIELDS, SYNC_FIELDS, HeldoutValidation, StepView, batch_labels

logger = logging.getLogger(__name__)


class EnvaceTrainerMixin(ObservationLossMixin):
    """Role labels for ``grpo_rolewise``, per-role and staleness metrics, role-tagged dumps, held-out validation
    (:mod:`envace.verl.trainer` holds the verl-free parts); placed before one of verl's V1 trainers.

    The typed ``envace`` group (:class:`~envace.config.EnvAceConfig`) is attached at construction
    (``self.envace_config``), before verl's constructor builds anything from the config. Each step's batch is one
    :class:`~envace.verl.trainer.StepView` (``self.step_view``), built by the first hook of the step that needs it
    and read by every later one, the rollout dump included."""

    #: the mode name verl's own code compares against (the verl base class's registered name)
    VERL_MODE: str = "sync"
    #: TransferQueue fields a subclass needs after each step besides ``advantages``: read in the same call
    STEP_FIELDS: tuple[str, ...] = ()

    def __init__(self, config, *args, **kwargs) -> None:
        self.envace_config: EnvAceConfig = validate_envace_config(config)
        self.step_view: StepView | None = None
        super().__init__(config, *args, **kwargs)

    def _build_replay_buffer(self):
        # runs inside verl's __init__ right after it read trainer_mode and parameter_sync_step from the config, and
        # before anything else compares them: both are set to what verl's own trainer of this kind would hold
        self.trainer_mode = self.VERL_MODE
        self.parameter_sync_step = self.config.trainer.v1.get(self.VERL_MODE, {}).get("parameter_sync_step", 1)
        buffer = super()._build_replay_buffer()
        # the buffer's documented constructor argument, which verl's builder does not expose
        buffer.poll_interval = self.envace_config.replay_poll_s
        return buffer

    # -- the prompt ledger (envace.verl.prompts): every dispatched prompt is trained, dropped or in flight --------
    @property
    def _ledger(self) -> PromptLedger:
        return self.__dict__.setdefault("_prompt_ledger", PromptLedger())

    def _next_train_batch(self, num_prompts: int | None = None):
        batch, payloads = self._draw_prompts(num_prompts)
        self._ledger.dispatched(self.global_steps, batch["uid"], payloads)
        return batch

    def _draw_prompts(self, num_prompts: int | None) -> tuple[Any, list[Any] | None]:
        """The next ``num_prompts`` training prompts (verl's dataloader), and a ledger payload per prompt."""
        return super()._next_train_batch(num_prompts), None

    def _settle_prompts(self, view: StepView) -> Settled:
        trained = [key_group(k) for k, tag in zip(view.keys, view.tags, strict=True) if not tag.get("is_padding")]
        listing = tq.kv_list("train") or {}
        registered = [k for k, tag in listing.get("train", {}).items() if tag.get("is_prompt", False)]
        settled = self._ledger.settle(trained, registered)
        self._ledger.log(Path(self.config.trainer.default_local_dir), int(self.global_steps), settled)
        return settled

    def _checkpoint_folder(self) -> Path:
        """The checkpoint folder of the current step: the one written at it, or the one a resume loaded."""
        if self.config.trainer.resume_mode == "resume_path" and self.config.trainer.get("resume_from_path"):
            loaded = Path(self.config.trainer.resume_from_path)
            if loaded.name == f"global_step_{self.global_steps}":
                return loaded
        return Path(self.config.trainer.default_local_dir) / f"global_step_{self.global_steps}"

    def _save_checkpoint(self) -> None:
        # written before verl's own save, which marks the checkpoint complete last
        self._ledger.save(self._checkpoint_folder())
        super()._save_checkpoint()

    def _load_checkpoint(self) -> None:
        super()._load_checkpoint()
        if self.global_steps > 0:
            self._prompt_ledger = PromptLedger.load(self._checkpoint_folder())

    # -- the step's view ------------------------------------------------------------------------------------------
    @staticmethod
    def _reader(batch):
        """Reads fields of ``batch``'s partition from TransferQueue (:data:`envace.verl.trainer.Reader`)."""
        def read(keys: Sequence[str], fields: Sequence[str]):
            return tq.kv_batch_get(keys=list(keys), partition_id=batch.partition_id, select_fields=list(fields))
        return read

    def _compute_advantage(self, batch, metrics: dict):
        if self.config.algorithm.adv_estimator != ESTIMATOR_NAME:
            return super()._compute_advantage(batch, metrics)
        rows = self.step_view.rows_of(batch.keys, self._reader(batch))
        labels = batch_labels(batch.keys, rows, batch.tags)
        with role_labels(**labels, options=dataclasses.asdict(self.envace_config.advantage)):
            return super()._compute_advantage(batch, metrics)

    def step(self, metrics: dict, timing_raw: dict):
        self.step_view = view = StepView()  # this step's, handed to every hook until the next step begins
        batch = super().step(metrics, timing_raw)
        # one read after the update: the advantages, the subclass's fields, verl's old and rollout log-probs where it
        # recomputed them (it then reports their difference) and its importance weights under rollout correction
        corr = self.config.algorithm.get("rollout_correction") or {}
        weighted = bool(corr.get("rollout_is")) and not corr.get("bypass_mode", False)
        sync = "training/rollout_probs_diff_max" in metrics
        view.read_updated(batch.keys, batch.tags, self._reader(batch),
                          ["advantages", *self.STEP_FIELDS, *(SYNC_FIELDS if sync else ()),
                           *(IS_FIELDS if weighted else ())])
        threshold = self.config.trainer.v1.sampler.get("max_off_policy_threshold")
        metrics.update(view.metrics(int(self.global_steps), threshold))
        view.settled = self._settle_prompts(view)
        metrics.update({"envace/prompts/trained": float(len(view.settled.trained) + len(view.settled.unknown)),
                        "envace/prompts/dropped": float(len(view.settled.dropped)),
                        "envace/prompts/in_flight": float(len(self._ledger.open))})
        return batch

    def _heldout(self) -> HeldoutValidation:
        if getattr(self, "_heldout_validation", None) is None:
            out = Path(self.config.trainer.default_local_dir) / "validation"
            self._heldout_validation = HeldoutValidation(out, greedy=self.envace_config.validation.greedy)
        return self._heldout_validation

    def _validate(self) -> dict[str, float]:
        loader = self.val_dataloader
        self.val_dataloader = self._heldout().batches(loader)
        try:
            return super()._validate()
        finally:
            self.val_dataloader = loader

    def _val_metrics_update(self, data_sources, sample_uids, reward_extra_infos_dict, sample_turns,
                            expected_acc_counts=None) -> dict[str, float]:
        out = super()._val_metrics_update(data_sources, sample_uids, reward_extra_infos_dict, sample_turns,
                                          expected_acc_counts=expected_acc_counts)
        scores = reward_extra_infos_dict.get("acc") or reward_extra_infos_dict["reward"]
        out.update(self._heldout().metrics(int(self.global_steps), data_sources, sample_uids, scores))
        return out

    def _dump_generations(self, inputs, outputs, gts, scores, reward_extra_infos_dict, dump_path):
        # verl dumps a step's rollouts after the step (and may validate in between, dumping other rows through this
        # same method): the step's view labels a dump of exactly its rows
        keys = reward_extra_infos_dict.get("uid")
        view = self.step_view
        if view is not None and keys and view.keys and set(keys) == set(view.keys):
            labels = view.dump_rows()
            reward_extra_infos_dict = dict(reward_extra_infos_dict)
            for name in DUMP_COLUMNS:
                reward_extra_infos_dict[name] = [labels[k][name] for k in keys]
        return super()._dump_generations(inputs, outputs, gts, scores, reward_extra_infos_dict, dump_path)


class EnvSchedMixin:
    """EnvSched chooses every training prompt verl dispatches and observes each group's K rewards once the group is
    trained; placed before :class:`EnvaceTrainerMixin`, whose prompt ledger carries each uid's (selection, task).

    * **Selection.** Each ``_next_train_batch`` call (verl's warm-up, each step's batch, refills of evicted groups,
      of any size) is one selection: ``EnvScheduler.select(selection, size, exclude=in flight)``, with selection ids
      1, 2, ... (in a sync run one per step, so the id is the step). A task still in flight is chosen again only when
      the pool has too few others; the scheduler warns and counts it (``envsched/inflight_reselected``).
    * **Observation.** After each step the groups trained in it are observed under the selection that chose them
      (several selections may finish in one step, one selection over several steps); a group verl dropped, or one
      with no scored rollout, is dropped from the scheduler. Each (selection, task) is resolved exactly once.
    * **Resume.** The scheduler's state (``envsched.pt``) and the ledger are written before verl's checkpoint, which
      holds the same groups in flight (TransferQueue), so a resume neither loses nor repeats an observation.
    """

    STEP_FIELDS = ("uid", "rm_scores")  # read with the advantages by envace's step

    def _init_dataloader(self) -> None:
        super()._init_dataloader()
        rows = self.train_dataset.dataframe.select_columns(["extra_info"]).to_list()
        pool_kwargs = self.envace_config.agent.pool_kwargs
        t0 = time.perf_counter()
        self.scheduler, keys = build_scheduler(self.config, rows, pool_kwargs)
        self._row_of = {k: i for i, k in enumerate(keys)}
        self._sched_build_s: float | None = time.perf_counter() - t0
        logger.info("envsched: %d tasks, graph built in %.2fs", len(keys), self._sched_build_s)

    def _draw_prompts(self, num_prompts: int | None) -> tuple[Any, list[Any]]:
        size = int(num_prompts or self.config.data.train_batch_size)
        selection = max(self.scheduler.selections, default=0) + 1
        task_ids = self.scheduler.select(selection, size=size, exclude=self.scheduler.in_flight_mask())
        batch_dict = collate_fn([self.train_dataset[self._row_of[t]] for t in task_ids])
        uids = [str(uuid.uuid4()) for _ in task_ids]
        batch_dict["uid"] = np.array(uids, dtype=object)
        batch = tu.get_tensordict(batch_dict)
        tu.assign_non_tensor_data(batch, "global_steps", self.global_steps)
        log_selection(Path(self.config.trainer.default_local_dir),
                      {"step": self.global_steps, "selection": selection, "task_ids": task_ids, "uids": uids})
        return batch, [[selection, t] for t in task_ids]

    def step(self, metrics: dict, timing_raw: dict):
        batch = super().step(metrics, timing_raw)
        # envace's step read uid and rm_scores with the advantages (STEP_FIELDS) into the step's view, and settled
        # the prompt ledger: which groups were trained, and which verl dropped
        view = self.step_view
        data, settled, rows = view.updated, view.settled, view.rows
        uids = [str(u) for u in data["uid"]]
        t0 = time.perf_counter()
        unscored_total, observed = 0, []
        for selection, members in _by_selection(settled.trained).items():
            at = [i for i, u in enumerate(uids) if u in members]
            rewards, trajectories, unscored = collect_groups(
                [batch.keys[i] for i in at], [uids[i] for i in at], [data["rm_scores"][i] for i in at],
                [rows[i] for i in at], members, [batch.tags[i] for i in at])
            unscored_total += unscored
            if rewards:
                # all-or-nothing: an ObservationError (naming the task) leaves the scheduler unchanged
                self.scheduler.observe(selection, rewards, trajectories or None)
                observed.append(selection)
            silent = sorted(set(members.values()) - set(rewards))
            if silent:  # no scored rollout: resolved without an observation
                self.scheduler.drop(selection, silent)
        for selection, members in _by_selection(settled.dropped).items():
            self.scheduler.drop(selection, sorted(set(members.values())))
        metrics["envsched/unscored_rollouts"] = float(unscored_total)
        if not observed:
            logger.warning("envsched: step %d produced no scored rollout; nothing to observe", self.global_steps)
        # every ``envsched/*`` key of the selections observed (the latest last): selection (envs_per_batch,
        # selected_<evidence type>, ...), observation (realized_var_*, short_groups, ...) and the prediction
        # diagnostics (spearman_q_<evidence type>, ...); with none observed, the latest selection's
        for selection in observed or [max(self.scheduler.selections, default=0)]:
            metrics.update(self.scheduler.metrics(selection))
        metrics["envsched/trainer_observe_time_s"] = time.perf_counter() - t0
        if self._sched_build_s is not None:  # once per process (also after a resume)
            metrics["envsched/static_build_time_s"] = self._sched_build_s
            self._sched_build_s = None
        return batch

    def _save_checkpoint(self) -> None:
        # written before verl's own save, which marks the checkpoint complete last
        folder = self._checkpoint_folder()
        folder.mkdir(parents=True, exist_ok=True)
        save_scheduler_state(self.scheduler, folder / STATE_FILE)
        super()._save_checkpoint()

    def _load_checkpoint(self) -> None:
        super()._load_checkpoint()
        if self.global_steps <= 0:
            return
        path = self._checkpoint_folder() / STATE_FILE
        if not path.is_file():
            raise FileNotFoundError(
                f"resuming at step {self.global_steps} but {path} is missing: the checkpoint was not written "
                "by the envsched trainer, so the scheduler state cannot be restored"
            )
        load_scheduler_state(self.scheduler, path)
        logger.info("envsched: restored scheduler state from %s", path)


def _by_selection(settled: dict[str, Any]) -> dict[int, dict[str, str]]:
    """Ledger payloads ``{uid: [selection, task]}`` grouped as ``{selection: {uid: task}}``, oldest selection first."""
    out: dict[int, dict[str, str]] = {}
    for uid, (selection, task) in settled.items():
        out.setdefault(int(selection), {})[uid] = str(task)
    return dict(sorted(out.items()))


@register_trainer("envace_sync")
class EnvaceSyncTrainer(EnvaceTrainerMixin, PPOTrainerSync):
    """verl's sync trainer with envace's role labels, metrics and dumps."""

    VERL_MODE = "sync"


@register_trainer("envace_colocate_async")
class EnvaceColocateAsyncTrainer(EnvaceTrainerMixin, PPOTrainerColocateAsync):
    """verl's colocated async trainer (rollout and training share the devices; generation continues across
    steps, bounded by ``trainer.v1.sampler.max_off_policy_threshold``) with envace's labels, metrics and dumps."""

    VERL_MODE = "colocate_async"


@register_trainer("envace_separate_async")
class EnvaceSeparateAsyncTrainer(EnvaceTrainerMixin, PPOTrainerSeparateAsync):
    """verl's separated async trainer (a standalone rollout pool; weights sent every
    ``trainer.v1.separate_async.parameter_sync_step`` mini-batches) with envace's labels, metrics and dumps."""

    VERL_MODE = "separate_async"


@register_trainer("envsched_sync")
class EnvSchedSyncTrainer(EnvSchedMixin, EnvaceTrainerMixin, PPOTrainerSync):
    """``envace_sync`` with EnvSched choosing every training batch."""

    VERL_MODE = "sync"


@register_trainer("envsched_colocate_async")
class EnvSchedColocateAsyncTrainer(EnvSchedMixin, EnvaceTrainerMixin, PPOTrainerColocateAsync):
    """``envace_colocate_async`` with EnvSched choosing every prompt dispatched."""

    VERL_MODE = "colocate_async"


@register_trainer("envsched_separate_async")
class EnvSchedSeparateAsyncTrainer(EnvSchedMixin, EnvaceTrainerMixin, PPOTrainerSeparateAsync):
    """``envace_separate_async`` with EnvSched choosing every prompt dispatched."""

    VERL_MODE = "separate_async"


#: every trainer mode envace registers, and its class
TRAINERS: dict[str, type] = {name: cls for name, cls in TRAINER_REGISTRY.items() if cls.__module__ == __name__}
