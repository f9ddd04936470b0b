"""EnvSched's config (``envsched/config.py``): unknown keys and bad values fail loudly, the defaults are the paper's
and the shipped YAML's."""

from __future__ import annotations

import pytest

from envsched import ConfigError, EnvSchedConfig


# ---- config -----------------------------------------------------------------------------------------
def test_unknown_config_key_fails_loudly():
    with pytest.raises(ConfigError, match="unknown config key 'bacth_size'"):
        EnvSchedConfig.from_dict({"bacth_size": 64})
    with pytest.raises(ConfigError, match="llm: unknown endpoint key 'modle'"):
        EnvSchedConfig.from_dict({"llm": {"modle": "x"}})
    with pytest.raises(ConfigError, match="'rho'"):
        EnvSchedConfig.from_dict({"rho": 1.5})
    with pytest.raises(ConfigError, match="'scheduler'"):
        EnvSchedConfig.from_dict({"scheduler": "greedy"})
    with pytest.raises(ConfigError, match="clip_v"):
        EnvSchedConfig.from_dict({"clip_v": [0.3, 0.1]})


def test_config_defaults_are_the_papers_and_yaml(tmp_path):
    c = EnvSchedConfig()
    assert (c.batch_size, c.rho, c.k_within, c.k_cross, c.lambda_g, c.lambda_s, c.h_long, c.h_short) == (64, 0.5, 6, 12, 2.0, 2.0, 8.0, 2.0)
    assert (c.eta_decline, c.exposure_c0, c.lambda_sim, c.cap_env_round, c.cap_env_window, c.cap_task_consecutive) == (0.5, 16.0, 0.08, 4, 11, 2)
    assert c.view_weights == (0.28, 0.08, 0.16, 0.12, 0.16, 0.20) and c.tfidf_max_features == 35000
    p = tmp_path / "c.yaml"
    p.write_text("envsched:\n  rho: 0.25\n  scheduler: random\n")
    assert EnvSchedConfig.from_yaml(p).rho == 0.25
    p.write_text("rho: 0.25\nsheduler: random\n")
    with pytest.raises(ConfigError, match="sheduler"):
        EnvSchedConfig.from_yaml(p)


def test_shipped_yaml_loads():
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "configs" / "envsched" / "envsched.yaml"
    assert EnvSchedConfig.from_yaml(path) == EnvSchedConfig()
    # it lists every field (a user reads the options there), so a new field cannot be left out of it
    import yaml

    listed = set(yaml.safe_load(path.read_text())["envsched"])
    assert listed == set(EnvSchedConfig.model_fields), set(EnvSchedConfig.model_fields) ^ listed


def test_new_fields_are_validated():
    with pytest.raises(ConfigError, match="'fusion'"):
        EnvSchedConfig.from_dict({"fusion": "average"})
    with pytest.raises(ConfigError, match="'cross_reference'"):
        EnvSchedConfig.from_dict({"cross_reference": "local"})
