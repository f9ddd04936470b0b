"""The test-time rehearsal settings (envace/loop_config.py TTSConfig) are one typed config with one source of
defaults, reached three ways: the dataclass, the evaluation CLI (one flag per field, named in its metadata:
envace/eval/args.py) and Hydra (``envace.tts``: configs/envace/default.yaml, envace/config.py). A field's default is
the same whichever way it is reached, a value set either way gives the same config, and a bad value fails with one
line naming the flag or the key."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envace.config import ConfigError, tts_config_from, validate_envace_config
from envace.eval.args import tts_from_args
from envace.eval.cli import build_parser, main
from envace.loop_config import TTS_MODES, TTSConfig
from envace.verl.config import compose

ENDPOINT = ["--base-url", "http://127.0.0.1:9/v1", "--model", "m"]
DEFAULT_YAML = Path(__file__).resolve().parents[2] / "configs" / "envace" / "default.yaml"
FIELDS = {f.name: f for f in dataclasses.fields(TTSConfig)}
HINTS = typing.get_type_hints(TTSConfig)


def by_cli(*argv: str) -> TTSConfig:
    return tts_from_args(build_parser().parse_args(["bfcl", *ENDPOINT, *argv]))


@pytest.fixture(scope="module")
def hydra_default() -> TTSConfig:
    return validate_envace_config(compose([])).tts


def test_every_default_is_the_same_from_the_dataclass_the_cli_and_hydra(hydra_default):
    """The CLI without any rehearsal flag, Hydra without any envace.tts key and the dataclass agree, field by field;
    the YAML copy of the group is the dataclass's (tests/envace/test_config_defaults.py checks every value)."""
    assert by_cli() == TTSConfig() == hydra_default
    assert tts_config_from({}) == TTSConfig()  # a file without the section: the defaults too
    assert set(yaml.safe_load(DEFAULT_YAML.read_text())["tts"]) == set(FIELDS)


def test_each_flag_is_the_one_its_field_names_and_the_yaml_comment_names_it():
    """The flags are generated from the fields' metadata: each field's flag sets that field and no other, and the
    documented YAML names the flag in the key's comment (so the Hydra key and the flag are findable from each other)."""
    lines = DEFAULT_YAML.read_text().splitlines()
    start = lines.index("tts:")
    for name, f in FIELDS.items():
        value = _SAMPLES.get(name, "x1")
        argv = [f.metadata["flag"]] if value is True else [f.metadata["flag"], str(value)]
        assert by_cli(*argv, *([] if name == "mode" else ["--tts", "parallel"])) == TTSConfig(
            **{"mode": "parallel", name: value}), name
        i = next(i for i in range(start, len(lines)) if lines[i].strip().startswith(f"{name}:"))
        assert f"({f.metadata['flag']}" in lines[i - 1], f"default.yaml: the comment of tts.{name} names no flag"


#: a value other than the default for each non-string field
_SAMPLES: dict[str, Any] = {"mode": "parallel", "rehearsals": 3, "act_temperature": 0.5, "act_top_p": 0.5,
                            "rehearse_temperature": 0.5, "rehearse_top_p": 0.5, "evaluate_temperature": 0.5,
                            "evaluate_top_p": 0.5, "summarize_temperature": 0.5, "summarize_top_p": 0.5,
                            "judge_max_tokens": 64, "repair_rounds": 2, "json_schema": True, "prompt_version": "v1",
                            "max_trajectory_chars": 100, "max_context_chars": 100, "max_memory_items": 3,
                            "memory": "verbatim", "max_memory_chars": 100}
#: words Hydra's override grammar reads as something other than a string
_NOT_STRINGS = {"null", "true", "false", "nan", "inf", "none", "yes", "no", "on", "off"}


def _value(name: str) -> st.SearchStrategy[Any]:
    """Valid values of a field, other than its default."""
    if name == "mode":
        return st.sampled_from([m for m in TTS_MODES if m != "none"])
    if name == "prompt_version":
        return st.just("v1")
    if name == "memory":
        return st.just("verbatim")
    base = next((a for a in typing.get_args(HINTS[name]) if a is not type(None)), HINTS[name])
    if base is bool:
        return st.just(True)
    if base is str:
        return st.from_regex(r"[a-z][a-z0-9]{0,8}", fullmatch=True).filter(lambda s: s not in _NOT_STRINGS)
    if name.endswith("_temperature"):
        return st.sampled_from([0.0, 0.25, 1.5, 2.0])
    if name.endswith("_top_p"):
        return st.sampled_from([0.05, 0.5, 0.9])
    return st.integers(min_value=1, max_value=50)


@st.composite
def _changes(draw: st.DrawFn) -> dict[str, Any]:
    names = draw(st.lists(st.sampled_from(sorted(FIELDS)), min_size=1, max_size=5, unique=True))
    changes = {n: draw(_value(n)) for n in names}
    changes.setdefault("mode", "parallel")  # every other setting needs rehearsals (the CLI refuses it without)
    return changes


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=_changes())
def test_a_value_set_by_flag_or_by_hydra_key_gives_the_same_config(changes):
    argv: list[str] = []
    overrides: list[str] = []
    for name, value in changes.items():
        flag = FIELDS[name].metadata["flag"]
        argv += [flag] if value is True else [flag, str(value)]
        overrides.append(f"envace.tts.{name}={str(value).lower() if isinstance(value, bool) else value}")
    expected = TTSConfig(**changes)
    assert by_cli(*argv) == expected
    assert validate_envace_config(compose(overrides)).tts == expected


@pytest.mark.parametrize(("flag", "key", "value", "reason"), [
    ("--rehearsals", "rehearsals", "0", "must be >= 1, got 0"),
    ("--act-top-p", "act_top_p", "0", "must be in (0, 1], got 0"),
    ("--evaluate-temperature", "evaluate_temperature", "3", "must be in [0, 2], got 3"),
    ("--tts-repair-rounds", "repair_rounds", "-1", "must be >= 0, got -1"),
    ("--tts-prompt-version", "prompt_version", "v9", "'v9' has no file"),
    ("--tts-memory", "memory", "digest", "must be one of ['summary', 'verbatim'], got 'digest'"),
    ("--tts-max-memory-chars", "max_memory_chars", "0", "must be >= 1, got 0"),
])
def test_a_bad_value_fails_with_one_line_naming_the_flag_or_the_key(flag, key, value, reason, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["bfcl", *ENDPOINT, "--tts", "parallel", flag, value, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and f"{flag} {reason}" in err[0]
    assert not (tmp_path / "o").exists()
    with pytest.raises(ConfigError) as hexc:
        validate_envace_config(compose([f"envace.tts.{key}={value}"]))
    msg = str(hexc.value)
    assert f"envace.tts.{key} {reason}" in msg and "\n" not in msg


def test_a_hydra_type_error_names_the_key():
    with pytest.raises(ConfigError, match=re.escape("envace.tts.rehearsals")):
        validate_envace_config(compose(["envace.tts.rehearsals=many"]))
    with pytest.raises(ConfigError, match=re.escape("envace.tts.rehersals")):  # a typo of a key
        validate_envace_config(compose(["+envace.tts.rehersals=3"]))


def test_an_experiment_file_sets_the_keys_the_flags_leave_out(tmp_path, capsys):
    """``--tts-config FILE`` reads ``envace.tts`` of an experiment file (Hydra's form); flags given override it."""
    exp = tmp_path / "eval_tts.yaml"
    exp.write_text("# @package _global_\nenvace:\n  tts:\n    mode: sequential\n    rehearsals: 3\n"
                   "    evaluate_temperature: 0.2\n")
    assert by_cli("--tts-config", str(exp)) == TTSConfig(mode="sequential", rehearsals=3, evaluate_temperature=0.2)
    assert by_cli("--tts-config", str(exp), "--rehearsals", "5", "--tts", "parallel") == TTSConfig(
        mode="parallel", rehearsals=5, evaluate_temperature=0.2)
    assert validate_envace_config(compose(["envace.tts.mode=sequential", "envace.tts.rehearsals=3",
                                           "envace.tts.evaluate_temperature=0.2"])).tts == by_cli(
        "--tts-config", str(exp))
    exp.write_text("envace:\n  tts:\n    mode: parallel\n    rehearsals: 0\n")
    with pytest.raises(SystemExit) as exc:
        main(["bfcl", *ENDPOINT, "--tts-config", str(exp), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1
    assert f"--tts-config {exp}" in err[0] and "envace.tts.rehearsals must be >= 1" in err[0]
    exp.write_text("envace:\n  tts:\n    rehearsal: 2\n")
    with pytest.raises(SystemExit):
        main(["bfcl", *ENDPOINT, "--tts-config", str(exp), "--tts", "parallel", "--out", str(tmp_path / "o")])
    assert "'envace.tts.rehearsal'" in capsys.readouterr().err
    exp.write_text("envace:\n  tts:\n    mode: none\n")
    with pytest.raises(SystemExit):
        main(["bfcl", *ENDPOINT, "--tts-config", str(exp), "--out", str(tmp_path / "o")])
    assert "--tts-config has no effect without --tts" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
