"""``scripts/test.sh``, the README's test command: the tests not marked ``slow`` run on pytest-xdist workers, the
``slow`` ones after them (on two workers a file per worker, trainer ranks on fewer threads; on one, the ``heavy``
ones one after another with the others beside them), and a failure in either set fails the command (run on a
scratch suite of a few tests, through the project's real virtualenv)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SUITE = {
    "test_fast.py": "def test_fast():\n    pass\n",
    # the slow test records the trainer threads it was given
    "test_slow.py": ("import os\nimport pytest\n\n\n@pytest.mark.slow\ndef test_slow():\n"
                     "    with open(os.environ['THREADS_OUT'], 'w') as fh:\n"
                     "        fh.write(os.environ.get('ENVACE_TRAINER_THREADS', 'unset'))\n"),
}


def run(tmp_path: Path, *args: str, workers: str = "2", slow_workers: str = "1", files: dict[str, str] = SUITE,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``scripts/test.sh ARGS`` on the scratch suite; the caller's ``ENVACE_TRAINER_THREADS`` is dropped unless
    ``env`` sets it."""
    suite = tmp_path / "suite"
    suite.mkdir(exist_ok=True)
    for name, text in files.items():
        (suite / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if k != "ENVACE_TRAINER_THREADS"} | (env or {})
    env.update(ENVACE_TEST_WORKERS=workers, ENVACE_SLOW_WORKERS=slow_workers, THREADS_OUT=str(tmp_path / "threads"))
    return subprocess.run([str(REPO / "scripts" / "test.sh"), "-p", "no:cacheprovider", "-c", str(REPO / "pyproject.toml"),
                           "--rootdir", str(suite), *args, str(suite)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)


#: a heavy and a light slow test that each wait for the other to start: they pass only when they run at once (the
#: heavy one opens the gate, as the project's conftest does once the warm start is built)
BESIDE = {
    "test_fast.py": SUITE["test_fast.py"],
    "test_heavy.py": ("import os, pathlib, time\nimport pytest\n\n\n@pytest.mark.slow\n@pytest.mark.heavy\n"
                      "def test_heavy():\n    out = pathlib.Path(os.environ['THREADS_OUT']).parent\n"
                      "    (out / 'heavy').touch()\n    pathlib.Path(os.environ['ENVACE_TEST_GATE']).touch()\n"
                      "    deadline = time.monotonic() + 120\n"
                      "    while not (out / 'light').exists():\n        assert time.monotonic() < deadline\n"
                      "        time.sleep(0.1)\n"),
    "test_light.py": ("import os, pathlib, time\nimport pytest\n\n\n@pytest.mark.slow\n"
                      "def test_light():\n    out = pathlib.Path(os.environ['THREADS_OUT']).parent\n"
                      "    (out / 'light').touch()\n    deadline = time.monotonic() + 120\n"
                      "    while not (out / 'heavy').exists():\n        assert time.monotonic() < deadline\n"
                      "        time.sleep(0.1)\n"),
}


def test_one_slow_worker_runs_the_light_slow_tests_beside_the_heavy_ones(tmp_path):
    proc = run(tmp_path, "-v", files=BESIDE)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    fast, heavy, light = out.split("test session starts")[1:]  # the light session's output comes last
    assert "test_fast.py::test_fast" in fast
    assert "test_heavy.py::test_heavy PASSED" in heavy and "test_light.py::" not in heavy, heavy
    assert "test_light.py::test_light PASSED" in light and "test_heavy.py::" not in light, light
    # a failure on either side fails the command
    files = dict(BESIDE, **{"test_light.py": BESIDE["test_light.py"] + "    assert False\n"})
    (tmp_path / "failing").mkdir()
    proc = run(tmp_path / "failing", "-m", "slow", files=files)
    heavy, light = proc.stdout.split("test session starts")[1:]
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 passed" in heavy and "1 failed" in light, proc.stdout


#: the heavy test builds for 5 s before it opens the gate; the light one checks that the build was done when it started
GATED = {
    "test_heavy.py": ("import os, pathlib, time\nimport pytest\n\n\n@pytest.mark.slow\n@pytest.mark.heavy\n"
                      "def test_heavy():\n    out = pathlib.Path(os.environ['THREADS_OUT']).parent\n"
                      "    time.sleep(5)\n    (out / 'built').touch()\n"
                      "    pathlib.Path(os.environ['ENVACE_TEST_GATE']).touch()\n"),
    "test_light.py": ("import os, pathlib\nimport pytest\n\n\n@pytest.mark.slow\n"
                      "def test_light():\n    assert (pathlib.Path(os.environ['THREADS_OUT']).parent / 'built').exists()\n"),
}


def test_the_light_slow_tests_wait_for_the_heavy_sessions_gate_or_its_end(tmp_path):
    """The slow tests beside the heavy ones start only once the heavy session opens ``$ENVACE_TEST_GATE`` (the
    warm start's build must not share the machine); a heavy session that never opens it (a selection without the
    project's conftest) lets them start when it ends."""
    proc = run(tmp_path, "-m", "slow", files=GATED)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (tmp_path / "built").unlink()
    ungated = {"test_heavy.py": GATED["test_heavy.py"].replace(
        "    pathlib.Path(os.environ['ENVACE_TEST_GATE']).touch()\n", ""), "test_light.py": GATED["test_light.py"]}
    proc = run(tmp_path, "-m", "slow", files=ungated)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_fast_tests_run_on_workers_then_slow_tests_in_one_process(tmp_path):
    proc = run(tmp_path, "-v")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    # three pytest sessions, in this order: the fast tests, the heavy slow ones (none here), the other slow ones
    first, heavy, second = out.split("test session starts")[1:]
    assert "created: 2/2 workers" in first and re.search(r"PASSED \S*test_fast.py::test_fast", first), first
    assert "created:" not in second and "test_slow.py::test_slow PASSED" in second, second
    assert "1 passed in" in first and "2 deselected" in heavy and "1 passed, 1 deselected" in second
    assert (tmp_path / "threads").read_text() == "unset"  # one slow process: the trainer's own default


def test_slow_tests_on_two_workers_get_a_file_each_and_fewer_trainer_threads(tmp_path):
    proc = run(tmp_path, "-v", slow_workers="2")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    second = out.split("test session starts")[2]
    assert "created: 2/2 workers" in second and "LoadFileScheduling" in second, second
    assert re.search(r"PASSED \S*test_slow.py::test_slow", second), second
    cpus = len(os.sched_getaffinity(0))
    assert (tmp_path / "threads").read_text() == str(max(1, cpus // 4))
    # a value set by the caller is kept
    proc = run(tmp_path, "-m", "slow", slow_workers="2", env={"ENVACE_TRAINER_THREADS": "3"})
    assert proc.returncode == 0 and (tmp_path / "threads").read_text() == "3", proc.stdout + proc.stderr


def test_a_failing_fast_test_fails_the_command_and_the_slow_tests_still_run(tmp_path):
    files = dict(SUITE, **{"test_fast.py": "def test_fast():\n    assert False\n"})
    proc = run(tmp_path, "-v", files=files)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "test_slow.py::test_slow PASSED" in out


def test_a_marker_expression_runs_one_set(tmp_path):
    proc = run(tmp_path, "-v", "-m", "not slow")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "created: 2/2 workers" in out and "test_slow" not in out, out
    proc = run(tmp_path, "-v", "-m", "slow")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "created:" not in out and "test_slow.py::test_slow PASSED" in out, out
    proc = run(tmp_path, "-v", "-m", "slow", slow_workers="2")
    assert proc.returncode == 0 and "created: 2/2 workers" in proc.stdout, proc.stdout + proc.stderr


def test_one_worker_runs_in_process_and_nothing_selected_is_exit_5(tmp_path):
    proc = run(tmp_path, "-v", workers="1")
    assert proc.returncode == 0 and "created:" not in proc.stdout, proc.stdout + proc.stderr
    proc = run(tmp_path, "-k", "no_such_test")
    assert proc.returncode == 5, proc.stdout + proc.stderr


#: the scratch suite and a slow test marked ``extended`` that records that it ran
EXTENDED = dict(SUITE, **{"test_extended.py": (
    "import os, pathlib\nimport pytest\n\n\n@pytest.mark.slow\n@pytest.mark.extended\ndef test_extended():\n"
    "    (pathlib.Path(os.environ['THREADS_OUT']).parent / 'extended').touch()\n")})


@pytest.mark.parametrize("args", [(), ("-m", "slow")])
def test_extended_tests_run_only_with_extended_and_are_counted_when_left_out(tmp_path, args):
    proc = run(tmp_path, "-v", *args, files=EXTENDED)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "test_slow.py::test_slow PASSED" in out, out
    assert not (tmp_path / "extended").exists() and "test_extended.py::" not in out, out
    assert out.rstrip().endswith("envace: 1 test marked extended not run (scripts/test.sh --extended runs them; "
                                 "docs/testing.md)"), out[-500:]
    proc = run(tmp_path, "-v", "--extended", *args, files=EXTENDED)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "test_extended.py::test_extended PASSED" in out, out
    assert (tmp_path / "extended").exists() and "marked extended not run" not in out, out
    # a selection without extended tests ends without the line
    proc = run(tmp_path, "-m", "not slow", files=EXTENDED)
    assert proc.returncode == 0 and "marked extended" not in proc.stdout + proc.stderr, proc.stdout


@pytest.mark.parametrize("variable", ["ENVACE_TEST_WORKERS", "ENVACE_SLOW_WORKERS"])
@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_a_bad_worker_count_is_refused(tmp_path, variable, value):
    proc = run(tmp_path, **{"workers" if variable == "ENVACE_TEST_WORKERS" else "slow_workers": value})
    assert proc.returncode == 2 and f"{variable} must be a positive integer" in proc.stderr, proc.stderr
