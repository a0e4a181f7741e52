"""Decoupled mode on a SimPy clock: asynchronous workers and per-module synchronisers.

Each decoupled worker is a SimPy process: it leases a free unfinished path, waits for
the path's previous update to be accounted for (at most ``pull_wait_s``, and at most
``pull_wait_fraction`` of its phase), runs a phase of H inner steps (fewer for a slow
worker with ``dynamic_steps``), pushes the path's update (its modules' bytes over the
link) and offers it to each module's synchroniser. The synchroniser decides with the
trainer's own rules, :mod:`dipaco.decoupled.quorum` (quorum size, adaptive grace window,
the cap for finished paths, staleness drop, fill-time EMA): the same functions
:class:`dipaco.decoupled.merge.MergingModuleSync` calls, on the simulated clock. A
failure kills the phase in flight; the worker is back ``detect_s + restart_s`` later and
its path's lease frees after ``lease_s``.

Path choice, phase length and the pull wait are the trainer's own
:class:`dipaco.decoupled.scheduling.PathPicker`, one per worker as in the trainer (the
least advanced free path; a markedly slow worker takes the most advanced one and, with
dynamic steps, ``H / slowness`` steps), with the slowness known after its first phase.
With more worker groups than workers (10^6 chips) a worker stands for ``k`` groups: a
failure loses one group's share of its phase and the group's restart time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Optional

import simpy

from dipaco.config.decoupled import DecoupledConfig
from dipaco.decoupled import quorum as rules
from dipaco.decoupled.scheduling import PathPicker
from dipaco.sim.faults import Faults
from dipaco.sim.job import SimJob
from dipaco.sim.tally import ModeResult, Tally, result

__all__ = ["ModuleState", "Synchronizers", "simulate_decoupled"]


@dataclass
class ModuleState:
    """One module's synchroniser as the rules see it: versions, pending updates, EMAs."""

    module_id: str
    sharing: list[int]
    quorum: int
    version: int = 0
    pending: list[tuple[int, int, Any]] = field(default_factory=list)  # (path, base version, steps)
    first_pending_at: Optional[float] = None
    fill_ema: Optional[float] = None
    phase_ema: Optional[float] = None  # seconds of a phase (the grace window's scale)
    grace_armed: bool = False
    steps: list[tuple] = field(default_factory=list)  # each outer step: (time, trigger, paths, version)


class Synchronizers:
    """Every module's synchroniser on one SimPy clock, deciding with
    :mod:`dipaco.decoupled.quorum` (the trainer's rules); ``on_account(path)`` when one of a
    path's updates is applied or dropped, ``on_apply(path, steps, now)`` when applied."""

    def __init__(self, env: simpy.Environment, cfg: DecoupledConfig, sharing: dict[str, list[int]],
                 on_account: Callable[[int], None], on_apply: Callable[[int, Any, float], None]) -> None:
        self.env, self.d = env, cfg
        self.modules = {m: ModuleState(m, ps, rules.quorum_size(cfg.quorum, len(ps))) for m, ps in sharing.items()}
        self.done_paths: set[int] = set()
        self.on_account, self.on_apply = on_account, on_apply

    def offer(self, module_id: str, path: int, base: int, steps: Any, phase_s: Optional[float] = None) -> None:
        """An update of ``path`` started from version ``base`` arrives now (``steps``: what
        ``on_apply`` is given when it is applied; ``phase_s``: its phase's seconds)."""
        mod = self.modules[module_id]
        if rules.is_stale(mod.version, base, self.d.max_staleness):
            self.on_account(path)
            return
        mod.pending.append((path, base, steps))
        mod.phase_ema = rules.next_phase_ema(mod.phase_ema, phase_s)
        if mod.first_pending_at is None:
            mod.first_pending_at = self.env.now
        self.check(mod)

    def check(self, mod: ModuleState, flush: bool = False, deadline: Optional[float] = None) -> None:
        """Step ``mod`` if a step is due now (or ``flush``); else arm its grace timer.
        ``deadline``: the grace expiry a timer fired for (the clock reads it, not a float
        a rounding short of it)."""
        now = self.env.now
        grace = rules.grace_window(self.d, mod.fill_ema, mod.phase_ema, mod.quorum, len(mod.sharing))
        # (first + grace) - first can round a hair below grace: the fired timer reads its deadline plus 1 ns
        clock = now if deadline is None else max(now, deadline + 1e-9 * max(1.0, abs(deadline)))
        why = "flush" if flush and mod.pending else rules.step_due(
            {p for p, _, _ in mod.pending}, mod.sharing, mod.quorum, mod.first_pending_at, clock, grace,
            self.done_paths)
        if why is None:
            if mod.pending and not mod.grace_armed:
                mod.grace_armed = True
                first = float(mod.first_pending_at)
                self.env.process(self._grace(mod, first, first + grace))
            return
        if why == "quorum" and mod.first_pending_at is not None:
            mod.fill_ema = rules.next_fill_ema(mod.fill_ema, now - mod.first_pending_at)
        kept = [u for u in mod.pending if not rules.is_stale(mod.version, u[1], self.d.max_staleness)]
        pending, mod.pending, mod.first_pending_at = mod.pending, [], None
        if kept:
            mod.version += 1
            mod.steps.append((now, why, sorted(p for p, _, _ in kept), mod.version))
            for path, _, steps in kept:
                self.on_apply(path, steps, now)
        for path, _, _ in pending:
            self.on_account(path)

    def _grace(self, mod: ModuleState, first: float, deadline: float) -> Generator:
        yield self.env.timeout(max(0.0, deadline - self.env.now))
        mod.grace_armed = False
        if mod.pending:  # the window of the batch it was armed for, or a fresh look at a new batch
            self.check(mod, deadline=deadline if mod.first_pending_at == first else None)

    def flush(self) -> None:
        """The end of training: every pending update is stepped."""
        for mod in self.modules.values():
            if mod.pending:
                self.check(mod, flush=True)


class _DecoupledSim:
    def __init__(self, job: SimJob, horizon_s: Optional[float]) -> None:
        self.job, self.horizon_s, self.d = job, horizon_s, job.decoupled
        self.env = simpy.Environment()
        self.faults = Faults(job.cluster, job.groups, job.chips_per_group)
        H = job.inner_steps
        self.budget = math.inf if horizon_s is not None else float(job.rounds * H)
        self.k = job.groups / job.workers  # worker groups one simulated worker stands for
        self.tally = Tally(target_steps=float(job.paths * job.rounds * H) * self.k)
        sharing: dict[str, list[int]] = {}
        for p, mods in enumerate(job.path_modules[: job.paths]):
            for m in mods:
                sharing.setdefault(m, []).append(p)
        self.sync = Synchronizers(self.env, self.d, sharing, self._account, self._applied)
        self.modules = self.sync.modules
        self.done_paths = self.sync.done_paths
        self.progress = [0.0] * job.paths
        self.held: set[int] = set()
        self.unaccounted = [0] * job.paths  # modules still holding the path's last update
        self.accounted = [self.env.event().succeed() for _ in range(job.paths)]  # no update out yet
        self.slowness: list[Optional[float]] = [None] * job.workers
        self.pickers = [PathPicker(self.d, H, self.budget) for _ in range(job.workers)]
        self.window_end = 0.0  # the training window closes when the last phase ends (or is applied)
        self.in_phase = [False] * job.workers  # a failure kills a phase; a waiting worker only restarts
        self.procs = [self.env.process(self._worker(i)) for i in range(job.workers)]
        self.finished = self.env.event()
        self.env.process(self._failures())
        self.env.process(self._watch())

    def _applied(self, path: int, steps: Any, now: float) -> None:
        self.window_end = max(self.window_end, now)
        # a path's phase is applied module by module: each module carries its share
        n, factor = steps  # type: ignore[misc]  # the worker's (steps, straggler factor) of the phase
        self.tally.apply(n / len(self.job.path_modules[path]), now, factor)

    def _account(self, path: int) -> None:
        self.unaccounted[path] -= 1
        if self.unaccounted[path] <= 0 and not self.accounted[path].triggered:
            self.accounted[path].succeed()

    # ------------------------------------------------------------------ workers
    def _pick(self, i: int) -> Optional[int]:
        """The trainer's own choice (:meth:`PathPicker.candidates`) among the paths no worker holds."""
        others = self.job.step_s * self._others_factor(i)
        order = self.pickers[i].candidates(self.progress, self.slowness[i], self.job.workers - 1, others,
                                           self.env.now, lambda: 0.0)  # ties: the lowest path
        free = [p for p in order or [] if p not in self.held]
        if not free:
            return None
        self.pickers[i].took()
        return free[0]

    def _worker(self, i: int) -> Generator:
        job, c = self.job, self.job.cluster
        while True:
            path = self._pick(i)
            if path is None:
                if all(self.progress[p] >= self.budget for p in range(job.paths)):
                    return
                yield self.env.timeout(self.d.poll_s)
                continue
            self.held.add(path)
            n = self.pickers[i].phase_steps(self.budget - self.progress[path], self.slowness[i])
            if not self.accounted[path].triggered:  # pull wait
                cap = self.pickers[i].pull_wait_s(n * job.step_s * (self.slowness[i] or 1.0))
                yield self.accounted[path] | self.env.timeout(cap)
            base = {m: self.modules[m].version for m in job.path_modules[path]}
            factor = self.faults.factor(i)
            dur = n * job.step_s * factor
            start = self.env.now
            self.in_phase[i] = True
            try:
                yield self.env.timeout(dur)
                push = job.transfer_s(job.rank_bytes(list(job.path_modules[path])))
                yield self.env.timeout(push)
                self.tally.exposed_s += push / job.workers  # per worker: the share of each one's wall
            except simpy.Interrupt:
                self.in_phase[i] = False
                self.tally.failures += 1
                self.tally.executed_steps += n * self.k * min(1.0, (self.env.now - start) / dur)
                self.env.process(self._release(path, max(c.detect_s, self.d.lease_s)))
                yield self.env.timeout(c.detect_s + c.restart_s)
                continue
            self.in_phase[i] = False
            self.window_end = self.env.now
            # the slowness this worker publishes (its seconds per step against the others')
            self.slowness[i] = factor / max(1e-12, self._others_factor(i))
            self.progress[path] += n
            self.held.discard(path)
            self.pickers[i].held(path)
            if self.progress[path] >= self.budget:
                self.done_paths.add(path)
            steps = n * self.k * (1.0 - self._lost_share(dur))
            self.tally.executed_steps += n * self.k
            self.tally.bytes += job.rank_bytes(list(job.path_modules[path])) * job.ranks_per_group * self.k
            self.accounted[path] = self.env.event()
            self.unaccounted[path] = len(job.path_modules[path])
            for m in job.path_modules[path]:
                self.sync.offer(m, path, base[m], (steps, factor), dur)

    def _others_factor(self, i: int) -> float:
        c = self.job.cluster
        others = [c.slow_factor if j < c.slow_groups else 1.0 for j in range(self.job.workers) if j != i]
        others.sort()
        return others[len(others) // 2] if others else 1.0

    def _lost_share(self, dur: float) -> float:
        """Aggregated workers (k > 1): the share of a phase its groups' failures cost."""
        if self.k <= 1:
            return 0.0
        c = self.job.cluster
        fails = self.faults.failure_rate(int(round(self.k))) * dur
        lost = fails * (0.5 * dur + c.detect_s + c.restart_s) / max(dur, 1e-12) / self.k
        self.tally.failures += int(self.faults.rng.poisson(fails))
        return min(1.0, lost)

    def _release(self, path: int, after: float) -> Generator:
        yield self.env.timeout(after)
        self.held.discard(path)

    def _failures(self) -> Generator:
        if self.k > 1:
            return  # aggregated workers: failures are a share of each phase (_lost_share)
        while True:
            wait = self.faults.next_failure_in()
            if math.isinf(wait):
                return
            yield self.env.timeout(wait)
            w = self.faults.failed_group() % self.job.workers
            if self.in_phase[w] and not self.finished.triggered:
                self.procs[w].interrupt("failure")
            else:
                self.tally.failures += 1

    def _watch(self) -> Generator:
        """The end: every worker stopped; pending updates are flushed (the real supervisor's
        last step), and the training window closes."""
        yield simpy.AllOf(self.env, self.procs)
        self.sync.flush()
        self.finished.succeed()

    def run(self) -> ModeResult:
        self.env.run(until=self.finished if self.horizon_s is None else self.horizon_s)
        job = self.job
        wall = float(self.env.now) if self.horizon_s is not None else self.window_end
        return result("decoupled", self.tally, wall, job.chips, job.step_s * job.chips_per_group,
                      job.tokens_per_step, rounds=max(1, round(max(self.progress) / job.inner_steps)))


def simulate_decoupled(job: SimJob, horizon_s: Optional[float] = None) -> ModeResult:
    """Simulate decoupled mode until ``horizon_s`` (None: every path's budget applied)."""
    return _DecoupledSim(job, horizon_s).run()
