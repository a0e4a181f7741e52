"""Balanced top-k assignment of documents to paths (training shards), from a cost matrix.

Given ``costs[N, P]`` (lower is better) every document receives ``top_k`` distinct paths
such that no shard holds more than ``capacity = ceil(capacity_factor * N * top_k / P)``
documents:

1. Assignment runs in ``top_k`` rounds; round r gives each document its r-th path. Doing
   everyone's first choice before anyone's second keeps overflow out of the shards
   documents want most.
2. Within a round, documents go in order of confidence — the margin between their best
   and second-best path cost, largest first (ties: lower document index) — and take their
   best path that still has room and that they do not already hold. Overflow therefore
   lands on the uncertain documents, which lose least by moving.
3. When ``N >= P`` (top_k = 1) or generally when enough documents exist, no shard is left
   empty: each empty path takes its nearest document (lowest cost for that path) from a
   shard that keeps at least one document, replacing that document's path from the
   largest such shard.

With ``capacity_factor >= 1`` the total room ``P * capacity >= N * top_k``, so step 2
always finds a path: directly, or (top_k > 1, when the only room left is on paths the
document already holds) by moving one other document to a path with room.
"""
from __future__ import annotations

import math

import numpy as np


def capacity_per_path(num_docs: int, num_paths: int, top_k: int, capacity_factor: float) -> int:
    """Most documents one shard may hold: ``ceil(capacity_factor * N * top_k / P)``."""
    return max(1, math.ceil(capacity_factor * num_docs * top_k / num_paths - 1e-9))


def balanced_assign(costs: np.ndarray, *, top_k: int = 1, capacity_factor: float = 1.25) -> list[list[int]]:
    """Each row's ``top_k`` distinct paths (best first by cost) under per-shard capacity.

    Raises ValueError when ``top_k`` is not in [1, P] or ``capacity_factor < 1``.
    """
    costs = np.asarray(costs, np.float64)
    if costs.ndim != 2:
        raise ValueError(f"costs must be [N, P], got shape {costs.shape}")
    n, p = costs.shape
    top_k = int(top_k)
    if not 1 <= top_k <= p:
        raise ValueError(f"top_k must be in [1, {p}] (number of paths), got {top_k}")
    if not capacity_factor >= 1.0:
        raise ValueError(
            f"capacity_factor must be >= 1.0 (1.0 = perfectly balanced shards), got {capacity_factor}"
        )
    if n == 0:
        return []
    cap = capacity_per_path(n, p, top_k, capacity_factor)
    # Preference order of each document (stable: equal costs → lower path id first).
    pref = np.argsort(costs, axis=1, kind="stable")
    if p > 1:
        sorted_c = np.take_along_axis(costs, pref[:, :2], axis=1)
        margin = sorted_c[:, 1] - sorted_c[:, 0]
    else:
        margin = np.zeros(n)
    order = np.lexsort((np.arange(n), -margin))
    load = np.zeros(p, np.int64)
    chosen: list[list[int]] = [[] for _ in range(n)]
    for _round in range(top_k):
        for i in order.tolist():
            held = chosen[i]
            for path in pref[i].tolist():
                if load[path] < cap and path not in held:
                    held.append(path)
                    load[path] += 1
                    break
            else:
                _make_room(costs, pref[i], chosen, load, i, cap)
    _fill_empty(costs, chosen, load)
    # Report paths best first by cost, whatever order the rounds produced.
    return [sorted(h, key=lambda q, row=costs[i]: (row[q], q)) for i, h in enumerate(chosen)]


def _make_room(costs: np.ndarray, pref_i: np.ndarray, chosen: list[list[int]], load: np.ndarray, i: int,
               cap: int) -> None:
    """Document ``i`` finds room only on paths it already holds (possible with top_k > 1).

    Total room suffices (``P * cap >= N * top_k``), so some path ``q`` it holds has room
    and every path it lacks is full. Its best missing path ``q2`` has ``cap`` holders, not
    all of whom can hold ``q`` too (``q`` would then be over capacity): the holder ``j``
    that moves ``q2 → q`` at the least cost makes the room, and ``i`` takes ``q2``.
    """
    held = chosen[i]
    q2 = next(q for q in pref_i.tolist() if q not in held)
    best = None
    for q in (q for q in held if load[q] < cap):
        for j, other in enumerate(chosen):
            if q2 in other and q not in other:
                delta = costs[j, q] - costs[j, q2]
                if best is None or delta < best[0]:
                    best = (delta, j, q)
    if best is None:  # impossible while capacity_factor >= 1 (see above); a loud guard
        raise RuntimeError("balanced_assign ran out of room; this is a bug")
    _, j, q = best
    chosen[j][chosen[j].index(q2)] = q
    load[q] += 1
    held.append(q2)  # q2's load is unchanged: j left it, i joined it


def _fill_empty(costs: np.ndarray, chosen: list[list[int]], load: np.ndarray) -> None:
    """Give every empty path its nearest document that can move without emptying a shard."""
    for path in np.flatnonzero(load == 0).tolist():
        for i in np.argsort(costs[:, path], kind="stable").tolist():
            held = chosen[i]
            if path in held:
                continue
            donors = [q for q in held if load[q] > 1]
            if not donors:
                continue
            give_up = max(donors, key=lambda q: (load[q], costs[i, q]))
            held[held.index(give_up)] = path
            load[give_up] -= 1
            load[path] += 1
            break


__all__ = ["balanced_assign", "capacity_per_path"]
