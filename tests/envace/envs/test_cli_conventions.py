"""One CLI error convention across every entry point (issue 33, deliverable 2; findings 6-8, 13): a usage or input
mistake exits 2 with ONE line on stderr naming the culprit, and no traceback.

The table: entry point × {missing file, empty file, malformed line, wrong type of path, out-of-range number}; a cell
an entry point has no input for is left out (``None``), never faked. Python entry points run in-process through
their ``main`` (argparse's own errors arrive as SystemExit); ``scripts/build_worldbook.sh`` runs as a subprocess
(its argument errors come before it touches the virtualenv). Then: ``python -m envace.data record-traces`` writes
nothing for a selection that selects nothing (finding 8), and a failed ``build_worldbook.sh`` leaves no ``OUT/books`` behind
so the corrected rerun runs (finding 13; run against a copy of the script whose bootstrap only names this
interpreter, so the test never installs anything)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def _mains() -> dict[str, Callable]:
    from envace.data.__main__ import main as data
    from envace.envs.__main__ import main as envs
    from envace.eval.cli import main as eval_
    from envace.models.__main__ import main as models
    from trace2env.__main__ import main as t2e

    return {"trace2env": t2e, "envace.envs": envs, "envace.data": data, "envace.eval": eval_,
            "envace.models": models}


@pytest.fixture
def files(tmp_path) -> dict[str, Path]:
    f = {"missing": tmp_path / "missing.jsonl", "empty": tmp_path / "empty.jsonl", "bad": tmp_path / "bad.jsonl",
         "dir": tmp_path / "adir", "file": tmp_path / "afile", "run": tmp_path / "run", "badrun": tmp_path / "badrun"}
    f["empty"].write_text("")
    f["bad"].write_text('{"messages": []}\n{"messages": [}\n')
    f["dir"].mkdir()
    f["file"].write_text("x")
    f["run"].mkdir()
    (f["run"] / "summary.json").write_text("")
    f["badrun"].mkdir()
    (f["badrun"] / "summary.json").write_text("{\n")
    return f


A, E, M, W, R = "missing file", "empty file", "malformed line", "wrong type of path", "out-of-range number"
# (entry point, case) -> (argv with {placeholders} for the files fixture, text the one line must contain)
TABLE: dict[tuple[str, str], tuple[list[str], str] | None] = {
    ("trace2env", A): (["build", "{missing}", "--out", "{dir}/o"], "missing.jsonl: cannot read"),
    ("trace2env", E): (["build", "{empty}", "--out", "{dir}/o"], "empty.jsonl: holds no trace"),
    ("trace2env", M): (["build", "{bad}", "--out", "{dir}/o"], "bad.jsonl:2: not valid JSON"),
    ("trace2env", W): (["eval", "{file}", "{bad}"], "afile is not a directory"),
    ("trace2env", R): (["eval", "{dir}", "{bad}", "--n-boot", "-1"], "--n-boot"),
    ("envace.envs", A): (["verify", "bfcl_multi_turn", "t", "{missing}"], "missing.jsonl: cannot read"),
    ("envace.envs", E): (["verify", "bfcl_multi_turn", "--batch", "{empty}"], "empty.jsonl: holds no task"),
    ("envace.envs", M): (["verify", "bfcl_multi_turn", "--batch", "{bad}"], "bad.jsonl:2: not valid JSON"),
    ("envace.envs", W): (["verify", "bfcl_multi_turn", "t", "{dir}"], "adir: a directory"),
    ("envace.envs", R): (["gold", "bfcl_multi_turn", "--limit", "0"], "--limit"),
    ("envace.data", A): (["convert-cm2", "{missing}", "{dir}/o"], "missing.jsonl does not exist"),
    ("envace.data", E): (["--pool-kwargs", "", "record-traces", "--pool", "synthetic", "--out", "{dir}/t.jsonl"],
                         "--pool-kwargs"),
    ("envace.data", M): (["convert-cm2", "{bad}", "{dir}/o"], "record 1 at $: line 2 is not valid JSON"),
    ("envace.data", W): (["record-traces", "--pool", "synthetic", "--out", "{dir}"], "adir: a directory"),
    ("envace.data", R): (["record-traces", "--pool", "synthetic", "--max-tasks", "-5", "--out", "{dir}/t.jsonl"],
                         "--max-tasks: expected an integer >= 1"),
    ("envace.eval", A): (["table", "{missing}"], "missing.jsonl/summary.json not found"),
    ("envace.eval", E): (["table", "{run}"], "run/summary.json: not a readable summary.json"),
    ("envace.eval", M): (["tts-table", "{badrun}"], "badrun/summary.json: not a readable summary.json"),
    ("envace.eval", W): (["bfcl", "--base-url", "http://127.0.0.1:9/v1", "--model", "m", "--out", "{file}"],
                         "--out"),
    ("envace.eval", R): (["bfcl", "--base-url", "http://127.0.0.1:9/v1", "--model", "m", "--temperature", "nan"],
                         "--temperature"),
    ("envace.models", A): None,  # reads no file
    ("envace.models", E): None,
    ("envace.models", M): None,
    ("envace.models", W): (["build", "--out", "{file}"], "--out"),
    ("envace.models", R): None,  # no numeric flag
}


@pytest.mark.parametrize(("entry", "case"), [k for k, v in TABLE.items() if v is not None],
                         ids=[f"{e}:{c}" for (e, c), v in TABLE.items() if v is not None])
def test_every_entry_point_answers_a_mistake_with_one_line_and_exit_2(entry, case, files, capsys, monkeypatch,
                                                                       tmp_path):
    monkeypatch.chdir(tmp_path)
    argv_t, expect = TABLE[(entry, case)]
    argv = []
    for a in argv_t:
        for k, v in files.items():
            a = a.replace("{" + k + "}", str(v))
        argv.append(a)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    try:
        code = _mains()[entry](argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert expect in err, err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written


SCRIPT = REPO / "scripts" / "build_worldbook.sh"


def _script(tmp_path: Path, bootstrap: str) -> Path:
    """A copy of build_worldbook.sh whose bootstrap.sh is ``bootstrap``: the real one may install a virtualenv,
    which a test must never do (not even when the script regresses and reaches it)."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, root / "scripts" / "build_worldbook.sh")
    (root / "scripts" / "bootstrap.sh").write_text(bootstrap)
    return root / "scripts" / "build_worldbook.sh"


@pytest.mark.parametrize(("args", "expect"), [
    (["--pool", "synthetic", "--out", "{o}", "--max-tasks"], "--max-tasks needs a value"),
    (["--pool", "synthetic", "--out", "{o}", "--max-tasks", "0"], "--max-tasks: expected an integer >= 1, got '0'"),
    (["--pool", "synthetic", "--out", "{f}"], "--out {f} is a file"),
    (["--pool", "synthetic", "--out"], "--out needs a value"),
    (["--pool", "synthetic", "--out", "{o}", "--bogus"], "unknown argument --bogus"),
])
def test_finding7_build_worldbook_sh_argument_errors_are_one_line(args, expect, tmp_path):
    script = _script(tmp_path, 'echo "bootstrap reached" >&2; exit 99\n')
    f = tmp_path / "afile"
    f.write_text("x")
    fill = {"o": str(tmp_path / "out"), "f": str(f)}
    proc = subprocess.run(["bash", str(script), *[a.format(**fill) for a in args]], capture_output=True, text=True,
                          timeout=60, check=False)
    err = proc.stderr
    assert proc.returncode == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"build_worldbook.sh: {expect.format(**fill)}"), err
    assert not (tmp_path / "out").exists()  # nothing written, the virtualenv never touched


def test_finding8_a_selection_of_nothing_writes_nothing(tmp_path, capsys):
    from envace.data.__main__ import main

    out = tmp_path / "t.jsonl"
    for argv, expect in ((["--env-id", "nope"], "--env-id nope: no train-split task of pool 'synthetic'"),
                         (["--split", "bogus"], "--split 'bogus': expected train, test or all"),
                         (["--max-tasks", "-5"], "--max-tasks: expected an integer >= 1, got '-5'"),
                         (["--pool-kwargs", '{"synthetic": {"n_envs": "x"}}'], "--pool-kwargs for 'synthetic'")):
        globals_, verb = (argv, []) if argv[0] == "--pool-kwargs" else ([], argv)
        try:
            code = main([*globals_, "record-traces", "--pool", "synthetic", "--out", str(out), *verb])
        except SystemExit as e:
            code = e.code
        err = capsys.readouterr().err
        assert code == 2 and expect in err and len(err.strip().splitlines()) == 1, err
        assert not out.exists()
    assert main(["--pool-kwargs", '{"synthetic": {"n_envs": 1, "tasks_per_env": 6}}', "record-traces", "--pool",
                 "synthetic", "--max-tasks", "2", "--out", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 2  # --max-tasks 2 is the first two, never "all but the last two"


def test_finding13_a_failed_build_leaves_no_books_and_the_corrected_rerun_runs(tmp_path):
    script = _script(tmp_path, f"PY={sys.executable}; export PY\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    out = tmp_path / "wb"
    cmd = ["bash", str(script), "--pool", "synthetic", "--out", str(out),
           "--pool-kwargs", json.dumps({"n_envs": 1, "tasks_per_env": 10, "seed": 3})]
    bad = subprocess.run([*cmd, "--", "--max-tokens", "0"], capture_output=True, text=True, timeout=300, check=False,
                         env=env, cwd=tmp_path)
    assert bad.returncode == 2 and "--max-tokens" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
    assert not (out / "books").exists()
    good = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False, env=env, cwd=tmp_path)
    assert good.returncode == 0, good.stderr
    books = sorted(p.name for p in (out / "books").iterdir())
    assert len(books) == 1 and not (out / ".books.partial").exists()
    from trace2env import load_worldbooks

    single, by_env = load_worldbooks(out / "books")
    assert not single and list(by_env) == ["syn-bank-00"] and by_env["syn-bank-00"].manifest.source_pool == "synthetic"


TABLE_SCRIPT = REPO / "scripts" / "eval_trace2env_table.sh"


@pytest.mark.parametrize(("args", "expect"), [
    (["--out"], "--out needs a value"),
    (["--out", "{o}", "--n-boot", "0"], "--n-boot: expected an integer >= 1, got '0'"),
    (["--out", "{o}", "--subset", "--no-det"], "--subset needs a value"),
    (["--out", "{o}", "--repair-rounds", "-1"], "--repair-rounds: expected an integer >= 0, got '-1'"),
    (["--out", "{o}", "--subset-lines", "3,x"], "--subset-lines: expected line numbers separated by commas"),
    (["--out", "{o}", "--benchmarks", "bfcl,nope"], "--benchmarks: unknown benchmark nope"),
    (["--out", "{f}"], "--out {f} is not a directory"),
    (["--out", "{o}", "--serve", "{o}/none"], "--serve {o}/none is not a directory"),
    (["--benchmarks", "bfcl"], "--out is required"),
    (["--out", "{o}", "--bogus"], "unknown argument --bogus"),
])
def test_eval_trace2env_table_sh_argument_errors_are_one_line(args, expect, tmp_path):
    """The same convention for the Trace2Env table script: checked before the virtualenv or the output folder."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(TABLE_SCRIPT, root / "scripts" / TABLE_SCRIPT.name)
    (root / "scripts" / "bootstrap.sh").write_text('echo "bootstrap reached" >&2; exit 99\n')
    f = tmp_path / "afile"
    f.write_text("x")
    fill = {"o": str(tmp_path / "out"), "f": str(f)}
    proc = subprocess.run(["bash", str(root / "scripts" / TABLE_SCRIPT.name), *[a.format(**fill) for a in args]],
                          capture_output=True, text=True, timeout=60, check=False)
    err = proc.stderr
    assert proc.returncode == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"eval_trace2env_table.sh: {expect.format(**fill)}"), err
    assert not (tmp_path / "out").exists()
