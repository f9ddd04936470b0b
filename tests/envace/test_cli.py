"""The ``envace`` console script (pyproject's [project.scripts]) dispatches to the real CLIs."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from envace.cli import COMMANDS, main


def test_every_command_module_has_a_main():
    import importlib

    for module, _ in COMMANDS.values():
        assert callable(importlib.import_module(module).main)


def test_dispatch_and_errors(capsys):
    assert main(["envs", "list"]) == 0
    assert "synthetic" in capsys.readouterr().out
    assert main(["no-such-command"]) == 2 and "unknown command" in capsys.readouterr().err
    assert main([]) == 2 and main(["--help"]) == 0


def test_installed_console_script_runs():
    exe = shutil.which("envace", path=str(__import__("pathlib").Path(sys.executable).parent))
    if exe is None:
        pytest.skip("the console script is not installed in this interpreter's environment")
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0 and "envace COMMAND" in out.stdout
