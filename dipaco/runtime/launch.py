"""Starting ranks: in-process (local), on this host (spawn), or under torchrun.

The Hydra process resolves the config once and prepares everything that must happen
before ranks exist (tokenizer, router fit: faiss must not run in a process forked after
its OpenMP threads started: docs/design.md, "Processes"). It then calls :func:`launch`, which runs
``fn(cfg, run, rank, world_size, *args)`` on every rank and returns rank 0's result.

``slurm`` is torchrun's case with the rank env made from SLURM's (:mod:`dipaco.runtime.slurm`).

``spawn`` uses torch.distributed's elastic launch API: the agent watches its workers and,
when one dies, stops the others and raises, so a killed rank ends the run in bounded
time (the monitor interval plus the collective timeout) instead of hanging it.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from dipaco.run.checkpoint import CheckpointManager
from dipaco.config import Config, to_config
from dipaco.runtime import elastic, process_start
from dipaco.runtime.process_start import LaunchError
from dipaco.runtime.placement import Placement, apply_placement, placement_of
from dipaco.runtime.elastic_spawn import RESTART_EXIT, run_agents
from dipaco.runtime.faults import NODE_ENV
from dipaco.run.results import RoundsResult
from dipaco.run.run_dir import RunDir
from dipaco.runtime.progress import log, share_run_log


TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def require_torchrun_env() -> None:
    """launcher=torchrun outside torchrun is one line naming the missing variables."""
    missing = [v for v in TORCHRUN_ENV if v not in os.environ]
    if missing:
        raise LaunchError(f"launcher=torchrun but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                          "not set: start with `torchrun --nproc-per-node=N -m dipaco.cli.train launcher=torchrun "
                          "...`, or use launcher=local / launcher=spawn")


# SIGUSR2 is what SLURM (``#SBATCH --signal=USR2@N``, as submitit writes it) sends every
# task N seconds before the time limit: under launcher=slurm the job then requeues itself
# (dipaco/runtime/preempt.py)
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGUSR2") if hasattr(signal, name))
# a rank of launcher=spawn (not elastic) stopped by a signal exits with this plus the
# signal's number, so the launching process can name the signal (elastic: RESTART_EXIT)
STOPPED_EXIT_BASE = 80


class StopSignals:
    """``with StopSignals(): ...``: SIGTERM/SIGINT/SIGUSR2 ask the rounds to stop at the next
    round boundary (checkpoint written) instead of killing the process mid-write. A second
    signal stops at once. ``StopSignals.received`` names the signal, or is ``None``.
    """

    received: Optional[str] = None
    # called with the signal's name on the first one (dipaco.runtime.preempt.RequeueDeadline.arm)
    on_signal: Optional[Callable[[str], None]] = None

    def __enter__(self) -> "StopSignals":
        StopSignals.received = None
        self._old: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():  # signal handlers live there only
            for sig in STOP_SIGNALS:
                self._old[sig] = signal.signal(sig, _on_stop_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        StopSignals.received = None  # a later run in this process starts unsignalled
        StopSignals.on_signal = None


def _on_stop_signal(signum: int, _frame: Any) -> None:
    if StopSignals.received is not None:  # the second one: stop now
        signal.signal(signum, signal.SIG_DFL)
        raise KeyboardInterrupt
    StopSignals.received = signal.Signals(signum).name
    if os.environ.get(NODE_ENV) is None:
        # print, not the logger: a signal handler that takes the logging lock the interrupted
        # code holds would deadlock. An elastic rank says nothing: its agent stops it for a
        # membership change (rank 0 of the next start names the group that left, in one line)
        # or passes on a stop the launching process has already acknowledged
        print(f"[dipaco] {StopSignals.received}: stopping after the round in flight, whose checkpoint is "
              "then written; send it again to stop at once", flush=True)
    if StopSignals.on_signal is not None:
        StopSignals.on_signal(StopSignals.received)


def stop_requested(distributed: bool) -> bool:
    """Whether any rank got a stop signal; in a distributed run all ranks agree (one
    all-reduce per round), so they stop after the same round, and a rank that got no
    signal itself learns one that did (``StopSignals.received``: the highest number)."""
    got = StopSignals.received
    if not distributed:
        return got is not None
    t = torch.tensor([float(signal.Signals[got].value) if got else 0.0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if t.item() > 0 and got is None:
        StopSignals.received = signal.Signals(int(t.item())).name
    return bool(t.item() > 0)


def free_port() -> int:
    """A TCP port on localhost that is free right now (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed(placement: Placement, timeout_s: float) -> tuple[int, int]:
    """Join the process group described by the env (RANK, WORLD_SIZE, MASTER_*).

    ``placement`` is this rank's (:func:`dipaco.runtime.placement.placement_of`: GPU
    ``host rank % device_count``, threads by ranks per host; nccl only with one GPU per
    rank); it is applied before the group exists, so nccl and the sync's staging use the
    right GPU.
    """
    if not dist.is_initialized():
        apply_placement(placement)
        dist.init_process_group(backend=placement.rank_device.backend, timeout=_dt.timedelta(seconds=timeout_s))
    if dist.get_rank() == 0:
        log.info(f"{dist.get_world_size()} rank(s); rank 0: {placement.describe()}")
    return dist.get_rank(), dist.get_world_size()


MONITOR_S = 0.5  # how often the spawn launcher's agent looks at its ranks
# how long a rank whose collective failed because a peer vanished waits before it fails
# too: three of the agent's looks, so the agent reports the rank that died, not the ones
# it took with it (which failed rank the agent finds first is a race otherwise)
PEER_LOSS_GRACE_S = 3 * MONITOR_S
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer")  # gloo's words for it


def lost_a_peer(e: BaseException) -> bool:
    """Whether a collective failed because another rank's process is gone."""
    return any(w in str(e) for w in _PEER_LOST)


def _rank_entry(fn: Callable[..., Any], cfg_dict: dict, run: RunDir, args: tuple,
                handover: Optional[process_start.Handover] = None) -> Any:
    """Body of one spawned or torchrun rank (``handover``: the launcher's environment and
    streams, for a rank forked from the server of :mod:`dipaco.runtime.process_start`)."""
    process_start.enter(handover)
    cfg = to_config(cfg_dict)
    if os.environ.get("RANK") == "0":  # a spawned rank 0: its messages join the job's train.log
        share_run_log(run.log_file)
    rank, world = init_distributed(placement_of(cfg), cfg.launcher.timeout_s)
    try:
        with StopSignals():  # the elastic agent forwards SIGTERM to its workers
            if cfg.launcher.elastic and elastic.join(run, rank, world).restart:
                cfg = dataclasses.replace(cfg, resume=True)  # a restart of the launch continues it
            try:
                out = fn(cfg, run, rank, world, *args)
            except RuntimeError as e:
                if not cfg.launcher.elastic and lost_a_peer(e):
                    # the dead peer is the failure to report: the agent names the first
                    # failed rank it finds at its next look, and would find this one too
                    time.sleep(PEER_LOSS_GRACE_S)
                raise
            if cfg.launcher.name == "spawn" and StopSignals.received and not getattr(out, "finished", True):
                # Stopped at a round boundary, its checkpoint written: exit, never return a value.
                # Elastic: an exit code 0 would tell an agent that has not seen a restart (or a
                # stop) the run is over. Both: torch's worker waits until its agent reads the
                # value, and an agent shutting down on a signal never does, so every rank stood
                # 30 s until SIGKILL after its checkpoint. The launcher reads the checkpoint.
                # Every rank learnt the same signal (stop_requested), so all exit alike.
                sys.exit(RESTART_EXIT if cfg.launcher.elastic
                         else STOPPED_EXIT_BASE + signal.Signals[StopSignals.received].value)
            return out
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(fn: Callable[..., Any], cfg: Config, run: RunDir, *args: Any) -> Any:
    """Run ``fn(cfg, run, rank, world_size, *args)`` on every rank; return rank 0's value.

    ``local``: one call in this process with ``rank=None`` (the local backend plays every
    worker group). ``spawn``: ``launcher.nproc`` processes on this host. ``torchrun``
    and ``slurm``: this process is already one rank; the env says which.
    """
    name = cfg.launcher.name
    if name == "local":
        apply_placement(placement_of(cfg))
        return fn(cfg, run, None, 1, *args)
    cfg_dict = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    if name in ("torchrun", "slurm"):  # slurm: dipaco.runtime.slurm exported the torchrun env
        if "RANK" not in os.environ:
            raise LaunchError("launcher=torchrun but RANK is not set: start with `torchrun ... dipaco-train ...`")
        if dist.is_initialized():  # train() joined the group already (rank 0 prepared)
            return fn(cfg, run, dist.get_rank(), dist.get_world_size(), *args)
        return _rank_entry(fn, cfg_dict, run, args)
    if name != "spawn":
        raise LaunchError(f"unknown launcher {name!r}")
    if StopSignals.received:  # asked to stop while preparing: ranks would never hear of it
        return _stopped_result(cfg, run)
    if cfg.launcher.elastic:
        return _launch_elastic(fn, cfg, cfg_dict, run, args)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # the agent's own warnings ("Received 15 death signal ...") would break the one-line
    # rule; what went wrong is in the LaunchError / RunStopped line instead
    for name in ("torch.distributed.elastic", "torch.distributed.elastic.agent.server.api",
                 "torch.distributed.elastic.multiprocessing.api"):  # each has its own level
        logging.getLogger(name).setLevel(logging.ERROR)
    # ... and its traceback for a rank that stopped on a signal is no failure (addFilter adds it once)
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_not_a_stopped_rank)
    port = free_port()
    extra = {"log_line_prefix_template": "[rank${rank}] "} if _supports_prefix() else {}
    lc = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=cfg.launcher.nproc,
        run_id=f"dipaco-{uuid.uuid4().hex[:8]}",
        rdzv_backend="static",
        rdzv_endpoint=f"127.0.0.1:{port}",
        rdzv_configs={"rank": 0, "timeout": int(cfg.launcher.timeout_s)},
        max_restarts=0,
        monitor_interval=MONITOR_S,
        start_method=process_start.start_method(),
        **extra,
    )
    try:
        results = elastic_launch(lc, entrypoint=_rank_entry)(fn, cfg_dict, run, args, process_start.handover())
    except ChildFailedError as e:
        names = {_stop_signal_of(f.exitcode) for f in e.failures.values()}
        if len(names) == 1 and None not in names:
            # every rank stopped at a round boundary on a signal sent to the ranks, not to this process
            StopSignals.received = StopSignals.received or names.pop()
            return _stopped_result(cfg, run)
        failures = "; ".join(
            f"rank {r} exited with {f.exitcode} ({f.message or 'no message'})"
            for r, f in sorted(e.failures.items())
        )
        raise LaunchError(f"a rank failed: {failures}") from None
    except SignalException as e:
        # the agent stopped the ranks (they checkpoint at the round boundary if they can)
        StopSignals.received = StopSignals.received or signal.Signals(e.sigval).name
        return _stopped_result(cfg, run)
    return results[0]


def _launch_elastic(fn: Callable[..., Any], cfg: Config, cfg_dict: dict, run: RunDir, args: tuple) -> Any:
    """``launcher.elastic``: one elastic agent per worker group (dipaco/runtime/elastic_spawn.py)."""
    outcome = run_agents(cfg, run, _rank_entry, (fn, cfg_dict, run, args), free_port(),
                         stop_requested=lambda: StopSignals.received is not None)
    if outcome.finished:
        return outcome.value
    if outcome.stopped:
        return _stopped_result(cfg, run)
    why = "; ".join(outcome.failures) or "every agent ended without a result (" + "; ".join(outcome.ended) + ")"
    raise LaunchError("a rank failed: " + why)


def _stop_signal_of(exitcode: Optional[int]) -> Optional[str]:
    """The stop signal a spawned rank's exit code names (``STOPPED_EXIT_BASE`` + its number), else None."""
    if exitcode is None:
        return None
    n = exitcode - STOPPED_EXIT_BASE
    return signal.Signals(n).name if n in STOP_SIGNALS else None


def _not_a_stopped_rank(record: logging.LogRecord) -> bool:
    """False for torch's "failed (exitcode: N) ..." record (its first argument is the exit
    code) of a rank that stopped on a signal."""
    args = record.args if isinstance(record.args, tuple) else ()
    return not (args and isinstance(args[0], int) and _stop_signal_of(args[0]) is not None)


def _stopped_result(cfg: Config, run: RunDir) -> RoundsResult:
    """What a launch stopped by a signal leaves: the newest complete checkpoint."""
    ckpt = CheckpointManager(run.checkpoints).latest_valid()
    done = int(ckpt.name.split("_")[1]) if ckpt is not None else 0
    return RoundsResult(rounds=cfg.trainer.rounds, completed_rounds=done, start_round=done,
                        world_size=cfg.launcher.nproc, checkpoint=str(ckpt) if ckpt is not None else None)


def _supports_prefix() -> bool:
    import inspect

    from torch.distributed.launcher.api import LaunchConfig

    return "log_line_prefix_template" in inspect.signature(LaunchConfig).parameters

