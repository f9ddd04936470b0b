"""The static graph (``envsched/graph.py``): Eq. 1 as the weighted sum of the views' cosines, the sparse row-block
products, code-structure tokens, the abstraction report (App. E.1), and a graph built in chunks, or by worker
processes, equal to one built in one chunk in this process."""

from __future__ import annotations

import ast
import dataclasses
import inspect

import numpy as np
import pytest
import scipy.sparse as sp
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.metrics.pairwise import cosine_similarity

from envsched import EnvSchedConfig, TaskPool, build_static_graph
from envsched.graph import _description_texts, _fallback_code_tokens, code_structure, sparse_row_block_dot
from envsched.synthetic import synthetic_records


def test_eq1_full_similarity_is_weighted_sum_of_view_cosines(small):
    pool, cfg, g = small
    texts = [t.instruction for t in pool.tasks]
    # view 1 alone, encoded independently with sklearn + cosine_similarity
    h1 = TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, min_df=1, max_features=35000).fit_transform(texts)
    h3 = TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True).fit_transform(["\n".join(t.verifier_checks) for t in pool.tasks])
    rows, cols = np.arange(10), np.arange(20, 30)
    s = g.sim_full(rows, cols)
    # remove the other views' contributions by rebuilding with one-hot weights
    g1 = build_static_graph(pool, cfg.replace(view_weights=(1, 0, 0, 0, 0, 0)))
    assert g1.sim_full(rows, cols) == pytest.approx(cosine_similarity(h1[rows], h1[cols]), abs=1e-9)
    g13 = build_static_graph(pool, cfg.replace(view_weights=(0.25, 0, 0.75, 0, 0, 0)))
    expect = 0.25 * cosine_similarity(h1[rows], h1[cols]) + 0.75 * cosine_similarity(h3[rows], h3[cols])
    assert g13.sim_full(rows, cols) == pytest.approx(expect, abs=1e-9)
    assert np.all(s <= 1 + 1e-9) and np.all(s >= 0)
    assert g.report()["extractors"] == {"deterministic": len(pool)}


def test_sparse_block_dot_matches_scipy(small):
    _, _, g = small
    rows, cols = np.array([3, 0, 47, 5]), np.array([1, 2, 3])
    assert sparse_row_block_dot(g.x_full, rows, cols) == pytest.approx((g.x_full[rows] @ g.x_full[cols].T).toarray())
    block = g.feature_block(3)
    for j in cols:
        block.add(int(j))
    assert block.dot(rows) == pytest.approx((g.x_full[rows] @ g.x_full[cols].T).toarray())
    assert block.dot(rows, 1, 2) == pytest.approx((g.x_full[rows] @ g.x_full[cols[1:2]].T).toarray())
    g.close_block(block)
    assert (g.scratch_map() == -1).all()


def test_code_structure_tokens():
    toks = code_structure("assert db['cards']['4411'].frozen == True\nok = check(x)").split()
    assert "Assert" in toks and "attr:frozen" in toks and "cmp:Eq" in toks and "call:check" in toks and "key:cards" in toks
    assert code_structure("if (x === 1) { y(); }")  # not Python: token fallback


def _code_structure_by_ast_walk(code: str) -> str:
    """code_structure as it was written with ``ast.walk`` (the reference its list-based walk must equal)."""
    if not code.strip():
        return ""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return " ".join(_fallback_code_tokens(code))
    toks: list[str] = []
    for node in ast.walk(tree):
        toks.append(type(node).__name__)
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name:
                toks.append(f"call:{name}")
        elif isinstance(node, ast.Attribute):
            toks.append(f"attr:{node.attr}")
        elif isinstance(node, ast.Name):
            toks.append(f"name:{node.id}")
        elif isinstance(node, ast.Compare):
            toks.extend(f"cmp:{type(op).__name__}" for op in node.ops)
        elif isinstance(node, ast.Constant):
            toks.append(f"const:{type(node.value).__name__}")
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
            toks.append(f"key:{node.slice.value}")
    return " ".join(toks)


def test_code_structure_equals_the_ast_walk_it_replaces(pool):
    codes = [t.verifier_code for t in pool.tasks] + [
        inspect.getsource(ast), inspect.getsource(dataclasses), "x[1]['a'].b(c)(d)", "a < b <= c != d", "1 +", "", "  ",
        "def f(*, a=1, **k):\n    return lambda y: [z async for z in y]", "match x:\n    case [1, *r]: pass\n    case {'k': v}: pass",
        "print(f'{a!r:>{w}}', b'x', 1j, ..., None)", "del a[1:2, ::3]", "if (x === 1) { y(); }",
    ]
    for code in codes:
        assert code_structure(code) == _code_structure_by_ast_walk(code), code[:80]


def test_abstraction_without_gold_calls_warns(caplog):
    from envsched import TaskPool, build_static_graph
    from envsched.synthetic import synthetic_records

    recs = synthetic_records(2, 40, seed=1)
    with caplog.at_level("WARNING", logger="envsched.graph"):
        g = build_static_graph(TaskPool.from_records(recs), EnvSchedConfig())
    assert g.report()["abstraction"]["low_resolution"] == 0.0 and "gold_actions" not in caplog.text
    bare = [{k: v for k, v in r.items() if k != "gold_actions"} for r in recs]
    with caplog.at_level("WARNING", logger="envsched.graph"):
        g = build_static_graph(TaskPool.from_records(bare), EnvSchedConfig())
    rep = g.report()["abstraction"]
    assert rep["tasks_without_gold_actions"] == 80.0 and rep["low_resolution"] == 1.0
    assert rep["distinct_abstract_fraction_median"] < 0.25
    assert "80 of 80 tasks have no gold_actions" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="envsched.graph"):
        build_static_graph(TaskPool.from_records(bare), EnvSchedConfig(abstraction_min_distinct_fraction=0.0))
    assert "gold_actions" not in caplog.text


# -- a graph built in chunks ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pool():
    return TaskPool.from_records(synthetic_records(6, 40, seed=3))


def _same(a: sp.csr_matrix, b: sp.csr_matrix) -> bool:
    a, b = sp.csr_matrix(a), sp.csr_matrix(b)
    return a.shape == b.shape and a.dtype == b.dtype and all(np.array_equal(getattr(a, k), getattr(b, k)) for k in ("indptr", "indices", "data"))


def test_graph_built_in_chunks_equals_one_chunk(pool):
    cfg = EnvSchedConfig()
    one = build_static_graph(pool, cfg, chunk_rows=len(pool))
    many = build_static_graph(pool, cfg, chunk_rows=17)
    assert _same(one.x_full, many.x_full) and _same(one.x_abs, many.x_abs)
    assert np.array_equal(one.mean_within_env_similarity(), many.mean_within_env_similarity())
    assert one.view_shapes == many.view_shapes and one.abstraction == many.abstraction
    assert isinstance(one.x_full.data, np.ndarray) and not one.x_full.data.flags.writeable  # mapped read-only
    assert [d.model_dump() for d in one.descriptions[:3]] == [d.model_dump() for d in many.descriptions[:3]]
    # S_full from the mapped matrix equals S_full from an in-memory copy, also after its pages are released
    mem = sp.csr_matrix((np.array(one.x_full.data), np.array(one.x_full.indices), np.array(one.x_full.indptr)), shape=one.x_full.shape)
    in_memory = dataclasses.replace(one, x_full=mem, disk=None)
    rows, cols = np.arange(0, len(pool), 7), np.arange(3, len(pool), 11)
    want = in_memory.sim_full(rows, cols)
    assert np.array_equal(one.sim_full(rows, cols), want)
    one.release_pages()
    assert np.array_equal(one.sim_full(rows, cols), want)


def test_graph_built_by_worker_processes_equals_the_in_process_build(pool):
    """workers = 2 over 5 chunks (forked children count each chunk's TF-IDF terms and derive its operation texts):
    the same x_full (values, indices, in-row order), x_abs, representatives, shapes and descriptions."""
    cfg = EnvSchedConfig()
    one = build_static_graph(pool, cfg, chunk_rows=50, workers=1)
    two = build_static_graph(pool, cfg, chunk_rows=50, workers=2)
    assert one.report()["build_workers"] == 1 and two.report()["build_workers"] == 2
    assert _same(one.x_full, two.x_full) and _same(one.x_abs, two.x_abs)
    assert one.x_full.indices.dtype == two.x_full.indices.dtype and one.x_full.indptr.dtype == two.x_full.indptr.dtype
    assert np.array_equal(one.mean_within_env_similarity(), two.mean_within_env_similarity())
    assert one.view_shapes == two.view_shapes and one.abstraction == two.abstraction
    assert one.extractor_counts == two.extractor_counts == {"deterministic": len(pool)} and two.fallback_reasons == {}
    assert [d.model_dump() for d in one.descriptions] == [d.model_dump() for d in two.descriptions]
    assert set(two.build_breakdown) >= {"operations", "abstract_view", "view:instruction_chars", "x_full", "representatives"}


def test_worker_count_files_are_gone_after_the_build(pool, tmp_path):
    """The build workers write each chunk's counts into the store folder; pass 2 removes them, leaving x_full."""
    build_static_graph(pool, EnvSchedConfig(), chunk_rows=50, workers=2, store=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x_full_data.npy", "x_full_indices.npy", "x_full_indptr.npy", "x_full_shape.npy"]


def test_equal_description_texts_are_one_object(pool):
    """A build worker sends each distinct operation text once (pickle's memo), and the parent keeps one copy."""
    from envsched.operations import DeterministicExtractor

    concrete, abstract = _description_texts(pool.tasks, DeterministicExtractor())
    assert [DeterministicExtractor().texts(t) for t in pool.tasks] == list(zip(concrete, abstract))
    for texts in (concrete, abstract):
        assert len({id(t) for t in texts}) == len(set(texts)) < len(texts)


def test_build_workers_must_be_positive(pool):
    with pytest.raises(ValueError, match="build_workers"):
        EnvSchedConfig(build_workers=0)
    with pytest.raises(ValueError, match="workers must be >= 1"):
        build_static_graph(pool, EnvSchedConfig(), workers=0)
    assert EnvSchedConfig().build_workers is None and EnvSchedConfig(build_workers=1).build_workers == 1


def test_a_failure_while_counting_a_view_is_raised_not_read_as_an_empty_view(pool, monkeypatch):
    """The views' chunks are counted in one stream; a ValueError there must not pass for "this view has no terms"
    (which leaves the view one zero column) and shift the chunks the next views read."""
    import envsched.graph as graph_mod

    real = graph_mod.count_chunk

    def failing(texts, kwargs, spill=None):
        if kwargs.get("analyzer") == "char_wb":
            raise ValueError("broken analyzer")
        return real(texts, kwargs, spill)

    monkeypatch.setattr(graph_mod, "count_chunk", failing)
    with pytest.raises(RuntimeError, match="broken analyzer"):
        build_static_graph(pool, EnvSchedConfig(), chunk_rows=50, workers=1)
