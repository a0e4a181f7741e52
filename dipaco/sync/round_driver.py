"""The one object that runs the rounds: a process's per-module syncs
(:class:`~dipaco.sync.diloco.DiLoCoSync`) by a :class:`~dipaco.plan.schedule.RoundSchedule`,
for every round of both sync schedules, in both backends.

The rounds loop (:func:`dipaco.rounds.loop.run_round`; tests and benchmarks drive it the
same way, with ``RoundSchedule.synchronous``) cuts every path's turn into segments that
end at the schedule's boundaries (one segment of H steps when synchronous)::

    driver = RoundDriver(DiLoCoSync(topology, modules, rank=...), schedule, rounds)
    for r in range(rounds):                      # the caller counts the rounds
        schedule = driver.begin_round(r)         # round r's schedule (the last synchronous)
        for step in schedule.boundaries():       # the launch and landing steps, then H
            for p in driver.paths:               # local: every path; torch: my group's
                driver.activate(p)               # p's own copy of its modules goes live
                ...inner steps up to `step`...
                driver.contribute(p, step, tokens, alpha)  # α·Δ of p's modules launching at `step`
            driver.sync_point(step)              # land, launch, land (collectives in torch)
        stats = driver.end_round()               # the live modules hold θ_global

A sync point (:meth:`sync_point`) is, in this order on every rank: the modules launched
earlier that land at the step; the modules launching at it, in the global module order
(:meth:`CollectiveModuleSync.launch`: encode, start the exchange; on the communication
thread with ``overlap``); those of them that land at once (launch = land), each right
after its own launch (one exchange in flight, as little memory as one module's sums) or,
with ``overlap``, after every launch, so outer steps run while later modules are still
being exchanged (docs/design.md contract 2).

Per-path copies. A landing that *replaces* (launch = land, τ = 0: DiLoCo's synchronous
round, streaming's final round) puts θ_global in every path's copy, so a path's copy is
dead once it has contributed: nothing is kept, and each turn begins from θ_global exactly
as in DiLoCo (no per-path copy, no extra memory or time). Under streaming with τ > 0 a
path keeps what it learnt while a module was in flight: the landing *mixes*,
``copy ← keep·copy + (1 − keep)·θ_global`` (``keep`` = ``diloco.streaming_mix``), into
each path's own copy of the module: the one in the live module (*resident*) or a flat
fp32 copy beside it; :meth:`activate` swaps copies only when another path used the
module since (never, with one path per worker group). Between rounds every copy is set
aside and the live modules hold θ_global (:meth:`end_round`), so checkpoints, early
stopping and the final evaluation read the global weights. α of a contribution is the
path's tokens since that module's previous launch (``diloco.alpha`` applied to them).

Checkpoints (:mod:`dipaco.rounds.checkpointing`): every exchange lands in the round it was
launched in (the last launch is at H − τ), so a round boundary never has one in flight.
What it holds under streaming is each path's copies and its tokens since each module's
last launch: :meth:`path_state` / :meth:`load_path_state`.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional, Sequence

import torch

from dipaco.plan.schedule import RoundSchedule
from dipaco.plan.stagger import inflight_peak
from dipaco.sync.diloco import DiLoCoSync
from dipaco.sync.module_core import flatten_params, load_flat
from dipaco.sync.module_sync import ModuleRoundStats, RoundStats

__all__ = ["RoundDriver", "wall_peak"]

TOKENS = ".tokens"


def wall_peak(intervals: Sequence[tuple[float, float, int]]) -> int:
    """The most bytes in flight at one instant: ``(start, end, bytes)`` intervals, an
    interval ending at the instant another starts not counted with it."""
    events = sorted([(a, 1, n) for a, _, n in intervals] + [(b, 0, -n) for _, b, n in intervals])
    now = peak = 0
    for _, _, n in events:
        now += n
        peak = max(peak, now)
    return peak


class RoundDriver:
    """The rounds of ``sync``'s modules by ``schedule`` (module doc).

    Args:
        sync: the per-module syncs of this process (``rank=None``: every worker group).
        schedule: the run's round schedule (:func:`dipaco.plan.build.build_schedule`);
            the same on every rank.
        rounds: the run's rounds, the last synchronous (:meth:`RoundSchedule.of_round`);
            None: every round by ``schedule``.
        keep: ``diloco.streaming_mix``, the share of a path's copy a mixing landing keeps.
        measure: report the bytes in flight and the time blocked on exchanges
            (``diloco.streaming``'s records; the synchronous run's say 0).
    """

    def __init__(self, sync: DiLoCoSync, schedule: RoundSchedule, rounds: Optional[int] = None,
                 keep: float = 0.5, measure: bool = False) -> None:
        missing = [m for m in sync.syncs if m not in schedule.points]
        if missing:
            raise ValueError(f"no sync point for modules {missing}")
        self.schedule = schedule.restrict(sync.syncs)
        if sync.sharded and not self.schedule.replaces_only:
            raise ValueError("streaming sync keeps per-path copies of unsharded modules; "
                             "launcher.group_parallel=fsdp is not supported")
        self.sync, self.syncs, self.rounds = sync, sync.syncs, rounds
        self.keep, self.measure = float(keep), bool(measure)
        topo = sync.topology
        self.paths = sync.paths_to_train()
        self.path_modules = {p: [m for m in self.syncs if m in topo.path_modules[p]] for p in self.paths}
        self.holders = {m: [p for p in self.paths if m in self.path_modules[p]] for m in self.syncs}
        self.copies: dict[tuple[int, str], torch.Tensor] = {}  # absent: the path's copy is θ_global
        self.since = {(p, m): 0 for p in self.paths for m in self.path_modules[p]}
        # the path whose copy the live module holds; None: θ_global, or a copy no path needs
        self.resident: dict[str, Optional[int]] = {m: None for m in self.syncs}
        self.round, self.current = 0, self.schedule  # the round begun last (the caller counts)
        self._landed: dict[str, ModuleRoundStats] = {}
        self._intervals: list[tuple[float, float, int]] = []
        self._bytes: dict[str, int] = {}
        self.blocked_s = 0.0  # time this round waited on exchanges not yet complete

    @classmethod
    def from_config(cls, sync: DiLoCoSync, d: Any, rounds: int, schedule: RoundSchedule) -> "RoundDriver":
        """From ``cfg.diloco`` (``d``: ``streaming_mix``, ``streaming``) and the run's schedule."""
        return cls(sync, schedule, rounds, keep=d.streaming_mix, measure=d.streaming)

    # ----------------------------------------------------------------- the round
    def begin_round(self, r: int) -> RoundSchedule:
        """Round ``r``'s schedule (0-based): the run's, its last round synchronous."""
        self.round = int(r)
        self.current = self.schedule if self.rounds is None else self.schedule.of_round(r, self.rounds)
        return self.current

    def in_flight(self) -> bool:
        """Whether an exchange of this process is launched and not landed."""
        return any(s.in_flight for s in self.syncs.values())

    def activate(self, p: int) -> None:
        """Put path ``p``'s copy of each of its modules into the live module."""
        for m in self.path_modules[p]:
            who = self.resident[m]
            if who == p:
                continue
            params = self.syncs[m].params
            if who is not None:  # another path's copy is live: set it aside
                self.copies[(who, m)] = flatten_params(params, params[0].device)
            if (p, m) in self.copies:
                load_flat(params, self.copies.pop((p, m)))
            else:
                self.syncs[m].restore()
            self.resident[m] = p

    @torch.no_grad()
    def contribute(self, p: int, step: int, tokens: int, alpha: Callable[[int, float], float]) -> dict[str, bool]:
        """Path ``p`` (live) trained up to ``step`` with ``tokens`` since its last segment:
        add α·Δ of its modules that launch at ``step``, α = ``alpha(p, tokens since the
        module's last launch)``; ``{module: accepted}`` (False: a non-finite Δ, dropped and
        counted). The finiteness of every Δ is read from the device once for the call."""
        for m in self.path_modules[p]:
            self.since[(p, m)] += int(tokens)
        now = self.current.launching(step, self.path_modules[p])
        if not now:
            return {}
        alphas = {m: alpha(p, self.since[(p, m)]) for m in now}
        deltas = {m: self.syncs[m].pseudo_gradient() for m in now}
        finite = torch.stack([torch.isfinite(d).all() for d in deltas.values()]).tolist()
        contributor, out = self.sync.topology.group_of_path(p), {}
        for m, ok in zip(now, finite):
            self.since[(p, m)] = 0
            out[m] = self.syncs[m].contribute(p, alphas[m], contributor, deltas[m], ok)
            if self.current.points[m].replaces:
                self.resident[m] = None  # the landing replaces p's copy: nobody needs it now
            elif not out[m]:  # a non-finite copy would poison every later step: start over from θ_global
                self.syncs[m].restore()
        return out

    def sync_point(self, step: int) -> dict[str, ModuleRoundStats]:
        """The sync point after inner step ``step``: land, launch, land (module doc)."""
        pts = self.current.points
        ordered = [m for m in self.syncs if m in pts]  # the global module order, on every rank
        done = {m: self._land(m) for m in ordered if pts[m].land == step and pts[m].launch < step}
        now = [m for m in ordered if pts[m].launch == step]
        for m in now:
            self.syncs[m].launch()
            if pts[m].land == step and not self.sync.overlap:
                done[m] = self._land(m)
        for m in now:
            if pts[m].land == step and m not in done:
                done[m] = self._land(m)
        self._landed.update(done)
        return done

    def _land(self, m: str) -> ModuleRoundStats:
        """Wait for ``m``'s exchange, take its outer step and replace or mix every copy."""
        s = self.syncs[m]
        pending = s.pending
        t0 = time.perf_counter()
        pending.wait()  # the part of the exchange the inner steps did not hide
        self.blocked_s += time.perf_counter() - t0
        if self.current.points[m].replaces:
            stats = s.land()
            s.restore()  # every path's copy is θ_global now: the live module holds it
            for p in self.holders[m]:
                self.copies.pop((p, m), None)
            self.resident[m] = None
        else:
            # a path whose copy is still θ_global keeps the one before this step
            for p in self.holders[m]:
                if self.resident[m] != p and (p, m) not in self.copies:
                    self.copies[(p, m)] = s.snapshot()
            stats = s.land()
            for p in self.holders[m]:
                if self.resident[m] == p:
                    s.mix(1.0 - self.keep)
                else:
                    s.mix_into(self.copies[(p, m)], 1.0 - self.keep)
        # bytes one rank of m's module group sent (the local backend counts them all)
        self._bytes[m] = int(stats.bytes_sent) // (1 if self.sync.rank is not None
                                                   else max(1, len(self.sync.topology.module_ranks(m))))
        self._intervals.append((pending.started_at, pending.done_at or pending.started_at, self._bytes[m]))
        return stats

    def end_round(self) -> RoundStats:
        """Set every copy aside with θ_global live; the round's statistics."""
        busy = [m for m, s in self.syncs.items() if s.in_flight]
        if busy:  # the schedule lands everything within the round (module doc)
            raise RuntimeError(f"modules {busy} are still in flight at the end of round {self.round + 1}")
        for m, p in self.resident.items():
            if p is not None:
                params = self.syncs[m].params
                self.copies[(p, m)] = flatten_params(params, params[0].device)
                self.syncs[m].restore()
                self.resident[m] = None
        stats = RoundStats(round=self.round, modules={m: self._landed[m] for m in self.syncs if m in self._landed})
        if self.measure:
            stats.inflight_peak_bytes = max((inflight_peak(self.current, self.path_modules[p], self._bytes)
                                             for p in self.paths
                                             if all(m in self._bytes for m in self.path_modules[p])), default=0)
            stats.inflight_peak_wall_bytes = wall_peak(self._intervals)
            stats.blocked_s = self.blocked_s
        self._landed, self._intervals, self._bytes, self.blocked_s = {}, [], {}, 0.0
        return stats

    # ----------------------------------------------------------------- state
    @property
    def holds_path_state(self) -> bool:
        """Whether a round boundary can hold more than θ_global: each path's copies and its
        tokens since a launch before H (any schedule but the synchronous one)."""
        return not self.schedule.is_synchronous

    def path_state(self, p: int) -> dict[str, torch.Tensor]:
        """Path ``p``'s copies and tokens since each module's last launch (a round boundary)."""
        out: dict[str, torch.Tensor] = {}
        for m in self.path_modules[p]:
            if self.resident[m] is not None:
                raise RuntimeError("path_state() is taken between rounds, with every copy set aside")
            c = self.copies.get((p, m))
            out[m] = (self.syncs[m].global_weights if c is None else c).detach().to("cpu", torch.float32).clone()
            out[m + TOKENS] = torch.tensor(self.since[(p, m)], dtype=torch.int64)
        return out

    def load_path_state(self, p: int, state: Optional[dict[str, torch.Tensor]]) -> None:
        """Inverse of :meth:`path_state`; None (a checkpoint of synchronous rounds):
        every copy is θ_global and no tokens are pending."""
        for m in self.path_modules[p]:
            params = self.syncs[m].params
            self.copies.pop((p, m), None)
            self.since[(p, m)] = 0
            if state is None or m not in state:
                continue
            flat = state[m].to(params[0].device, torch.float32).reshape(-1)
            if flat.numel() != self.syncs[m].numel:
                raise ValueError(f"streaming copy of {m!r} for path {p} has {flat.numel()} values, "
                                 f"the module {self.syncs[m].numel}")
            self.copies[(p, m)] = flat.clone()
            self.since[(p, m)] = int(state[m + TOKENS])
