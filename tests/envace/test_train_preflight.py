"""envace/train.py before and at the start of Ray: every check (envace's and verl's typed keys, verl's own
validation, the registries' names) runs before the data build, the model build and Ray, and ``--preflight-only``
runs them alone, as the multi-node head does before it starts Ray; a driver that joins a cluster of several nodes
checks, before it builds, that every node sees where the builds write; a single-node run starts its own cluster (never
the one Ray's "current cluster" file names), and the network-interface variables reach every Ray worker; and
scripts/train.sh's check, on every node before any Ray start, that the NVIDIA driver can run the installed torch's
CUDA build (a stand-in nvidia-smi and torch/version.py simulate a CUDA 12 driver under the CUDA 13 lock)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from envace.config import ConfigError
from envace.launch import cuda_mismatch
from envace.train import init_ray, main
from envace.verl.config import compose

REPO = Path(__file__).resolve().parents[2]
TINY = ["actor_rollout_ref.model.path=builtin:tiny-qwen3", "envace.data.max_tasks_per_pool=8", "data.max_prompt_length=8192"]


class Heavy(Exception):
    """A slow step (data build, model build, Ray) was reached."""


@pytest.fixture
def heavy(monkeypatch, tmp_path):
    """The slow steps of a launch replaced by spies that record their call and stop there, and an empty
    ``ENVACE_CACHE``; yields the list of steps reached (in order)."""
    from envace import train

    reached: list[str] = []

    def spy(name):
        def stop(*_args, **_kwargs):
            reached.append(name)
            raise Heavy(name)
        return stop

    resolve = train.resolve_model_path

    def model(path, build=True):
        return spy("model build")() if build else resolve(path, build=False)

    monkeypatch.setattr(train, "build_data", spy("data build"))
    monkeypatch.setattr(train, "resolve_model_path", model)
    monkeypatch.setattr(train, "init_ray", spy("ray"))
    monkeypatch.setenv("ENVACE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    yield reached


#: the probe's mistakes (issue 43, findings 1 and 2) and their like: the override, and the key its one line names.
#: Old behaviour: the first two were refused by verl only after the data build and the warm start's build (minutes);
#: the next two ended in a ValueError / ZeroDivisionError traceback after the data build; the registry names passed
#: every check and failed inside Ray.
MISTAKES = [
    ("actor_rollout_ref.actor.ppo_mini_batch_size=16", "actor.ppo_mini_batch_size (16)"),
    ("data.train_batch_size=-8", "data.train_batch_size"),
    ("trainer.total_training_steps=abc", "'trainer.total_training_steps'"),
    ("data.train_batch_size=0", "data.train_batch_size"),
    ("actor_rollout_ref.rollout.name=nonsense", "actor_rollout_ref.rollout.name='nonsense'"),
    ("trainer.v1.trainer_mode=nonsense", "trainer.v1.trainer_mode='nonsense'"),
    ("algorithm.adv_estimator=nonsense", "algorithm.adv_estimator='nonsense'"),
    ("actor_rollout_ref.rollout.mode=sync", "Rollout mode 'sync' has been removed"),
    ("trainer.total_epochs=0", "trainer.total_epochs"),
    ("trainer.total_training_steps=null", "trainer.total_training_steps"),
    ("actor_rollout_ref.rollout.temperature=nan", "actor_rollout_ref.rollout.temperature"),
    ("trainer.total_training_stepz=5", "trainer.total_training_stepz"),
    ("trainer.nnodes=2", "trainer.nnodes=2 needs a Ray cluster"),  # old: refused at Ray start, after the builds
]


@pytest.mark.parametrize(("override", "key"), MISTAKES)
def test_every_mistake_is_one_line_before_anything_heavy(heavy, tmp_path, capsys, override, key):
    run = tmp_path / "run"
    assert main([override, f"trainer.default_local_dir={run}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("envace: config error: ") and key in err[0], err
    assert heavy == [] and not (tmp_path / "cache").exists() and not run.exists()


#: issue 47, item 2: one setting with two keys, given two values (the CPU default: data.train_batch_size=8,
#: rollout.n=4, observation_source=rehearse), and the start of the one line that names both keys and both values.
#: Old behaviour: each passed, and the trainer's key silently replaced the other (envsched's batch and group size in
#: envace.verl.sched inside Ray; the default agent loop in the pre-flight).
TWO_VALUES = [
    (["data.train_batch_size=64", "envsched.batch_size=32"],
     "envsched.batch_size=32 differs from data.train_batch_size=64: "),
    (["envsched.rollouts_per_task=8"], "envsched.rollouts_per_task=8 differs from actor_rollout_ref.rollout.n=4: "),
    (["actor_rollout_ref.rollout.agent.default_agent_loop=envace_env"],
     ("actor_rollout_ref.rollout.agent.default_agent_loop=envace_env differs from envace_act_rehearse, the loop of "
      "envace.agent.observation_source=rehearse: ")),
]


@pytest.mark.parametrize(("overrides", "line"), TWO_VALUES)
def test_one_setting_given_two_values_is_refused_naming_both_keys(heavy, tmp_path, capsys, overrides, line):
    run = tmp_path / "run"
    assert main(["--preflight-only", *overrides, f"trainer.default_local_dir={run}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"envace: config error: {line}"), err
    assert heavy == [] and not (tmp_path / "cache").exists() and not run.exists()


def test_the_envsched_keys_set_to_the_trainers_values_pass(heavy, tmp_path, capsys):
    """The same keys given the trainer's values (or left at their interpolation) pass the pre-flight of the EnvSched
    recipe; the default agent loop is filled in from the observation source."""
    run = f"trainer.default_local_dir={tmp_path / 'run'}"
    assert main(["--preflight-only", run, "experiment=cpu_envsched", "data.train_batch_size=4",
                 "envsched.batch_size=4", "envsched.rollouts_per_task=2"]) == 0
    assert main(["--preflight-only", run, "experiment=cpu_envsched", "data.train_batch_size=4",
                 "actor_rollout_ref.rollout.agent.default_agent_loop=envace_act_rehearse"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "envace: pre-flight passed"
    assert heavy == []


def test_the_one_line_is_all_a_fresh_process_prints(tmp_path):
    """In a process of its own (warnings printed, not collected by pytest): verl's notes and warnings of the early
    check ("Disabled critic ...") do not come before the refusal, and nothing is built into the empty cache."""
    proc = subprocess.run([sys.executable, "-m", "envace.train", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                           f"trainer.default_local_dir={tmp_path / 'run'}"], cwd=REPO, capture_output=True, text=True,
                          env=dict(os.environ, ENVACE_CACHE=str(tmp_path / "cache")), timeout=300, check=False)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == [("envace: config error: verl rejects the config: ValueError: train_batch_size "
                                         "(8) must be >= actor.ppo_mini_batch_size (16)")]
    assert not (tmp_path / "cache").exists() and not (tmp_path / "run").exists()


def test_a_valid_config_reaches_the_data_build_first_and_preflight_only_reaches_nothing(heavy, tmp_path, capsys):
    """The spies are live: the default config passes every check and its first slow step is the data build
    (before the warm start's build and Ray). ``--preflight-only`` runs the same checks and stops, exit 0."""
    run = f"trainer.default_local_dir={tmp_path / 'run'}"
    with pytest.raises(Heavy):
        main([run])
    assert heavy == ["data build"]
    heavy.clear()
    assert main(["--preflight-only", run]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "envace: pre-flight passed"
    assert heavy == [] and not (tmp_path / "cache").exists() and not (tmp_path / "run").exists()
    assert main(["--preflight-only", run, "data.train_batch_size=0"]) == 2


def test_on_a_cluster_of_several_nodes_the_folders_the_builds_write_into_are_checked_before_building(
        heavy, monkeypatch, tmp_path):
    """Issue 44's follow-up: a driver told to join a Ray cluster (``RAY_ADDRESS``, ``trainer.nnodes=2``) joins it
    before the builds and, the cluster having several nodes, checks that every node sees the run directory, the
    folders the builds will write into (a ``builtin:`` model's under ENVACE_CACHE; ``envace.data.out_dir``) and the
    paths the user gave; refused, it exits 2 with nothing built. Passed, the builds follow. Old behaviour: the only
    check came after the data build and the warm start's (minutes). Ray is replaced by spies here;
    tests/envace/test_multinode.py runs it for real."""
    from envace import launch, train
    from envace.config import ConfigError

    checks: list[tuple[str, dict[str, str], dict[str, str]]] = []
    verdict: list[str] = []

    def check_shared_storage(run_dir, paths, timeout=300.0, *, folders=None):
        checks.append((str(run_dir), dict(paths), dict(folders or {})))
        if verdict:
            raise ConfigError(verdict[0])

    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    monkeypatch.setattr(train, "init_ray", lambda cfg: heavy.append("ray"))
    monkeypatch.setattr(train, "alive_nodes", lambda: 2)
    monkeypatch.setattr(launch, "check_shared_storage", check_shared_storage)
    run = tmp_path / "run"
    base = [f"trainer.default_local_dir={run}", "trainer.nnodes=2"]

    verdict.append("every node must see the run directory ...")
    assert main(base) == 2
    assert heavy == ["ray"] and not run.exists() and not (tmp_path / "cache").exists()
    assert checks == [(str(run), {}, {"actor_rollout_ref.model.path (under ENVACE_CACHE)":
                                      str(tmp_path / "cache" / "models")})]

    verdict.clear()
    heavy.clear()
    checks.clear()
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with pytest.raises(Heavy, match="data build"):
        main([*base, f"actor_rollout_ref.model.path={model}", f"envace.data.out_dir={tmp_path / 'data'}"])
    assert heavy == ["ray", "data build"]
    assert checks == [(str(run), {"actor_rollout_ref.model.path": str(model)},
                       {"envace.data.out_dir": str(tmp_path / "data")})]


def test_enabling_debug_shows_the_traceback(heavy, monkeypatch):
    from envace.config import ConfigError

    monkeypatch.setenv("ENVACE_DEBUG", "1")
    with pytest.raises(ConfigError, match="data.train_batch_size"):
        main(["data.train_batch_size=0"])


def test_a_value_verl_rejects_only_inside_its_workers_fails_before_ray(heavy, tmp_path, capsys):
    """``rollout.mode=sync`` passes verl's ``validate_config`` but fails ``RolloutConfig.__post_init__``, which
    verl runs inside its rollout workers. Old behaviour: the error came after the Ray cluster was up (and, later,
    after the data and model builds)."""
    rc = main([*TINY, f"envace.data.out_dir={tmp_path / 'data'}", f"trainer.default_local_dir={tmp_path / 'run'}",
               "actor_rollout_ref.rollout.mode=sync"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "verl rejects the config" in err and "Rollout mode 'sync' has been removed" in err
    assert heavy == [] and not (tmp_path / "data").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_multinode_head_runs_the_preflight_before_it_starts_ray(tmp_path):
    """Issue 43, finding 3: the head started Ray and waited up to RAY_JOIN_TIMEOUT (600 s) for workers before the
    typo was read. Now it exits 2 at once, naming the key, with no Ray started and no token written."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    token = tmp_path / "shared" / "ray_token"
    env.update(NNODES="2", NODE_RANK="0", MASTER_ADDR="127.0.0.1", RAY_PORT=str(_free_port()),
               RAY_AUTH_TOKEN_PATH=str(token), ENVACE_CACHE=str(tmp_path / "cache"))
    # well within RAY_JOIN_TIMEOUT (600 s), which the head used to wait out first
    proc = subprocess.run([str(REPO / "scripts" / "train.sh"), "trainer.total_training_stepz=5"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [("envace: config error: Could not override "
                                                 "'trainer.total_training_stepz'. To append to your config use "
                                                 "+trainer.total_training_stepz=5")]
    assert "Ray head" not in proc.stdout and not token.parent.exists() and not (tmp_path / "cache").exists()


def test_network_interface_variables_reach_every_ray_worker(monkeypatch, tmp_path):
    import ray

    seen = {}

    def fake_init(**kwargs):
        seen.update(kwargs)

    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"GPU": 1.0, "CPU": 32.0})
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for key, value in {"NCCL_SOCKET_IFNAME": "eth1", "GLOO_SOCKET_IFNAME": "eth1", "NCCL_IB_HCA": "mlx5_0"}.items():
        monkeypatch.setenv(key, value)
    init_ray(compose([*TINY, f"trainer.default_local_dir={tmp_path}"]))
    env = seen["runtime_env"]["env_vars"]
    assert (env["NCCL_SOCKET_IFNAME"], env["GLOO_SOCKET_IFNAME"], env["NCCL_IB_HCA"]) == ("eth1", "eth1", "mlx5_0")
    assert seen["address"] == "local"


@pytest.fixture
def stale_ray_tmpdir(monkeypatch):
    """A RAY_TMPDIR whose current-cluster file names a cluster that does not exist (short path: Ray's
    socket paths must stay under the Unix limit)."""
    d = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))
    (d / "ray").mkdir()
    (d / "ray" / "ray_current_cluster").write_text("127.0.0.1:1")
    monkeypatch.setenv("RAY_TMPDIR", str(d))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_single_node_training_starts_its_own_cluster_despite_a_stale_current_cluster_file(stale_ray_tmpdir, tmp_path):
    """The issue's reproduction (``RAY_TMPDIR=$d scripts/train.sh`` with ``127.0.0.1:1`` in
    ``$d/ray/ray_current_cluster``). Old behaviour: ``ray.init()`` without an address read the file and
    failed with "When connecting to an existing cluster, num_cpus and num_gpus must not be provided" (or
    joined whatever cluster the file named)."""
    import ray

    cfg = compose([*TINY, f"trainer.default_local_dir={tmp_path}", "ray_kwargs.ray_init.num_cpus=2"])
    try:
        init_ray(cfg)
        assert ray.is_initialized()
        assert ray.get_runtime_context().gcs_address != "127.0.0.1:1"
        assert ray.cluster_resources().get("GPU") == 1.0  # this run's own logical slot
        assert str(stale_ray_tmpdir) in ray._private.worker.global_worker.node.get_session_dir_path()
    finally:
        ray.shutdown()
    assert os.environ.get("RAY_ADDRESS") in (None, "")


# -- the NVIDIA driver against the installed torch's CUDA build (scripts/train.sh, every node, before Ray) ------------
H100 = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-aaaa0000-0000-0000-0000-000000000000)"


@pytest.mark.parametrize(("driver", "cuda", "refused"), [
    ("550.54.15", "13.0", True),  # R550 (CUDA 12.4) under the CUDA 13 lock: the case
    ("535.230.02", "13.0", True),
    ("570.124.06", "13.0", True),  # R570 (CUDA 12.8), the last branch before CUDA 13
    ("470.256.02", "13.0", True),  # too old for the CUDA 12.8 lock too
    ("580.65.06", "13.0", False),  # the first CUDA 13.0 driver
    ("590.44.01", "13.0", False),
    ("535.230.02", "12.8", False),  # the CUDA 12.8 lock: minor-version compatibility within CUDA 12
    ("525.60.13", "12.8", False),  # its first driver
    ("470.256.02", "12.8", True),
    (None, "13.0", False),  # no driver: a CPU node
    ("550.54.15", None, False),  # CPU torch: nothing to check
])
def test_driver_against_torch_cuda(driver, cuda, refused):
    """One line naming the driver, the torch build and its lock, and every way out: the CUDA 12.8 lock where the
    driver runs it (a CUDA 13 torch on R525.60.13 to R575), a driver upgrade, or forward compatibility."""
    problem = cuda_mismatch(driver, f"2.11.0+cu{(cuda or '').replace('.', '')}", cuda)
    assert (problem is not None) == refused
    if refused:
        assert f"NVIDIA driver {driver}" in problem and f"CUDA {cuda}" in problem and "\n" not in problem
        assert f"(requirements/gpu-cu{cuda.split('.')[0]}.lock)" in problem
        assert "upgrade the driver to the R" in problem and f"cuda-compat-{cuda.replace('.', '-')}" in problem
        cuda12_runs_here = cuda == "13.0" and not driver.startswith("470.")
        assert ("ENVACE_CUDA=12 scripts/train.sh" in problem) == cuda12_runs_here, problem
        assert ("requirements/gpu-cu12.lock" in problem) == (cuda12_runs_here or cuda == "12.8"), problem


def _cuda12_node(tmp_path: Path, cuda_works: bool = False) -> dict[str, str]:
    """The environment of a node whose nvidia-smi reports an H100 on driver 550.54.15 (CUDA 12.4) and whose
    torch is the CUDA 13.0 build: a stand-in ``torch`` package (its ``version.py`` as a real wheel writes it) put
    first on PYTHONPATH; ``torch.cuda.is_available()`` answers ``cuda_works`` (forward compatibility)."""
    bindir, fake = tmp_path / "bin", tmp_path / "faketorch" / "torch"
    bindir.mkdir()
    fake.mkdir(parents=True)
    (bindir / "nvidia-smi").write_text(
        "#!/usr/bin/env bash\n"
        f"echo \"$@\" >> {tmp_path / 'smi_calls'}\n"
        f'case "$*" in *driver_version*) echo 550.54.15 ;; *-L*) echo "{H100}" ;;\n'
        '  *) echo "CUDA Version: 12.4" ;; esac\n')
    (bindir / "nvidia-smi").chmod(0o755)
    (fake / "version.py").write_text("from typing import Optional\n__version__ = '2.11.0+cu130'\n"
                                     "cuda: Optional[str] = '13.0'\n")
    (fake / "__init__.py").write_text("from . import version\n__version__ = version.__version__\n"
                                      f"class cuda:\n    @staticmethod\n    def is_available():\n"
                                      f"        return {cuda_works}\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE", "GPUS_PER_NODE", "PYTHONPATH")}
    import torch

    # the stand-in nvidia-smi must not make scripts/bootstrap.sh reinstall this virtualenv for another platform or
    # CUDA build (its R550 driver picks the CUDA 12.8 lock)
    env.update(PATH=f"{bindir}:{os.environ['PATH']}", PYTHONPATH=str(fake.parent),
               ENVACE_PLATFORM="gpu" if torch.version.cuda else "cpu",
               ENVACE_CUDA=torch.version.cuda.split(".")[0] if torch.version.cuda else "auto")
    return env


def _train_sh(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(REPO / "scripts" / "train.sh"), *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120, check=False)


def test_train_sh_stops_on_a_cuda_12_driver_before_ray_on_one_node(tmp_path):
    """Old behaviour: no check; train.py's "no CUDA device" came after the config and data work (and pip had
    installed the CUDA 13 torch without a word)."""
    run = tmp_path / "run"
    proc = _train_sh(_cuda12_node(tmp_path), f"trainer.default_local_dir={run}")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if "driver" in ln]
    assert len(lines) == 1 and "driver 550.54.15 supports CUDA up to 12.4" in lines[0], proc.stderr
    assert "cuda-compat-13-0" in lines[0] and "R580" in lines[0] and "ENVACE_CUDA=12" in lines[0]
    assert "Traceback" not in proc.stderr and not run.exists()  # nothing written, no Ray, no trainer
    assert "--query-gpu=driver_version" in (tmp_path / "smi_calls").read_text()


def test_train_sh_stops_on_a_cuda_12_driver_before_ray_on_every_node_of_two(tmp_path):
    """Old behaviour: with NNODES > 1 train.py's CUDA check was skipped (RAY_ADDRESS set) and the run died later,
    inside Ray workers; both the head and the worker now stop before their ``ray start``."""
    env = _cuda12_node(tmp_path)
    env.update(NNODES="2", MASTER_ADDR="127.0.0.1", RAY_PORT="1", RAY_AUTH_TOKEN="t" * 32, RAY_JOIN_TIMEOUT="2")
    for rank in ("0", "1"):
        proc = _train_sh(dict(env, NODE_RANK=rank), "trainer.total_training_steps=1")
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "driver 550.54.15 supports CUDA up to 12.4" in proc.stderr
        assert "Ray head" not in proc.stdout  # neither "starting Ray head" nor "joining Ray head"


def test_forward_compatibility_passes_the_check(tmp_path):
    """With NVIDIA's compat libraries on the library path torch reaches the GPUs on the old driver: the check
    says so and lets the run go on."""
    env = _cuda12_node(tmp_path, cuda_works=True)
    proc = subprocess.run([sys.executable, "-m", "envace.launch", "cuda-check"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0 and "CUDA forward compatibility" in proc.stderr, proc.stderr
    (tmp_path / "b").mkdir()
    broken = subprocess.run([sys.executable, "-m", "envace.launch", "cuda-check"], cwd=REPO,
                            env=_cuda12_node(tmp_path / "b", cuda_works=False), capture_output=True, text=True,
                            timeout=120, check=False)
    assert broken.returncode == 2 and "needs driver >= 580.65.06" in broken.stderr, broken.stderr


ASYNC = "trainer.v1.trainer_mode=envace_colocate_async"
ACT_ONLY = "envace.advantage.trained_roles=[act]"


@pytest.mark.parametrize(("overrides", "says"), [
    # the rehearse role is trained but sampled cooler than verl scores it
    (["envace.agent.rehearse_temperature=0.6"], "trained_roles=[act]"),
    # the same temperature as the rollout's, or the rollout's by default
    (["envace.agent.rehearse_temperature=1.0"], None),
    ([], None),
    # rehearsals that carry no loss may sample as they like
    (["envace.agent.rehearse_temperature=0.6", ACT_ONLY], None),
    # no rehearsal is generated
    (["envace.agent.rehearse_temperature=0.6", "envace.agent.observation_source=real"], None),
    # off-policy correction weighs every row by its rollout log-probs, untrained rehearsals too (issue 46): an async
    # trainer, or rollout correction's importance weights or rejection in a sync one, refuse the cooler rehearsals
    (["envace.agent.rehearse_temperature=0.6", ACT_ONLY, ASYNC], "trainer_mode=envace_colocate_async"),
    (["envace.agent.rehearse_temperature=0.6", ACT_ONLY, "trainer.v1.trainer_mode=envsched_colocate_async"],
     "trainer_mode=envsched_colocate_async"),
    (["envace.agent.rehearse_temperature=0.6", "algorithm.rollout_correction.rollout_is=token"],
     "algorithm.rollout_correction.rollout_is=token"),
    (["envace.agent.rehearse_temperature=0.6", ACT_ONLY, "algorithm.rollout_correction.rollout_rs=token_k3",
      "algorithm.rollout_correction.rollout_rs_threshold=0.01"], "algorithm.rollout_correction.rollout_rs=token_k3"),
    # ... but not rehearsals sampled at the rollout temperature, nor a config that generates none
    (["envace.agent.rehearse_temperature=1.0", ASYNC, "algorithm.rollout_correction.rollout_is=token"], None),
    (["envace.agent.rehearse_temperature=0.6", ASYNC, "envace.agent.observation_source=real"], None),
])
def test_trained_rehearsals_sample_at_the_temperature_verl_scores_them_at(monkeypatch, tmp_path, capsys,
                                                                          overrides, says):
    """verl computes every row's log-probs at ``rollout.temperature``; a trained rehearsal sampled at another
    temperature would be trained off-policy with a ratio away from 1, so the config is refused before any work.
    Under an async trainer or rollout correction, verl's importance weights and rejection read every row's rollout
    log-probs, so the config is refused even when the rehearse role carries no loss. Old behaviour: an async trainer
    with ``trained_roles=[act]`` (or rollout correction) passed and trained with rehearse weights biased by the
    temperature."""
    from envace import train

    def stop(*_args, **_kwargs):
        raise SystemExit("past the check")

    monkeypatch.setattr(train, "resolve_worldbooks", stop)
    base = [*TINY, "actor_rollout_ref.rollout.temperature=1.0", f"trainer.default_local_dir={tmp_path / 'run'}"]
    if says:
        assert main([*base, *overrides]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "envace.agent.rehearse_temperature=0.6" in err[0] and says in err[0], err
    else:
        with pytest.raises(SystemExit, match="past the check"):
            main([*base, *overrides])


# -- the async trainers (issue 46): what verl asserts inside Ray, and the staleness bound ----------------------------
#: separate_async with every requirement of verl's PPOTrainerSeparateAsync met (8 prompts = 2 syncs x 4), but for the
#: checkpoint engine, which each test names
SEPARATE = ["trainer.v1.trainer_mode=envace_separate_async", "trainer.v1.separate_async.parameter_sync_step=2",
            "actor_rollout_ref.rollout.nnodes=1"]


@pytest.mark.parametrize("mode", ["envace_separate_async", "envsched_separate_async", "separate_async"])
def test_separate_async_batch_sizes_are_checked_before_anything_heavy(heavy, tmp_path, capsys, mode):
    """verl's PPOTrainerSeparateAsync asserts train_batch_size == parameter_sync_step x ppo_mini_batch_size in its
    constructor, inside Ray after the data and model builds; envace's trainers of that kind and verl's own are refused
    here, naming the key (cpu_default: 8 prompts, mini-batch 4, verl's default parameter_sync_step 4)."""
    assert main([f"trainer.v1.trainer_mode={mode}", f"trainer.default_local_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("envace: config error: trainer.v1.separate_async.parameter_sync_step=4")
    assert "(4 × 4 = 16)" in err[0] and heavy == []


@pytest.mark.parametrize(("overrides", "says"), [
    (["actor_rollout_ref.rollout.nnodes=0"], "actor_rollout_ref.rollout.nnodes=0: separate_async generates on a"),
    (["actor_rollout_ref.rollout.n_gpus_per_node=0"], "actor_rollout_ref.rollout.n_gpus_per_node=0"),
    ([], "actor_rollout_ref.rollout.checkpoint_engine.backend=naive: separate_async"),
    (["actor_rollout_ref.rollout.checkpoint_engine.backend=nccl", "reward.reward_model.enable=true"],
     "reward.reward_model.enable_resource_pool=false: separate_async"),
    (["actor_rollout_ref.rollout.checkpoint_engine.backend=nccl"],
     "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl cannot load on this machine"),
    (["actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
      "actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=no_such_engine_module"],
     "checkpoint_engine.custom_backend_module=no_such_engine_module: No module named 'no_such_engine_module'"),
])
def test_separate_async_needs_a_standalone_rollout_and_an_engine_that_loads(heavy, monkeypatch, tmp_path, capsys,
                                                                            overrides, says):
    """The rest of what verl's PPOTrainerSeparateAsync asserts (a standalone rollout of its own devices; not the
    naive engine; a reward model in a pool of its own), and a checkpoint engine that cannot import here: nccl without cupy (simulated on every machine,
    as on a CPU install: verl records the engine module's import error), named with the locks that install it."""
    from verl.checkpoint_engine import CheckpointEngineRegistry

    monkeypatch.delitem(CheckpointEngineRegistry._registry, "nccl", raising=False)
    monkeypatch.setitem(CheckpointEngineRegistry._import_errors, "nccl_checkpoint_engine",
                        ImportError("No module named 'cupy'"))
    assert main([*SEPARATE, *overrides, f"trainer.default_local_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
    if "backend=nccl cannot" in says:
        assert "nccl_checkpoint_engine: No module named 'cupy'" in err[0] and "gpu-cu13.lock" in err[0]
    assert heavy == [] and not (tmp_path / "run").exists()


def test_a_complete_separate_async_config_reaches_the_data_build(heavy, monkeypatch, tmp_path):
    """The refusals above are the only ones: with an engine that loads (a stand-in registered under its name), the
    same config passes every check and its first slow step is the data build."""
    from verl.checkpoint_engine import CheckpointEngineRegistry

    monkeypatch.setitem(CheckpointEngineRegistry._registry, "standin", object)
    with pytest.raises(Heavy):
        main([*SEPARATE, "actor_rollout_ref.rollout.checkpoint_engine.backend=standin",
              f"trainer.default_local_dir={tmp_path / 'run'}"])
    assert heavy == ["data build"]


def test_separate_async_counts_the_standalone_rollouts_gpu_slots():
    """verl places separate_async's standalone rollout on devices of its own: the Ray cluster needs the trainer's
    slots and the rollout's."""
    from envace.train import check_ray_resources

    cfg = compose(["trainer.nnodes=2", "trainer.n_gpus_per_node=8", "trainer.v1.trainer_mode=envace_separate_async",
                   "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=8"])
    with pytest.raises(ConfigError, match=r"trainer.nnodes × trainer.n_gpus_per_node \+ actor_rollout_ref.rollout."
                                          r"nnodes × n_gpus_per_node = 2 × 8 \+ 1 × 8 = 24"):
        check_ray_resources(cfg, {"GPU": 16.0}, n_nodes=3)
    check_ray_resources(cfg, {"GPU": 24.0}, n_nodes=3)
    colocated = compose(["trainer.nnodes=2", "trainer.n_gpus_per_node=8", "trainer.v1.trainer_mode=envace_colocate_async",
                         "actor_rollout_ref.rollout.nnodes=1"])
    check_ray_resources(colocated, {"GPU": 16.0}, n_nodes=2)  # colocated: the rollout shares the trainer's devices


@pytest.mark.parametrize(("overrides", "says"), [
    # drop bounds the staleness (threshold - 1 versions): nothing to say
    ([ASYNC], []),
    ([ASYNC, "trainer.v1.sampler.max_off_policy_strategy=wait"],
     ["trainer.v1.sampler.max_off_policy_strategy=wait: stale groups are trained, not dropped"]),
    ([ASYNC, "trainer.v1.sampler.max_off_policy_threshold=null"],
     ["trainer.v1.sampler.max_off_policy_threshold=null: the colocate_async trainer trains rollouts of any age"]),
    # the sync trainer has no staleness: its sampler settings are not read
    (["trainer.v1.sampler.max_off_policy_strategy=wait"], []),
    # verl fetches prompts one at a time in async modes (and for exact refills in sync): a batch size set is ignored
    ([ASYNC, "data.gen_batch_size=4"],
     ["data.gen_batch_size=4 is overridden to 1 by verl with trainer.v1.trainer_mode=envace_colocate_async"]),
    ([ASYNC, "data.gen_batch_size=1"], []),
    (["data.gen_batch_size=4"], []),
    (["data.gen_batch_size=4", "trainer.v1.sampler.sync_refill_failed_groups=true"],
     ["data.gen_batch_size=4 is overridden to 1 by verl with exact refills"]),
])
def test_async_settings_verl_would_override_or_leave_unbounded_are_warned_about(tmp_path, capsys, overrides, says):
    """An async trainer under max_off_policy_strategy=wait (its staleness can pass the threshold) or without a
    threshold, and a data.gen_batch_size verl replaces by 1: one warning line each, naming the key; the run goes on.
    Old behaviour: nothing said (verl logs the gen_batch_size override inside Ray, and nothing at all about wait)."""
    assert main(["--preflight-only", *overrides, f"trainer.default_local_dir={tmp_path / 'run'}"]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("envace: warning: ")]
    assert len(err) == len(says) and all(s in line for s, line in zip(says, err)), err


@pytest.mark.parametrize(("override", "key"), [
    ("trainer.v1.sampler.max_off_policy_threshold=0", "trainer.v1.sampler.max_off_policy_threshold must be >= 1"),
    ("trainer.v1.sampler.max_off_policy_threshold=2.5", "'trainer.v1.sampler.max_off_policy_threshold'"),
    ("trainer.v1.sampler.max_off_policy_strategy=keep", "trainer.v1.sampler.max_off_policy_strategy must be one of"),
    ("trainer.v1.separate_async.parameter_sync_step=0", "trainer.v1.separate_async.parameter_sync_step must be >= 1"),
    ("trainer.v1.colocate_async.num_warmup_batches=-1", "trainer.v1.colocate_async.num_warmup_batches must be >= 0"),
])
def test_async_keys_verl_checks_only_inside_ray_are_typed(heavy, tmp_path, capsys, override, key):
    """verl asserts the sampler's threshold and strategy when its replay buffer is built, inside Ray; these keys are
    typed and ranged with envace's own (envace.config.VerlKeys), whatever the trainer mode."""
    assert main([ASYNC, override, f"trainer.default_local_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and key in err[0], err
    assert heavy == []


def test_an_unformed_warm_start_is_named_before_the_run_and_in_its_last_line(monkeypatch, tmp_path, capsys):
    """A warm start whose copy drill missed its target (its manifest says so) trains, but the user reads why the
    README's figures will not hold before the run starts and again as the run's last line (issue 43)."""
    import json as _json

    from omegaconf import open_dict

    from envace import train
    from envace.models.warmstart import warm_recipe

    model = tmp_path / "warm"
    model.mkdir()
    (model / "envace_manifest.json").write_text(_json.dumps({
        "recipe": warm_recipe(), "cpu": {"capability": "AVX2"},
        "train": {"drill_formed": False, "drill_final_loss": 0.064, "drill_steps": 4500}}))

    def prepare(cfg):
        with open_dict(cfg):
            cfg.actor_rollout_ref.model.path = str(model)
        return cfg, None

    events: list[str] = []
    monkeypatch.setattr(train, "prepare", prepare)
    monkeypatch.setattr(train, "launch", lambda cfg: events.append(capsys.readouterr().err))
    monkeypatch.setattr(train, "report_learning", lambda run_dir: print("envace: held-out success ..."))
    assert main([f"trainer.default_local_dir={tmp_path / 'run'}"]) == 0
    before, after = events[0].strip().splitlines(), capsys.readouterr().err.strip().splitlines()
    assert len(before) == 1 and "did not form its copying circuit" in before[0] and "AVX2" in before[0]
    assert after == before  # the last line of the run, after the held-out line (stdout)
