"""Grouped flat k-means (``method="grouped"``, ``router=grouped``): flat k-means laid onto the grid by sharing.

EXPERIMENTAL: no measurement in docs/results.md supports it (§4 and §10 measure flat k-means;
neither measures this layout). Its only evidence is the synthetic benchmark
``benchmarks/bench_route_sharing.py``; ``dipaco-route`` says so when it fits one.

One k-means of P clusters (as ``router=flat``); then :func:`grouped_layout` splits the P
centroids into K_0 equal groups of nearby centroids (k-means on the centroids, balanced
exactly), each group into K_1 equal sub-groups, and so on, and lays the cluster ids onto
cells in that order. Path-level routing is the flat one; only which clusters share a
module changes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional, Sequence

import numpy as np

from ..assign import balanced_assign
from ..kmeans import fit_kmeans, squared_distances
from .base import Grid, KMeansConfig, num_paths
from .flat import FlatMethod

__all__ = ["GroupedConfig", "GroupedMethod", "grouped_layout"]


@dataclass
class GroupedConfig(KMeansConfig):
    """Flat k-means laid by sharing: its only setting is the k-means iterations (``niter``)."""

    name: ClassVar[str] = "grouped"
    experimental: ClassVar[Optional[str]] = (
        "no measurement in docs/results.md supports it (only the synthetic benchmarks/bench_route_sharing.py)")

    def build(self, grid: Grid, *, seed: int, dim: int) -> "GroupedMethod":
        return GroupedMethod(self, grid, seed=seed)

    def min_documents(self, grid: Grid) -> int:
        return num_paths(grid)


class GroupedMethod(FlatMethod):
    """:class:`FlatMethod` whose fitted centroids are reordered by :func:`grouped_layout`."""

    def fit(self, features: np.ndarray, prefixes: Sequence[np.ndarray]) -> None:
        super().fit(features, prefixes)
        self.centroids = self.centroids[grouped_layout(self.centroids, self.grid, niter=self.config.niter,
                                                       seed=self.seed)]


def grouped_layout(centroids: np.ndarray, grid: Sequence[int], *, niter: int = 20, seed: int = 0) -> np.ndarray:
    """Order of the ``P`` flat clusters on the grid cells: ``centroids[order]`` is cell-ordered.

    Cells sharing a level-0 module get a group of mutually near centroids (k-means of the
    centroids into K_0 groups, then an exactly balanced assignment), recursively per level.
    """
    g = [int(k) for k in grid]

    def lay(ids: np.ndarray, level: int) -> list[int]:
        if level == len(g) - 1 or ids.size == 1:
            return ids.tolist()
        k = g[level]
        if k == 1:
            return lay(ids, level + 1)
        pts = centroids[ids]
        group_centres = fit_kmeans(pts, k, niter=niter, seed=seed + level)
        # capacity_factor 1.0 with N = k * size: every group gets exactly `size` clusters
        groups = np.array([h[0] for h in balanced_assign(squared_distances(pts, group_centres),
                                                            capacity_factor=1.0)])
        return [c for j in range(k) for c in lay(ids[groups == j], level + 1)]

    return np.asarray(lay(np.arange(centroids.shape[0]), 0), np.int64)
