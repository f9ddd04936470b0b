"""Launch helpers (envace/launch.py) and the multi-node pre-flight of scripts/train.sh that needs no cluster:
GPU counting, joining a head that is still starting, process lifetime, authentication, offline mode, the
environment variables train.sh reads, checked before it installs anything, and the shared-storage check's marker
folders and node probe."""

from __future__ import annotations

import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envace.launch import count_gpus, passthrough_env, wait_head

REPO = Path(__file__).resolve().parents[2]

TWO_GPUS = """GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-aaaa0000-0000-0000-0000-000000000000)
GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-bbbb0000-0000-0000-0000-000000000000)
"""
MIG = """GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-aaaa0000-0000-0000-0000-000000000000)
  MIG 3g.20gb     Device  0: (UUID: MIG-1111aaaa-0000-0000-0000-000000000000)
  MIG 2g.10gb     Device  1: (UUID: MIG-2222aaaa-0000-0000-0000-000000000000)
  MIG 1g.5gb      Device  2: (UUID: MIG-3333aaaa-0000-0000-0000-000000000000)
GPU 1: NVIDIA A100-SXM4-40GB (UUID: GPU-bbbb0000-0000-0000-0000-000000000000)
"""


@pytest.mark.parametrize(
    ("listing", "visible", "expected"),
    [
        (TWO_GPUS, None, 2),
        (TWO_GPUS, "1", 1),
        (TWO_GPUS, "0,1", 2),
        (TWO_GPUS, "", 0),
        (TWO_GPUS, "1,-1,0", 1),  # CUDA stops at the first invalid entry
        (TWO_GPUS, "GPU-bbbb0000-0000-0000-0000-000000000000", 1),
        (MIG, None, 4),  # `nvidia-smi -L | wc -l` said 5: the MIG-enabled GPU counted besides its MIG devices
        (MIG, "MIG-2222aaaa-0000-0000-0000-000000000000", 1),
        (MIG, "1", 1),
        (None, None, 0),
    ],
)
def test_gpu_count_honours_cuda_visible_devices_and_mig(listing, visible, expected):
    assert count_gpus(listing, visible) == expected


def test_network_interface_variables_are_selected_for_the_workers():
    env = {"NCCL_SOCKET_IFNAME": "eth1", "GLOO_SOCKET_IFNAME": "eth1", "NCCL_IB_HCA": "mlx5_0",
           "NCCL_IB_GID_INDEX": "3", "HOME": "/root", "CUDA_VISIBLE_DEVICES": "0"}
    assert passthrough_env(env) == {"NCCL_SOCKET_IFNAME": "eth1", "GLOO_SOCKET_IFNAME": "eth1",
                                    "NCCL_IB_HCA": "mlx5_0", "NCCL_IB_GID_INDEX": "3"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_worker_waits_for_a_head_that_is_still_starting_and_gives_up_at_the_timeout():
    port = _free_port()
    started = time.monotonic()
    assert wait_head(f"127.0.0.1:{port}", timeout=1.0, poll=0.2) == 1
    assert time.monotonic() - started < 5

    listener = socket.socket()

    def head_comes_up() -> None:
        time.sleep(1.0)
        listener.bind(("127.0.0.1", port))
        listener.listen()

    threading.Thread(target=head_comes_up, daemon=True).start()
    try:
        assert wait_head(f"127.0.0.1:{port}", timeout=30.0, poll=0.2) == 0
    finally:
        listener.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (ProcessLookupError, OSError):
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux")
def test_bound_exec_dies_with_its_parent_even_on_sigkill(tmp_path):
    """scripts/train.sh starts its Ray node this way: a SIGKILLed train.sh cannot run its exit trap, and the
    node must not outlive it."""
    pidfile = tmp_path / "child.pid"
    script = textwrap.dedent(f"""
        "{sys.executable}" -m envace.launch bound-exec --parent $$ -- \
            "{sys.executable}" -c 'import os, time; open("{pidfile}", "w").write(str(os.getpid())); time.sleep(120)' &
        wait
    """)
    parent = subprocess.Popen(["bash", "-c", script], cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        while not (pidfile.exists() and pidfile.read_text()):
            assert time.monotonic() < deadline, "the bound command did not start"
            time.sleep(0.1)
        child = int(pidfile.read_text())
        assert _alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child)
    finally:
        if parent.poll() is None:
            parent.kill()


FAKE_NVIDIA_SMI = """#!/usr/bin/env bash
env > "{envfile}"
cat <<'EOF'
{listing}EOF
"""


def _worker(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """scripts/train.sh as worker node 1 of 2, its head never coming up, on a machine with a fake nvidia-smi."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    smi = bindir / "nvidia-smi"
    smi.write_text(FAKE_NVIDIA_SMI.format(envfile=tmp_path / "env.txt", listing=MIG))
    smi.chmod(0o755)
    full = {k: v for k, v in os.environ.items()
            if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE", "GPUS_PER_NODE",
                         "CUDA_VISIBLE_DEVICES", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")}
    import torch

    full.update(NNODES="2", NODE_RANK="1", MASTER_ADDR="127.0.0.1", RAY_PORT=str(_free_port()), RAY_JOIN_TIMEOUT="2",
                PATH=f"{bindir}:{os.environ['PATH']}", **env)
    # the fake nvidia-smi must not make scripts/bootstrap.sh reinstall this virtualenv for another platform or CUDA
    # build (it reports no driver version)
    full["ENVACE_PLATFORM"] = "gpu" if torch.version.cuda else "cpu"
    full["ENVACE_CUDA"] = torch.version.cuda.split(".")[0] if torch.version.cuda else "auto"
    proc = subprocess.Popen([str(REPO / "scripts" / "train.sh")], cwd=REPO, env=full, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"scripts/train.sh did not give up on a head that never came up:\n{out}\n{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_multi_node_without_a_token_is_refused(tmp_path):
    """Old behaviour: without RAY_AUTH_TOKEN, train.sh set RAY_AUTH_MODE=disabled and ran Ray unauthenticated."""
    proc = _worker(tmp_path)
    assert proc.returncode == 2
    assert "needs token authentication" in proc.stderr and "RAY_AUTH_TOKEN_PATH" in proc.stderr
    assert "RAY_AUTH_MODE=disabled" in proc.stderr  # the explicit opt-out is named
    assert "joining Ray head" not in proc.stdout  # nothing was started


def test_worker_counts_mig_devices_runs_offline_and_times_out_joining(tmp_path):
    """Old behaviour: `nvidia-smi -L | wc -l` (5 here: one GPU line besides its three MIG lines), no offline
    mode, and `ray start --address` against a head that is not up yet, with no retry or time-out of ours."""
    proc = _worker(tmp_path, RAY_AUTH_TOKEN="t" * 32)
    assert "(4 device slot(s))" in proc.stdout, proc.stdout + proc.stderr
    assert proc.returncode == 1 and "did not accept connections within 2s" in proc.stderr
    env = dict(line.split("=", 1) for line in (tmp_path / "env.txt").read_text().splitlines() if "=" in line)
    assert env["HF_HUB_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == env["HF_DATASETS_OFFLINE"] == "1"
    assert env["RAY_AUTH_MODE"] == "token"


def test_node_ip_is_the_interface_that_routes_to_the_head():
    """The worker's ``ray start --node-ip-address``: on a multi-NIC node Ray's own guess may be an interface the
    head cannot reach; the source address of a route to the head is one it can."""
    from envace.launch import node_ip

    assert node_ip("127.0.0.1") == "127.0.0.1"
    out = subprocess.run([sys.executable, "-m", "envace.launch", "node-ip", "--head", "127.0.0.1"], cwd=REPO,
                         capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "127.0.0.1"


def test_train_sh_expands_no_possibly_empty_array_under_set_u():
    """bash < 4.4 (e.g. CentOS 7's 4.2) treats ``"${EMPTY[@]}"`` as an unbound variable under ``set -u``, and
    train.sh stopped there when RAY_NUM_CPUS was unset. No bash < 4.4 is installable here, so this reads the
    script: it expands no array at all (optional flags use ``${VAR:+"--flag=$VAR"}``, which every bash accepts)."""
    text = (REPO / "scripts" / "train.sh").read_text()
    assert "set -euo pipefail" in text
    code = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    assert not [ln for ln in code if "[@]" in ln or "[*]" in ln or "=(" in ln]
    assert '${RAY_NUM_CPUS:+"--num-cpus=$RAY_NUM_CPUS"}' in text


def test_the_head_stops_waiting_for_nodes_when_its_own_ray_start_has_exited(capsys):
    """A head whose ``ray start`` died (under load Ray's raylet can abort while its dashboard agent starts) used to
    wait RAY_JOIN_TIMEOUT (600 s) for a cluster that could never form; now it stops at once and says why."""
    from envace.launch import wait_nodes

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    started = time.monotonic()
    assert wait_nodes(2, timeout=300, poll=0.2, address=f"127.0.0.1:{_free_port()}", node_pid=dead.pid) == 1
    assert time.monotonic() - started < 30
    assert f"Ray (ray start, pid {dead.pid}) exited before the cluster" in capsys.readouterr().err


# -- the environment variables scripts/train.sh reads, checked before scripts/bootstrap.sh installs anything ---------
#: a multi-node head's environment; ENVACE_PLATFORM=bogus makes scripts/bootstrap.sh stop at its first line (exit 2,
#: its own message) and ENVACE_VENV names a folder it would create: a check that ran after bootstrap started, or a
#: variable let through, shows as that message instead of train.sh's own line
HEAD = {"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "RAY_AUTH_MODE": "disabled",
        "ENVACE_PLATFORM": "bogus"}
BOOTSTRAP_REACHED = "envace: ENVACE_PLATFORM must be cpu, gpu or auto (got 'bogus')"


def _train_sh_env(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "ENVACE_")) and k not in (
        "NNODES", "NODE_RANK", "MASTER_ADDR", "GPUS_PER_NODE")}
    full.update(ENVACE_VENV=str(tmp_path / "venv"), **env)
    return subprocess.run([str(REPO / "scripts" / "train.sh"), "trainer.total_training_steps=1"], cwd=REPO, env=full,
                          capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize(("env", "variable"), [
    # issue 43: `2h` stopped only the watcher, `nan` disabled the deadline, a negative one stopped the run at once
    ({"ENVACE_STEP_DEADLINE": "2h"}, "ENVACE_STEP_DEADLINE='2h'"),
    ({"ENVACE_STEP_DEADLINE": "nan"}, "ENVACE_STEP_DEADLINE='nan'"),
    ({"ENVACE_STEP_DEADLINE": "-60"}, "ENVACE_STEP_DEADLINE='-60'"),
    ({"ENVACE_STEP_DEADLINE": "inf"}, "ENVACE_STEP_DEADLINE='inf'"),
    ({"ENVACE_STARTUP_DEADLINE": "3h"}, "ENVACE_STARTUP_DEADLINE='3h'"),
    ({"ENVACE_STARTUP_DEADLINE": "nan"}, "ENVACE_STARTUP_DEADLINE='nan'"),
    ({"ENVACE_STARTUP_DEADLINE": "-1"}, "ENVACE_STARTUP_DEADLINE='-1'"),
    ({"ENVACE_STARTUP_DEADLINE": "1e4"}, "ENVACE_STARTUP_DEADLINE='1e4'"),
    ({"NNODES": "two"}, "NNODES='two'"),
    ({"NNODES": "0"}, "NNODES='0'"),
    ({"NODE_RANK": "2"}, "NODE_RANK='2' must be a whole number from 0 to 1"),
    ({"NODE_RANK": "-1"}, "NODE_RANK='-1'"),
    ({"RAY_PORT": "70000"}, "RAY_PORT='70000'"),
    ({"RAY_PORT": "63 79"}, "RAY_PORT='63 79'"),
    ({"RAY_JOIN_TIMEOUT": "10m"}, "RAY_JOIN_TIMEOUT='10m'"),
    ({"RAY_WAIT_NODES_TIMEOUT": "1.5"}, "RAY_WAIT_NODES_TIMEOUT='1.5'"),
    ({"GPUS_PER_NODE": "-1"}, "GPUS_PER_NODE='-1'"),
    ({"GPUS_PER_NODE": "auto"}, "GPUS_PER_NODE='auto'"),
    ({"RAY_NUM_CPUS": "1e3"}, "RAY_NUM_CPUS='1e3'"),
    ({"RAY_AUTH_MODE": "disable"}, "RAY_AUTH_MODE='disable'"),
    ({"RAY_AUTH_MODE": "", "MASTER_ADDR": ""}, "MASTER_ADDR"),
    ({"RAY_AUTH_MODE": ""}, "needs token authentication"),
])
def test_a_bad_variable_is_one_line_before_bootstrap(tmp_path, env, variable):
    proc = _train_sh_env(tmp_path, **{**HEAD, **env})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [proc.stderr.strip()] and proc.stderr.startswith("scripts/train.sh: error: ")
    assert variable in proc.stderr and proc.stdout == ""
    assert not (tmp_path / "venv").exists()


@pytest.mark.parametrize("env", [
    {},
    {"ENVACE_STEP_DEADLINE": "0", "NODE_RANK": "1", "RAY_PORT": "6380", "RAY_JOIN_TIMEOUT": "0", "GPUS_PER_NODE": "8",
     "RAY_NUM_CPUS": "0"},
    {"ENVACE_STEP_DEADLINE": "0.5", "NODE_RANK": "01", "RAY_WAIT_NODES_TIMEOUT": "30", "RAY_AUTH_MODE": "token",
     "RAY_AUTH_TOKEN": "t" * 32},
    {"ENVACE_STARTUP_DEADLINE": "0", "ENVACE_STEP_DEADLINE": "600"},
    {"ENVACE_STARTUP_DEADLINE": "21600.5"},
    {"NNODES": "1", "NODE_RANK": "7", "ENVACE_STEP_DEADLINE": "2h", "ENVACE_STARTUP_DEADLINE": "3h"},  # one node reads none
    {"NODE_RANK": "1", "GPUS_PER_NODE": "0"},  # a CPU-only worker node (the head's pre-flight checks its own count)
])
def test_good_variables_reach_bootstrap(tmp_path, env):
    proc = _train_sh_env(tmp_path, **{**HEAD, **env})
    assert proc.returncode == 2 and proc.stderr.strip() == BOOTSTRAP_REACHED, proc.stderr


def test_help_on_a_multinode_head_starts_nothing(tmp_path):
    """Old behaviour: ``--help`` reached the trainer only after the head had started Ray and its workers joined."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update({k: v for k, v in HEAD.items() if k not in ("ENVACE_PLATFORM", "RAY_AUTH_MODE")},
               RAY_PORT=str(_free_port()), RAY_AUTH_TOKEN_PATH=str(tmp_path / "token"))
    proc = subprocess.run([str(REPO / "scripts" / "train.sh"), "--help"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0 and "usage: scripts/train.sh" in proc.stdout, proc.stderr
    assert "Ray head" not in proc.stdout and not (tmp_path / "token").exists()


@pytest.mark.parametrize(("variable", "default"), [("ENVACE_STEP_DEADLINE", "7200"),
                                                  ("ENVACE_STARTUP_DEADLINE", "10800")])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(st.text(alphabet="0123456789.-+eEinfatxhms ", max_size=8), st.floats().map(str),
                 st.integers(-10, 10**12).map(str)))
def test_a_deadline_train_sh_accepts_is_a_finite_number_of_seconds(tmp_path, variable, default, text):
    """Whatever the text, train.sh refuses it with its one line, or the watcher gets a finite number >= 0 (empty:
    the default)."""
    proc = _train_sh_env(tmp_path, **HEAD, **{variable: text})
    if proc.stderr.strip() == BOOTSTRAP_REACHED:
        value = float(text or default)
        assert math.isfinite(value) and value >= 0
    else:
        assert proc.stderr.startswith(f"scripts/train.sh: error: {variable}=") and proc.returncode == 2


@pytest.mark.parametrize("argv", [
    ["watch", "--pid", "1", "--address", "h:1", "--log", "x", "--step-deadline", "nan"],
    ["watch", "--pid", "1", "--address", "h:1", "--log", "x", "--step-deadline", "-1"],
    ["watch", "--pid", "1", "--address", "h:1", "--log", "x", "--step-deadline", "2h"],
    ["watch", "--pid", "1", "--address", "h:1", "--log", "x", "--startup-deadline", "nan"],
    ["watch", "--pid", "1", "--address", "h:1", "--log", "x", "--startup-deadline", "-10800"],
    ["wait-nodes", "--nodes", "0"],
    ["wait-head", "--address", "h:1", "--timeout", "inf"],
])
def test_launch_refuses_a_bad_number_in_one_line(argv, capsys):
    """A direct call of the helpers train.sh runs: numbers are range-checked as they are parsed (the old watcher read
    ``--step-deadline nan`` as no deadline and ``-1`` as an expired one)."""
    from envace.launch import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith(f"python -m envace.launch {argv[0]}: error: argument --") and argv[-2] in err


# -- shared storage: the head's marker folders and a node's probe ------------------------------------------------------
def test_the_marker_folders_are_removed_with_what_the_check_created_when_it_is_refused_or_passes(tmp_path):
    """The shared-storage check's folder probe (``envace.launch._markers``): a folder not there yet is created for
    its marker, its missing parents with it; a refused check (an error inside) and a passed one both end with the
    markers and every folder it created removed, an existing folder keeping what it held. A folder made here that
    something else wrote into meanwhile (a build) is kept with that. Old behaviour: one marker, in the run
    directory, which the check created and left behind."""
    from envace.config import ConfigError
    from envace.launch import MARKER_PREFIX, _markers

    run = tmp_path / "run"
    run.mkdir()
    (run / "global_step_4").mkdir()
    models = tmp_path / "home" / ".cache" / "envace" / "models"  # no home yet
    out = tmp_path / "out"
    folders = {"trainer.default_local_dir": run, "actor_rollout_ref.model.path (under ENVACE_CACHE)": models,
               "envace.data.out_dir": out, "the run directory again": run}
    token = "f" * 32
    with pytest.raises(ConfigError, match="refused"), _markers(folders, token) as markers:
        assert set(markers) == set(folders)
        for name, marker in markers.items():
            assert Path(marker).parent == folders[name] and Path(marker).name.startswith(MARKER_PREFIX)
            assert Path(marker).read_text() == token
        raise ConfigError("refused")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert [p.name for p in run.iterdir()] == ["global_step_4"]

    with _markers(folders, token):
        (out / "train.parquet").write_text("")
    assert [p.name for p in out.iterdir()] == ["train.parquet"] and not (tmp_path / "home").exists()
    assert [p.name for p in run.iterdir()] == ["global_step_4"]


def test_a_marker_folder_the_head_cannot_write_is_one_line_naming_its_key(tmp_path):
    """Root writes through permissions, so the folder lies under a file: ``mkdir`` fails on every account."""
    from envace.config import ConfigError
    from envace.launch import _markers

    run, blocker = tmp_path / "run", tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ConfigError) as refused, _markers({"trainer.default_local_dir": run,
                                                          "envace.data.out_dir": blocker / "data"}, "f" * 32):
        pytest.fail("the markers were written")
    assert str(refused.value) == (f"envace.data.out_dir: cannot write into {blocker / 'data'} on the head "
                                  "(Not a directory)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # the run directory made for it is gone again


def test_a_node_probe_names_each_marker_it_cannot_read_and_each_missing_path_by_its_key(tmp_path, monkeypatch):
    import ray

    from envace.launch import _probe_node

    class Context:
        def get_node_id(self) -> str:
            return "b" * 28

    monkeypatch.setattr(ray, "get_runtime_context", Context)
    seen, other = tmp_path / "seen", tmp_path / "other"
    seen.write_text("t")
    other.write_text("another run's token")
    out = _probe_node({"trainer.default_local_dir": str(seen), "envace.data.out_dir": str(other),
                       "actor_rollout_ref.model.path (under ENVACE_CACHE)": str(tmp_path / "hidden" / "m")}, "t",
                      {"data.train_files[0]": str(tmp_path / "x.parquet"), "envace.agent.worldbook": str(seen)})
    assert out["node_id"] == "b" * 28 and out["problems"] == [
        f"envace.data.out_dir: the marker {other} has other content (another run, or a different file system)",
        (f"actor_rollout_ref.model.path (under ENVACE_CACHE): cannot read {tmp_path / 'hidden' / 'm'} (No such "
         "file or directory)"),
        f"data.train_files[0] {tmp_path / 'x.parquet'} does not exist",
    ]


# -- the head's watcher: the start-up and step deadlines, on a simulated clock ---------------------------------------
HEAD_NODE = {"NodeID": "a" * 28, "Alive": True, "NodeManagerAddress": "10.0.0.1",
             "Resources": {"node:__internal_head__": 1.0}}
WORKER_NODE = {"NodeID": "b" * 28, "Alive": True, "NodeManagerAddress": "10.0.0.2", "Resources": {}}


def _metrics(step: int, *keys: str) -> str:
    """A line of verl's console logger (``verl.utils.logger.aggregate_logger.concat_dict_to_str``)."""
    return " - ".join([f"step:{step}", *(f"{k}:0.25" for k in keys or ("actor/pg_loss", "timing_s/step"))])


def _watch(tmp_path: Path, lines: dict[float, str], *, startup: float, step: float, ends_at: float | None = None,
           lost_at: float | None = None, poll: float = 30.0) -> tuple[int, float, int | None]:
    """:func:`envace.launch.watch` on a stand-in training driver: a real process (the pid the watcher checks and
    signals), a console log that receives ``lines`` ({simulated second: line}) as the simulated clock passes them, and
    a two-node cluster whose worker is lost at ``lost_at``. The driver ends by itself at ``ends_at``. Returns the
    watcher's status, the simulated second it returned at, and the driver's exit status (-15: the watcher's SIGTERM;
    None: it ended by itself)."""
    from envace.launch import watch

    log = tmp_path / "driver.log"
    log.write_text("")
    driver = subprocess.Popen(["sleep", "600"])
    now = 0.0
    pending = sorted(lines.items())
    ended = False

    def sleep(seconds: float) -> None:
        nonlocal now, ended
        now += seconds
        with open(log, "a") as fh:
            while pending and pending[0][0] <= now:
                fh.write(pending.pop(0)[1] + "\n")
        if ends_at is not None and now >= ends_at and not ended:
            driver.kill()
            driver.wait()
            ended = True

    def nodes() -> list[dict]:
        return [HEAD_NODE, {**WORKER_NODE, "Alive": lost_at is None or now < lost_at}]

    try:
        status = watch(driver.pid, "unused:1", log, str(tmp_path / "run"), step, startup_deadline=startup, poll=poll,
                       grace=10, nodes=nodes, clock=lambda: now, sleep=sleep)
        return status, now, None if ended else driver.wait(timeout=30)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()


@pytest.mark.parametrize("first", [
    _metrics(0, "val-core/bfcl_multi_turn/reward/mean@1", "val-aux/num_turns/mean"),  # validation before training
    _metrics(10, "val-core/bfcl_multi_turn/reward/mean@1"),  # the same, resuming from global_step_10
    _metrics(1),  # trainer.val_before_train=false: start-up ends with the first step
], ids=["validation", "validation-on-resume", "no-validation"])
def test_a_start_up_longer_than_a_step_but_within_its_own_deadline_does_not_stop_the_run(tmp_path, capsys, first):
    """Issue 44: ENVACE_STEP_DEADLINE (7,200 s) timed start-up too, so a healthy 8B run on H20 that took longer than a
    step to load, start vLLM and validate was stopped before its first step. Start-up here takes 9,000 s; the steps
    after it take 3,000 s each."""
    n = int(first.split(" - ")[0].removeprefix("step:"))
    lines = {600.0: "INFO Capturing CUDA graphs (decode, FULL): 100%", 8990.0: "Initial validation metrics: {...}",
             9000.0: first, 12000.0: _metrics(n + 1), 15000.0: _metrics(n + 2)}
    status, _, driver = _watch(tmp_path, lines, startup=10800, step=7200, ends_at=16000)
    out, err = capsys.readouterr()
    assert (status, driver, err) == (0, None, "")
    assert ("start-up deadline 10800s (ENVACE_STARTUP_DEADLINE), step deadline 7200s (ENVACE_STEP_DEADLINE)"
            in out)


def test_a_start_up_past_its_deadline_stops_the_run_naming_it(tmp_path, capsys):
    """Log lines that are not step lines (vLLM starting) do not end start-up; past ENVACE_STARTUP_DEADLINE the
    watcher stops the driver and names that variable, not the step deadline."""
    status, at, driver = _watch(tmp_path, {600.0: "INFO Capturing CUDA graphs", 4000.0: "Initial validation (1/160)"},
                                startup=10800, step=7200)
    err = capsys.readouterr().err
    assert (status, driver) == (3, -signal.SIGTERM) and 10800 < at <= 10800 + 30
    assert err.splitlines() == [err.strip()]
    assert ("envace: start-up did not finish within 10800s (no step line yet: loading the model, starting the "
            "rollout engine or validating before training; ENVACE_STARTUP_DEADLINE): stopping the run. Last "
            f"checkpoint: none yet in {tmp_path / 'run'}") in err
    assert "ENVACE_STEP_DEADLINE" not in err


def test_a_step_past_the_step_deadline_after_start_up_stops_the_run_naming_it(tmp_path, capsys):
    lines = {5010.0: _metrics(0, "val-core/x"), 8010.0: _metrics(1)}  # at polls (every 30 s): read when written
    status, at, driver = _watch(tmp_path, lines, startup=10800, step=7200)
    err = capsys.readouterr().err
    assert (status, driver) == (3, -signal.SIGTERM) and 8010 + 7200 < at <= 8010 + 7200 + 30
    assert "envace: no training step finished within 7200s (during step 2; ENVACE_STEP_DEADLINE): stopping" in err
    assert "ENVACE_STARTUP_DEADLINE" not in err


def test_deadlines_of_0_are_off(tmp_path, capsys):
    lines = {50000.0: _metrics(0, "val-core/x"), 90000.0: _metrics(1)}
    status, _, driver = _watch(tmp_path, lines, startup=0, step=0, ends_at=100000, poll=600)
    out, err = capsys.readouterr()
    assert (status, driver, err) == (0, None, "")
    assert "start-up deadline none (ENVACE_STARTUP_DEADLINE), step deadline none (ENVACE_STEP_DEADLINE)" in out


def test_a_node_lost_during_start_up_stops_the_run_at_once(tmp_path, capsys):
    status, at, driver = _watch(tmp_path, {}, startup=10800, step=7200, lost_at=1000)
    err = capsys.readouterr().err
    assert (status, driver) == (3, -signal.SIGTERM) and 1000 <= at <= 1030
    assert ("envace: lost Ray worker node 10.0.0.2 (node id bbbbbbbbbbbb) before the first step finished: stopping "
            "the run") in err


# -- build tools: what Triton compiles its launcher with ---------------------------------------------------------------
#: a C compiler that builds whatever it is given (writes its -o file)
CC_OK = '#!/bin/sh\nwhile [ $# -gt 0 ]; do if [ "$1" = -o ]; then : > "$2"; fi; shift; done\n'
#: gcc installed without the C library's headers (Debian's gcc without its recommended libc6-dev)
CC_NO_LIBC = ('#!/bin/sh\necho "In file included from $1:1:" >&2\n'
              'echo "/usr/include/python3.11/Python.h:23:10: fatal error: stdlib.h: No such file or directory" >&2\n'
              'echo "compilation terminated." >&2\nexit 1\n')


def _bin(tmp_path: Path, **programs: str) -> str:
    """A PATH of one folder holding ``programs`` ({name: shell script})."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    for name, text in programs.items():
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    return str(bindir)


def _include(tmp_path: Path, python_h: str | None = "") -> str:
    inc = tmp_path / "include"
    inc.mkdir(exist_ok=True)
    if python_h is not None:
        (inc / "Python.h").write_text(python_h)
    return str(inc)


@pytest.mark.parametrize(("programs", "cc", "expected"), [
    (("gcc", "clang", "cc"), None, "gcc"),  # gcc before clang; a bare `cc` is not looked for
    (("clang", "cc"), None, "clang"),
    (("gcc", "clang"), "clang", "clang"),  # $CC wins
    (("gcc",), "ccache gcc", None),  # one program name, as Triton runs it
    (("gcc",), "", None),
    (("gcc",), "/nonexistent/gcc", None),
    (("cc",), None, None),
])
def test_the_c_compiler_is_found_as_triton_finds_it(tmp_path, monkeypatch, programs, cc, expected):
    from envace.launch import find_c_compiler

    path = _bin(tmp_path, **dict.fromkeys(programs, CC_OK))
    env = {"PATH": path} if cc is None else {"PATH": path, "CC": cc}
    name, found = find_c_compiler(env)
    assert found == (None if expected is None else str(Path(path) / expected))
    assert name == (cc if cc is not None else expected)
    # against Triton's own lookup, where the installed Triton has it as a function (3.9: _find_compiler)
    build = pytest.importorskip("triton.runtime.build")
    if not hasattr(build, "_find_compiler"):
        return
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", path)
    if cc is not None:
        monkeypatch.setenv("CC", cc)
    if name is None:
        with pytest.raises(RuntimeError, match="Failed to find C compiler"):
            build._find_compiler.__wrapped__("c")
    else:
        assert build._find_compiler.__wrapped__("c") in (name, found)


def test_build_tools_problem_names_what_to_install(tmp_path):
    from envace.launch import build_tools_problem

    empty = str(tmp_path / "nothing")
    os.mkdir(empty)
    with_python_h = _include(tmp_path)
    no_cc = build_tools_problem({"PATH": empty}, with_python_h)
    assert no_cc.startswith("no C compiler on PATH (gcc or clang, or $CC): Triton")
    assert "apt-get install build-essential (Debian/Ubuntu) or dnf install gcc glibc-devel (RHEL/Fedora)" in no_cc

    bad_cc = build_tools_problem({"PATH": _bin(tmp_path, gcc=CC_OK), "CC": "ccache gcc"}, with_python_h)
    assert bad_cc.startswith("CC='ccache gcc' is not an executable on PATH")

    no_headers = build_tools_problem({"PATH": _bin(tmp_path, gcc=CC_OK)}, str(tmp_path))
    assert no_headers.startswith(f"no Python headers ({tmp_path}/Python.h) for Python {sys.version_info[0]}.")

    no_libc = build_tools_problem({"PATH": _bin(tmp_path, gcc=CC_NO_LIBC)}, with_python_h)
    assert "(/usr/include/python3.11/Python.h:23:10: fatal error: stdlib.h: No such file or directory)" in no_libc
    assert no_libc.startswith(f"the C compiler {tmp_path}/bin/gcc cannot build a Python extension")
    assert "build-essential" in no_libc and "envace-cc-" not in no_libc

    assert build_tools_problem({"PATH": _bin(tmp_path, gcc=CC_OK)}, with_python_h) is None
    for problem in (no_cc, bad_cc, no_headers, no_libc):
        assert "\n" not in problem


@pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("clang") is None, reason="no C compiler here")
def test_the_probe_builds_with_the_real_compiler_and_headers(tmp_path):
    """This machine's own compiler and this interpreter's headers, as Triton uses them; and the same compiler on
    headers it cannot build (a missing system header, as without libc6-dev), named from its own error."""
    from envace.launch import build_tools_problem, python_include_dir

    if not (Path(python_include_dir()) / "Python.h").is_file():
        pytest.skip("this interpreter has no headers")
    assert build_tools_problem(dict(os.environ)) is None
    broken = _include(tmp_path, "#include <envace_no_such_header.h>\n")
    problem = build_tools_problem(dict(os.environ), broken)
    assert problem is not None and "envace_no_such_header.h" in problem and "build-essential" in problem


@pytest.mark.parametrize(("prefix", "expected", "absent"), [
    ("/usr", "apt-get install python3.11-dev (Debian/Ubuntu) or dnf install python3.11-devel (RHEL/Fedora)", "pyenv"),
    ("/root/.pyenv/versions/3.11.7", "install them with the interpreter, so this one at /root/.pyenv/versions/3.11.7",
     "-dev"),
    ("/opt/conda", "uv python install 3.11, pyenv install 3.11", "-dev"),
])
def test_the_headers_fix_fits_where_the_interpreter_came_from(prefix, expected, absent):
    from envace.launch import python_headers_fix

    fix = python_headers_fix(prefix, (3, 11))
    assert expected in fix and absent not in fix


def test_build_check_stops_a_cuda_node_without_a_compiler_and_lets_a_cpu_node_pass(tmp_path, monkeypatch, capsys):
    """The pre-flight train.sh runs on every node: a node whose torch is a CUDA build and whose nvidia-smi lists a GPU
    must have the build tools; a CPU node (the CPU platform compiles nothing), or a CUDA torch without a GPU, need not."""
    from envace import launch

    smi = "#!/bin/sh\necho 'GPU 0: NVIDIA H20 (UUID: GPU-aaaa0000-0000-0000-0000-000000000000)'\n"
    monkeypatch.setenv("PATH", _bin(tmp_path, **{"nvidia-smi": smi}))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(launch, "torch_cuda_version", lambda: ("2.11.0+cu130", "13.0"))
    assert launch.main(["build-check"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [err.strip()]
    assert err.startswith("envace: no C compiler on PATH") and err.strip().endswith("(docs/gpu.md#build-tools)")

    monkeypatch.setattr(launch, "torch_cuda_version", lambda: ("2.13.0+cpu", None))
    assert launch.main(["build-check"]) == 0
    monkeypatch.setattr(launch, "torch_cuda_version", lambda: ("2.11.0+cu130", "13.0"))
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))  # no nvidia-smi: no GPU
    assert launch.main(["build-check"]) == 0
    assert capsys.readouterr().err == ""


def test_the_heads_auth_token_is_written_once_owner_only(tmp_path, capsys):
    """``auth-token``, train.sh's head and gpu_smoke.sh --nodes: a new token, mode 600, in a folder made for it; a
    token already there (a relaunch, or the workers' copy of it) is kept."""
    from envace.launch import main, write_auth_token

    path = tmp_path / "shared" / "ray_token"
    assert main(["auth-token", str(path)]) == 0
    token = path.read_text()
    assert len(token.strip()) == 64 and path.stat().st_mode & 0o777 == 0o600
    assert capsys.readouterr().out.strip() == f"envace: wrote a new Ray auth token to {path} (mode 600)"
    assert write_auth_token(path) is False and path.read_text() == token
    assert not list(path.parent.glob("*.tmp"))
