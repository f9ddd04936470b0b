"""The paper's GPU recipes (EnvACE §5.1) composed through Hydra exactly as scripts/train.sh does, checked field
by field; and trainer.total_training_steps honoured against verl's epoch limit."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf, open_dict

from envace.config import ConfigError
from envace.train import fit_total_epochs
from envace.verl.config import compose

ENVACE = ["envace_qwen3_1_7b_h20_2x8", "envace_qwen3_4b_h20_2x8", "envace_qwen3_8b_h20_2x8", "envace_qwen3_8b_h100_2x8",
          "envace_qwen3_8b_h20_2x8_async", "ablation_real_env_grpo", "ablation_simulator"]
PLAIN = ["qwen3_8b_h20_2x8", "qwen3_8b_h100_2x8"]
MODELS = {"envace_qwen3_1_7b_h20_2x8": "/models/Qwen3-1.7B", "envace_qwen3_4b_h20_2x8": "/models/Qwen3-4B"}


@pytest.mark.parametrize("name", ENVACE + PLAIN)
def test_recipe_has_the_paper_values(name):
    cfg = compose([f"experiment={name}"])
    actor, rollout, ref = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.ref
    # 16 prompts x 4 rollouts = 64 instances per step, 470 steps
    assert (cfg.data.train_batch_size, rollout.n) == (16, 4)
    assert cfg.trainer.total_training_steps == 470
    # one PPO update per step: the mini-batch is the whole batch, one pass
    assert actor.ppo_mini_batch_size == cfg.data.train_batch_size and actor.ppo_epochs == 1
    # lr 1e-6, KL loss 1e-4 with verl's low-variance KL, no KL in the reward, entropy 0
    assert actor.optim.lr == 1.0e-6
    assert actor.use_kl_loss is True and actor.kl_loss_coef == 1.0e-4 and actor.kl_loss_type == "low_var_kl"
    assert cfg.algorithm.use_kl_in_reward is False
    assert actor.entropy_coeff == 0
    # prompt 12,000 / response 8,000 tokens; the rollout window covers both
    assert (cfg.data.max_prompt_length, cfg.data.max_response_length) == (12000, 8000)
    assert rollout.max_model_len == 20000
    # 30 user turns
    assert cfg.envace.agent.limits.max_user_turns == 30
    # 2 nodes x 8 GPUs, vLLM, SDPA attention with packed micro-batches (no flash-attn wheel needed)
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node) == (2, 8)
    assert rollout.name == "vllm" and cfg.trainer.device == "cuda"
    assert cfg.actor_rollout_ref.model.override_config.attn_implementation == "sdpa"
    assert cfg.actor_rollout_ref.model.use_remove_padding is True
    assert cfg.actor_rollout_ref.model.enable_gradient_checkpointing is True
    # one longest rollout fits one micro-batch; vLLM leaves room for the resident training state
    assert actor.use_dynamic_bsz is True
    assert actor.ppo_max_token_len_per_gpu >= rollout.max_model_len
    assert ref.log_prob_max_token_len_per_gpu >= rollout.max_model_len
    assert 0.5 <= rollout.gpu_memory_utilization <= 0.75
    assert rollout.agent.num_workers == 16
    # total_training_steps decides the run length (epochs derived at launch), checkpoints are bounded
    assert cfg.trainer.total_epochs == "auto"
    assert cfg.trainer.max_actor_ckpt_to_keep == 3 and cfg.trainer.save_freq == 50
    assert cfg.actor_rollout_ref.model.path == MODELS.get(name, "/models/Qwen3-8B")


@pytest.mark.parametrize("name", ENVACE)
def test_envace_recipes_rehearse_with_rolewise_grpo_and_validate_at_the_paper_sampling(name):
    cfg = compose([f"experiment={name}"])
    val = cfg.actor_rollout_ref.rollout.val_kwargs
    assert (val.temperature, val.top_p, val.do_sample) == (0.6, 0.95, True)
    # training samples both roles at 1.0 / 1.0 (the reference code; the recipe's comment weighs §5.1)
    rollout = cfg.actor_rollout_ref.rollout
    assert (rollout.temperature, rollout.top_p, cfg.envace.agent.rehearse_temperature) == (1.0, 1.0, None)
    if name.startswith("envace_"):
        assert cfg.envace.agent.observation_source == "rehearse"
        assert cfg.algorithm.adv_estimator == "grpo_rolewise"


def test_plain_grpo_recipes_train_one_row_per_rollout_in_the_real_environment():
    for name in PLAIN:
        cfg = compose([f"experiment={name}"])
        assert cfg.algorithm.adv_estimator == "grpo"
        assert cfg.envace.agent.observation_source == "real" and cfg.envace.agent.act_layout == "trajectory"


def test_memory_settings_follow_the_gpu():
    h20, h100 = compose(["experiment=envace_qwen3_8b_h20_2x8"]), compose(["experiment=envace_qwen3_8b_h100_2x8"])
    # 96 GB H20: 32,000 tokens per micro-batch (~55 GB peak); 80 GB H100: 24,000 (~45 GB)
    assert h20.actor_rollout_ref.actor.ppo_max_token_len_per_gpu == 32000
    assert h100.actor_rollout_ref.actor.ppo_max_token_len_per_gpu == 24000
    assert h100.actor_rollout_ref.rollout.gpu_memory_utilization < h20.actor_rollout_ref.rollout.gpu_memory_utilization
    for small in ("envace_qwen3_1_7b_h20_2x8", "envace_qwen3_4b_h20_2x8"):
        assert compose([f"experiment={small}"]).actor_rollout_ref.rollout.tensor_model_parallel_size == 1
    assert h20.actor_rollout_ref.rollout.tensor_model_parallel_size == 2


# -- trainer.total_training_steps against verl's epochs ------------------------------------------------------
def with_rows(tmp_path, overrides: list[str], rows: int):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"x": list(range(rows))}), path)
    cfg = compose(overrides)
    with open_dict(cfg):
        cfg.data.train_files = str(path)
    return cfg


def test_auto_epochs_cover_total_training_steps(tmp_path, capsys):
    # the case: 608 tasks, 64 per step -> 9 steps per epoch; verl's 30 epochs would stop at 270
    cfg = with_rows(tmp_path, ["experiment=qwen3_8b_h20_2x8", "data.train_batch_size=64",
                               "data.filter_overlong_prompts=false"], 608)
    with open_dict(cfg):
        fit_total_epochs(cfg)
    assert cfg.trainer.total_epochs == 53 and 53 * 9 >= 470 > 52 * 9
    assert "9 steps per epoch" in capsys.readouterr().out
    # the paper's recipe: 16 per step -> 38 steps per epoch -> 13 epochs, + 1 spare for verl's length filter
    cfg = with_rows(tmp_path, ["experiment=envace_qwen3_8b_h20_2x8"], 608)
    with open_dict(cfg):
        fit_total_epochs(cfg)
    assert cfg.trainer.total_epochs == 14


def test_explicit_epochs_too_few_for_the_steps_is_a_preflight_error(tmp_path):
    cfg = with_rows(tmp_path, ["experiment=qwen3_8b_h20_2x8", "data.train_batch_size=64",
                               "trainer.total_epochs=30"], 608)
    with pytest.raises(ConfigError, match=r"total_training_steps=470 needs 53 epochs of 9 steps "
                                          r".*total_epochs=30 ends the run at step 270"):
        fit_total_epochs(cfg)
    cfg = with_rows(tmp_path, ["experiment=qwen3_8b_h20_2x8", "data.train_batch_size=64",
                               "trainer.total_epochs=60"], 608)
    fit_total_epochs(cfg)  # enough: left as set
    assert cfg.trainer.total_epochs == 60


def test_epoch_count_respects_train_max_samples_and_rejects_a_partial_batch(tmp_path):
    cfg = with_rows(tmp_path, ["trainer.total_training_steps=10", "data.train_batch_size=4",
                               "data.train_max_samples=8", "data.filter_overlong_prompts=false"], 100)
    with open_dict(cfg):
        fit_total_epochs(cfg)
    assert cfg.trainer.total_epochs == 5  # 8 rows / 4 = 2 steps per epoch
    cfg = with_rows(tmp_path, ["trainer.total_training_steps=10", "data.train_batch_size=16"], 8)
    with pytest.raises(ConfigError, match="no full batch"):
        fit_total_epochs(cfg)


def test_the_envsched_recipe_has_the_envsched_papers_values():
    """EnvSched §3.1 / App. D: B = 64 pairs x K = 8, 200 steps, Adam lr 1e-6, cosine after 10 warm-up steps, clip
    0.2, T 0.99 / top-p 0.99 / top-k 100, 40 turns, 4,096 tokens a turn, 32,000 a sequence, rho 1/2, K_within 6,
    K_cross 12, with EnvSched choosing every batch of a GRPO run in the real environments."""
    cfg = compose(["experiment=envsched_qwen3_8b_h20_2x8"])
    actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    assert cfg.trainer.v1.trainer_mode == "envsched_sync" and cfg.algorithm.adv_estimator == "grpo"
    assert (cfg.data.train_batch_size, rollout.n, cfg.trainer.total_training_steps) == (64, 8, 200)
    assert actor.ppo_mini_batch_size == cfg.data.train_batch_size and actor.ppo_epochs == 1
    assert (actor.optim.lr, actor.optim.lr_scheduler_type, actor.optim.lr_warmup_steps) == (1.0e-6, "cosine", 10)
    assert actor.clip_ratio == 0.2 and actor.use_kl_loss is False and cfg.algorithm.use_kl_in_reward is False
    assert (rollout.temperature, rollout.top_p, rollout.top_k) == (0.99, 0.99, 100)
    assert cfg.envace.agent.limits.max_steps_per_turn == 40 and cfg.envace.agent.act_max_tokens == 4096
    assert rollout.max_model_len == 32000 == cfg.data.max_prompt_length + cfg.data.max_response_length
    assert actor.ppo_max_token_len_per_gpu >= rollout.max_model_len
    assert (cfg.envsched.rho, cfg.envsched.k_within, cfg.envsched.k_cross) == (0.5, 6, 12)
    assert cfg.envsched.relation_weights == "paper"
    assert cfg.envace.agent.observation_source == "real" and cfg.envace.agent.act_layout == "trajectory"
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node, rollout.name) == (2, 8, "vllm")


def _leaves(node, prefix=""):
    """A resolved config (``OmegaConf.to_container``) as ``{dotted key: value}``."""
    if isinstance(node, dict):
        return {k: v for key, value in node.items() for k, v in _leaves(value, f"{prefix}{key}.").items()}
    return {prefix[:-1]: node}


def test_the_async_recipe_is_the_paper_recipe_on_colocate_async_with_a_bound_of_one_version(capsys):
    """Issue 46, deliverable 6: the async 8B recipe differs from the sync one in exactly the trainer, its warm-up, the
    staleness bound (drop at 2 versions: every trained token at most one update old) and the rollout correction
    (decoupled token-level TIS); envace's checks of the trainer's kind pass it without a warning (drop bounds it)."""
    from envace.config import validate_envace_config
    from envace.train import check_trainer_mode, verl_mode

    sync, asyn = compose(["experiment=envace_qwen3_8b_h20_2x8"]), compose(["experiment=envace_qwen3_8b_h20_2x8_async"])
    before, after = (_leaves(OmegaConf.to_container(c, resolve=True)) for c in (sync, asyn))
    changed = {k: after[k] for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    # the run directory, its dumps and the rollout trace interpolate the run name
    assert changed == {
        "trainer.v1.trainer_mode": "envace_colocate_async",
        "trainer.v1.sampler.max_off_policy_threshold": 2,
        "algorithm.rollout_correction.rollout_is": "token",
        "trainer.experiment_name": "envace_qwen3_8b_h20_2x8_async",
        "trainer.default_local_dir": "outputs/envace/envace_qwen3_8b_h20_2x8_async",
        "trainer.rollout_data_dir": "outputs/envace/envace_qwen3_8b_h20_2x8_async/rollouts",
        "actor_rollout_ref.rollout.trace.experiment_name": "envace_qwen3_8b_h20_2x8_async",
    }, changed
    # stated in the recipe with their reasons, and verl's defaults
    assert (asyn.trainer.v1.sampler.max_off_policy_strategy, asyn.trainer.v1.colocate_async.num_warmup_batches) == (
        "drop", 1)
    assert (asyn.algorithm.rollout_correction.rollout_is_threshold, asyn.algorithm.rollout_correction.bypass_mode) == (
        2.0, False)
    assert verl_mode(asyn) == "colocate_async"
    check_trainer_mode(asyn, validate_envace_config(asyn))
    assert "warning" not in capsys.readouterr().err


def test_the_echo_recipe_is_the_cpu_default_as_real_environment_grpo_with_the_observation_loss(tmp_path, capsys):
    """Issue 48, deliverable 1: ``echo_cpu`` differs from the CPU default in exactly what makes it real-environment
    GRPO (the learning tests' ``grpo`` arm: verl's GRPO, the real environment, one sample per rollout) and the
    observation loss's weight; the pre-flight passes it (the trainer installs the loss)."""
    from envace.train import main

    default, echo = compose(["experiment=cpu_default"]), compose(["experiment=echo_cpu"])
    before, after = (_leaves(OmegaConf.to_container(c, resolve=True)) for c in (default, echo))
    changed = {k: after[k] for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    coef = echo.envace.loss.observation_nll_coef
    assert coef > 0 and default.envace.loss.observation_nll_coef == 0
    assert changed == {
        "envace.agent.observation_source": "real",
        "envace.agent.act_layout": "trajectory",
        "algorithm.adv_estimator": "grpo",
        "algorithm.norm_adv_by_std_in_grpo": False,  # as the default's role-wise advantages (no std division)
        "envace.loss.observation_nll_coef": coef,
        "trainer.experiment_name": "echo_cpu",
        "trainer.default_local_dir": "outputs/envace/echo_cpu",
        "trainer.rollout_data_dir": "outputs/envace/echo_cpu/rollouts",
        "actor_rollout_ref.rollout.trace.experiment_name": "echo_cpu",
    }, changed
    assert main(["--preflight-only", "experiment=echo_cpu", f"trainer.default_local_dir={tmp_path / 'run'}"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "envace: pre-flight passed"
