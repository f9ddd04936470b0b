"""configs/envace/default.yaml states the defaults of the schema dataclasses (envace/config.py and the sections it
embeds: LoopLimits, RehearsalPrompt, TTSConfig, ChecklistJudgeConfig) and nothing else: every YAML key is a dataclass
field with the same default, every dataclass field is in the YAML, recursively, and every key carries a comment. The
dataclasses are the one source; the YAML is their documented copy, checked here."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from omegaconf import OmegaConf

from envace.config import EnvAceConfig

DEFAULT_YAML = Path(__file__).resolve().parents[2] / "configs" / "envace" / "default.yaml"


def schema_defaults() -> dict[str, Any]:
    """The dataclass defaults as plain YAML values (tuples as lists, nested dataclasses as mappings)."""
    return OmegaConf.to_container(OmegaConf.structured(EnvAceConfig))  # type: ignore[return-value]


def drift(yaml_values: Any, defaults: Any, path: str = "envace") -> list[str]:
    """Every difference between a YAML mapping and the schema defaults, one line each, naming the key."""
    if isinstance(defaults, dict) and isinstance(yaml_values, dict):
        out = [f"{path}.{k}: in the YAML, not a field of the schema" for k in yaml_values if k not in defaults]
        out += [f"{path}.{k}: a schema field missing from the YAML" for k in defaults if k not in yaml_values]
        for k in defaults:
            if k in yaml_values:
                out += drift(yaml_values[k], defaults[k], f"{path}.{k}")
        return out
    same = yaml_values == defaults and type(yaml_values) is type(defaults)
    if not same and isinstance(defaults, float) and isinstance(yaml_values, int | float):
        same = float(yaml_values) == defaults and not isinstance(yaml_values, bool)
    return [] if same else [f"{path}: YAML {yaml_values!r} != dataclass default {defaults!r}"]


def test_default_yaml_equals_the_dataclass_defaults():
    assert drift(yaml.safe_load(DEFAULT_YAML.read_text()), schema_defaults()) == []


def test_every_default_yaml_key_is_commented():
    """A key's line is preceded by a comment line (the project documents every config-group field)."""
    lines = DEFAULT_YAML.read_text().splitlines()
    bare = []
    for i, line in enumerate(lines):
        if re.match(r"^\s*[A-Za-z_][A-Za-z0-9_]*:", line):
            above = lines[i - 1].strip() if i else ""
            if not above.startswith("#"):
                bare.append(f"default.yaml:{i + 1}: {line.strip()}")
    assert bare == []


def test_schema_sections_are_dataclasses_all_the_way_down():
    """Every nested section of the schema is a typed dataclass (no untyped dict standing for a section)."""
    def walk(cls: type, path: str) -> list[str]:
        out = []
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if dataclasses.is_dataclass(default):
                out += walk(type(default), f"{path}.{f.name}")
            elif f.name in ("judge", "simulator", "checklist"):
                out.append(f"{path}.{f.name}: {f.type}")
        return out

    untyped = [x for x in walk(EnvAceConfig, "envace") if "EndpointConfig" not in x]
    assert untyped == []


# -- the check itself catches drift ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "edit, expected",
    [
        (lambda y: y["agent"]["limits"].__setitem__("max_user_turns", 31),
         "envace.agent.limits.max_user_turns: YAML 31 != dataclass default 30"),
        (lambda y: y["reward"]["checklist"].__setitem__("repair_rounds", 2),
         "envace.reward.checklist.repair_rounds: YAML 2 != dataclass default 1"),
        (lambda y: y["agent"]["rehearsal"].pop("max_examples"),
         "envace.agent.rehearsal.max_examples: a schema field missing from the YAML"),
        (lambda y: y["data"].__setitem__("shuffle", True),
         "envace.data.shuffle: in the YAML, not a field of the schema"),
        (lambda y: y.__setitem__("preflight", "true"),
         "envace.preflight: YAML 'true' != dataclass default True"),
    ],
)
def test_drift_is_detected(edit, expected):
    """A scratch copy of the YAML with one default changed, dropped or added fails the check, naming the key."""
    values = yaml.safe_load(DEFAULT_YAML.read_text())
    edit(values)
    assert drift(values, schema_defaults()) == [expected]


def test_drift_of_a_dataclass_default_is_detected(monkeypatch):
    """The other direction: a dataclass default changed in code, the YAML left as it was."""
    from envace.config import AgentConfig
    from envace.loop_config import LoopLimits

    @dataclasses.dataclass
    class Drifted(LoopLimits):
        tool_memory_mb: int = 4096

    monkeypatch.setattr(EnvAceConfig.__dataclass_fields__["agent"], "default_factory",
                        lambda: AgentConfig(limits=Drifted()))
    defaults = OmegaConf.to_container(OmegaConf.structured(EnvAceConfig))
    assert drift(yaml.safe_load(DEFAULT_YAML.read_text()), defaults) == [
        "envace.agent.limits.tool_memory_mb: YAML 2048 != dataclass default 4096"]
