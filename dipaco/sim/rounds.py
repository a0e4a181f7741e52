"""The round-based modes on a SimPy clock: a :class:`RoundSim` runs rounds of one
:class:`RoundMode` (sync, elastic, streaming, DDP: :mod:`dipaco.sim.modes`) until the
budget or the horizon.

One SimPy process trains round after round; another draws the cluster's failures and
interrupts it (:class:`simpy.Interrupt`). Rounds between two events are drawn as one
block (their straggler factors drawn one by one), so a simulated week costs events in
proportion to failures and blocks, not to rounds or chips. A round
(:class:`RoundCost`): the busiest worker group trains its paths in turn (paths dealt
round-robin, :mod:`dipaco.plan.topology`) and every group waits for the slowest; the mode
says what its exchanges expose and send. A failure rolls the job back to its last
checkpoint (``trainer.checkpoint_every`` rounds) and costs ``detect_s + restart_s``; in an
elastic mode the survivors re-form instead (``detect_s + rendezvous_s``) and go on from
the last round with the paths re-dealt over fewer groups, the group rejoining
``restart_s`` later at a round boundary (another rendezvous).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import ClassVar, Generator, Optional, Protocol, Sequence

import simpy

from dipaco.sim.faults import Faults
from dipaco.sim.job import SimJob
from dipaco.sim.tally import ModeResult, Tally, result

__all__ = ["RoundCost", "RoundMode", "RoundSim"]

_BLOCK = 512  # rounds drawn at once between events


@dataclass(frozen=True)
class RoundCost:
    """What one simulated round cost."""

    seconds: float  # wall: the inner steps and what the link exposed
    exposed: float  # the inner loop stood for the link
    bytes: float  # every rank's, together
    steps: float  # path inner steps run
    factor: float  # their mean straggler factor


class RoundMode(Protocol):
    """What :class:`RoundSim` asks of a round-based mode (:mod:`dipaco.sim.modes`)."""

    name: ClassVar[str]
    elastic: ClassVar[bool]  # a lost group makes the survivors re-form (else: roll back)

    def path_steps(self, groups_up: int) -> float:
        """Path inner steps a round runs with ``groups_up`` groups."""

    def exchange(self, step_s: float) -> tuple[float, float]:
        """``(exposed seconds, bytes one rank sends)`` of a round of ``step_s``-second steps."""


class RoundSim:
    """One round-based mode on one SimPy environment (module doc)."""

    def __init__(self, job: SimJob, mode: RoundMode, horizon_s: Optional[float],
                 failures_at: Optional[Sequence[float]] = None) -> None:
        self.job, self.mode, self.horizon_s = job, mode, horizon_s
        self.script = None if failures_at is None else sorted(float(t) for t in failures_at)
        self.env = simpy.Environment()
        self.faults = Faults(job.cluster, job.groups, job.chips_per_group)
        H = job.inner_steps
        self.tally = Tally(target_steps=float(job.paths * job.rounds * H))
        self.groups_up = job.groups
        self.rejoins = 0  # elastic: groups back and waiting for a round boundary
        self.recovering = False
        self.committed: list[tuple[float, float]] = []  # (steps, factor) of each round since the last checkpoint
        self.rounds_done = 0
        self.block: Optional[tuple[float, list[float], list[RoundCost]]] = None
        self.finished = self.env.event()
        self.trainer = self.env.process(self._train())
        self.env.process(self._failures())

    # ------------------------------------------------------------------ one round
    def _round(self) -> RoundCost:
        """The next round's cost."""
        job, up = self.job, self.groups_up
        nominal = job.step_s * job.path_load(up)
        step = nominal * self.faults.slowest(up)
        ranks = max(1, min(up, job.plan_groups)) * job.ranks_per_group
        exposed, rank_bytes = self.mode.exchange(step)
        # a group's steps are busy at most as long as the round's slowest group: the mean
        # factor of a heavy tail (lognormal, large sigma) can exceed the draw, and goodput 1
        slowest = step / max(nominal, 1e-300)
        return RoundCost(job.inner_steps * step + exposed, exposed, rank_bytes * ranks, self.mode.path_steps(up),
                         min(self.faults.mean_factor(up), slowest))

    # ------------------------------------------------------------------ accounting
    def _commit(self, rounds: list[RoundCost]) -> None:
        t = self.tally
        for r in rounds:
            t.exposed_s += r.exposed
            t.bytes += r.bytes
            t.executed_steps += r.steps
            t.rounds += 1
            self.rounds_done += 1
            self.committed.append((r.steps, r.factor))
            if self.mode.elastic or self.rounds_done % self.job.checkpoint_every == 0:
                self.committed = []  # elastic: every round is committed (the survivors go on from it)
            t.apply(r.steps, self.env.now, r.factor)

    def _rollback(self) -> None:
        """A failure: the rounds since the last checkpoint are lost (sync, streaming, ddp)."""
        lost = self.committed
        self.tally.applied_steps -= sum(n for n, _ in lost)
        self.tally.applied_busy -= sum(n * f for n, f in lost)
        self.tally.rounds -= len(lost)
        self.rounds_done -= len(lost)
        self.committed = []

    def _done(self) -> bool:
        return self.horizon_s is None and self.tally.applied_steps >= self.tally.target_steps - 1e-9

    # ------------------------------------------------------------------ processes
    def _train(self) -> Generator:
        while not self._done():
            if self.groups_up == 0:  # every group is down (elastic): wait for one to rejoin
                yield self.env.timeout(self.job.cluster.restart_s)
                self.groups_up, self.rejoins = self.rejoins, 0
                continue
            left = self.tally.target_steps - self.tally.applied_steps
            rounds: list[RoundCost] = []
            while len(rounds) < _BLOCK and (self.horizon_s is not None or left > 0):
                rounds.append(self._round())
                left -= rounds[-1].steps
            cum = [0.0]
            for r in rounds:
                cum.append(cum[-1] + r.seconds)
            self.block = (self.env.now, cum, rounds)
            try:
                yield self.env.timeout(cum[-1])
                self._commit(rounds)
            except simpy.Interrupt as why:
                blk, self.block = self.block, None  # no further interrupt while this one is handled
                yield from self._interrupted(str(why.cause), blk)
            self.block = None
            if self.rejoins and self.mode.elastic:
                yield from self._recover(self.job.cluster.rendezvous_s)
                self.groups_up, self.rejoins = self.groups_up + self.rejoins, 0
        self.finished.succeed()

    def _interrupted(self, cause: str, blk: tuple) -> Generator:
        start, cum, rounds = blk
        elapsed = self.env.now - start
        done = bisect.bisect_right(cum, elapsed + 1e-12) - 1
        self._commit(rounds[:done])  # the rounds that ended before the event
        c = self.job.cluster
        if cause == "rejoin":  # finish the round in flight, then re-form with the group
            if done < len(rounds):
                yield self.env.timeout(max(0.0, cum[done + 1] - elapsed))
                self._commit(rounds[done:done + 1])
            return
        partial = rounds[done].steps * (elapsed - cum[done]) / max(rounds[done].seconds, 1e-12) \
            if done < len(rounds) else 0
        self.tally.executed_steps += partial
        self.tally.failures += 1
        if self.mode.elastic:
            self.groups_up -= 1
            self.env.process(self._rejoin())
            yield from self._recover(c.detect_s + c.rendezvous_s)
        else:
            self._rollback()
            yield from self._recover(c.detect_s + c.restart_s)

    def _recover(self, seconds: float) -> Generator:
        self.recovering = True
        yield self.env.timeout(seconds)
        self.recovering = False

    def _rejoin(self) -> Generator:
        yield self.env.timeout(self.job.cluster.restart_s)
        self.rejoins += 1
        if self.block is not None and not self.recovering:
            self.trainer.interrupt("rejoin")

    def _failures(self) -> Generator:
        script = iter(self.script) if self.script is not None else None
        while True:
            up = self.groups_up if self.mode.elastic else self.job.groups
            if script is not None:  # failures at given times (tests)
                wait = next(script, math.inf) - self.env.now
            else:
                wait = self.faults.next_failure_in(max(1, up))
            if math.isinf(wait):
                return
            yield self.env.timeout(wait)
            if self.finished.triggered:
                return
            if self.recovering or self.block is None:
                # a failure while the job re-forms: one more group to replace, no extra rollback
                self.tally.failures += 1
                if self.mode.elastic and self.groups_up > 0:
                    self.groups_up -= 1
                    self.env.process(self._rejoin())
                continue
            self.trainer.interrupt("failure")

    def run(self) -> ModeResult:
        until = self.finished if self.horizon_s is None else self.horizon_s
        self.env.run(until=until)
        if self.block is not None and not self.finished.triggered:  # the horizon cut a block: keep its ended rounds
            start, cum, rounds = self.block
            self._commit(rounds[:bisect.bisect_right(cum, self.env.now - start + 1e-12) - 1])
        job = self.job
        return result(self.mode.name, self.tally, float(self.env.now), job.chips, job.step_s * job.chips_per_group,
                      job.tokens_per_step)

