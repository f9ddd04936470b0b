"""Fixtures of the envace tests: ``train_sh``, a run of ``scripts/train.sh`` for the end-to-end trainer tests,
``gpu_lock_resolves``, the GPU locks' resolves against PyPI started when the session starts, and
``warm_start_built_first``, the warm start's build before the first test that is marked to use it (the fake OpenAI
server and its reply builders are in ``tests/conftest.py``)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
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


# -- the GPU locks' resolves against PyPI (test_install.py's test_gpu_lock_resolves_*) -------------------------------
#: the tests whose resolves start with the session: uv's resolve of each lock for each supported Python's oldest
#: release on the oldest supported glibc, and pip's resolve with a real interpreter of each supported Python version
UV_RESOLVE_TEST = "test_gpu_lock_resolves_for_linux_x86_64_cuda"
PIP_RESOLVE_TEST = "test_gpu_lock_resolves_with_a_real_interpreter"
PYPI_INDEX = os.environ.get("ENVACE_PYPI_INDEX", "https://pypi.org/simple")
#: uv evaluates environment markers for a target Python that is not installed (``--python-version``); pip's
#: ``--python-version`` changes only wheel tags and Requires-Python checks and evaluates markers with the running
#: interpreter, so a pip resolve "for 3.12" on 3.11 passed a lock that cannot install on 3.12
UV = "uv==0.13.9"
#: the pip that resolves with a real interpreter, pinned: pip 23.2.1 (what pyenv's 3.11.7 and 3.12.1 bring) downloads
#: every wheel at the end of a ``--dry-run`` resolve (433 MB for vllm 0.19.1 alone); 26.3 stops at the metadata
PIP = "pip==26.3"
#: pure-Python distributions PyPI has only as sdists; built locally into wheels for the binary-only resolves
SDIST_ONLY = ("antlr4-python3-runtime==4.9.3",)
#: the oldest glibc the GPU locks support: vllm 0.19.1's and llguidance 1.7.6's wheels are manylinux_2_31 (Ubuntu
#: 20.04, Debian 11); every pin must have a wheel for it
PLATFORM = "x86_64-manylinux_2_31"
#: where pyenv keeps the interpreters it builds
PYENV_VERSIONS = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions"
#: a resolve's key: ("uv", lock, full Python version) or ("pip", lock, Python minor version)
ResolveKey = tuple[str, str, str]


def pypi_unreachable() -> str | None:
    try:
        urllib.request.urlopen(f"{PYPI_INDEX}/pip/", timeout=15).close()
    except OSError as exc:
        return f"{PYPI_INDEX} unreachable ({exc})"
    return None


def clean_pip_env() -> dict[str, str]:
    """This machine's pip/uv config (local wheel folders, a CPU torch) must not stand in for PyPI."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "UV_")) and k != "PYTHONPATH"}
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def find_cpython(minor: str, pyenv_versions: Path = PYENV_VERSIONS, path: str | None = None) -> Path | None:
    """A CPython interpreter of version ``minor`` ("3.12") on this machine: the newest pyenv build of it, else
    ``python3.12`` on ``path`` (default: PATH); None when there is none. Each candidate is run and must report
    itself as CPython ``minor`` (a pyenv shim for a version pyenv does not have fails here)."""
    def release(exe: Path) -> tuple[int, ...]:
        return tuple(int(x) for x in re.findall(r"\d+", exe.parent.parent.name))

    candidates = sorted(pyenv_versions.glob(f"{minor}.*/bin/python{minor}"), key=release, reverse=True)
    on_path = shutil.which(f"python{minor}", path=os.environ.get("PATH", "") if path is None else path)
    candidates += [Path(on_path)] if on_path else []
    probe = "import platform, sys; print(platform.python_implementation(), '%d.%d' % sys.version_info[:2])"
    for exe in candidates:
        try:
            out = subprocess.run([str(exe), "-c", probe], capture_output=True, text=True, timeout=60, check=False)
        except (OSError, subprocess.SubprocessError):
            continue
        if out.returncode == 0 and out.stdout.split() == ["CPython", minor]:
            return exe
    return None


@pytest.fixture(scope="session")
def cpython_finder() -> Callable[..., Path | None]:
    """find_cpython, for test_install.py's test of the interpreter lookup the real-interpreter resolves rely on."""
    return find_cpython


def _run(cmd: list[str], env: dict[str, str], procs: list[subprocess.Popen], timeout: int) -> tuple[int, str]:
    """``cmd``'s return code and output (stdout and stderr); the process is added to ``procs`` so that the session
    can stop it."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    procs.append(proc)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        return -9, f"timed out after {timeout} s\n{out[-3000:]}"
    return proc.returncode, out


def prepare_resolvers(tmp: Path, procs: list[subprocess.Popen]) -> dict[str, Any]:
    """What every resolve needs, once per session: uv (``tmp/uv``) and pip (``tmp/pip``) from PyPI, and wheels of
    the sdist-only pins (``tmp/wheels``). ``{"skip": reason}`` when PyPI is unreachable, else the setup's return code
    and output tail."""
    reason = pypi_unreachable()
    if reason:
        return {"skip": reason}
    env, pip = clean_pip_env(), [sys.executable, "-m", "pip"]
    common = ["--no-cache-dir", "--index-url", PYPI_INDEX]
    for cmd in ([*pip, "install", *common, "--target", str(tmp / "uv"), UV],
                [*pip, "install", *common, "--no-deps", "--target", str(tmp / "pip"), PIP],
                [*pip, "wheel", *common, "--no-deps", "--no-build-isolation", "-w", str(tmp / "wheels"),
                 *SDIST_ONLY]):
        rc, out = _run(cmd, env, procs, 300)
        if rc:
            return {"setup_rc": rc, "setup_out": f"{' '.join(cmd)}\n{out[-3000:]}"}
    return {"setup_rc": 0, "setup_out": ""}


def _pins(lines: list[str]) -> dict[str, str]:
    lines = [ln.split(";")[0].strip() for ln in lines]
    return dict(ln.split("==", 1) for ln in lines if "==" in ln and not ln.startswith("#"))


def resolve_with_uv(tmp: Path, lock: str, python: str, procs: list[subprocess.Popen]) -> dict[str, Any]:
    """uv's resolve of ``requirements/<lock>`` (and no-deps.txt) for CPython ``python`` (a full version: markers
    such as ``python_full_version < "3.11.3"`` are evaluated for it) on manylinux x86-64 at the oldest supported
    glibc (PLATFORM), binary wheels only, reading package metadata only: each step's return code and output tail,
    the resolved ``{name: version}`` and the seconds it took."""
    # uv must not fetch an interpreter of the target version: the resolve builds nothing (binary wheels only)
    env = dict(clean_pip_env(), UV_CACHE_DIR=str(tmp / "uv-cache"), UV_PYTHON_DOWNLOADS="never")
    start, work = time.monotonic(), tmp / f"uv-{lock}-{python}"
    work.mkdir()
    resolved = work / "resolved.txt"
    cmd = [str(tmp / "uv" / "bin" / "uv"), "pip", "compile", "--no-config", "--python", sys.executable,
           "--python-version", python, "--python-platform", PLATFORM, "--index-url", PYPI_INDEX,
           "--find-links", str(tmp / "wheels"), "--only-binary", ":all:", "--no-header", "--no-annotate",
           "-o", str(resolved)]
    rc, out = _run([*cmd, str(REPO / "requirements" / lock)], env, procs, 840)
    result: dict[str, Any] = {"resolve_rc": rc, "resolve_out": out[-6000:]}
    if rc == 0:
        result["resolved"] = _pins(resolved.read_text().splitlines())
        # bfcl-eval goes in with --no-deps (requirements/no-deps.txt): it needs a wheel for the platform too
        cmd[cmd.index(str(resolved))] = str(work / "nodeps.txt")
        result["nodeps_rc"], out = _run([*cmd, "--no-deps", str(REPO / "requirements" / "no-deps.txt")], env,
                                        procs, 300)
        result["nodeps_out"] = out[-3000:]
    result["seconds"] = round(time.monotonic() - start, 1)
    return result


def resolve_with_pip(tmp: Path, lock: str, minor: str, procs: list[subprocess.Popen]) -> dict[str, Any]:
    """pip's resolve of ``requirements/<lock>`` with a real CPython ``minor`` interpreter (find_cpython), the way
    scripts/bootstrap.sh installs it: ``pip install --dry-run --ignore-installed --report``, binary wheels only,
    markers and wheel tags those of that interpreter on this machine. Nothing is installed, and only metadata is
    read: PEP 658 metadata files where the index advertises them, else HTTP range requests into each wheel
    (``fast-deps``). ``{"skip": reason}`` without such an interpreter; else the interpreter, the return code and
    output tail, the resolved ``{name: version}``, the wheels pip downloaded whole (none expected) and the seconds."""
    exe = find_cpython(minor)
    if exe is None:
        return {"skip": f"no CPython {minor} interpreter on this machine (looked for {PYENV_VERSIONS}/{minor}.*/bin/"
                        f"python{minor} and python{minor} on PATH): {lock} is not resolved with a real {minor}"}
    env = dict(clean_pip_env(), PYTHONPATH=str(tmp / "pip"))  # the pinned pip, ahead of the interpreter's own
    start, report = time.monotonic(), tmp / f"pip-{lock}-{minor}.json"
    rc, out = _run([str(exe), "-s", "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-cache-dir",
                    "--index-url", PYPI_INDEX, "--find-links", str(tmp / "wheels"), "--only-binary", ":all:",
                    "--use-feature=fast-deps", "--report", str(report), "-r", str(REPO / "requirements" / lock)],
                   env, procs, 840)
    result: dict[str, Any] = {"interpreter": str(exe), "resolve_rc": rc, "resolve_out": out[-6000:],
                              "downloaded": re.findall(r"^\s*Downloading (\S+\.whl)", out, re.MULTILINE)}
    if rc == 0:
        done = json.loads(report.read_text())
        result["python"] = done["environment"]["python_full_version"]
        result["resolved"] = {i["metadata"]["name"]: i["metadata"]["version"] for i in done["install"]}
    result["seconds"] = round(time.monotonic() - start, 1)
    return result


def _shared_basetemp(tmp_path_factory: pytest.TempPathFactory) -> Path | None:
    """The temporary root every pytest-xdist worker of this run shares (each worker's own basetemp is a child of
    it); None outside xdist."""
    return tmp_path_factory.getbasetemp().parent if os.environ.get("PYTEST_XDIST_WORKER") else None


def _result_file(shared: Path, key: ResolveKey) -> Path:
    return shared / f"gpu-lock-{'-'.join(key)}.json"


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


def _run_resolves(tmp: Path, futures: dict[ResolveKey, Future], shared: Path | None,
                  procs: list[subprocess.Popen]) -> None:
    """Prepare the resolvers once, then run every resolve in ``futures`` (four at a time: they wait on the network),
    setting each future and, under xdist, writing its result where the other workers wait for it."""
    def finish(key: ResolveKey, result: dict[str, Any] | None, exc: BaseException | None = None) -> None:
        if exc is None:
            futures[key].set_result(result)
        else:
            futures[key].set_exception(exc)
            result = {"error": repr(exc)}
        if shared is not None:
            part = _result_file(shared, key).with_suffix(".part")
            part.write_text(json.dumps(result))
            part.replace(_result_file(shared, key))

    try:
        setup = prepare_resolvers(tmp, procs)
    except BaseException as exc:  # noqa: BLE001 - handed to every test through its future
        for key in futures:
            finish(key, None, exc)
        return
    if setup.get("setup_rc", 0) != 0 or "skip" in setup:  # every test reports the setup's failure or skip
        for key in futures:
            finish(key, setup)
        return

    def one(key: ResolveKey) -> None:
        tool, lock, python = key
        try:
            resolve = resolve_with_pip if tool == "pip" else resolve_with_uv
            finish(key, {**setup, **resolve(tmp, lock, python, procs)})
        except BaseException as exc:  # noqa: BLE001 - handed to the test through its future
            finish(key, None, exc)

    # pip's resolves take longest (tens of seconds of range requests each): they go first
    with ThreadPoolExecutor(max_workers=4, thread_name_prefix="gpu-lock-resolve") as pool:
        list(pool.map(one, sorted(futures, key=lambda k: k[0] != "pip")))


@pytest.fixture(scope="session", autouse=True)
def gpu_lock_resolves(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                      ) -> Iterator[dict[ResolveKey, Future]]:
    """``{(tool, lock, python): Future of its result}`` for each resolve the selected GPU-lock tests ask for
    (resolve_with_uv, resolve_with_pip).

    The resolves wait minutes on PyPI and use little CPU, so they start in a background thread when the session
    starts (this fixture is autouse) and each test only waits for its result: the wait overlaps the other tests
    instead of adding to the run. Nothing starts when those tests are not selected (e.g. ``-m "not slow"``).

    Under pytest-xdist every worker collects every test, and any of them may be handed one: the first worker to
    claim the resolves (an exclusively created file in the shared temporary root) runs them all and writes each
    result there, the others wait for those files, and the claiming worker's session does not end before they are
    written."""
    tools = {UV_RESOLVE_TEST: "uv", PIP_RESOLVE_TEST: "pip"}
    keys = sorted({(tools[item.originalname], item.callspec.params["lock"], item.callspec.params["python"])
                   for item in request.session.items if getattr(item, "originalname", None) in tools})
    futures: dict[ResolveKey, Future] = {key: Future() for key in keys}
    shared = _shared_basetemp(tmp_path_factory)
    procs: list[subprocess.Popen] = []
    owner: threading.Thread | None = None
    if keys:
        claimed = True
        if shared is not None:
            try:
                os.close(os.open(shared / "gpu-lock-resolves.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:  # another worker runs them
                claimed = False
        if claimed:
            owner = threading.Thread(target=_run_resolves, name="gpu-lock-resolves", daemon=True,
                                     args=(tmp_path_factory.mktemp("gpu-lock"), futures, shared, procs))
            owner.start()
        else:
            for key, fut in futures.items():
                threading.Thread(target=_wait_for_file, args=(_result_file(shared, key), fut), daemon=True).start()
    yield futures
    if shared is not None and owner is not None:  # another worker may be waiting for the results
        owner.join(timeout=1800)
    for proc in procs:  # a session that ends early (-x, Ctrl-C) leaves no resolver behind
        if proc.poll() is None:
            proc.kill()


@pytest.fixture(scope="session", autouse=True)
def warm_start_built_first(request: pytest.FixtureRequest,
                           gpu_lock_resolves: dict[ResolveKey, Future]) -> None:
    """Builds the warm-started tiny Qwen3 (``envace.models.warmstart.ensure_warm_model``; cached) when the session
    starts, if a selected test is marked ``warm_start``, after the GPU lock's resolve has started.

    The build's two torch threads stall when another process shares their cores (a step went from 0.26 to 2.6 s),
    so it must not run beside other tests on pytest-xdist workers (``scripts/test.sh`` runs the slow tests on two).
    Every worker collects the whole selection and so calls the build when its session starts: one builds, the
    others wait on the build's file lock, idle, before any test runs.

    Then it touches ``$ENVACE_TEST_GATE`` where that is set: ``scripts/test.sh`` starts the slow tests that run
    beside the heavy ones only then, so the build has the machine to itself."""
    if any(item.get_closest_marker("warm_start") for item in request.session.items):
        from envace.models.warmstart import ensure_warm_model

        ensure_warm_model()
    if os.environ.get("ENVACE_TEST_GATE"):
        Path(os.environ["ENVACE_TEST_GATE"]).touch()
