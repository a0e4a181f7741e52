"""Routing that matches module sharing: NMI per level of product / flat / grouped / tree k-means.

    python -m benchmarks.bench_route_sharing     # about 30 s on 2 cores (--quick/--full: the same)

On synthetic token corpora with a known two-level structure (``router.synthetic``), mean
over seeds 0, 1, 2:

* ``hierarchy``: K_0 super-topics of K_1 topics each; path NMI against the topic, level-0
  NMI/purity against the super-topic (does a level-0 module get one super-topic?).
* ``two_factor``: sub-topic t's vocabulary is shared by every super-topic; level-1 NMI
  against t (does level-1 module j serve one sub-topic under every level-0 module?).
* ``skewed``: the first topic of each super-topic has ~2.5x the documents; training
  shards (``Router.assign``) with ``balance`` hard vs soft: path NMI, imbalance, and the
  share of documents the balance moved off their best path that stayed on its level-0 module.

Prints the tables and writes benchmarks/results/route_sharing.json (not committed).
"""
from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from benchmarks.common import RESULTS_DIR, print_table
from router import Router, routing_report
from router.synthetic import hierarchical_corpus
from dipaco.storage.strict_json import dumps_strict
from benchmarks.common import write_output

SEEDS = (0, 1, 2)
METHODS = ("product", "flat", "grouped", "tree")
GRIDS = ([2, 2], [4, 4])


def _mean(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(float(np.mean([r[k] for r in rows])), 3) for k in rows[0]}


def hierarchy(grid: list[int], method: str, *, shared: bool) -> dict[str, float]:
    rows = []
    for seed in SEEDS:
        docs, supers, leaves = hierarchical_corpus(*grid, super_rate=0.6 if shared else 0.5,
                                                   shared_sub_topics=shared, seed=seed)
        best = Router.fit(docs, grid, method=method, seed=seed).route_batch(docs)
        p = int(np.prod(grid))
        l0 = routing_report(best, num_paths=p, labels=supers, grid=grid)["levels"][0]
        row = {"path_nmi": routing_report(best, num_paths=p, labels=leaves)["nmi"],
               "level0_nmi": l0["nmi"], "level0_purity": l0["purity"]}
        if shared:  # sub-topic t is the same in every super-topic only here
            row["level1_nmi"] = routing_report(best, num_paths=p, labels=leaves % grid[1], grid=grid)["levels"][1]["nmi"]
        rows.append(row)
    return _mean(rows)


def skewed(method: str, balance: str) -> dict[str, float]:
    rows = []
    for seed in SEEDS:
        docs, supers, leaves = hierarchical_corpus(4, 4, super_rate=0.5, docs_per_topic=60, seed=seed)
        rng = np.random.default_rng(seed)
        keep = [i for i in range(len(docs)) if leaves[i] % 4 == 0 or rng.random() < 0.4]
        docs, leaves = [docs[i] for i in keep], leaves[keep]
        r = Router.fit(docs, [4, 4], method=method, seed=seed, balance=balance)
        shards = r.assign(docs)
        best, got = r.route_batch(docs), np.array([s[0] for s in shards])
        moved = got != best
        rep = routing_report(shards, num_paths=16, labels=leaves)
        rows.append({"path_nmi": rep["nmi"], "imbalance": rep["imbalance"], "moved": float(moved.mean()),
                     "moved_kept_level0": float((got[moved] // 4 == best[moved] // 4).mean()) if moved.any() else 1.0})
    return _mean(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="accepted for the benchmark runner; same sizes")
    ap.add_argument("--full", action="store_true", help="accepted for the benchmark runner; same sizes")
    ap.parse_args(argv)
    out: dict[str, Any] = {"hierarchy": [], "two_factor": [], "skewed": []}
    for grid in GRIDS:
        for method in METHODS:
            out["hierarchy"].append({"grid": grid, "method": method, **hierarchy(grid, method, shared=False)})
            out["two_factor"].append({"grid": grid, "method": method, **hierarchy(grid, method, shared=True)})
    for method in ("flat", "tree"):
        for balance in ("hard", "soft"):
            out["skewed"].append({"method": method, "balance": balance, **skewed(method, balance)})
    cols = ["grid", "method", "path_nmi", "level0_nmi", "level0_purity"]
    print_table(out["hierarchy"], cols, "hierarchy (K_0 super-topics of K_1 topics)")
    print_table(out["two_factor"], cols + ["level1_nmi"], "two factors (sub-topics shared across super-topics)")
    cols = ["method", "balance", "path_nmi", "imbalance", "moved", "moved_kept_level0"]
    print_table(out["skewed"], cols, "skewed hierarchy [4,4], training shards")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    write_output(RESULTS_DIR / "route_sharing.json", dumps_strict(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
