"""envace/train.py before and at the start of Ray: verl's typed config is validated before any Ray work, a
single-node run starts its own cluster (never the one Ray's "current cluster" file names), and the
network-interface variables reach every Ray worker; and scripts/train.sh's check, on every node before any Ray
start, that the NVIDIA driver can run the installed torch's CUDA build (a stand-in nvidia-smi and torch/version.py
simulate a CUDA 12 driver under the CUDA 13 lock)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from envace.launch import cuda_mismatch
from envace.train import init_ray, main
from envace.verl.config import compose

TINY = ["actor_rollout_ref.model.path=builtin:tiny-qwen3", "envace.data.max_tasks_per_pool=8", "data.max_prompt_length=8192"]


def test_a_value_verl_rejects_only_inside_its_workers_fails_before_ray(monkeypatch, tmp_path, capsys):
    """``rollout.mode=sync`` passes verl's ``validate_config`` but fails ``RolloutConfig.__post_init__``, which
    verl runs inside its rollout workers. Old behaviour: the error came after the Ray cluster was up."""

    def no_ray(cfg):
        raise AssertionError("Ray was started with a config verl rejects")

    monkeypatch.setattr("envace.train.init_ray", no_ray)
    rc = main([*TINY, f"envace.data.out_dir={tmp_path}", f"trainer.default_local_dir={tmp_path / 'run'}",
               "actor_rollout_ref.rollout.mode=sync"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "verl rejects the config" in err and "Rollout mode 'sync' has been removed" in err


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
REPO = Path(__file__).resolve().parents[2]
H100 = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-aaaa0000-0000-0000-0000-000000000000)"


@pytest.mark.parametrize(("driver", "cuda", "refused"), [
    ("550.54.15", "13.0", True),  # R550 (CUDA 12.4) under the CUDA 13 lock: the case
    ("535.230.02", "13.0", True),
    ("580.65.06", "13.0", False),  # the first CUDA 13.0 driver
    ("590.44.01", "13.0", False),
    ("535.230.02", "12.8", False),  # minor-version compatibility within CUDA 12
    ("470.256.02", "12.8", True),
    (None, "13.0", False),  # no driver: a CPU node
    ("550.54.15", None, False),  # CPU torch: nothing to check
])
def test_driver_against_torch_cuda(driver, cuda, refused):
    problem = cuda_mismatch(driver, "2.11.0", cuda)
    assert (problem is not None) == refused
    if refused:
        assert f"NVIDIA driver {driver}" in problem and f"CUDA {cuda}" in problem and "\n" not in problem
        assert "upgrade the driver to the R" in problem and f"cuda-compat-{cuda.replace('.', '-')}" in problem


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

    # the stand-in nvidia-smi must not make scripts/bootstrap.sh reinstall this virtualenv for another platform
    env.update(PATH=f"{bindir}:{os.environ['PATH']}", PYTHONPATH=str(fake.parent),
               ENVACE_PLATFORM="gpu" if torch.version.cuda else "cpu")
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
    assert "cuda-compat-13-0" in lines[0] and "R580" in lines[0]
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


@pytest.mark.parametrize(("overrides", "refused"), [
    # the rehearse role is trained but sampled cooler than verl scores it
    (["envace.agent.rehearse_temperature=0.6"], True),
    # the same temperature as the rollout's, or the rollout's by default
    (["envace.agent.rehearse_temperature=1.0"], False),
    ([], False),
    # rehearsals that carry no loss may sample as they like
    (["envace.agent.rehearse_temperature=0.6", "envace.advantage.trained_roles=[act]"], False),
    # no rehearsal is generated
    (["envace.agent.rehearse_temperature=0.6", "envace.agent.observation_source=real"], False),
])
def test_trained_rehearsals_sample_at_the_temperature_verl_scores_them_at(monkeypatch, tmp_path, capsys,
                                                                          overrides, refused):
    """verl computes every row's log-probs at ``rollout.temperature``; a trained rehearsal sampled at another
    temperature would be trained off-policy with a ratio away from 1, so the config is refused before any work."""
    from envace import train

    def stop(*_args, **_kwargs):
        raise SystemExit("past the check")

    monkeypatch.setattr(train, "resolve_worldbooks", stop)
    base = [*TINY, "actor_rollout_ref.rollout.temperature=1.0", f"trainer.default_local_dir={tmp_path / 'run'}"]
    if refused:
        assert main([*base, *overrides]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "envace.agent.rehearse_temperature=0.6" in err[0] and "trained_roles=[act]" in err[0]
    else:
        with pytest.raises(SystemExit, match="past the check"):
            main([*base, *overrides])
