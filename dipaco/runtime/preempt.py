"""A run stopped by a signal, and a SLURM job that requeues itself (``launcher=slurm``).

SLURM sends SIGUSR2 to every task ``hydra.launcher.signal_delay_s`` (120 s) before the
time limit (submitit writes ``#SBATCH --signal=USR2@120``); a preempting scheduler or
``scancel`` sends SIGTERM. Either way every rank finishes the round in flight and the
round's checkpoint is committed (:class:`dipaco.runtime.launch.StopSignals`, the rounds loop).
Finishing the round, rather than saving mid-round, keeps "resume equals uninterrupted"
exact: a round checkpoint holds everything the next round reads (docs/design.md
contract 5), while the inner loop's position inside a round is not checkpointed. A
round that cannot end in time is abandoned instead: :class:`RequeueDeadline` requeues
the job :data:`DEADLINE_MARGIN_S` before its end (``SLURM_JOB_END_TIME``), and the
requeued job resumes from the last committed round checkpoint, which is just as exact;
only the unfinished round is lost.

Then, on SIGUSR2 only, rank 0 runs ``scontrol requeue $SLURM_JOB_ID`` (at most
``launcher.max_requeues`` times, counted by SLURM's ``SLURM_RESTART_COUNT``). SIGTERM
does not requeue: it is also what ``scancel`` sends, and a scheduler that preempts with
``PreemptMode=REQUEUE`` requeues the job itself. A requeued job (``SLURM_RESTART_COUNT``
> 0) runs with ``resume=true`` (:func:`requeued_resume`), whoever requeued it.

Why not submitit's own handler (``helpers.Checkpointable``): it checkpoints and requeues
from inside the signal handler on rank 0 at once, in the middle of a round, while the
other ranks run on; only the job knows where a round ends, and all ranks must agree on
it (one all-reduce per round, :func:`dipaco.runtime.launch.stop_requested`).
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import threading
import time
from typing import Callable, Mapping, Optional

from dipaco.config import Config
from dipaco.run.lock import restart_count
from dipaco.run.results import RoundsResult
from dipaco.run.run_dir import RunDir, RunStopped

REQUEUE_SIGNAL = "SIGUSR2"
# seconds before the job's end at which a round still in flight is abandoned: enough for
# `scontrol requeue` and for SLURM to stop the tasks before its own kill
DEADLINE_MARGIN_S = 30.0


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


class RequeueDeadline:
    """Rank 0 of a ``launcher=slurm`` job: after SIGUSR2, requeue at the job's end minus
    :data:`DEADLINE_MARGIN_S` if the stop at the round boundary has not done it by then.

    ``arm`` is called from the signal handler (:attr:`dipaco.runtime.launch.StopSignals.on_signal`);
    ``claim`` by the normal path, which requeues itself unless the deadline did already.
    Without ``SLURM_JOB_END_TIME`` (SLURM < 21.08) nothing is armed: SLURM's kill at the
    limit then leaves the last committed checkpoint, and ``resume=true`` continues it.
    """

    def __init__(self, cfg: Config, env: Mapping[str, str], *, requeue: Callable[[str], None] = scontrol_requeue,
                 log: Callable[[str], None] = print, clock: Callable[[], float] = time.time) -> None:
        self.cfg, self.env, self.requeue, self.log, self.clock = cfg, env, requeue, log, clock
        self._lock = threading.Lock()
        self._timer: Optional[threading.Timer] = None
        self.fired = False  # the deadline requeued the job

    def seconds_left(self) -> Optional[float]:
        """Seconds until the deadline, or ``None`` when the job's end time is unknown."""
        end = self.env.get("SLURM_JOB_END_TIME", "")
        return float(end) - DEADLINE_MARGIN_S - self.clock() if end.isdigit() else None

    def arm(self, signal_name: str) -> None:
        """Start the deadline on SIGUSR2 (once; never past launcher.max_requeues)."""
        left = self.seconds_left()
        if (signal_name != REQUEUE_SIGNAL or left is None or self._timer is not None
                or restart_count(self.env) >= self.cfg.launcher.max_requeues or not self.env.get("SLURM_JOB_ID")):
            return
        self._timer = threading.Timer(max(0.0, left), self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        with self._lock:
            if self.fired:
                return
            self.fired = True
        job = str(self.env["SLURM_JOB_ID"])
        self.log(f"the round in flight cannot end before SLURM job {job}'s time limit: abandoning it and "
                 "requeueing now; the job resumes from the last committed round checkpoint")
        try:
            self.requeue(job)
        except (OSError, subprocess.SubprocessError) as e:
            self.log(f"`scontrol requeue {job}` failed ({e}); continue with resume=true once it ends")

    def claim(self) -> bool:
        """For the normal path: ``True`` if it should requeue (the deadline has not)."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            if self.fired:
                return False
            self.fired = True
            return True

    def cancel(self) -> None:
        """The job is ending by itself: never requeue from here."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            self.fired = True
