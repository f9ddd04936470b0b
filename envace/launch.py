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
``build-check``
    Exits 2 with the packages to install when this GPU node lacks what Triton compiles with at run time: a C compiler
    and the interpreter's headers (:func:`build_check`).
``auth-token PATH``
    On the head: writes a new Ray authentication token to PATH (mode 600, renamed into place) unless one is there
    (:func:`write_auth_token`; the workers read it from shared storage).
``node-ip --head HOST``
    Prints this node's address on the interface that routes to the head (the worker's ``ray start`` uses it).
``wait-nodes --address HOST:PORT --nodes N [--timeout S]``
    Waits until the cluster has N alive nodes (connection attempts retried while the head starts).
``watch --pid PID --address HOST:PORT --log FILE [--startup-deadline S] [--step-deadline S] -- OVERRIDES...``
    On the head of a multi-node run: stops the training driver with one line naming the lost node (or the deadline
    that passed: start-up's or a step's) and the checkpoint a relaunch resumes from, exit 3 (:func:`watch`).

Library functions: :func:`passthrough_env` (network-interface variables every Ray worker gets) and
:func:`check_shared_storage` (every node sees the run directory, the model and the data before training starts, and
the folders the builds write into before they start).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from trace2env.cliargs import ArgumentParser, number

__all__ = [
    "PASSTHROUGH_PREFIXES",
    "Progress",
    "bound_exec",
    "build_check",
    "build_tools_problem",
    "check_shared_storage",
    "count_gpus",
    "find_c_compiler",
    "passthrough_env",
    "python_include_dir",
    "wait_head",
    "wait_nodes",
    "watch",
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
    # a CUDA 13 torch on a driver that runs CUDA 12: the CUDA 12.8 lock is the way out that needs no root
    cuda12 = ("install the CUDA 12.8 build instead (ENVACE_CUDA=12 scripts/train.sh ... reinstalls the virtualenv "
              "from requirements/gpu-cu12.lock, which scripts/bootstrap.sh picks by default on this driver), or "
              if major > 12 and have >= _vtuple(MIN_DRIVER[12]) else "")
    return (f"this node's NVIDIA driver {driver} supports CUDA up to {branch_cuda}, but the installed torch "
            f"{torch_version} (requirements/gpu-cu{major}.lock) is built for CUDA {torch_cuda} and needs driver >= "
            f"{need}: {cuda12}upgrade the driver to the R{need.split('.')[0]} branch or newer, or, on data-centre "
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


# -- build tools: what Triton compiles with at run time --------------------------------------------------------------
# Triton (vLLM's kernels; the torch.compile of verl's use_torch_compile) builds a small C launcher the first time it
# runs a kernel, with the C compiler and the interpreter's Python.h. A node without them fails only then, on a Ray
# worker, minutes into the run; build_check says so before anything starts.
#: what Triton's launcher includes, built into a shared object with Triton's own flags (triton/runtime/build.py)
_PROBE_C = "#include <Python.h>\n#include <dlfcn.h>\n#include <stdbool.h>\nbool envace_probe(void) { return true; }\n"
_INSTALL_CC = "apt-get install build-essential (Debian/Ubuntu) or dnf install gcc glibc-devel (RHEL/Fedora)"


def find_c_compiler(environ: Mapping[str, str] | None = None) -> tuple[str | None, str | None]:
    """The C compiler Triton runs, found the way Triton finds it (``triton/runtime/build.py``; the same lookup in the
    GPU lock's Triton 3.6 and the CPU lock's 3.9): ``$CC`` when set, taken as given (even empty, even with flags in
    it: Triton runs it as one program name); else ``gcc``, else ``clang``, on ``PATH``.

    Returns ``(the name Triton runs, its path)``: ``(CC, None)`` when ``$CC`` names no executable, ``(None, None)``
    when ``$CC`` is unset and neither compiler is on ``PATH``."""
    env = os.environ if environ is None else environ
    path = env.get("PATH", os.defpath)
    if "CC" in env:
        cc = env["CC"]
        return cc, (shutil.which(cc, path=path) if cc else None)
    for name in ("gcc", "clang"):
        if (found := shutil.which(name, path=path)) is not None:
            return name, found
    return None, None


def python_include_dir() -> str:
    """Where Triton looks for ``Python.h``: this interpreter's ``include`` path, with Debian's ``posix_local`` scheme
    read as ``posix_prefix`` as Triton does (in a virtualenv: the base interpreter's headers)."""
    scheme = sysconfig.get_default_scheme()
    if scheme == "posix_local":
        scheme = "posix_prefix"
    return sysconfig.get_paths(scheme=scheme)["include"]


def python_headers_fix(base_prefix: str, version: tuple[int, int]) -> str:
    """How to get the headers of the interpreter installed at ``base_prefix``: a distribution's Python (``/usr``)
    ships them in a separate package; pyenv, conda, uv and python.org builds install them with the interpreter."""
    v = f"{version[0]}.{version[1]}"
    if os.path.realpath(base_prefix) == "/usr":
        return f"install them: apt-get install python{v}-dev (Debian/Ubuntu) or dnf install python{v}-devel (RHEL/Fedora)"
    return (f"interpreters from pyenv, conda, uv or python.org install them with the interpreter, so this one at "
            f"{base_prefix} is incomplete: reinstall it (e.g. uv python install {v}, pyenv install {v}), or remove .venv "
            f"and rerun with ENVACE_PYTHON set to a Python {v} that has them")


def _first_error(output: str, tmp: str) -> str:
    """The compiler's first error line (its temporary paths dropped), for a one-line message."""
    lines = [ln.replace(tmp + os.sep, "").strip() for ln in output.splitlines() if ln.strip()]
    return next((ln for ln in lines if "error" in ln.lower() or "cannot find" in ln), lines[0] if lines else "")


def build_tools_problem(environ: Mapping[str, str] | None = None, include_dir: str | None = None) -> str | None:
    """Why Triton could not build its launcher on this node (one line naming what to install), or None.

    Checks, in order: a C compiler (:func:`find_c_compiler`), ``Python.h`` in ``include_dir`` (default
    :func:`python_include_dir`), then builds a shared object that includes what Triton's launcher includes, with
    Triton's flags: a compiler installed without the C library's headers or start files (Debian's ``gcc`` without
    its recommended ``libc6-dev``) fails only there. ``environ`` (default: this process's) gives ``CC`` and ``PATH``
    and is the compiler's environment."""
    env = dict(os.environ if environ is None else environ)
    include = include_dir if include_dir is not None else python_include_dir()
    why = "Triton (vLLM's kernels, verl's use_torch_compile) compiles its launcher at run time"
    name, cc = find_c_compiler(env)
    if cc is None:
        if name is None:
            return f"no C compiler on PATH (gcc or clang, or $CC): {why}; install one: {_INSTALL_CC}"
        return (f"CC={name!r} is not an executable on PATH: {why} with $CC as given; set CC to an installed C compiler, "
                f"or unset it to use gcc or clang ({_INSTALL_CC})")
    if not (Path(include) / "Python.h").is_file():
        return (f"no Python headers ({include}/Python.h) for Python {sys.version_info[0]}.{sys.version_info[1]} "
                f"({sys.executable}): {why} against them; "
                + python_headers_fix(sys.base_prefix, (sys.version_info[0], sys.version_info[1])))
    with tempfile.TemporaryDirectory(prefix="envace-cc-") as tmp:
        src, out = Path(tmp) / "probe.c", Path(tmp) / "probe.so"
        src.write_text(_PROBE_C)
        cmd = [cc, str(src), "-O3", "-shared", "-fPIC", "-o", str(out), f"-I{include}"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"the C compiler {cc} did not run ({exc}): {why}; install a working one: {_INSTALL_CC}"
        if done.returncode == 0 and out.is_file():
            return None
        error = _first_error(done.stderr + done.stdout, tmp) or f"exit status {done.returncode}"
        return (f"the C compiler {cc} cannot build a Python extension ({error}): {why} with it; install the C "
                f"library's headers and linker beside it: {_INSTALL_CC}")


def _nvidia_gpu_listed(environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    exe = shutil.which("nvidia-smi", path=env.get("PATH", os.defpath))
    if exe is None:
        return False
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return bool(parse_nvidia_smi(out))


def build_check(environ: Mapping[str, str] | None = None, include_dir: str | None = None) -> int:
    """``scripts/train.sh``'s pre-flight on every node, after :func:`cuda_check`: 2 with :func:`build_tools_problem`'s
    line where this node runs CUDA kernels (``nvidia-smi`` lists a GPU and the installed torch is a CUDA build) and
    cannot build Triton's launcher, else 0.

    CPU nodes are not checked: the CPU platform compiles nothing (``configs/platform/cpu.yaml``: the padded
    micro-batches call verl's plain entropy function, not its torch.compile'd one, which serves only packed
    batches; vLLM's CPU build runs eager; hfcpu is plain transformers)."""
    if torch_cuda_version()[1] is None or not _nvidia_gpu_listed(environ):
        return 0
    problem = build_tools_problem(environ, include_dir)
    if problem is None:
        return 0
    print(f"envace: {problem} (docs/gpu.md#build-tools)", file=sys.stderr)
    return 2


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
#: how :func:`check_shared_storage`'s error names the run directory: the key that moves it
RUN_DIR_KEY = "trainer.default_local_dir"


@contextlib.contextmanager
def _markers(folders: Mapping[str, str | os.PathLike[str]], token: str) -> Iterator[dict[str, str]]:
    """Write a marker file holding ``token`` into each of ``folders`` (name → folder); yields name → marker path.

    A folder that does not exist yet is created for its marker (with its missing parents). On exit, whatever the
    outcome, the markers are removed and so are the folders created here, deepest first, each only while empty: the
    check leaves the file system as it found it (a refused run leaves nothing behind), and a folder something else
    wrote into meanwhile is kept with what it holds. A folder the head cannot create or write into is a
    :class:`~envace.config.ConfigError` naming it."""
    from envace.config import ConfigError

    written: list[Path] = []
    created: list[Path] = []
    try:
        markers: dict[str, str] = {}
        for name, folder in folders.items():
            path = Path(os.path.abspath(Path(folder).expanduser()))
            missing = [p for p in (path, *path.parents) if not p.exists()]
            try:
                for p in reversed(missing):  # the outermost first
                    try:
                        p.mkdir()
                    except FileExistsError:  # another process made it meanwhile: not ours to remove
                        continue
                    created.append(p)
                marker = path / f"{MARKER_PREFIX}{token[:12]}"
                if marker not in written:  # two names for one folder share its marker
                    marker.write_text(token)
                    written.append(marker)
            except OSError as exc:
                raise ConfigError(f"{name}: cannot write into {path} on the head ({exc.strerror or exc})") from None
            markers[name] = str(marker)
        yield markers
    finally:
        for marker in written:
            marker.unlink(missing_ok=True)
        for p in reversed(created):
            try:
                p.rmdir()
            except OSError:  # not empty: another process wrote there meanwhile
                pass


def _probe_node(markers: Mapping[str, str], token: str, paths: Mapping[str, str]) -> dict[str, Any]:
    """Runs on one node: can it read each of the head's markers (name → marker path) and the listed paths?"""
    import ray

    problems = []
    for what, marker in markers.items():
        try:
            if Path(marker).read_text() != token:
                problems.append(f"{what}: the marker {marker} has other content (another run, or a different file "
                                "system)")
        except OSError as exc:
            problems.append(f"{what}: cannot read {marker} ({exc.strerror or exc})")
    for what, path in paths.items():
        if not os.path.exists(path):
            problems.append(f"{what} {path} does not exist")
        elif not os.access(path, os.R_OK):
            problems.append(f"{what} {path} is not readable")
    ctx = ray.get_runtime_context()
    return {"node_id": ctx.get_node_id(), "host": socket.gethostname(), "problems": problems}


def check_shared_storage(run_dir: str | os.PathLike[str], paths: Mapping[str, str], timeout: float = 300.0, *,
                         folders: Mapping[str, str | os.PathLike[str]] | None = None) -> None:
    """Every alive node of the connected Ray cluster must see ``run_dir`` (the checkpoint directory), every folder
    of ``folders`` and every path in ``paths``. Raises :class:`~envace.config.ConfigError` naming each node that
    cannot, before any training starts.

    The head writes a marker file into ``run_dir`` and into each folder of ``folders`` (:func:`_markers`: a folder
    not there yet is created for it, and removed again afterwards), and a Ray task on each node reads every marker
    back and checks that each path of ``paths`` exists there. ``folders`` are where something is still to be
    written for the workers to read: :func:`envace.train.prepare` checks, before its builds, the folders they
    write into. Both mappings name each entry by what moves it (e.g. ``actor_rollout_ref.model.path (under
    ENVACE_CACHE)``; the run directory is ``trainer.default_local_dir``), so that the error tells the user what to
    set (:func:`envace.train.worker_paths`, :func:`envace.train.build_folders`)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from envace.config import ConfigError

    token = uuid.uuid4().hex
    with _markers({RUN_DIR_KEY: run_dir, **(folders or {})}, token) as markers:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        head_key = "node:__internal_head__"
        label = {n["NodeID"]: ("head" if head_key in (n.get("Resources") or {}) else "worker") for n in nodes}
        probe = ray.remote(num_cpus=0)(_probe_node)
        refs = {
            probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(
                markers, token, dict(paths)
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
                "every node must see the run directory and every path its workers read, at the same path on shared "
                "storage (set the key or variable named to a folder there); " + " | ".join(failures)
            )


# -- watching a multi-node run -------------------------------------------------------------------------------
#: exit status of ``watch`` (and of scripts/train.sh) when it stopped the run: a lost node or a passed deadline
WATCH_STOPPED = 3
#: verl's console logger, one line a step (what the watcher, and gpu_smoke's resume row, read)
STEP_LINE = re.compile(r"\bstep:(\d+) - ")


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
    steps = STEP_LINE.findall(chunk[:end].decode(errors="replace"))
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


class Progress:
    """The training driver's progress as the head's watcher reads it from the driver's console log, and the deadline
    that applies at each moment.

    Start-up ends with the driver's first ``step:N - `` line: verl logs the metrics of its validation before
    training at the step it starts (0) or resumes from, and with ``trainer.val_before_train=false`` the first line is
    the first training step's. Until then ``startup_deadline`` applies, counted from the watcher's start: building
    the data and models, loading the weights into the actor, the reference and the rollout replicas, vLLM's
    compilation and CUDA-graph capture, and that validation pass, which together outlast a training step. After it,
    ``step_deadline`` applies from each new step line to the next. 0 turns either off. Times are
    ``time.monotonic()`` seconds, passed in."""

    def __init__(self, step_deadline: float, startup_deadline: float, now: float) -> None:
        self.step_deadline = step_deadline
        self.startup_deadline = startup_deadline
        self.step: int | None = None  # the last step logged; None while the driver starts up
        self.since = now  # when start-up began, or when ``step`` was logged

    def saw(self, step: int | None, now: float) -> None:
        """Record the last step line read at ``now`` (None: no new line)."""
        if step is not None and step != self.step:
            self.step, self.since = step, now

    @property
    def at(self) -> str:
        """Where the run stands, for a message."""
        return f"during step {self.step + 1}" if self.step is not None else "before the first step finished"

    def overdue(self, now: float) -> str | None:
        """Which deadline has passed at ``now``, naming its variable, or None."""
        waited = now - self.since
        if self.step is None:
            if self.startup_deadline and waited > self.startup_deadline:
                return (f"start-up did not finish within {self.startup_deadline:g}s (no step line yet: loading the "
                        "model, starting the rollout engine or validating before training; ENVACE_STARTUP_DEADLINE)")
        elif self.step_deadline and waited > self.step_deadline:
            return f"no training step finished within {self.step_deadline:g}s ({self.at}; ENVACE_STEP_DEADLINE)"
        return None


def watch(pid: int, address: str, log: str | os.PathLike[str], run_dir: str | None, step_deadline: float,
          startup_deadline: float = 0.0, poll: float = 5.0, grace: float = 60.0, *,
          nodes: Callable[[], list[dict[str, Any]]] | None = None, clock: Callable[[], float] = time.monotonic,
          sleep: Callable[[float], None] = time.sleep) -> int:
    """Watch a multi-node run from its head until the training driver ``pid`` ends (then 0).

    verl's synchronous trainer waits on its workers without a deadline, so a node lost mid-rollout hangs the run.
    Every ``poll`` seconds this checks that every Ray node alive at the start is still alive, and that the driver's
    console output (``log``) shows progress within the deadline that applies (:class:`Progress`: ``startup_deadline``
    until its first ``step:N`` line, then ``step_deadline`` per step). On a lost node or a passed deadline it prints
    one line naming the node (or the deadline and its variable) and the checkpoint a relaunch resumes from, stops
    the driver (SIGTERM, SIGKILL after ``grace`` s) and returns :data:`WATCH_STOPPED`. A driver that ended by itself
    while a node was already marked lost (it failed on the node's collective first) gets the same line and status.

    ``nodes`` returns the cluster's node table (default: ``ray.nodes()`` of the cluster at ``address``, connected
    here); ``clock`` and ``sleep`` keep the time. Tests replace the three to play hours of a run in a moment."""
    if nodes is not None:
        return _watch(pid, Path(log), run_dir, Progress(step_deadline, startup_deadline, clock()), poll, grace, nodes,
                      clock, sleep)
    import ray

    ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    try:
        return _watch(pid, Path(log), run_dir, Progress(step_deadline, startup_deadline, clock()), poll, grace,
                      ray.nodes, clock, sleep)
    finally:
        ray.shutdown()


def _watch(pid: int, log: Path, run_dir: str | None, progress: Progress, poll: float, grace: float,
           nodes: Callable[[], list[dict[str, Any]]], clock: Callable[[], float],
           sleep: Callable[[float], None]) -> int:
    """:func:`watch`'s loop, given the cluster's node table."""
    table = nodes()
    head = {n["NodeID"] for n in table if "node:__internal_head__" in (n.get("Resources") or {})}
    watched = {n["NodeID"]: n.get("NodeManagerAddress", "?") for n in table if n.get("Alive")}

    def names(ids: list[str]) -> str:
        return ", ".join(f"{'head' if n in head else 'worker'} node {watched[n]} (node id {n[:12]})" for n in ids)

    def seconds(deadline: float) -> str:
        return f"{deadline:g}s" if deadline else "none"

    print(f"envace: watching {len(watched)} Ray node(s) and the training driver {pid}: start-up deadline "
          f"{seconds(progress.startup_deadline)} (ENVACE_STARTUP_DEADLINE), step deadline "
          f"{seconds(progress.step_deadline)} (ENVACE_STEP_DEADLINE)", flush=True)
    offset = 0
    while _pid_alive(pid):
        sleep(poll)
        new, offset = _last_step(log, offset)
        progress.saw(new, clock())
        try:
            alive = {n["NodeID"] for n in nodes() if n.get("Alive")}
        except Exception:  # noqa: BLE001, S112 - the head's GCS itself is gone: the driver fails on its own
            continue
        lost = sorted(set(watched) - alive)
        why = f"lost Ray {names(lost)} {progress.at}" if lost else progress.overdue(clock())
        if why and _pid_alive(pid):
            print(f"envace: {why}: stopping the run. Last checkpoint: {last_checkpoint(run_dir)}; relaunch the "
                  "same command on every node to resume from it (docs/multinode.md)", file=sys.stderr, flush=True)
            _stop_driver(pid, grace)
            return WATCH_STOPPED
    try:  # the driver may have failed on a lost node before the head's health checks declared it dead
        lost = sorted(set(watched) - {n["NodeID"] for n in nodes() if n.get("Alive")})
    except Exception:  # noqa: BLE001 - the head's GCS is gone too: nothing more to tell
        lost = []
    if lost:
        new, offset = _last_step(log, offset)
        progress.saw(new, clock())
        print(f"envace: lost Ray {names(lost)} {progress.at}: the training driver failed on it. Last checkpoint: "
              f"{last_checkpoint(run_dir)}; relaunch the same command on every node to resume from it "
              "(docs/multinode.md)", file=sys.stderr, flush=True)
        return WATCH_STOPPED
    return 0


def write_auth_token(path: str | os.PathLike[str]) -> bool:
    """The head's Ray token on shared storage: unless ``path`` already holds one (non-empty), write a new random
    token there, readable by its owner only (mode 600) and renamed into place, so that a worker waiting for the file
    never reads half of it. Returns whether it wrote one. ``scripts/train.sh``'s head and ``scripts/gpu_smoke.sh
    --nodes`` both call it."""
    import secrets

    target = Path(path)
    if target.is_file() and target.stat().st_size:
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(secrets.token_hex(32) + "\n")
    tmp.replace(target)
    return True


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
    sub.add_parser("build-check", help="stop (exit 2, naming the packages) when a GPU node lacks a C compiler or "
                                       "the Python headers Triton compiles with")
    wa = sub.add_parser("watch", help="stop the run (exit 3) on a lost Ray node or a passed deadline")
    wa.add_argument("--pid", type=count, required=True, help="the training driver")
    wa.add_argument("--address", required=True)
    wa.add_argument("--log", required=True, help="the driver's console output (its step:N lines)")
    wa.add_argument("--step-deadline", type=seconds, default=0.0, help="seconds per step (0: none)")
    wa.add_argument("--startup-deadline", type=seconds, default=0.0,
                    help="seconds until the first step line: start-up and validation before training (0: none)")
    wa.add_argument("--poll", type=number(float, min=0, min_open=True), default=5.0)
    wa.add_argument("--grace", type=seconds, default=60.0, help="seconds between SIGTERM and SIGKILL of the driver")
    wa.add_argument("--run-dir", default=None, help="the checkpoint directory (default: composed from OVERRIDES)")
    wa.add_argument("overrides", nargs=argparse.REMAINDER, help="-- train.sh's arguments")
    tok = sub.add_parser("auth-token", help="write a new Ray auth token to PATH (mode 600) unless one is there")
    tok.add_argument("path")
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
    if args.cmd == "build-check":
        return build_check()
    if args.cmd == "watch":
        overrides = args.overrides[1:] if args.overrides[:1] == ["--"] else args.overrides
        run_dir = args.run_dir or _run_dir_of(overrides)
        return watch(args.pid, args.address, args.log, run_dir, args.step_deadline,
                     startup_deadline=args.startup_deadline, poll=args.poll, grace=args.grace)
    if args.cmd == "auth-token":
        if write_auth_token(args.path):
            print(f"envace: wrote a new Ray auth token to {args.path} (mode 600)")
        return 0
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
