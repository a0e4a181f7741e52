"""Routing benchmark: faiss vs scikit-learn k-means, and end-to-end featurize + route throughput.

    python benchmarks/bench_routing.py            # full: 1M x 256-d → 256 clusters
    python benchmarks/bench_routing.py --quick    # 100k x 256-d → 256, plus MiniBatchKMeans

Prints a table and writes benchmarks/results/routing.json (not committed), with the
process's peak RSS. Not a test: timings depend on the host and its load (benchmarks/README.md).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import time
from pathlib import Path

import numpy as np
from dipaco.storage.strict_json import dumps_strict
from benchmarks.common import write_output


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


def bench_kmeans(n: int, d: int, k: int, niter: int, repeats: int, minibatch: bool) -> tuple[list[dict], dict]:
    """The project's ``fit_kmeans`` vs scikit-learn's KMeans, timed interleaved; plus reference rows.

    The headline pair (dipaco default, sklearn KMeans with random init as in the issue)
    runs ``repeats`` times, alternating; the reference rows run once each.
    """
    import faiss
    from sklearn.cluster import KMeans, MiniBatchKMeans

    from router.kmeans import fit_kmeans

    x = clustered_points(n, d, k)
    last: dict[str, tuple[np.ndarray, int]] = {}

    def dipaco() -> float:
        s, c = timed(lambda: fit_kmeans(x, k, niter=niter, seed=0))
        last["dipaco"] = (c, niter)
        return s

    def sklearn_random() -> float:
        # tol=0 so scikit-learn runs Lloyd until its labels stop changing (or niter).
        km = KMeans(k, n_init=1, max_iter=niter, tol=0.0, init="random", random_state=0)
        s, _ = timed(lambda: km.fit(x))
        last["sklearn"] = (km.cluster_centers_.astype(np.float32), int(km.n_iter_))
        return s

    # Alternate the two sides (A B, B A, ...) so a load spike does not always hit one.
    timing = {"dipaco": {"samples": []}, "sklearn": {"samples": []}}
    for i in range(repeats):
        for name, fn in (("dipaco", dipaco), ("sklearn", sklearn_random))[:: 1 if i % 2 == 0 else -1]:
            timing[name]["samples"].append(fn())
    for side in timing.values():
        side["median"] = float(np.median(side["samples"]))
    rows = [
        {"method": "dipaco fit_kmeans (default: k-means++, sample 64/centroid, 1 pass on all)",
         "seconds": timing["dipaco"]["median"], "samples": timing["dipaco"]["samples"],
         "iterations": None, "inertia": inertia(x, last["dipaco"][0])},
        {"method": "sklearn KMeans (n_init=1, random init, tol=0)",
         "seconds": timing["sklearn"]["median"], "samples": timing["sklearn"]["samples"],
         "iterations": last["sklearn"][1], "inertia": inertia(x, last["sklearn"][0])},
    ]
    s, c = timed(lambda: fit_kmeans(x, k, niter=niter, seed=0, sample_per_centroid=None))
    rows.append({"method": "dipaco fit_kmeans (every iteration on all points)", "seconds": s, "inertia": inertia(x, c)})
    km = faiss.Kmeans(d, k, niter=niter, seed=0, max_points_per_centroid=n)
    s, _ = timed(lambda: km.train(x))
    rows.append({"method": "faiss.Kmeans (bare: random init, all points, OpenMP)", "seconds": s,
                 "iterations": niter, "inertia": inertia(x, km.centroids)})
    if minibatch:
        mb = MiniBatchKMeans(k, n_init=1, max_iter=niter, batch_size=4096, random_state=0)
        s, _ = timed(lambda: mb.fit(x))
        rows.append({"method": "sklearn MiniBatchKMeans", "seconds": s, "iterations": int(mb.n_iter_),
                     "inertia": inertia(x, mb.cluster_centers_.astype(np.float32))})
    for r in rows:
        r.update(n=n, d=d, k=k, niter=niter)
    head = {"sklearn_over_dipaco": rows[1]["seconds"] / rows[0]["seconds"],
            "inertia_dipaco": rows[0]["inertia"], "inertia_sklearn": rows[1]["inertia"],
            "faiss_gpus": faiss.get_num_gpus()}
    return rows, head


def bench_memmap(n: int, d: int, k: int) -> dict:
    """fit_kmeans + search on an ``[n, d]`` float32 memmap: seconds and peak heap (tracemalloc
    sees numpy's allocations, not the file's pages), to show memory stays one batch."""
    import tempfile
    import tracemalloc

    from router.kmeans import fit_kmeans, search

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "x.npy"
        mm = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(n, d))
        rng = np.random.default_rng(0)
        centres = rng.standard_normal((k, d)).astype(np.float32)
        for s in range(0, n, 100_000):
            m = min(100_000, n - s)
            mm[s : s + m] = centres[rng.integers(0, k, m)] + 0.5 * rng.standard_normal((m, d), dtype=np.float32)
        mm.flush()
        del mm
        x = np.load(path, mmap_mode="r")
        tracemalloc.start()
        fit_s, c = timed(lambda: fit_kmeans(x, k))
        fit_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        search_s, (_, dist) = timed(lambda: search(x, c, 1))
        search_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return {"n": n, "d": d, "k": k, "file_mib": x.nbytes / 2**20, "fit_seconds": fit_s,
                "fit_peak_heap_mib": fit_peak / 2**20, "search_seconds": search_s,
                "search_peak_heap_mib": search_peak / 2**20, "inertia": float(dist.mean())}


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
    ap.add_argument("--repeats", type=int, default=3, help="interleaved runs of the headline pair (medians)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "routing.json"))
    args = ap.parse_args()

    if args.threads is not None:
        import faiss
        from threadpoolctl import threadpool_limits

        faiss.omp_set_num_threads(args.threads)
        threadpool_limits(args.threads)
    load_before = os.getloadavg()[0]
    n = 100_000 if args.quick else 1_000_000
    kmeans_rows, head = bench_kmeans(n, 256, 256, niter=20, repeats=args.repeats, minibatch=args.quick)
    print(f"\nk-means: {n:,} x 256-d float32 -> 256 clusters, at most 20 iterations "
          f"(first two rows: medians of {args.repeats} interleaved runs)")
    print(f"{'method':75s} {'seconds':>9s} {'iters':>6s} {'inertia':>9s}")
    for r in kmeans_rows:
        iters = "-" if r.get("iterations") is None else str(r["iterations"])
        print(f"{r['method']:75s} {r['seconds']:9.2f} {iters:>6s} {r['inertia']:9.2f}")
    print(f"sklearn KMeans / dipaco fit_kmeans: {head['sklearn_over_dipaco']:.1f}x the time "
          f"(inertia {head['inertia_sklearn']:.2f} vs {head['inertia_dipaco']:.2f}; target >= 3x at equal or lower)")

    mem = bench_memmap(1_000_000, 64, 16)
    print(f"\nmemory-mapped input: {mem['n']:,} x {mem['d']} float32 ({mem['file_mib']:.0f} MiB), k={mem['k']}: "
          f"fit {mem['fit_seconds']:.1f} s, peak heap {mem['fit_peak_heap_mib']:.1f} MiB; search "
          f"{mem['search_seconds']:.1f} s, peak heap {mem['search_peak_heap_mib']:.1f} MiB; inertia {mem['inertia']:.2f}")

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
              "load_average_before_after": [load_before, os.getloadavg()[0]], **head,
              "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              "kmeans": kmeans_rows, "memmap": mem, "end_to_end": e2e}
    write_output(out, dumps_strict(result, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
