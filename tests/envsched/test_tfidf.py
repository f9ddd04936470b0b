"""Row-chunked TF-IDF (``envsched/tfidf.py``): ``tfidf_chunks`` gives exactly ``TfidfVectorizer.fit_transform``
(values, column indices, in-row order) without a binding ``max_features``, and through a tie at the cut the
alphabetically first terms, the same on every CPU; for every view's analyzer, in this process or counted by worker
processes.  ``count_chunk`` (pass 1, with its shortcuts for repeated texts, ``char_wb`` words and token pairs)
counts as ``CountVectorizer`` does, on any text.  ``chunk_map`` keeps the order and raises a worker's failure; the
on-disk CSR round-trips and refuses a short write."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.feature_extraction.text import CountVectorizer, TfidfVectorizer

from envsched import TaskPool
from envsched.graph import code_structure
from envsched.synthetic import synthetic_records
from envsched.tfidf import (
    DiskCSR,
    DiskCSRWriter,
    _count_by_tokens,
    _count_by_words,
    _shortcut,
    chunk_map,
    count_chunk,
    tfidf_chunks,
)


@pytest.fixture(scope="module")
def pool():
    return TaskPool.from_records(synthetic_records(6, 40, seed=3))


def _same(a: sp.csr_matrix, b: sp.csr_matrix) -> bool:
    a, b = sp.csr_matrix(a), sp.csr_matrix(b)
    return a.shape == b.shape and a.dtype == b.dtype and all(np.array_equal(getattr(a, k), getattr(b, k)) for k in ("indptr", "indices", "data"))


_VIEWS = {"words": {"ngram_range": (1, 2)}, "chars": {"analyzer": "char_wb", "ngram_range": (3, 5)},
          "code": {"token_pattern": r"\S+", "lowercase": False, "ngram_range": (1, 2)}}


def _view_texts(pool, view: str) -> list[str]:
    texts = [code_structure(t.verifier_code) for t in pool.tasks] if view == "code" else [t.instruction for t in pool.tasks]
    texts[3] = ""  # an empty document stays an empty row
    texts[9] = texts[40] = texts[2]  # repeated texts are counted once and their rows repeated
    return texts


def _stable_vocabulary(texts: list[str], args: dict) -> dict[str, int]:
    """The ``max_features`` terms of highest total count, the alphabetically first among those tied at the cut,
    numbered alphabetically: from ``CountVectorizer``'s uncut counts."""
    cv = CountVectorizer(**{k: v for k, v in args.items() if k in ("analyzer", "ngram_range", "token_pattern", "lowercase")})
    tf = np.asarray(cv.fit_transform(texts).sum(axis=0)).ravel()
    terms = sorted(cv.vocabulary_, key=lambda t: (-tf[cv.vocabulary_[t]], t))[: args["max_features"]]
    return {t: j for j, t in enumerate(sorted(terms))}


@pytest.mark.parametrize("view", list(_VIEWS))
@pytest.mark.parametrize("max_features", [35_000, 150, 5])
def test_chunked_tfidf_equals_sklearn(pool, view, max_features):
    """No cut (35,000): ``TfidfVectorizer.fit_transform`` byte for byte, in-row order included.  A cut through a tie
    (150, 5): the alphabetically first of the tied terms (scikit-learn's choice there depends on numpy's sort kernel),
    values as ``TfidfVectorizer`` gives them over that vocabulary, rows in first-appearance order."""
    texts = _view_texts(pool, view)
    args = {"min_df": 1, "max_features": max_features, "sublinear_tf": True, "dtype": np.float32, **_VIEWS[view]}
    want = TfidfVectorizer(**args).fit_transform(texts)
    kept = _stable_vocabulary(texts, args)
    cut = len(kept) < len(TfidfVectorizer(**{**args, "max_features": None}).fit(texts).vocabulary_)
    fixed = TfidfVectorizer(**{**args, "vocabulary": kept}).fit_transform(texts)
    analyze = CountVectorizer(**{k: v for k, v in args.items() if k in _VIEWS[view] or k == "lowercase"}).build_analyzer()
    first = {}
    for t in texts:
        for g in analyze(t):
            first.setdefault(g, len(first))
    by_col = sorted(kept)
    for chunk_rows, workers in ((len(texts), 1), (37, 1), (4, 1), (37, 2)):
        got = sp.vstack(list(tfidf_chunks(texts, chunk_rows=chunk_rows, workers=workers, **args)), format="csr")
        if not cut:
            assert _same(got, want), (view, max_features, chunk_rows, workers)
            continue
        for r in range(got.shape[0]):  # in-row order: first appearance in the corpus
            ranks = [first[by_col[j]] for j in got.indices[got.indptr[r] : got.indptr[r + 1]]]
            assert ranks == sorted(ranks)
        canon = got.copy()
        canon.sort_indices()
        assert np.array_equal(canon.indptr, fixed.indptr) and np.array_equal(canon.indices, fixed.indices)
        np.testing.assert_allclose(canon.data, fixed.data, rtol=1e-6)  # a row's norm may sum in another order


_ISA = {"avx2": "AVX512F AVX512CD AVX512_SKX AVX512_CLX AVX512_CNL AVX512_ICL AVX512_SPR",
        "baseline": "AVX512F AVX512CD AVX512_SKX AVX512_CLX AVX512_CNL AVX512_ICL AVX512_SPR AVX2 FMA3"}


def test_the_cut_through_a_tie_is_the_same_on_every_cpu(pool, tmp_path):
    """numpy picks its sort kernel by the CPU (``NPY_DISABLE_CPU_FEATURES`` turns AVX-512 and AVX2 off, as a CPU
    without them has them off): the kept vocabulary and every value come out the same under each, where
    ``TfidfVectorizer`` keeps other terms at the tie on this machine."""
    texts = _view_texts(pool, "words")
    (tmp_path / "texts.json").write_text(json.dumps(texts))
    script = (
        "import json, sys, numpy as np, scipy.sparse as sp\n"
        "from envsched.tfidf import tfidf_chunks\n"
        f"texts = json.loads(open({str(tmp_path / 'texts.json')!r}).read())\n"
        "x = sp.vstack(list(tfidf_chunks(texts, chunk_rows=37, min_df=1, max_features=150, ngram_range=(1, 2))), format='csr')\n"
        "sys.stdout.write(json.dumps([x.indptr.tolist(), x.indices.tolist(), x.data.tolist()]))\n"
    )
    runs = {isa: subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                                env={**os.environ, "NPY_DISABLE_CPU_FEATURES": off}).stdout for isa, off in _ISA.items()}
    here = sp.vstack(list(tfidf_chunks(texts, chunk_rows=37, min_df=1, max_features=150, ngram_range=(1, 2))), format="csr")
    assert {json.dumps([here.indptr.tolist(), here.indices.tolist(), here.data.tolist()])} == set(runs.values())


def _counted_as_sklearn(texts: list[str], kwargs: dict) -> None:
    """``count_chunk`` against ``CountVectorizer`` itself: the terms in order of first appearance in the analyzer's
    stream, each row's counts, rows sorted by that order, and the term and document frequencies."""
    got = count_chunk(texts, kwargs)
    analyze = CountVectorizer(**kwargs).build_analyzer()
    streams = [analyze(t) for t in texts]
    order = list(dict.fromkeys(g for s in streams for g in s))
    assert got.terms == order
    x = sp.csr_matrix((got.data, got.indices, got.indptr), shape=(len(texts), len(order)))
    for r, s in enumerate(streams):
        row = x.indices[x.indptr[r] : x.indptr[r + 1]]
        assert np.all(np.diff(row) > 0)
        assert {order[j]: int(c) for j, c in zip(row, x.data[x.indptr[r] : x.indptr[r + 1]])} == {g: s.count(g) for g in s}
    assert got.tf.tolist() == [sum(s.count(g) for s in streams) for g in order]
    assert got.df.tolist() == [sum(g in s for s in streams) for g in order]


_WORDS = st.text(alphabet=st.sampled_from(list("abAB_é1 \t\n\u3000\u2028\x1c\x85")), max_size=12)


@settings(max_examples=150, deadline=None)
@given(st.lists(_WORDS, min_size=1, max_size=8).flatmap(lambda distinct: st.lists(st.sampled_from(distinct), min_size=1, max_size=12)),
       st.sampled_from([{"analyzer": "char_wb", "ngram_range": (3, 5)}, {"analyzer": "char_wb", "ngram_range": (1, 2), "lowercase": False},
                        {"analyzer": "char_wb", "ngram_range": (2, 4), "strip_accents": "unicode"},
                        {"ngram_range": (1, 2)}, {"token_pattern": r"\S+", "lowercase": False, "ngram_range": (1, 2)},
                        {"ngram_range": (2, 2)}, {"ngram_range": (1, 1), "strip_accents": "ascii"}]))
def test_count_chunk_counts_as_count_vectorizer(texts, kwargs):
    """Repeated texts, unicode whitespace (ideographic space, line separator, the C0 / C1 separators ``split()``
    takes), case, accents, one-token texts and words shorter than the n-grams: the shortcuts give sklearn's counts
    and order."""
    assert _shortcut(kwargs) is (_count_by_words if kwargs.get("analyzer") == "char_wb" else _count_by_tokens)
    if not any(CountVectorizer(**kwargs).build_analyzer()(t) for t in texts):
        assert count_chunk(texts, kwargs).terms == []  # a chunk without any term
        return
    _counted_as_sklearn(texts, kwargs)


def test_count_chunk_takes_the_general_path_for_what_the_shortcuts_cannot_count():
    """A char_wb analyzer with a custom preprocessor, binary counts, stop words, trigrams: counted by sklearn's
    analyzer over the whole text."""
    texts = ["Ab  ab ab the", "ab ab", "Ab  ab ab the"]
    for kwargs in ({"analyzer": "char_wb", "ngram_range": (2, 3), "preprocessor": lambda t: t.replace("b", "b c")},
                   {"analyzer": "char_wb", "ngram_range": (2, 3), "binary": True}, {"stop_words": "english"},
                   {"ngram_range": (1, 3)}, {"binary": True}):
        assert _shortcut(kwargs) is None
        got = count_chunk(texts, kwargs)
        want = CountVectorizer(**kwargs).fit(texts)
        assert sorted(got.terms) == sorted(want.vocabulary_)
        assert got.tf.sum() == want.transform(texts).sum()


def test_tokens_with_spaces_are_counted_by_the_analyzer():
    """A tokenizer whose tokens have spaces: the bigram "ab ab" of tokens ("ab", "ab") and the token "ab ab" are one
    term for sklearn, so the token-pair shortcut declines and the analyzer counts."""
    texts = ["ab ab", "ab ab ab", "x ab ab"]
    kwargs = {"token_pattern": r"ab ab|\w+", "ngram_range": (1, 2)}
    assert _shortcut(kwargs) is _count_by_tokens and _count_by_tokens(texts, kwargs) is None
    _counted_as_sklearn(texts, kwargs)


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


def test_disk_csr_reads_rows_by_pread_as_stored(tmp_path):
    """read_rows gives each row's stored entries (in any order, repeated, empty) as the mapping holds them, reads
    through a descriptor that outlives the files, and refuses a short read instead of leaving entries unset."""
    rng = np.random.default_rng(1)
    x = sp.random(60, 40, density=0.15, format="csr", random_state=rng, dtype=np.float64)
    x.data[x.indptr[7] : x.indptr[8]] = 0.0  # row 7 empty
    x.eliminate_zeros()
    w = DiskCSRWriter(tmp_path, "m", 60, 40, x.nnz, np.float64)
    w.append(x)
    w.finish()
    disk = DiskCSR(tmp_path, "m")
    assert disk.can_pread and disk.nbytes == x.nnz * (x.data.itemsize + x.indices.itemsize)
    for f in tmp_path.iterdir():
        f.unlink()  # as a built graph's temporary store: the mapping and the descriptors stay valid
    m = disk.matrix
    for rows in (np.array([3]), np.array([7]), rng.permutation(60), np.array([5, 5, 59, 0, 7, 12])):
        total = int((m.indptr[rows + 1] - m.indptr[rows]).sum())
        cols, vals = np.empty(total, dtype=m.indices.dtype), np.empty(total, dtype=m.data.dtype)
        disk.read_rows(rows, cols, vals)
        want = m[rows]
        assert np.array_equal(cols, want.indices) and np.array_equal(vals, want.data)
    (tmp_path / "t").mkdir()
    w = DiskCSRWriter(tmp_path / "t", "m", 60, 40, x.nnz, np.float64)
    w.append(x)
    w.finish()
    short = DiskCSR(tmp_path / "t", "m")
    with open(tmp_path / "t" / "m_data.npy", "r+b") as fh:
        fh.truncate(fh.seek(0, 2) - 8)  # the last entry's value lost
    rows = np.array([59])
    total = int(short.matrix.indptr[60] - short.matrix.indptr[59])
    with pytest.raises(OSError, match="expected"):
        short.read_rows(rows, np.empty(total, dtype=np.int32), np.empty(total))
