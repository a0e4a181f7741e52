"""Which of a path's updates are alternatives to each other, and how a late one lands.

A decoupled worker starts each phase of path p from the module's version it pulls. If
that version does not contain the path's previous update (the pull stopped waiting for
it), the new phase is a second displacement from the same point as the previous one,
not an increment on it: the two are *alternatives*. Precisely, an update's **anchor** is
the latest phase of its own path that was applied at or before the version it started
from (-1: none); updates of one path with the same anchor are alternatives.

Alternatives pending together already count as one contributor with the mean of their
contributions (:mod:`dipaco.decoupled.merge`). This module makes the outcome independent
of *when* they land: if an alternative arrives after its siblings were applied, the step
applies only the difference between the mean of all of them and what was applied, so the
module ends where applying them all at once would have put it (the staleness discount of
that first application carries over), not a second full move past it. On the toy of
``tests/test_sync_decoupled.py``: two alternatives of Δ = −0.9 from θ = 0 (lr 1) give
θ = 0.9 whether they land in one step or two; stepping the late one in full gave 1.536.

Memory: per module, the applied mean of each sharing path's latest group (one flat
vector per path; a full-quorum step's pending updates hold as much). It lives in the
synchroniser's memory only: a restarted synchroniser has none, so an alternative landing
right after a restart is merged as a fresh update (its staleness discount damps it).
An alternative older than its path's latest applied group (files listed out of order)
is merged as fresh as well.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

__all__ = ["Alternatives", "Applied"]


@dataclass
class Applied:
    """What one path's latest group of alternatives moved the module by (the numerator of
    the steps that applied them): ``mean`` = Σ dᵢ·cᵢ / n over its n members."""

    anchor: int
    n: int
    mean: torch.Tensor
    discount: float  # the staleness discount of their first application

    def correction(self, contributions: Sequence[torch.Tensor]) -> torch.Tensor:
        """What k late members add to the numerator so that the group's total becomes the
        mean of all n + k members (each with this group's discount)."""
        k = len(contributions)
        total = contributions[0].clone()
        for c in contributions[1:]:
            total += c
        return (total * self.discount - self.mean * k) / (self.n + k)

    def absorb(self, contributions: Sequence[torch.Tensor]) -> None:
        """Count k late members in (after :meth:`correction` was applied)."""
        self.mean = self.mean + self.correction(contributions)
        self.n += len(contributions)


class Alternatives:
    """Anchors and applied groups of one module's sharing paths (see the module doc)."""

    def __init__(self) -> None:
        self._own: dict[int, list[tuple[int, int]]] = {}  # path → [(version applied, phase)], ascending
        self._latest: dict[int, Applied] = {}  # path → its latest applied group

    def rebuild(self, phases: dict[str, str], applied: dict[str, int]) -> None:
        """The anchors from a ledger (``"path:phase" → id``, ``id → version``); no groups."""
        self._own, self._latest = {}, {}
        for slot, uid in phases.items():
            if uid in applied:
                path, phase = (int(x) for x in slot.split(":"))
                self.note_applied(path, phase, applied[uid])

    def note_applied(self, path: int, phase: int, version: int) -> None:
        """Phase ``phase`` of ``path`` went into ``version`` of the module."""
        bisect.insort(self._own.setdefault(path, []), (int(version), int(phase)))

    def anchor(self, path: int, base_version: int) -> int:
        """The latest phase of ``path`` applied at or before ``base_version`` (-1: none)."""
        own = self._own.get(path, [])
        i = bisect.bisect_right(own, (int(base_version), float("inf")))
        return max((phase for _, phase in own[:i]), default=-1)

    def prior(self, path: int, anchor: int) -> Optional[Applied]:
        """The applied group these updates are late alternatives to, if any."""
        got = self._latest.get(path)
        return got if got is not None and got.anchor == anchor else None

    def record(self, path: int, anchor: int, contributions: Sequence[torch.Tensor],
               discounts: Sequence[float]) -> None:
        """A group of ``path`` (members' contributions and staleness discounts) was applied."""
        prior = self.prior(path, anchor)
        if prior is not None:
            prior.absorb(contributions)
            return
        latest = self._latest.get(path)
        if latest is not None and latest.anchor > anchor:
            return  # an old alternative that landed late and out of order: keep the newer group
        k = len(contributions)
        if k == 1 and discounts[0] == 1.0:
            mean = contributions[0]  # the common case: no copy
        else:
            mean = sum(c * d for c, d in zip(contributions, discounts)) / k
        self._latest[path] = Applied(anchor, k, mean, sum(discounts) / k)
