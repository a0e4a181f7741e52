"""faiss k-means wrapper and featurizers."""
from __future__ import annotations

import numpy as np
import pytest

from router import TokenTfidfFeaturizer, fit_kmeans, search, squared_distances
from router.features import featurizer_from_state
from router.synthetic import topic_corpus


def blobs(n_per: int = 50, k: int = 6, d: int = 8, seed: int = 0):
    rng = np.random.default_rng(seed)
    centers = rng.normal(0, 5, (k, d))
    x = np.vstack([c + rng.normal(0, 0.3, (n_per, d)) for c in centers]).astype(np.float32)
    return x, np.repeat(np.arange(k), n_per), centers


def test_kmeans_is_deterministic_and_finds_separated_blobs():
    x, y, centers = blobs()
    a = fit_kmeans(x, 6, seed=1)
    b = fit_kmeans(x, 6, seed=1)
    np.testing.assert_array_equal(a, b)
    assert a.shape == (6, 8) and a.dtype == np.float32
    # each true center has a centroid close by
    assert np.sqrt(squared_distances(centers.astype(np.float32), a).min(1)).max() < 0.5


def test_kmeans_small_inputs():
    x, _, _ = blobs(n_per=1, k=4)
    with pytest.raises(ValueError, match="at least k"):
        fit_kmeans(x, 5)
    np.testing.assert_allclose(fit_kmeans(x, 1), x.mean(0, keepdims=True), rtol=1e-6)
    assert fit_kmeans(x, 4).shape == (4, 8)  # N == k works
    with pytest.raises(ValueError, match="NaN"):
        fit_kmeans(np.full((10, 2), np.nan), 2)


def test_squared_distances_and_search_agree_with_brute_force():
    rng = np.random.default_rng(0)
    x, c = rng.normal(size=(30, 5)).astype(np.float32), rng.normal(size=(7, 5)).astype(np.float32)
    brute = ((x[:, None, :] - c[None]) ** 2).sum(-1)
    np.testing.assert_allclose(squared_distances(x, c), brute, rtol=1e-4, atol=1e-5)
    ids, dist = search(x, c, 3)
    np.testing.assert_array_equal(ids, np.argsort(brute, 1)[:, :3])
    assert (np.diff(dist, axis=1) >= 0).all()


def test_tfidf_featurizer_shapes_state_and_round_trip():
    docs, labels = topic_corpus(4, docs_per_topic=10, seed=0)
    f = TokenTfidfFeaturizer(dim=16, seed=0)
    x = f.fit_transform(docs)
    assert x.shape == (40, 16) and x.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(x, axis=1), 1.0, rtol=1e-5)
    # same topic → more similar than different topic
    sim = x @ x.T
    same = labels[:, None] == labels[None, :]
    assert sim[same].mean() > sim[~same].mean() + 0.5
    # unseen tokens and empty docs → zero rows, no crash
    z = f.transform([[], [10**9]])
    assert np.all(z == 0)
    # exported state is plain arrays + JSON params and reproduces features exactly
    arrays = f.state_arrays()
    assert all(isinstance(a, np.ndarray) and a.dtype != object for a in arrays.values())
    g = featurizer_from_state("token_tfidf", f.params(), arrays)
    np.testing.assert_array_equal(g.transform(docs), x)
    # dim larger than the corpus supports: still exactly dim columns
    assert TokenTfidfFeaturizer(dim=100).fit_transform(docs[:5]).shape == (5, 100)
    with pytest.raises(ValueError, match="not fitted"):
        TokenTfidfFeaturizer().transform(docs)
