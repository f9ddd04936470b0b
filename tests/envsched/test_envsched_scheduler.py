"""Public API: config errors, JSONL pool errors, select/observe/predict, metrics, state_dict round-trip."""

import copy
import json
import pickle

import numpy as np
import pytest

from envsched import ConfigError, EnvSchedConfig, EnvScheduler, PoolFormatError, TaskPool
from envsched.synthetic import SimulatedLearner, synthetic_records


@pytest.fixture(scope="module")
def records():
    return synthetic_records(8, 10, seed=5)


@pytest.fixture(scope="module")
def graph(records):
    return EnvScheduler(TaskPool.from_records(records), EnvSchedConfig(batch_size=12)).graph


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


# ---- pool -------------------------------------------------------------------------------------------
def _write(tmp_path, lines):
    p = tmp_path / "pool.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


GOOD = json.dumps({"task_id": "a", "env_id": "e", "instruction": "do it"})


@pytest.mark.parametrize(
    "line, reason",
    [
        ('{"task_id": "b", "env_id": "e", "instruction": "x"', "invalid JSON"),
        ('{"task_id": "b", "env_id": "e"}', "missing required key 'instruction'"),
        ('{"task_id": "b", "env_id": "e", "instruction": "x", "verifer_code": "1"}', "unknown key(s) ['verifer_code']"),
        ('{"task_id": "b", "env_id": "e", "instruction": "x", "tools": [{"description": "no name"}]}', "tools[0] has no string 'name'"),
        ('{"task_id": "b", "env_id": "e", "instruction": "x", "gold_actions": [{"name": "f", "arguments": "{bad"}]}', "gold_actions[0].arguments is not valid JSON"),
        ('{"task_id": "a", "env_id": "e", "instruction": "x"}', "duplicate task_id 'a' (first on line 1)"),
        ('[1, 2]', "record must be a JSON object"),
        ('{"task_id": "", "env_id": "e", "instruction": "x"}', "'task_id' must be a non-empty string"),
    ],
)
def test_jsonl_errors_name_line_and_reason(tmp_path, line, reason):
    p = _write(tmp_path, [GOOD, "", line])
    with pytest.raises(PoolFormatError) as exc:
        TaskPool.from_jsonl(p)
    assert exc.value.line == 3
    assert f"{p}:3: " in str(exc.value) and reason in str(exc.value)


def test_jsonl_round_trip(tmp_path, records):
    pool = TaskPool.from_records(records[:5])
    pool.to_jsonl(tmp_path / "p.jsonl")
    again = TaskPool.from_jsonl(tmp_path / "p.jsonl")
    assert again.tasks == pool.tasks and again.fingerprint() == pool.fingerprint()


# ---- scheduler ----------------------------------------------------------------------------------------
def _learner(records, pool):
    arch = np.array([r["meta"]["archetype"] for r in records])
    return SimulatedLearner(pool.env, arch, np.array([len(r["verifier_checks"]) for r in records]), seed=1)


def _run(s, learner, pool, steps, trace):
    for step in steps:
        ids = s.select(step)
        trace.append(ids)
        nodes = pool.indices(ids)
        R = learner.rollout(nodes, 8)
        learner.train(nodes, R)
        s.observe(step, {t: r.tolist() for t, r in zip(ids, R)})


def test_select_observe_predict_and_metrics(records, graph):
    pool = TaskPool.from_records(records)
    s = EnvScheduler(pool, EnvSchedConfig(batch_size=12), graph=graph)
    learner = _learner(records, pool)
    trace = []
    _run(s, learner, pool, range(6), trace)
    for ids in trace:
        assert len(ids) == len(set(ids)) == 12
    assert s.select(5) == trace[5] and s.select(2) == trace[2]  # idempotent for selected steps
    with pytest.raises(ValueError, match="backwards"):
        s.select(-1)
    m = s.metrics()
    for key in ("realized_var_mean", "realized_var_median", "predicted_var_mean", "envs_per_batch", "tools_per_batch", "coverage_count",
                "exploitation_count", "progress_filtered", "identifier_filtered", "select_time_s", "schedule_time_s"):
        assert isinstance(m[f"envsched/{key}"], float), key
    assert m["envsched/coverage_count"] == 6 and m["envsched/exploitation_count"] == 6
    assert all(k.startswith("envsched/") for k in m)
    p = s.predict()
    assert p.v.shape == p.m.shape == p.d.shape == p.q.shape == (len(pool),)
    assert 0 < p.q.min() and p.q.max() < 1 and np.all(p.v >= 0) and np.all(p.v <= 0.25)
    assert set(p.as_dict()[pool.task_ids[0]]) == {"v", "m", "d", "q"}
    s.select(6)
    with pytest.raises(KeyError, match="unknown task_id 'nope'"):
        s.observe(6, {"nope": [1.0]})


@pytest.mark.parametrize("mode", ["envsched", "random"])
def test_state_dict_round_trip_matches_uninterrupted_run(records, graph, mode):
    pool = TaskPool.from_records(records)
    cfg = EnvSchedConfig(batch_size=12, scheduler=mode, seed=7)
    a = EnvScheduler(pool, cfg, graph=graph)
    la = _learner(records, pool)
    head = []
    _run(a, la, pool, range(5), head)
    state = pickle.loads(pickle.dumps(a.state_dict()))
    lb = copy.deepcopy(la)
    tail_a = []
    _run(a, la, pool, range(5, 10), tail_a)

    b = EnvScheduler(pool, cfg, graph=graph)
    b.load_state_dict(state)
    tail_b = []
    _run(b, lb, pool, range(5, 10), tail_b)
    assert tail_a == tail_b
    assert np.allclose(a.predict().q, b.predict().q)


def test_state_from_other_pool_is_rejected(records, graph):
    pool = TaskPool.from_records(records)
    s = EnvScheduler(pool, EnvSchedConfig(batch_size=12), graph=graph)
    other = EnvScheduler(TaskPool.from_records(records[:-1]), EnvSchedConfig(batch_size=12, scheduler="random"))
    with pytest.raises(ValueError, match="different task pool"):
        other.load_state_dict(s.state_dict())


def test_random_mode_is_seeded_and_builds_no_graph(records):
    pool = TaskPool.from_records(records)
    a = EnvScheduler(pool, {"batch_size": 12, "scheduler": "random", "seed": 3})
    b = EnvScheduler(pool, {"batch_size": 12, "scheduler": "random", "seed": 3})
    assert a.select(0) == b.select(0)
    assert a._graph is None


def test_batch_larger_than_pool_is_a_config_error(records):
    with pytest.raises(ConfigError, match="batch_size"):
        EnvScheduler(TaskPool.from_records(records[:5]), {"batch_size": 6, "scheduler": "random"})


def test_tiny_pool_relaxes_caps_instead_of_short_batches():
    recs = synthetic_records(1, 10, seed=0)  # one environment: C1 = 4 cannot fill a batch of 8
    pool = TaskPool.from_records(recs)
    s = EnvScheduler(pool, EnvSchedConfig(batch_size=8))
    for step in range(4):
        ids = s.select(step)
        assert len(set(ids)) == 8
        s.observe(step, {t: [1.0, 0.0, 0.5] for t in ids})
    assert s.metrics(3)["envsched/cap_relaxations"] > 0
