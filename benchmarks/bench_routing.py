"""Routing benchmark: faiss vs scikit-learn k-means, and end-to-end featurize + route throughput.

    python benchmarks/bench_routing.py            # full: 1M x 256-d → 256 clusters
    python benchmarks/bench_routing.py --quick    # 100k x 256-d → 256, plus MiniBatchKMeans

Prints a table and writes benchmarks/results/routing.json (not committed).
Not a test: timings depend on the host (±20% run to run on a shared 2-core host).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np


def clustered_points(n: int, d: int, k: int, seed: int = 0) -> np.ndarray:
    """Gaussian blobs around k random centres (k-means on pure noise is not representative)."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((k, d)).astype(np.float32)
    x = centres[rng.integers(0, k, n)]
    x += 0.5 * rng.standard_normal((n, d), dtype=np.float32)
    return x


def inertia(x: np.ndarray, centroids: np.ndarray) -> float:
    """Mean squared distance to the nearest centroid (quality check across libraries)."""
    from router.kmeans import search

    _, dist = search(x, centroids, 1)
    return float(dist.mean())


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def bench_kmeans(n: int, d: int, k: int, niter: int, minibatch: bool) -> list[dict]:
    from sklearn.cluster import KMeans, MiniBatchKMeans

    from router.kmeans import fit_kmeans

    x = clustered_points(n, d, k)
    rows = []
    s, c = timed(lambda: fit_kmeans(x, k, niter=niter, seed=0, init="random"))
    rows.append({"method": "faiss (all points, random init)", "seconds": s, "inertia": inertia(x, c)})
    s, c = timed(lambda: fit_kmeans(x, k, niter=niter, seed=0, init="random", max_points_per_centroid=256))
    rows.append({"method": "faiss (sample 256/centroid)", "seconds": s, "inertia": inertia(x, c)})
    s, c = timed(lambda: fit_kmeans(x, k, niter=niter, seed=0))
    rows.append({"method": "faiss (all points, k-means++ init)", "seconds": s, "inertia": inertia(x, c)})
    # tol=0 so scikit-learn runs the same number of Lloyd iterations as faiss.
    km = KMeans(k, n_init=1, max_iter=niter, tol=0.0, init="random", random_state=0)
    s, _ = timed(lambda: km.fit(x))
    # scikit-learn stops early once labels stop changing: record how many iterations ran.
    rows.append({"method": "sklearn KMeans (n_init=1, random init)", "seconds": s, "iterations": int(km.n_iter_),
                 "inertia": inertia(x, km.cluster_centers_.astype(np.float32))})
    if minibatch:
        mb = MiniBatchKMeans(k, n_init=1, max_iter=niter, batch_size=4096, random_state=0)
        s, _ = timed(lambda: mb.fit(x))
        rows.append({"method": "sklearn MiniBatchKMeans", "seconds": s, "iterations": int(mb.n_iter_),
                     "inertia": inertia(x, mb.cluster_centers_.astype(np.float32))})
    for r in rows:
        r.setdefault("iterations", niter)  # faiss always runs niter Lloyd iterations
        r.update(n=n, d=d, k=k, niter=niter)
    return rows


def bench_end_to_end(n_fit: int, n_route: int, grid: list[int], method: str) -> dict:
    from router import Router
    from router.synthetic import topic_corpus

    per_topic = (n_fit + n_route) // 16 + 1
    docs, _ = topic_corpus(16, docs_per_topic=per_topic, vocab_per_topic=500, length=(32, 200),
                           shared_vocab=2000, shared_rate=0.3, seed=0)
    order = np.random.default_rng(0).permutation(len(docs))
    fit_docs = [docs[i] for i in order[:n_fit]]
    route_docs = [docs[i] for i in order[n_fit : n_fit + n_route]]
    fit_s, router = timed(lambda: Router.fit(fit_docs, grid, method=method, seed=0))
    route_s, _ = timed(lambda: router.route_batch(route_docs))
    assign_s, _ = timed(lambda: router.assign(route_docs))
    return {"grid": grid, "method": method, "fit_docs": n_fit, "fit_seconds": fit_s,
            "route_docs": len(route_docs), "route_seconds": route_s,
            "docs_per_second": len(route_docs) / route_s,
            "balanced_assign_docs_per_second": len(route_docs) / assign_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="100k points instead of 1M (about a minute)")
    ap.add_argument("--threads", type=int, default=None,
                    help="threads for faiss (OpenMP) and scikit-learn/BLAS; default: library defaults. "
                         "On a loaded host, OpenMP with more threads than free cores can be 3x slower")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "routing.json"))
    args = ap.parse_args()

    if args.threads is not None:
        import faiss
        from threadpoolctl import threadpool_limits

        faiss.omp_set_num_threads(args.threads)
        threadpool_limits(args.threads)
    load_before = os.getloadavg()[0]
    n = 100_000 if args.quick else 1_000_000
    kmeans_rows = bench_kmeans(n, 256, 256, niter=20, minibatch=args.quick)
    print(f"\nk-means: {n:,} x 256-d float32 -> 256 clusters, 20 iterations")
    print(f"{'method':42s} {'seconds':>9s} {'iters':>6s} {'inertia':>9s}")
    for r in kmeans_rows:
        print(f"{r['method']:42s} {r['seconds']:9.2f} {r['iterations']:6d} {r['inertia']:9.2f}")

    n_fit, n_route = (20_000, 20_000) if args.quick else (200_000, 200_000)
    e2e = [bench_end_to_end(n_fit, n_route, g, m) for g, m in (([4, 4], "product"), ([4, 4], "flat"))]
    print(f"\nend to end (TF-IDF of 32-token prefixes -> SVD 64 -> route), {n_route:,} documents")
    print(f"{'grid':8s} {'method':8s} {'fit s':>7s} {'route docs/s':>13s} {'assign docs/s':>14s}")
    for r in e2e:
        print(f"{str(r['grid']):8s} {r['method']:8s} {r['fit_seconds']:7.2f} "
              f"{r['docs_per_second']:13,.0f} {r['balanced_assign_docs_per_second']:14,.0f}")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"mode": "quick" if args.quick else "full", "host": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "threads": args.threads,
              "load_average_before_after": [load_before, os.getloadavg()[0]], "kmeans": kmeans_rows, "end_to_end": e2e}
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, out)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
