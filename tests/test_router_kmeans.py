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


def test_tfidf_projection_reads_only_the_used_columns_and_keeps_the_bits():
    """The projection of a batch equals scipy's product with the whole matrix, bit for bit,
    whatever the batch (one document, many, empty ones), and reads only the columns used."""
    docs, _ = topic_corpus(6, docs_per_topic=30, seed=1)
    f = TokenTfidfFeaturizer(dim=12, seed=0).fit(docs)
    batch = [docs[0][:1], docs[3], [], [10**9], docs[7][:5], *docs[40:90]]
    x = f._tfidf(batch)
    whole = np.asarray(x @ f.components.T, dtype=np.float32)
    np.testing.assert_array_equal(f._project(x).view(np.int32), whole.view(np.int32))
    np.testing.assert_array_equal(f._project(f._tfidf([docs[3]])).view(np.int32), whole[1:2].view(np.int32))
    seen = []
    real = f.components

    class Spy(np.ndarray):
        def __getitem__(self, key):
            seen.append(key)
            return np.asarray(real).__getitem__(key)

    f.components = real.view(Spy)
    f._project(f._tfidf([docs[3]]))
    f.components = real
    used = sorted(set(f._tfidf([docs[3]]).indices.tolist()))
    assert sorted(np.asarray(seen[0][1]).tolist()) == used and len(used) < real.shape[1]  # its terms only


def test_kmeans_same_centroids_whatever_the_thread_count_and_storage(tmp_path):
    """Each batch is searched single-threaded, so the result cannot depend on threads; a
    memory-mapped input is read in batches and gives the same centroids as an array."""
    import faiss

    import router.kmeans as km

    x, _, _ = blobs(n_per=400, k=6, d=8)  # 2400 rows: several batches below
    mm = np.lib.format.open_memmap(tmp_path / "x.npy", mode="w+", dtype=np.float32, shape=x.shape)
    mm[:] = x
    mm.flush()
    threads = faiss.omp_get_max_threads()
    old_batch = km._BATCH
    try:
        km._BATCH = 512
        faiss.omp_set_num_threads(1)
        one = fit_kmeans(x, 6, seed=3)
        faiss.omp_set_num_threads(2)
        two = fit_kmeans(np.load(tmp_path / "x.npy", mmap_mode="r"), 6, seed=3)
        ids, dist = search(x, one, 2)
        np.testing.assert_array_equal(squared_distances(x, one).argmin(1), ids[:, 0])
    finally:
        km._BATCH = old_batch
        faiss.omp_set_num_threads(threads)
    np.testing.assert_array_equal(one, two)
    assert faiss.omp_get_max_threads() == threads  # the caller's OpenMP setting is left alone


def test_kmeans_sample_then_full_pass_matches_full_lloyd():
    x, _, _ = blobs(n_per=200, k=8, d=16, seed=2)

    def inertia(c):
        return float(search(x, c, 1)[1].mean())

    sampled = fit_kmeans(x, 8, seed=0, sample_per_centroid=16)  # 128 of 1600 points, then all
    full = fit_kmeans(x, 8, seed=0, sample_per_centroid=None)
    assert inertia(sampled) <= 1.01 * inertia(full)
    # random init runs too and nredo keeps the best of its runs
    assert inertia(fit_kmeans(x, 8, seed=0, init="random", nredo=3)) <= inertia(fit_kmeans(x, 8, seed=0, init="random"))


def test_kmeans_fewer_distinct_points_than_k_gives_finite_centroids():
    x = np.repeat(np.eye(3, dtype=np.float32), 10, axis=0)  # 30 rows, 3 distinct points
    c = fit_kmeans(x, 5, seed=0)
    assert c.shape == (5, 3) and np.isfinite(c).all()
    assert set(map(tuple, np.round(c, 6))) <= set(map(tuple, np.eye(3)))
    with pytest.raises(ValueError, match="tol"):
        fit_kmeans(x, 2, tol=-1)


@pytest.mark.gpu
def test_kmeans_uses_faiss_gpu_when_present():
    import faiss

    import router.kmeans as km

    if faiss.get_num_gpus() == 0:
        pytest.skip("faiss sees no GPU (faiss-cpu build or no CUDA device)")
    x, _, centers = blobs(n_per=100, k=6, d=8)
    assert "Gpu" in type(km._Nearest(x[:6]).index).__name__
    c = fit_kmeans(x, 6, seed=1)
    assert np.sqrt(squared_distances(centers.astype(np.float32), c).min(1)).max() < 0.5
