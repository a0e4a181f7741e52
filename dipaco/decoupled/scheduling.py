"""How a decoupled worker schedules itself: which path it leases next and how many inner
steps its phase takes (dynamic local updates).

:class:`PathPicker` holds the rules, on a clock and paths' progress it is given (wall
time and the store's progress files in a worker; SimPy's clock and the simulated
progress in :mod:`dipaco.sim.decoupled`, which calls the same object). :class:`WorkerScheduling`
is a part of :class:`dipaco.decoupled.worker.DecoupledWorker` (its base class): it reads
the worker's speed and the other slots' speeds under ``speed/`` (the only thing worker
slots share) and asks its picker.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

from dipaco.decoupled.lease import Lease

__all__ = ["PathPicker", "WorkerScheduling"]


class PathPicker:
    """One worker's path choice and phase length (dynamic local updates, Liu et al. 2024).

    ``ratio`` below is the worker's time per inner step ÷ the other workers' median (None:
    not known yet); ``budget`` each path's inner steps (``math.inf``: no end, a simulated
    horizon). The picker remembers the path the worker held last and, for a slow worker,
    how long it leaves that path to others.

    Args:
        dcfg: decoupled settings (``slow_threshold``, ``dynamic_steps``, ``min_phase_steps``,
            ``pull_wait_s``, ``pull_wait_fraction``).
        inner_steps: H, a phase's length at normal speed.
        budget: inner steps each path trains.
    """

    def __init__(self, dcfg: Any, inner_steps: int, budget: float) -> None:
        self.d, self.H, self.budget = dcfg, int(inner_steps), budget
        self.last_path: Optional[int] = None
        self.avoid_until: Optional[float] = None
        # sitting out the tail: (since when, steps left then); None: not sitting out
        self.sitting_out: Optional[tuple[float, float]] = None

    def is_slow(self, ratio: Optional[float]) -> bool:
        """Markedly slower than the others (beyond ``slow_threshold``)."""
        return ratio is not None and ratio > self.d.slow_threshold

    def phase_steps(self, remaining: float, ratio: Optional[float]) -> int:
        """Inner steps of the next phase on a path with ``remaining`` steps to go.

        A worker markedly slower than the others runs ``H ÷ ratio`` steps (at least
        ``min_phase_steps``), so its phase takes about as long as theirs and the path it
        holds keeps pace.
        """
        n = self.H
        if self.d.dynamic_steps and self.is_slow(ratio):
            n = max(min(self.d.min_phase_steps, self.H), int(round(self.H / float(ratio))))
        return int(max(1, min(n, remaining)))

    def pull_wait_s(self, phase_s: Optional[float]) -> float:
        """The longest a phase waits for its path's previous update to be accounted for:
        ``pull_wait_s``, and at most ``pull_wait_fraction`` of the phase's expected
        seconds ``phase_s`` (None: not known yet)."""
        cap = float(self.d.pull_wait_s)
        if self.d.pull_wait_fraction is not None and phase_s is not None:
            cap = min(cap, self.d.pull_wait_fraction * phase_s)
        return cap

    def candidates(self, progress: Sequence[float], ratio: Optional[float], n_others: int,
                   others_s_per_step: Optional[float], now: float,
                   tiebreak: Callable[[], float]) -> Optional[list[int]]:
        """The paths to try to lease, best first; None: every path has its budget.

        A path's phases are sequential (phase k+1 starts from phase k's inner state), so a
        path held by a slow worker falls behind unless paths change hands. Normal workers
        take the least-advanced unfinished path. A worker markedly slower
        than the others takes the MOST advanced one instead, and after a phase it leaves
        its last path to others for a while (half of their phase; two without dynamic
        steps) unless nothing else is unfinished: the lagging path goes to a fast worker
        and the slow one works where there is slack, so every path spends about as long in
        the slow slot. ``tiebreak()`` is drawn once per unfinished path, in path order.
        The caller leases the first free one and calls :meth:`took`; ``[]``: none for now.
        """
        todo = [(k, tiebreak(), p) for p, k in enumerate(progress) if k < self.budget]
        if not todo:
            return None
        slow = self.is_slow(ratio)
        if slow and self.budget < float("inf") and self._sit_out_tail(
                sum(self.budget - k for k, _, _ in todo), ratio, n_others, others_s_per_step, now):
            return []
        self.sitting_out = None
        order = [p for _, _, p in sorted(todo, key=lambda x: (-x[0], x[1]) if slow else (x[0], x[1]))]
        # The path a slow worker just held lags (it advanced at my pace, even with dynamic
        # steps); leave it to a fast worker for a while. Without dynamic steps my phases
        # last `ratio` of theirs, so the lag is bigger and the wait worth longer.
        if slow and self.last_path is not None and len(todo) > 1 and others_s_per_step is not None:
            if self.avoid_until is None:
                phases = 0.5 if self.d.dynamic_steps else 2.0
                self.avoid_until = now + phases * self.H * float(others_s_per_step)
            if now < self.avoid_until:
                order = [p for p in order if p != self.last_path]
        return order

    def _sit_out_tail(self, remaining: float, ratio: Optional[float], n_others: int,
                      others_s_per_step: Optional[float], now: float) -> bool:
        """Whether a slow worker leaves the ``remaining`` steps to the others.

        The tail: when the others can finish what is left in about the time one of my
        phases takes, taking one would only make me the last one to finish (or, with
        dynamic steps, leave a remainder that someone must run after me). But only while
        they do: every worker may judge itself slow (each against the others' median, on
        speeds measured at different times; under extreme stragglers, all of them), and
        workers that all leave the tail to each other never end. So the sitting out lasts
        while the remaining steps fall: with no progress for one of the others' phases
        (``H × others_s_per_step``; their phases end within it if they run), I take one.
        """
        my_phase = self.H if self.d.dynamic_steps else self.H * float(ratio or 1.0)  # in the others' steps
        if remaining > n_others * my_phase:
            return False
        if self.sitting_out is None or remaining < self.sitting_out[1]:
            self.sitting_out = (now, remaining)  # (re)starts at each progress the others make
            return True
        patience = self.H * float(others_s_per_step) if others_s_per_step is not None else 0.0
        return now - self.sitting_out[0] < patience

    def took(self) -> None:
        """A lease was taken: a slow worker's wait away from its last path ends."""
        self.avoid_until = None

    def held(self, path: int) -> None:
        """A phase of ``path`` ended: the path a slow worker leaves to others next."""
        self.last_path = path


class WorkerScheduling:
    """Path choice and phase length of one decoupled worker (see the module doc)."""

    cfg: Any
    dcfg: Any
    store: Any
    index: int
    sps: Optional[float]
    picker: PathPicker

    def _publish_speed(self, seconds: float, steps: int) -> None:
        """Publish my seconds per inner step (an EMA over phases and heartbeats)."""
        sps = seconds / max(1, steps)
        self.sps = sps if self.sps is None else 0.5 * self.sps + 0.5 * sps
        self.store.put_json(f"speed/worker_{self.index}.json", {"s_per_step": self.sps, "t": time.time(),
                                                                "renewal_s": round(Lease.margin.worst, 3)})

    def _others_sps(self) -> tuple[Optional[float], int]:
        """Median seconds per inner step of the other worker slots active in the last
        minute (None: no data yet), and how many there are."""
        vals = []
        for name in self.store.list("speed"):
            if name != f"worker_{self.index}.json":
                got = self.store.get_json(f"speed/{name}")
                if got is not None and time.time() - float(got["t"]) < 60.0:
                    vals.append(float(got["s_per_step"]))
        return (float(np.median(vals)) if vals else None), len(vals)

    def _slowness(self) -> tuple[Optional[float], int]:
        """``(my time per step ÷ the others' median, number of others)``; None: unknown."""
        others, n_others = self._others_sps()
        if others is None or self.sps is None or others <= 0:
            return None, n_others
        return self.sps / others, n_others

    def phase_steps(self, remaining: int) -> int:
        """Inner steps of my next phase on a path with ``remaining`` steps to go
        (:meth:`PathPicker.phase_steps` at my slowness)."""
        return self.picker.phase_steps(remaining, self._slowness()[0])

    def pull_wait_s(self, steps: int) -> float:
        """How long my phase of ``steps`` waits for its path's last update (:meth:`PathPicker.pull_wait_s`)."""
        return self.picker.pull_wait_s(None if self.sps is None else self.sps * steps)

    def pick(self) -> tuple[Optional[Lease], bool]:
        """Lease a free unfinished path: ``(lease, all_finished)`` (:meth:`PathPicker.candidates`)."""
        progress = [self._progress(p) for p in range(self.grid.num_paths)]
        ratio, n_others = self._slowness()
        others = None if ratio is None else self.sps / ratio
        order = self.picker.candidates(progress, ratio, n_others, others, time.time(), self.rng.random)
        if order is None:
            return None, True
        for p in order:
            if not Lease.is_free(self.store, f"path_{p}"):
                continue
            lease = Lease(self.store, f"path_{p}", self.id, self.dcfg.lease_s)
            if lease.acquire():
                if lease.took_over_from:
                    self.event({"e": "takeover", "path": p, "from": lease.took_over_from, "epoch": lease.epoch})
                self.picker.took()
                return lease, False
        return None, False
