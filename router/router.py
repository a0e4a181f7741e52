"""The Router: documents (token ids) → paths of a grid, by their first ``prefix_tokens`` tokens.

Path ids follow the grid's mixed radix with level 0 most significant
(``np.ravel_multi_index(path, grid)``; for grid [4, 4], path (2, 1) is id 9).

Ways to turn features into paths (``method``):

* ``"product"``: k-means per level on separate blocks of the rotated features; path cost
  is the sum of the levels' squared distances (``router.product``).
* ``"tree"``: hierarchical k-means: level-0 clusters, their sub-clusters at level 1, and
  so on; path cost is the sum of squared distances to the path's node at each level, so
  paths that share a module receive related documents (``router.tree``).
* ``"flat"``: one k-means with P centroids on the whole feature vector; cluster c is laid
  onto grid cell ``np.unravel_index(c, grid)`` (identity layout: cluster id = path id).
  faiss cluster ids carry no meaning, so which clusters share a module is arbitrary.
* ``"grouped"``: the flat k-means, with clusters laid onto cells so that the clusters
  sharing a level-0 module are near each other (``router.tree.grouped_layout``).
* ``"merge"``: many fine k-means clusters merged bottom-up (Ward) into the grid's tree:
  level-0 groups, their sub-groups, ..., a path is a leaf; path cost is the distance to
  the path's nearest fine centroid (``router.merge``).

With ``prompt_classifier`` a logistic-regression head is fitted at the end of
:meth:`Router.fit`: it learns, from each training document's first ``prefix_tokens``
tokens, the path its balanced assignment on ``cluster_tokens`` gave it, and from then on
scores every view (prompts, shards, re-routing contexts). Centroids fitted on 128-token
views place a 32-token prompt less surely than the document it opens: on held-out
documents of the built-in corpus the head sent the prompt to its document's path more
often than nearest-centroid routing did (docs/results.md §18).

After :meth:`Router.fit_discriminative` the costs come from a logistic-regression head
(−log p(path | prefix)); the k-means state stays and is the fallback.

Empty prefix: a document with no tokens has no features; it routes to the fallback
order — the paths sorted by how many training documents k-means sent them (largest
shard first, ties by lower id). Its cost row is that rank (0.0, 1.0, ...).
"""
from __future__ import annotations

import os
import sys
import zlib
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from .assign import BALANCES, balanced_assign
from .discriminative import DiscriminativeHead, fit_discriminative
from .features import CallableFeaturizer, TokenTfidfFeaturizer, as_token_array
from .kmeans import fit_kmeans, squared_distances
from .merge import default_fine_clusters, fit_merge, merge_costs
from .product import fit_product, level_blocks, product_level_costs
from .saved import ROUTER_FORMAT_VERSION, check_grid, read_router, write_router
from .tree import fit_tree, grouped_layout, tree_costs

# "random" is a control: a path drawn from a hash of the prefix tokens, so routing is
# deterministic but carries no information about the document's content.
METHODS = ("product", "tree", "flat", "grouped", "merge", "random")

Doc = Sequence[int]
Docs = Sequence[Sequence[int]]


# ``tokens=_WHOLE`` reads a document whole: a slice past its end stops at the end
_WHOLE = sys.maxsize


class Router:
    """Routes token-id documents to paths of a grid. Build with :meth:`Router.fit` or :meth:`Router.load`."""

    def __init__(
        self,
        *,
        grid: Sequence[int],
        method: str,
        prefix_tokens: int,
        top_k: int,
        capacity_factor: float,
        seed: int,
        niter: int,
        featurizer: TokenTfidfFeaturizer | CallableFeaturizer,
        centroids: list[np.ndarray],
        rotation: np.ndarray | None,
        fallback_order: np.ndarray,
        head: DiscriminativeHead | None = None,
        balance: str = "hard",
        soft_capacity_factor: float = 2.0,
        cluster_tokens: int | None = None,
        reroute_context: int | None = None,
        cluster_paths: np.ndarray | None = None,
        fine_clusters: int | None = None,
        prompt_classifier: bool = False,
    ) -> None:
        self.grid = check_grid(grid)
        self.num_paths = int(np.prod(self.grid))
        self.method = method
        self.prefix_tokens = int(prefix_tokens)
        # training documents are clustered and sharded on their first cluster_tokens tokens
        # (the whole document is known then); a prompt is routed on prefix_tokens
        self.cluster_tokens = int(cluster_tokens) if cluster_tokens else self.prefix_tokens
        # a re-route reads the last reroute_context tokens before its window; None: all of them
        if reroute_context is not None and int(reroute_context) < 1:
            raise ValueError(f"reroute_context must be >= 1 token or None (everything read so far), "
                             f"got {reroute_context}")
        self.reroute_context = None if reroute_context is None else int(reroute_context)
        self.top_k = int(top_k)
        self.capacity_factor = float(capacity_factor)
        self.balance = balance
        self.soft_capacity_factor = float(soft_capacity_factor)
        self.seed = int(seed)
        self.niter = int(niter)
        self.featurizer = featurizer
        self.centroids = [np.asarray(c, np.float32) for c in centroids]
        self.rotation = rotation
        self.fallback_order = np.asarray(fallback_order, np.int64)
        self.head = head
        if method == "product":
            level_blocks(featurizer.dim, self.grid)  # refuses a feature dim too small for the levels
        # merge: the path of each fine centroid (sorted, every path present); None otherwise
        self.cluster_paths = None if cluster_paths is None else np.asarray(cluster_paths, np.int64)
        if method == "merge":
            cp = self.cluster_paths
            if cp is None or cp.shape != (self.centroids[0].shape[0],) or (np.diff(cp) < 0).any() \
                    or not np.array_equal(np.unique(cp), np.arange(self.num_paths)):
                raise ValueError("method 'merge' needs cluster_paths: one sorted path id per fine centroid, "
                                 f"covering all {self.num_paths} paths; refit the router (dipaco-route)")
        self.fine_clusters = None if fine_clusters is None else int(fine_clusters)
        self.prompt_classifier = bool(prompt_classifier)

    # ------------------------------------------------------------------ building
    @classmethod
    def fit(
        cls,
        docs: Docs,
        grid: Sequence[int],
        *,
        prefix_tokens: int = 32,
        method: str = "product",
        top_k: int = 1,
        capacity_factor: float = 1.25,
        seed: int = 0,
        featurizer: TokenTfidfFeaturizer | CallableFeaturizer | None = None,
        niter: int = 20,
        balance: str = "hard",
        soft_capacity_factor: float = 2.0,
        cluster_tokens: int | None = None,
        reroute_context: int | None = None,
        fine_clusters: int | None = None,
        prompt_classifier: bool = False,
    ) -> "Router":
        """Fit featurizer and k-means on the prefixes of ``docs`` for ``grid``.

        Args:
            docs: token-id documents (lists or int arrays); only the first
                ``cluster_tokens`` tokens of each are used.
            prefix_tokens: tokens a prompt is routed on (:meth:`route`).
            cluster_tokens: tokens of each training document the featurizer and k-means
                are fitted on and the training shards assigned on (:meth:`assign`);
                None: ``prefix_tokens``. Training documents are whole when they are
                sharded, so a longer view clusters them by more than their opening.
            reroute_context: tokens before a window that re-route it (:meth:`window_context`);
                None: everything read so far.
            grid: modules per level, e.g. ``[4, 4]`` → 16 paths.
            method: one of :data:`METHODS` (see the module docstring).
            top_k, capacity_factor, balance, soft_capacity_factor: defaults for
                :meth:`assign` (training shards; see ``router.assign``).
            featurizer: default ``TokenTfidfFeaturizer(dim=64, seed=seed)``; an unfitted
                token featurizer is fitted here; a :class:`CallableFeaturizer` is used as is.
            niter: k-means iterations.
            fine_clusters: fine k-means clusters of ``method="merge"`` (at least P);
                None: :func:`router.merge.default_fine_clusters`.
            prompt_classifier: fit a head that routes a document's first
                ``prefix_tokens`` tokens to the path its shard assignment gave it (see the
                module docstring); it then scores every view: prompts, shards, re-routes.
        """
        g = check_grid(grid)
        p = int(np.prod(g))
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if int(prefix_tokens) < 1:
            raise ValueError(f"prefix_tokens must be >= 1, got {prefix_tokens}")
        cluster_tokens = int(cluster_tokens) if cluster_tokens else int(prefix_tokens)
        if cluster_tokens < int(prefix_tokens):
            raise ValueError(f"cluster_tokens ({cluster_tokens}) must be >= prefix_tokens ({prefix_tokens}): "
                             "documents are clustered on at least the tokens they are routed on")
        if not 1 <= int(top_k) <= p:
            raise ValueError(f"top_k must be in [1, {p}] (paths of grid {list(g)}), got {top_k}")
        if prompt_classifier and method == "random":
            raise ValueError("prompt_classifier learns content-based shards; the random control has none: "
                             "use prompt_classifier=False with method='random'")
        if not capacity_factor >= 1.0:
            raise ValueError(f"capacity_factor must be >= 1.0, got {capacity_factor}")
        if balance not in BALANCES:
            raise ValueError(f"balance must be one of {BALANCES}, got {balance!r}")
        if balance == "soft" and not soft_capacity_factor >= capacity_factor:
            raise ValueError(f"soft_capacity_factor ({soft_capacity_factor}) must be >= capacity_factor "
                             f"({capacity_factor})")
        fine_clusters = default_fine_clusters(p) if fine_clusters is None else int(fine_clusters)
        prefixes = [as_token_array(d)[:cluster_tokens] for d in docs]
        nonempty = [x for x in prefixes if x.size]
        need = {"flat": p, "grouped": p, "merge": fine_clusters}.get(method, max(g))
        if len(nonempty) < need:
            raise ValueError(
                f"docs: {len(nonempty)} non-empty documents cannot be clustered into "
                f"{need} clusters (grid {list(g)}, method {method!r}); give at least {need} "
                "documents or use a smaller grid"
            )
        if featurizer is None:
            featurizer = TokenTfidfFeaturizer(dim=64, seed=seed)
        if not featurizer.is_fitted:
            featurizer.fit(nonempty)
        feats = featurizer.transform(nonempty)
        rotation = None
        cluster_paths = None
        if method == "random":
            centroids = [np.zeros((1, featurizer.dim), np.float32)]
        elif method == "flat":
            centroids = [fit_kmeans(feats, p, niter=niter, seed=seed)]
        elif method == "grouped":
            flat = fit_kmeans(feats, p, niter=niter, seed=seed)
            centroids = [flat[grouped_layout(flat, g, niter=niter, seed=seed)]]
        elif method == "tree":
            centroids = fit_tree(feats, g, niter=niter, seed=seed)
        elif method == "merge":
            fine, cluster_paths = fit_merge(feats, g, fine_clusters, niter=niter, seed=seed)
            centroids = [fine]
        else:
            centroids, rotation = fit_product(feats, g, niter=niter, seed=seed)
        router = cls(
            grid=g,
            method=method,
            prefix_tokens=prefix_tokens,
            top_k=top_k,
            capacity_factor=capacity_factor,
            seed=seed,
            niter=niter,
            featurizer=featurizer,
            centroids=centroids,
            rotation=rotation,
            fallback_order=np.arange(p),
            balance=balance,
            soft_capacity_factor=soft_capacity_factor,
            cluster_tokens=cluster_tokens,
            reroute_context=reroute_context,
            cluster_paths=cluster_paths,
            fine_clusters=fine_clusters if method == "merge" else None,
            prompt_classifier=prompt_classifier,
        )
        fit_costs = router._random_costs(prefixes) if method == "random" else router._kmeans_costs(feats)
        counts = np.bincount(fit_costs.argmin(axis=1), minlength=p)
        router.fallback_order = np.lexsort((np.arange(p), -counts))
        if prompt_classifier and p > 1:
            # the label of a document is the best path of its balanced shard assignment
            shard = np.array([h[0] for h in router.assign_costs(fit_costs)], np.int64)
            short = featurizer.transform([x[: router.prefix_tokens] for x in nonempty])
            router.fit_discriminative(fit_costs, features=short, labels=shard)
        return router

    # ------------------------------------------------------------------ ids
    def path_tuple(self, path_id: int) -> tuple[int, ...]:
        """Grid cell (one module index per level) of ``path_id``."""
        return tuple(int(i) for i in np.unravel_index(int(path_id), self.grid))

    def path_id(self, path: Sequence[int]) -> int:
        """Path id of the grid cell ``path`` (level 0 most significant)."""
        return int(np.ravel_multi_index(tuple(int(i) for i in path), self.grid))

    @property
    def fallback_path(self) -> int:
        """Path of an empty prefix: the largest k-means shard of the training documents."""
        return int(self.fallback_order[0])

    @property
    def uses_discriminative(self) -> bool:
        return self.head is not None

    # ------------------------------------------------------------------ features & costs
    def prefixes(self, docs: Docs, tokens: int | None = None) -> list[np.ndarray]:
        """The routing prefix (first ``tokens``, default ``prefix_tokens``, token ids) of each document."""
        if isinstance(docs, np.ndarray) and docs.ndim == 1 and docs.dtype.kind in "iu":
            raise ValueError("docs must be a batch of documents; for one document use route(token_ids)")
        n = self.prefix_tokens if tokens is None else int(tokens)
        return [as_token_array(d)[:n] for d in docs]

    def features(self, docs: Docs) -> np.ndarray:
        """Routing features ``[N, dim]`` of the prefixes of ``docs``."""
        return self.featurizer.transform(self.prefixes(docs))

    def level_costs(self, features: np.ndarray) -> list[np.ndarray]:
        """Per-level squared distances ``[N, K_l]`` (product method; zeros for K = 1 levels)."""
        if self.method != "product":
            raise ValueError("level_costs exists for method='product' only")
        return product_level_costs(features, self.grid, self.centroids, self.rotation)

    def _kmeans_costs(self, features: np.ndarray) -> np.ndarray:
        if self.method == "merge":
            return merge_costs(features, self.centroids[0], self.cluster_paths, self.num_paths)
        if self.method in ("flat", "grouped"):
            return squared_distances(features, self.centroids[0])
        if self.method == "tree":
            return tree_costs(features, self.grid, self.centroids)
        n = features.shape[0]
        total = np.zeros((n,) + self.grid, np.float32)
        for level, d in enumerate(self.level_costs(features)):
            shape = [n] + [1] * len(self.grid)
            shape[level + 1] = self.grid[level]
            total += d.reshape(shape)  # broadcast: C order == level 0 most significant
        return total.reshape(n, self.num_paths)

    def kmeans_costs(self, docs: Docs) -> np.ndarray:
        """k-means path costs ``[N, P]`` even when a discriminative head is fitted."""
        return self._costs(docs, use_head=False)

    def costs(self, docs: Docs) -> np.ndarray:
        """Path costs float32 ``[N, P]``, lower is better (classifier −log p if fitted, else k-means)."""
        return self._costs(docs, use_head=True)

    def _random_costs(self, prefixes: list[np.ndarray]) -> np.ndarray:
        """Costs from a seeded hash of each prefix: the "random" routing control."""
        out = np.empty((len(prefixes), self.num_paths), np.float32)
        for i, x in enumerate(prefixes):
            key = zlib.crc32(np.asarray(x, np.int64).tobytes()) ^ (self.seed * 2654435761 & 0xFFFFFFFF)
            out[i] = np.random.default_rng(key).random(self.num_paths)
        return out

    def shard_costs(self, docs: Docs) -> np.ndarray:
        """:meth:`costs` on the first ``cluster_tokens`` tokens: what training shards are assigned on."""
        return self._costs(docs, use_head=True, tokens=self.cluster_tokens)

    def _costs(self, docs: Docs, *, use_head: bool, tokens: int | None = None) -> np.ndarray:
        prefixes = self.prefixes(docs, tokens)
        feats = self.featurizer.transform(prefixes)
        out = self._random_costs(prefixes) if self.method == "random" else self._kmeans_costs(feats)
        if use_head and self.head is not None:
            out = self.head.costs(feats, tie_break=out)
        empty = np.fromiter((x.size == 0 for x in prefixes), bool, count=len(prefixes))
        if empty.any():
            rank = np.empty(self.num_paths, np.float32)
            rank[self.fallback_order] = np.arange(self.num_paths, dtype=np.float32)
            out[empty] = rank
        return out

    # ------------------------------------------------------------------ routing
    def route(self, token_ids: Doc) -> int:
        """Best path of one document (by its first ``prefix_tokens`` tokens)."""
        return int(self.route_batch([token_ids])[0])

    def route_batch(self, docs: Docs) -> np.ndarray:
        """Best path of each document, int64 ``[N]`` (evaluation routing: unbalanced)."""
        if len(docs) == 0:
            return np.zeros(0, np.int64)
        return self.costs(docs).argmin(axis=1).astype(np.int64)

    def route_topk(self, docs: Docs, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` best distinct paths per document, best first: (paths int64 [N,k], costs float32 [N,k])."""
        if not 1 <= int(k) <= self.num_paths:
            raise ValueError(f"k must be in [1, {self.num_paths}] (number of paths), got {k}")
        c = self.costs(docs)
        order = np.argsort(c, axis=1, kind="stable")[:, : int(k)]
        return order.astype(np.int64), np.take_along_axis(c, order, axis=1)

    def assign(
        self, docs: Docs, *, top_k: int | None = None, capacity_factor: float | None = None,
        balance: str | None = None,
    ) -> list[list[int]]:
        """Training shards: each document's ``top_k`` distinct paths, balanced (see router.assign),
        on the first ``cluster_tokens`` tokens of each document."""
        return self.assign_costs(self.shard_costs(docs), top_k=top_k, capacity_factor=capacity_factor, balance=balance)

    def assign_costs(
        self, costs: np.ndarray, *, top_k: int | None = None, capacity_factor: float | None = None,
        balance: str | None = None,
    ) -> list[list[int]]:
        """:meth:`assign` on precomputed :meth:`costs` ``[N, P]``; None arguments take the router's."""
        return balanced_assign(
            costs,
            top_k=self.top_k if top_k is None else top_k,
            capacity_factor=self.capacity_factor if capacity_factor is None else capacity_factor,
            balance=self.balance if balance is None else balance,
            soft_capacity_factor=self.soft_capacity_factor,
        )

    def reroute_windows(self, token_ids: Doc, W: int) -> list[int]:
        """Path of each consecutive window of ``W`` tokens of one document.

        Window j covers tokens ``[j*W, (j+1)*W)``. Window 0 is routed by tokens
        ``[0, prefix_tokens)`` (the usual routing prefix, which may reach past the window
        when ``prefix_tokens > W``). Window j ≥ 1 is routed by the tokens read before it:
        all of ``[0, j*W)`` (``reroute_context`` None, the default), or the last
        ``reroute_context`` of them. Either way generation has them when it reaches the
        window. An empty document has no windows and returns ``[]``.

        Why everything read so far: a path's shard is whole documents grouped by how they
        open, so the best evidence for which path models a document is as much of it as is
        known. Re-routing on the 32 tokens right before each window cost 1.9% on the default
        run; on the whole context it is within ±0.5% of routing once (docs/results.md §17).
        """
        if int(W) < 1:
            raise ValueError(f"W (re-routing window) must be >= 1 token, got {W}")
        toks = as_token_array(token_ids, name="token_ids")
        n_windows = -(-toks.size // int(W))
        return self.route_contexts([self.window_context(toks, j, W) for j in range(n_windows)]).tolist()

    def window_context(self, token_ids: Doc, j: int, W: int) -> np.ndarray:
        """The tokens that route window ``j`` of ``W`` tokens (:meth:`reroute_windows`'s rule;
        generation calls it one window at a time)."""
        toks = np.asarray(token_ids, dtype=np.int64)
        if j == 0:
            return toks[: self.prefix_tokens]
        end = j * W
        return toks[: end] if self.reroute_context is None else toks[max(0, end - self.reroute_context) : end]

    def route_contexts(self, contexts: Docs) -> np.ndarray:
        """Best path of each context (tokens already seen, cut by :meth:`window_context`), int64
        ``[N]``, read whole: the re-routing rule of :meth:`reroute_windows` (:meth:`route_batch`
        would keep only ``prefix_tokens``)."""
        if len(contexts) == 0:
            return np.zeros(0, np.int64)
        return self._costs(contexts, use_head=True, tokens=_WHOLE).argmin(axis=1).astype(np.int64)

    # ------------------------------------------------------------------ discriminative
    def fit_discriminative(
        self,
        losses: np.ndarray,
        docs: Docs | None = None,
        *,
        features: np.ndarray | None = None,
        C: float = 1.0,
        max_iter: int = 500,
        min_docs: int = 8,
        labels: np.ndarray | None = None,
    ) -> bool:
        """Re-route by measured losses ``[N, P]`` of ``docs`` (or precomputed ``features``).

        ``labels``: the path each document should learn (default: its lowest-loss path).

        Returns True when a classifier now drives :meth:`costs`; False when the documented
        fallback applied (too few documents or a single preferred path) and k-means routes.
        """
        if (docs is None) == (features is None):
            raise ValueError("pass exactly one of docs= or features= to fit_discriminative")
        feats = self.features(docs) if features is None else np.asarray(features, np.float32)
        losses = np.asarray(losses)
        if losses.ndim != 2 or losses.shape[1] != self.num_paths:
            raise ValueError(
                f"losses must be [N, {self.num_paths}] (one column per path of grid {list(self.grid)}), "
                f"got shape {losses.shape}"
            )
        self.head = fit_discriminative(feats, losses, C=C, max_iter=max_iter, min_docs=min_docs, seed=self.seed,
                                       labels=labels)
        return self.head is not None

    # ------------------------------------------------------------------ persistence
    def manifest(self) -> dict[str, Any]:
        return {
            "version": ROUTER_FORMAT_VERSION,
            "grid": list(self.grid),
            "num_paths": self.num_paths,
            "method": self.method,
            "prefix_tokens": self.prefix_tokens,
            "cluster_tokens": self.cluster_tokens,
            "reroute_context": self.reroute_context,
            "top_k": self.top_k,
            "capacity_factor": self.capacity_factor,
            "balance": self.balance,
            "soft_capacity_factor": self.soft_capacity_factor,
            "seed": self.seed,
            "niter": self.niter,
            "fine_clusters": self.fine_clusters,
            "prompt_classifier": self.prompt_classifier,
            "featurizer": {"kind": self.featurizer.kind, "params": self.featurizer.params()},
            "discriminative": self.head is not None,
        }

    def save(self, directory: str | os.PathLike) -> Path:
        """Write arrays (.npz, no pickle) and ``manifest.json`` with their sha256, atomically."""
        km = {f"centroids_{l}": c for l, c in enumerate(self.centroids)}
        km["fallback_order"] = self.fallback_order
        if self.rotation is not None:
            km["rotation"] = self.rotation
        if self.cluster_paths is not None:
            km["cluster_paths"] = self.cluster_paths
        head = self.head.state_arrays() if self.head is not None else None
        return write_router(Path(directory), self.manifest(), km, self.featurizer.state_arrays(), head)

    @classmethod
    def load(
        cls,
        directory: str | os.PathLike,
        featurizer_fn: Callable[[list[np.ndarray]], Any] | None = None,
        *,
        expected_grid: Sequence[int] | None = None,
    ) -> "Router":
        """Load a saved Router; refuses (ValueError naming the file) anything inconsistent.

        Args:
            featurizer_fn: required when the router was fitted with a CallableFeaturizer.
            expected_grid: if given, a manifest for a different grid is refused.
        """
        return cls(**read_router(Path(directory), featurizer_fn, expected_grid))

    def __repr__(self) -> str:
        return (
            f"Router(grid={list(self.grid)}, method={self.method!r}, prefix_tokens={self.prefix_tokens}, "
            f"featurizer={self.featurizer.kind}, discriminative={self.head is not None})"
        )


__all__ = ["Router", "ROUTER_FORMAT_VERSION", "METHODS"]
