"""k-means and nearest-centroid search with faiss (the only module of ``router`` that imports faiss).

Lloyd's algorithm is written here around faiss's exact nearest-centroid search
(``IndexFlatL2``, on the GPU when faiss-gpu sees one), not with ``faiss.Kmeans``, for
three reasons measured on a shared 2-core host (benchmarks/README.md, "routing"):

* ``faiss.Kmeans`` always runs ``niter`` iterations; from a k-means++ start Lloyd has
  usually converged after a handful, so we stop when the objective stalls (``tol``).
* faiss parallelises each search block with OpenMP inside OpenBLAS: one fork/join per
  4096×k GEMM. When another job holds a core, every barrier waits for a descheduled
  thread and two threads ran 3.3× *slower* than one. Here each worker thread searches its
  own batch of points single-threaded (faiss releases the GIL), so threads only meet once
  per iteration, and the result does not depend on the thread count.
* The k-means++ seeding is a vectorised numpy loop (scikit-learn's ``kmeans_plusplus``
  took 11–20 s for 4096 points × 256 centroids on that host, behind thread oversubscription).

Points are read in batches of ``_BATCH`` rows, so no ``[N, k]`` or ``[N, d]`` temporary is
ever built: fitting and searching a memory-mapped ``[1M, d]`` array stays bounded.
"""
from __future__ import annotations

import logging
import math
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Callable, Iterator

import numpy as np
import scipy.sparse as sp
from threadpoolctl import threadpool_limits



def _faiss() -> ModuleType:
    """faiss, imported on first use: importing ``router`` (dipaco's config reads its routing
    methods' settings) must not load faiss's native library."""
    # faiss logs which SIMD build it loads at INFO; under Hydra (root logger at INFO) that
    # is three lines of noise in every run.
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)
    import faiss

    return faiss


# Rows per search call: large enough that the GEMM dominates the call overhead, small
# enough that a batch's [B, k] distances and [B, d] float32 copy stay a few MB.
_BATCH = 16_384
# k-means++ seeds on a sample of 16 points per centroid (at least 2048, at most 20k): the
# sample only places the initial centroids; Lloyd iterations then use every point.
_PLUSPLUS_PER_CENTROID, _PLUSPLUS_MIN, _PLUSPLUS_MAX = 16, 2048, 20_000


def _as_points(x: np.ndarray, name: str = "x") -> np.ndarray:
    """``x`` as a C-contiguous float32 [N, d] array (no copy when it already is, e.g. a memmap)."""
    x = np.asanyarray(x)
    if x.ndim != 2:
        raise ValueError(f"{name} must be a 2-D array [N, d], got shape {x.shape}")
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        x = np.ascontiguousarray(x, dtype=np.float32)
    for start in range(0, x.shape[0], _BATCH):  # batched: isfinite of [N, d] is N*d bytes
        if not np.isfinite(x[start : start + _BATCH]).all():
            raise ValueError(f"{name} contains NaN or inf; check the featurizer output")
    return x


def _batches(n: int) -> Iterator[slice]:
    for start in range(0, n, _BATCH):
        yield slice(start, min(start + _BATCH, n))


def _threads() -> int:
    return max(1, _faiss().omp_get_max_threads())


def _map_batches(fn: Callable[[slice], object], n: int) -> list:
    """``fn`` over the row batches of ``[0, n)``, in order, on a pool of single-threaded workers."""
    slices = list(_batches(n))
    if _faiss().get_num_gpus() > 0:
        return [fn(s) for s in slices]

    def run(s: slice):
        # OpenMP's thread count is per calling thread: this makes faiss (and the OpenBLAS
        # bundled with it) single-threaded inside this worker only.
        _faiss().omp_set_num_threads(1)
        return fn(s)

    # Even one worker goes through the pool: the caller's own OpenMP setting stays untouched.
    with ThreadPoolExecutor(max(1, min(_threads(), len(slices)))) as pool:
        return list(pool.map(run, slices))


class _Nearest:
    """Exact nearest-centroid search over fixed centroids; faiss-gpu when a GPU is visible."""

    def __init__(self, centroids: np.ndarray):
        index = _faiss().IndexFlatL2(centroids.shape[1])
        if _faiss().get_num_gpus() > 0:
            index = _faiss().index_cpu_to_all_gpus(index)
        index.add(centroids)
        self.index = index

    def __call__(self, x: np.ndarray, k: int = 1) -> tuple[np.ndarray, np.ndarray]:
        dist, ids = self.index.search(np.ascontiguousarray(x, dtype=np.float32), int(k))
        return dist, ids


def _kmeans_plusplus(x: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """Greedy k-means++ (Arthur & Vassilvitskii; 2 + ln k candidates per step) on the rows of ``x``."""
    n = x.shape[0]
    trials = 2 + int(math.log(k))
    norms = np.einsum("ij,ij->i", x, x)
    centers = np.empty((k, x.shape[1]), np.float32)
    first = int(rng.integers(n))
    centers[0] = x[first]
    closest = np.maximum(norms - 2.0 * (x @ x[first]) + norms[first], 0.0)
    for c in range(1, k):
        cum = np.cumsum(closest, dtype=np.float64)
        if cum[-1] <= 0.0:  # fewer distinct points than k: any point is as good as another
            cand = rng.integers(n, size=trials)
        else:
            cand = np.minimum(np.searchsorted(cum, rng.random(trials) * cum[-1], side="right"), n - 1)
        d2 = np.maximum(norms[cand, None] - 2.0 * (x[cand] @ x.T) + norms[None, :], 0.0)
        np.minimum(d2, closest[None, :], out=d2)
        best = int(np.argmin(d2.sum(axis=1)))
        centers[c] = x[cand[best]]
        closest = d2[best]
    return centers


def _sample_rows(x: np.ndarray, m: int, rng: np.random.Generator) -> np.ndarray:
    n = x.shape[0]
    return np.asarray(x) if n <= m else x[np.sort(rng.choice(n, m, replace=False))]


def _lloyd(x: np.ndarray, centroids: np.ndarray, niter: int, tol: float) -> tuple[np.ndarray, float]:
    """Lloyd iterations from ``centroids`` until the objective stalls; returns (centroids, mean sq. distance)."""
    n, d = x.shape
    labels = np.full(n, -1, np.int64)
    prev_obj = math.inf
    for _ in range(niter):
        search = _Nearest(centroids)

        def assign(s: slice) -> tuple[float, int]:
            dist, ids = search(x[s])
            changed = int((labels[s] != ids[:, 0]).sum())
            labels[s] = ids[:, 0]
            return float(dist.sum(dtype=np.float64)), changed

        parts = _map_batches(assign, n)
        obj = sum(p[0] for p in parts) / n
        if sum(p[1] for p in parts) == 0:
            return centroids, obj  # same assignment: the update would give these centroids again
        centroids = _update(x, labels, centroids, search)
        if prev_obj < math.inf and prev_obj - obj <= tol * prev_obj:
            return centroids, obj
        prev_obj = obj
    return centroids, obj


def _update(x: np.ndarray, labels: np.ndarray, old: np.ndarray, search: _Nearest) -> np.ndarray:
    """Centroid of each cluster; an empty cluster takes the point farthest from its centroid."""
    k, d = old.shape
    sums = np.zeros((k, d), np.float64)
    for s in _batches(x.shape[0]):
        rows = labels[s]
        onehot = sp.csr_matrix((np.ones(rows.size, np.float32), (rows, np.arange(rows.size))), shape=(k, rows.size))
        sums += onehot @ x[s]
    counts = np.bincount(labels, minlength=k)
    empty = np.flatnonzero(counts == 0)
    centroids = (sums / np.maximum(counts, 1)[:, None]).astype(np.float32)
    if empty.size:
        # Deterministic repair: the len(empty) points worst served by the old centroids.
        far = np.concatenate([search(x[s])[0][:, 0] for s in _batches(x.shape[0])])
        worst = np.argsort(-far, kind="stable")[: empty.size]
        centroids[empty] = x[np.sort(worst)]
    return centroids


def fit_kmeans(
    x: np.ndarray,
    k: int,
    *,
    niter: int = 20,
    seed: int = 0,
    tol: float = 1e-4,
    sample_per_centroid: int | None = 64,
    init: str = "k-means++",
    nredo: int = 1,
) -> np.ndarray:
    """Cluster the rows of ``x`` into ``k`` centroids; returns float32 ``[k, d]``.

    Deterministic for a fixed ``seed``, whatever the thread count. ``k == 1`` returns the
    mean. ``x`` may be a memory-mapped array: it is read in batches, never copied whole.

    Small inputs: ``N < k`` raises ValueError (some cluster would have no point; use a
    smaller grid or more documents). A cluster that ends up empty takes the point farthest
    from its centroid; with fewer distinct points than ``k`` some centroids coincide
    (routing ties go to the lower path id, and balanced assignment fills those paths).

    Args:
        niter: at most this many Lloyd iterations.
        tol: stop once an iteration lowers the mean squared distance by less than this
            fraction (0 = run until the assignment stops changing or ``niter``).
        init: ``"k-means++"`` (default): greedy k-means++ on a seeded sample of 16 points
            per centroid (2048–20k points); ``"random"``: k distinct random points, which on
            separable data often merges two true clusters and splits another (measured:
            NMI 0.94 vs 1.0 on 8 planted topics).
        nredo: independent runs (different seeds), keeping the lowest objective.
        sample_per_centroid: Lloyd first converges on a seeded sample of this many points
            per centroid, then runs one iteration on all points (every point assigned,
            every centroid the mean of its points). 64 points place a centroid as well as
            all of them on the routing benchmark (mean squared distance 71.06 vs 71.13 for
            Lloyd on all 100k points) at a fraction of the passes. None: every iteration
            on all points.
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
    if init not in ("k-means++", "random"):
        raise ValueError(f"init must be 'k-means++' or 'random', got {init!r}")
    if not tol >= 0.0:
        raise ValueError(f"tol must be >= 0, got {tol}")
    if k == 1:
        total = sum(x[s].sum(axis=0, dtype=np.float64) for s in _batches(n))
        return (total / n).astype(np.float32)[None, :]
    rng = np.random.default_rng(seed)
    best, best_obj = None, math.inf
    for _ in range(max(1, int(nredo))):
        if init == "k-means++":
            m = min(max(_PLUSPLUS_PER_CENTROID * k, _PLUSPLUS_MIN), _PLUSPLUS_MAX)
            # Hundreds of small sequential GEMMs: a multi-threaded BLAS only adds barriers
            # (measured 5x slower with 2 threads on a loaded 2-core host).
            with threadpool_limits(1, user_api="blas"):
                start = _kmeans_plusplus(_sample_rows(x, m, rng), k, rng)
        else:
            start = np.asarray(x[np.sort(rng.choice(n, k, replace=False))], np.float32)
        full_iters = int(niter)
        if sample_per_centroid is not None and n > k * int(sample_per_centroid):
            sample = _sample_rows(x, k * int(sample_per_centroid), rng)
            start, _ = _lloyd(sample, start, int(niter), float(tol))
            full_iters = 1
        centroids, obj = _lloyd(x, start, full_iters, float(tol))
        if obj < best_obj:
            best, best_obj = centroids, obj
    return np.ascontiguousarray(best, dtype=np.float32)


def squared_distances(x: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """Squared L2 distances ``[N, k]`` (float32, >= 0) from each row of ``x`` to each centroid.

    All distances, not just the nearest: path costs add distances across levels. Computed
    in batches (||x||² − 2x·c + ||c||²), so temporaries stay ``[batch, k]``.
    """
    x = _as_points(x)
    c = _as_points(centroids, "centroids")
    if x.shape[1] != c.shape[1]:
        raise ValueError(f"x has dimension {x.shape[1]} but centroids have {c.shape[1]}")
    out = np.empty((x.shape[0], c.shape[0]), np.float32)
    cc = np.einsum("ij,ij->i", c, c)
    for s in _batches(x.shape[0]):
        xb = x[s]
        d2 = np.einsum("ij,ij->i", xb, xb)[:, None] - 2.0 * (xb @ c.T) + cc[None, :]
        np.maximum(d2, 0.0, out=out[s])
    return out


def search(x: np.ndarray, centroids: np.ndarray, k: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` nearest centroids of each row, nearest first: ``(ids int64 [N,k], sq. dist float32 [N,k])``."""
    x = _as_points(x)
    c = _as_points(centroids, "centroids")
    if not 1 <= k <= c.shape[0]:
        raise ValueError(f"k must be in [1, {c.shape[0]}] (number of centroids), got {k}")
    if x.shape[1] != c.shape[1]:
        raise ValueError(f"x has dimension {x.shape[1]} but centroids have {c.shape[1]}")
    nearest = _Nearest(c)
    parts = _map_batches(lambda s: nearest(x[s], k), x.shape[0])
    if not parts:
        return np.zeros((0, k), np.int64), np.zeros((0, k), np.float32)
    dist = np.concatenate([p[0] for p in parts])
    ids = np.concatenate([p[1] for p in parts])
    return ids.astype(np.int64), dist.astype(np.float32)


__all__ = ["fit_kmeans", "squared_distances", "search"]
