"""The Router: documents (token ids) → paths of a grid, by their first ``prefix_tokens`` tokens.

Path ids follow the grid's mixed radix with level 0 most significant
(``np.ravel_multi_index(path, grid)``; for grid [4, 4], path (2, 1) is id 9).

How features become path costs is the routing method's (``method``, a name of the
registry ``router.methods.REGISTRY``, each described in its module under
``router/methods/``). Everything else is the Router's and the same for every method: the
views it reads (:class:`router.settings.RouterSettings`), the featurizer, balanced top-k
training shards, the fallback path, the classifier heads, saving and loading.

With ``prompt_classifier`` a logistic-regression head is fitted at the end of
:meth:`Router.fit`: it learns, from each training document's first ``prefix_tokens``
tokens, the path its balanced assignment on ``cluster_tokens`` gave it, and from then on
scores every view (prompts, shards, re-routing contexts). Centroids fitted on 128-token
views place a 32-token prompt less surely than the document it opens: on held-out
documents of the built-in corpus the head sent the prompt to its document's path more
often than nearest-centroid routing did (docs/results.md §18).

After :meth:`Router.fit_discriminative` the costs come from a logistic-regression head
(−log p(path | prefix)); the method's state stays and is the fallback.

Empty prefix: a document with no tokens has no features; it routes to the fallback
order — the paths sorted by how many training documents the method sent them (largest
shard first, ties by lower id). Its cost row is that rank (0.0, 1.0, ...).
"""
from __future__ import annotations

import os
import sys
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from .assign import balanced_assign
from .discriminative import DiscriminativeHead, fit_discriminative
from .features import CallableFeaturizer, TokenTfidfFeaturizer, as_token_array
from .methods import METHODS, MethodConfig, RoutingMethod, split_settings
from .saved import FEATURIZER, HEAD, METHOD, ROUTER, ROUTER_FORMAT_VERSION, check_grid, read_router, write_router
from .settings import RouterSettings

Doc = Sequence[int]
Docs = Sequence[Sequence[int]]
_SETTINGS = frozenset(f.name for f in fields(RouterSettings))

# ``tokens=_WHOLE`` reads a document whole: a slice past its end stops at the end
_WHOLE = sys.maxsize


class Router:
    """Routes token-id documents to paths of a grid. Build with :meth:`Router.fit` or :meth:`Router.load`."""

    def __init__(
        self,
        *,
        grid: Sequence[int],
        routing: RoutingMethod,
        settings: RouterSettings,
        seed: int,
        featurizer: TokenTfidfFeaturizer | CallableFeaturizer,
        fallback_order: np.ndarray,
        head: DiscriminativeHead | None = None,
    ) -> None:
        """A fitted router (built by :meth:`fit` and :meth:`load`).

        Args:
            routing: the fitted routing method (``router.methods``).
            settings: its views and balance; ``cluster_tokens`` None means ``prefix_tokens``.
            seed: of the featurizer, the method and the classifier heads.
        """
        self.grid = check_grid(grid)
        self.num_paths = int(np.prod(self.grid))
        self.routing = routing
        self.settings = settings.resolved()
        self.settings.check(self.num_paths)
        self.seed = int(seed)
        self.featurizer = featurizer
        self.fallback_order = np.asarray(fallback_order, np.int64)
        self.head = head

    def __getattr__(self, name: str) -> Any:
        # the settings read as attributes (router.top_k): listed once, in RouterSettings
        if name in _SETTINGS:
            return getattr(self.__dict__["settings"], name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def method(self) -> str:
        """The routing method's name (a key of ``router.methods.REGISTRY``)."""
        return self.routing.config.name

    # ------------------------------------------------------------------ building
    @classmethod
    def fit(
        cls,
        docs: Docs,
        grid: Sequence[int],
        *,
        method: str | MethodConfig = "product",
        seed: int = 0,
        featurizer: TokenTfidfFeaturizer | CallableFeaturizer | None = None,
        **settings: Any,
    ) -> "Router":
        """Fit featurizer and routing method on the prefixes of ``docs`` for ``grid``.

        Args:
            docs: token-id documents (lists or int arrays); only the first
                ``cluster_tokens`` tokens of each are used.
            grid: modules per level, e.g. ``[4, 4]`` → 16 paths.
            method: a name of :data:`router.methods.METHODS` or a method's config
                (``router.methods.method_config``).
            seed: of the featurizer, the method and the prompt classifier.
            featurizer: default ``TokenTfidfFeaturizer(dim=64, seed=seed)``; an unfitted
                token featurizer is fitted here; a :class:`CallableFeaturizer` is used as is.
            settings: the router's (:class:`router.settings.RouterSettings`: ``prefix_tokens``,
                ``cluster_tokens``, ``top_k``, ...) and the method's (``niter``,
                ``fine_clusters``, ...), by name; a name that is neither is a TypeError.
                Training documents are whole when they are sharded, so ``cluster_tokens``
                (None: ``prefix_tokens``) may cluster them by more than their opening.
        """
        g = check_grid(grid)
        plain, config = split_settings(method, settings)
        plain = plain.resolved()
        plain.check(int(np.prod(g)))
        if plain.prompt_classifier and not config.learns_content:
            raise ValueError(f"prompt_classifier learns content-based shards; the {config.name} control has none: "
                             f"use prompt_classifier=False with method={config.name!r}")
        if featurizer is None:
            featurizer = TokenTfidfFeaturizer(dim=64, seed=seed)
        routing = config.build(g, seed=int(seed), dim=featurizer.dim)
        prefixes = [as_token_array(d)[: plain.cluster_tokens] for d in docs]
        nonempty = [x for x in prefixes if x.size]
        need = routing.config.min_documents(g)
        if len(nonempty) < need:
            raise ValueError(
                f"docs: {len(nonempty)} non-empty documents cannot be clustered into "
                f"{need} clusters (grid {list(g)}, method {config.name!r}); give at least {need} "
                "documents or use a smaller grid"
            )
        if not featurizer.is_fitted:
            featurizer.fit(nonempty)
        feats = featurizer.transform(nonempty)
        routing.fit(feats, nonempty)
        p = int(np.prod(g))
        router = cls(grid=g, routing=routing, settings=plain, seed=seed, featurizer=featurizer,
                     fallback_order=np.arange(p))
        fit_costs = routing.costs(feats, nonempty)
        counts = np.bincount(fit_costs.argmin(axis=1), minlength=p)
        router.fallback_order = np.lexsort((np.arange(p), -counts))
        if plain.prompt_classifier and p > 1:
            # the label of a document is the best path of its balanced shard assignment
            shard = np.array([h[0] for h in router.assign_costs(fit_costs)], np.int64)
            short = featurizer.transform([x[: plain.prefix_tokens] for x in nonempty])
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

    def method_costs(self, docs: Docs) -> np.ndarray:
        """The routing method's path costs ``[N, P]`` even when a discriminative head is fitted."""
        return self._costs(docs, use_head=False)

    def costs(self, docs: Docs) -> np.ndarray:
        """Path costs float32 ``[N, P]``, lower is better (classifier −log p if fitted, else the method's)."""
        return self._costs(docs, use_head=True)

    def shard_costs(self, docs: Docs) -> np.ndarray:
        """:meth:`costs` on the first ``cluster_tokens`` tokens: what training shards are assigned on."""
        return self._costs(docs, use_head=True, tokens=self.cluster_tokens)

    def _costs(self, docs: Docs, *, use_head: bool, tokens: int | None = None) -> np.ndarray:
        prefixes = self.prefixes(docs, tokens)
        feats = self.featurizer.transform(prefixes)
        out = self.routing.costs(feats, prefixes)
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
        """What ``manifest.json`` records besides the array files (``router/saved.py``)."""
        return {
            "version": ROUTER_FORMAT_VERSION,
            "grid": list(self.grid),
            "num_paths": self.num_paths,
            "method": self.method,
            "seed": self.seed,
            "settings": asdict(self.settings),
            "method_settings": asdict(self.routing.config),
            "featurizer": {"kind": self.featurizer.kind, "params": self.featurizer.params()},
            "discriminative": self.head is not None,
        }

    def save(self, directory: str | os.PathLike) -> Path:
        """Write arrays (.npz, no pickle) and ``manifest.json`` with their sha256, atomically."""
        return write_router(Path(directory), self.manifest(), {
            METHOD: self.routing.arrays(),
            ROUTER: {"fallback_order": self.fallback_order},
            FEATURIZER: self.featurizer.state_arrays(),
            HEAD: None if self.head is None else self.head.state_arrays(),
        })

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
