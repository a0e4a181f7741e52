"""The simulator's sync modes, one small component each, built from the job by name
(:func:`make_mode`, as a codec is from its name): what a round's exchanges cost and what
a failure does (the round-based modes, run by :class:`dipaco.sim.rounds.RoundSim`), or
a clock of their own (decoupled, :mod:`dipaco.sim.decoupled`).

* **sync**: every module exchanged after the round's inner steps (the plan's bytes per
  rank, :mod:`dipaco.sim.job`), nothing overlapped; a failure rolls back to the checkpoint;
* **elastic** (``launcher.elastic``): sync's round; a lost group makes the survivors re-form;
* **streaming**: the fragments of the job's streaming schedule
  (:meth:`dipaco.plan.schedule.RoundSchedule.fragments`), each path's share of a fragment
  on the link from its launch step; the inner loop stands only when a fragment has not
  landed by its landing step; the link carries one fragment at a time, in launch order;
* **ddp**: one path data-parallel over every group: a gradient all-reduce each inner
  step, nothing overlapped; failures as in sync;
* **decoupled**: workers and synchronisers meeting through a store, with the trainer's
  own quorum and scheduling rules.
"""
from __future__ import annotations

from typing import Callable, ClassVar, Optional, Sequence

from dipaco.sim.decoupled import simulate_decoupled
from dipaco.sim.job import SimJob
from dipaco.sim.rounds import RoundSim
from dipaco.sim.tally import ModeResult

__all__ = ["MODES", "Mode", "make_mode", "simulate_mode"]

#: simulated seconds of decoupled mode when its workers stand for many groups each
STATIONARY_S = 600.0


class Mode:
    """A simulated mode of ``job``: its horizon, its events per round, its simulation."""

    name: ClassVar[str]
    elastic: ClassVar[bool] = False

    def __init__(self, job: SimJob) -> None:
        self.job = job
        self.path_bytes = job.rank_bytes()  # the most one rank sends for a path's modules

    @property
    def phases(self) -> int:
        """Events drawn per round of compute (:mod:`dipaco.sim.cost`)."""
        return 1

    def horizon_s(self) -> Optional[float]:
        """Simulated seconds (None: until the config's rounds are applied)."""
        h = self.job.cluster.horizon_hours
        return None if h is None else h * 3600.0

    def path_steps(self, groups_up: int) -> float:
        """Path inner steps a round runs: every path's H (groups train theirs in turn)."""
        return float(max(groups_up, self.job.paths) * self.job.inner_steps)

    def exchange(self, step_s: float) -> tuple[float, float]:
        """``(exposed seconds, bytes one rank sends)`` of a round: the path's modules at once."""
        return self.job.transfer_s(self.path_bytes), self.path_bytes

    def simulate(self, horizon_s: Optional[float], failures_at: Optional[Sequence[float]] = None) -> ModeResult:
        """Until ``horizon_s`` (None: the config's rounds applied); ``failures_at``: failures at
        these seconds instead of the cluster's drawn ones."""
        return RoundSim(self.job, self, horizon_s, failures_at).run()


class Sync(Mode):
    name = "sync"


class Elastic(Mode):
    name = "elastic"
    elastic = True


class Streaming(Mode):
    """A path's share of each fragment on the link from the fragment's launch step (module doc)."""

    name = "streaming"

    def __init__(self, job: SimJob) -> None:
        super().__init__(job)
        frags = job.streaming.fragments()
        # each path's share of the round: per fragment, the bytes of its modules there (their
        # sum is what the path's round sends); paths alike in that are simulated once
        self.shares = sorted({tuple((f.launch, f.land, sum(job.module_bytes[m] for m in f.modules if m in pm))
                                    for f in frags) for pm in job.path_modules})
        self._timed = [[(a, b, job.transfer_s(n)) for a, b, n in share] for share in self.shares]

    def exchange(self, step_s: float) -> tuple[float, float]:
        return max(self.stall(share, step_s) for share in self._timed), self.path_bytes

    @staticmethod
    def stall(fragments: Sequence[tuple[int, int, float]], step_s: float) -> float:
        """Seconds the inner loop stands for ``(launch, land, seconds on the link)`` fragments:
        a fragment starts at its launch (once the link is free) and stalls the steps by what
        its transfer outlasts its landing step (exactly its transfer when launch = land)."""
        stall = link_free = 0.0
        for a, b, seconds in fragments:
            ready = a * step_s + stall
            start = max(ready, link_free)
            link_free = start + seconds
            stall += max(0.0, (start - ready) + seconds - (b - a) * step_s)
        return stall


class DDP(Mode):
    name = "ddp"

    def path_steps(self, groups_up: int) -> float:
        return float(groups_up * self.job.inner_steps)  # one path over every group

    def exchange(self, step_s: float) -> tuple[float, float]:
        H, per_step = self.job.inner_steps, self.job.ddp_rank_bytes_per_step
        return H * self.job.transfer_s(per_step), H * per_step


class Decoupled(Mode):
    name = "decoupled"

    @property
    def phases(self) -> int:
        return self.job.workers  # a phase per worker

    def horizon_s(self) -> Optional[float]:
        # a decoupled worker standing for many groups folds their failures into each phase: its
        # goodput is a stationary rate, and ten simulated minutes measure it (a week of phases
        # of 256 workers would be millions of events)
        horizon, job = super().horizon_s(), self.job
        return horizon if job.groups <= job.workers or horizon is None else min(horizon, STATIONARY_S)

    def simulate(self, horizon_s: Optional[float], failures_at: Optional[Sequence[float]] = None) -> ModeResult:
        if failures_at is not None:
            raise ValueError("decoupled mode draws its failures; it takes no failure times")
        return simulate_decoupled(self.job, horizon_s)


#: every mode the simulator knows, in the order the table prints them
MODES: dict[str, Callable[[SimJob], Mode]] = {m.name: m for m in (Sync, Elastic, Streaming, Decoupled, DDP)}


def make_mode(name: str, job: SimJob) -> Mode:
    """The mode ``name`` of ``job`` (one of :data:`MODES`)."""
    if name not in MODES:
        raise ValueError(f"unknown simulated mode {name!r}: choose from {', '.join(MODES)}")
    return MODES[name](job)


def simulate_mode(job: SimJob, name: str, horizon_s: Optional[float] = None,
                  failures_at: Optional[Sequence[float]] = None) -> ModeResult:
    """Simulate mode ``name`` of ``job`` until ``horizon_s`` (None: the config's rounds applied)."""
    return make_mode(name, job).simulate(horizon_s, failures_at)
