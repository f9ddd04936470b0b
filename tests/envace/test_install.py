"""What scripts/bootstrap.sh installs: the lock that fits the machine (requirements/cpu.lock without NVIDIA
GPUs, requirements/gpu.lock with them), exactly; the GPU lock carries verl 0.9.1's own vLLM/torch/transformers
pins and resolves for Linux x86-64 CUDA (checked against PyPI, reading package metadata only)."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
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


def machine_platform() -> str:
    """The platform bootstrap.sh picks: ENVACE_PLATFORM, else gpu when nvidia-smi lists a GPU."""
    forced = os.environ.get("ENVACE_PLATFORM", "auto")
    if forced in ("cpu", "gpu"):
        return forced
    smi = shutil.which("nvidia-smi")
    if smi:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, check=False).stdout
        if any(line.startswith("GPU ") for line in out.splitlines()):
            return "gpu"
    return "cpu"


PLATFORM = machine_platform()


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


@pytest.mark.skipif(PLATFORM != "cpu", reason="this machine installs requirements/gpu.lock")
def test_cpu_machine_has_cpu_torch_no_vllm_no_cuda_wheels():
    import torch

    assert torch.__version__.split("+")[0] == "2.13.0"
    assert torch.version.cuda is None
    assert importlib.util.find_spec("vllm") is None
    names = {d.metadata["Name"].lower() for d in md.distributions()}
    assert not sorted(n for n in names if re.match(CUDA_WHEELS, n))


@pytest.mark.skipif(PLATFORM != "gpu", reason="no NVIDIA GPU on this machine (requirements/cpu.lock)")
def test_gpu_machine_has_cuda_torch_and_the_pinned_vllm():
    import torch

    assert torch.__version__.split("+")[0] == "2.11.0" and str(torch.version.cuda).startswith("13")
    assert md.version("vllm") == "0.24.0" and md.version("transformers") == "5.9.0"


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
    # the same tree on both platforms wherever the engine pins allow it
    cpu = lock_pins("cpu.lock")
    assert {n for n in set(cpu) & set(pins) if cpu[n] != pins[n]} <= {"torch", "transformers", "fastapi", "numpy"}


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
    assert [ep.value for ep in eps] == ["envace.verl_plugin"]


# -- the GPU lock resolves for Linux x86-64 CUDA (network) ----------------------------------------------
INDEX = os.environ.get("ENVACE_PYPI_INDEX", "https://pypi.org/simple")
#: pure-Python distributions PyPI has only as sdists; built locally into wheels for the platform resolve
SDIST_ONLY = ("antlr4-python3-runtime==4.9.3",)
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(17, 40)] + ["manylinux2014_x86_64", "manylinux2010_x86_64",
                                                                  "manylinux1_x86_64", "linux_x86_64"]


def pypi_unreachable() -> str | None:
    try:
        urllib.request.urlopen(f"{INDEX}/pip/", timeout=15).close()
    except OSError as exc:
        return f"{INDEX} unreachable ({exc})"
    return None


def clean_pip_env() -> dict[str, str]:
    """This machine's pip config (local wheel folders, a CPU torch) must not stand in for PyPI."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("python", ["3.11"])  # the CI interpreter; 3.12 resolves the same lock (checked by hand, 2026-12-01)
def test_gpu_lock_resolves_for_linux_x86_64_cuda(tmp_path, python):
    """pip resolves the whole GPU lock, with dependencies, for CPython on manylinux x86-64, binary wheels only.

    --dry-run with --use-feature=fast-deps reads each wheel's metadata with HTTP range requests: no wheel is
    downloaded. The resolved set must equal the lock (nothing missing, nothing extra, the same versions).
    """
    reason = pypi_unreachable()
    if reason:
        pytest.skip(reason)
    env, pip = clean_pip_env(), [sys.executable, "-m", "pip"]
    wheels = tmp_path / "wheels"
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir", "--index-url", INDEX,
                    "-w", str(wheels), *SDIST_ONLY], env=env, check=True, capture_output=True, timeout=300)
    report = tmp_path / "report.json"
    cmd = [*pip, "install", "--dry-run", "--ignore-installed", "--no-cache-dir", "--use-feature=fast-deps",
           "--report", str(report), "--target", str(tmp_path / "target"), "--index-url", INDEX,
           "--find-links", str(wheels), "--only-binary=:all:", "--python-version", python,
           "--implementation", "cp", "--abi", f"cp{python.replace('.', '')}", "--abi", "abi3", "--abi", "none",
           *[a for p in PLATFORMS for a in ("--platform", p)], "-r", str(REPO / "requirements" / "gpu.lock")]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=840, check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert not re.search(r"^\s*Downloading \S+\.whl", out.stdout, re.MULTILINE), "a wheel was downloaded"
    resolved = {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"]
                for i in json.loads(report.read_text())["install"]}
    assert resolved == lock_pins("gpu.lock")
    # bfcl-eval goes in with --no-deps (requirements/no-deps.txt): it needs a wheel for the platform too
    nodeps = [*cmd[: cmd.index("-r")], "--no-deps", "-r", str(REPO / "requirements" / "no-deps.txt")]
    nodeps[nodeps.index(str(report))] = str(tmp_path / "nodeps.json")
    out = subprocess.run(nodeps, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
