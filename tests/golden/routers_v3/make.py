"""Write the saved routers of ``tests/golden/routers_v3/`` (run once, by the code before
the routing methods became a registry: commit 8e27190, router format version 3).

One router per routing method, fitted on a small fixed corpus and saved as that code
saved them (``manifest.json`` with flat keys, ``kmeans.npz``), plus ``expected.npz``: the
corpus and, per method, what that code computed from the router it had just fitted
(shard costs, the balanced assignment, the routes of 8-token prompts). Run directories
made before the registry hold such routers; ``tests/test_router_registry.py`` loads these
and fits them again, and both must give what is recorded here.

    python tests/golden/routers_v3/make.py      # at 8e27190 only; the files are not rewritten
"""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from router import Router, TokenTfidfFeaturizer
from router.synthetic import topic_corpus

HERE = Path(__file__).resolve().parent
GRID = [2, 2]
# what each method is fitted with: the settings its conf/router/*.yaml sets, scaled down
FITS = {
    "product": dict(top_k=2),
    "tree": dict(balance="soft"),
    "flat": dict(),
    "grouped": dict(),
    "merge": dict(top_k=2, fine_clusters=8, cluster_tokens=24, prompt_classifier=True),
    "random": dict(),
}


def corpus() -> list[np.ndarray]:
    docs, _ = topic_corpus(4, docs_per_topic=30, vocab_per_topic=30, length=(12, 40), seed=0)
    return docs


def fit(method: str, docs: list[np.ndarray]) -> Router:
    # a small featurizer keeps the fixture a few KB: 8 dimensions, unigrams only
    feat = TokenTfidfFeaturizer(dim=8, seed=0, bigrams=False)
    return Router.fit(docs, GRID, method=method, prefix_tokens=8, seed=0, featurizer=feat, **FITS[method])


def main() -> None:
    docs = corpus()
    prompts = [d[:8] for d in docs] + [np.zeros(0, np.int64)]  # an empty prompt: the fallback path
    out: dict[str, np.ndarray] = {
        "tokens": np.concatenate(docs).astype(np.int32), "offsets": np.cumsum([0] + [len(d) for d in docs])}
    for method in FITS:
        r = fit(method, docs)
        d = HERE / method
        shutil.rmtree(d, ignore_errors=True)
        r.save(d)
        out[f"{method}.shard_costs"] = r.shard_costs(docs)
        out[f"{method}.assign"] = np.array(r.assign(docs), np.int8)
        out[f"{method}.route"] = r.route_batch(prompts).astype(np.int8)
    np.savez(HERE / "expected.npz", **out)


if __name__ == "__main__":
    main()
