"""The DiPaCo rounds on one rank (or, in the local backend, on every worker group in turn).

:func:`run_rank` is build → resume → loop → record: :func:`dipaco.rounds.rank.build_rank`
makes what the rank trains with, :func:`dipaco.rounds.rank.resume` reloads the newest
checkpoint, :func:`run_round` is one round, and :class:`dipaco.rounds.record.RoundRecorder`
keeps the records, checkpoints and totals.

One round (:func:`run_round`): for each path this rank's worker group owns (every path
in the local backend), restore the path's modules to the round's global weights, run H
inner AdamW steps (data parallel over the worker group), and contribute the
pseudo-gradients of its modules weighted by α (``diloco.alpha``). Then the round's sync
points run (:class:`dipaco.sync.diloco.RoundSchedule`; in the synchronous schedule every
module this rank holds launches its exchange over exactly the ranks that hold it and
takes its outer step). Checkpoints are taken at round boundaries; resume reloads the
newest valid one and continues bit for bit. With ``diloco.streaming`` a round is
:func:`dipaco.rounds.stream.run_streaming_round`: the turns are cut at staggered sync
points and exchanges travel while the paths train.
"""
from __future__ import annotations

import time
from typing import Optional

import torch.distributed as dist

from dipaco.runtime import elastic, faults
from dipaco.config import Config
from dipaco.runtime.launch import stop_requested
from dipaco.runtime.progress import say
from dipaco.run.results import RoundsResult
from dipaco.rounds.rank import RankState, build_rank, resume
from dipaco.rounds.record import RoundOutcome, RoundRecorder
from dipaco.rounds.stream import run_streaming_round
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
        play = run_streaming_round if rs.stream is not None else run_round
        rec.round_done(r, play(rs, r, on_step=rec.on_step))
        due = (r + 1) % cfg.trainer.checkpoint_every == 0 or r + 1 == R
        if due:
            rec.checkpoint(r + 1)
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


def run_round(rs: RankState, r: int, on_step=None) -> RoundOutcome:
    """Round ``r + 1``: every path of this rank takes its turn, then the sync points run."""
    H, sync = rs.cfg.diloco.inner_steps, rs.sync
    t0 = time.perf_counter()
    paths = {}
    for p in rs.paths:  # a worker group trains its paths in turn (contract 3)
        faults.inject("before_inner", round_idx=r + 1, rank=rs.rank, path=p)  # no-op unless DIPACO_FAULT
        sync.begin_path(p)  # the path's live modules ← θ_global
        learner = rs.learners[p]
        stats = learner.train_steps(H, on_step=on_step)
        faults.inject("after_inner", round_idx=r + 1, rank=rs.rank, path=p, grid=rs.grid,
                      module_ids=list(rs.topo.path_modules[p]))
        accepted = sync.end_path(p, rs.alpha(p, stats.tokens))  # α·Δ of each module of the path
        paths[p] = {"loss": stats.loss, "tokens": stats.tokens, "seconds": stats.seconds,
                    # the inner lr of the round's last step (the schedule is per step)
                    "lr": lr_at(learner.step - 1 + rs.warmup_steps, learner.total_steps, rs.cfg.trainer),
                    # non-finite updates: skipped inner steps, dropped pseudo-gradients
                    "skipped_steps": stats.skipped,
                    "dropped_modules": sorted(m for m, ok in accepted.items() if not ok)}
    t1 = time.perf_counter()
    # Waiting for the slowest worker group is not communication: a barrier first
    # separates that wait from the exchanges and outer steps that follow.
    if rs.distributed:
        dist.barrier()
    tb = time.perf_counter()
    stats = sync.finish_round()  # the schedule's sync points: launch, finish (collectives)
    t2 = time.perf_counter()
    return RoundOutcome(paths, stats, compute_s=t1 - t0, wait_s=tb - t1, sync_s=t2 - tb)
