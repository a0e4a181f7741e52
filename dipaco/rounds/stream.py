"""One streaming round (``diloco.streaming=true``): the paths' turns cut at the staggered
sync points, exchanges in flight while the inner steps go on.

The same loop in both backends. Each segment runs every path of this process up to the
next sync step (:meth:`dipaco.sync.streaming.StreamingSync.boundaries`), each path
contributing α·Δ of its modules that launch there; then the sync point lands, launches
and lands (:meth:`~dipaco.sync.streaming.StreamingSync.sync_point`). In the torch
backend the launches go to the communication thread, so the next segment's inner steps
run while the module is exchanged, and the sync point τ steps later waits only for what
they did not hide. ``sync_s`` of the round is the time the inner steps stood still at
sync points (the exposed communication, plus encoding and outer steps); ``compute_s``
the inner steps and the copies' swaps.

HAZARDS (torch backend; why this cannot deadlock). While a module is in flight two
threads issue collectives: the communication thread (the module's exchange: its module
subgroup and, with G > 1, the exchange's own worker group) and this one (the inner loop's
gradient all-reduce on the worker group, FSDP2 is refused). They never share a process
group (:mod:`dipaco.sync.groups`, 3.), and each thread issues its collectives in one
order on every rank: the comm thread runs launches in (step, global module order), the
same total order on every rank of every module group, so no cycle of waits can form.
Nothing may issue a collective on a module subgroup from this thread while the stream is
in flight: the round's barrier, checkpoints, early stopping and the digest checks all run
after :meth:`~dipaco.sync.streaming.StreamingSync.end_round`, which refuses to end a
round with an exchange in flight.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import torch.distributed as dist

from dipaco.config.schedule import lr_at
from dipaco.rounds.learner import InnerStats
from dipaco.rounds.rank import RankState
from dipaco.rounds.record import RoundOutcome
from dipaco.runtime import faults

__all__ = ["run_streaming_round"]


def run_streaming_round(rs: RankState, r: int, on_step: Optional[Callable[[], None]] = None) -> RoundOutcome:
    """Round ``r + 1`` under streaming sync (module doc)."""
    stream = rs.stream
    assert stream is not None
    totals = {p: InnerStats() for p in rs.paths}
    dropped: dict[int, set[str]] = {p: set() for p in rs.paths}
    compute_s = sync_s = 0.0
    prev = 0
    steps = stream.boundaries(r)
    for step in steps:
        t0 = time.perf_counter()
        for p in rs.paths:  # a worker group trains its paths in turn (contract 3), segment by segment
            if prev == 0:
                faults.inject("before_inner", round_idx=r + 1, rank=rs.rank, path=p)  # no-op unless DIPACO_FAULT
            stream.activate(p)
            st = rs.learners[p].train_steps(step - prev, on_step=on_step)
            launching = [m for m in stream.path_modules[p] if stream.points_of(r)[m][0] == step]
            if launching:
                faults.inject("after_inner", round_idx=r + 1, rank=rs.rank, path=p, grid=rs.grid,
                              module_ids=launching)
            accepted = stream.contribute(p, step, st.tokens, rs.alpha)
            dropped[p].update(m for m, ok in accepted.items() if not ok)
            _add(totals[p], st)
        t1 = time.perf_counter()
        stream.sync_point(step)
        compute_s += t1 - t0
        sync_s += time.perf_counter() - t1
        prev = step
    t2 = time.perf_counter()
    if rs.distributed:
        dist.barrier()  # as the synchronous round: the slowest worker group's wait, apart
    wait_s = time.perf_counter() - t2
    stats = stream.end_round()  # θ_global live again, every path's copy set aside
    paths = {}
    for p, t in totals.items():
        learner = rs.learners[p]
        paths[p] = {"loss": t.loss, "tokens": t.tokens, "seconds": t.seconds,
                    "lr": lr_at(learner.step - 1 + rs.warmup_steps, learner.total_steps, rs.cfg.trainer),
                    "skipped_steps": t.skipped, "dropped_modules": sorted(dropped[p])}
    return RoundOutcome(paths, stats, compute_s=compute_s, wait_s=wait_s, sync_s=sync_s)


def _add(total: InnerStats, st: InnerStats) -> None:
    total.steps += st.steps
    total.tokens += st.tokens
    total.loss_sum += st.loss_sum
    total.seconds += st.seconds
    total.skipped += st.skipped
