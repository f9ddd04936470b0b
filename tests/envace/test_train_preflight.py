"""envace/train.py before and at the start of Ray: verl's typed config is validated before any Ray work, a
single-node run starts its own cluster (never the one Ray's "current cluster" file names), and the
network-interface variables reach every Ray worker."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from envace.train import compose, init_ray, main

TINY = ["actor_rollout_ref.model.path=builtin:tiny-qwen3", "envace.data.max_tasks_per_pool=4", "data.max_prompt_length=8192"]


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
