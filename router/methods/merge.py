"""Routing by merged clusters (``method="merge"``, ``router=merge``): fine k-means merged onto the grid.
 One k-means of ``M`` *fine* clusters (M well above the number of
paths) follows the corpus's natural groups closely, whatever their shape; a k-means of
only P clusters must cut them into P round pieces of similar spread and often halves a
big domain while lumping two small ones. The fine clusters are then merged by Ward's
criterion (size-weighted: merging clusters A and B costs ``n_A n_B / (n_A + n_B) *
|c_A - c_B|^2``, the rise in within-cluster squares) into K_0 groups, the level-0
modules; each group's fine clusters into K_1 sub-groups, and so on down the levels. A
path is a leaf of that tree, so paths that share a level-0 module hold neighbouring
clusters, as in the tree router (:mod:`router.methods.tree`) but with groups that follow the data
instead of one k-means per node.

A document's cost for a path is its squared distance to the nearest fine centroid of the
path: routing is nearest-fine-cluster, and a document that must move (balance) moves to
the path of its next-nearest fine cluster.

Measured on the built-in corpus (docs/results.md §18), shards on 128 tokens: NMI of the
[2, 2] training shards against the five domains is 0.63-0.66 (product k-means: 0.36 on
32 tokens, 0.47-0.50 on 128), yet the routed perplexity is 2.7-3.6% worse than product
k-means's, with top-2 and with top-1 shards: it is a choice, not the default.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar, Mapping, Optional, Sequence

import numpy as np

from ..assign import balanced_assign
from ..kmeans import fit_kmeans, squared_distances
from .base import COSTLY, Grid, KMeansConfig, num_paths, setting

__all__ = ["MergeConfig", "MergeMethod", "default_fine_clusters", "fit_merge", "merge_costs", "ward_groups"]


@dataclass
class MergeConfig(KMeansConfig):
    """Fine k-means merged by Ward's criterion onto the grid's tree."""

    name: ClassVar[str] = "merge"
    # fine k-means clusters (at least the paths); null: max(64, 8 x paths)
    fine_clusters: Optional[int] = setting(None, lo="paths", hi=2**16, why=COSTLY)

    def resolved(self, grid: Grid) -> "MergeConfig":
        """This config with ``fine_clusters`` filled in for ``grid`` (as a fitted router saves it)."""
        fine = default_fine_clusters(num_paths(grid)) if self.fine_clusters is None else int(self.fine_clusters)
        return replace(self, fine_clusters=fine)

    def build(self, grid: Grid, *, seed: int, dim: int) -> "MergeMethod":
        return MergeMethod(self.resolved(grid), grid, seed=seed)

    def min_documents(self, grid: Grid) -> int:
        return int(self.resolved(grid).fine_clusters)


class MergeMethod:
    """Fine centroids and the path of each (sorted, every path present); a path's cost is
    the squared distance to its nearest fine centroid."""

    def __init__(self, config: MergeConfig, grid: Grid, *, seed: int) -> None:
        self.config, self.grid, self.seed = config, grid, seed
        self.centroids = np.zeros((0, 0), np.float32)
        self.cluster_paths = np.zeros(0, np.int64)

    def fit(self, features: np.ndarray, prefixes: Sequence[np.ndarray]) -> None:
        self.centroids, self.cluster_paths = fit_merge(features, self.grid, int(self.config.fine_clusters),
                                                       niter=self.config.niter, seed=self.seed)

    def costs(self, features: np.ndarray, prefixes: Sequence[np.ndarray]) -> np.ndarray:
        return merge_costs(features, self.centroids, self.cluster_paths, num_paths(self.grid))

    def arrays(self) -> dict[str, np.ndarray]:
        return {"centroids_0": self.centroids, "cluster_paths": self.cluster_paths}

    def load_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        cents = np.asarray(arrays["centroids_0"], np.float32)
        cp = np.asarray(arrays["cluster_paths"], np.int64)
        p = num_paths(self.grid)
        if cp.shape != (cents.shape[0],) or (np.diff(cp) < 0).any() or not np.array_equal(np.unique(cp), np.arange(p)):
            raise ValueError(f"method 'merge' needs cluster_paths: one sorted path id per fine centroid, covering all "
                             f"{p} paths; refit the router (dipaco-route)")
        self.centroids, self.cluster_paths = cents, cp


def default_fine_clusters(num_paths: int) -> int:
    """Fine clusters when none are configured: 8 per path and at least 64, enough for Ward's
    merge to find each path's group among several, few enough that every fine cluster
    holds hundreds of documents of a corpus of tens of thousands."""
    return max(64, 8 * int(num_paths))


def ward_groups(centroids: np.ndarray, sizes: np.ndarray, k: int) -> np.ndarray:
    """Merge ``centroids`` (weighted by ``sizes``) bottom-up by Ward's criterion into ``k`` groups.

    Groups are as big as the data makes them; balance is the shard assignment's job
    (:mod:`router.assign`). Capping a group at 1.25 x the mean while merging lowered the
    [2, 2] shards' NMI against the domains from 0.66 to 0.49 on a 20,000-document sample
    of the built-in corpus, whose domains are not of equal size.

    Returns the group id (0..k-1) of every centroid. Groups are numbered by their smallest
    member index, so the result does not depend on merge order bookkeeping. Ties between
    equal merge costs go to the lowest index pair (deterministic).
    """
    m = centroids.shape[0]
    if not 1 <= k <= m:
        raise ValueError(f"cannot merge {m} clusters into {k} groups; need 1 <= k <= {m}")
    c = np.asarray(centroids, np.float64).copy()
    n = np.maximum(np.asarray(sizes, np.float64), 1e-9)  # an empty cluster still merges somewhere
    owner = np.arange(m)  # the live cluster each original centroid belongs to
    alive = np.ones(m, bool)
    # Pairwise merge costs of live clusters; a merge only changes one row and column.
    d = ((c[:, None, :] - c[None, :, :]) ** 2).sum(-1)
    cost = n[:, None] * n[None, :] / (n[:, None] + n[None, :]) * d
    np.fill_diagonal(cost, np.inf)
    for _ in range(m - k):
        a, b = np.unravel_index(int(np.argmin(cost)), cost.shape)
        a, b = min(a, b), max(a, b)
        c[a] = (n[a] * c[a] + n[b] * c[b]) / (n[a] + n[b])
        n[a] += n[b]
        alive[b] = False
        owner[owner == b] = a
        cost[b, :] = cost[:, b] = np.inf
        row = n[a] * n / (n[a] + n) * ((c - c[a]) ** 2).sum(-1)
        row[~alive] = np.inf
        row[a] = np.inf
        cost[a, :] = cost[:, a] = row
    roots = np.flatnonzero(alive)  # ascending: group j is the j-th surviving cluster
    return np.searchsorted(roots, owner).astype(np.int64)


def fit_merge(x: np.ndarray, grid: Sequence[int], fine_clusters: int, *, niter: int = 20,
              seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Fine k-means of the rows of ``x``, merged onto ``grid``.

    Returns ``(centroids [M', d] float32, cluster_paths [M'] int64)``: the fine centroids
    and the path (grid cell id) each belongs to, sorted by path. Every path holds at least
    one fine cluster. ``M'`` can exceed ``fine_clusters`` when a tree node holds fewer fine
    clusters than it has children: that node's documents are then re-clustered into as
    many clusters as it has children (one each).
    """
    g = [int(k) for k in grid]
    p = int(np.prod(g))
    x = np.ascontiguousarray(x, np.float32)
    if not p <= fine_clusters <= x.shape[0]:
        raise ValueError(f"fine_clusters={fine_clusters} must lie in [{p}, {x.shape[0]}] "
                         f"(paths of grid {g}, documents); set router.fine_clusters accordingly")
    fine = fit_kmeans(x, int(fine_clusters), niter=niter, seed=seed)
    near = squared_distances(x, fine).argmin(axis=1)
    cents = [fine[j] for j in range(fine.shape[0])]
    members = [np.flatnonzero(near == j) for j in range(fine.shape[0])]
    # Each entry of `nodes` is the list of fine-cluster indices under one tree node, in
    # mixed-radix order of the cells above it.
    nodes: list[list[int]] = [list(range(len(cents)))]
    for level, k in enumerate(g):
        if k == 1:
            continue
        children: list[list[list[int]]] = []
        for node_i, ids in enumerate(nodes):
            if len(ids) < k:  # too few fine clusters to split: re-cluster the node's documents
                docs = np.concatenate([members[j] for j in ids])
                ids = _split_node(x, docs, k, cents, members, ids, niter=niter,
                                  seed=seed + 7919 * (level + 1) + node_i)
            sizes = np.array([members[j].size for j in ids], np.float64)
            group = ward_groups(np.stack([cents[j] for j in ids]), sizes, k)
            children.append([[ids[t] for t in np.flatnonzero(group == q)] for q in range(k)])
        if len(children) > 1:
            children = _align(children, cents, members)
        nodes = [child for node in children for child in node]
    paths = np.empty(len(cents), np.int64)
    for cell, ids in enumerate(nodes):
        paths[ids] = cell
    order = np.argsort(paths, kind="stable")
    return np.stack(cents)[order].astype(np.float32), paths[order]


def _split_node(x: np.ndarray, docs: np.ndarray, k: int, cents: list, members: list, ids: list[int], *,
                niter: int, seed: int) -> list[int]:
    """Replace the fine clusters ``ids`` (at least one) by ``k`` new ones fitted on their
    documents ``docs``.

    With fewer than ``k`` documents the node repeats its centroids (the balanced
    assignment's floor still gives every path documents)."""
    if docs.size >= k:
        new = fit_kmeans(x[docs], k, niter=niter, seed=seed)
        near = squared_distances(x[docs], new).argmin(axis=1)
        groups = [docs[near == j] for j in range(k)]
    else:  # fewer documents than children: repeat the node's centroids
        new = np.stack([cents[ids[j % len(ids)]] for j in range(k)])
        groups = [docs[j : j + 1] for j in range(k)]
    out = []
    for j in range(k):
        if j < len(ids):  # reuse the slots of the replaced clusters, then append
            slot = ids[j]
            cents[slot], members[slot] = new[j], groups[j]
        else:
            cents.append(new[j])
            members.append(groups[j])
            slot = len(cents) - 1
        out.append(slot)
    return out


def _centre(ids: list[int], cents: list, members: list) -> np.ndarray:
    """Size-weighted mean of the fine centroids ``ids`` (the group's centroid)."""
    w = np.array([max(members[j].size, 1) for j in ids], np.float64)
    return (np.stack([cents[j] for j in ids]) * w[:, None]).sum(0) / w.sum()


def _align(children: list[list[list[int]]], cents: list, members: list) -> list[list[list[int]]]:
    """Reorder each node's children so that child q sits in the same direction from its
    parent in every node: the q-th module of this level is shared by the q-th child of
    every node, so it should serve alike sub-groups (residual directions, as in the tree
    router)."""
    k = len(children[0])
    offsets = []
    for node in children:
        parent = _centre([j for child in node for j in child], cents, members)
        offsets.append(np.stack([_centre(child, cents, members) - parent for child in node]))
    every = np.concatenate(offsets).astype(np.float32)
    ref = fit_kmeans(every, k, niter=20, seed=0) if every.shape[0] > k else every[:k]
    out = []
    for node, off in zip(children, offsets):
        match = balanced_assign(squared_distances(off, ref), capacity_factor=1.0)  # one-to-one
        slot = [m[0] for m in match]
        ordered: list[list[int]] = [[] for _ in range(k)]
        for child, s in zip(node, slot):
            ordered[s] = child
        out.append(ordered)
    return out


def merge_costs(x: np.ndarray, centroids: np.ndarray, cluster_paths: np.ndarray, num_paths: int) -> np.ndarray:
    """Path costs ``[N, P]``: squared distance to the nearest fine centroid of each path.

    ``cluster_paths`` must be sorted (as :func:`fit_merge` returns it) and cover every path.
    """
    d = squared_distances(x, centroids)
    starts = np.searchsorted(cluster_paths, np.arange(num_paths))
    return np.minimum.reduceat(d, starts, axis=1).astype(np.float32, copy=False)
