"""Flat k-means (``method="flat"``, ``router=flat``): one k-means of P clusters, cluster c on grid cell c.

The P centroids are laid onto the cells in faiss's order (cluster id = path id), so which
clusters share a module is arbitrary (``router.methods.grouped`` lays them by sharing).
A path's cost is the squared distance to its centroid.

Measured in docs/results.md §4 (as good as product k-means at top-1 on two seeds, the
seeds disagreeing on the sign) and §10 (the routers' NMI on the multidomain corpus).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Mapping, Sequence

import numpy as np

from ..kmeans import fit_kmeans, squared_distances
from .base import Grid, KMeansConfig, num_paths

__all__ = ["FlatConfig", "FlatMethod"]


@dataclass
class FlatConfig(KMeansConfig):
    """One k-means of P clusters: its only setting is the k-means iterations (``niter``)."""

    name: ClassVar[str] = "flat"

    def build(self, grid: Grid, *, seed: int, dim: int) -> "FlatMethod":
        return FlatMethod(self, grid, seed=seed)

    def min_documents(self, grid: Grid) -> int:
        return num_paths(grid)


class FlatMethod:
    """P centroids, one per path (row p is path p's)."""

    def __init__(self, config: KMeansConfig, grid: Grid, *, seed: int) -> None:
        self.config, self.grid, self.seed = config, grid, seed
        self.centroids = np.zeros((0, 0), np.float32)

    def fit(self, features: np.ndarray, prefixes: Sequence[np.ndarray]) -> None:
        self.centroids = fit_kmeans(features, num_paths(self.grid), niter=self.config.niter, seed=self.seed)

    def costs(self, features: np.ndarray, prefixes: Sequence[np.ndarray]) -> np.ndarray:
        return squared_distances(features, self.centroids)

    def arrays(self) -> dict[str, np.ndarray]:
        return {"centroids_0": self.centroids}

    def load_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        c = np.asarray(arrays["centroids_0"], np.float32)
        if c.shape[0] != num_paths(self.grid):
            raise ValueError(f"centroids_0 holds {c.shape[0]} centroids for {num_paths(self.grid)} paths")
        self.centroids = c
