"""scripts/gpu_smoke.sh on CPU: the pre-check, the recipe as one node runs it (every memory setting the recipe's),
each row made to fail (the run-directory checks against written metrics, the checkpoint row against written shards,
the resume row against a launch's output, the peak-memory row against measured values, the cluster rows on Ray nodes
on loopback: two with token authentication, and one without it that no second node joins), and the dry run, which
stops with exit status 3 where CUDA is needed; the full run is a `gpu` test (ENVACE_SMOKE_MODEL=<checkpoint>)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from envace import gpu_smoke

REPO = Path(__file__).resolve().parents[2]

#: Qwen3-0.6B's shape (config.json only: the dry run never loads weights)
QWEN3_0_6B = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 1024,
              "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
              "head_dim": 128, "tie_word_embeddings": True}
#: a Qwen3 small enough to train on CPU from its config.json alone (random weights)
TINY = dict(QWEN3_0_6B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
#: the recipes the issue names; every GPU recipe is checked by test_every_gpu_recipe_is_offered
RECIPES = ("envace_qwen3_8b_h20_2x8", "envace_qwen3_8b_h100_2x8", "envace_qwen3_1_7b_h20_2x8",
           "envace_qwen3_4b_h20_2x8", "envace_qwen3_8b_h20_2x8_async")


def checkpoint(tmp_path: Path, config: dict | None = None, name: str = "Qwen3-0.6B") -> Path:
    ckpt = tmp_path / name
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(config or QWEN3_0_6B))
    return ckpt


def test_parameter_estimate_matches_qwen3_sizes():
    assert 0.55e9 < gpu_smoke.estimate_params(QWEN3_0_6B) < 0.65e9
    q17 = dict(QWEN3_0_6B, hidden_size=2048, intermediate_size=6144, num_attention_heads=16)
    assert 1.6e9 < gpu_smoke.estimate_params(q17) < 2.1e9  # Qwen3-1.7B: 1.7B without embeddings, 2.0B with


# -- the recipe on one node --------------------------------------------------------------------------------------

def _flat(node, prefix: str = "") -> dict:
    if isinstance(node, dict):
        return {k: v for key, value in node.items() for k, v in _flat(value, f"{prefix}{key}.").items()}
    return {prefix[:-1]: node}


#: keys the config interpolates from a shrunk one (rollout.n_gpus_per_node from trainer's, the critic's mini-batch
#: from the actor's, EnvSched's batch from data.train_batch_size); trainer.logger adds verl's file logger, whose
#: metrics the checks read
DERIVED = {"actor_rollout_ref.rollout.n_gpus_per_node", "actor_rollout_ref.rollout.nnodes",
           "critic.ppo_mini_batch_size", "envsched.batch_size", "trainer.logger"}


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_smoke_run_is_the_recipe_but_for_nodes_batch_and_length(recipe):
    """Every value of the composed config but SHRUNK_KEYS (and what verl interpolates from them) is the recipe's:
    the memory settings, token budgets and tensor-parallel size among them; each change is named."""
    from envace.verl.config import compose

    model, run = "/models/Qwen3-8B", "/tmp/run"
    full = compose([f"experiment={recipe}", f"actor_rollout_ref.model.path={model}", f"trainer.default_local_dir={run}"])
    smoke = gpu_smoke.smoke_config(recipe, model, Path(run), 2, available_gpus=4)
    before, after = (_flat(OmegaConf.to_container(c, resolve=True)) for c in (full, smoke.cfg))
    changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    assert changed <= set(gpu_smoke.SHRUNK_KEYS) | DERIVED, changed - set(gpu_smoke.SHRUNK_KEYS) - DERIVED
    assert not changed & set(gpu_smoke.MEMORY_KEYS)
    assert all(k in before for k in gpu_smoke.MEMORY_KEYS)  # a renamed key would make the check above vacuous
    t = smoke.cfg.trainer
    assert (t.nnodes, t.n_gpus_per_node, t.total_training_steps, t.save_freq, t.test_freq) == (1, 4, 2, 2, 2)
    assert smoke.recipe_gpus == 16 and "nnodes 2 -> 1" in smoke.changes and "n_gpus_per_node 8 -> 4" in smoke.changes
    assert len(smoke.changes) == len([k for k in gpu_smoke.SHRUNK_KEYS if k in changed])


@pytest.mark.parametrize(("gpus", "expect"), [(None, 8), (8, 8), (3, 2), (1, None)])
def test_the_smoke_run_validates_on_the_node_it_runs_on(gpus, expect):
    """The 8B recipe (TP 2) on a full node, on 3 GPUs (one whole vLLM replica of 2), and on 1 GPU, where its
    tensor-parallel size cannot run: a usage error naming --recipe."""
    from envace.config import validate_envace_config
    from envace.verl.config import validate_verl_config

    if expect is None:
        with pytest.raises(gpu_smoke.SmokeError, match="argument --recipe: its tensor-parallel size 2 needs 2 GPUs"):
            gpu_smoke.smoke_config(gpu_smoke.DEFAULT_RECIPE, "/m/Qwen3-8B", Path("/tmp/run"), 2, gpus)
        return
    smoke = gpu_smoke.smoke_config(gpu_smoke.DEFAULT_RECIPE, "/m/Qwen3-8B", Path("/tmp/run"), 2, gpus)
    a = smoke.cfg.actor_rollout_ref
    assert (smoke.cfg.trainer.n_gpus_per_node, a.rollout.tensor_model_parallel_size) == (expect, 2)
    assert smoke.cfg.data.train_batch_size * a.rollout.n % expect == 0 and smoke.cfg.data.train_batch_size >= 2
    assert a.actor.optim.lr == gpu_smoke.SMOKE_LR and a.actor.kl_loss_coef == 1e-4  # the paper's KL
    validate_envace_config(smoke.cfg)
    validate_verl_config(smoke.cfg, model=False)


def test_every_gpu_recipe_is_offered():
    gpu = [n for n in gpu_smoke.recipe_names() if gpu_smoke.is_gpu_recipe(n)]
    assert set(RECIPES) <= set(gpu) and not [n for n in gpu if n.startswith("cpu_")]
    assert gpu_smoke.recipe_defaults("envace_qwen3_8b_h100_2x8") == ["envace_qwen3_8b_h20_2x8", "_self_"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU: the smoke test would run")
def test_dry_run_on_cpu_stops_where_cuda_is_needed(tmp_path):
    ckpt = checkpoint(tmp_path)
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run([str(REPO / "scripts" / "gpu_smoke.sh"), str(ckpt), "--recipe", "envace_qwen3_8b_h100_2x8",
                          "--out", str(tmp_path / "out")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 3, out.stdout[-3000:] + out.stderr[-3000:]
    assert ("stopped before the GPU checks (the checkpoint and the recipe are fine): this machine has no CUDA GPU"
            in out.stderr)
    table = out.stdout[out.stdout.index("check "):]
    assert "[ok] checkpoint: qwen3, ~0.60B parameters" in out.stdout
    recipe = next(line for line in table.splitlines() if line.startswith("recipe"))
    assert "envace_qwen3_8b_h100_2x8 -> 1x8 GPU, batch 2x4" in recipe
    assert ("gpu_memory_utilization 0.6, prompt/response/context 12000/8000/20000 tokens, ppo_max_token_len_per_gpu "
            "24000, TP 2") in recipe
    assert "shrunk: nnodes 2 -> 1, train_batch_size 16 -> 2" in recipe
    assert "the recipe's model is /models/Qwen3-8B: memory figures are MODEL's" in recipe
    assert "CUDA" in table and "FAIL" in table
    assert not (tmp_path / "out" / "run").exists()  # nothing started


# -- the pre-check -----------------------------------------------------------------------------------------------

def test_bad_checkpoint_is_a_usage_error(tmp_path, capsys):
    (tmp_path / "no-config").mkdir()
    with pytest.raises(SystemExit) as exit_:
        gpu_smoke.main([str(tmp_path / "no-config")])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (f"scripts/gpu_smoke.sh: error: argument model: {tmp_path / 'no-config'} has "
                                       "no config.json (a local Hugging Face checkpoint is required) (see --help)\n")


#: Qwen3-VL-2B's config.json in outline: the text model's sizes are nested in text_config
QWEN3_VL = {"model_type": "qwen3_vl", "architectures": ["Qwen3VLForConditionalGeneration"],
            "text_config": {**QWEN3_0_6B, "model_type": "qwen3_vl_text"}, "vision_config": {"depth": 24}}
CLUSTER_ENV = {"MASTER_ADDR": "10.0.0.1", "RAY_AUTH_TOKEN": "x" * 64}


@pytest.mark.parametrize(("args", "env", "code", "says"), [
    (["--help"], {}, 0, "usage: scripts/gpu_smoke.sh"),
    ([], {}, 2, "scripts/gpu_smoke.sh: error: the following arguments are required: model (see --help)"),
    (["{tmp}/missing"], {}, 2,
     "scripts/gpu_smoke.sh: error: argument model: {tmp}/missing: no such checkpoint folder"),
    (["{tmp}/empty"], {}, 2, ("scripts/gpu_smoke.sh: error: argument model: {tmp}/empty/config.json: line 1 column 1: "
                              "not JSON (Expecting value)")),
    (["{tmp}/vl"], {}, 2, ("scripts/gpu_smoke.sh: error: argument model: {tmp}/vl/config.json: model_type "
                           "'qwen3_vl', a multimodal checkpoint (text_config), but the smoke test trains a text-only")),
    (["{tmp}/Qwen3-0.6B", "--out", "{tmp}/a-file/out"], {}, 2,
     "scripts/gpu_smoke.sh: error: argument --out: {tmp}/a-file/out: {tmp}/a-file is a file, not a directory"),
    (["{tmp}/Qwen3-0.6B", "--recipe", "envace_qwen3_8b_h30_2x8"], {}, 2,
     "scripts/gpu_smoke.sh: error: argument --recipe: no recipe 'envace_qwen3_8b_h30_2x8' in "),
    (["{tmp}/Qwen3-0.6B", "--recipe", "cpu_default"], {}, 2,
     "scripts/gpu_smoke.sh: error: argument --recipe: cpu_default is not a GPU recipe"),
    (["{tmp}/Qwen3-0.6B", "--nodes", "0"], {}, 2,
     "scripts/gpu_smoke.sh: error: argument --nodes: expected a whole number >= 1, got '0'"),
    (["{tmp}/Qwen3-0.6B", "--nodes", "2"], {"RAY_AUTH_TOKEN": "x"}, 2,
     "scripts/gpu_smoke.sh: error: argument --nodes: MASTER_ADDR (this head node's address"),
    (["{tmp}/Qwen3-0.6B", "--nodes", "2"], {"MASTER_ADDR": "10.0.0.1"}, 2,
     "scripts/gpu_smoke.sh: error: argument --nodes: export RAY_AUTH_TOKEN=<secret> or RAY_AUTH_TOKEN_PATH"),
    (["{tmp}/Qwen3-0.6B", "--nodes", "2"], {**CLUSTER_ENV, "RAY_AUTH_MODE": "disabled"}, 2,
     "scripts/gpu_smoke.sh: error: argument --nodes: RAY_AUTH_MODE=disabled: the smoke test checks Ray's token"),
    (["{tmp}/Qwen3-0.6B", "--nodes", "2"], {**CLUSTER_ENV, "NODE_RANK": "1"}, 2,
     "scripts/gpu_smoke.sh: error: argument --nodes: NODE_RANK=1: the smoke test runs on the head"),
])
def test_the_script_answers_help_and_usage_mistakes_before_it_installs_anything(tmp_path, args, env, code, says):
    """On a node without the virtualenv (ENVACE_VENV names none; a GPU node's lock), the arguments, the model's
    config.json, the recipe's name and the cluster's variables are checked with the system python3 before
    bootstrap.sh would take its lock and install."""
    checkpoint(tmp_path)
    for name, text in (("empty", ""), ("vl", json.dumps(QWEN3_VL))):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(text)
    (tmp_path / "a-file").write_text("x")
    venv = tmp_path / "venv"
    base = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "NODE_RANK", "RAY_PORT", "RAY_AUTH_MODE",
                                                             "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    out = subprocess.run([str(REPO / "scripts" / "gpu_smoke.sh"), *(a.format(tmp=tmp_path) for a in args)],
                         cwd=tmp_path, env={**base, **env, "ENVACE_VENV": str(venv), "ENVACE_PLATFORM": "gpu"},
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == code, out.stderr
    if code:
        assert out.stderr.startswith(says.format(tmp=tmp_path)) and len(out.stderr.splitlines()) == 1, out.stderr
    else:
        assert out.stdout.startswith(says) and "--recipe RECIPE" in out.stdout and "--nodes NODES" in out.stdout
        assert not out.stderr
    assert not venv.exists() and not Path(f"{venv}.lock").exists()  # bootstrap.sh never ran


def test_the_pre_check_needs_only_the_standard_library(tmp_path):
    """``python3 -S`` (no site-packages: a node's system Python) runs the pre-check of a good checkpoint, recipe
    and cluster."""
    cmd = [sys.executable, "-S", "-E", "-m", "envace.gpu_smoke", "--preflight", str(checkpoint(tmp_path)),
           "--recipe", "envace_qwen3_4b_h20_2x8", "--nodes", "2", "--out", str(tmp_path / "out")]
    out = subprocess.run(cmd, cwd=REPO, env={**os.environ, **CLUSTER_ENV}, capture_output=True, text=True,
                         timeout=60, check=False)
    assert (out.returncode, out.stdout, out.stderr) == (0, "", "")
    assert not (tmp_path / "out").exists()


JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 5000) | st.floats() | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                    max_leaves=8)
CONFIG_KEYS = ("model_type", *gpu_smoke.SIZE_KEYS, *gpu_smoke.OPTIONAL_SIZE_KEYS, "text_config", "tie_word_embeddings")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(config=JSON | st.dictionaries(st.sampled_from(CONFIG_KEYS), JSON | st.integers(1, 4096)
                                     | st.sampled_from(["qwen3", "qwen2", "qwen3_vl"])))
def test_any_config_json_is_accepted_with_a_size_or_refused_in_one_line(tmp_path, config):
    folder = tmp_path / "ckpt"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    try:
        model = gpu_smoke.checkpoint_arg(str(folder))
    except argparse.ArgumentTypeError as exc:
        assert str(exc).startswith(str(folder)) and "\n" not in str(exc)
        return
    assert model.config["model_type"] in ("qwen3", "qwen2")
    assert gpu_smoke.estimate_params(model.config) > 0


def test_the_docs_state_the_time_bound_the_time_outs_give():
    """docs/gpu.md's "Checking one GPU node" states the bounds the time-outs give (one node; the cluster checks)."""
    section = (REPO / "docs" / "gpu.md").read_text().split("## Checking one GPU node", 1)[1].split("\n## ", 1)[0]
    assert f"(at most {-(-gpu_smoke.TIME_BOUND_S // 60)} minutes: the sum of" in section, section[:600]
    assert f"for the nodes to join, plus {-(-gpu_smoke.CLUSTER_BOUND_S // 60)} minutes)" in section
    assert "≤ 10 minutes" not in section


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_full_smoke_on_a_gpu(tmp_path):
    model = os.environ.get("ENVACE_SMOKE_MODEL")
    if not model:
        pytest.skip("set ENVACE_SMOKE_MODEL to a local checkpoint of the recipe's model (Qwen3-8B)")
    out = subprocess.run([str(REPO / "scripts" / "gpu_smoke.sh"), model, "--out", str(tmp_path / "out")],
                         cwd=REPO, capture_output=True, text=True, timeout=gpu_smoke.TIME_BOUND_S + 600, check=False)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]


# -- the run-directory checks, on written metrics (no GPU needed) ----------------------------------------------------

#: a healthy step; the probability difference is the bf16 value verl's own runs report (verl-project/verl#7749)
GOOD = {"training/rollout_probs_diff_mean": 6.4e-3, "training/rollout_probs_diff_max": 0.2,
        "training/rollout_actor_probs_pearson_corr": 0.985, "actor/grad_norm": 0.8, "actor/pg_loss": 0.01,
        "actor/kl_loss": 1e-4, "critic/score/mean": 0.25, "envace/act/calls_per_trajectory": 1.5,
        "actor/perf/max_memory_allocated_gb": 30.0}


def run_dir_with(tmp_path: Path, changes: dict[int, dict]) -> Path:
    """A run directory as verl and envace write it: metrics JSONL (one line a step) and rollout dumps."""
    run = tmp_path / "run"
    (run / "metrics").mkdir(parents=True)
    (run / "rollouts").mkdir()
    lines = []
    for step in (1, 2, 3):
        data = {**GOOD, **changes.get(step, {})}
        if step == 2 and "no_val" not in changes:
            data["val-core/bfcl_multi_turn/reward/mean@1"] = 0.1
        lines.append(json.dumps({"step": step, "data": {k: v for k, v in data.items() if v is not None}}))
        rows = [{"role": "act", "uid": f"u{i}", "trajectory_id": f"t{i // 2}", "score": 0.5,
                 "output": '<tool_call>{"name": "ls", "arguments": {}}</tool_call>'} for i in range(4)]
        (run / "rollouts" / f"{step}.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (run / "metrics" / "m.jsonl").write_text("\n".join(lines))
    return run


def test_the_run_checks_pass_on_a_healthy_run(tmp_path):
    report = gpu_smoke.Report()
    gpu_smoke.check_run_outputs(report, run_dir_with(tmp_path, {}), gpu_gb=80.0, tp=2)
    assert not report.failed, report.table()
    assert {r[0] for r in report.rows} >= {"step 2 validation", "peak memory, FSDP2 engine", "step 2 update",
                                           "step 1 weight sync (TP 2, before any update)",
                                           "step 2 weight sync (TP 2, after update 1)",
                                           "step 3 weight sync (TP 2, after update 2)"}


@pytest.mark.parametrize(("changes", "failing"), [
    # a stale sync after the update at SMOKE_LR: the rollout's probabilities are the old policy's
    ({2: {"training/rollout_probs_diff_mean": 0.04, "training/rollout_probs_diff_max": 0.9,
          "training/rollout_actor_probs_pearson_corr": 0.93}}, "step 2 weight sync (TP 2, after update 1)"),
    # just above bf16's per-token bound (2 x 2^-8 x |z| / 4 at |z| ~ 10): more than rounding explains
    ({3: {"training/rollout_probs_diff_mean": 0.021}}, "step 3 weight sync (TP 2, after update 2)"),
    # a rollout on weights that were never synced: tiny differences, no correlation
    ({1: {"training/rollout_probs_diff_mean": 6.6e-6, "training/rollout_actor_probs_pearson_corr": -0.01}},
     "step 1 weight sync (TP 2, before any update)"),
    # verl reported no rollout-vs-trainer comparison at all (e.g. bypass mode): not a pass
    ({3: {"training/rollout_probs_diff_mean": None, "training/rollout_actor_probs_pearson_corr": None}},
     "step 3 weight sync (TP 2, after update 2)"),
    ({2: {"actor/grad_norm": 0.0}}, "step 2 update"),
    ({3: {"actor/kl_loss": float("nan")}}, "step 3 loss/KL/grad-norm"),
    ({1: {"critic/score/mean": 1.5}}, "step 1 reward, tool calls"),
    ({"no_val": {}}, "step 2 validation"),
    ({3: {"actor/perf/max_memory_allocated_gb": 81.0}}, "peak memory, FSDP2 engine"),
])
def test_the_run_checks_fail_on_a_broken_run(tmp_path, changes, failing):
    report = gpu_smoke.Report()
    gpu_smoke.check_run_outputs(report, run_dir_with(tmp_path, changes), gpu_gb=80.0, tp=2)
    failed = [r[0] for r in report.rows if r[1] == "FAIL"]
    assert failed == [failing], report.table()


def test_a_run_that_stopped_before_an_update_fails_the_steps_row(tmp_path):
    run = run_dir_with(tmp_path, {})
    metrics = run / "metrics" / "m.jsonl"
    metrics.write_text(metrics.read_text().splitlines()[0])  # step 1 only: no rollout after an update
    report = gpu_smoke.Report()
    gpu_smoke.check_run_outputs(report, run, gpu_gb=80.0, tp=2)
    assert ("steps logged", "FAIL", "[1]") in report.rows


def test_a_recipe_that_does_not_fit_the_node_fails_its_row(tmp_path):
    report = gpu_smoke.Report()
    assert gpu_smoke.check_recipe(report, gpu_smoke.DEFAULT_RECIPE, tmp_path / "Qwen3-8B", tmp_path / "run", 1) is None
    why = ("argument --recipe: its tensor-parallel size 2 needs 2 GPUs per vLLM replica, and this node has 1")
    assert report.rows == [("recipe", "FAIL", f"{gpu_smoke.DEFAULT_RECIPE} on one node does not validate: {why}")]


@pytest.mark.slow  # an envace.train process composes the config (about 8 s on 2 cores)
def test_a_training_launch_that_fails_fails_its_row_and_keeps_its_log(tmp_path):
    """The launch row is envace.train's exit status: a key the config does not have stops it (exit 2)."""
    report = gpu_smoke.Report()
    out = gpu_smoke.run_training(report, "train 2 steps", ["experiment=cpu_bfcl", "trainer.no_such_key=1"],
                                 tmp_path / "train.log", timeout=300)
    assert report.rows[0][:2] == ("train 2 steps", "FAIL") and report.rows[0][2].startswith("exit 2 in ")
    assert "no_such_key" in out and (tmp_path / "train.log").read_text() == out


# -- the checkpoint the first launch saves, and the second launch resuming from it ----------------------------------

def saved_run(tmp_path: Path, step: int = 2, world: int = 2) -> Path:
    """A run directory after verl 0.9.1 saved ``step``, as its FSDP checkpoint manager and trainer write it (tiny
    tensors): every rank's model, optimizer and extra-state shard, the dataloader's state, then the tracker."""
    run = tmp_path / "run"
    actor = run / f"global_step_{step}" / "actor"
    actor.mkdir(parents=True)
    for rank in range(world):
        for kind in ("model", "optim", "extra_state"):
            torch.save({"w": torch.zeros(2)}, actor / f"{kind}_world_size_{world}_rank_{rank}.pt")
    torch.save({"epoch": 0}, actor.parent / "data.pt")
    (run / "latest_checkpointed_iteration.txt").write_text(str(step))
    return run


def test_the_checkpoint_row_passes_on_a_complete_checkpoint_the_tracker_names(tmp_path):
    run = saved_run(tmp_path)
    report = gpu_smoke.Report()
    assert gpu_smoke.check_saved(report, run), report.table()
    says = f"{run}/global_step_2 complete (every rank's shards, data.pt), latest_checkpointed_iteration.txt names it"
    assert report.rows == [("checkpoint at step 2", "ok", says)]


#: each way a save goes wrong (made by damage()), and what the row then says; the row's former test (`actor/` is a
#: directory) passed every one but the first
BROKEN_SAVES = {
    # the first launch never saved (it failed before step 2)
    "nothing saved": "{run}/global_step_2 does not exist; no latest_checkpointed_iteration.txt in {run}",
    # the step's folders exist but hold nothing
    "empty actor/": "actor/ is empty",
    # a crash or a full disk in the middle of a write; a rank that never wrote
    "truncated shard": "actor/optim_world_size_2_rank_1.pt is not an intact torch archive",
    "missing rank": "actor/model: ranks [1] of world size 2 are missing",
    # verl writes the tracker last, and the resumed launch finds the checkpoint through it
    "no tracker": "no latest_checkpointed_iteration.txt in {run} (verl writes it after the checkpoint)",
    "tracker names step 1": "latest_checkpointed_iteration.txt names step '1', not 2",
}


def damage(run: Path, how: str) -> None:
    step, tracker = run / "global_step_2", run / "latest_checkpointed_iteration.txt"
    if how == "nothing saved":
        shutil.rmtree(step)
        tracker.unlink()
    elif how == "empty actor/":
        for f in (step / "actor").iterdir():
            f.unlink()
    elif how == "truncated shard":
        shard = step / "actor" / "optim_world_size_2_rank_1.pt"
        shard.write_bytes(shard.read_bytes()[:100])
    elif how == "missing rank":
        (step / "actor" / "model_world_size_2_rank_1.pt").unlink()
    elif how == "no tracker":
        tracker.unlink()
    else:
        assert how == "tracker names step 1", how
        tracker.write_text("1")


@pytest.mark.parametrize("how", BROKEN_SAVES)
def test_the_checkpoint_row_fails_on_a_checkpoint_a_relaunch_cannot_load(tmp_path, how):
    """The row is envace.verl.resume's completeness check (the one a relaunch makes) plus verl's tracker: each
    way a save goes wrong fails it, naming what is wrong."""
    run = saved_run(tmp_path)
    damage(run, how)
    report = gpu_smoke.Report()
    assert not gpu_smoke.check_saved(report, run)
    assert [r[:2] for r in report.rows] == [("checkpoint at step 2", "FAIL")]
    assert BROKEN_SAVES[how].format(run=run) in report.rows[0][2], report.rows[0][2]


def test_the_checkpoint_row_of_the_envsched_trainer_needs_the_schedulers_state(tmp_path):
    """With trainer.v1.trainer_mode=envsched_sync a relaunch restores EnvSched's state too: a checkpoint without
    envsched.pt fails, one with a loadable envsched.pt passes."""
    run = saved_run(tmp_path)
    report = gpu_smoke.Report()
    assert not gpu_smoke.check_saved(report, run, trainer_mode="envsched_sync")
    assert report.rows[-1][1:] == ("FAIL", "envsched.pt is missing")
    torch.save({"obs_count": torch.zeros(3, dtype=torch.int64)}, run / "global_step_2" / "envsched.pt")
    assert gpu_smoke.check_saved(report, run, trainer_mode="envsched_sync"), report.table()
    assert "data.pt, envsched.pt)" in report.rows[-1][2]


def launch_output(resumed_from: str | None, steps: tuple[int, ...], *, v1: bool = True, warning: str = "") -> str:
    """A training launch's output as run_training keeps it, stdout then stderr: verl's console logger's step lines
    (stdout); envace's ``warning``, then verl's trainer's checkpoint line (stderr, verl's logging format), relayed
    from the TaskRunner actor."""
    actor = "(TaskRunner pid=4242) "
    stdout = "".join(f"{actor}step:{s} - actor/pg_loss:0.01 - critic/score/mean:0.25\n" for s in steps)
    if resumed_from is None:
        verl = f"{actor}INFO:2026-12-06 14:00:00,000:Training from scratch\n"
    elif v1:
        verl = (f"{actor}INFO:2026-12-06 14:00:00,000:Resuming from {resumed_from}, setting global step to "
                f"{resumed_from.rsplit('_', 1)[-1]}\n")
    else:  # the legacy trainer's print
        verl = f"{actor}Resuming from {resumed_from}\n"
    return stdout + warning + verl


@pytest.mark.parametrize("v1", [True, False], ids=["v1 trainer", "legacy trainer"])
@pytest.mark.parametrize("run_name", ["run", "smoke runs"], ids=["run", "a space in the path"])
def test_the_resume_row_passes_when_the_second_launch_loads_step_2_and_logs_step_3(tmp_path, run_name, v1):
    run = tmp_path / run_name
    report = gpu_smoke.Report()
    assert gpu_smoke.check_resumed(report, launch_output(f"{run}/global_step_2", (3,), v1=v1), run), report.table()
    assert report.rows == [("resumed from step 2", "ok", f"loaded {run}/global_step_2, first step 3")]


#: envace.verl.resume's line when the tracker's checkpoint is incomplete and an older one is loaded instead
FALLBACK = ("envace: WARNING: checkpoint {run}/global_step_2 is incomplete (actor/ is empty); resuming from the "
            "newest complete one, {run}/global_step_1\n")


@pytest.mark.parametrize(("resumed_from", "steps", "warning", "says"), [
    # no checkpoint found: steps 1 to 3 again, which the metrics files cannot tell from a resumed run
    (None, (1, 2, 3), "", "no 'Resuming from' line in its output: it trained from scratch"),
    # another run's step 2, and envace's fallback to an older checkpoint: the row's former test (`global_step_2`
    # and `Resuming` anywhere in the output) passed both
    ("/elsewhere/run/global_step_2", (3,), "", "it resumed from /elsewhere/run/global_step_2, not {run}/global_step_2"),
    ("{run}/global_step_1", (2, 3), FALLBACK, "it resumed from {run}/global_step_1, not {run}/global_step_2"),
    # it loaded the checkpoint and then failed before a step
    ("{run}/global_step_2", (), "", "its first logged step is none, not 3"),
], ids=["from scratch", "another run", "older checkpoint", "no step"])
def test_the_resume_row_fails_when_the_second_launch_did_not_continue_from_step_2(tmp_path, resumed_from, steps,
                                                                                   warning, says):
    run = tmp_path / "run"
    out = launch_output(resumed_from and resumed_from.format(run=run), steps, warning=warning.format(run=run))
    report = gpu_smoke.Report()
    assert not gpu_smoke.check_resumed(report, out, run)
    assert report.rows == [("resumed from step 2", "FAIL", says.format(run=run))]


@pytest.mark.parametrize(("measured", "fails"), [
    ({"vllm_gb": 60.0, "freed_gb": 58.0, "woke": True, "decode_tps": 900.0}, False),
    # sleep kept most of the KV cache: the actor's update would not have the room the recipe counts on
    ({"vllm_gb": 60.0, "freed_gb": 20.0, "woke": True, "decode_tps": 900.0}, True),
    ({"vllm_gb": 60.0, "freed_gb": 58.0, "woke": False, "decode_tps": 900.0}, True),
])
def test_the_vllm_sleep_row_fails_when_sleep_keeps_the_memory_or_it_does_not_wake(measured, fails):
    report = gpu_smoke.Report()
    assert gpu_smoke.check_vllm(report, measured, 0.7, 2) is not fails
    assert report.rows[0][:2] == ("vLLM sleep frees memory", "FAIL" if fails else "ok")
    assert report.rows[1][:2] == ("vLLM decode", "-")  # a figure, not a check


# -- the peak memory of one update at the recipe's budget ----------------------------------------------------------

UPDATE = {"gpus": 8, "tokens": 32000, "oom": False, "seconds": 9.0, "finite": True, "params": 8.2e9, "peak_gb": 52.0}


@pytest.mark.parametrize(("update", "vllm", "fails"), [
    (UPDATE, {"asleep_gb": 1.5}, None),
    (UPDATE, None, None),
    # the update alone fits, but not beside what vLLM keeps while asleep
    (dict(UPDATE, peak_gb=79.0), {"asleep_gb": 1.5}, "79.0 GB + vLLM asleep 1.5 GB = 80.5 GB > the GPU's 80.0 GB"),
    (dict(UPDATE, peak_gb=81.0), None, "81.0 GB + vLLM asleep 0.0 GB = 81.0 GB > the GPU's 80.0 GB"),
    (dict(UPDATE, oom=True, peak_gb=None, error="CUDA out of memory. Tried to allocate 9.06 GiB"), None,
     "out of memory in one 32000-token update over 8 GPU(s) (CUDA out of memory. Tried to allocate 9.06 GiB)"),
    (dict(UPDATE, peak_gb=None), None, "no peak measured"),
])
def test_the_peak_memory_row_fails_above_the_gpus_memory(update, vllm, fails):
    report = gpu_smoke.Report()
    ok = gpu_smoke.check_peak(report, "peak memory, one 32000-token update", update, vllm, 80.0, 16)
    assert ok is (fails is None) and report.failed is (fails is not None)
    if fails:
        assert report.rows[0][2].startswith(fails), report.rows
    else:
        assert "FSDP2 over 8 GPU(s), 8.20B parameters" in report.rows[0][2]


@pytest.mark.slow  # two torch processes start (about 15 s on 2 cores)
def test_the_update_runs_fsdp2_sharded_at_the_token_budget(tmp_path):
    """:func:`child_peak` as the smoke test launches it (``torch.distributed.run``, one process per device), here two
    CPU ranks over gloo: FSDP2 shards the model, a packed 700-token row of sequences of at most 300 tokens trains one
    step with gradient checkpointing, and rank 0 answers with the global parameter count."""
    ckpt = checkpoint(tmp_path, TINY, "tiny")
    spec = {"tokens": 700, "max_model_len": 300, "gradient_checkpointing": True, "attn_implementation": "sdpa"}
    got = gpu_smoke.run_child("peak", ckpt, spec, timeout=300, gpus=2)
    assert (got["gpus"], got["tokens"], got["oom"], got["finite"], got["peak_gb"]) == (2, 700, False, True, None)
    assert abs(got["params"] - gpu_smoke.estimate_params(TINY)) < 0.01 * got["params"]  # + norms: global, not a shard


# -- --nodes N: the cluster rows, on two Ray nodes on loopback -------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_env(**auth: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    return {**env, **auth}


def _start_cluster(port: int, env: dict[str, str], workers: int) -> list[subprocess.Popen]:
    common = [sys.executable, "-m", "ray.scripts.scripts", "start", "--num-cpus=1", "--num-gpus=0", "--block",
              "--node-ip-address=127.0.0.1"]
    procs = [subprocess.Popen([*common, "--head", f"--port={port}", "--disable-usage-stats",
                               "--include-dashboard=false"], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)]
    procs += [subprocess.Popen([*common, f"--address=127.0.0.1:{port}"], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True) for _ in range(workers)]
    joined = subprocess.run([sys.executable, "-m", "envace.launch", "wait-nodes", "--address", f"127.0.0.1:{port}",
                             "--nodes", str(1 + workers), "--timeout", "240", "--node-pid", str(procs[0].pid)],
                            env=env, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    if joined.returncode:
        _stop_cluster(procs)
    assert joined.returncode == 0, joined.stdout + joined.stderr[-2000:]
    return procs


def _stop_cluster(procs: list[subprocess.Popen]) -> None:
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # `ray start --block` stops its own processes
    for proc in procs:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def token_cluster():
    """A token-authenticated Ray cluster of two nodes on loopback; yields its address and its token."""
    token = "ab" * 32
    port = _free_port()
    env = _ray_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    procs = _start_cluster(port, env, workers=1)
    yield f"127.0.0.1:{port}", env
    _stop_cluster(procs)


@pytest.fixture
def connected(token_cluster, monkeypatch):
    """This process as the smoke test's head is: a Ray driver of the token cluster, holding its token."""
    import ray
    from ray._private.authentication_test_utils import reset_auth_token_state

    address, env = token_cluster
    for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):
        monkeypatch.setenv(key, env[key])
    reset_auth_token_state()  # Ray reads its auth settings once per process: this one's came from the test session
    ray.init(address=address, log_to_driver=False)
    yield address
    ray.shutdown()
    monkeypatch.undo()
    reset_auth_token_state()


@pytest.mark.slow  # a Ray cluster of two nodes and seven Ray drivers start (about 35 s on 2 cores)
def test_the_cluster_rows_pass_on_a_token_cluster_and_each_fails_where_the_cluster_does(tmp_path, token_cluster,
                                                                                         connected):
    address, env = token_cluster
    # a refused client retries for RAY_NUM_REDIS_GET_RETRIES seconds (20 by default) before it gives up: 3 here
    # (five refusals below: 85 s less), where the cluster is up and a refusal is the same on every try
    clients = {**env, "RAY_NUM_REDIS_GET_RETRIES": "3"}
    report = gpu_smoke.Report()
    # token auth, for real: the cluster admits its token and refuses a client without it or with another one
    assert gpu_smoke.check_token_auth(report, address, clients), report.table()
    assert "a client with the token connects; without one: refused" in report.rows[-1][2]
    # the all-reduce across the two nodes, for real (gloo: no GPU here), through Ray tasks pinned to each node
    assert gpu_smoke.check_allreduce(report, backend="gloo", numel=1024), report.table()
    assert report.rows[-1][2].startswith("2 ranks on 2 nodes, sum correct")
    # shared storage, for real: both nodes see the run directory and the model (one machine)
    model = checkpoint(tmp_path)
    assert gpu_smoke.check_storage(report, tmp_path / "run", model), report.table()
    # ... and a model path that a node cannot see fails the row, naming the node
    assert not gpu_smoke.check_storage(report, tmp_path / "run", tmp_path / "elsewhere" / "Qwen3-8B")
    assert report.rows[-1][1] == "FAIL" and "model " in report.rows[-1][2] and "does not exist" in report.rows[-1][2]
    # a client whose token the cluster accepts is the positive control: with the wrong one in this process's
    # environment, the row fails on it
    bad = gpu_smoke.Report()
    assert not gpu_smoke.check_token_auth(bad, address, {**clients, "RAY_AUTH_TOKEN": "cd" * 32})
    assert "a client with the cluster's token could not connect" in bad.rows[-1][2]


@pytest.fixture(scope="module")
def open_node():
    """One Ray node on loopback without authentication (RAY_AUTH_MODE=disabled), shared by the token row's negative
    control and the cluster row's count; yields its address and its ``ray start --head`` process."""
    port = _free_port()
    procs = _start_cluster(port, _ray_env(RAY_AUTH_MODE="disabled"), workers=0)
    yield f"127.0.0.1:{port}", procs[0]
    _stop_cluster(procs)


@pytest.mark.slow  # three Ray drivers start (and open_node, once for the module)
def test_the_token_auth_row_fails_on_a_cluster_without_authentication(open_node):
    """A cluster whose token authentication is off admits a client without a token and one with another token:
    the row fails, naming both (the row cannot pass on a cluster that only has a token configured)."""
    address, _ = open_node
    report = gpu_smoke.Report()
    assert not gpu_smoke.check_token_auth(report, address, _ray_env(RAY_AUTH_MODE="disabled"))
    assert report.rows[-1][1] == "FAIL"
    assert "a client without a token connected; a client with another token connected" in report.rows[-1][2]


@pytest.fixture
def tokenless_driver(monkeypatch):
    """This process as a Ray driver without a token, as open_node's clients are: Ray reads its authentication
    settings once per process, so they are re-read from the cleaned environment, and again afterwards."""
    from ray._private.authentication_test_utils import reset_auth_token_state

    for key in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(key, raising=False)
    reset_auth_token_state()
    yield
    monkeypatch.undo()
    reset_auth_token_state()


@pytest.mark.slow  # two Ray drivers connect to open_node (about 5 s on 2 cores, and open_node once)
def test_the_cluster_row_fails_when_a_node_never_joins(open_node, tokenless_driver, tmp_path, capfd):
    """--nodes N's wait for the workers (check_cluster's first row), on a real cluster of one node: --nodes 1 is
    answered at once; --nodes 2 fails when RAY_JOIN_TIMEOUT passes, because the count stayed at 1 (not because the
    driver could not connect), naming the time-out's variable and the head's log."""
    address, head = open_node
    report = gpu_smoke.Report()
    assert gpu_smoke.check_joined(report, 1, address, timeout=60, head=head), report.table()
    t0 = time.monotonic()
    assert not gpu_smoke.check_joined(report, 2, address, timeout=3, head=head, head_log=tmp_path / "ray_head.log")
    assert time.monotonic() - t0 < 30  # the time-out bounds the wait (two polls past it at most, plus Ray's start)
    assert [r[:2] for r in report.rows] == [("Ray cluster", "ok"), ("Ray cluster", "FAIL")]
    assert report.rows[1][2] == (f"fewer than 2 nodes joined {address} within 3 s (RAY_JOIN_TIMEOUT; the head's log: "
                                 f"{tmp_path / 'ray_head.log'})")
    assert "only 1/2 Ray nodes joined within 3s" in capfd.readouterr().err


def test_the_cluster_row_fails_at_once_when_the_heads_ray_start_exited(tmp_path):
    """A head whose ``ray start`` exited (its port taken, an address not of this node) never forms the cluster: the
    row fails at once, not after RAY_JOIN_TIMEOUT, and says the head exited."""
    head = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    head.wait()
    report = gpu_smoke.Report()
    t0 = time.monotonic()
    address, head_log = f"127.0.0.1:{_free_port()}", tmp_path / "ray_head.log"  # nothing listens at the address
    assert not gpu_smoke.check_joined(report, 2, address, timeout=120, head=head, head_log=head_log)
    assert time.monotonic() - t0 < 60  # not the time-out
    says = f"the head's ray start exited (status 1) before 2 nodes joined {address}; the head's log: {head_log}"
    assert report.rows == [("Ray cluster", "FAIL", says)]


@pytest.mark.parametrize(("results", "problem"), [
    ([{"rank": 0, "node_id": "a", "sum_ok": True}, {"rank": 1, "node_id": "b", "sum_ok": False}],
     "ranks [1] got a wrong sum"),
    ([{"rank": 0, "node_id": "a", "sum_ok": True}, {"rank": 1, "node_id": "a", "sum_ok": True}],
     "the ranks ran on 1 node(s), not 2"),
    ([{"rank": 0, "node_id": "a", "sum_ok": True}], "1 of 2 ranks answered"),
])
def test_an_all_reduce_that_did_not_cross_the_nodes_correctly_fails(results, problem):
    """The all-reduce's row logic on results a real two-node GPU cluster cannot be made to give here."""
    assert problem in gpu_smoke.allreduce_problems(results, nodes=2, world=2)
    assert gpu_smoke.allreduce_problems([dict(r, node_id=str(r["rank"]), sum_ok=True) for r in
                                         ({"rank": 0}, {"rank": 1})], nodes=2, world=2) == []


@pytest.mark.slow  # a head, a train.sh worker and the checks' Ray drivers start (a minute or two on 2 cores)
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU: the all-reduce would run")
def test_nodes_2_on_cpu_checks_token_auth_and_storage_then_stops_before_nccl(tmp_path):
    """``gpu_smoke.sh MODEL --nodes 2`` on the head, the real run's worker command (``train.sh`` with NODE_RANK=1)
    on the other node: the head writes the token to RAY_AUTH_TOKEN_PATH, the worker reads it and joins, token
    authentication and shared storage pass for real, the NCCL all-reduce needs CUDA (exit 3), and the worker ends
    with 0 once the head closes the cluster."""
    port = _free_port()
    token = tmp_path / "shared" / "ray_token"
    env = _ray_env(MASTER_ADDR="127.0.0.1", RAY_PORT=str(port), RAY_AUTH_TOKEN_PATH=str(token), RAY_JOIN_TIMEOUT="300")
    worker = subprocess.Popen([str(REPO / "scripts" / "train.sh")], cwd=REPO,
                              env=dict(env, NNODES="2", NODE_RANK="1", GPUS_PER_NODE="0"), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        head = subprocess.run([str(REPO / "scripts" / "gpu_smoke.sh"), str(checkpoint(tmp_path)), "--nodes", "2",
                               "--out", str(tmp_path / "out")], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=900, check=False)
        worker_out, _ = worker.communicate(timeout=240)
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGTERM)
            worker.wait(timeout=120)
    assert head.returncode == 3, head.stdout[-4000:] + head.stderr[-2000:]
    assert "stopped before the NCCL all-reduce (token authentication and shared storage passed)" in head.stderr
    table = head.stdout[head.stdout.index("check "):]
    for row in ("Ray cluster", "Ray token auth", "shared storage"):
        assert re.search(rf"^{row}\s+ok\s", table, re.MULTILINE), table
    assert token.stat().st_mode & 0o777 == 0o600
    assert worker.returncode == 0 and "has closed the cluster" in worker_out, worker_out[-3000:]
    deadline = time.monotonic() + 60
    while _port_open(port) and time.monotonic() < deadline:
        time.sleep(1)
    assert not _port_open(port)  # the head's Ray stopped with the smoke test


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0
