"""A training run's prompt files are named by version in the typed config (``envace.agent.rehearsal.version``,
``envace.agent.tools_added_version``, ``envace.reward.checklist.prompt_version``) and recorded in its run directory
(envace/config.py ``record_prompt_versions``, called at launch); an unknown version is a one-line config error
naming the key."""

from __future__ import annotations

import json

import pytest

from envace.config import (
    PROMPT_VERSIONS_FILE,
    ConfigError,
    EnvAceConfig,
    prompt_versions,
    record_prompt_versions,
    validate_envace_config,
)
from envace.verl.config import compose

V1 = {"rehearsal": "v1", "tools_added": "v1", "checklist_judge": "v1"}


def test_the_composed_config_names_v1_of_each_prompt():
    ecfg = validate_envace_config(compose([]))
    assert prompt_versions(ecfg) == prompt_versions(EnvAceConfig()) == V1


@pytest.mark.parametrize(("key", "file"), [("envace.agent.rehearsal.version", "rehearsal_v9.txt"),
                                           ("envace.agent.tools_added_version", "tools_added_v9.txt")])
def test_an_unknown_prompt_version_is_one_line_naming_the_key(key, file):
    with pytest.raises(ConfigError) as exc:
        validate_envace_config(compose([f"{key}=v9"]))
    msg = str(exc.value)
    assert f"{key} 'v9' has no file" in msg and file in msg and "\n" not in msg


def test_each_launch_appends_its_versions_to_the_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    path = record_prompt_versions(run_dir, EnvAceConfig())
    assert path == run_dir / PROMPT_VERSIONS_FILE
    record_prompt_versions(run_dir, EnvAceConfig())  # a resumed run: a second line
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["prompts"] for x in lines] == [V1] * 2
    assert all(x["time"] for x in lines)
