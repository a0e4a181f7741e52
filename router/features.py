"""Featurizers: turn the routing prefix of a document (token ids) into a dense vector.

Two kinds exist:

* :class:`TokenTfidfFeaturizer` (the default): TF-IDF over the prefix's token ids
  (unigrams and, optionally, adjacent bigrams), projected to ``dim`` by a truncated SVD
  and L2-normalised. Its whole state is plain numpy arrays + JSON-able params, so a
  Router can be saved without pickle.
* :class:`CallableFeaturizer`: wraps an LM featurizer ``fn(list_of_prefixes) -> [N, d]``
  (e.g. the mean hidden state of the prefix, provided by dipaco). Its state is the
  callable itself, which cannot be saved as arrays: the Router records its kind and the
  caller passes the callable again on load.

Featurizers see whatever token sequences they are given; the Router is the one that cuts
documents to their first ``prefix_tokens`` tokens.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Sequence

import numpy as np
import scipy.sparse as sp

TokenDocs = Sequence[Sequence[int]]

# Token ids must fit in 31 bits so a bigram (a, b) packs exactly (no hashing, no
# collisions) into one int64 key: ((a + 1) << 31) | b, which never overlaps a unigram key.
_MAX_TOKEN_ID = (1 << 31) - 1
# Above this many documents, transform() shows a tqdm bar (unless progress=False).
_PROGRESS_MIN_DOCS = 50_000
# Below this many (documents x vocabulary) cells the SVD runs on one BLAS thread.
_SMALL_SVD = 50_000_000


def as_token_array(doc: Sequence[int] | np.ndarray, *, name: str = "docs") -> np.ndarray:
    """Return ``doc`` as a 1-D int64 array, or raise a ValueError that says what is wrong.

    Accepts lists/tuples of ints and integer numpy arrays; an empty document is allowed.
    """
    arr = np.asarray(doc)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(
            f"{name}: each document must be a 1-D sequence of token ids, got shape {arr.shape}; "
            "tokenize text first (routing uses token ids only)"
        )
    if arr.dtype.kind not in "iu":
        raise ValueError(
            f"{name}: token ids must be integers, got dtype {arr.dtype}; "
            "tokenize text first (routing uses token ids only)"
        )
    arr = arr.astype(np.int64, copy=False)
    if arr.min() < 0 or arr.max() > _MAX_TOKEN_ID:
        raise ValueError(
            f"{name}: token ids must lie in [0, {_MAX_TOKEN_ID}], got range "
            f"[{arr.min()}, {arr.max()}]"
        )
    return arr


def _l2_normalise(x: np.ndarray) -> np.ndarray:
    """Row-wise L2 normalisation; all-zero rows (empty prefix, unseen tokens) stay zero."""
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return (x / np.maximum(norms, 1e-12)).astype(np.float32, copy=False)


def progress_bar(total: int, enabled: bool | None, desc: str):
    """A tqdm bar over ``total`` documents, or None: when ``enabled`` is False, when it is
    None and the input is small, and whenever stderr is not a terminal (a bar redraws
    itself with ``\\r``: in a log file that is thousands of lines of noise). The same rule
    as ``dipaco.runtime.progress``, which ``router`` may not import."""
    if enabled is False or (enabled is None and total < _PROGRESS_MIN_DOCS) or not sys.stderr.isatty():
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="doc", leave=False)


class TokenTfidfFeaturizer:
    """TF-IDF of token ids → truncated SVD to ``dim`` → L2-normalised float32 features.

    Args:
        dim: output dimension. Always exactly ``dim``: when the vocabulary or the corpus
            supports fewer SVD components, the missing components are zero.
        seed: seed of the randomized SVD (fixed seed → identical features).
        bigrams: also count adjacent token pairs of the prefix.
        min_df: drop terms seen in fewer documents than this at fit time.
        max_features: keep at most this many terms (the most frequent by document count).
        sublinear_tf: use ``1 + log(tf)`` instead of raw counts (long repeated runs of one
            token, e.g. padding or indentation, then do not dominate the prefix).
        batch_size: documents per transform batch (bounds memory on large inputs).
        progress: tqdm bar: None = only on large inputs, False = never, True = always;
            never when stderr is not a terminal.
    """

    kind = "token_tfidf"

    def __init__(
        self,
        dim: int = 64,
        seed: int = 0,
        *,
        bigrams: bool = True,
        min_df: int = 1,
        max_features: int | None = 200_000,
        sublinear_tf: bool = True,
        batch_size: int = 16_384,
        progress: bool | None = None,
    ) -> None:
        if int(dim) < 1:
            raise ValueError(f"dim must be >= 1, got {dim}")
        if int(min_df) < 1:
            raise ValueError(f"min_df must be >= 1, got {min_df}")
        if max_features is not None and int(max_features) < 1:
            raise ValueError(f"max_features must be >= 1 or None, got {max_features}")
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.dim = int(dim)
        self.seed = int(seed)
        self.bigrams = bool(bigrams)
        self.min_df = int(min_df)
        self.max_features = None if max_features is None else int(max_features)
        self.sublinear_tf = bool(sublinear_tf)
        self.batch_size = int(batch_size)
        self.progress = progress
        # Fitted state: sorted int64 term keys, their idf, and the SVD components [dim, V].
        self.vocab_keys: np.ndarray | None = None
        self.idf: np.ndarray | None = None
        self.components: np.ndarray | None = None

    # ------------------------------------------------------------------ helpers
    @property
    def is_fitted(self) -> bool:
        return self.components is not None

    def _term_keys(self, docs: TokenDocs) -> tuple[np.ndarray, np.ndarray]:
        """(row index, term key) of every unigram (and bigram) occurrence in ``docs``."""
        arrays = [as_token_array(d) for d in docs]
        lengths = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
        if lengths.sum() == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        flat = np.concatenate(arrays)
        rows = np.repeat(np.arange(len(arrays), dtype=np.int64), lengths)
        keys = [flat]
        key_rows = [rows]
        if self.bigrams and flat.size > 1:
            same_doc = rows[1:] == rows[:-1]
            a, b = flat[:-1][same_doc], flat[1:][same_doc]
            keys.append(((a + 1) << 31) | b)
            key_rows.append(rows[1:][same_doc])
        return np.concatenate(key_rows), np.concatenate(keys)

    def _tfidf(self, docs: TokenDocs) -> sp.csr_matrix:
        """Sparse TF-IDF rows (L2-normalised) over the fitted vocabulary."""
        assert self.vocab_keys is not None and self.idf is not None
        rows, keys = self._term_keys(docs)
        vocab = self.vocab_keys
        if vocab.size:
            col = np.searchsorted(vocab, keys)
            col = np.minimum(col, vocab.size - 1)
            known = vocab[col] == keys
        else:
            col = np.zeros_like(keys)
            known = np.zeros(keys.shape, bool)
        # Terms never seen at fit time carry no idf and are dropped.
        m = sp.coo_matrix(
            (np.ones(int(known.sum()), np.float32), (rows[known], col[known])),
            shape=(len(docs), max(vocab.size, 1)),
        ).tocsr()
        m.sum_duplicates()
        if self.sublinear_tf:
            m.data = 1.0 + np.log(m.data)
        if vocab.size:
            m = m.multiply(self.idf[None, :]).tocsr()
        norms = np.sqrt(np.asarray(m.multiply(m).sum(axis=1)).ravel())
        return sp.diags(1.0 / np.maximum(norms, 1e-12)) @ m

    # ------------------------------------------------------------------ API
    def fit(self, docs: TokenDocs) -> "TokenTfidfFeaturizer":
        """Learn the vocabulary, idf and SVD projection from ``docs`` (token-id prefixes)."""
        from sklearn.utils.extmath import randomized_svd  # lazy: keeps `import router` light

        n = len(docs)
        if n == 0:
            raise ValueError("docs is empty: the featurizer needs at least one document to fit")
        rows, keys = self._term_keys(docs)
        # Document frequency: count each (doc, term) once: the distinct (doc, term) pairs,
        # found by one sort of the occurrences (no [M, 2] array and its row-unique copies)
        order = np.lexsort((keys, rows))
        rows, keys = rows[order], keys[order]
        first = np.ones(keys.size, bool)
        first[1:] = (rows[1:] != rows[:-1]) | (keys[1:] != keys[:-1])
        terms, df = np.unique(keys[first], return_counts=True)
        del rows, keys, order, first  # the SVD below is the fit's peak: nothing else stays
        keep = df >= self.min_df
        terms, df = terms[keep], df[keep]
        if self.max_features is not None and terms.size > self.max_features:
            # Most frequent first; ties broken by key so the choice is deterministic.
            order = np.lexsort((terms, -df))[: self.max_features]
            order.sort()
            terms, df = terms[order], df[order]
        self.vocab_keys = terms.astype(np.int64)
        # Smoothed idf (as if one extra document contained every term): never zero or inf.
        self.idf = (np.log((1.0 + n) / (1.0 + df)) + 1.0).astype(np.float32)
        x = self._tfidf(docs).astype(np.float64)
        # Small SVDs run faster on one BLAS thread: with several threads each tiny LU/QR
        # pays synchronisation costs (measured 0.1 s vs up to 2 s on a busy 2-core host).
        small = n * max(terms.size, 1) < _SMALL_SVD
        n_comp = min(self.dim, terms.size, n)
        vt = None
        if n_comp >= 1 and x.nnz:
            from threadpoolctl import threadpool_limits  # lazy: scikit-learn's dependency, needed only here

            with threadpool_limits(limits=1 if small else None):
                _, _, vt = randomized_svd(x, n_comp, n_iter=5, random_state=self.seed)
        del x
        components = np.zeros((self.dim, max(terms.size, 1)), np.float32)
        for i in range(n_comp if vt is not None else 0):  # a row at a time: no [dim, terms] float64 temporaries
            # Sign convention: the largest-magnitude entry of each component is positive,
            # so features do not flip sign between library versions.
            row = vt[i]
            components[i] = (row * np.sign(row[np.abs(row).argmax()])).astype(np.float32)
        self.components = components
        return self

    def _project(self, x: sp.csr_matrix) -> np.ndarray:
        """``x @ components.T``, reading only the columns ``x`` uses.

        ``components.T`` is a Fortran-ordered ``[V, dim]`` view, and scipy's sparse-times-dense
        product copies a dense operand that is not C-ordered whole on every call: 19 of the
        22 ms a one-prompt route took on the README's default run, where the prompt uses at
        most a few dozen of the vocabulary's columns. The columns used, copied C-ordered, give
        the same products summed in the same order (the same bits).
        """
        assert self.components is not None
        cols, inverse = np.unique(x.indices, return_inverse=True)
        used = np.ascontiguousarray(self.components[:, cols].T)
        narrow = sp.csr_matrix((x.data, inverse.astype(x.indices.dtype, copy=False), x.indptr),
                               shape=(x.shape[0], cols.size))
        return np.asarray(narrow @ used, dtype=np.float32)

    def transform(self, docs: TokenDocs) -> np.ndarray:
        """Features of ``docs``: float32 ``[N, dim]``, rows L2-normalised (empty → zeros)."""
        if not self.is_fitted:
            raise ValueError("TokenTfidfFeaturizer is not fitted: call fit(docs) first")
        n = len(docs)
        out = np.zeros((n, self.dim), np.float32)
        bar = progress_bar(n, self.progress, "featurize")
        for start in range(0, n, self.batch_size):
            batch = docs[start : start + self.batch_size]
            out[start : start + len(batch)] = self._project(self._tfidf(batch))
            if bar is not None:
                bar.update(len(batch))
        if bar is not None:
            bar.close()
        return _l2_normalise(out)

    def fit_transform(self, docs: TokenDocs) -> np.ndarray:
        return self.fit(docs).transform(docs)

    # ------------------------------------------------------------------ state
    def params(self) -> dict[str, Any]:
        """JSON-able constructor parameters (what the manifest records)."""
        return {
            "dim": self.dim,
            "seed": self.seed,
            "bigrams": self.bigrams,
            "min_df": self.min_df,
            "max_features": self.max_features,
            "sublinear_tf": self.sublinear_tf,
            "batch_size": self.batch_size,
        }

    def state_arrays(self) -> dict[str, np.ndarray]:
        """The fitted state as plain numpy arrays (saved without pickle)."""
        if not self.is_fitted:
            raise ValueError("TokenTfidfFeaturizer is not fitted: nothing to save")
        return {"vocab_keys": self.vocab_keys, "idf": self.idf, "components": self.components}

    @classmethod
    def from_state(cls, params: dict[str, Any], arrays: dict[str, np.ndarray]) -> "TokenTfidfFeaturizer":
        """Rebuild a fitted featurizer from :meth:`params` and :meth:`state_arrays`."""
        f = cls(**params)
        missing = {"vocab_keys", "idf", "components"} - set(arrays)
        if missing:
            raise ValueError(f"featurizer state lacks arrays {sorted(missing)}")
        f.vocab_keys = np.asarray(arrays["vocab_keys"], np.int64)
        f.idf = np.asarray(arrays["idf"], np.float32)
        f.components = np.asarray(arrays["components"], np.float32)
        if f.components.shape[0] != f.dim or f.idf.shape[0] != f.vocab_keys.shape[0]:
            raise ValueError(
                f"featurizer state is inconsistent: components {f.components.shape}, "
                f"idf {f.idf.shape}, vocab {f.vocab_keys.shape}, dim {f.dim}"
            )
        return f


class CallableFeaturizer:
    """Wrap an LM featurizer ``fn(list_of_prefixes) -> array [N, dim]``.

    ``fn`` receives a list of 1-D int64 numpy arrays (the prefixes) in batches of
    ``batch_size`` and must return one row per prefix. Empty prefixes are not passed to
    ``fn`` (a model may not accept them); their features are zeros. Rows are
    L2-normalised when ``normalize`` is true, so k-means sees cosine geometry as with
    the default featurizer.
    """

    kind = "callable"

    def __init__(
        self,
        fn: Callable[[list[np.ndarray]], Any],
        dim: int,
        *,
        normalize: bool = True,
        batch_size: int = 256,
        progress: bool | None = None,
    ) -> None:
        if not callable(fn):
            raise ValueError(f"fn must be callable (list of prefixes -> [N, dim] array), got {type(fn)}")
        if int(dim) < 1:
            raise ValueError(f"dim must be >= 1, got {dim}")
        self.fn = fn
        self.dim = int(dim)
        self.normalize = bool(normalize)
        self.batch_size = int(batch_size)
        self.progress = progress

    is_fitted = True

    def fit(self, docs: TokenDocs) -> "CallableFeaturizer":
        """No-op: the LM that backs ``fn`` is trained elsewhere."""
        return self

    def transform(self, docs: TokenDocs) -> np.ndarray:
        """Features of ``docs``: float32 ``[N, dim]`` (empty prefixes → zeros)."""
        arrays = [as_token_array(d) for d in docs]
        out = np.zeros((len(arrays), self.dim), np.float32)
        nonempty = [i for i, a in enumerate(arrays) if a.size]
        bar = progress_bar(len(nonempty), self.progress, "featurize (LM)")
        for start in range(0, len(nonempty), self.batch_size):
            idx = nonempty[start : start + self.batch_size]
            feats = np.asarray(self.fn([arrays[i] for i in idx]), dtype=np.float32)
            if feats.shape != (len(idx), self.dim):
                raise ValueError(
                    f"featurizer fn returned shape {feats.shape} for {len(idx)} prefixes; "
                    f"expected ({len(idx)}, {self.dim}) — pass the dim the LM produces"
                )
            out[idx] = feats
            if bar is not None:
                bar.update(len(idx))
        if bar is not None:
            bar.close()
        return _l2_normalise(out) if self.normalize else out

    def fit_transform(self, docs: TokenDocs) -> np.ndarray:
        return self.transform(docs)

    def params(self) -> dict[str, Any]:
        return {"dim": self.dim, "normalize": self.normalize, "batch_size": self.batch_size}

    def state_arrays(self) -> dict[str, np.ndarray]:
        return {}


def featurizer_from_state(
    kind: str,
    params: dict[str, Any],
    arrays: dict[str, np.ndarray],
    featurizer_fn: Callable[[list[np.ndarray]], Any] | None = None,
):
    """Rebuild a featurizer of ``kind`` from saved params/arrays (and the callable, if LM)."""
    if kind == TokenTfidfFeaturizer.kind:
        return TokenTfidfFeaturizer.from_state(params, arrays)
    if kind == CallableFeaturizer.kind:
        if featurizer_fn is None:
            raise ValueError(
                "this router was fitted with an LM featurizer (kind 'callable'), which cannot be "
                "saved as arrays: pass featurizer_fn=<the same fn> to Router.load"
            )
        return CallableFeaturizer(featurizer_fn, **params)
    raise ValueError(f"unknown featurizer kind {kind!r}; expected 'token_tfidf' or 'callable'")


__all__ = [
    "TokenTfidfFeaturizer",
    "CallableFeaturizer",
    "as_token_array",
    "featurizer_from_state",
]
