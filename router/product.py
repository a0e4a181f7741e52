"""Product k-means (``method="product"``): each level clusters its own block of the features.

The feature vector is rotated by a seeded random orthogonal matrix (so no level gets only
the leading, high-variance SVD components) and split into contiguous blocks, one per
level with K > 1. Level l clusters its block into K_l centroids; the cost of path
``(k_0, k_1, ...)`` is the sum over levels of the squared distance from the level's block
to centroid ``k_l``. Levels with K = 1 contribute nothing (and get no block, so no feature
dimension is wasted on them). Levels are clustered independently, so which documents
share a module is decided by one block of features only (see ``router.tree`` for fits
where the paths sharing a module receive related documents).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .kmeans import fit_kmeans, squared_distances

__all__ = ["random_rotation", "level_blocks", "fit_product", "product_level_costs"]


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
