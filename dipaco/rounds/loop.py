"""The DiPaCo rounds on one rank (or, in the local backend, on every worker group in turn).

:func:`run_rank` is build → resume → loop → record: :func:`dipaco.rounds.rank.build_rank`
makes what the rank trains with, :func:`dipaco.rounds.rank.resume` reloads the newest
checkpoint, :func:`run_round` is one round, and :class:`dipaco.rounds.record.RoundRecorder`
keeps the records, checkpoints and totals.

One round (:func:`run_round`), the same loop for every schedule and both backends: the
round's :class:`dipaco.plan.schedule.RoundSchedule` (synchronous: every module launches
and lands after step H; ``diloco.streaming``: staggered fragments, the last round
synchronous) cuts each path's turn into segments ending at its boundaries. Each segment
runs every path this rank's worker group owns (every path in the local backend) up to the
next boundary from its copy of its modules (θ_global when synchronous), data parallel over
the worker group, each path contributing α·Δ (``diloco.alpha``) of its modules launching
there; then the sync point lands, launches and lands
(:meth:`dipaco.sync.round_driver.RoundDriver.sync_point`): each module's exchange runs over exactly the ranks that hold it. A synchronous round is one
segment of H inner steps and one sync point. Checkpoints are taken at round boundaries;
resume reloads the newest valid one and continues bit for bit.

Time: ``compute_s`` is the inner steps (and the copies' swaps); ``wait_s`` the barrier
that separates waiting for the slowest worker group from the exchanges (before the last
sync point when nothing is in flight then, else after it); ``sync_s`` the time the inner
steps stood still at sync points (the exposed communication, encoding, outer steps).

HAZARDS (torch backend; why streaming cannot deadlock). While a module is in flight two
threads issue collectives: the communication thread (the module's exchange: its module
subgroup and, with G > 1, the exchange's own worker group) and this one (the inner loop's
gradient all-reduce on the worker group, FSDP2 is refused). They never share a process
group (:mod:`dipaco.sync.groups`, 3.), and each thread issues its collectives in one
order on every rank: the comm thread runs launches in (step, global module order), the
same total order on every rank of every module group, so no cycle of waits can form.
Nothing may issue a collective on a module subgroup from this thread while an exchange is
in flight: the round's barrier waits until none is, and checkpoints, early stopping and
the digest checks all run after :meth:`~dipaco.sync.round_driver.RoundDriver.end_round`,
which refuses to end a round with an exchange in flight.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import torch.distributed as dist

from dipaco.runtime import elastic, faults
from dipaco.config import Config
from dipaco.runtime.hardware import release_free_memory
from dipaco.runtime.launch import stop_requested
from dipaco.runtime.progress import say
from dipaco.run.results import RoundsResult
from dipaco.rounds.learner import InnerStats
from dipaco.rounds.rank import RankState, build_rank, resume
from dipaco.rounds.record import RoundOutcome, RoundRecorder
from dipaco.run.run_dir import RunDir
from dipaco.config.schedule import lr_at

__all__ = ["run_rank", "run_round"]


def run_rank(cfg: Config, run: RunDir, rank: Optional[int], world_size: int) -> RoundsResult:
    """Train the DiPaCo rounds; ``rank=None`` is the local backend (all groups here)."""
    rs = build_rank(cfg, run, rank, world_size)
    start_round = resume(rs)
    # an elastic launch records this start and says what a membership change cost
    elastic.started(run, rank, rs.topo.group_size, start_round, log=lambda m: say(m, rank))
    rec = RoundRecorder(rs, start_round)
    R = cfg.trainer.rounds
    for r in range(start_round, R):
        rec.round_done(r, run_round(rs, r, on_step=rec.on_step))
        due = (r + 1) % cfg.trainer.checkpoint_every == 0 or r + 1 == R
        if due:
            rec.checkpoint(r + 1)
        release_free_memory()  # the heap holes the round's turns left (docs/gpu.md: 0.6 MiB a path)
        # asked after the round's checkpoint, so a signal that came while it was written
        # stops here, not one round later (one collective per round: every rank agrees)
        stop = cfg.trainer.stop_after_rounds is not None and r + 1 >= cfg.trainer.stop_after_rounds
        stop = stop_requested(rs.distributed) or stop  # SIGTERM/SIGINT: every rank stops after this round
        if stop and not due:
            rec.checkpoint(r + 1)
        if stop:
            say(f"stopping after round {r + 1} (checkpoint written)", rank)
            break
    return rec.result()


def run_round(rs: RankState, r: int, on_step: Optional[Callable[[], None]] = None) -> RoundOutcome:
    """Round ``r + 1``: the paths' turns cut at the schedule's boundaries (module doc)."""
    driver = rs.driver
    schedule = driver.begin_round(r)
    totals = {p: InnerStats() for p in rs.paths}
    dropped: dict[int, set[str]] = {p: set() for p in rs.paths}
    compute_s = wait_s = sync_s = 0.0
    prev, waited = 0, not rs.distributed
    for step in schedule.boundaries():
        t0 = time.perf_counter()
        for p in rs.paths:  # a worker group trains its paths in turn (contract 3), segment by segment
            if prev == 0:
                faults.inject("before_inner", round_idx=r + 1, rank=rs.rank, path=p)  # no-op unless DIPACO_FAULT
            driver.activate(p)  # the path's copy of its modules goes live (θ_global when synchronous)
            st = rs.learners[p].train_steps(step - prev, on_step=on_step)
            launching = schedule.launching(step, driver.path_modules[p])
            if launching:
                faults.inject("after_inner", round_idx=r + 1, rank=rs.rank, path=p, grid=rs.grid,
                              module_ids=launching)
            accepted = driver.contribute(p, step, st.tokens, rs.alpha)  # α·Δ of the modules launching now
            dropped[p].update(m for m, ok in accepted.items() if not ok)
            _add(totals[p], st)
        t1 = time.perf_counter()
        if not waited and step == schedule.inner_steps and not driver.in_flight():
            # Waiting for the slowest worker group is not communication: a barrier first
            # separates that wait from the exchanges and outer steps that follow.
            dist.barrier()
            waited = True
        tb = time.perf_counter()
        driver.sync_point(step)  # land, launch, land (collectives in the torch backend)
        compute_s += t1 - t0
        wait_s += tb - t1
        sync_s += time.perf_counter() - tb
        prev = step
    if not waited:  # an exchange was in flight at H (streaming): the slowest group's wait, after it
        t2 = time.perf_counter()
        dist.barrier()
        wait_s += time.perf_counter() - t2
    stats = driver.end_round()  # θ_global live again, every path's copy set aside
    paths = {}
    for p, t in totals.items():
        learner = rs.learners[p]
        paths[p] = {"loss": t.loss, "tokens": t.tokens, "seconds": t.seconds,
                    # the inner lr of the round's last step (the schedule is per step)
                    "lr": lr_at(learner.step - 1 + rs.warmup_steps, learner.total_steps, rs.cfg.trainer),
                    # non-finite updates: skipped inner steps, dropped pseudo-gradients
                    "skipped_steps": t.skipped, "dropped_modules": sorted(dropped[p])}
    return RoundOutcome(paths, stats, compute_s=compute_s, wait_s=wait_s, sync_s=sync_s)


def _add(total: InnerStats, st: InnerStats) -> None:
    total.steps += st.steps
    total.tokens += st.tokens
    total.loss_sum += st.loss_sum
    total.seconds += st.seconds
    total.skipped += st.skipped
