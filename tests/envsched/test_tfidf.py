"""Row-chunked TF-IDF (``envsched/tfidf.py``): ``tfidf_chunks`` gives exactly ``TfidfVectorizer.fit_transform``
(values, column indices, in-row order) with and without a binding ``max_features``, for every view's analyzer, in
this process or counted by worker processes; ``chunk_map`` keeps the order and raises a worker's failure; the
on-disk CSR round-trips and refuses a short write."""

from __future__ import annotations

import os

import numpy as np
import pytest
import scipy.sparse as sp
from sklearn.feature_extraction.text import TfidfVectorizer

from envsched import TaskPool
from envsched.graph import code_structure
from envsched.synthetic import synthetic_records
from envsched.tfidf import DiskCSR, DiskCSRWriter, chunk_map, tfidf_chunks


@pytest.fixture(scope="module")
def pool():
    return TaskPool.from_records(synthetic_records(6, 40, seed=3))


def _same(a: sp.csr_matrix, b: sp.csr_matrix) -> bool:
    a, b = sp.csr_matrix(a), sp.csr_matrix(b)
    return a.shape == b.shape and a.dtype == b.dtype and all(np.array_equal(getattr(a, k), getattr(b, k)) for k in ("indptr", "indices", "data"))


@pytest.mark.parametrize("view", ["words", "chars", "code"])
@pytest.mark.parametrize("max_features", [35_000, 150, 5])
def test_chunked_tfidf_equals_sklearn(pool, view, max_features):
    kw = {"words": {"ngram_range": (1, 2)}, "chars": {"analyzer": "char_wb", "ngram_range": (3, 5)},
          "code": {"token_pattern": r"\S+", "lowercase": False, "ngram_range": (1, 2)}}[view]
    texts = [code_structure(t.verifier_code) for t in pool.tasks] if view == "code" else [t.instruction for t in pool.tasks]
    texts[3] = ""  # an empty document stays an empty row
    args = {"min_df": 1, "max_features": max_features, "sublinear_tf": True, "dtype": np.float32, **kw}
    want = TfidfVectorizer(**args).fit_transform(texts)
    for chunk_rows, workers in ((len(texts), 1), (37, 1), (4, 1), (37, 2)):
        got = sp.vstack(list(tfidf_chunks(texts, chunk_rows=chunk_rows, workers=workers, **args)), format="csr")
        assert _same(got, want), (view, max_features, chunk_rows, workers)


def _square_or_fail(a: int, b: int) -> list[int]:
    if a == 6:
        raise KeyError("chunk 6")
    if a == 9:
        os._exit(7)  # a worker that dies without an answer
    return [i * i for i in range(a, b)]


def test_chunk_map_keeps_the_order_and_raises_a_workers_failure():
    bounds = [(a, a + 3) for a in range(0, 6, 3)]
    want = [[0, 1, 4], [9, 16, 25]]
    for workers in (1, 2, 3):
        assert list(chunk_map(_square_or_fail, bounds, workers)) == want
    with pytest.raises(KeyError, match="chunk 6"):
        list(chunk_map(_square_or_fail, [*bounds, (6, 9), (9, 12)], 2))
    with pytest.raises(RuntimeError, match="exited with code 7"):
        list(chunk_map(_square_or_fail, [*bounds, (9, 12)], 2))


def test_disk_csr_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    x = sp.random(50, 30, density=0.2, format="csr", random_state=rng, dtype=np.float64)
    w = DiskCSRWriter(tmp_path, "m", 50, 30, x.nnz, np.float64)
    for a in range(0, 50, 13):
        w.append(x[a : a + 13])
    w.finish()
    assert _same(DiskCSR(tmp_path, "m").matrix, x)
    w = DiskCSRWriter(tmp_path, "bad", 50, 30, x.nnz + 1, np.float64)
    w.append(x)
    with pytest.raises(RuntimeError, match="expected"):
        w.finish()
