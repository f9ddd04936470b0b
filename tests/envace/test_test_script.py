"""``scripts/test.sh``, the README's test command: the tests not marked ``slow`` run on pytest-xdist workers, the
``slow`` ones after them in one process, and a failure in either set fails the command (run on a scratch suite of
three tests, through the project's real virtualenv)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SUITE = {
    "test_fast.py": "def test_fast():\n    pass\n",
    "test_slow.py": "import pytest\n\n\n@pytest.mark.slow\ndef test_slow():\n    pass\n",
}


def run(tmp_path: Path, *args: str, workers: str = "2", files: dict[str, str] = SUITE) -> subprocess.CompletedProcess:
    suite = tmp_path / "suite"
    suite.mkdir(exist_ok=True)
    for name, text in files.items():
        (suite / name).write_text(text)
    env = dict(os.environ, ENVACE_TEST_WORKERS=workers)
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


def test_one_worker_runs_in_process_and_nothing_selected_is_exit_5(tmp_path):
    proc = run(tmp_path, "-v", workers="1")
    assert proc.returncode == 0 and "created:" not in proc.stdout, proc.stdout + proc.stderr
    proc = run(tmp_path, "-k", "no_such_test")
    assert proc.returncode == 5, proc.stdout + proc.stderr


@pytest.mark.parametrize("workers", ["0", "two", "-1"])
def test_a_bad_worker_count_is_refused(tmp_path, workers):
    proc = run(tmp_path, workers=workers)
    assert proc.returncode == 2 and "ENVACE_TEST_WORKERS must be a positive integer" in proc.stderr, proc.stderr
