"""The round's one schedule type: after which inner step each module launches its
exchange and after which its new global weights land.

Every round of every sync mode is a :class:`RoundSchedule`:

* the synchronous round (DiLoCo's; :meth:`RoundSchedule.synchronous`): every module
  launches and lands after step H, so a path's turn is one segment of H inner steps;
* streaming's staggered round (:func:`dipaco.plan.stagger.streaming_schedule`): fragments
  launch at their own steps and land τ steps later, so the turns are cut at those steps
  (:meth:`boundaries`);
* streaming's final round is synchronous again (:meth:`RoundSchedule.of_round`).

A landing *replaces* the live weights by the new global ones when the exchange overlapped
no inner step (launch = land: nothing was learnt meanwhile) and *mixes* them in
otherwise (``diloco.streaming_mix``). Pure Python: the round driver
(:mod:`dipaco.sync.round_driver`) runs it, and the planner's bytes in flight
(:func:`dipaco.plan.stagger.inflight_peak`) and the simulator (:mod:`dipaco.sim.modes`)
read its :meth:`~RoundSchedule.fragments`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

__all__ = ["Fragment", "RoundSchedule", "SyncPoint"]


@dataclass(frozen=True)
class SyncPoint:
    """When one module syncs within a round of H inner steps."""

    launch: int  # after this inner step of the round (1..H) the module's exchange starts
    land: int  # after this inner step its new global weights land (launch ≤ land ≤ H)

    @property
    def replaces(self) -> bool:
        """The landing replaces the live weights: the exchange overlapped no inner step."""
        return self.launch == self.land


@dataclass(frozen=True)
class Fragment:
    """The modules that share one sync point: they launch together and land together."""

    launch: int
    land: int
    modules: tuple[str, ...]  # in the global module order


class RoundSchedule:
    """Every module's :class:`SyncPoint` in a round of ``inner_steps`` inner steps.

    Args:
        inner_steps: H, the inner steps of a round.
        points: the sync point of every module, in the global module order (the order
            modules are launched and landed in at one step, on every rank).
    """

    def __init__(self, inner_steps: int, points: Mapping[str, SyncPoint]) -> None:
        self.inner_steps = int(inner_steps)
        if self.inner_steps < 1:
            raise ValueError(f"a round has H >= 1 inner steps, got {inner_steps}")
        for m, pt in points.items():
            if not 1 <= pt.launch <= pt.land <= self.inner_steps:
                raise ValueError(f"module {m!r}: sync point {pt} must have 1 <= launch <= land <= H = {self.inner_steps}")
        self.points = dict(points)

    @classmethod
    def synchronous(cls, module_ids: Sequence[str], inner_steps: int) -> "RoundSchedule":
        """DiLoCo's round: every module launches and lands after step H."""
        H = int(inner_steps)
        return cls(H, {m: SyncPoint(H, H) for m in module_ids})

    def of_round(self, r: int, rounds: int) -> "RoundSchedule":
        """Round ``r``'s schedule (0-based) in a run of ``rounds``: this one, except that the
        run's last round is synchronous, so the final θ_global has every inner step in it."""
        if r == rounds - 1 and not self.is_synchronous:
            return RoundSchedule.synchronous(list(self.points), self.inner_steps)
        return self

    @property
    def is_synchronous(self) -> bool:
        """Whether every module launches and lands after the round's last inner step."""
        H = self.inner_steps
        return all(pt.launch == pt.land == H for pt in self.points.values())

    @property
    def replaces_only(self) -> bool:
        """Whether every landing replaces (τ = 0): then no path needs a copy of its own."""
        return all(pt.replaces for pt in self.points.values())

    def restrict(self, module_ids: Iterable[str]) -> "RoundSchedule":
        """The same schedule for the modules of ``module_ids`` only (global order kept)."""
        keep = set(module_ids)
        return RoundSchedule(self.inner_steps, {m: pt for m, pt in self.points.items() if m in keep})

    def boundaries(self) -> list[int]:
        """The steps the turns are cut at: every launch and landing step, and H, ascending."""
        return sorted({s for pt in self.points.values() for s in (pt.launch, pt.land)} | {self.inner_steps})

    def launching(self, step: int, modules: Iterable[str] | None = None) -> list[str]:
        """The modules (of ``modules``; default all) launching after ``step``, in the global order."""
        want = None if modules is None else set(modules)
        return [m for m, pt in self.points.items() if pt.launch == step and (want is None or m in want)]

    def fragments(self) -> list[Fragment]:
        """The modules of each sync point, in launch order (then landing order)."""
        by_point: dict[SyncPoint, list[str]] = {}
        for m, pt in self.points.items():
            by_point.setdefault(pt, []).append(m)
        return [Fragment(pt.launch, pt.land, tuple(ms))
                for pt, ms in sorted(by_point.items(), key=lambda kv: (kv[0].launch, kv[0].land))]
