"""Fixtures of the envace tests: ``train_sh``, a run of ``scripts/train.sh`` for the end-to-end trainer tests,
``gpu_lock_resolves``, the GPU lock's resolve against PyPI started when the session starts, and
``warm_start_built_first``, the warm start's build before the first test that is marked to use it (the fake OpenAI
server and its reply builders are in ``tests/conftest.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


def _train_sh(run_dir: Path, *overrides: str, timeout: int = 1800) -> str:
    """``scripts/train.sh trainer.default_local_dir=RUN_DIR OVERRIDES…`` on its own Ray cluster; asserts exit 0 and
    returns stdout + stderr (verl's console metrics lines included)."""
    env = dict(os.environ, RAY_DEDUP_LOGS="0")
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [str(REPO / "scripts" / "train.sh"), f"trainer.default_local_dir={run_dir}", *overrides],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-8000:]
    return out


@pytest.fixture(scope="session")
def train_sh() -> Callable[..., str]:
    return _train_sh


# -- the GPU lock's PyPI resolve (test_install.py::test_gpu_lock_resolves_for_linux_x86_64_cuda) --------------------
GPU_LOCK_TEST = "test_gpu_lock_resolves_for_linux_x86_64_cuda"
PYPI_INDEX = os.environ.get("ENVACE_PYPI_INDEX", "https://pypi.org/simple")
#: the resolver: uv evaluates environment markers for the target Python (``--python-version``); pip's
#: ``--python-version`` changes only wheel tags and Requires-Python checks and evaluates markers with the running
#: interpreter, so a pip resolve "for 3.12" on 3.11 passed a lock that cannot install on 3.12
UV = "uv==0.13.9"
#: pure-Python distributions PyPI has only as sdists; built locally into wheels for the binary-only resolve
SDIST_ONLY = ("antlr4-python3-runtime==4.9.3",)
#: the oldest glibc the lock supports (Ubuntu 22.04); wheels must exist for it
PLATFORM = "x86_64-manylinux_2_35"


def pypi_unreachable() -> str | None:
    try:
        urllib.request.urlopen(f"{PYPI_INDEX}/pip/", timeout=15).close()
    except OSError as exc:
        return f"{PYPI_INDEX} unreachable ({exc})"
    return None


def clean_pip_env() -> dict[str, str]:
    """This machine's pip/uv config (local wheel folders, a CPU torch) must not stand in for PyPI."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "UV_"))}
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def resolve_gpu_lock(tmp: Path, python: str, procs: list[subprocess.Popen]) -> dict[str, Any]:
    """uv's resolve of requirements/gpu.lock (and no-deps.txt) for CPython ``python`` (a full version: markers such
    as ``python_full_version < "3.11.3"`` are evaluated for it) on manylinux x86-64, binary wheels only, reading
    package metadata only (PyPI serves it beside each wheel).

    Returns ``{"skip": reason}`` when PyPI is unreachable, else each step's return code and output tail and the
    resolved ``{name: version}``. Every process it starts is added to ``procs`` (so the session can stop them)."""
    reason = pypi_unreachable()
    if reason:
        return {"skip": reason}
    env, pip = clean_pip_env(), [sys.executable, "-m", "pip"]
    # uv must not fetch an interpreter of the target version: the resolve builds nothing (binary wheels only)
    env.update(UV_CACHE_DIR=str(tmp / "uv-cache"), UV_PYTHON_DOWNLOADS="never")

    def run(cmd: list[str], timeout: int) -> tuple[int, str]:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append(proc)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            return -9, f"timed out after {timeout} s\n{out[-3000:]}"
        return proc.returncode, out

    rc, out = run([*pip, "install", "--no-cache-dir", "--index-url", PYPI_INDEX, "--target", str(tmp / "uv"), UV], 300)
    result: dict[str, Any] = {"wheel_rc": rc, "wheel_out": out[-3000:]}
    if rc:
        return result
    wheels = tmp / "wheels"
    rc, out = run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir", "--index-url", PYPI_INDEX,
                   "-w", str(wheels), *SDIST_ONLY], 300)
    result.update(wheel_rc=rc, wheel_out=out[-3000:])
    if rc:
        return result
    resolved = tmp / "resolved.txt"
    cmd = [str(tmp / "uv" / "bin" / "uv"), "pip", "compile", "--no-config", "--python", sys.executable,
           "--python-version", python, "--python-platform", PLATFORM, "--index-url", PYPI_INDEX,
           "--find-links", str(wheels),
           "--only-binary", ":all:", "--no-header", "--no-annotate", "-o", str(resolved)]
    rc, out = run([*cmd, str(REPO / "requirements" / "gpu.lock")], 840)
    result.update(resolve_rc=rc, resolve_out=out)
    if rc:
        return result
    lines = [ln.split(";")[0].strip() for ln in resolved.read_text().splitlines()]
    result["resolved"] = dict(ln.split("==", 1) for ln in lines if "==" in ln and not ln.startswith("#"))
    # bfcl-eval goes in with --no-deps (requirements/no-deps.txt): it needs a wheel for the platform too
    cmd[cmd.index(str(resolved))] = str(tmp / "nodeps.txt")
    result["nodeps_rc"], out = run([*cmd, "--no-deps", str(REPO / "requirements" / "no-deps.txt")], 300)
    result["nodeps_out"] = out[-3000:]
    return result


def _shared_basetemp(tmp_path_factory: pytest.TempPathFactory) -> Path | None:
    """The temporary root every pytest-xdist worker of this run shares (each worker's own basetemp is a child of
    it); None outside xdist."""
    return tmp_path_factory.getbasetemp().parent if os.environ.get("PYTEST_XDIST_WORKER") else None


def _wait_for_file(path: Path, fut: Future, timeout: float = 1800.0) -> None:
    """Resolve ``fut`` from the JSON another worker writes to ``path`` (``{"error": …}`` becomes an exception)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            fut.set_exception(TimeoutError(f"no GPU-lock resolve result at {path} after {timeout:.0f} s"))
            return
        time.sleep(2.0)
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError) as exc:  # written atomically, so this is a bug: name the file, do not hang the test
        fut.set_exception(RuntimeError(f"unreadable GPU-lock resolve result {path}: {exc}"))
        return
    if "error" in result:
        fut.set_exception(RuntimeError(f"the GPU-lock resolve failed on another worker: {result['error']}"))
    else:
        fut.set_result(result)


@pytest.fixture(scope="session", autouse=True)
def gpu_lock_resolves(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                      ) -> Iterator[dict[str, Future]]:
    """``{python: Future of resolve_gpu_lock}`` for each interpreter the selected GPU-lock tests ask for.

    The resolve waits minutes on PyPI and uses little CPU, so it starts in a background thread when the session
    starts (this fixture is autouse) and the test only waits for its result: the wait overlaps the other tests
    instead of adding to the run. Nothing starts when that test is not selected (e.g. ``-m "not slow"``).

    Under pytest-xdist every worker collects every test, and any of them may be handed the test: the first worker
    to claim the resolve (an exclusively created file in the shared temporary root) runs it and writes its result
    there, the others wait for that file, and the claiming worker's session does not end before it is written."""
    wanted = sorted({item.callspec.params["python"] for item in request.session.items
                     if getattr(item, "originalname", None) == GPU_LOCK_TEST})
    shared = _shared_basetemp(tmp_path_factory)
    futures: dict[str, Future] = {}
    procs: list[subprocess.Popen] = []
    owned: list[threading.Thread] = []
    for python in wanted:
        fut: Future = Future()
        futures[python] = fut
        out = shared / f"gpu-lock-{python}.json" if shared else None
        if out is not None:
            try:
                os.close(os.open(out.with_suffix(".claim"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:  # another worker runs it
                threading.Thread(target=_wait_for_file, args=(out, fut), daemon=True).start()
                continue
        tmp = tmp_path_factory.mktemp(f"gpu-lock-{python}")

        def work(fut: Future = fut, tmp: Path = tmp, python: str = python, out: Path | None = out) -> None:
            try:
                result = resolve_gpu_lock(tmp, python, procs)
            except BaseException as exc:  # noqa: BLE001 - handed to the test through the future
                fut.set_exception(exc)
                result = {"error": repr(exc)}
            else:
                fut.set_result(result)
            if out is not None:
                part = out.with_suffix(".part")
                part.write_text(json.dumps(result))
                part.replace(out)

        thread = threading.Thread(target=work, name=f"gpu-lock-resolve-{python}", daemon=True)
        thread.start()
        owned.append(thread)
    yield futures
    if shared is not None:  # another worker may be waiting for the result
        for thread in owned:
            thread.join(timeout=1800)
    for proc in procs:  # a session that ends early (-x, Ctrl-C) leaves no pip behind
        if proc.poll() is None:
            proc.kill()


@pytest.fixture(scope="session", autouse=True)
def warm_start_built_first(request: pytest.FixtureRequest, gpu_lock_resolves: dict[str, Future]) -> None:
    """Builds the warm-started tiny Qwen3 (``envace.models.warmstart.ensure_warm_model``; cached) when the session
    starts, if a selected test is marked ``warm_start``, after the GPU lock's resolve has started.

    The build's two torch threads stall when another process shares their cores (a step went from 0.26 to 2.6 s),
    so it must not run beside other tests on pytest-xdist workers (``scripts/test.sh`` runs the slow tests on two).
    Every worker collects the whole selection and so calls the build when its session starts: one builds, the
    others wait on the build's file lock, idle, before any test runs."""
    if any(item.get_closest_marker("warm_start") for item in request.session.items):
        from envace.models.warmstart import ensure_warm_model

        ensure_warm_model()
