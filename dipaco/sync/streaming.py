"""Streaming DiLoCo over the per-module syncs (arXiv 2501.18512): each module launches its
exchange at its own inner step, the paths keep training while it travels, and τ steps
later the new global weights are mixed into the live ones.

:class:`StreamingSync` drives a :class:`~dipaco.sync.diloco.DiLoCoSync` (its
``ModuleSync`` per module, its communicator) by the staggered points of
:mod:`dipaco.plan.stagger`; the rounds loop (:mod:`dipaco.rounds.stream`) cuts every
path's turn into segments that end at those points::

    for step in stream.boundaries(r):            # the round's sync steps, then H
        for p in paths:                          # local: every path; torch: my group's
            stream.activate(p)                   # p's own copy of its modules goes live
            ...inner steps up to `step`...
            stream.contribute(p, step, tokens)   # α·Δ of p's modules launching at `step`
        stream.sync_point(step)                  # land, launch, land (below)
    stats = stream.end_round()                   # park: the live modules hold θ_global

Per-path copies. In synchronous DiLoCo every path starts its turn from θ_global, so the
paths of one process can share module objects. Under streaming a path keeps what it
learnt while a module was in flight (the landing *mixes*), so each path has its own copy
of each of its modules: the one in the live module (*resident*) or a flat fp32 copy
beside it; :meth:`activate` swaps copies in and out only when another path used the
module since (never, with one path per worker group). Between rounds every copy is set
aside and the live modules hold θ_global (:meth:`end_round`), so checkpoints, early
stopping and the final evaluation read the global weights, as after a synchronous round.

A sync point of step ``s``, always in this order on every rank: the modules launched
earlier that land at ``s`` (wait, outer step, mix); the modules launching at ``s``, in the
global module order (encode, start: on the communication thread with ``overlap``); those
of them whose delay is 0 land at once. Landing mixes the new global weights into every
copy of the module this process holds, ``copy ← keep·copy + (1 − keep)·θ_global``
(``keep`` = ``diloco.streaming_mix``, the paper's α), or replaces the copy when the
exchange overlapped no inner step (τ = 0: nothing was learnt meanwhile; the synchronous
round, and streaming's final round). α of a contribution is the path's tokens since that
module's previous launch (``diloco.alpha`` applied to them).

Checkpoints (:mod:`dipaco.rounds.checkpointing`, given this driver): every exchange lands in the round it was launched in (the last launch is
at H − τ), so a round boundary never has one in flight: none is lost or applied twice
on resume. What a round boundary does hold is each path's copies and its tokens since
each module's last launch: :meth:`path_state` / :meth:`load_path_state`
(``streams/path_<p>.safetensors``).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional, Sequence

import torch

from dipaco.plan.stagger import Points, inflight_peak, synchronous_points
from dipaco.sync.diloco import DiLoCoSync
from dipaco.sync.module_core import flatten_params, load_flat
from dipaco.sync.module_sync import ModuleRoundStats, RoundStats

__all__ = ["StreamingSync", "wall_peak"]

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


class StreamingSync:
    """Streaming DiLoCo over ``sync``'s modules (module doc).

    Args:
        sync: the per-module syncs of this process (``rank=None``: every worker group).
        points: every module's ``(launch, land)`` steps in a round
            (:func:`dipaco.plan.stagger.streaming_points`); the same on every rank.
        rounds: the run's rounds; the last is synchronous (every module at step H), so
            the final θ_global has every inner step in it.
        keep: ``diloco.streaming_mix``, the share of the live weights kept on landing.
    """

    def __init__(self, sync: DiLoCoSync, points: Points, rounds: int, keep: float = 0.5) -> None:
        if sync.sharded:
            raise ValueError("streaming sync keeps per-path copies of unsharded modules; "
                             "launcher.group_parallel=fsdp is not supported")
        missing = [m for m in sync.syncs if m not in points]
        if missing:
            raise ValueError(f"no streaming sync point for modules {missing}")
        self.sync, self.rounds, self.keep = sync, int(rounds), float(keep)
        self.H = max(b for _, b in points.values())
        self.points = {m: points[m] for m in sync.syncs}
        self.final = {m: pt for m, pt in synchronous_points(list(sync.syncs), self.H).items()}
        topo = sync.topology
        self.paths = sync.paths_to_train()
        self.path_modules = {p: [m for m in sync.syncs if m in topo.path_modules[p]] for p in self.paths}
        self.holders = {m: [p for p in self.paths if m in self.path_modules[p]] for m in sync.syncs}
        self.copies: dict[tuple[int, str], torch.Tensor] = {}  # absent: the path's copy is θ_global
        self.since = {(p, m): 0 for p in self.paths for m in self.path_modules[p]}
        self.resident: dict[str, Optional[int]] = {m: None for m in sync.syncs}  # None: θ_global is live
        self._round_points: Points = self.points
        self._landed: dict[str, ModuleRoundStats] = {}
        self._intervals: list[tuple[float, float, int]] = []
        self._bytes: dict[str, int] = {}
        self.blocked_s = 0.0  # time this round waited on exchanges not yet complete

    @classmethod
    def from_config(cls, sync: DiLoCoSync, d: Any, rounds: int, points: Points) -> "StreamingSync":
        """From ``cfg.diloco`` (``d``: its ``streaming_mix``) and the run's staggered points
        (:func:`dipaco.plan.build.build_streaming_points`: the same on every rank)."""
        return cls(sync, points, rounds, keep=d.streaming_mix)

    # ----------------------------------------------------------------- the round
    def points_of(self, r: int) -> Points:
        """Round ``r``'s sync points (0-based): staggered, the last round synchronous."""
        return self.final if r == self.rounds - 1 else self.points

    def boundaries(self, r: int) -> list[int]:
        """The steps round ``r``'s turns are cut at: its sync steps and H, ascending."""
        self._round_points = self.points_of(r)
        return sorted({s for pt in self._round_points.values() for s in pt} | {self.H})

    def activate(self, p: int) -> None:
        """Put path ``p``'s copy of each of its modules into the live module."""
        for m in self.path_modules[p]:
            who = self.resident[m]
            if who == p:
                continue
            params = self.sync.syncs[m].params
            if who is not None:  # another path's copy is live: set it aside
                self.copies[(who, m)] = flatten_params(params, params[0].device)
            if (p, m) in self.copies:
                load_flat(params, self.copies.pop((p, m)))
            else:
                self.sync.syncs[m].restore()
            self.resident[m] = p

    @torch.no_grad()
    def contribute(self, p: int, step: int, tokens: int, alpha: Callable[[int, float], float]) -> dict[str, bool]:
        """Path ``p`` (live) trained up to ``step`` with ``tokens`` since its last segment:
        contribute α·Δ of its modules that launch at ``step``; ``{module: accepted}``."""
        mods = self.path_modules[p]
        for m in mods:
            self.since[(p, m)] += int(tokens)
        now = [m for m in mods if self._round_points[m][0] == step]
        if not now:
            return {}
        deltas = [self.sync.syncs[m].pseudo_gradient() for m in now]
        finite = torch.stack([torch.isfinite(d).all() for d in deltas]).tolist()  # one device read
        out = {}
        group = self.sync.topology.group_of_path(p)
        for m, d, ok in zip(now, deltas, finite):
            a = alpha(p, self.since[(p, m)])
            self.since[(p, m)] = 0
            out[m] = self.sync.syncs[m].contribute(p, a, group, d, ok)
            if not out[m]:  # a non-finite copy would poison every later step: start over from θ_global
                self.sync.syncs[m].restore()
        return out

    def sync_point(self, step: int) -> dict[str, ModuleRoundStats]:
        """The sync point after ``step``: land, launch (global order), land the τ = 0 ones."""
        pts = self._round_points
        ordered = list(self.sync.syncs)  # the global module order, on every rank
        done = {m: self._land(m) for m in ordered if pts[m][1] == step and pts[m][0] < step}
        now = [m for m in ordered if pts[m][0] == step]
        for m in now:
            self.sync.launch([m])
            if pts[m][1] == step and not self.sync.overlap:  # one exchange at a time, as run_event
                done[m] = self._land(m)
        for m in now:
            if pts[m][1] == step and m not in done:
                done[m] = self._land(m)
        self._landed.update(done)
        return done

    def _land(self, m: str) -> ModuleRoundStats:
        s = self.sync.syncs[m]
        pending = s.pending
        t0 = time.perf_counter()
        pending.wait()  # the part of the exchange the inner steps did not hide
        self.blocked_s += time.perf_counter() - t0
        a, b = self._round_points[m]
        weight = 1.0 if a == b else 1.0 - self.keep
        if weight != 1.0:  # a path whose copy is still θ_global keeps the one before this step
            for p in self.holders[m]:
                if self.resident[m] != p and (p, m) not in self.copies:
                    self.copies[(p, m)] = s.core.weights.to(s.params[0].device, copy=True)
        stats = s.finish()
        for p in self.holders[m]:
            if self.resident[m] == p:
                s.mix(weight)
            elif weight == 1.0:
                self.copies.pop((p, m), None)  # absent: θ_global
            else:
                s.core.mix_into([self.copies[(p, m)]], weight)
        self._bytes[m] = self._per_rank(m, stats.bytes_sent)
        self._intervals.append((pending.started_at, pending.done_at or pending.started_at, self._bytes[m]))
        return stats

    def _per_rank(self, m: str, sent: int) -> int:
        """Bytes one rank of ``m``'s module group sent (the local backend counts them all)."""
        if self.sync.rank is not None:
            return int(sent)
        return int(sent) // max(1, len(self.sync.topology.module_ranks(m)))

    def end_round(self) -> RoundStats:
        """Set every copy aside with θ_global live; the round's statistics."""
        busy = [m for m, s in self.sync.syncs.items() if s.in_flight]
        if busy:  # the schedule lands everything within the round (module doc)
            raise RuntimeError(f"modules {busy} are still in flight at the end of round {self.sync.round + 1}")
        for m, p in self.resident.items():
            if p is not None:
                params = self.sync.syncs[m].params
                self.copies[(p, m)] = flatten_params(params, params[0].device)
                self.sync.syncs[m].restore()
                self.resident[m] = None
        pts = self._round_points
        peak = max((inflight_peak(pts, self.path_modules[p], self._bytes) for p in self.paths
                    if all(m in self._bytes for m in self.path_modules[p])), default=0)
        stats = RoundStats(round=self.sync.round, modules={m: self._landed[m] for m in self.sync.syncs
                                                           if m in self._landed},
                           inflight_peak_bytes=peak, inflight_peak_wall_bytes=wall_peak(self._intervals),
                           blocked_s=self.blocked_s)
        self._landed, self._intervals, self._bytes, self.blocked_s = {}, [], {}, 0.0
        self.sync.round += 1
        return stats

    # ----------------------------------------------------------------- state
    def path_state(self, p: int) -> dict[str, torch.Tensor]:
        """Path ``p``'s copies and tokens since each module's last launch (a round boundary)."""
        out: dict[str, torch.Tensor] = {}
        for m in self.path_modules[p]:
            if self.resident[m] is not None:
                raise RuntimeError("path_state() is taken between rounds, with every copy set aside")
            c = self.copies.get((p, m))
            out[m] = (self.sync.syncs[m].core.weights if c is None else c).detach().to("cpu", torch.float32).clone()
            out[m + TOKENS] = torch.tensor(self.since[(p, m)], dtype=torch.int64)
        return out

    def load_path_state(self, p: int, state: Optional[dict[str, torch.Tensor]]) -> None:
        """Inverse of :meth:`path_state`; None (a checkpoint of synchronous rounds):
        every copy is θ_global and no tokens are pending."""
        for m in self.path_modules[p]:
            params = self.sync.syncs[m].params
            self.copies.pop((p, m), None)
            self.since[(p, m)] = 0
            if state is None or m not in state:
                continue
            flat = state[m].to(params[0].device, torch.float32).reshape(-1)
            if flat.numel() != self.sync.syncs[m].numel:
                raise ValueError(f"streaming copy of {m!r} for path {p} has {flat.numel()} values, "
                                 f"the module {self.sync.syncs[m].numel}")
            self.copies[(p, m)] = flat.clone()
            self.since[(p, m)] = int(state[m + TOKENS])
