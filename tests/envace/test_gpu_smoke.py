"""scripts/gpu_smoke.sh: on a machine without CUDA it checks the checkpoint and the shrunk paper recipe, then
stops with a clear message and exit status 3; the full run is a `gpu` test (ENVACE_SMOKE_MODEL=<checkpoint>)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envace import gpu_smoke

REPO = Path(__file__).resolve().parents[2]

#: Qwen3-0.6B's shape (config.json only: the dry run never loads weights)
QWEN3_0_6B = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 1024,
              "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
              "head_dim": 128, "tie_word_embeddings": True}


def checkpoint(tmp_path: Path, config: dict | None = None) -> Path:
    ckpt = tmp_path / "Qwen3-0.6B"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(config or QWEN3_0_6B))
    return ckpt


def test_parameter_estimate_matches_qwen3_sizes():
    assert 0.55e9 < gpu_smoke.estimate_params(QWEN3_0_6B) < 0.65e9
    q17 = dict(QWEN3_0_6B, hidden_size=2048, intermediate_size=6144, num_attention_heads=16)
    assert 1.6e9 < gpu_smoke.estimate_params(q17) < 2.1e9  # Qwen3-1.7B: 1.7B without embeddings, 2.0B with


def test_shrunk_recipe_keeps_the_paper_values_and_fits_one_gpu():
    from envace.verl.config import compose

    cfg = compose(gpu_smoke.overrides("/models/Qwen3-1.7B", Path("/tmp/run"), 2))
    a = cfg.actor_rollout_ref
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node, a.rollout.tensor_model_parallel_size) == (1, 1, 1)
    assert (cfg.data.train_batch_size, a.rollout.n) == (4, 2)
    assert (cfg.trainer.total_training_steps, cfg.trainer.save_freq) == (2, 2)
    # the paper's KL; ten times its learning rate, so a stale weight sync shows (gpu_smoke.SMOKE_LR)
    assert (a.actor.optim.lr, a.actor.kl_loss_coef, a.actor.kl_loss_type) == (1e-5, 1e-4, "low_var_kl")
    assert (cfg.trainer.test_freq, cfg.data.val_max_samples) == (2, 4)  # one validation pass, at step 2
    assert a.model.override_config.attn_implementation == "sdpa" and a.rollout.name == "vllm"
    assert a.rollout.max_model_len >= cfg.data.max_prompt_length + cfg.data.max_response_length


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU: the smoke test would run")
def test_dry_run_on_cpu_stops_where_cuda_is_needed(tmp_path):
    ckpt = checkpoint(tmp_path)
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run([str(REPO / "scripts" / "gpu_smoke.sh"), str(ckpt), "--out", str(tmp_path / "out")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 3, out.stdout[-3000:] + out.stderr[-3000:]
    assert "stopped before the GPU checks: this machine has no CUDA GPU" in out.stderr
    table = out.stdout[out.stdout.index("check "):]
    assert "[ok] checkpoint: qwen3, ~0.60B parameters" in out.stdout
    assert "recipe" in table and "envace_qwen3_8b_h20_2x8 -> 1x1 GPU, TP 1, batch 4x2" in table
    assert "CUDA" in table and "FAIL" in table
    assert not (tmp_path / "out" / "run").exists()  # nothing started


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


@pytest.mark.parametrize(("args", "code", "says"), [
    (["--help"], 0, "usage: scripts/gpu_smoke.sh"),
    ([], 2, "scripts/gpu_smoke.sh: error: the following arguments are required: model (see --help)"),
    (["{tmp}/missing"], 2, "scripts/gpu_smoke.sh: error: argument model: {tmp}/missing: no such checkpoint folder"),
    (["{tmp}/empty"], 2, ("scripts/gpu_smoke.sh: error: argument model: {tmp}/empty/config.json: line 1 column 1: "
                          "not JSON (Expecting value)")),
    (["{tmp}/vl"], 2, ("scripts/gpu_smoke.sh: error: argument model: {tmp}/vl/config.json: model_type 'qwen3_vl', "
                       "a multimodal checkpoint (text_config), but the smoke test trains a text-only Qwen3")),
    (["{tmp}/Qwen3-0.6B", "--out", "{tmp}/a-file/out"], 2,
     "scripts/gpu_smoke.sh: error: argument --out: {tmp}/a-file/out: {tmp}/a-file is a file, not a directory"),
])
def test_the_script_answers_help_and_usage_mistakes_before_it_installs_anything(tmp_path, args, code, says):
    """On a node without the virtualenv (ENVACE_VENV names none; a GPU node's lock), the arguments and the model's
    config.json are checked with the system python3 before bootstrap.sh would take its lock and install."""
    checkpoint(tmp_path)
    for name, text in (("empty", ""), ("vl", json.dumps(QWEN3_VL))):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(text)
    (tmp_path / "a-file").write_text("x")
    venv = tmp_path / "venv"
    env = dict(os.environ, ENVACE_VENV=str(venv), ENVACE_PLATFORM="gpu")
    out = subprocess.run([str(REPO / "scripts" / "gpu_smoke.sh"), *(a.format(tmp=tmp_path) for a in args)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == code, out.stderr
    if code:
        assert out.stderr.startswith(says.format(tmp=tmp_path)) and len(out.stderr.splitlines()) == 1, out.stderr
    else:
        assert out.stdout.startswith(says) and "--out OUT" in out.stdout and not out.stderr
    assert not venv.exists() and not Path(f"{venv}.lock").exists()  # bootstrap.sh never ran


def test_the_pre_check_needs_only_the_standard_library(tmp_path):
    """``python3 -S`` (no site-packages: a node's system Python) runs the pre-check of a good checkpoint."""
    cmd = [sys.executable, "-S", "-E", "-m", "envace.gpu_smoke", "--preflight", str(checkpoint(tmp_path)),
           "--out", str(tmp_path / "out")]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_full_smoke_on_a_gpu(tmp_path):
    model = os.environ.get("ENVACE_SMOKE_MODEL")
    if not model:
        pytest.skip("set ENVACE_SMOKE_MODEL to a local Qwen3 0.6B-1.7B checkpoint")
    out = subprocess.run([str(REPO / "scripts" / "gpu_smoke.sh"), model, "--out", str(tmp_path / "out")],
                         cwd=REPO, capture_output=True, text=True, timeout=1200, check=False)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]


def test_the_tensor_parallel_2_launch_composes_and_validates():
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from envace.config import validate_envace_config
    from envace.verl.config import compose

    cfg = compose(gpu_smoke.overrides("/models/Qwen3-1.7B", Path("/tmp/run"), 1, tp=2))
    assert (cfg.trainer.n_gpus_per_node, cfg.actor_rollout_ref.rollout.tensor_model_parallel_size) == (2, 2)
    validate_envace_config(cfg)
    validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))


# -- the run-directory checks, on written metrics (no GPU needed) ----------------------------------------------------

GOOD = {"training/rollout_probs_diff_mean": 2e-3, "training/rollout_probs_diff_max": 0.2,
        "training/rollout_actor_probs_pearson_corr": 0.995, "actor/grad_norm": 0.8, "actor/pg_loss": 0.01,
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
    gpu_smoke.check_run_outputs(report, run_dir_with(tmp_path, {}), gpu_gb=80.0)
    assert not report.failed, report.table()
    assert {r[0] for r in report.rows} >= {"step 2 validation", "peak memory, FSDP2 engine", "step 3 weight sync",
                                           "step 2 update"}


@pytest.mark.parametrize(("changes", "failing"), [
    # a stale sync after the update at SMOKE_LR: the rollout's probabilities are the old policy's
    ({2: {"training/rollout_probs_diff_mean": 0.04, "training/rollout_probs_diff_max": 0.9,
          "training/rollout_actor_probs_pearson_corr": 0.93}}, "step 2 weight sync"),
    # a rollout on weights that were never synced: tiny differences, no correlation
    ({1: {"training/rollout_probs_diff_mean": 6.6e-6, "training/rollout_actor_probs_pearson_corr": -0.01}},
     "step 1 weight sync"),
    # verl reported no rollout-vs-trainer comparison at all (e.g. bypass mode): not a pass
    ({3: {"training/rollout_probs_diff_mean": None, "training/rollout_actor_probs_pearson_corr": None}},
     "step 3 weight sync"),
    ({2: {"actor/grad_norm": 0.0}}, "step 2 update"),
    ({"no_val": {}}, "step 2 validation"),
    ({3: {"actor/perf/max_memory_allocated_gb": 81.0}}, "peak memory, FSDP2 engine"),
])
def test_the_run_checks_fail_on_a_broken_run(tmp_path, changes, failing):
    report = gpu_smoke.Report()
    gpu_smoke.check_run_outputs(report, run_dir_with(tmp_path, changes), gpu_gb=80.0)
    failed = [r[0] for r in report.rows if r[1] == "FAIL"]
    assert failed == [failing], report.table()
