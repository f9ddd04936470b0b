"""Static graph (Eq. 1), abstraction (App. E.1), neighbour search and the deterministic extractor."""

import numpy as np
import pytest
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.metrics.pairwise import cosine_similarity

from envsched import EnvSchedConfig, TaskPool, abstract_text, build_static_graph
from envsched.graph import code_structure, sparse_row_block_dot
from envsched.neighbors import NeighborIndex, merge_topk
from envsched.operations import DeterministicExtractor, OperationDescription, tool_operation_type
from envsched.synthetic import synthetic_records


@pytest.fixture(scope="module")
def small():
    pool = TaskPool.from_records(synthetic_records(6, 8, seed=3))
    cfg = EnvSchedConfig(tfidf_float32=False)
    return pool, cfg, build_static_graph(pool, cfg)


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


def test_neighbor_index_matches_brute_force(small):
    pool, _, g = small
    n = len(pool)
    full = (g.x_full @ g.x_full.T).toarray()
    ab = (g.x_abs @ g.x_abs.T).toarray()
    nb = NeighborIndex(g, 3, 4)
    rng = np.random.default_rng(0)
    observed = rng.choice(n, 20, replace=False)
    nb.add_observed(observed[:7])
    nb.add_observed(observed[7:])  # incremental == one-shot
    env = pool.env
    for i in range(n):
        same = [j for j in observed if env[j] == env[i] and j != i and full[i, j] > 0]
        other = [j for j in observed if env[j] != env[i] and ab[i, j] > 0]
        want_in = sorted(same, key=lambda j: (-full[i, j], j))[:3]
        want_x = sorted(other, key=lambda j: (-ab[i, j], j))[:4]
        got_in = [j for j in nb.idx["in"][i] if j >= 0]
        got_x = [j for j in nb.idx["cross"][i] if j >= 0]
        assert sorted(got_in) == sorted(want_in), i
        assert sorted(got_x) == sorted(want_x), i
        assert nb.sim["in"][i][: len(got_in)] == pytest.approx([full[i, j] for j in got_in])


def test_merge_topk_total_order_is_insertion_independent():
    idx = np.full((1, 2), -1)
    sim = np.full((1, 2), -np.inf)
    a = merge_topk(idx, sim, np.array([[5, 2, 9]]), np.array([[0.5, 0.5, 0.7]]), 2, 0.0)
    b1 = merge_topk(idx, sim, np.array([[9]]), np.array([[0.7]]), 2, 0.0)
    b = merge_topk(*b1, np.array([[5, 2]]), np.array([[0.5, 0.5]]), 2, 0.0)
    assert a[0].tolist() == b[0].tolist() == [[9, 2]]  # tie at 0.5 -> lower index


def test_abstraction_removes_identifiers_fields_and_literals():
    def task(tool_a, tool_b, field, name, value):
        return TaskPool.from_records([{
            "task_id": "t", "env_id": "e", "instruction": f"Set status of {name} to {value}",
            "tools": [{"name": tool_a, "parameters": {"properties": {"name": {}}}}, {"name": tool_b, "parameters": {"properties": {field: {}}}}],
            "verifier_checks": [f"{field} is {value}"],
            "gold_actions": [{"name": tool_a, "arguments": {"name": name}}, {"name": tool_b, "arguments": {"user_id": "U-1234", field: value}}],
        }])[0]

    ext = DeterministicExtractor()
    a = ext.describe(task("get_user_by_name", "update_user_status", "status", "Alice", "active"))
    b = ext.describe(task("find_patient_by_name", "update_bed_status", "occupancy", "Bob Stone", "occupied"))
    ta, tb = abstract_text(a), abstract_text(b)
    assert ta == tb
    for word in ("user", "alice", "u-1234", "active", "occupancy", "get_", "update_"):
        assert word not in ta.lower()
    assert "op:lookup(entity_by_name)" in ta and "<id>" in ta and "<string>" in ta
    assert "dep:lookup(entity_by_name)>update(status)" in ta


def test_tool_operation_types():
    assert [tool_operation_type(n) for n in ("get_user_by_name", "update_user_status", "createReservation", "remove_exclusion", "verify_eligibility", "is_authorized_user_for_policy", "frobnicate")] == [
        "lookup", "update", "create", "delete", "validate", "authorize", "update"]


def test_deterministic_description_is_valid_and_structured():
    pool = TaskPool.from_records(synthetic_records(2, 3, seed=1))
    for t in pool.tasks:
        d = DeterministicExtractor().describe(t)
        OperationDescription.model_validate(d.model_dump())  # round-trips through the schema
        assert len(d.operations) == len(t.gold_actions)
        assert sum(len(r.checks) for r in d.reward_groups) == len(t.verifier_checks)


def test_code_structure_tokens():
    toks = code_structure("assert db['cards']['4411'].frozen == True\nok = check(x)").split()
    assert "Assert" in toks and "attr:frozen" in toks and "cmp:Eq" in toks and "call:check" in toks and "key:cards" in toks
    assert code_structure("if (x === 1) { y(); }")  # not Python: token fallback
