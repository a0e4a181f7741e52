"""Product k-means (``method="product"``; ``router=kmeans``, the default): a k-means per level.

Each level clusters its own block of the features. The feature vector is rotated by a
seeded random orthogonal matrix (so no level gets only the leading, high-variance SVD
components) and split into contiguous blocks, one per level with K > 1. Level l clusters
its block into K_l centroids; the cost of path ``(k_0, k_1, ...)`` is the sum over levels
of the squared distance from the level's block to centroid ``k_l``. Levels with K = 1
contribute nothing (and get no block, so no feature dimension is wasted on them). Levels
are clustered independently, so which documents share a module is decided by one block
of features only (see ``router.methods.tree`` for fits where the paths sharing a module
receive related documents).

Measured throughout docs/results.md (§10-19): top-2 product k-means is the default run's router.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Mapping, Sequence

import numpy as np

from ..kmeans import fit_kmeans, squared_distances
from .base import Grid, KMeansConfig, num_paths

__all__ = ["ProductConfig", "ProductMethod", "random_rotation", "level_blocks", "fit_product", "product_level_costs"]


@dataclass
class ProductConfig(KMeansConfig):
    """Product k-means: its only setting is the k-means iterations (``niter``)."""

    name: ClassVar[str] = "product"

    def build(self, grid: Grid, *, seed: int, dim: int) -> "ProductMethod":
        return ProductMethod(self, grid, seed=seed, dim=dim)


class ProductMethod:
    """Per-level centroids on blocks of the rotated features; a path's cost is the sum of its levels'."""

    def __init__(self, config: ProductConfig, grid: Grid, *, seed: int, dim: int) -> None:
        level_blocks(dim, grid)  # refuses a feature dim too small for the levels
        self.config, self.grid, self.seed = config, grid, seed
        self.centroids: list[np.ndarray] = []
        self.rotation: np.ndarray | None = None

    def fit(self, features: np.ndarray, prefixes: Sequence[np.ndarray]) -> None:
        self.centroids, self.rotation = fit_product(features, self.grid, niter=self.config.niter, seed=self.seed)

    def level_costs(self, features: np.ndarray) -> list[np.ndarray]:
        """Per-level squared distances ``[N, K_l]`` (zeros for K = 1 levels)."""
        return product_level_costs(features, self.grid, self.centroids, self.rotation)

    def costs(self, features: np.ndarray, prefixes: Sequence[np.ndarray]) -> np.ndarray:
        n = features.shape[0]
        total = np.zeros((n,) + self.grid, np.float32)
        for level, d in enumerate(self.level_costs(features)):
            shape = [n] + [1] * len(self.grid)
            shape[level + 1] = self.grid[level]
            total += d.reshape(shape)  # broadcast: C order == level 0 most significant
        return total.reshape(n, num_paths(self.grid))

    def arrays(self) -> dict[str, np.ndarray]:
        return {**{f"centroids_{l}": c for l, c in enumerate(self.centroids)}, "rotation": self.rotation}

    def load_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        self.centroids = [np.asarray(arrays[f"centroids_{l}"], np.float32) for l in range(len(self.grid))]
        self.rotation = np.asarray(arrays["rotation"], np.float32)


def random_rotation(d: int, seed: int) -> np.ndarray:
    """A seeded uniformly random orthogonal ``[d, d]`` matrix (QR of a Gaussian, sign-fixed)."""
    rng = np.random.default_rng(seed)
    q, r = np.linalg.qr(rng.standard_normal((d, d)))
    return (q * np.sign(np.diag(r))[None, :]).astype(np.float32)


def level_blocks(d: int, grid: Sequence[int]) -> list[tuple[int, int] | None]:
    """Feature columns [start, end) for each level; None for levels with K = 1."""
    active = [l for l, k in enumerate(grid) if k > 1]
    if d < len(active):
        raise ValueError(
            f"feature dim {d} is smaller than the number of levels with K > 1 ({len(active)}): "
            "raise the featurizer dim or use method='flat'"
        )
    bounds = np.array_split(np.arange(d), max(len(active), 1))
    blocks: list[tuple[int, int] | None] = [None] * len(grid)
    for l, cols in zip(active, bounds):
        blocks[l] = (int(cols[0]), int(cols[-1]) + 1)
    return blocks


def fit_product(feats: np.ndarray, grid: Sequence[int], *, niter: int, seed: int
                ) -> tuple[list[np.ndarray], np.ndarray]:
    """Per-level centroids (``[K_l, block]``; ``[1, 0]`` for K = 1) and the rotation."""
    rotation = random_rotation(feats.shape[1], seed)
    rotated = feats @ rotation
    centroids = []
    for level, (k, block) in enumerate(zip(grid, level_blocks(feats.shape[1], grid))):
        if block is None:  # K = 1: the level is shared, it contributes no cost
            centroids.append(np.zeros((1, 0), np.float32))
            continue
        x = np.ascontiguousarray(rotated[:, block[0] : block[1]])
        # A distinct seed per level so levels do not start from mirrored centroids.
        centroids.append(fit_kmeans(x, k, niter=niter, seed=seed + 1000 * level))
    return centroids, rotation


def product_level_costs(features: np.ndarray, grid: Sequence[int], centroids: Sequence[np.ndarray],
                        rotation: np.ndarray) -> list[np.ndarray]:
    """Per-level squared distances ``[N, K_l]`` (zeros for K = 1 levels)."""
    rotated = features.astype(np.float32) @ rotation
    out = []
    for k, block, c in zip(grid, level_blocks(features.shape[1], grid), centroids):
        if block is None:
            out.append(np.zeros((features.shape[0], k), np.float32))
        else:
            out.append(squared_distances(rotated[:, block[0] : block[1]], c))
    return out
