"""Row-chunked TF-IDF equal to scikit-learn's ``TfidfVectorizer.fit_transform``, and CSR matrices on disk.

At a million tasks one ``TfidfVectorizer.fit_transform`` of the character 3-5-gram view holds every raw
(document, n-gram) pair as Python integers before it prunes the vocabulary, and the finished S_full feature
matrix of Eq. 1 is several GiB (docs/results/envsched_scale.md).  ``tfidf_chunks`` gives the same matrix, chunk of
rows by chunk of rows, holding one chunk at a time:

1. pass 1 counts each chunk as scikit-learn's ``CountVectorizer`` counts it (``count_chunk``: the vectorizer's own
   analyzer, or its exact shortcuts for repeated texts, ``char_wb`` words and word unigrams / bigrams); the chunk
   count matrices go to a scratch folder with the chunk's own term numbers, the terms of all chunks are numbered
   once in order of first appearance (``pandas.factorize``), and term counts and document frequencies added up;
2. the vocabulary is cut as ``TfidfVectorizer`` cuts it (``_sort_features`` then ``_limit_features``:
   document-frequency bounds, then the ``max_features`` most frequent terms, alphabetical among those tied at the
   cut, where scikit-learn's choice depends on the CPU: ``_kept_columns``) and the idf is computed as
   ``TfidfTransformer.fit`` computes it, in the same dtype;
3. pass 2 maps each stored chunk to the kept columns (entries keep sklearn's in-row order: first appearance in
   the corpus) and applies ``TfidfTransformer.transform`` (sublinear tf, idf, L2 rows: all row-local).

Every stored value, column index and in-row order equals ``TfidfVectorizer(...).fit_transform(texts)`` where no
tie straddles the ``max_features`` cut (tests/envsched/test_tfidf.py checks ``array_equal`` on data, indices and
indptr), and ``TfidfVectorizer(vocabulary=<the kept terms>)`` where one does.

``DiskCSR`` writes a CSR matrix chunk by chunk to ``.npy`` files and opens it memory-mapped, read-only: a
step reads only the rows it needs, and ``release()`` drops the pages a step touched from the resident set
(they stay in the page cache).
"""

from __future__ import annotations

import gc
import heapq
import itertools
import mmap
import multiprocessing
import os
import shutil
import tempfile
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from numbers import Integral
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pandas as pd
import scipy.sparse as sp
from sklearn.feature_extraction.text import CountVectorizer, TfidfTransformer, TfidfVectorizer

CHUNK_ROWS = 50_000

T = TypeVar("T")


def row_chunks(n: int, chunk_rows: int) -> list[tuple[int, int]]:
    """The (start, stop) rows of ``n`` rows in chunks of ``chunk_rows``, in order (the last may be shorter)."""
    return [(a, min(a + chunk_rows, n)) for a in range(0, n, chunk_rows)]


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity (macOS, Windows)
        return os.cpu_count() or 1


def chunk_map(fn: Callable[..., T], jobs: Sequence[tuple[Any, ...]], workers: int) -> Iterator[T]:
    """``fn(*job)`` for each job of ``jobs`` (e.g. a chunk's ``(start, stop)`` rows), yielded in order.

    ``workers`` <= 1, a single job, or a platform without ``fork``: in this process.  Otherwise each call runs in
    its own forked child process, at most ``workers`` at once, and sends its result back pickled: a child sees
    the parent's data (the pool, ``fn``'s closure) without pickling, and the pages it copies by touching them
    (reference counts) are freed when it exits after its one chunk, so the memory a child adds stays bounded by
    one chunk's share however large the pool.  A child finished ahead of the consumer waits to send its result, so
    at most ``workers`` results are pending.  An exception in a child is raised here (the remaining children are
    killed); a child that dies without an answer raises RuntimeError.
    """
    if workers <= 1 or len(jobs) <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        for job in jobs:
            yield fn(*job)
        return
    ctx = multiprocessing.get_context("fork")
    todo = iter(jobs)
    running: deque[tuple[Any, Any]] = deque()

    def start() -> None:
        for job in itertools.islice(todo, 1):
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_chunk_child, args=(send, fn, job), daemon=True)
            proc.start()
            send.close()
            running.append((proc, recv))

    try:
        for _ in range(workers):
            start()
        while running:
            proc, recv = running.popleft()
            try:
                status, value = recv.recv()
            except EOFError:
                proc.join()
                raise RuntimeError(f"a build worker (pid {proc.pid}) exited with code {proc.exitcode} without a result") from None
            finally:
                recv.close()
            proc.join()
            start()
            if status == "error":
                raise value
            yield value
    finally:
        for proc, recv in running:  # only after an error or an abandoned iteration
            proc.kill()
            proc.join()
            recv.close()


def _chunk_child(send: Any, fn: Callable[..., Any], job: tuple[Any, ...]) -> None:
    """Body of a ``chunk_map`` child: one call, its result (or exception) sent to the parent."""
    gc.freeze()  # a collection would otherwise write to every inherited object's header and copy its page
    try:
        out: tuple[str, Any] = ("ok", fn(*job))
    except BaseException as exc:  # noqa: BLE001 - whatever fn raises is raised again in the parent
        out = ("error", exc)
    try:
        send.send(out)
    except Exception as exc:  # noqa: BLE001 - an unpicklable result or exception still reaches the parent
        send.send(("error", RuntimeError(f"a build worker could not send its result: {type(exc).__name__}: {exc}")))
    send.close()


def tfidf_chunks(texts: Sequence[str], *, chunk_rows: int = CHUNK_ROWS, scratch: Path | None = None, workers: int = 1,
                 **vectorizer_kwargs: Any) -> Iterator[sp.csr_matrix]:
    """Row chunks (``chunk_rows`` rows each, in order) of ``TfidfVectorizer(**vectorizer_kwargs).fit_transform(texts)``.

    ``texts`` only needs ``len`` and slicing (``texts[a:b]`` is asked once per chunk, in pass 1): a lazy sequence
    computes each chunk's texts when it is counted.  ``workers`` > 1 counts the chunks of pass 1 in forked
    processes (``chunk_map``), at most ``workers`` at once; the vocabulary is still merged in chunk order, so the
    result is the same.  Raises ValueError as ``fit_transform`` does when the vocabulary is empty (before anything
    is yielded).
    """
    n_doc = len(texts)
    kwargs = counter_kwargs(vectorizer_kwargs)
    counts = chunk_map(lambda a, b: count_chunk(texts[a:b], kwargs), row_chunks(n_doc, chunk_rows), workers)
    yield from tfidf_from_counts(counts, n_doc, scratch=scratch, **vectorizer_kwargs)


def counter_kwargs(vectorizer_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The ``CountVectorizer`` arguments (analyzer, n-grams, ...) of ``TfidfVectorizer(**vectorizer_kwargs)``'s pass 1."""
    params = TfidfVectorizer(**vectorizer_kwargs).get_params()
    return {k: v for k, v in params.items() if k not in ("norm", "use_idf", "smooth_idf", "sublinear_tf", "max_df", "min_df", "max_features", "dtype", "vocabulary")}


def tfidf_from_counts(counts: Iterator[ChunkCounts], n_doc: int, *, scratch: Path | None = None, **vectorizer_kwargs: Any) -> Iterator[sp.csr_matrix]:
    """``tfidf_chunks`` from its pass 1 counts: ``count_chunk`` of each row chunk of the ``n_doc`` texts with
    ``counter_kwargs(vectorizer_kwargs)``, in order; ``counts`` is read to its end before the first chunk is yielded
    (a caller may count several views' chunks in one ``chunk_map`` and hand each view its slice).

    The chunks' terms are numbered once, by ``pandas.factorize`` over all of them in chunk order (codes in order of
    first appearance: the ids ``CountVectorizer`` numbers terms by before it sorts them); each chunk's counts wait on
    disk with its own term numbers until pass 2 maps them to the kept columns.
    """
    vec = TfidfVectorizer(**vectorizer_kwargs)
    dtype = vec.dtype
    own = scratch is None
    folder = Path(tempfile.mkdtemp(prefix="envsched-tfidf-")) if own else Path(scratch)
    folder.mkdir(parents=True, exist_ok=True)
    stored: list[str] = []  # each chunk's count matrix on disk: <prefix>_{data,indices,indptr}.npy
    try:
        terms: list[list[str]] = []
        tf: list[np.ndarray] = []
        df: list[np.ndarray] = []
        for c, part in enumerate(counts):
            terms.append(part.terms)
            tf.append(part.tf)
            df.append(part.df)
            stored.append(part.spilled or part.spill(folder / f"c{c}").spilled)  # type: ignore[arg-type]
            del part
        offsets = np.zeros(len(terms) + 1, dtype=np.int64)
        np.cumsum([len(t) for t in terms], out=offsets[1:])
        if not offsets[-1]:
            raise ValueError("empty vocabulary; perhaps the documents only contain stop words")
        every = np.empty(offsets[-1], dtype=object)
        for c, t in enumerate(terms):
            every[offsets[c] : offsets[c + 1]] = t
        del terms
        gid, vocab = pd.factorize(every)  # every chunk's terms, in order: codes by first appearance in the corpus
        del every
        tf_all = np.bincount(gid, weights=np.concatenate(tf), minlength=len(vocab)).astype(np.int64)  # exact below 2**53
        df_all = np.bincount(gid, weights=np.concatenate(df), minlength=len(vocab)).astype(np.int64)
        del tf, df
        col = _kept_columns(vocab.tolist(), tf_all, df_all, n_doc, vec)
        del vocab
        n_features = int(col.max()) + 1
        kept_df = np.zeros(n_features, dtype=np.int64)
        kept_df[col[col >= 0]] = df_all[col >= 0]
        transformer = _transformer(vec, kept_df, n_doc, dtype)
        for c, prefix in enumerate(stored):
            data = np.load(f"{prefix}_data.npy")
            g = gid[offsets[c] + np.load(f"{prefix}_indices.npy")]  # each entry's term, numbered corpus-wide
            indptr = np.load(f"{prefix}_indptr.npy")
            for name in _PARTS:
                Path(f"{prefix}_{name}.npy").unlink()
            keep = col[g] >= 0
            rows = np.repeat(np.arange(len(indptr) - 1), np.diff(indptr))
            new_indptr = np.zeros(len(indptr), dtype=np.int32)
            np.cumsum(np.bincount(rows[keep], minlength=len(indptr) - 1), out=new_indptr[1:])
            x = sp.csr_matrix((data[keep].astype(dtype), g[keep], new_indptr), shape=(len(indptr) - 1, len(col)))
            # rows in sklearn's in-row order: by first appearance of the term in the whole corpus
            x.has_sorted_indices = False
            x.sort_indices()
            counts_c = sp.csr_matrix((x.data, col[x.indices].astype(np.int32), new_indptr), shape=(len(indptr) - 1, n_features))
            yield sp.csr_matrix(transformer.transform(counts_c, copy=False))
    finally:
        if own:
            shutil.rmtree(folder, ignore_errors=True)
        for prefix in stored:  # after an error, or a caller that stopped early
            for name in _PARTS:
                Path(f"{prefix}_{name}.npy").unlink(missing_ok=True)


@dataclass
class ChunkCounts:
    """Pass 1 of ``tfidf_chunks`` for one chunk of documents: ``terms`` in order of first appearance in the chunk,
    the chunk's count matrix over them (CSR parts, term k = column k, rows sorted by column), and each term's
    total count ``tf`` and document frequency ``df`` in the chunk.  ``spilled``: the path prefix the count matrix was
    written to (``<spilled>_{data,indices,indptr}.npy``) by the process that counted it, which then sends the
    arrays empty: a build worker writes its chunk to disk instead of pickling it to the parent."""

    terms: list[str]
    data: np.ndarray
    indices: np.ndarray
    indptr: np.ndarray
    tf: np.ndarray
    df: np.ndarray
    spilled: str | None = None

    def spill(self, prefix: Path | str) -> ChunkCounts:
        """This chunk with its count matrix written to ``<prefix>_{data,indices,indptr}.npy`` and left out."""
        for name in _PARTS:
            np.save(f"{prefix}_{name}.npy", getattr(self, name))
        empty = np.zeros(0, dtype=np.int32)
        return ChunkCounts(self.terms, empty, empty, empty, self.tf, self.df, spilled=str(prefix))


_PARTS = ("data", "indices", "indptr")


def count_chunk(texts: Sequence[str], counter_kwargs: dict[str, Any], spill: Path | str | None = None) -> ChunkCounts:
    """Count one chunk as scikit-learn's ``CountVectorizer(**counter_kwargs)`` counts it (its own analyzer), columns
    renumbered in order of first appearance (the order ``CountVectorizer`` numbers terms in before it sorts them);
    with ``spill``, the count matrix is written there (``ChunkCounts.spill``).

    Three exact shortcuts keep the per-token Python of the analyzers off repeated text:

    * each distinct text is analysed once and its row repeated (a task pool repeats texts: at 20,000 synthetic
      tasks the operations view has 1.6 % distinct texts, the abstract view 0.06 %);
    * a ``char_wb`` analyzer only makes n-grams inside each whitespace-separated word (``_char_wb_ngrams`` loops
      over ``text.split()``), so a text's counts are the sum of its words' counts: the distinct words are analysed
      once each, by the same analyzer, and the text x word counts are multiplied by the word x n-gram counts
      (``_count_by_words``);
    * a word analyzer's unigrams and bigrams are counted as integer pairs of token ids (``_count_by_tokens``): the
      texts are tokenized by the vectorizer's own preprocessor and tokenizer, and only the distinct terms become
      strings.
    """
    first: dict[str, int] = {}
    rows = np.fromiter((first.setdefault(t, len(first)) for t in texts), dtype=np.int64, count=len(texts))
    distinct = list(first)
    del first
    try:
        shortcut = _shortcut(counter_kwargs)
        counted = shortcut(distinct, counter_kwargs) if shortcut is not None else None
        terms, x = counted if counted is not None else _count(distinct, counter_kwargs)
    except ValueError:  # a chunk without any term
        return ChunkCounts([], np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(len(texts) + 1, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))
    if len(distinct) < len(texts):
        x = x[rows]
    n_terms = len(terms)
    out = ChunkCounts(
        terms=terms, data=x.data.astype(np.int32), indices=x.indices.astype(np.int32), indptr=x.indptr.astype(np.int64),
        tf=np.bincount(x.indices, weights=x.data, minlength=n_terms).astype(np.int64),  # exact below 2**53
        df=np.bincount(x.indices, minlength=n_terms).astype(np.int64),
    )
    return out if spill is None else out.spill(spill)


def _count(texts: Sequence[str], counter_kwargs: dict[str, Any]) -> tuple[list[str], sp.csr_matrix]:
    """``CountVectorizer(**counter_kwargs).fit_transform(texts)`` with its columns renumbered in order of first
    appearance: (the terms in that order, the int64 count matrix over them, rows sorted by column)."""
    cv = CountVectorizer(**counter_kwargs, dtype=np.int64)
    x = cv.fit_transform(texts).tocsr()
    by_col = [""] * len(cv.vocabulary_)
    for t, j in cv.vocabulary_.items():
        by_col[j] = t
    # fit_transform sorted the vocabulary alphabetically without reordering the rows' entries, which stay in order
    # of first appearance: the first position of each column in x.indices orders the columns by first appearance
    cols, first = np.unique(x.indices, return_index=True)
    by_first = cols[np.argsort(first, kind="stable")]
    rank = np.empty(x.shape[1], dtype=np.int32)
    rank[by_first] = np.arange(len(by_first), dtype=np.int32)
    x.indices = rank[x.indices]
    return [by_col[j] for j in by_first], x


def _shortcut(counter_kwargs: dict[str, Any]) -> Callable[..., tuple[list[str], sp.csr_matrix] | None] | None:
    """The exact shortcut that counts as ``CountVectorizer(**counter_kwargs)`` does, or None (texts given as strings
    and counts kept, not binary, for either): ``_count_by_words`` for the ``char_wb`` analyzer with scikit-learn's own
    preprocessing (a custom preprocessor is applied once, to the text, and not again to its words);
    ``_count_by_tokens`` for the word analyzer with n-grams of at most two tokens and no stop words."""
    cv = CountVectorizer(**counter_kwargs)
    kw = cv.get_params()
    if kw["input"] != "content" or kw["binary"]:
        return None
    if kw["analyzer"] == "char_wb" and kw["preprocessor"] is None:
        return _count_by_words
    if kw["analyzer"] == "word" and kw["ngram_range"][1] <= 2 and cv.get_stop_words() is None:
        return _count_by_tokens
    return None


def _count_by_words(texts: Sequence[str], counter_kwargs: dict[str, Any]) -> tuple[list[str], sp.csr_matrix]:
    """``_count`` for a ``char_wb`` analyzer, through the texts' distinct words (``_shortcut`` says when).

    ``_char_wb_ngrams`` makes the n-grams of ``" " + w + " "`` for each word ``w`` of ``preprocess(text).split()``
    (its whitespace collapsing does not change what ``split()`` returns), so the words are split here with the
    vectorizer's own preprocessor, and the distinct words, in order of first appearance, are counted by the same
    analyzer with preprocessing off (it was applied to the whole text).  An n-gram first appears in the first word
    that has it, so the n-grams' first-appearance order over the distinct words is theirs over the texts.
    """
    cv = CountVectorizer(**counter_kwargs)
    preprocess = cv.build_preprocessor()
    word_id: dict[str, int] = {}
    indices: list[int] = []
    indptr = np.zeros(len(texts) + 1, dtype=np.int64)
    for r, text in enumerate(texts):
        indices.extend([word_id.setdefault(w, len(word_id)) for w in preprocess(cv.decode(text)).split()])
        indptr[r + 1] = len(indices)
    words = sp.csr_matrix((np.ones(len(indices), dtype=np.int64), np.asarray(indices, dtype=np.int64), indptr), shape=(len(texts), len(word_id)))
    words.sum_duplicates()
    terms, grams = _count(list(word_id), {**counter_kwargs, "lowercase": False, "strip_accents": None})
    x = sp.csr_matrix(words @ grams)
    x.sort_indices()
    return terms, x


def _count_by_tokens(texts: Sequence[str], counter_kwargs: dict[str, Any]) -> tuple[list[str], sp.csr_matrix] | None:
    """``_count`` for a word analyzer of unigrams and / or bigrams (``_shortcut`` says when); None where a token
    has a space in it (a bigram's string could then be another term's), which ``_count`` counts instead.

    ``_word_ngrams`` gives each text's terms as its tokens, then the space-joined pairs of neighbouring tokens
    (those of the n-gram range).  Here each token is an integer id (in order of first appearance), a pair is the
    integer ``V + a * V + b``, and each term occurrence gets its position in the analyzer's stream of terms: the
    terms are numbered by their first position, as ``_count`` numbers them.
    """
    cv = CountVectorizer(**counter_kwargs)
    preprocess, tokenize = cv.build_preprocessor(), cv.build_tokenizer()
    lo, hi = cv.ngram_range
    token_id: dict[str, int] = {}
    flat: list[int] = []
    lengths = np.zeros(len(texts), dtype=np.int64)
    for r, text in enumerate(texts):
        tokens = tokenize(preprocess(cv.decode(text)))
        flat.extend([token_id.setdefault(w, len(token_id)) for w in tokens])
        lengths[r] = len(tokens)
    words = list(token_id)
    if any(" " in w for w in words):
        return None
    ids = np.asarray(flat, dtype=np.int64)
    v = len(words)
    row = np.repeat(np.arange(len(texts), dtype=np.int64), lengths)
    start = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum(lengths, out=start[1:])
    local = np.arange(len(ids), dtype=np.int64) - start[row]  # a token's position in its text
    n_uni = lengths if lo == 1 else np.zeros_like(lengths)
    n_bi = np.maximum(lengths - 1, 0) if hi == 2 else np.zeros_like(lengths)
    stream = np.zeros(len(texts), dtype=np.int64)  # where each text's terms begin in the analyzer's stream
    np.cumsum((n_uni + n_bi)[:-1], out=stream[1:])
    keys, rows, positions = [], [], []
    if lo == 1:
        keys.append(ids)
        rows.append(row)
        positions.append(stream[row] + local)
    if hi == 2:
        pair = local < lengths[row] - 1  # a token followed by another of its text
        first = np.flatnonzero(pair)
        keys.append(v + ids[first] * v + ids[first + 1])
        rows.append(row[first])
        positions.append(stream[row[first]] + n_uni[row[first]] + local[first])
    key, rows_, pos = np.concatenate(keys), np.concatenate(rows), np.concatenate(positions)
    if not len(key):
        raise ValueError("empty vocabulary; perhaps the documents only contain stop words")
    distinct, first_at, inverse = np.unique(key, return_index=True, return_inverse=True)
    by_first = np.argsort(pos[first_at], kind="stable")
    rank = np.empty(len(distinct), dtype=np.int64)
    rank[by_first] = np.arange(len(distinct), dtype=np.int64)
    x = sp.csr_matrix((np.ones(len(key), dtype=np.int64), (rows_, rank[inverse])), shape=(len(texts), len(distinct)))
    x.sum_duplicates()
    terms = []
    for k in distinct[by_first].tolist():
        if k < v:
            terms.append(words[k])
        else:
            a, b = divmod(k - v, v)
            terms.append(words[a] + " " + words[b])
    return terms, x


def _kept_columns(vocab: list[str], tf: np.ndarray, df: np.ndarray, n_doc: int, vec: TfidfVectorizer) -> np.ndarray:
    """Final column of each term id (``vocab``: the terms by id; -1: pruned), as ``CountVectorizer.fit_transform``
    decides it: the document-frequency bounds, then the ``max_features`` terms of highest total count, in alphabetical
    order.

    One departure, at a tie: ``_limit_features`` keeps ``(-tf).argsort()[:max_features]`` over the alphabetically
    sorted terms, and numpy's default sort is not stable, so which of the terms tied at the cut it keeps depends on
    the sort kernel numpy picks for the CPU (AVX-512, AVX2 and none keep three different sets; at 51 x 400 synthetic
    tasks five of the six views cut through a tie).  Here the tie goes to the alphabetically first terms, what a
    stable sort keeps, on every machine.  Only the tied terms and the kept ones are sorted, not the vocabulary.
    """
    max_df, min_df, limit = vec.max_df, vec.min_df, vec.max_features
    high = max_df if isinstance(max_df, Integral) else max_df * n_doc
    low = min_df if isinstance(min_df, Integral) else min_df * n_doc
    kept = np.flatnonzero((df <= high) & (df >= low))
    if limit is not None and len(kept) > limit:
        tfs = tf[kept].astype(vec.dtype)  # compared in the vectorizer's dtype, as _limit_features compares them
        cut = np.partition(tfs, len(tfs) - limit)[len(tfs) - limit]  # the limit-th highest count
        above, tied = kept[tfs > cut], kept[tfs == cut]
        first = heapq.nsmallest(limit - len(above), tied.tolist(), key=vocab.__getitem__)
        kept = np.concatenate([above, np.asarray(first, dtype=np.int64)])
    if not len(kept):
        raise ValueError("After pruning, no terms remain. Try a lower min_df or a higher max_df.")
    col = np.full(len(vocab), -1, dtype=np.int64)
    col[np.asarray(sorted(kept.tolist(), key=vocab.__getitem__), dtype=np.int64)] = np.arange(len(kept))
    return col


def _transformer(vec: TfidfVectorizer, df: np.ndarray, n_doc: int, dtype: Any) -> TfidfTransformer:
    """A ``TfidfTransformer`` with the idf ``TfidfTransformer.fit`` computes from document frequencies ``df``
    over ``n_doc`` documents (fitted on an empty matrix of the right width, then given the corpus idf)."""
    tr = TfidfTransformer(norm=vec.norm, use_idf=vec.use_idf, smooth_idf=vec.smooth_idf, sublinear_tf=vec.sublinear_tf)
    tr.fit(sp.csr_matrix((1, len(df)), dtype=dtype))
    if vec.use_idf:
        fdf = df.astype(dtype, copy=False)
        fdf += float(vec.smooth_idf)
        n = n_doc + int(vec.smooth_idf)
        idf = np.full_like(fdf, fill_value=n, dtype=dtype)
        idf /= fdf
        np.log(idf, out=idf)
        idf += 1.0
        tr.idf_ = idf
    return tr


# ---------------------------------------------------------------------------------------------------
# CSR matrices on disk
# ---------------------------------------------------------------------------------------------------


class DiskCSRWriter:
    """Append row chunks of a CSR matrix to ``folder/<name>_{data,indices,indptr}.npy`` (plain ``.npy`` files).

    ``total_nnz`` must be known up front (the ``.npy`` header holds the shape); rows are written in order.
    """

    def __init__(self, folder: Path, name: str, n_rows: int, n_cols: int, total_nnz: int, dtype: Any):
        self.folder, self.name, self.shape = Path(folder), name, (n_rows, n_cols)
        self.idx_dtype = np.int32 if max(total_nnz, n_cols) < 2**31 else np.int64
        self.nnz, self.rows = 0, 0
        self.indptr = np.zeros(n_rows + 1, dtype=np.int64)
        self._data = self._open("data", total_nnz, dtype)
        self._indices = self._open("indices", total_nnz, self.idx_dtype)
        self.total = total_nnz

    def _open(self, part: str, n: int, dtype: Any) -> Any:
        fh = open(self.folder / f"{self.name}_{part}.npy", "wb")  # noqa: SIM115 - closed in finish()
        np.lib.format.write_array_header_2_0(fh, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": (n,)})
        fh.dtype = np.dtype(dtype)  # type: ignore[attr-defined]
        return fh

    def append(self, x: sp.csr_matrix) -> None:
        x = sp.csr_matrix(x)
        self._data.write(np.ascontiguousarray(x.data, dtype=self._data.dtype).tobytes())
        self._indices.write(np.ascontiguousarray(x.indices, dtype=self.idx_dtype).tobytes())
        self.indptr[self.rows + 1 : self.rows + x.shape[0] + 1] = self.nnz + x.indptr[1:]
        self.rows += x.shape[0]
        self.nnz += x.nnz

    def finish(self) -> None:
        self._data.close()
        self._indices.close()
        if self.rows != self.shape[0] or self.nnz != self.total:
            raise RuntimeError(f"{self.name}: wrote {self.rows} rows / {self.nnz} entries, expected {self.shape[0]} / {self.total}")
        np.save(self.folder / f"{self.name}_indptr.npy", self.indptr.astype(self.idx_dtype))
        np.save(self.folder / f"{self.name}_shape.npy", np.asarray(self.shape, dtype=np.int64))


class DiskCSR:
    """A read-only CSR matrix whose arrays are memory-mapped ``.npy`` files (see ``DiskCSRWriter``).

    ``matrix`` is a ``scipy.sparse.csr_matrix`` over the mapped arrays (no copy); ``release()`` tells the kernel
    the touched pages are not needed now (``MADV_DONTNEED``): they leave the resident set and are read again
    from the page cache on the next access.  ``read_rows`` copies scattered rows with ``pread`` instead, which
    maps nothing.  The files may be deleted once opened (the mappings and descriptors stay valid).
    """

    def __init__(self, folder: Path, name: str):
        folder = Path(folder)
        self.folder, self.name = folder, name
        self.shape = tuple(int(s) for s in np.load(folder / f"{name}_shape.npy"))
        self._maps: list[mmap.mmap] = []
        self._fds: dict[str, tuple[int, int]] = {}  # file name -> (descriptor, offset of the array) for read_rows
        data = self._map(folder / f"{name}_data.npy")
        indices = self._map(folder / f"{name}_indices.npy")
        indptr = np.load(folder / f"{name}_indptr.npy")
        if indices.dtype != indptr.dtype:
            raise ValueError(f"{folder / name}: index dtypes differ ({indices.dtype}, {indptr.dtype})")
        m = sp.csr_matrix(self.shape, dtype=data.dtype)
        m.data, m.indices, m.indptr = data, indices, indptr  # no copy, no check that would write
        m.has_sorted_indices = False
        self.matrix = m
        self.nbytes = data.nbytes + indices.nbytes

    def _map(self, path: Path) -> np.ndarray:
        with open(path, "rb") as fh:
            version = np.lib.format.read_magic(fh)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, _, dtype = read(fh)
            offset = fh.tell()
            n = int(np.prod(shape))
            if n == 0:
                return np.zeros(shape, dtype=dtype)
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            if hasattr(os, "preadv"):  # read_rows: a descriptor of its own (closed with this object)
                fd = os.dup(fh.fileno())
                self._fds[path.name] = (fd, offset)
                weakref.finalize(self, os.close, fd)
        self._maps.append(mm)
        return np.frombuffer(mm, dtype=dtype, count=n, offset=offset)

    @property
    def can_pread(self) -> bool:
        """Whether ``read_rows`` reads without the mapping (``os.preadv`` exists; both arrays have entries)."""
        return len(self._fds) == 2

    def read_rows(self, rows: np.ndarray, cols: np.ndarray, vals: np.ndarray) -> None:
        """The stored entries of ``rows``, in order, into ``cols`` / ``vals`` (sized to their total), read from the
        files by ``pread`` (two reads a row): the same values as the mapping without bringing its pages into the
        resident set.  At a million tasks the scattered rows Eq. 5 refreshes cost about 4 us each this way against
        about 7 us through the mapping (page faults, then the releases that keep it small;
        docs/results/envsched_scale.md).  Raises ``OSError`` on a short read (a truncated file)."""
        (fd_d, off_d), (fd_i, off_i) = self._fds[f"{self.name}_data.npy"], self._fds[f"{self.name}_indices.npy"]
        ptr = self.matrix.indptr
        starts, ends = ptr[rows].tolist(), ptr[np.asarray(rows) + 1].tolist()
        bc, bv = memoryview(cols).cast("B"), memoryview(vals).cast("B")
        ic, iv = cols.itemsize, vals.itemsize
        pos, got, preadv = 0, 0, os.preadv
        for a, b in zip(starts, ends):
            k = pos + b - a
            got += preadv(fd_i, [bc[pos * ic : k * ic]], off_i + a * ic) + preadv(fd_d, [bv[pos * iv : k * iv]], off_d + a * iv)
            pos = k
        if pos != len(cols) or pos != len(vals) or got != pos * (ic + iv):
            raise OSError(f"{self.folder / self.name}: read {got} bytes of {len(rows)} rows, expected {pos * (ic + iv)} into {len(cols)} entries")

    def release(self) -> None:
        for mm in self._maps:
            try:
                mm.madvise(mmap.MADV_DONTNEED)
            except (AttributeError, OSError, ValueError):  # platform without madvise: pages stay until evicted
                pass
