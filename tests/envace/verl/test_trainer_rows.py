"""envace's V1 trainers read each trained row's ``extra_fields`` from TransferQueue once per step, through the
rollout contract (envace/agents/contract.py), into the step's view (``StepView``): ``_compute_advantage`` (under
``grpo_rolewise``) reads them and hands the estimator the role labels; the step's metrics, rollout-dump labels and
EnvSched's observation reuse that read; the advantages and EnvSched's ``uid``/``rm_scores`` come in one more read
after the update.

verl's own ``step``/``_compute_advantage`` are replaced by stand-ins that call the envace overrides the way verl
0.9.1 does (``step`` runs ``_compute_advantage`` once per sub-batch, then returns the combined batch meta), and
TransferQueue by an in-memory store that records every read."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from transfer_queue import KVBatchMeta

from envace import advantage
from envace.agents.contract import RolloutFields, RolloutFieldsError
from envace.config import AdvantageConfig, validate_envace_config
from envace.roles import Role


def wire(role: Role, traj: str, index: int, *, failed: bool = False, empty: bool = False, calls: float = 1.0):
    return RolloutFields(
        role=role, trajectory_id=traj, output_index=index, task_id="t1", pool="p", env_id="e",
        observation_source="rehearse", stop_reason="completed", reward=0.0 if failed else 1.0,
        verify_failed=failed, counters={"tool_calls": calls}, actions=({"name": "ls", "arguments": {}},),
        empty=empty, num_tokens=5 + index,
    ).to_extra_fields()


#: two prompts (u1, u2); rollout u1_0 has an act and a rehearse output; u2_0's verifier failed; one padding row
ROWS = {
    "u1_0_0": wire(Role.ACT, "u1_0", 0),
    "u1_0_1": wire(Role.REHEARSE, "u1_0", 1, empty=True),
    "u1_1_0": wire(Role.ACT, "u1_1", 0, calls=3.0),
    "u2_0_0": wire(Role.ACT, "u2_0", 0, failed=True),
    "u2_1_0": wire(Role.ACT, "u2_1", 0),
}
ROWS["pad_0_0"] = dict(ROWS["u1_0_0"])
SUB_BATCHES = [["u1_0_0", "u1_0_1", "u1_1_0"], ["u2_0_0", "u2_1_0", "pad_0_0"]]


class Store:
    """TransferQueue's ``kv_batch_get`` over ``ROWS``, recording (keys, fields) of every call."""

    def __init__(self, rows):
        self.rows, self.reads = rows, []
        self.registered: set[str] = set()  # prompt uids still in the partition after the step (in flight)

    def kv_list(self, partition_id=None):
        return {"train": {uid: {"is_prompt": True, "status": "running"} for uid in self.registered}}

    def kv_batch_get(self, keys, partition_id, select_fields):
        self.reads.append((list(keys), list(select_fields)))
        out = {}
        for f in select_fields:
            if f == "extra_fields":
                out[f] = np.array([self.rows[k] for k in keys], dtype=object)
            elif f == "advantages":
                out[f] = torch.tensor([[0.5 * i, 0.0] for i, _ in enumerate(keys)])
            elif f == "uid":
                out[f] = np.array([k.split("_")[0] for k in keys], dtype=object)
            elif f == "rm_scores":
                out[f] = [torch.tensor([0.0, float(not self.rows[k]["reward_extra_info"]["verify_failed"])])
                          for k in keys]
        return out

    def extra_field_reads(self):
        return [k for keys, fields in self.reads if "extra_fields" in fields for k in keys]


@pytest.fixture
def verl_stand_ins(monkeypatch):
    """(store, estimator label log): TransferQueue replaced by a Store; verl's step and _compute_advantage by
    stand-ins that run envace's overrides as verl 0.9.1 does."""
    import transfer_queue
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    store = Store(ROWS)
    labels_seen: list[dict] = []
    monkeypatch.setattr(transfer_queue, "kv_batch_get", store.kv_batch_get)
    monkeypatch.setattr(transfer_queue, "kv_list", store.kv_list)

    def verl_compute_advantage(self, batch, metrics):
        labels_seen.append(advantage._LABELS.get())  # what grpo_rolewise would read
        return batch

    def verl_step(self, metrics, timing_raw):
        keys, tags = [], []
        for sub in SUB_BATCHES:  # parameter_sync_step=2: one _step_once per sub-batch
            sub_tags = [{"is_padding": k.startswith("pad")} for k in sub]
            self._compute_advantage(KVBatchMeta(keys=sub, tags=sub_tags, partition_id="train"), metrics)
            keys += sub
            tags += sub_tags
        return KVBatchMeta(keys=keys, tags=tags, partition_id="train")

    monkeypatch.setattr(PPOTrainer, "_compute_advantage", verl_compute_advantage)
    monkeypatch.setattr(PPOTrainer, "step", verl_step)
    return store, labels_seen


def make_trainer(mode: str, estimator: str, run_dir: Path | None = None):
    from verl.trainer.ppo.v1.trainer_base import get_trainer_cls

    from envace.verl.extensions import register_trainer_extensions

    register_trainer_extensions()
    cls = get_trainer_cls(mode)
    trainer = cls.__new__(cls)  # verl's __init__ is not run: no workers, no Ray
    trainer.config = OmegaConf.create({"algorithm": {"adv_estimator": estimator},
                                       "envace": {"advantage": {"baseline": "trajectory"}},
                                       "trainer": {"v1": {"sampler": {"max_off_policy_threshold": 2}},
                                                   "default_local_dir": str(run_dir or "/nonexistent")}})
    trainer.envace_config = validate_envace_config(trainer.config)  # what the mixin's __init__ attaches
    trainer.step_view = None
    trainer.global_steps = 3
    return trainer


@pytest.mark.parametrize("kind", ["sync", "colocate_async", "separate_async"])
def test_rolewise_step_reads_each_rows_extra_fields_once_and_labels_the_estimator(verl_stand_ins, kind):
    """The same in each of verl's three trainers the mixin is placed before."""
    store, labels_seen = verl_stand_ins
    trainer = make_trainer(f"envace_{kind}", "grpo_rolewise")
    metrics: dict = {}
    batch = trainer.step(metrics, {})
    assert sorted(store.extra_field_reads()) == sorted(ROWS)  # every row once, none twice
    assert len(store.reads) == 3  # one per sub-batch's advantage, one after the update (advantages only)
    assert store.reads[-1][1] == ["advantages"]
    first, second = labels_seen
    assert list(first["roles"]) == ["act", "rehearse", "act"] and list(first["traj_index"]) == ["u1_0"] * 2 + ["u1_1"]
    assert all(type(r) is Role for r in first["roles"])  # the role type itself, not its wire name
    assert list(first["empty"]) == [False, True, False]
    assert first["options"] == {**dataclasses.asdict(AdvantageConfig()), "baseline": "trajectory"}  # the typed config
    assert list(second["valid"]) == [False, True, False]  # u2_0 unscored, the padding row never valid
    assert metrics["envace/act/outputs"] == 4 and metrics["envace/rehearse/outputs"] == 1  # padding left out
    assert metrics["envace/rehearse/empty_rate"] == 1.0 and metrics["envace/masked_rate"] == 0.25
    assert metrics["envace/act/calls_per_trajectory"] == 1.5  # (1 + 3 + 1 + 1) / 4 trajectories
    assert metrics["envace/act/advantage_mean"] == pytest.approx(np.mean([0.0, 1.0, 2.0]))  # u2_0 masked
    # the rollout dump's labels (DUMP_COLUMNS): role, trajectory, advantage, environment, source, simulated calls,
    # the row's rollout-vs-actor difference (only when verl recomputed the old log-probs), the task, and the weight
    # versions verl tagged the row with (absent in these stand-in tags)
    assert trainer.step_view.dump_rows()["u1_0_1"] == {
        "role": "rehearse", "trajectory_id": "u1_0", "advantage": 0.5, "env_id": "e", "observation_source": "rehearse",
        "simulated_calls": 0.0, "rollout_probs_diff_max": None, "task_id": "t1", "dispatch_step": None,
        "min_global_steps": None, "max_global_steps": None}
    assert batch.keys == SUB_BATCHES[0] + SUB_BATCHES[1]


def test_without_rolewise_the_one_read_after_the_update_brings_the_extra_fields(verl_stand_ins):
    store, labels_seen = verl_stand_ins
    trainer = make_trainer("envace_sync", "grpo")
    metrics: dict = {}
    trainer.step(metrics, {})
    assert labels_seen == [None, None] and len(store.reads) == 1
    assert store.reads[0][1] == ["advantages", "extra_fields"] and sorted(store.extra_field_reads()) == sorted(ROWS)
    assert metrics["envace/rehearse/outputs"] == 1


def test_envsched_observes_each_trained_group_under_the_selection_that_chose_it(verl_stand_ins, tmp_path):
    """The step trains u1 (chosen by selection 1) and u2 (selection 2); u3 (selection 2) is still registered in
    TransferQueue, so in flight; u4 (selection 1) is gone without being trained: verl dropped it. Each trained
    group is observed under its own selection, from the step's one read; the dropped one is dropped from the
    scheduler; the ledger's line says so."""
    store, _ = verl_stand_ins
    trainer = make_trainer("envsched_sync", "grpo_rolewise", tmp_path)

    class Scheduler:
        def __init__(self):
            self.calls = []

        def observe(self, selection, rewards, trajectories):
            self.calls.append(("observe", selection, rewards, trajectories))

        def drop(self, selection, task_ids):
            self.calls.append(("drop", selection, task_ids))

        def metrics(self, selection):
            return {"envsched/selection": float(selection)}

    trainer.scheduler, trainer.global_steps, trainer._sched_build_s = Scheduler(), 3, None
    trainer._ledger.dispatched(1, ["u1", "u4"], [[1, "p/t1"], [1, "p/t4"]])
    trainer._ledger.dispatched(2, ["u2", "u3"], [[2, "p/t2"], [2, "p/t3"]])
    store.registered = {"u3"}
    metrics: dict = {}
    trainer.step(metrics, {})
    assert len(store.reads) == 3 and store.reads[-1][1] == ["advantages", "uid", "rm_scores"]
    assert sorted(store.extra_field_reads()) == sorted(ROWS)
    observe1, observe2, drop = trainer.scheduler.calls
    assert observe1[:3] == ("observe", 1, {"p/t1": [1.0, 1.0]})
    assert observe1[3]["p/t1"] == [[{"name": "ls", "arguments": {}}]] * 2
    assert observe2[:3] == ("observe", 2, {"p/t2": [1.0]})  # u2_0 unscored, padding skipped
    assert drop == ("drop", 1, ["p/t4"])
    assert metrics["envsched/unscored_rollouts"] == 1.0 and metrics["envsched/selection"] == 2.0
    assert metrics["envace/prompts/trained"] == 2 and metrics["envace/prompts/dropped"] == 1
    assert metrics["envace/prompts/in_flight"] == 1 and list(trainer._ledger.open) == ["u3"]
    line = json.loads((tmp_path / "prompts.jsonl").read_text())
    assert line == {"step": 3, "dispatched": {"u1": 1, "u4": 1, "u2": 2, "u3": 2}, "trained": ["u1", "u2"],
                    "dropped": ["u4"], "open": ["u3"]}


def test_a_row_that_breaks_the_contract_stops_the_step_before_the_estimator_runs(verl_stand_ins, monkeypatch):
    _, labels_seen = verl_stand_ins
    monkeypatch.setitem(ROWS, "u1_0_1", {**ROWS["u1_0_1"], "role": "actor"})
    trainer = make_trainer("envace_sync", "grpo_rolewise")
    with pytest.raises(RolloutFieldsError, match="row u1_0_1: extra_fields.role: 'actor' is not a role"):
        trainer.step({}, {})
    assert labels_seen == []
    monkeypatch.setitem(ROWS, "u1_0_1", {k: v for k, v in ROWS["u1_0_1"].items() if k != "trajectory_id"})
    with pytest.raises(RolloutFieldsError, match="row u1_0_1: extra_fields lack trajectory_id"):
        make_trainer("envace_sync", "grpo").step({}, {})


def test_row_probs_diff_max_names_the_row_verls_batch_maximum_comes_from():
    """The per-row column of the rollout dump: the largest probability difference over the row's response tokens
    (masked tokens ignored), whose maximum over rows is verl's ``training/rollout_probs_diff_max``."""
    from envace.verl.trainer import row_probs_diff_max

    def nested(rows):
        return torch.nested.nested_tensor([torch.tensor(r) for r in rows], layout=torch.jagged)

    old = nested([[-0.1, -2.0, -0.5], [-1.0], [-0.3, -0.3]])
    roll = nested([[-0.1, -2.0, -5.0], [-1.5], [-0.3, -0.3]])
    mask = nested([[1, 1, 0], [1], [0, 0]])
    got = row_probs_diff_max(old, roll, mask)
    # row 0: its only differing token is masked; row 1: |e^-1 - e^-1.5|; row 2: nothing to compare
    assert got[0] == pytest.approx(0.0) and got[1] == pytest.approx(np.exp(-1.0) - np.exp(-1.5)) and got[2] is None


def test_role_is_metrics_weigh_each_roles_response_tokens():
    """verl's rollout-correction weights, per role over masked-in tokens: the rehearse role's tokens carry them as the
    act role's do; verl's padding rows are left out."""
    from envace.verl.trainer import role_is_metrics

    def nested(rows):
        return torch.nested.nested_tensor([torch.tensor(r, dtype=torch.float32) for r in rows], layout=torch.jagged)

    rows = [RolloutFields(role=Role.ACT), RolloutFields(role=Role.REHEARSE), RolloutFields(role=Role.ACT)]
    weights = nested([[1.0, 2.0, 9.0], [0.5, 1.5], [4.0]])
    mask = nested([[1, 1, 0], [1, 1], [1]])
    out = role_is_metrics(rows, weights, mask, tags=[{}, {}, {"is_padding": True}])
    assert out == {"envace/act/is_weighted_tokens": 2.0, "envace/act/is_weight_mean": 1.5,
                   "envace/rehearse/is_weighted_tokens": 2.0, "envace/rehearse/is_weight_mean": 1.0}


def test_the_steps_view_labels_the_dump_of_its_own_rows_only(verl_stand_ins, monkeypatch):
    """verl validates between a step and its rollout dump, dumping validation rows through the same
    ``_dump_generations``: those pass through unlabelled; the step's own rows get every dump column."""
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    from envace.verl.trainer import DUMP_COLUMNS

    dumped: list[dict] = []
    monkeypatch.setattr(PPOTrainer, "_dump_generations",
                        lambda self, inputs, outputs, gts, scores, extra, dump_path: dumped.append(extra))
    trainer = make_trainer("envace_sync", "grpo_rolewise")
    batch = trainer.step({}, {})
    trainer._dump_generations([], [], [], [], {"uid": ["val_0", "val_1"]}, "/val")
    keys = list(reversed(batch.keys))  # verl dumps in its own order
    trainer._dump_generations([], [], [], [], {"uid": keys}, "/rollouts")
    validation, training = dumped
    assert validation == {"uid": ["val_0", "val_1"]}
    assert set(training) == {"uid", *DUMP_COLUMNS}
    assert training["role"] == [trainer.step_view.dump_rows()[k]["role"] for k in keys]
    assert training["role"][keys.index("u1_0_1")] == "rehearse"
