"""Config composition, typed envace keys, verl's own validation and the pre-flight checks."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf, open_dict

from envace.config import (
    ENVSCHED_TRAINER_KEYS,
    ConfigError,
    envsched_config_from,
    validate_envace_config,
    validate_verl_keys,
)
from envace.train import check_platform, check_ray_resources, main, resolve_model_path
from envace.verl.config import CONFIG_DIR, compose

EXPERIMENTS = sorted(p.stem for p in (CONFIG_DIR / "experiment").glob("*.yaml"))
REPO = Path(__file__).resolve().parents[2]


def test_there_are_cpu_and_gpu_recipes():
    assert {"cpu_default", "qwen3_8b_h100_2x8", "qwen3_8b_h20_2x8"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_and_passes_verl_validation(experiment):
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    cfg = compose([f"experiment={experiment}"])
    validate_envace_config(cfg)
    validate_verl_keys(cfg)
    validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    # inherits verl's ppo_trainer: a deep verl default survives composition
    assert cfg.actor_rollout_ref.actor.clip_ratio == 0.2
    assert cfg.trainer.use_v1 is True


def test_gpu_recipe_uses_vllm_on_two_nodes():
    cfg = compose(["experiment=qwen3_8b_h20_2x8"])
    assert cfg.actor_rollout_ref.rollout.name == "vllm"
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node) == (2, 8)


def test_every_project_config_field_is_commented():
    """Each leaf field of envace's own yaml files has a comment line right above it."""
    offenders = []
    for path in CONFIG_DIR.rglob("*.yaml"):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            s = line.strip()
            if not s or s.startswith(("#", "-")) or ":" not in s or i == 0:
                continue
            if s.endswith(":"):  # a section header; its leaves carry the comments
                continue
            if not lines[i - 1].strip().startswith("#"):
                offenders.append(f"{path.relative_to(CONFIG_DIR)}:{i + 1}: {s}")
    assert not offenders, "\n".join(offenders)


def test_typed_envace_keys_fail_loudly_with_the_key_name():
    cfg = compose([])
    OmegaConf.set_struct(cfg, False)
    cfg.envace.agent.max_steps_per_turn = "many"
    with pytest.raises(ConfigError, match=r"envace\.agent\.max_steps_per_turn"):
        validate_envace_config(cfg)
    cfg = compose([])
    OmegaConf.set_struct(cfg, False)
    cfg.envace.data.pool = ["bfcl_multi_turn"]  # typo of `pools`
    with pytest.raises(ConfigError, match=r"envace\.data\.pool"):
        validate_envace_config(cfg)
    cfg = compose(["envace.replay_poll_s=0"])
    with pytest.raises(ConfigError, match=r"envace\.replay_poll_s must be > 0"):
        validate_envace_config(cfg)


def test_cli_typo_is_a_clean_error_before_anything_starts(capsys):
    assert main(["envace.data.pool=[x]"]) == 2
    assert "envace.data.pool" in capsys.readouterr().err


def test_gpu_config_on_a_machine_without_gpus_is_refused(monkeypatch, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ConfigError, match="no CUDA device"):
        check_platform(compose(["experiment=qwen3_8b_h100_2x8"]))
    assert main(["experiment=qwen3_8b_h100_2x8"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_missing_model_path_is_refused(tmp_path, capsys):
    with pytest.raises(ConfigError, match="not a local model directory"):
        resolve_model_path(str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="unknown builtin"):
        resolve_model_path("builtin:gpt-17")
    assert main([f"actor_rollout_ref.model.path={tmp_path / 'nope'}"]) == 2
    assert "never downloads weights" in capsys.readouterr().err


def test_ray_cluster_with_too_few_gpu_slots_is_refused():
    cfg = compose(["trainer.nnodes=2", "trainer.n_gpus_per_node=8"])
    with pytest.raises(ConfigError, match="needs trainer.nnodes × trainer.n_gpus_per_node = 2 × 8 = 16"):
        check_ray_resources(cfg, {"GPU": 8.0, "CPU": 64.0}, n_nodes=1)
    with pytest.raises(ConfigError, match="2 but the Ray cluster has 1 alive node"):
        check_ray_resources(cfg, {"GPU": 16.0}, n_nodes=1)
    check_ray_resources(cfg, {"GPU": 16.0}, n_nodes=2)


def test_train_sh_help_runs_without_starting_anything():
    out = subprocess.run([str(REPO / "scripts" / "train.sh"), "--help"], capture_output=True, text=True, timeout=300,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert "scripts/train.sh [experiment=NAME]" in out.stdout


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("envace.agent.limits.max_steps_per_turn=-1", "limits.max_steps_per_turn must be >= 1"),
        ("envace.agent.limits.on_step_limit=sometimes", "limits.on_step_limit must be one of"),
        ("envace.agent.observation_source=dream", "observation_source must be one of"),
        ("envace.advantage.baseline=median", "advantage.baseline must be one of"),
        ("envace.agent.rehearsal.max_histroy_chars=5", "max_histroy_chars"),
        ("+envace.reward.judge.base_url=http://x", "base_url"),
    ],
)
def test_envace_typed_values_fail_before_launch(override, message, capsys):
    assert main([override]) == 2
    assert message in capsys.readouterr().err


def test_observation_source_picks_the_loop_of_train_and_validation_rows(tmp_path):
    import pyarrow.parquet as pq

    from envace.agents import LOOP_NAMES, registered_loop_names
    from envace.train import prepare

    assert set(LOOP_NAMES.values()) <= set(registered_loop_names())
    cfg = compose(["experiment=cpu_default", f"envace.data.out_dir={tmp_path}", "envace.data.max_tasks_per_pool=12",
                   "actor_rollout_ref.model.path=builtin:tiny-qwen3"])  # the warm start takes minutes to build
    cfg, ecfg = prepare(cfg)
    assert ecfg.agent.observation_source == "rehearse" and cfg.algorithm.adv_estimator == "grpo_rolewise"
    assert cfg.actor_rollout_ref.rollout.agent.default_agent_loop == "envace_act_rehearse"
    train = set(pq.read_table(cfg.data.train_files, columns=["agent_name"]).column(0).to_pylist())
    val = set(pq.read_table(cfg.data.val_files, columns=["agent_name"]).column(0).to_pylist())
    assert train == {"envace_act_rehearse"} and val == {"envace_env"}


def test_preflight_refuses_data_whose_agent_loop_is_not_registered(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from envace.agents import agent_loop_config_path
    from envace.train import check_agent_names

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"agent_name": ["envace_env", "envace_agent"]}), path)
    with pytest.raises(ConfigError, match=r"agent loop\(s\) \['envace_agent'\]"):
        check_agent_names([str(path)], agent_loop_config_path())
    pq.write_table(pa.table({"agent_name": ["envace_env", "envace_act_rehearse"]}), path)
    check_agent_names([str(path)], agent_loop_config_path())


def test_a_broken_worldbook_folder_stops_the_run_before_it_starts(tmp_path):
    """The simulator's books are verified whole at pre-flight (all or nothing, as evaluation does), not found
    missing mid-rollout: a folder holding something that is not a worldbook refuses the run, naming it."""
    from envace.config import ConfigError
    from envace.train import prepare

    books = tmp_path / "books"
    (books / "kv-a").mkdir(parents=True)  # a book that lost its manifest.json
    (books / "kv-a" / "rules.json").write_text("{}")
    cfg = compose(["experiment=cpu_default", "envace.agent.observation_source=simulator",
                   f"envace.agent.worldbook={books}", "envace.preflight=false",
                   f"trainer.default_local_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=r"envace.agent.worldbook=.*kv-a") as err:
        prepare(cfg)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "run").exists()


def test_a_training_task_id_no_pool_holds_is_one_line_before_anything_runs(tmp_path):
    """With an empty cache: the data build is refused before the warm start (about 10 minutes) is built."""
    cache = tmp_path / "cache"
    proc = subprocess.run([sys.executable, "-m", "envace.train", "experiment=cpu_default",
                           "envace.data.train_task_ids=[nope]", f"envace.data.out_dir={tmp_path / 'data'}",
                           f"trainer.default_local_dir={tmp_path / 'run'}"], capture_output=True, text=True,
                          env=dict(os.environ, ENVACE_CACHE=str(cache)), timeout=300, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "envace.data: train_task_ids: 1 id(s) in no 'train' split" in proc.stderr and "'nope'" in proc.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "data" / "train.parquet").exists()
    assert not (cache / "models").exists()


@pytest.mark.parametrize(("override", "message"), [
    # issue 43, finding 2: a ValueError traceback (exit 1) after the data build; a ZeroDivisionError
    ("trainer.total_training_steps=abc",
     "key 'trainer.total_training_steps': Value 'abc' of type 'str' could not be converted to Integer"),
    ("data.train_batch_size=0", "data.train_batch_size must be >= 1, got 0"),
    ("data.train_batch_size=-8", "data.train_batch_size must be >= 1, got -8"),
    ("trainer.total_epochs=2.5", "trainer.total_epochs must be auto or an integer >= 1, got 2.5"),
    ("trainer.total_training_steps=null", "trainer.total_epochs=auto needs trainer.total_training_steps"),
    ("trainer.nnodes=0", "trainer.nnodes must be >= 1"),  # verl: ZeroDivisionError
    ("trainer.n_gpus_per_node=two", "key 'trainer.n_gpus_per_node'"),  # verl: TypeError
    ("trainer.device=tpu", "trainer.device must be one of ['cuda', 'npu', 'cpu']"),
    ("trainer.resume_mode=sometimes", "trainer.resume_mode must be one of"),
    ("trainer.save_freq=often", "key 'trainer.save_freq'"),
    ("trainer.use_v1=maybe", "key 'trainer.use_v1'"),
    ("data.max_prompt_length=0", "data.max_prompt_length must be >= 1"),
    ("actor_rollout_ref.rollout.n=0", "actor_rollout_ref.rollout.n must be >= 1"),
    ("actor_rollout_ref.rollout.temperature=nan", "actor_rollout_ref.rollout.temperature must be >= 0, got nan"),
    ("actor_rollout_ref.actor.ppo_mini_batch_size=0", "actor_rollout_ref.actor.ppo_mini_batch_size must be >= 1"),
    ("actor_rollout_ref.actor.optim.lr=fast", "key 'actor_rollout_ref.actor.optim.lr'"),
])
def test_verl_keys_are_typed_and_ranged_naming_the_key(override, message):
    """verl checks these only inside its workers (or never): the schema refuses them first, in one line."""
    with pytest.raises(ConfigError) as err:
        validate_verl_keys(compose([override]))
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(("override", "message"), [
    ("envace.data.max_tasks_per_pool=0", "envace.data.max_tasks_per_pool must be >= 1, got 0"),
    ("envace.data.pools=[]", "envace.data.pools is empty"),
])
def test_envace_data_values_are_ranged(override, message):
    with pytest.raises(ConfigError, match=message):
        validate_envace_config(compose([override]))


def _whole(value):
    """``value`` as the whole number OmegaConf reads from it (an int, or text ``int()`` parses), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    try:
        return int(value) if isinstance(value, str) else None
    except ValueError:
        return None


@settings(max_examples=60, deadline=None)
@given(steps=st.one_of(st.integers(-10**6, 10**6), st.floats(allow_nan=True), st.text(max_size=6), st.none()),
       batch=st.one_of(st.integers(-10**6, 10**6), st.booleans(), st.text(max_size=6),
                       st.integers(-3, 10**6).map(str)))
def test_verl_keys_accept_exactly_positive_whole_numbers(composed, steps, batch):
    """Whatever a launch script or a recipe puts there: a step count and a batch size are accepted exactly when they
    are whole numbers >= 1 (a step count may be null with an explicit epoch count); else one ConfigError line."""
    cfg = composed.copy()
    with open_dict(cfg):
        cfg.trainer.total_training_steps, cfg.data.train_batch_size, cfg.trainer.total_epochs = steps, batch, 3
    n_steps, n_batch = _whole(steps), _whole(batch)
    if (steps is None or (n_steps or 0) >= 1) and (n_batch or 0) >= 1:
        typed = validate_verl_keys(cfg)
        assert (typed.trainer.total_training_steps, typed.data.train_batch_size) == (n_steps, n_batch)
    else:
        with pytest.raises(ConfigError) as err:
            validate_verl_keys(cfg)
        assert "\n" not in str(err.value)
        assert "trainer.total_training_steps" in str(err.value) or "data.train_batch_size" in str(err.value)


@pytest.fixture(scope="module")
def composed():
    return compose([])


# -- one name per setting (issue 47, item 2) ----------------------------------------------------------------------
@pytest.mark.parametrize(("experiment", "sizes"), [("cpu_default", (8, 4)), ("cpu_envsched", (2, 2)),
                                                   ("envsched_qwen3_8b_h20_2x8", (64, 8))])
def test_the_envsched_batch_and_group_size_are_the_trainers_keys_interpolated(experiment, sizes):
    """EnvSched's B and K are the trainer's prompts per step and rollouts per prompt: in the training config the
    envsched keys interpolate the trainer's, so every recipe (and an override of the trainer's key) gives the
    scheduler the trainer's values. The library's own file keeps its values, for use without verl."""
    from envsched import EnvSchedConfig

    cfg = compose([f"experiment={experiment}"])
    raw = OmegaConf.to_container(cfg.envsched, resolve=False)
    assert {key: raw[key] for key in ENVSCHED_TRAINER_KEYS} == {
        "batch_size": "${data.train_batch_size}", "rollouts_per_task": "${actor_rollout_ref.rollout.n}"}
    typed = envsched_config_from(cfg)
    assert (typed.batch_size, typed.rollouts_per_task) == sizes
    moved = envsched_config_from(compose([f"experiment={experiment}", "data.train_batch_size=6",
                                          "actor_rollout_ref.rollout.n=3"]))
    assert (moved.batch_size, moved.rollouts_per_task) == (6, 3)
    alone = EnvSchedConfig.from_yaml(CONFIG_DIR / "envsched" / "envsched.yaml")
    assert (alone.batch_size, alone.rollouts_per_task) == (64, 8)


@settings(max_examples=60, deadline=None)
@given(batch=st.integers(1, 6), n=st.integers(1, 6), key=st.sampled_from(sorted(ENVSCHED_TRAINER_KEYS)),
       mine=st.none() | st.integers(1, 6))
def test_an_envsched_batch_key_passes_exactly_when_it_equals_the_trainers(composed, batch, n, key, mine):
    """Whatever values the trainer's keys and an override of the envsched key take: the typed group is built exactly
    when the two agree (or the envsched key is left at its interpolation), else one line names both keys and both
    values."""
    cfg = copy.deepcopy(composed)
    with open_dict(cfg):
        cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n = batch, n
        if mine is not None:
            cfg.envsched[key] = mine
    trainer_key = ENVSCHED_TRAINER_KEYS[key]
    theirs = OmegaConf.select(cfg, trainer_key)
    if mine is None or mine == theirs:
        typed = envsched_config_from(cfg)
        assert (typed.batch_size, typed.rollouts_per_task) == (batch, n)
    else:
        with pytest.raises(ConfigError) as err:
            envsched_config_from(cfg)
        assert str(err.value).startswith(f"envsched.{key}={mine} differs from {trainer_key}={theirs}: ")
        assert "\n" not in str(err.value)


@pytest.mark.parametrize(("override", "message"), [
    ("envace.reward.checklist.use_json_schema=true",
     "envace.reward.checklist.use_json_schema=True would override envace.reward.judge.use_json_schema"),
    ("+envace.reward.checklist.sampling.temperature=0.7",
     "envace.reward.checklist.sampling.temperature would override envace.reward.judge.temperature"),
    ("+envace.reward.checklist.sampling.max_tokens=64",
     "envace.reward.checklist.sampling.max_tokens would override envace.reward.judge.max_tokens"),
])
def test_a_judge_request_setting_has_one_key_the_endpoints(override, message):
    """The checklist judge's config could set the judge endpoint's request settings again per call, and won without a
    word; in the training config the endpoint's key (``envace.reward.judge.*``) is the one name. Request fields the
    endpoint has no key for stay in ``checklist.sampling``."""
    with pytest.raises(ConfigError) as err:
        validate_envace_config(compose([override]))
    assert message in str(err.value) and "\n" not in str(err.value)
    sampling = validate_envace_config(compose(["+envace.reward.checklist.sampling.stop=[END]"])).reward.checklist.sampling
    assert sampling == {"stop": ["END"]}
