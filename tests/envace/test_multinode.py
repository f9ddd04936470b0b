"""The multi-node path of scripts/train.sh, for real on one machine.

Two Ray nodes on loopback (a head and a worker, two raylets), NNODES=2 with one CPU-platform device
slot per node, one training step across both nodes (FSDP over gloo, one rank per node).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_two_ray_nodes_one_training_step(tmp_path):
    port = _free_port()
    env = dict(os.environ, NNODES="2", MASTER_ADDR="127.0.0.1", RAY_PORT=str(port), RAY_NUM_CPUS="16",
               GPUS_PER_NODE="1", RAY_DEDUP_LOGS="0")
    env.pop("RAY_ADDRESS", None)
    head_cmd = [
        str(REPO / "scripts" / "train.sh"),
        f"trainer.default_local_dir={tmp_path / 'run'}",
        "trainer.total_training_steps=1", "trainer.save_freq=-1", "trainer.test_freq=-1",
        "data.max_response_length=64", "actor_rollout_ref.rollout.n=2", "trainer.logger=[console]",
    ]
    head = subprocess.Popen(head_cmd, cwd=REPO, env=dict(env, NODE_RANK="0"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    worker = None
    try:
        deadline = time.monotonic() + 300
        while not _port_open(port):
            assert head.poll() is None, head.stdout.read()[-4000:]
            assert time.monotonic() < deadline, "Ray head did not come up"
            time.sleep(1)
        worker = subprocess.Popen([str(REPO / "scripts" / "train.sh")], cwd=REPO, env=dict(env, NODE_RANK="1"),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
        out, _ = head.communicate(timeout=1500)
    finally:
        if head.poll() is None:
            head.kill()
        if worker is not None:
            try:
                worker.wait(timeout=60)  # the head stops the cluster on exit, which ends the worker node
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)  # train.sh and its `ray start --block` child
        subprocess.run([str(REPO / ".venv" / "bin" / "ray"), "stop", "--force"], capture_output=True)
    assert head.returncode == 0, out[-6000:]
    assert "Ray cluster has 2/2 nodes" in out
    assert "step:1 - " in out
    assert "training/rollout_probs_diff_max" in out
    # two FSDP ranks, one rollout replica each, placed on two different Ray nodes
    servers = re.findall(r"hfcpu://[^/\s']+/(\w+)/hfcpu_server_(\d+)_0", out)
    assert {rank for _, rank in servers} == {"0", "1"}, servers
    assert len({node for node, _ in servers}) == 2, servers
    assert "envace: training finished" in out
