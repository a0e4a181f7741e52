"""k-means and nearest-centroid search with faiss (the only module of ``router`` that imports faiss).

faiss is ~8x faster than scikit-learn's KMeans at routing scale (see
benchmarks/bench_routing.py); keeping it behind these three functions lets the rest of the
package stay numpy-only.
"""
from __future__ import annotations

import logging

import numpy as np

# faiss logs which SIMD build it loads at INFO; under Hydra (root logger at INFO) that
# is three lines of noise in every run.
logging.getLogger("faiss.loader").setLevel(logging.WARNING)
import faiss  # noqa: E402

# k-means++ seeding costs O(sample * k * d * log k): seed on a sample of 16 points per
# centroid (at least 2048, at most 20k). Measured for k = 256, d = 256 on a busy 2-core
# host: 4096 points 3 s, 20k points 29 s; the sample only places the initial centroids,
# Lloyd iterations then use every point.
_PLUSPLUS_PER_CENTROID, _PLUSPLUS_MIN, _PLUSPLUS_MAX = 16, 2048, 20_000
# Below this many point-centroid-dimension products per iteration, k-means uses one thread.
_SMALL_PROBLEM = 20_000_000


def _as_points(x: np.ndarray, name: str = "x") -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"{name} must be a 2-D array [N, d], got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError(f"{name} contains NaN or inf; check the featurizer output")
    return x


def fit_kmeans(
    x: np.ndarray,
    k: int,
    *,
    niter: int = 20,
    seed: int = 0,
    max_points_per_centroid: int | None = None,
    init: str = "k-means++",
    nredo: int = 1,
) -> np.ndarray:
    """Cluster the rows of ``x`` into ``k`` centroids; returns float32 ``[k, d]``.

    Deterministic for a fixed ``seed`` (and thread count). ``k == 1`` returns the mean
    without calling faiss.

    Small inputs: ``N < k`` raises ValueError (some cluster would have no point; use a
    smaller grid or more documents). When ``N >= k`` but there are fewer distinct points
    than ``k``, faiss splits clusters and some centroids coincide; routing still works
    (ties go to the lower path id) but those paths will receive few documents, which
    balanced assignment then fills.

    Args:
        init: ``"k-means++"`` (default) seeds faiss with scikit-learn's k-means++ on a
            seeded sample of 16 points per centroid (2048–20k points); ``"random"`` is faiss's
            own init (k random points), which on separable data often merges two true
            clusters and splits another (measured: NMI 0.94 vs 1.0 on 8 planted topics).
        nredo: independent runs, keeping the lowest objective (random init only).
        max_points_per_centroid: faiss subsamples to ``k * max_points_per_centroid``
            points before clustering (faiss's own default is 256). None = use all points,
            which is what routing quality wants at our sizes.
    """
    x = _as_points(x)
    n, d = x.shape
    k = int(k)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if n < k:
        raise ValueError(
            f"cannot cluster {n} points into k={k} centroids: need at least k points "
            "(route more documents or use a smaller grid)"
        )
    if niter < 1:
        raise ValueError(f"niter must be >= 1, got {niter}")
    if k == 1:
        return x.mean(axis=0, keepdims=True).astype(np.float32)
    if init not in ("k-means++", "random"):
        raise ValueError(f"init must be 'k-means++' or 'random', got {init!r}")
    if max_points_per_centroid is None:
        max_points_per_centroid = -(-n // k) + 1
    km = faiss.Kmeans(
        d,
        k,
        niter=int(niter),
        seed=int(seed),
        verbose=False,
        # We handle small N ourselves; this only silences faiss's "provide at least 39*k
        # points" warning on stderr.
        min_points_per_centroid=1,
        max_points_per_centroid=int(max_points_per_centroid),
    )
    init_centroids = None
    if init == "k-means++":
        from sklearn.cluster import kmeans_plusplus

        rng = np.random.default_rng(seed)
        m = min(max(_PLUSPLUS_PER_CENTROID * k, _PLUSPLUS_MIN), _PLUSPLUS_MAX)
        sample = x if n <= m else x[np.sort(rng.choice(n, m, replace=False))]
        init_centroids, _ = kmeans_plusplus(sample, k, random_state=seed)
        init_centroids = np.ascontiguousarray(init_centroids, dtype=np.float32)
    else:
        km.cp.nredo = int(nredo)
    # Tiny problems run faster on one OpenMP thread (thread start-up and barriers dominate,
    # badly so on a loaded host); faiss's thread count is process-global, so restore it.
    threads = faiss.omp_get_max_threads()
    if n * k * d < _SMALL_PROBLEM:
        faiss.omp_set_num_threads(1)
    try:
        km.train(x, init_centroids=init_centroids)
    finally:
        faiss.omp_set_num_threads(threads)
    return np.ascontiguousarray(km.centroids, dtype=np.float32).reshape(k, d)


def squared_distances(x: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """Squared L2 distances ``[N, k]`` (float32, >= 0) from each row of ``x`` to each centroid.

    A plain numpy expression (||x||² − 2x·c + ||c||²): routing needs all distances, not just
    the nearest, because path costs add distances across levels.
    """
    x = _as_points(x)
    c = _as_points(centroids, "centroids")
    if x.shape[1] != c.shape[1]:
        raise ValueError(f"x has dimension {x.shape[1]} but centroids have {c.shape[1]}")
    d2 = (x * x).sum(1, keepdims=True) - 2.0 * (x @ c.T) + (c * c).sum(1)[None, :]
    return np.maximum(d2, 0.0).astype(np.float32, copy=False)


def search(x: np.ndarray, centroids: np.ndarray, k: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` nearest centroids of each row, nearest first: ``(ids int64 [N,k], sq. dist float32 [N,k])``."""
    x = _as_points(x)
    c = _as_points(centroids, "centroids")
    if not 1 <= k <= c.shape[0]:
        raise ValueError(f"k must be in [1, {c.shape[0]}] (number of centroids), got {k}")
    index = faiss.IndexFlatL2(c.shape[1])
    index.add(c)
    dist, ids = index.search(x, int(k))
    return ids.astype(np.int64), dist.astype(np.float32)


__all__ = ["fit_kmeans", "squared_distances", "search"]
