"""The multi-node path of scripts/train.sh, for real on one machine.

Two Ray nodes on loopback (a head and a worker, two raylets), NNODES=2 with one CPU-platform device
slot per node, training across both nodes (FSDP over gloo, one rank per node); one run carries all the checks of a
real two-node training, so the suite starts such a cluster only for it and its relaunch. The steps' tool
calls are answered by the Trace2Env simulator (``observation_source=simulator`` over worldbooks built
model-free from the synthetic pool's gold traces by ``scripts/build_worldbook.sh``), so the same run is the
end-to-end training test of the simulator as an observation source (issue 9). The cluster is
token-authenticated (the head writes the token to RAY_AUTH_TOKEN_PATH, the worker reads it), an unrelated
Ray cluster on the same machine survives the run (train.sh stops only what it started), and a worker node
that cannot see the run directory stops the run before training, named in the error. The head and the worker have
a home directory each, and the worker's mount namespace hides the head's (a cluster whose nodes do not share $HOME):
a user who sets only a shared run directory and model trains, the data the head generates going into the run
directory, and one who leaves a path in the head's home is told which key or variable moves it. A worker joins on its route
to the head and ends with 0 when the head closes the cluster; the head's watcher stops a run on a lost node or a
step past its deadline; and a worker node killed mid-step stops a real run (exit 3, the node and the last
checkpoint named), whose relaunch resumes from that checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# every test here starts Ray clusters whose timeouts are tight (1 s health checks, a 10 s reconnect): beside a
# trainer run a head's start-up outlasted them, so they run one at a time with the other heavy tests
pytestmark = [pytest.mark.slow, pytest.mark.heavy]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _ray_processes(port: int) -> list[int]:
    """Ray processes of the cluster whose GCS listens on ``port`` (their command lines name it)."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info.get("cmdline") or [])
        if re.search(rf"(gcs_server_port=|127\.0\.0\.1:){port}\b", cmd) and "pytest" not in cmd:
            found.append(p.info["pid"])
    return found


class Lines:
    """Collects a process's output in a thread; ``wait_for`` blocks until a pattern shows up. Once the process
    has ended, ``text`` first lets the thread read what is still in the pipe (its last lines, e.g. the line a run
    stops with, can arrive after ``wait()`` returns); a pipe some leftover child holds open ends that wait after
    30 s."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc, self.lines, self.cond = proc, [], threading.Condition()
        self.pump = threading.Thread(target=self._pump, daemon=True)
        self.pump.start()
        self.drain_deadline: float | None = None

    def _pump(self) -> None:
        for line in self.proc.stdout:
            with self.cond:
                self.lines.append(line)
                self.cond.notify_all()

    def _drain(self) -> None:
        if self.proc.poll() is None:
            return
        if self.drain_deadline is None:
            self.drain_deadline = time.monotonic() + 30
        self.pump.join(timeout=max(0.0, self.drain_deadline - time.monotonic()))

    @property
    def text(self) -> str:
        self._drain()
        with self.cond:
            return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not re.search(pattern, "".join(self.lines)):
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    break
                self.cond.wait(min(left, 1.0))
            else:
                return True
        return bool(re.search(pattern, self.text))


def _env(port: int, token_path: Path) -> dict[str, str]:
    # both "nodes" share this machine's cores: one torch thread per trainer rank, as on two real nodes each would
    # size its pool to its own CPUs (envace.platform.engine.trainer_threads)
    env = dict(os.environ, NNODES="2", MASTER_ADDR="127.0.0.1", RAY_PORT=str(port), RAY_NUM_CPUS="16",
               GPUS_PER_NODE="1", RAY_DEDUP_LOGS="0", RAY_AUTH_TOKEN_PATH=str(token_path), ENVACE_TRAINER_THREADS="1")
    for key in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_MODE"):
        env.pop(key, None)
    return env


def _separate_homes(env: dict[str, str], root: Path) -> tuple[dict[str, str], dict[str, str], Path]:
    """The head's and the worker's environments with a home directory each under ``root`` and no ``ENVACE_CACHE``
    (a cluster whose nodes do not share $HOME, and a user who did not set it); returns both and the head's home."""
    homes = {rank: root / f"home{rank}" for rank in (0, 1)}
    for home in homes.values():
        home.mkdir(parents=True)
    head, worker = ({**{k: v for k, v in env.items() if k != "ENVACE_CACHE"}, "NODE_RANK": str(rank),
                     "HOME": str(homes[rank])} for rank in (0, 1))
    return head, worker, homes[0]


def _mount_namespaces() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-m", "--propagation", "private", "true"], capture_output=True, check=False).returncode == 0


def _without(hidden: list[Path], command: list[str]) -> list[str]:
    """``command`` in a mount namespace of its own in which each folder of ``hidden`` is an empty tmpfs: a node
    that does not share those folders with the head."""
    mounts = " && ".join(f"mount -t tmpfs none {shlex.quote(str(p))}" for p in hidden)
    return ["unshare", "-m", "--propagation", "private", "bash", "-c", f"{mounts} && exec {shlex.join(command)}"]


def _wait_for_port(proc: subprocess.Popen, port: int, timeout: float = 180) -> None:
    """Wait until the Ray head ``proc`` started listens on ``port`` (its GCS)."""
    deadline = time.monotonic() + timeout
    while not _port_open(port):
        assert proc.poll() is None and time.monotonic() < deadline, f"the Ray head on port {port} did not start"
        time.sleep(0.5)


def _ray_processes_gone(port: int, timeout: float = 60) -> list[int]:
    """Wait up to ``timeout`` s for the Ray processes of the cluster on ``port`` to exit; those still running."""
    deadline = time.monotonic() + timeout
    while _ray_processes(port) and time.monotonic() < deadline:
        time.sleep(1)
    return _ray_processes(port)


def _stop(proc: subprocess.Popen | None, timeout: float = 120) -> None:
    """SIGTERM a train.sh (its trap stops its own Ray node), SIGKILL if it does not end."""
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


@pytest.fixture
def bystander():
    """An unrelated Ray cluster on this machine (someone else's), which no envace run may stop."""
    port = _free_port()
    tmp = Path(tempfile.mkdtemp(prefix="rb", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    env["RAY_AUTH_MODE"] = "disabled"
    proc = subprocess.Popen([sys.executable, "-m", "ray.scripts.scripts", "start", "--head", f"--port={port}",
                             "--num-cpus=1", "--num-gpus=0", f"--temp-dir={tmp}", "--disable-usage-stats",
                             "--include-dashboard=false", "--block"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 180
    while not _port_open(port):
        assert proc.poll() is None and time.monotonic() < deadline, "the bystander Ray cluster did not start"
        time.sleep(1)
    yield proc, port
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # `ray start --block` stops its own processes
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    shutil.rmtree(tmp, ignore_errors=True)


#: environments of the default run's synthetic pool the two-node run keeps (its first two)
SIM_ENVS = 2


@pytest.fixture(scope="module")
def worldbooks(tmp_path_factory) -> Path:
    """One worldbook per environment of the default run's synthetic pool (configs/experiment/cpu_default.yaml) cut
    to ``SIM_ENVS`` environments, built model-free from gold traces of its train split."""
    from omegaconf import OmegaConf

    from envace.verl.config import compose

    pool_kwargs = OmegaConf.to_container(compose(["experiment=cpu_default"]).envace.agent.pool_kwargs.synthetic)
    out = tmp_path_factory.mktemp("worldbooks")
    proc = subprocess.run([str(REPO / "scripts" / "build_worldbook.sh"), "--pool", "synthetic", "--out", str(out),
                           "--pool-kwargs", json.dumps({**pool_kwargs, "n_envs": SIM_ENVS})], cwd=REPO,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    books = out / "books"
    assert len([d for d in books.iterdir() if (d / "manifest.json").is_file()]) == SIM_ENVS
    return books


@pytest.mark.warm_start
def test_two_ray_nodes_train_through_a_lost_worker_and_the_relaunch_resumes(tmp_path, bystander, worldbooks):
    """One two-node run of train.sh carries every check of a real multi-node training, so that the suite pays for
    one cluster start-up, not two.

    Step 1 across both nodes: the nodes have a home directory each, the head's hidden from the worker where mount
    namespaces allow, and the user sets no ENVACE_CACHE, only a shared run directory and model; the head builds the
    training data (``data.*_files: auto``) into the run directory, never into its home. The cluster is
    token-authenticated and an unrelated Ray cluster on the machine survives. The step's tool calls are answered by
    the Trace2Env simulator and compared with the real environment's responses.

    Then the worker node is killed mid-step 2, every process of it at once, as if it lost power. The head's watcher
    stops the run: exit 3 and one line naming the worker node and the step-1 checkpoint (old behaviour: verl waited
    on the lost node's actors without a deadline). The same commands relaunched resume from it and finish step 2;
    the worker ends with 0 once its head closes the cluster. The head declares a silent node dead after 3 missed
    1 s health checks here (Ray's default, 5 x 3 s, only takes longer)."""
    import psutil

    from envace.models.warmstart import ensure_warm_model

    bystander_proc, bystander_port = bystander
    token = tmp_path / "shared" / "ray_token"
    run = tmp_path / "run"
    ports: list[int] = []
    head_env, worker_env, head_home = _separate_homes(_env(0, token), tmp_path)
    args = [
        # the warm-started tiny Qwen3 (it emits tool calls) on the synthetic pool, its calls answered by the
        # Trace2Env simulator; the reward still comes from the real environment's replay (the shadow)
        "experiment=cpu_default",
        # the session's build, on storage both nodes see (the ENVACE_CACHE of this process, not the head's)
        f"actor_rollout_ref.model.path={ensure_warm_model()}",
        "envace.agent.observation_source=simulator", f"envace.agent.worldbook={worldbooks}",
        f"+envace.agent.pool_kwargs.synthetic.n_envs={SIM_ENVS}",
        f"trainer.default_local_dir={run}", "trainer.save_freq=1", "trainer.test_freq=-1",
        "trainer.val_before_train=false", "actor_rollout_ref.rollout.n=2", "trainer.logger=[console]",
        # hfcpu, the CPU default (the servers' names below are its): each vLLM CPU engine binds its worker to a core
        # and reserves another for its engine process, and two of them on one 2-core machine were not tried;
        # tests/envace/learning/test_grpo_rolewise.py runs the vLLM rollout
        "actor_rollout_ref.rollout.name=hfcpu",
        # verl pads a step's rows to a multiple of ppo_mini_batch_size x n = 8, 4 per rank: micro-batches of 4
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        # recompute the old log-probs so verl reports the rollout-vs-trainer difference across the two nodes
        "algorithm.rollout_correction.bypass_mode=false",
    ]

    def launch(steps: int) -> tuple[subprocess.Popen, Lines, subprocess.Popen, Lines]:
        """The head and the worker node of one launch, on a fresh port; the worker starts while the head is still
        coming up (it waits for the head and its token)."""
        port = _free_port()
        ports.append(port)
        health = {"RAY_PORT": str(port), "RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3"}
        head = subprocess.Popen([str(REPO / "scripts" / "train.sh"), *args, f"trainer.total_training_steps={steps}"],
                                cwd=REPO, env={**head_env, **health}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        worker_cmd = [str(REPO / "scripts" / "train.sh")]
        worker = subprocess.Popen(_without([head_home], worker_cmd) if _mount_namespaces() else worker_cmd,
                                  cwd=REPO, env={**worker_env, **health}, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, start_new_session=True)
        return head, Lines(head), worker, Lines(worker)

    head, out, worker, _ = launch(3)
    try:
        assert out.wait_for(r"Ray cluster has 2/2 nodes", 600), out.text[-4000:]
        assert stat.S_IMODE(token.stat().st_mode) == 0o600
        # the cluster is authenticated: a client with another token is turned away
        intruder = subprocess.run(
            [sys.executable, "-c", f"import ray; ray.init(address='127.0.0.1:{ports[0]}', log_to_driver=False)"],
            env={**{k: v for k, v in head_env.items() if k != "RAY_AUTH_TOKEN_PATH"}, "RAY_AUTH_MODE": "token",
                 "RAY_AUTH_TOKEN": "0" * 64}, capture_output=True, text=True, timeout=300, check=False,
        )
        assert intruder.returncode != 0, intruder.stdout + intruder.stderr
        assert out.wait_for(r"\bstep:1 - ", 1200), out.text[-6000:]
        deadline = time.monotonic() + 120
        while not (run / "latest_checkpointed_iteration.txt").exists():
            assert time.monotonic() < deadline, "no checkpoint after step 1"
            time.sleep(1)
        time.sleep(3)  # into step 2
        node = psutil.Process(worker.pid)
        for proc in [*node.children(recursive=True), node]:
            proc.kill()
        head.wait(timeout=600)
    finally:
        _stop(head)
        _stop(worker)
    text = out.text
    step1 = next(line for line in text.splitlines() if re.search(r"\bstep:1 - ", line))
    assert "auth: token" in text and "wrote a new Ray auth token" in text
    assert "training/rollout_probs_diff_max" in step1
    # the simulator answered the step's tool calls, each compared with the real environment's response
    compared = re.search(r"envace/rehearsal_fidelity/compared:([\d.]+)", step1)
    assert compared and float(compared.group(1)) > 0, step1
    assert re.search(r"envace/rehearsal_fidelity/exact:[\d.]+", step1)
    # two FSDP ranks, one rollout replica each, placed on two different Ray nodes
    servers = re.findall(r"hfcpu://[^/\s']+/(\w+)/hfcpu_server_(\d+)_0", text)
    assert {rank for _, rank in servers} == {"0", "1"}, servers
    assert len({node for node, _ in servers}) == 2, servers
    # the lost node stops the run: the watcher stops the driver, or the driver has already failed on the lost
    # node's actors; one line either way
    assert head.returncode == 3, text[-6000:]
    stop = next(line for line in text.splitlines() if "Last checkpoint:" in line)
    assert "lost Ray worker node " in stop and "during step 2" in stop, stop
    assert f"Last checkpoint: {run / 'global_step_1'}; relaunch the same command" in stop

    head, out, worker, wout = launch(2)
    try:
        head.wait(timeout=1200)
        worker.wait(timeout=300)
    finally:
        _stop(head)
        _stop(worker)
    text = out.text
    assert head.returncode == 0, text[-6000:]
    assert f"Resuming from {run / 'global_step_1'}" in text and "step:2 - " in text
    assert "envace: training finished" in text
    assert worker.returncode == 0 and "has closed the cluster" in wout.text, wout.text[-3000:]
    # the data the head generated for both nodes is in the run directory, none in the head's home
    assert list(run.glob("data/*/train.parquet")) and list(run.glob("data/*/val.parquet")), text[-4000:]
    assert not (head_home / ".cache" / "envace" / "data").exists()
    # each launch stopped what it started, and only that
    assert [pid for port in ports for pid in _ray_processes_gone(port)] == []
    assert bystander_proc.poll() is None and _port_open(bystander_port), "train.sh stopped another Ray cluster"


def test_a_node_that_cannot_see_the_run_directory_or_the_heads_home_stops_the_run_before_training(tmp_path):
    """The worker node runs in its own mount namespace where the run directory and the head's home directory are
    empty tmpfs mounts. It cannot read the markers the head writes, before it builds anything, into the run
    directory (where it would build the data) and into the folder of its ``ENVACE_CACHE`` (unset: in its home) where
    it would build the ``builtin:`` model. The head stops before the builds with one line (exit 2) naming that node
    and, for each folder, what moves it, and leaves nothing behind: no data, no model, the run directory as it was,
    no cache in its home. Old behaviour: the same refusal came after the data build and the model's."""
    if not _mount_namespaces():
        pytest.skip("needs mount namespaces (unshare -m)")
    port = _free_port()
    run = tmp_path / "run"
    run.mkdir()
    head_env, worker_env, head_home = _separate_homes(_env(port, tmp_path / "ray_token"), tmp_path)
    head = subprocess.Popen(
        [str(REPO / "scripts" / "train.sh"), "experiment=cpu_bfcl", f"trainer.default_local_dir={run}",
         "trainer.total_training_steps=1",
         "trainer.logger=[console]"],
        cwd=REPO, env=head_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )
    out = Lines(head)
    worker = None
    try:
        worker = subprocess.Popen(_without([run, head_home], [str(REPO / "scripts" / "train.sh")]), cwd=REPO,
                                  env=worker_env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        head.wait(timeout=1200)
    finally:
        _stop(head)
        _stop(worker)
    text = out.text
    assert head.returncode == 2, text[-6000:]
    failure = next(line for line in text.splitlines() if "every node must see the run directory" in line)
    assert failure.startswith("envace: config error: "), failure
    assert "worker node " in failure and "head node" not in failure, failure
    assert f"trainer.default_local_dir: cannot read {run}/" in failure, failure
    models = head_home / ".cache" / "envace" / "models"
    assert f"actor_rollout_ref.model.path (under ENVACE_CACHE, unset: ~/.cache/envace): cannot read {models}/" \
        in failure, failure
    # refused before the builds (no parquet, no model), and what the check made for its markers is gone again
    assert "step:1 - " not in text
    assert list(run.iterdir()) == [], list(run.rglob("*"))
    assert not (head_home / ".cache" / "envace").exists(), list(head_home.rglob("*"))
    assert _ray_processes_gone(port) == []


def test_a_worker_joins_on_its_route_to_the_head_and_ends_with_0_when_the_head_closes_the_cluster(tmp_path):
    """A train.sh worker node (RAY_NUM_CPUS unset: no empty-array expansion) joins a head on 127.0.0.1 with
    ``--node-ip-address`` of its interface that routes there (old: no flag, Ray's own guess), and once the head has
    closed the cluster, as it does after a finished run, the worker ends with status 0 (old: its ``ray start``
    failed and the worker reported 1 after a successful run)."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_NUM_CPUS")}
    # the worker's raylet gives up on a vanished head after 10 s instead of Ray's 60
    env.update(RAY_AUTH_MODE="disabled", RAY_gcs_rpc_server_reconnect_timeout_s="10")
    head = subprocess.Popen([sys.executable, "-m", "ray.scripts.scripts", "start", "--head",
                             "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=1", "--num-gpus=0",
                             "--disable-usage-stats", "--include-dashboard=false", "--block"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    _wait_for_port(head, port)  # the clients below give up on a head that is not up within 10 s
    worker = subprocess.Popen([str(REPO / "scripts" / "train.sh")], cwd=REPO,
                              env=dict(env, NNODES="2", NODE_RANK="1", MASTER_ADDR="127.0.0.1", RAY_PORT=str(port),
                                       GPUS_PER_NODE="0"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out = Lines(worker)
    try:
        joined = subprocess.run([sys.executable, "-m", "envace.launch", "wait-nodes", "--address",
                                 f"127.0.0.1:{port}", "--nodes", "2", "--timeout", "300"], env=env, cwd=REPO,
                                capture_output=True, text=True, timeout=360, check=False)
        assert joined.returncode == 0, joined.stdout + joined.stderr + out.text[-3000:]
        # Ray itself maps a loopback address to this machine's outward one (one NIC here), so the test reads the
        # flag off the worker's `ray start` command line: the address envace.launch node-ip found for the head
        import psutil

        starts = [" ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"])
                  if f"--address=127.0.0.1:{port}" in " ".join(p.info["cmdline"] or [])]
        assert starts and all("--node-ip-address=127.0.0.1" in cmd for cmd in starts), starts
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops its own processes: the cluster closes
        head.wait(timeout=120)
        worker.wait(timeout=240)
    finally:
        _stop(worker)
        if head.poll() is None:
            os.killpg(head.pid, signal.SIGKILL)
    assert worker.returncode == 0, out.text[-4000:]
    assert "has closed the cluster: node 1 is done" in out.text
    assert _ray_processes_gone(port) == []


def test_the_head_watcher_stops_a_run_on_a_lost_node_or_a_step_past_its_deadline(tmp_path):
    """``python -m envace.launch watch`` (train.sh runs it beside the training driver on the head) on a real
    two-node Ray cluster, with a stand-in driver that logs ``step:N`` lines as verl's console logger does and then
    hangs, as verl's trainer does when a node is lost mid-rollout. A step past its deadline, then a SIGKILLed worker
    node: each time the watcher names the cause and the checkpoint a relaunch resumes from, stops the driver and
    exits 3. Old behaviour: nothing watched; the run waited forever."""
    import psutil

    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    # the head declares a silent node dead after 3 missed 1 s health checks (Ray's default: 5 x 3 s)
    env.update(RAY_AUTH_MODE="disabled", RAY_health_check_period_ms="1000", RAY_health_check_failure_threshold="3")
    common = [sys.executable, "-m", "ray.scripts.scripts", "start", "--num-cpus=1", "--num-gpus=0", "--block"]
    head = subprocess.Popen([*common, "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
                             "--disable-usage-stats", "--include-dashboard=false"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    worker = None
    run = tmp_path / "run"
    (run / "global_step_4" / "actor").mkdir(parents=True)
    (run / "latest_checkpointed_iteration.txt").write_text("4")
    drivers = []

    def driver_and_watcher(name: str, *extra: str) -> tuple[subprocess.Popen, subprocess.Popen, Lines]:
        log = tmp_path / f"{name}.log"
        hangs = "import time; print('step:4 - x:1', flush=True); print('step:5 - x:1', flush=True); time.sleep(600)"
        with open(log, "w") as fh:
            driver = subprocess.Popen([sys.executable, "-c", hangs], stdout=fh, stderr=subprocess.STDOUT)
        drivers.append(driver)
        watcher = subprocess.Popen([sys.executable, "-m", "envace.launch", "watch", "--pid", str(driver.pid),
                                    "--address", f"127.0.0.1:{port}", "--log", str(log), "--run-dir", str(run),
                                    "--poll", "1", "--grace", "5", *extra],
                                   cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        return driver, watcher, Lines(watcher)

    try:
        _wait_for_port(head, port)
        worker = subprocess.Popen([*common, f"--address=127.0.0.1:{port}", "--node-ip-address=127.0.0.1"], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        joined = subprocess.run([sys.executable, "-m", "envace.launch", "wait-nodes", "--address",
                                 f"127.0.0.1:{port}", "--nodes", "2", "--timeout", "300"], env=env, cwd=REPO,
                                capture_output=True, text=True, timeout=360, check=False)
        assert joined.returncode == 0, joined.stdout + joined.stderr

        # a step past its deadline (both nodes alive)
        driver, watcher, out = driver_and_watcher("slow", "--step-deadline", "5")
        assert watcher.wait(timeout=240) == 3, out.text
        assert "watching 2 Ray node(s)" in out.text
        assert "no training step finished within 5s (during step 6" in out.text, out.text
        assert f"Last checkpoint: {run / 'global_step_4'}" in out.text
        assert driver.wait(timeout=30) == -signal.SIGTERM

        # a worker node lost mid-step
        driver, watcher, out = driver_and_watcher("lost")
        assert out.wait_for(r"watching 2 Ray node\(s\)", 240), out.text
        node = psutil.Process(worker.pid)
        for proc in [*node.children(recursive=True), node]:  # the node's raylet and workers, as if it lost power
            proc.kill()
        assert watcher.wait(timeout=240) == 3, out.text
        stop = next(line for line in out.text.splitlines() if "stopping the run" in line)
        assert "lost Ray worker node " in stop and "head node" not in stop and "during step 6" in stop, stop
        assert f"Last checkpoint: {run / 'global_step_4'}; relaunch the same command" in stop
        assert driver.wait(timeout=30) == -signal.SIGTERM
    finally:
        for d in drivers:
            if d.poll() is None:
                d.kill()
        if worker is not None and worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
    assert _ray_processes_gone(port) == []
