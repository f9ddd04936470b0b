"""Launch helpers used by ``scripts/train.sh`` and by :mod:`envace.train`'s pre-flight.

``python -m envace.launch SUBCOMMAND``:

``gpus``
    Prints the number of CUDA devices this node offers: ``CUDA_VISIBLE_DEVICES`` restricts the list, a
    MIG-enabled GPU counts as its MIG devices (``nvidia-smi -L`` prints both), no NVIDIA driver means one
    logical device slot backed by the CPU platform.
``bound-exec --parent PID -- COMMAND...``
    Becomes COMMAND bound to the life of ``PID``: Linux delivers SIGTERM to it when ``PID`` ends, however it
    ends (SIGKILL included). ``scripts/train.sh`` runs ``ray start --block`` this way: on SIGTERM it stops
    exactly the Ray processes it started (never ``ray stop``, which stops every Ray cluster of the machine).
``wait-head --address HOST:PORT [--timeout S]``
    Waits until the head's GCS port accepts connections (a worker started before its head retries).
``cuda-check``
    Exits 2 with the fix when this node's NVIDIA driver is too old for the CUDA build of the installed torch.
``node-ip --head HOST``
    Prints this node's address on the interface that routes to the head (the worker's ``ray start`` uses it).
``wait-nodes --address HOST:PORT --nodes N [--timeout S]``
    Waits until the cluster has N alive nodes (connection attempts retried while the head starts).
``watch --pid PID --address HOST:PORT --log FILE [--step-deadline S] -- OVERRIDES...``
    On the head of a multi-node run: stops the training driver with one line naming the lost node (or the step
    past its deadline) and the checkpoint a relaunch resumes from, exit 3 (:func:`watch`).

Library functions: :func:`passthrough_env` (network-interface variables every Ray worker gets) and
:func:`check_shared_storage` (every node sees the run directory and the model before training starts).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from trace2env.cliargs import ArgumentParser, number

__all__ = [
    "PASSTHROUGH_PREFIXES",
    "bound_exec",
    "check_shared_storage",
    "count_gpus",
    "passthrough_env",
    "wait_head",
    "wait_nodes",
]

#: network-interface and transport settings of NCCL / gloo: set on the head (or every node), handed to every
#: Ray worker of the job, so collectives on all nodes use the same interfaces
PASSTHROUGH_EXACT = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "NCCL_SOCKET_FAMILY",
                     "NCCL_DEBUG", "NCCL_CROSS_NIC", "NCCL_P2P_DISABLE", "NCCL_NET")
PASSTHROUGH_PREFIXES = ("NCCL_IB_", "NCCL_NET_", "NCCL_SOCKET_")


def passthrough_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The network-interface variables of ``environ`` (default: this process) to hand to every Ray worker."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if k in PASSTHROUGH_EXACT or k.startswith(PASSTHROUGH_PREFIXES)}


# -- GPUs ---------------------------------------------------------------------------------------------------
_GPU_LINE = re.compile(r"^GPU (\d+):.*\(UUID: (GPU-[^)]+)\)")
_MIG_LINE = re.compile(r"^\s+MIG .*\(UUID: (MIG-[^)]+)\)")


def parse_nvidia_smi(listing: str) -> list[dict[str, Any]]:
    """``nvidia-smi -L`` → one entry per physical GPU: ``{"index", "uuid", "mig": [MIG uuids]}``."""
    gpus: list[dict[str, Any]] = []
    for line in listing.splitlines():
        if m := _GPU_LINE.match(line):
            gpus.append({"index": int(m.group(1)), "uuid": m.group(2), "mig": []})
        elif (m := _MIG_LINE.match(line)) and gpus:
            gpus[-1]["mig"].append(m.group(1))
    return gpus


def count_gpus(listing: str | None, cuda_visible_devices: str | None) -> int:
    """CUDA devices a process sees, from ``nvidia-smi -L`` output and ``CUDA_VISIBLE_DEVICES``.

    A MIG-enabled GPU contributes its MIG devices, not itself. ``CUDA_VISIBLE_DEVICES`` (indices, GPU-…
    or MIG-… UUIDs, as CUDA reads it) keeps the listed devices, in order, up to the first one that does not
    exist. ``listing`` None (no driver) gives 0.
    """
    gpus = parse_nvidia_smi(listing or "")
    devices = [m for g in gpus for m in g["mig"]] + [g["uuid"] for g in gpus if not g["mig"]]
    if cuda_visible_devices is None:
        return len(devices)
    known_uuids = set(devices)
    by_index = {str(g["index"]): g for g in gpus}
    n = 0
    for item in (x.strip() for x in cuda_visible_devices.split(",")):
        if not item:
            break
        if item in by_index:
            g = by_index[item]
            n += len(g["mig"]) if g["mig"] else 1
        elif item in known_uuids or any(u.startswith(item) for u in known_uuids if item.startswith(("GPU-", "MIG-"))):
            n += 1
        else:  # CUDA stops at the first invalid entry (e.g. -1)
            break
    return n


def gpus_here() -> int:
    """The device slots this node offers: its CUDA devices, or 1 logical slot where no NVIDIA driver answers."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return 1
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return 1
    if not parse_nvidia_smi(out):
        return 1
    return count_gpus(out, os.environ.get("CUDA_VISIBLE_DEVICES"))


# -- the NVIDIA driver against the installed torch -------------------------------------------------------------
#: the oldest Linux driver each CUDA major version runs on without NVIDIA's forward-compatibility package
#: (minor-version compatibility: any 12.x runtime on a >= 525.60.13 driver; CUDA 13.x needs the R580 branch)
MIN_DRIVER = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}
#: the highest CUDA version of each driver branch (what ``nvidia-smi`` prints as "CUDA Version"), for messages
_BRANCH_CUDA = ((580, "13.0"), (575, "12.9"), (570, "12.8"), (560, "12.6"), (555, "12.5"), (550, "12.4"),
                (545, "12.3"), (535, "12.2"), (530, "12.1"), (525, "12.0"), (520, "11.8"), (450, "11.0"))


def driver_version(exe: str | None = None) -> str | None:
    """The NVIDIA driver version (``nvidia-smi --query-gpu=driver_version``), None without a driver."""
    exe = exe or shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    first = next((ln.strip() for ln in out.splitlines() if ln.strip()), "")
    return first if re.fullmatch(r"\d+(\.\d+)*", first) else None


def torch_cuda_version() -> tuple[str | None, str | None]:
    """``(torch version, CUDA version it was built for)`` of the torch this interpreter would import, read from
    ``torch/version.py`` without importing torch (seconds, and CUDA initialisation, saved); CUDA None for a CPU
    build, both None without torch."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None, None
    try:
        text = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text()
    except OSError:
        return None, None
    version = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)", text, re.MULTILINE)
    cuda = re.search(r"^cuda(?:\s*:[^=]*)?=\s*['\"]([^'\"]+)", text, re.MULTILINE)
    return (version.group(1) if version else None), (cuda.group(1) if cuda else None)


def _vtuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version))


def cuda_mismatch(driver: str | None, torch_version: str | None, torch_cuda: str | None) -> str | None:
    """Why this node's driver cannot run the installed torch's CUDA build (one line naming the fix), or None.

    None when there is no driver (a CPU node), torch is a CPU build, or the driver is new enough."""
    if driver is None or torch_cuda is None:
        return None
    major = _vtuple(torch_cuda)[0]
    need = MIN_DRIVER.get(major)
    have = _vtuple(driver)
    if need is None or have >= _vtuple(need):
        return None
    branch_cuda = next((cuda for branch, cuda in _BRANCH_CUDA if have[0] >= branch), "older than 11.0")
    compat = f"cuda-compat-{torch_cuda.replace('.', '-')}"
    return (f"this node's NVIDIA driver {driver} supports CUDA up to {branch_cuda}, but the installed torch "
            f"{torch_version} (requirements/gpu.lock) is built for CUDA {torch_cuda} and needs driver >= "
            f"{need}: upgrade the driver to the R{need.split('.')[0]} branch or newer, or, on data-centre "
            f"GPUs (H100, H200, H20, A100, L40S...) with an R535 or newer driver, install NVIDIA's "
            f"forward-compatibility package ({compat}, from NVIDIA's CUDA repository) on every node and export "
            f"LD_LIBRARY_PATH=/usr/local/cuda-{torch_cuda}/compat:$LD_LIBRARY_PATH before scripts/train.sh "
            f"(docs/gpu.md)")


def _cuda_usable() -> bool:
    """Does the installed torch reach a CUDA device (e.g. through the forward-compatibility package)? Run in a
    child interpreter: CUDA initialisation must not happen in the launcher."""
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    try:
        return subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=300,
                              check=False).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def cuda_check() -> int:
    """``scripts/train.sh``'s pre-flight on every node, before any Ray start: 0 when the installed torch can run
    on this node's driver (or the node has none), else 2 with the reason and the fix on one line."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return 0
    driver = driver_version(exe)
    torch_version, torch_cuda = torch_cuda_version()
    problem = cuda_mismatch(driver, torch_version, torch_cuda)
    if problem is None:
        return 0
    if _cuda_usable():  # the forward-compatibility libraries are on the library path: CUDA works regardless
        print(f"envace: driver {driver} is older than CUDA {torch_cuda} needs, but torch reaches the GPUs "
              "(CUDA forward compatibility)", file=sys.stderr)
        return 0
    print(f"envace: {problem}", file=sys.stderr)
    return 2


def node_ip(head: str) -> str:
    """The address of this node's interface that routes to ``head`` (a UDP socket's source address: nothing is
    sent). Ray's own guess may pick another interface on a multi-NIC node, one the head cannot reach."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((head, 9))
        return s.getsockname()[0]


# -- Ray nodes ------------------------------------------------------------------------------------------------
def _set_parent_death_signal(sig: int) -> None:
    """Linux: deliver ``sig`` to this process when its parent exits (survives exec)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    if libc.prctl(pr_set_pdeathsig, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def bound_exec(parent: int, command: Sequence[str]) -> int:
    """Exec ``command`` bound to the life of ``parent`` (see the module docstring); returns only on failure."""
    if not command:
        print("envace: bound-exec needs a command after --", file=sys.stderr)
        return 2
    if sys.platform.startswith("linux"):
        _set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before the death signal was armed, or it is not our parent
        print(f"envace: parent {parent} is gone; not starting {command[0]}", file=sys.stderr)
        return 1
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvp(command[0], list(command))
    return 1  # pragma: no cover - execvp does not return


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    return host, int(port)


def wait_head(address: str, timeout: float, poll: float = 1.0) -> int:
    """Block until ``address`` accepts TCP connections; 0, or 1 on time-out."""
    host, port = _split_address(address)
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(5.0, max(poll, 0.5))):
                return 0
        except OSError as exc:
            last = str(exc)
        if time.monotonic() > deadline:
            print(f"envace: the Ray head {address} did not accept connections within {timeout:g}s ({last})",
                  file=sys.stderr)
            return 1
        time.sleep(poll)


def wait_nodes(n: int, timeout: float, poll: float = 2.0, address: str | None = None,
               node_pid: int | None = None) -> int:
    """Block until the Ray cluster at ``address`` (default RAY_ADDRESS) has ``n`` alive nodes; 0, or 1 on time-out.

    Connection attempts are retried until the deadline (the head may still be starting), unless ``node_pid`` (the
    head's own ``ray start``) has exited: then the head will never come up, and this says so at once.
    """
    import ray

    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        print("envace: wait-nodes needs --address or RAY_ADDRESS", file=sys.stderr)
        return 2
    deadline = time.monotonic() + timeout
    while True:
        if node_pid is not None and not _pid_alive(node_pid):
            print(f"envace: this node's Ray (ray start, pid {node_pid}) exited before the cluster at {address} formed; "
                  "its error is above", file=sys.stderr)
            return 1
        try:
            ray.init(address=address, log_to_driver=False)
            break
        except (ConnectionError, RuntimeError, TimeoutError) as exc:
            if time.monotonic() > deadline:
                print(f"envace: cannot connect to the Ray cluster at {address}: {exc}", file=sys.stderr)
                return 1
            time.sleep(poll)
    try:
        while True:
            alive = sum(1 for node in ray.nodes() if node.get("Alive"))
            if alive >= n:
                print(f"envace: Ray cluster has {alive}/{n} nodes", flush=True)
                return 0
            if time.monotonic() > deadline:
                print(f"envace: only {alive}/{n} Ray nodes joined within {timeout:g}s", file=sys.stderr)
                return 1
            time.sleep(poll)
    finally:
        ray.shutdown()


# -- shared storage -------------------------------------------------------------------------------------------
MARKER_PREFIX = ".envace-shared-storage-"


def _probe_node(marker: str, token: str, paths: Mapping[str, str]) -> dict[str, Any]:
    """Runs on one node: can it read the head's marker and the listed paths?"""
    import ray

    problems = []
    try:
        if Path(marker).read_text() != token:
            problems.append(f"the marker {marker} has other content (another run, or a different file system)")
    except OSError as exc:
        problems.append(f"cannot read {marker} ({exc.strerror or exc})")
    for what, path in paths.items():
        if not os.path.exists(path):
            problems.append(f"{what} {path} does not exist")
        elif not os.access(path, os.R_OK):
            problems.append(f"{what} {path} is not readable")
    ctx = ray.get_runtime_context()
    return {"node_id": ctx.get_node_id(), "host": socket.gethostname(), "problems": problems}


def check_shared_storage(run_dir: str | os.PathLike[str], paths: Mapping[str, str], timeout: float = 300.0) -> None:
    """Every alive node of the connected Ray cluster must see ``run_dir`` (the checkpoint directory: the
    head writes a marker file there, an actor on each node reads it back) and every path in ``paths``
    (e.g. the model). Raises :class:`~envace.config.ConfigError` naming each node that cannot, before any
    training starts."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from envace.config import ConfigError

    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex
    marker = run / f"{MARKER_PREFIX}{token[:12]}"
    marker.write_text(token)
    try:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        head_key = "node:__internal_head__"
        label = {n["NodeID"]: ("head" if head_key in (n.get("Resources") or {}) else "worker") for n in nodes}
        probe = ray.remote(num_cpus=0)(_probe_node)
        refs = {
            probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(
                str(marker), token, dict(paths)
            ): n
            for n in nodes
        }
        ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
        failures = []
        for ref in pending:
            n = refs[ref]
            failures.append(f"{label[n['NodeID']]} node {n.get('NodeManagerAddress')} ({n['NodeID'][:12]}): did not "
                            f"answer within {timeout:g}s")
        for ref in ready:
            n = refs[ref]
            try:
                out = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - the node could not even run the probe
                failures.append(f"{label[n['NodeID']]} node {n.get('NodeManagerAddress')} ({n['NodeID'][:12]}): {exc}")
                continue
            if out["problems"]:
                failures.append(f"{label[n['NodeID']]} node {n.get('NodeManagerAddress')} ({out['host']}, "
                                f"{n['NodeID'][:12]}): " + "; ".join(out["problems"]))
        if failures:
            raise ConfigError(
                "every node must see the run directory and the model on shared storage (the same path on a "
                "shared file system); " + " | ".join(failures)
            )
    finally:
        marker.unlink(missing_ok=True)


# -- watching a multi-node run -------------------------------------------------------------------------------
#: exit status of ``watch`` (and of scripts/train.sh) when it stopped the run: a lost node or a step past its deadline
WATCH_STOPPED = 3
_STEP_LINE = re.compile(r"\bstep:(\d+) - ")


def last_checkpoint(run_dir: str | os.PathLike[str] | None) -> str:
    """Where a relaunch resumes: the step directory ``latest_checkpointed_iteration.txt`` names (verl's tracker),
    or why there is none."""
    if run_dir is None:
        return "unknown (the run directory could not be read from the config)"
    tracker = Path(run_dir) / "latest_checkpointed_iteration.txt"
    try:
        step = tracker.read_text().strip()
    except OSError:
        return f"none yet in {run_dir} (a relaunch starts from step 0)"
    return str(Path(run_dir) / f"global_step_{step}")


def _run_dir_of(overrides: Sequence[str]) -> str | None:
    """``trainer.default_local_dir`` of the config these train.sh arguments compose (None if they do not)."""
    try:
        from envace.verl.config import compose

        return str(Path(str(compose(list(overrides)).trainer.default_local_dir)).resolve())
    except Exception:  # noqa: BLE001 - the trainer itself reports a bad config; the watcher only loses the path
        return None


def _last_step(log: Path, offset: int) -> tuple[int | None, int]:
    """The last ``step:N - `` line verl's console logger wrote to ``log`` after byte ``offset``; the new offset."""
    try:
        with open(log, "rb") as fh:
            fh.seek(offset)
            chunk = fh.read()
    except OSError:
        return None, offset
    end = chunk.rfind(b"\n") + 1  # a partial last line is read again next time
    steps = _STEP_LINE.findall(chunk[:end].decode(errors="replace"))
    return (int(steps[-1]) if steps else None), offset + end


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped by train.sh) is gone
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (OSError, IndexError):
        return True


def _stop_driver(pid: int, grace: float) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while _pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    if _pid_alive(pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def watch(pid: int, address: str, log: str | os.PathLike[str], run_dir: str | None, step_deadline: float,
          poll: float = 5.0, grace: float = 60.0) -> int:
    """Watch a multi-node run from its head until the training driver ``pid`` ends (then 0).

    verl's synchronous trainer waits on its workers without a deadline, so a node lost mid-rollout hangs the run.
    Every ``poll`` seconds this checks that every Ray node alive at the start is still alive, and that the driver
    logged a new ``step:N`` line (``log``: its console output) within ``step_deadline`` seconds (0: no deadline).
    On a lost node or a step past its deadline it prints one line naming the node (or the step) and the
    checkpoint a relaunch resumes from, stops the driver (SIGTERM, SIGKILL after ``grace`` s) and returns
    :data:`WATCH_STOPPED`. A driver that ended by itself while a node was already marked lost (it failed on the
    node's collective first) gets the same line and status."""
    import ray

    ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    try:
        head = {n["NodeID"] for n in ray.nodes() if "node:__internal_head__" in (n.get("Resources") or {})}
        watched = {n["NodeID"]: n.get("NodeManagerAddress", "?") for n in ray.nodes() if n.get("Alive")}

        def names(ids: list[str]) -> str:
            return ", ".join(f"{'head' if n in head else 'worker'} node {watched[n]} (node id {n[:12]})" for n in ids)

        print(f"envace: watching {len(watched)} Ray node(s) and the step time (deadline "
              f"{f'{step_deadline:g}s' if step_deadline else 'none'}) of the training driver {pid}", flush=True)
        offset, step, since = 0, None, time.monotonic()
        while _pid_alive(pid):
            time.sleep(poll)
            new, offset = _last_step(Path(log), offset)
            if new is not None and new != step:
                step, since = new, time.monotonic()
            try:
                alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
            except Exception:  # noqa: BLE001, S112 - the head's GCS itself is gone: the driver fails on its own
                continue
            lost = sorted(set(watched) - alive)
            at = f"during step {step + 1}" if step is not None else "before the first step finished"
            why = None
            if lost:
                why = f"lost Ray {names(lost)} {at}"
            elif step_deadline and time.monotonic() - since > step_deadline:
                why = f"no training step finished within {step_deadline:g}s ({at}; ENVACE_STEP_DEADLINE)"
            if why and _pid_alive(pid):
                print(f"envace: {why}: stopping the run. Last checkpoint: {last_checkpoint(run_dir)}; relaunch the "
                      "same command on every node to resume from it (docs/multinode.md)", file=sys.stderr, flush=True)
                _stop_driver(pid, grace)
                return WATCH_STOPPED
        try:  # the driver may have failed on a lost node before the head's health checks declared it dead
            lost = sorted(set(watched) - {n["NodeID"] for n in ray.nodes() if n.get("Alive")})
        except Exception:  # noqa: BLE001 - the head's GCS is gone too: nothing more to tell
            lost = []
        if lost:
            new, offset = _last_step(Path(log), offset)
            step = new if new is not None else step
            at = f"during step {step + 1}" if step is not None else "before the first step finished"
            print(f"envace: lost Ray {names(lost)} {at}: the training driver failed on it. Last checkpoint: "
                  f"{last_checkpoint(run_dir)}; relaunch the same command on every node to resume from it "
                  "(docs/multinode.md)", file=sys.stderr, flush=True)
            return WATCH_STOPPED
        return 0
    finally:
        ray.shutdown()


# -- CLI ------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    # numbers are range-checked as they are parsed (NaN, infinities and negative times refused), and a bad flag is
    # one line, exit 2: scripts/train.sh's own checks of its variables come first, these catch a direct call
    seconds, count = number(float, min=0), number(int, min=1)
    parser = ArgumentParser(prog="python -m envace.launch")
    sub = parser.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("wait-nodes", help="wait until the Ray cluster has N alive nodes")
    w.add_argument("--nodes", type=count, required=True)
    w.add_argument("--timeout", type=seconds, default=600.0)
    w.add_argument("--address", default=None, help="HOST:PORT (default: RAY_ADDRESS)")
    w.add_argument("--node-pid", type=count, default=None,
                   help="give up when this process (the head's ray start) ends")
    h = sub.add_parser("wait-head", help="wait until the Ray head accepts connections")
    h.add_argument("--address", required=True)
    h.add_argument("--timeout", type=seconds, default=600.0)
    sub.add_parser("gpus", help="print the CUDA devices of this node (1 logical slot without a driver)")
    sub.add_parser("cuda-check", help="stop (exit 2, with the fix) when the driver cannot run the installed torch")
    wa = sub.add_parser("watch", help="stop the run (exit 3) on a lost Ray node or a step past its deadline")
    wa.add_argument("--pid", type=count, required=True, help="the training driver")
    wa.add_argument("--address", required=True)
    wa.add_argument("--log", required=True, help="the driver's console output (its step:N lines)")
    wa.add_argument("--step-deadline", type=seconds, default=0.0, help="seconds per step (0: none)")
    wa.add_argument("--poll", type=number(float, min=0, min_open=True), default=5.0)
    wa.add_argument("--grace", type=seconds, default=60.0, help="seconds between SIGTERM and SIGKILL of the driver")
    wa.add_argument("--run-dir", default=None, help="the checkpoint directory (default: composed from OVERRIDES)")
    wa.add_argument("overrides", nargs=argparse.REMAINDER, help="-- train.sh's arguments")
    ip = sub.add_parser("node-ip", help="print this node's address on the interface that routes to --head")
    ip.add_argument("--head", required=True)
    r = sub.add_parser("bound-exec", help="exec COMMAND, terminated when --parent ends")
    r.add_argument("--parent", type=count, required=True)
    r.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.cmd == "wait-nodes":
        return wait_nodes(args.nodes, args.timeout, address=args.address, node_pid=args.node_pid)
    if args.cmd == "wait-head":
        return wait_head(args.address, args.timeout)
    if args.cmd == "gpus":
        print(gpus_here())
        return 0
    if args.cmd == "cuda-check":
        return cuda_check()
    if args.cmd == "watch":
        overrides = args.overrides[1:] if args.overrides[:1] == ["--"] else args.overrides
        run_dir = args.run_dir or _run_dir_of(overrides)
        return watch(args.pid, args.address, args.log, run_dir, args.step_deadline, args.poll, args.grace)
    if args.cmd == "node-ip":
        try:
            print(node_ip(args.head))
        except OSError as exc:
            print(f"envace: no route from this node to the head {args.head} ({exc})", file=sys.stderr)
            return 2
        return 0
    if args.cmd == "bound-exec":
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        return bound_exec(args.parent, command)
    return 2


if __name__ == "__main__":
    sys.exit(main())
