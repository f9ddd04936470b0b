"""``scripts/test.sh``, the README's test command: the tests not marked ``slow`` run on pytest-xdist workers, the
``slow`` ones after them (on their own workers, a file per worker, trainer ranks on fewer threads), and a failure in
either set fails the command (run on a scratch suite of two tests, through the project's real virtualenv)."""

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


def test_fast_tests_run_on_workers_then_slow_tests_in_one_process(tmp_path):
    proc = run(tmp_path, "-v")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    first, second = out.split("test session starts")[1:]  # two pytest sessions, in this order
    assert "created: 2/2 workers" in first and re.search(r"PASSED \S*test_fast.py::test_fast", first), first
    assert "created:" not in second and "test_slow.py::test_slow PASSED" in second, second
    assert "1 passed in" in first and "1 passed, 1 deselected" in second
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


@pytest.mark.parametrize("variable", ["ENVACE_TEST_WORKERS", "ENVACE_SLOW_WORKERS"])
@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_a_bad_worker_count_is_refused(tmp_path, variable, value):
    proc = run(tmp_path, **{"workers" if variable == "ENVACE_TEST_WORKERS" else "slow_workers": value})
    assert proc.returncode == 2 and f"{variable} must be a positive integer" in proc.stderr, proc.stderr
