"""How a decoupled worker schedules itself: which path it leases next and how many inner
steps its phase takes (dynamic local updates).

:class:`WorkerScheduling` is a part of :class:`dipaco.decoupled.worker.DecoupledWorker`
(its base class): the rules read the worker's config (``cfg``, ``dcfg``), ``store``,
slot ``index``, ``rng``, ``grid``, its own speed ``sps`` and ``last_path`` /
``avoid_until``, and the paths' progress (``_progress``); the speeds the worker slots
publish under ``speed/`` are the only thing they share.
"""
from __future__ import annotations

import time
from typing import Any, Optional

import numpy as np

from dipaco.decoupled.lease import Lease

__all__ = ["WorkerScheduling"]


class WorkerScheduling:
    """Path choice and phase length of one decoupled worker (see the module doc)."""

    cfg: Any
    dcfg: Any
    store: Any
    index: int
    sps: Optional[float]
    last_path: Optional[int]
    avoid_until: Optional[float]

    def _publish_speed(self, seconds: float, steps: int) -> None:
        """Publish my seconds per inner step (an EMA over phases and heartbeats)."""
        sps = seconds / max(1, steps)
        self.sps = sps if self.sps is None else 0.5 * self.sps + 0.5 * sps
        self.store.put_json(f"speed/worker_{self.index}.json", {"s_per_step": self.sps, "t": time.time()})

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
        """Inner steps of my next phase on a path with ``remaining`` steps to go.

        Dynamic local updates (Liu et al. 2024): a worker markedly slower than the
        others runs ``H ÷ slowness`` steps (at least ``min_phase_steps``), so its phase
        takes about as long as theirs and the path it holds keeps pace.
        """
        H = self.cfg.diloco.inner_steps
        n = H
        ratio, _ = self._slowness()
        if self.dcfg.dynamic_steps and ratio is not None and ratio > self.dcfg.slow_threshold:
            n = max(min(self.dcfg.min_phase_steps, H), int(round(H / ratio)))
        return max(1, min(n, remaining))

    def pick(self) -> tuple[Optional[Lease], bool]:
        """Lease a free unfinished path: ``(lease, all_finished)``.

        A path's phases are sequential (phase k+1 starts from phase k's inner state), so
        a path held by a slow worker falls behind unless paths change hands. Normal
        workers take the least-advanced free path. A worker that is markedly slower
        than the others (> ``slow_threshold``× their median time per step) takes the MOST
        advanced free path instead, and after a phase it leaves its last path to others
        for a short while (half of their phase; two without dynamic steps) unless nothing
        else frees up: the lagging path goes to a fast worker and the slow one works where
        there is slack, so every path spends about as long in the slow slot.
        """
        H = self.cfg.diloco.inner_steps
        budget = self.cfg.trainer.rounds * H
        todo = []
        for p in range(self.grid.num_paths):
            k = self._progress(p)
            if k < budget:
                todo.append((k, self.rng.random(), p))
        if not todo:
            return None, True
        ratio, n_others = self._slowness()
        slow = ratio is not None and ratio > self.dcfg.slow_threshold
        others = None if ratio is None else self.sps / ratio
        if slow:
            # The tail: when the others can finish what is left in about the time one of
            # my phases takes, taking one would only make me the last one to finish (or,
            # with dynamic steps, leave a remainder that someone must run after me).
            remaining = sum(budget - k for k, _, _ in todo)
            my_phase = H if self.dcfg.dynamic_steps else H * ratio  # in the others' steps
            if remaining <= n_others * my_phase:
                return None, False
        order = sorted(todo, key=lambda x: (-x[0], x[1]) if slow else (x[0], x[1]))
        # The path a slow worker just held lags (it advanced at my pace, even with dynamic
        # steps); leave it to a fast worker for a while so that paths rotate through the
        # slow slot, unless nothing else frees up. Without dynamic steps my phases last
        # `ratio` of theirs, so the lag is bigger and the wait worth longer.
        if slow and self.last_path is not None and len(todo) > 1:
            if self.avoid_until is None:
                phases = 0.5 if self.dcfg.dynamic_steps else 2.0
                self.avoid_until = time.time() + phases * H * float(others)
            if time.time() < self.avoid_until:
                order = [x for x in order if x[2] != self.last_path]
        for _, _, p in order:
            if not Lease.is_free(self.store, f"path_{p}"):
                continue
            lease = Lease(self.store, f"path_{p}", self.id, self.dcfg.lease_s)
            if lease.acquire():
                if lease.took_over_from:
                    self.event({"e": "takeover", "path": p, "from": lease.took_over_from, "epoch": lease.epoch})
                self.avoid_until = None
                return lease, False
        return None, False
