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


# rows per batch of the [N, P] temporaries (argsort, float64 margins): they stay a few MB
_ROWS = 65_536


def _pref_dtype(p: int) -> np.dtype:
    """The narrowest signed int that holds every path id and -1."""
    return np.dtype(np.int8 if p < 2**7 else np.int16 if p < 2**15 else np.int32)


def preferences(costs: np.ndarray) -> np.ndarray:
    """Each row's paths from cheapest to dearest (stable: equal costs → lower path id
    first), computed in batches and stored in the narrowest int that holds a path id (int8
    up to 127 paths): 1 byte per document and path, not the 8 of an int64 argsort of the
    whole matrix."""
    n, p = costs.shape
    pref = np.empty((n, p), _pref_dtype(p))
    for lo in range(0, n, _ROWS):
        pref[lo:lo + _ROWS] = np.argsort(costs[lo:lo + _ROWS], axis=1, kind="stable")
    return pref


def path_capacities(costs: np.ndarray, top_k: int, capacity_factor: float, balance: str = "hard",
                    soft_capacity_factor: float = 2.0, pref: np.ndarray | None = None) -> np.ndarray:
    """Most documents each path may hold, int64 ``[P]`` (see the module docstring);
    ``pref``: :func:`preferences` of ``costs`` when already known."""
    n, p = costs.shape
    cap = capacity_per_path(n, p, top_k, capacity_factor)
    if balance == "hard":
        return np.full(p, cap, np.int64)
    ceiling = capacity_per_path(n, p, top_k, soft_capacity_factor)
    pref = preferences(costs) if pref is None else pref
    natural = np.bincount(pref[:, :top_k].ravel().astype(np.int64), minlength=p)
    return np.clip(natural, cap, ceiling).astype(np.int64)


def balanced_assign(costs: np.ndarray, *, top_k: int = 1, capacity_factor: float = 1.25, balance: str = "hard",
                    soft_capacity_factor: float = 2.0) -> list[list[int]]:
    """Each row's ``top_k`` distinct paths (best first by cost) under per-shard capacity.

    Raises ValueError when ``top_k`` is not in [1, P], ``capacity_factor < 1``, ``balance``
    is not one of :data:`BALANCES` or (soft) ``soft_capacity_factor < capacity_factor``.
    """
    return balanced_assign_array(costs, top_k=top_k, capacity_factor=capacity_factor, balance=balance,
                                 soft_capacity_factor=soft_capacity_factor).tolist()


def balanced_assign_array(costs: np.ndarray, *, top_k: int = 1, capacity_factor: float = 1.25,
                          balance: str = "hard", soft_capacity_factor: float = 2.0) -> np.ndarray:
    """:func:`balanced_assign` as an int array ``[N, top_k]`` (int8 up to 127 paths).

    What it keeps for all documents: ``costs`` as given (no float64 copy), the preference
    order (1 byte per document and path), a float64 margin and an int64 order per
    document and the result: O(paths) bytes per document, about 35 for a [4, 4] grid,
    so a million documents are assigned in ~35 MB beside their costs.
    """
    costs = np.asarray(costs)
    if costs.dtype.kind != "f":
        costs = costs.astype(np.float64)
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
    chosen = np.full((n, top_k), -1, _pref_dtype(p))
    if n == 0:
        return chosen
    # Preference order of each document (stable: equal costs → lower path id first).
    pref = preferences(costs)
    cap = path_capacities(costs, top_k, capacity_factor, balance, soft_capacity_factor, pref)
    margin = np.zeros(n)
    if p > 1:  # float64, as the costs were compared before: a float32 difference could reorder ties
        for lo in range(0, n, _ROWS):
            c = np.take_along_axis(costs[lo:lo + _ROWS], pref[lo:lo + _ROWS, :2].astype(np.int64), axis=1)
            margin[lo:lo + _ROWS] = c[:, 1].astype(np.float64) - c[:, 0].astype(np.float64)
    order = np.argsort(-margin, kind="stable")  # largest margin first, ties by lower index
    del margin
    load = [0] * p  # Python lists: the loop below reads them once per document
    room = cap.tolist()
    for r in range(top_k):
        column = chosen[:, r]
        for lo in range(0, n, _ROWS):  # the order in chunks: no list of N Python ints
            for i in order[lo:lo + _ROWS].tolist():
                held = chosen[i, :r].tolist() if r else ()
                for path in pref[i].tolist():
                    if load[path] < room[path] and path not in held:
                        column[i] = path
                        load[path] += 1
                        break
                else:
                    _make_room(costs, pref[i], chosen, r, load, i, room)
    # No shard below half the mean (hard) or mean / soft_capacity_factor (soft, the mirror
    # of its ceiling): a cell nobody prefers must still get enough data to train.
    fraction = HARD_FLOOR if balance == "hard" else 1.0 / soft_capacity_factor
    floor = np.full(p, max(1, math.floor(n * top_k / p * fraction + 1e-9)), np.int64)
    _fill_to_floor(costs, chosen, np.asarray(load, np.int64), floor)
    # Report paths best first by cost (ties: lower path id), whatever order the rounds produced.
    for lo in range(0, n, _ROWS):
        part = np.sort(chosen[lo:lo + _ROWS], axis=1)
        c = np.take_along_axis(costs[lo:lo + _ROWS], part.astype(np.int64), axis=1)
        chosen[lo:lo + _ROWS] = np.take_along_axis(part, np.argsort(c, axis=1, kind="stable"), axis=1)
    return chosen


def _make_room(costs: np.ndarray, pref_i: np.ndarray, chosen: np.ndarray, r: int, load: list[int], i: int,
               cap: list[int]) -> None:
    """Document ``i`` finds room in round ``r`` only on paths it already holds (possible
    with top_k > 1).

    Total room suffices (``sum(cap) >= N * top_k``), so some path ``q`` it holds has room
    and every path it lacks is full. With equal capacities its best missing path ``q2``
    has ``cap`` holders, not all of whom can hold ``q`` too (``q`` would then be over
    capacity): the holder ``j`` that moves ``q2 → q`` at the least cost makes the room,
    and ``i`` takes ``q2``. Unequal (soft) capacities try the next missing paths, then
    let ``i`` join its best missing path one over capacity. Candidates are found with one
    vectorised pass over ``chosen`` per (q2, q): the first ``j`` of least cost wins ties,
    then the first ``q`` in ``i``'s order.
    """
    held = chosen[i, :r].tolist()
    missing = [q for q in pref_i.tolist() if q not in held]
    best = None
    for q2 in missing:
        has_q2 = (chosen == q2).any(axis=1)
        for q in (q for q in held if load[q] < cap[q]):
            rows = np.flatnonzero(has_q2 & ~(chosen == q).any(axis=1))
            if rows.size:
                delta = costs[rows, q].astype(np.float64) - costs[rows, q2].astype(np.float64)
                k = int(np.argmin(delta))
                if best is None or delta[k] < best[0]:
                    best = (delta[k], int(rows[k]), q)
        if best is not None:
            break
    if best is None:
        if len(set(cap)) == 1:  # impossible with equal capacities (see above); a loud guard
            raise RuntimeError("balanced_assign ran out of room; this is a bug")
        chosen[i, r] = missing[0]
        load[missing[0]] += 1
        return
    _, j, q = best
    row = chosen[j]
    row[np.flatnonzero(row == q2)[0]] = q
    load[q] += 1
    chosen[i, r] = q2  # q2's load is unchanged: j left it, i joined it


def _fill_to_floor(costs: np.ndarray, chosen: np.ndarray, load: np.ndarray, floor: np.ndarray) -> None:
    """Bring every path up to ``floor[path]`` documents with its nearest documents that can
    move without taking their donor shard below its own floor (the largest donor gives)."""
    for path in np.flatnonzero(load < floor).tolist():
        for i in np.argsort(costs[:, path], kind="stable").tolist():
            if load[path] >= floor[path]:
                break
            held = chosen[i].tolist()
            if path in held:
                continue
            donors = [q for q in held if load[q] > floor[q]]
            if not donors:
                continue
            give_up = max(donors, key=lambda q: (load[q], costs[i, q]))
            chosen[i, held.index(give_up)] = path
            load[give_up] -= 1
            load[path] += 1


__all__ = ["BALANCES", "HARD_FLOOR", "balanced_assign", "balanced_assign_array", "capacity_per_path",
           "path_capacities", "preferences"]
