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
from typing import Any, Optional, Sequence

import torch

__all__ = ["Alternatives", "Applied", "MergeGroups"]


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


@dataclass
class MergeGroups:
    """How one outer step of :class:`dipaco.decoupled.merge.MergingModuleSync` weighs its
    updates: staleness and discount per update, each path's alternatives (updates with the
    same anchor) as one group, with the applied group it is late to, if any."""

    updates: list[Any]  # dipaco.decoupled.merge.Update, in (path, phase) order
    staleness: list[int]  # versions behind
    discounts: list[float]  # d(r), r: rounds late
    keys: list[tuple[int, int]]  # (path, anchor) of each update
    groups: dict[tuple[int, int], list[int]]  # (path, anchor) → indices of its updates
    prior: dict[tuple[int, int], Optional[Applied]]  # the group applied before, for late ones

    @classmethod
    def weigh(cls, updates: list[Any], version: int, alternatives: Alternatives) -> "MergeGroups":
        """The groups of ``updates`` at module version ``version`` (discounts: all 1, until
        the synchroniser sets them)."""
        keys = [(u.path_id, alternatives.anchor(u.path_id, u.base_version)) for u in updates]
        groups: dict[tuple[int, int], list[int]] = {}
        for i, key in enumerate(keys):
            groups.setdefault(key, []).append(i)
        return cls(updates, [version - u.base_version for u in updates], [1.0] * len(updates), keys, groups,
                   {key: alternatives.prior(*key) for key in groups})

    def size(self, i: int) -> int:
        """n_u: how many pending alternatives share update ``i``'s contributor weight."""
        return len(self.groups[self.keys[i]])

    def all_late(self) -> bool:
        """Every group is late to one applied before (the step is a correction)."""
        return all(self.prior[k] is not None for k in self.groups)

    def weights(self) -> list[float]:
        """α·d(s)/n per update, as the step record logs it (a late one: its group's)."""
        out = []
        for i, u in enumerate(self.updates):
            prior, k = self.prior[self.keys[i]], self.size(i)
            out.append(float(u.tokens) * self.discounts[i] / k if prior is None
                       else float(u.tokens) * prior.discount / (prior.n + k))
        return out

    def alpha_sum(self) -> float:
        """Σ α_u / n_u: one contributor's tokens per path's group of alternatives."""
        total = 0.0
        for i, u in enumerate(self.updates):
            k = self.size(i)
            total += float(u.tokens) if k == 1 else float(u.tokens) / k
        return total

    def numerator(self, contribs: list[torch.Tensor], numel: int) -> torch.Tensor:
        """Σ d(s_u)·α_u·Δ_u / n_u in update order; a late group adds its correction."""
        g = torch.zeros(numel, dtype=torch.float32)
        for i, key in enumerate(self.keys):
            prior = self.prior[key]
            if prior is None:
                d = self.discounts[i] / self.size(i)
                # (d == 1: no multiply, so a fresh full round is synchronous mode's sum bit for bit)
                g += contribs[i] if d == 1.0 else contribs[i] * d
            elif i == self.groups[key][0]:
                g += prior.correction([contribs[j] for j in self.groups[key]])
        return g
