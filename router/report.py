"""Routing report: shard sizes, balance and (with labels) agreement with known domains."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np


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
        members = path_ids[path_ids >= 0].astype(np.int64)
    elif len(path_ids) and not np.isscalar(path_ids[0]) and np.ndim(path_ids[0]) == 1:
        lists = [list(map(int, p)) for p in path_ids]
        best = np.array([p[0] if p else -1 for p in lists], np.int64)
        members = np.array([q for p in lists for q in p], np.int64)
    else:
        best = np.asarray(path_ids, np.int64).reshape(-1)
        members = best
    if members.size and (members.min() < 0 or members.max() >= num_paths):
        raise ValueError(f"path ids must lie in [0, {num_paths}), got range [{members.min()}, {members.max()}]")
    sizes = np.bincount(members, minlength=num_paths)
    mean = sizes.mean()
    report: dict[str, Any] = {
        "num_documents": int(best.size),
        "num_paths": num_paths,
        "shard_sizes": sizes.tolist(),
        "imbalance": float(sizes.max() / mean) if mean > 0 else None,
        "empty_shards": np.flatnonzero(sizes == 0).tolist(),
    }
    if labels is not None:
        # int codes stay an array (a million Python objects would cost ~60 MB); anything
        # else compares as text, None included
        labels = labels if isinstance(labels, np.ndarray) and labels.dtype.kind in "iu" else list(labels)
        if len(labels) != best.size:
            raise ValueError(f"labels has {len(labels)} entries for {best.size} documents")
        report.update(_agreement(best, num_paths, labels))
        if grid is not None:
            g = tuple(int(k) for k in grid)
            if int(np.prod(g)) != num_paths:
                raise ValueError(f"grid {list(g)} has {int(np.prod(g))} paths, not num_paths={num_paths}")
            ok = best >= 0
            modules = np.full((len(g), best.size), -1, np.int64)
            modules[:, ok] = np.unravel_index(best[ok], g)
            report["levels"] = [dict(level=l, modules=k, **_agreement(modules[l], k, labels)) for l, k in enumerate(g)]
    return report


def _agreement(assigned: np.ndarray, k: int, labels: Any) -> dict[str, float | None]:
    """NMI and purity of ``assigned`` (ids in [0, k), -1 = none) against ``labels``
    (any values, or an int array of label codes: the same partition, the same numbers)."""
    from sklearn.metrics import normalized_mutual_info_score  # lazy: keeps `import router` light

    if not assigned.size:
        return {"nmi": None, "purity": None}
    if isinstance(labels, np.ndarray):
        _, lab = np.unique(labels, return_inverse=True)
    else:
        _, lab = np.unique(np.asarray([str(x) for x in labels]), return_inverse=True)
    table = np.zeros((k + 1, lab.max() + 1), np.int64)
    np.add.at(table, (assigned, lab), 1)  # row -1 (a document with no path) never counts as correct
    return {"nmi": float(normalized_mutual_info_score(lab if isinstance(labels, np.ndarray) else labels, assigned)),
            "purity": float(table[:k].max(axis=1).sum() / assigned.size)}


__all__ = ["routing_report"]
