"""The ``envace`` console script (pyproject's [project.scripts]) dispatches to the real CLIs.

The script once pointed at a module that did not exist (``envace.cli`` came later): every call crashed with
ModuleNotFoundError and the one test of it skipped. So the declaration is checked against the installed
entry point and the module it loads, and the installed script runs as a subprocess (from another directory)."""

from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

import envace.cli
from envace.cli import COMMANDS, main

REPO = Path(__file__).resolve().parents[2]


def test_every_command_module_has_a_main():
    import importlib

    for module, _ in COMMANDS.values():
        assert callable(importlib.import_module(module).main)


def test_dispatch_and_errors(capsys):
    assert main(["envs", "list"]) == 0
    assert "synthetic" in capsys.readouterr().out
    assert main(["no-such-command"]) == 2 and "unknown command" in capsys.readouterr().err
    assert main([]) == 2 and main(["--help"]) == 0


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_command_gets_its_arguments(command, capsys):
    """``envace COMMAND --help`` is that command's own help (its parser saw the arguments, not envace's)."""
    try:
        code = main([command, "--help"])
    except SystemExit as exc:  # argparse's --help
        code = exc.code
    assert code == 0
    out = capsys.readouterr().out
    assert "usage:" in out and "envace COMMAND" not in out
    assert {"train": "Hydra overrides", "eval": "{tau2,bfcl,synthetic,w2r,table,tts-table,sweep}",
            "envs": "gold replays", "data": "record-traces",
            "models": "{build,path,export}"}[command] in out


def test_the_declared_console_script_is_the_installed_one():
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert declared == {"envace": "envace.cli:main"}
    try:
        dist = md.distribution("envace")
    except md.PackageNotFoundError:
        pytest.skip("envace is not installed in this interpreter (run from a source tree)")
    (ep,) = [ep for ep in dist.entry_points if ep.group == "console_scripts" and ep.name == "envace"]
    assert ep.value == declared["envace"]  # a stale install would name another target: reinstall (bootstrap.sh)
    assert ep.load() is envace.cli.main  # the module and the function exist (the old crash)


def script_path() -> Path:
    try:
        md.distribution("envace")
    except md.PackageNotFoundError:
        pytest.skip("envace is not installed in this interpreter (run from a source tree)")
    for folder in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        exe = Path(folder) / "envace"
        if exe.is_file():
            return exe
    raise AssertionError(f"envace is installed but its console script is missing from {sysconfig.get_path('scripts')}")


def run_script(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **env}
    return subprocess.run([str(script_path()), *args], cwd=cwd, env=environ, capture_output=True, text=True,
                          timeout=300, check=False)


def test_installed_console_script_runs(tmp_path):
    out = run_script("--help", cwd=tmp_path)
    assert out.returncode == 0 and "usage: envace COMMAND" in out.stdout, out.stderr[-2000:]
    assert all(f"  {name} " in out.stdout for name in COMMANDS)

    out = run_script("envs", "list", cwd=tmp_path)
    assert out.returncode == 0 and "bfcl_multi_turn" in out.stdout and "tau2" in out.stdout, out.stderr[-2000:]

    out = run_script("models", "path", cwd=tmp_path, ENVACE_CACHE=str(tmp_path / "cache"))
    assert out.returncode == 0 and out.stdout.strip() == str(tmp_path / "cache" / "models" / "tiny-qwen3")

    out = run_script("eval", "bfcl", "--limit", "1", cwd=tmp_path)  # the eval CLI's own argument check
    assert out.returncode == 2 and "give --base-url and --model" in out.stderr

    out = run_script("no-such-command", cwd=tmp_path)
    assert out.returncode == 2 and "unknown command 'no-such-command'" in out.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written into the working directory
