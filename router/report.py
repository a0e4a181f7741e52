"""Routing report: shard sizes, balance and (with labels) agreement with known domains."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import scipy.sparse as sp


def routing_report(
    path_ids: Sequence[int] | Sequence[Sequence[int]] | np.ndarray,
    *,
    num_paths: int,
    labels: Sequence[Any] | None = None,
    grid: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Summarise a routing as a JSON-able dict.

    Args:
        path_ids: the path of each document (``route_batch`` output), or the per-document
            path lists of ``Router.assign`` (or their int array ``[N, k]``, ``-1`` for no
            path); with lists, shard sizes count every membership and NMI/purity use each
            document's first (best) path.
        num_paths: P, so paths that received nothing still appear (as size 0).
        labels: optional known domain of each document (any hashable values).
        grid: modules per level (``num_paths`` must be their product); with labels, adds
            ``levels``: for each level, NMI and purity of the level's module index of
            each document's path (the documents a module trains on, against the domains).

    Returns keys ``num_documents``, ``shard_sizes`` (one per path), ``imbalance``
    (max/mean shard size; None without documents), ``empty_shards`` (path ids), and with
    labels ``nmi`` (sklearn normalized_mutual_info_score) and ``purity`` (share of
    documents whose path's majority label is their own label).
    """
    num_paths = int(num_paths)
    if num_paths < 1:
        raise ValueError(f"num_paths must be >= 1, got {num_paths}")
    if isinstance(path_ids, np.ndarray) and path_ids.ndim == 2:  # [N, k], -1: no path (no Python lists)
        best = path_ids[:, 0].astype(np.int64) if path_ids.shape[1] else np.full(len(path_ids), -1, np.int64)
        columns = [path_ids[:, j] for j in range(path_ids.shape[1])]
    elif len(path_ids) and not np.isscalar(path_ids[0]) and np.ndim(path_ids[0]) == 1:
        lists = [list(map(int, p)) for p in path_ids]
        best = np.array([p[0] if p else -1 for p in lists], np.int64)
        columns = [np.array([q for p in lists for q in p], np.int64)]
    else:
        best = np.asarray(path_ids, np.int64).reshape(-1)
        columns = [best]
    sizes = np.zeros(num_paths, np.int64)
    for col in columns:  # one column at a time: no int64 copy of every membership
        member = col[col >= 0] if isinstance(path_ids, np.ndarray) and path_ids.ndim == 2 else col
        if member.size and (member.min() < 0 or member.max() >= num_paths):
            raise ValueError(f"path ids must lie in [0, {num_paths}), got range [{member.min()}, {member.max()}]")
        sizes += np.bincount(member.astype(np.int64), minlength=num_paths)
    mean = sizes.mean()
    report: dict[str, Any] = {
        "num_documents": int(best.size),
        "num_paths": num_paths,
        "shard_sizes": sizes.tolist(),
        "imbalance": float(sizes.max() / mean) if mean > 0 else None,
        "empty_shards": np.flatnonzero(sizes == 0).tolist(),
    }
    if labels is not None:
        if len(labels) != best.size:
            raise ValueError(f"labels has {len(labels)} entries for {best.size} documents")
        # int codes stay an array (a million Python objects would cost ~60 MB); anything
        # else compares as text, None included. The classes are found once for every level.
        known = None  # documents whose label is known; None: all of them
        if isinstance(labels, np.ndarray) and labels.dtype.kind in "iu":
            lab = np.unique(labels, return_inverse=True)[1]
        else:
            # a document whose label is missing (null, or absent from its record) is left
            # out: its domain is unknown, and mixing None with names would not sort
            known = np.fromiter((x is not None for x in labels), bool, count=len(labels))
            names = [str(x) for x, ok in zip(labels, known) if ok]
            lab = np.unique(np.asarray(names, dtype=str), return_inverse=True)[1] if names else np.zeros(0, np.int64)
            known = None if known.all() else known
        best_known = best if known is None else best[known]
        report.update(_agreement(best_known, num_paths, lab))
        if grid is not None:
            g = tuple(int(k) for k in grid)
            if int(np.prod(g)) != num_paths:
                raise ValueError(f"grid {list(g)} has {int(np.prod(g))} paths, not num_paths={num_paths}")
            levels = []
            for level, k in enumerate(g):  # each document's module at this level (-1: no path)
                stride = int(np.prod(g[level + 1:]))
                modules = np.where(best >= 0, (best // stride) % k, -1)
                levels.append(dict(level=level, modules=k, **_agreement(modules if known is None else modules[known], k, lab)))
            report["levels"] = levels
    return report


def _agreement(assigned: np.ndarray, k: int, lab: np.ndarray) -> dict[str, float | None]:
    """NMI and purity of ``assigned`` (ids in [0, k), -1 = none) against the label classes
    ``lab`` (0, 1, ... in the sorted order of the labels)."""
    if not assigned.size:
        return {"nmi": None, "purity": None}
    n_lab = int(lab.max()) + 1
    # rows 0..k-1 the paths, row k the documents with no path (never counted as correct)
    cells = np.where(assigned >= 0, assigned, k).astype(np.int64) * n_lab + lab
    table = np.bincount(cells, minlength=(k + 1) * n_lab).reshape(k + 1, n_lab)
    return {"nmi": _nmi(lab, assigned), "purity": float(table[:k].max(axis=1).sum() / assigned.size)}


def _nmi(lab: np.ndarray, assigned: np.ndarray) -> float:
    """``sklearn.metrics.normalized_mutual_info_score(lab, assigned)`` (arithmetic mean of
    the entropies) from the [classes, clusters] contingency table, in the order scikit-learn
    builds it (classes and clusters sorted), so the value is the same to the last bit.

    scikit-learn's own function makes int64 and float64 arrays of every document several
    times over (~90 MB for 900,000 documents); the table is classes x clusters numbers.
    """
    from sklearn.metrics import mutual_info_score  # lazy: keeps `import router` light

    clusters, col = np.unique(assigned, return_inverse=True)
    n_classes, n_clusters = int(lab.max()) + 1, clusters.size
    if n_classes == n_clusters == 1:  # neither labelling splits the data: a perfect match
        return 1.0
    table = np.bincount(lab.astype(np.int64) * n_clusters + col, minlength=n_classes * n_clusters)
    table = table.reshape(n_classes, n_clusters)
    mi = mutual_info_score(None, None, contingency=sp.csr_matrix(table.astype(np.float64)))
    if mi == 0:
        return 0.0
    return float(mi / np.mean([_entropy(table.sum(axis=1)), _entropy(table.sum(axis=0))]))


def _entropy(counts: np.ndarray) -> float:
    """Entropy (nats) of a labelling given its counts per label."""
    pi = counts[counts > 0].astype(np.float64)
    if pi.size == 1:
        return 0.0
    total = np.sum(pi)
    return float(-np.sum((pi / total) * (np.log(pi) - np.log(total))))


__all__ = ["routing_report"]
