"""The on-disk graph cache (``envsched/graph_cache.py``): the key follows the pool's content and the graph's
config fields, a restart loads instead of rebuilding and reproduces the same matrices, an unreadable entry is
rebuilt, custom extractors skip the cache."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import scipy.sparse as sp

from envsched import EnvSchedConfig, EnvScheduler, TaskPool, build_static_graph
from envsched import graph_cache as graph_mod
from envsched.graph_cache import graph_cache_key, load_or_build_graph
from envsched.operations import DeterministicExtractor
from envsched.synthetic import synthetic_records


# ---- graph cache ----------------------------------------------------------------------------------------
def _same_graph(a, b):
    for x, y in ((a.x_full, b.x_full), (a.x_abs, b.x_abs)):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.array_equal(x.indptr, y.indptr) and np.array_equal(x.indices, y.indices) and np.array_equal(x.data, y.data)
    assert np.array_equal(a.mean_within_env_similarity(), b.mean_within_env_similarity())
    assert [m.tolist() for m in a.env_members] == [m.tolist() for m in b.env_members]
    assert a.extractor_counts == b.extractor_counts and a.view_shapes == b.view_shapes


def test_graph_cache_restart_loads_instead_of_rebuilding(tmp_path, monkeypatch):
    pool = TaskPool.from_records(synthetic_records(5, 6, seed=4))
    cfg = EnvSchedConfig(batch_size=8, graph_cache_dir=str(tmp_path / "cache"))
    plain = EnvScheduler(pool, cfg.replace(graph_cache_dir=None))
    first = EnvScheduler(pool, cfg)
    assert plain.graph.cache == "off" and first.graph.cache == "miss" and first.graph_report()["cache"] == "miss"
    _same_graph(plain.graph, first.graph)

    def no_build(*a, **k):
        raise AssertionError("rebuilt although cached")

    monkeypatch.setattr(graph_mod, "build_static_graph", no_build)
    restarted = EnvScheduler(TaskPool.from_records(synthetic_records(5, 6, seed=4)), cfg)  # a new process: new pool object
    assert restarted.graph.cache == "hit"
    _same_graph(plain.graph, restarted.graph)
    assert [d.model_dump() for d in restarted.graph.descriptions] == [d.model_dump() for d in plain.graph.descriptions]
    for step in range(4):  # same batches as without the cache
        ids = plain.select(step)
        assert restarted.select(step) == ids
        rewards = {t: [float((k + step) % 2), 1.0] for k, t in enumerate(ids)}
        plain.observe(step, rewards), restarted.observe(step, rewards)


def test_graph_cache_key_follows_pool_content_and_graph_config(tmp_path):
    recs = synthetic_records(3, 4, seed=1)
    pool = TaskPool.from_records(recs)
    cfg = EnvSchedConfig(graph_cache_dir=str(tmp_path))
    key = graph_mod.graph_cache_key(pool, cfg)
    assert graph_mod.graph_cache_key(pool, cfg.replace(rho=0.25, batch_size=4, graph_cache_dir="/elsewhere")) == key  # not graph fields
    assert graph_mod.graph_cache_key(pool, cfg.replace(view_weights=(0.3, 0.06, 0.16, 0.12, 0.16, 0.2))) != key
    assert graph_mod.graph_cache_key(pool, cfg.replace(tfidf_float32=False)) != key
    assert graph_mod.graph_cache_key(pool, cfg.replace(operation_extractor="llm", llm={"base_urls": ["http://h/v1"], "model": "m"})) != key
    edited = [dict(r) for r in recs]
    edited[5] = {**recs[5], "instruction": recs[5]["instruction"] + " now"}
    assert graph_mod.graph_cache_key(TaskPool.from_records(edited), cfg) != key
    g1 = graph_mod.load_or_build_graph(pool, cfg)
    g2 = graph_mod.load_or_build_graph(pool, cfg.replace(view_weights=(0.3, 0.06, 0.16, 0.12, 0.16, 0.2)))
    assert (g1.cache, g2.cache) == ("miss", "miss") and len([p for p in tmp_path.iterdir() if not p.name.startswith(".")]) == 2


def test_unreadable_cache_entry_is_rebuilt_and_custom_extractors_skip_the_cache(tmp_path, caplog):
    pool = TaskPool.from_records(synthetic_records(3, 4, seed=1))
    cfg = EnvSchedConfig(graph_cache_dir=str(tmp_path))
    g = graph_mod.load_or_build_graph(pool, cfg)
    key = graph_mod.graph_cache_key(pool, cfg)
    (tmp_path / key / "graph.npz").write_bytes(b"not a zip")
    with caplog.at_level(logging.WARNING, logger="envsched.graph_cache"):
        again = graph_mod.load_or_build_graph(pool, cfg)
    assert again.cache == "miss" and "unreadable" in caplog.text
    _same_graph(g, again)
    assert graph_mod.load_or_build_graph(pool, cfg).cache == "hit"

    class Custom(DeterministicExtractor):
        pass

    assert graph_mod.load_or_build_graph(pool, cfg, extractor=Custom()).cache == "skip"
    assert graph_mod.load_or_build_graph(pool, cfg, extractor=DeterministicExtractor()).cache == "hit"


@pytest.fixture(scope="module")
def pool():
    return TaskPool.from_records(synthetic_records(6, 40, seed=3))


def _same(a: sp.csr_matrix, b: sp.csr_matrix) -> bool:
    a, b = sp.csr_matrix(a), sp.csr_matrix(b)
    return a.shape == b.shape and a.dtype == b.dtype and all(np.array_equal(getattr(a, k), getattr(b, k)) for k in ("indptr", "indices", "data"))


def test_graph_cache_key_and_hit(pool, tmp_path):
    cfg = EnvSchedConfig(graph_cache_dir=str(tmp_path))
    key = graph_cache_key(pool, cfg)
    t0 = pool.tasks[0]
    changed = TaskPool([dataclasses.replace(t0, instruction=t0.instruction + " today"), *pool.tasks[1:]])
    assert graph_cache_key(changed, cfg) != key  # pool content
    assert graph_cache_key(pool, cfg.replace(view_weights=(0.3, 0.06, 0.16, 0.12, 0.16, 0.2))) != key  # config
    assert graph_cache_key(pool, cfg.replace(k_within=3)) == key  # a field the graph does not depend on
    built = load_or_build_graph(pool, cfg)
    assert built.cache == "miss"
    hit = load_or_build_graph(TaskPool(pool.tasks), cfg)
    assert hit.cache == "hit"
    plain = build_static_graph(pool, EnvSchedConfig())
    for g in (built, hit):
        assert _same(g.x_full, plain.x_full) and _same(g.x_abs, plain.x_abs)
        assert np.array_equal(g.mean_within_env_similarity(), plain.mean_within_env_similarity())
    assert [d.model_dump() for d in hit.descriptions[:3]] == [d.model_dump() for d in plain.descriptions[:3]]
    assert load_or_build_graph(changed, cfg).cache == "miss"
