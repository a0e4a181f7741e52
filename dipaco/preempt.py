"""A run stopped by a signal, and a SLURM job that requeues itself (``launcher=slurm``).

SLURM sends SIGUSR2 to every task ``hydra.launcher.signal_delay_s`` (120 s) before the
time limit (submitit writes ``#SBATCH --signal=USR2@120``); a preempting scheduler or
``scancel`` sends SIGTERM. Either way every rank finishes the round in flight and the
round's checkpoint is committed (:class:`dipaco.launch.StopSignals`, the rounds loop).
Finishing the round, rather than saving mid-round, keeps "resume equals uninterrupted"
exact: a round checkpoint holds everything the next round reads (docs/design.md
contract 5), while the inner loop's position inside a round is not checkpointed. If the
time runs out first, SLURM's kill leaves the last committed round checkpoint, which is
just as exact; only the unfinished round is lost.

Then, on SIGUSR2 only, rank 0 runs ``scontrol requeue $SLURM_JOB_ID`` (at most
``launcher.max_requeues`` times, counted by SLURM's ``SLURM_RESTART_COUNT``). SIGTERM
does not requeue: it is also what ``scancel`` sends, and a scheduler that preempts with
``PreemptMode=REQUEUE`` requeues the job itself. A requeued job (``SLURM_RESTART_COUNT``
> 0) runs with ``resume=true`` (:func:`requeued_resume`), whoever requeued it.

Why not submitit's own handler (``helpers.Checkpointable``): it checkpoints and requeues
from inside the signal handler on rank 0 at once, in the middle of a round, while the
other ranks run on; only the job knows where a round ends, and all ranks must agree on
it (one all-reduce per round, :func:`dipaco.launch.stop_requested`).
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
from typing import Callable, Mapping, Optional

from dipaco.config import Config
from dipaco.results import RoundsResult
from dipaco.run_dir import RunDir, RunStopped

REQUEUE_SIGNAL = "SIGUSR2"


def restart_count(env: Mapping[str, str]) -> int:
    """How many times SLURM has requeued this job (``SLURM_RESTART_COUNT``; 0 the first time)."""
    try:
        return int(env.get("SLURM_RESTART_COUNT") or 0)
    except ValueError:
        return 0


def requeued_resume(cfg: Config, env: Mapping[str, str], log: Callable[[str], None]) -> Config:
    """``cfg`` with ``resume=true`` when this is a requeued ``launcher=slurm`` job.

    A requeued job runs its first submission's command line again; without this it would
    be refused as a new run in a directory that holds one.
    """
    count = restart_count(env)
    if cfg.launcher.name != "slurm" or count == 0 or cfg.resume:
        return cfg
    log(f"SLURM job {env.get('SLURM_JOB_ID', '?')} requeued ({count} of launcher.max_requeues="
        f"{cfg.launcher.max_requeues}): resume=true")
    return dataclasses.replace(cfg, resume=True)


def scontrol_requeue(job_id: str) -> None:
    """``scontrol requeue JOB``; raises ``OSError`` / ``CalledProcessError`` / ``TimeoutExpired``."""
    subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=60, capture_output=True, text=True)


def stopped(cfg: Config, run: RunDir, result: RoundsResult, signal_name: str, *, requeue_here: bool,
            env: Optional[Mapping[str, str]] = None,
            requeue: Callable[[str], None] = scontrol_requeue) -> RunStopped:
    """The one line of a run that a signal stopped after ``result.completed_rounds`` rounds.

    With ``requeue_here`` (rank 0 of a ``launcher=slurm`` job) a SIGUSR2 also requeues the
    job, unless ``launcher.max_requeues`` requeues were made already.
    """
    env = os.environ if env is None else env
    done = result.completed_rounds
    where = (f"after round {done}; last complete checkpoint {result.checkpoint}" if result.checkpoint
             else "before the first checkpoint")
    resume = f"dipaco-train hydra.run.dir={run.root} resume=true"
    head = f"stopped by {signal_name} {where}"
    if cfg.launcher.name != "slurm" or signal_name != REQUEUE_SIGNAL:
        return RunStopped(f"{head}; continue with: {resume}")
    if not requeue_here:
        return RunStopped(f"{head}; rank 0 requeues the job (its log says whether it did)")
    job, count, allowed = env.get("SLURM_JOB_ID"), restart_count(env), cfg.launcher.max_requeues
    if not job:
        return RunStopped(f"{head}; not requeued: SLURM_JOB_ID is not set; continue with: {resume}")
    if count >= allowed:
        return RunStopped(f"{head}; not requeued: launcher.max_requeues={allowed} reached "
                          f"(SLURM_RESTART_COUNT={count}); continue with: {resume}")
    try:
        requeue(job)
    except (OSError, subprocess.SubprocessError) as e:
        why = (getattr(e, "stderr", None) or str(e)).strip().splitlines()
        return RunStopped(f"{head}; `scontrol requeue {job}` failed ({why[-1] if why else e}); "
                          f"continue with: {resume}")
    return RunStopped(f"{head}; requeued SLURM job {job} (requeue {count + 1} of launcher.max_requeues="
                      f"{allowed}): it continues from that checkpoint with resume=true")
