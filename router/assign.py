"""Balanced top-k assignment of documents to paths (training shards), from a cost matrix.

Given ``costs[N, P]`` (lower is better) every document receives ``top_k`` distinct paths
such that no shard holds more than its capacity. With ``balance="hard"`` every path has
``capacity = ceil(capacity_factor * N * top_k / P)``. With ``balance="soft"`` a path's
capacity is its *natural load* (how many documents have it among their ``top_k``
cheapest paths) clipped to ``[capacity, ceil(soft_capacity_factor * N * top_k / P)]``: a
big natural cluster keeps its documents up to the soft ceiling instead of spilling the
excess onto other clusters' paths, while overflow never pushes a path above the hard cap
unless its own documents already did. Mirroring the ceiling, a soft shard also holds at
least ``floor(N * top_k / P / soft_capacity_factor)`` documents: a path that no cluster
prefers (a k-means leaf of 10 documents out of 7,000, seen on the multidomain corpus)
still gets enough data to train. A hard shard holds at least ``floor(HARD_FLOOR * N * top_k / P)``
(half the mean): product k-means on a [4, 4] grid left cells that no document's two level
clusters both prefer with 1, 2 and 4 documents of 16,000, paths that then train as many
steps as the others on one document and serve whatever prompt lands there.

1. Assignment runs in ``top_k`` rounds; round r gives each document its r-th path. Doing
   everyone's first choice before anyone's second keeps overflow out of the shards
   documents want most.
2. Within a round, documents go in order of confidence — the margin between their best
   and second-best path cost, largest first (ties: lower document index) — and take their
   best path that still has room and that they do not already hold. Overflow therefore
   lands on the uncertain documents, which lose least by moving.
3. When ``N >= P`` (top_k = 1) or generally when enough documents exist, no shard is left
   below its floor: each such path takes its nearest documents (lowest cost for that path)
   from shards that stay at or above their own floor, replacing that document's path from
   the largest such shard.

With ``capacity_factor >= 1`` the total room ``P * capacity >= N * top_k``, so step 2
always finds a path: directly, or (top_k > 1, when the only room left is on paths the
document already holds) by moving one other document to a path with room. With unequal
soft capacities that move may not exist; the document then joins its best missing path
one above that path's capacity (soft capacities are a preference, not a guarantee).
"""
from __future__ import annotations

import math

import numpy as np

# "hard": one capacity for every path; "soft": a path keeps its natural load up to a ceiling
BALANCES = ("hard", "soft")
# hard balance: no shard below this fraction of the mean shard (soft: 1 / soft_capacity_factor).
# A structural guard against near-empty shards, far below what a natural cluster holds: the
# smallest shards of the [2, 2] runs in docs/results.md §13-14 sit at 0.58-0.92 of the mean.
HARD_FLOOR = 0.5


def capacity_per_path(num_docs: int, num_paths: int, top_k: int, capacity_factor: float) -> int:
    """Most documents one shard may hold: ``ceil(capacity_factor * N * top_k / P)``."""
    return max(1, math.ceil(capacity_factor * num_docs * top_k / num_paths - 1e-9))


def path_capacities(costs: np.ndarray, top_k: int, capacity_factor: float, balance: str = "hard",
                    soft_capacity_factor: float = 2.0) -> np.ndarray:
    """Most documents each path may hold, int64 ``[P]`` (see the module docstring)."""
    n, p = costs.shape
    cap = capacity_per_path(n, p, top_k, capacity_factor)
    if balance == "hard":
        return np.full(p, cap, np.int64)
    ceiling = capacity_per_path(n, p, top_k, soft_capacity_factor)
    natural = np.bincount(np.argsort(costs, axis=1, kind="stable")[:, :top_k].ravel(), minlength=p)
    return np.clip(natural, cap, ceiling).astype(np.int64)


def balanced_assign(costs: np.ndarray, *, top_k: int = 1, capacity_factor: float = 1.25, balance: str = "hard",
                    soft_capacity_factor: float = 2.0) -> list[list[int]]:
    """Each row's ``top_k`` distinct paths (best first by cost) under per-shard capacity.

    Raises ValueError when ``top_k`` is not in [1, P], ``capacity_factor < 1``, ``balance``
    is not one of :data:`BALANCES` or (soft) ``soft_capacity_factor < capacity_factor``.
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
    if balance not in BALANCES:
        raise ValueError(f"balance must be one of {BALANCES}, got {balance!r}")
    if balance == "soft" and not soft_capacity_factor >= capacity_factor:
        raise ValueError(f"soft_capacity_factor ({soft_capacity_factor}) must be >= capacity_factor "
                         f"({capacity_factor})")
    if n == 0:
        return []
    cap = path_capacities(costs, top_k, capacity_factor, balance, soft_capacity_factor)
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
                if load[path] < cap[path] and path not in held:
                    held.append(path)
                    load[path] += 1
                    break
            else:
                _make_room(costs, pref[i], chosen, load, i, cap)
    # No shard below half the mean (hard) or mean / soft_capacity_factor (soft, the mirror
    # of its ceiling): a cell nobody prefers must still get enough data to train.
    fraction = HARD_FLOOR if balance == "hard" else 1.0 / soft_capacity_factor
    floor = np.full(p, max(1, math.floor(n * top_k / p * fraction + 1e-9)), np.int64)
    _fill_to_floor(costs, chosen, load, floor)
    # Report paths best first by cost, whatever order the rounds produced.
    return [sorted(h, key=lambda q, row=costs[i]: (row[q], q)) for i, h in enumerate(chosen)]


def _make_room(costs: np.ndarray, pref_i: np.ndarray, chosen: list[list[int]], load: np.ndarray, i: int,
               cap: np.ndarray) -> None:
    """Document ``i`` finds room only on paths it already holds (possible with top_k > 1).

    Total room suffices (``sum(cap) >= N * top_k``), so some path ``q`` it holds has room
    and every path it lacks is full. With equal capacities its best missing path ``q2``
    has ``cap`` holders, not all of whom can hold ``q`` too (``q`` would then be over
    capacity): the holder ``j`` that moves ``q2 → q`` at the least cost makes the room,
    and ``i`` takes ``q2``. Unequal (soft) capacities try the next missing paths, then
    let ``i`` join its best missing path one over capacity.
    """
    held = chosen[i]
    missing = [q for q in pref_i.tolist() if q not in held]
    best = None
    for q2 in missing:
        for q in (q for q in held if load[q] < cap[q]):
            for j, other in enumerate(chosen):
                if q2 in other and q not in other:
                    delta = costs[j, q] - costs[j, q2]
                    if best is None or delta < best[0]:
                        best = (delta, j, q)
        if best is not None:
            break
    if best is None:
        if (cap == cap[0]).all():  # impossible with equal capacities (see above); a loud guard
            raise RuntimeError("balanced_assign ran out of room; this is a bug")
        held.append(missing[0])
        load[missing[0]] += 1
        return
    _, j, q = best
    chosen[j][chosen[j].index(q2)] = q
    load[q] += 1
    held.append(q2)  # q2's load is unchanged: j left it, i joined it


def _fill_to_floor(costs: np.ndarray, chosen: list[list[int]], load: np.ndarray, floor: np.ndarray) -> None:
    """Bring every path up to ``floor[path]`` documents with its nearest documents that can
    move without taking their donor shard below its own floor (the largest donor gives)."""
    for path in np.flatnonzero(load < floor).tolist():
        for i in np.argsort(costs[:, path], kind="stable").tolist():
            if load[path] >= floor[path]:
                break
            held = chosen[i]
            if path in held:
                continue
            donors = [q for q in held if load[q] > floor[q]]
            if not donors:
                continue
            give_up = max(donors, key=lambda q: (load[q], costs[i, q]))
            held[held.index(give_up)] = path
            load[give_up] -= 1
            load[path] += 1


__all__ = ["BALANCES", "HARD_FLOOR", "balanced_assign", "capacity_per_path", "path_capacities"]
