"""Hierarchical k-means (``method="tree"``, ``router=tree``): paths that share a module get related documents.

In a grid, the paths that share a level-l module are the cells with the same prefix
``(k_0, ..., k_l)``. :func:`fit_tree`: level 0 clusters all features into K_0 nodes; the
members of each node are clustered into K_1 children, and so on down the levels (a level
with K = 1 adds no node). Node ``(k_0, ..., k_l)`` has index
``np.ravel_multi_index((k_0, ..., k_l), grid[: l + 1])``, so the leaves are the path ids.
:func:`tree_costs` gives the cost of a path as the sum over levels of the squared
distance to the centroid of the path's node at that level: a document's next-best path
is then usually a sibling (same level-0 module), which is where balanced assignment
sends overflow. A level-1 module j is shared by the j-th children of *every* level-0
node, so the children are ordered to agree across nodes: child j of each node is the
one whose offset from its parent is nearest the j-th of K_1 reference offsets (k-means
of every point's offset from its parent), as in residual quantisation.

Measured in docs/results.md §10 and §12 (soft balance, top-1 and top-2): its shards
follow the domains most closely of the k-means routers, and it trains worse than product
k-means there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Mapping, Sequence

import numpy as np

from ..assign import balanced_assign
from ..kmeans import fit_kmeans, search, squared_distances
from .base import Grid, KMeansConfig

__all__ = ["TreeConfig", "TreeMethod", "fit_tree", "tree_costs"]


@dataclass
class TreeConfig(KMeansConfig):
    """Hierarchical k-means: its only setting is the k-means iterations (``niter``)."""

    name: ClassVar[str] = "tree"

    def build(self, grid: Grid, *, seed: int, dim: int) -> "TreeMethod":
        return TreeMethod(self, grid, seed=seed)


class TreeMethod:
    """One array of node centroids per level; a path's cost sums its nodes' squared distances."""

    def __init__(self, config: TreeConfig, grid: Grid, *, seed: int) -> None:
        self.config, self.grid, self.seed = config, grid, seed
        self.centroids: list[np.ndarray] = []

    def fit(self, features: np.ndarray, prefixes: Sequence[np.ndarray]) -> None:
        self.centroids = fit_tree(features, self.grid, niter=self.config.niter, seed=self.seed)

    def costs(self, features: np.ndarray, prefixes: Sequence[np.ndarray]) -> np.ndarray:
        return tree_costs(features, self.grid, self.centroids)

    def arrays(self) -> dict[str, np.ndarray]:
        return {f"centroids_{l}": c for l, c in enumerate(self.centroids)}

    def load_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        self.centroids = [np.asarray(arrays[f"centroids_{l}"], np.float32) for l in range(len(self.grid))]

# The first split decides which documents every module below it sees, and one k-means run
# can merge two natural clusters and split another; the root keeps the best of a few
# runs (lowest objective). It is one k-means of K_0 centroids, cheap next to the rest.
ROOT_REDO = 4


def _node_seed(seed: int, level: int, node: int) -> int:
    # distinct per node so sibling fits do not start from mirrored centroids
    return seed + 1000 * level + 7919 * node


def _fit_node(x: np.ndarray, k: int, parent: np.ndarray, *, niter: int, seed: int, nredo: int) -> np.ndarray:
    """``k`` child centroids of one node from its member points ``x``.

    A node with fewer than ``k`` members (small corpora, deep grids) keeps each member as a
    centroid and fills the rest with the parent's centroid; coinciding centroids tie, and
    balanced assignment still gives every path documents.
    """
    if x.shape[0] >= k:
        return fit_kmeans(x, k, niter=niter, seed=seed, nredo=nredo)
    out = np.repeat(parent[None, :], k, axis=0).astype(np.float32)
    out[: x.shape[0]] = x
    return out


def fit_tree(x: np.ndarray, grid: Sequence[int], *, niter: int = 20, seed: int = 0) -> list[np.ndarray]:
    """Hierarchical k-means of the rows of ``x`` for ``grid``.

    Returns one float32 array per level: ``[prod(grid[: l + 1]), d]`` node centroids in
    mixed-radix order, or ``[prod(grid[: l]), 0]`` for a level with K = 1 (no cost).
    Each point descends to its nearest child at every level; children are fitted on the
    points that reached their parent, then ordered by :func:`_align_children`.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    n, d = x.shape
    node = np.zeros(n, np.int64)  # each point's node at the previous level
    parents = x.mean(axis=0, keepdims=True)
    out: list[np.ndarray] = []
    depth = 0  # levels with K > 1 so far: a K = 1 level changes no seed
    for k in (int(k) for k in grid):
        if k == 1:
            out.append(np.zeros((parents.shape[0], 0), np.float32))
            continue
        cents = np.empty((parents.shape[0] * k, d), np.float32)
        child = np.empty(n, np.int64)
        for p in range(parents.shape[0]):
            members = np.flatnonzero(node == p)
            block = _fit_node(x[members], k, parents[p], niter=niter, seed=_node_seed(seed, depth, p),
                              nredo=ROOT_REDO if depth == 0 else 1)
            cents[p * k : (p + 1) * k] = block
            if members.size:
                child[members] = p * k + search(x[members], block)[0][:, 0]
        if parents.shape[0] > 1:
            cents, child = _align_children(x, node, parents, cents, child, k, niter=niter, seed=seed + depth)
        node, parents, depth = child, cents, depth + 1
        out.append(cents)
    return out


def _align_children(x: np.ndarray, node: np.ndarray, parents: np.ndarray, cents: np.ndarray,
                    child: np.ndarray, k: int, *, niter: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Reorder each node's ``k`` children so that child j sits in the same direction from its
    parent in every node (the j-th module of this level then serves alike sub-clusters).

    Returns the reordered centroids and each point's child index under the new order.
    """
    ref = fit_kmeans(x - parents[node], k, niter=niter, seed=seed)  # shared offset directions
    slot = np.empty(cents.shape[0], np.int64)  # new index of each child
    for p in range(parents.shape[0]):
        offsets = cents[p * k : (p + 1) * k] - parents[p]
        # capacity 1.0 with k children and k references: a one-to-one matching
        match = balanced_assign(squared_distances(offsets, ref), capacity_factor=1.0)
        slot[p * k : (p + 1) * k] = p * k + np.array([m[0] for m in match])
    aligned = np.empty_like(cents)
    aligned[slot] = cents
    return aligned, slot[child]


def tree_costs(x: np.ndarray, grid: Sequence[int], centroids: Sequence[np.ndarray]) -> np.ndarray:
    """Path costs ``[N, P]``: the sum over levels of squared distances to the path's node centroids."""
    total = np.zeros((x.shape[0], 1), np.float32)
    for k, c in zip(grid, centroids):
        total = np.repeat(total, int(k), axis=1)  # child j of node p is p * k + j
        if c.shape[1]:
            total += squared_distances(x, c)
    return total
