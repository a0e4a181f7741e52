"""How this package starts its processes on one host: ranks, elastic agents, decoupled
workers and synchronisers (and the tests' gloo ranks).

A fresh interpreter per process (multiprocessing's ``spawn``) imports torch, Dynamo (which
torch.optim's ``step`` imports) and this package before it does anything: about 5 s of CPU
each on a 2-core host with torch 2.13, so a 4-rank launch spent 10-20 s starting.
``forkserver`` pays those imports once: a server process imports :data:`PRELOAD` when first
asked, and every later process is a fork of it, running within a fraction of a second
(``benchmarks/bench_launch.py``: a 4-rank launch that takes one AdamW step per rank, 0.70 s
once the server runs against 9.4 s with fresh interpreters).

HAZARDS, and why each holds here:

* A fork copies the parent's threads' locks but not its threads. The server is a fresh
  interpreter that has only imported modules: no OpenMP region has run (faiss and torch
  both start their thread pools at the first parallel call, not at import), no CUDA context
  exists, no gloo or TCPStore thread has started. A process forked from the *launcher*
  would have all of those; that is why the start method is ``forkserver`` and never ``fork``.
  Nothing in :data:`PRELOAD` may run work at import.
* A forked process inherits the *server's* environment and standard streams, fixed when
  the server started (the first launch of this process), not the launcher's at the time of
  this launch: a variable set or removed since (``DIPACO_FAULT``, a placement or thread
  setting) would be lost or stale, and its output would go where the launcher's went then
  (under pytest, an earlier test's capture). The launcher therefore sends a
  :func:`handover` with the process's arguments, and the process's first act is
  :func:`enter`: its environment becomes the launcher's plus whatever its own starter
  (torch's agent: ``RANK``, ``MASTER_PORT``, ...) set for it, and its stdout and stderr the
  launcher's.
* Libraries that read the environment once, when they load, read the server's: OpenMP's
  ``OMP_NUM_THREADS`` above all. So no started process relies on it: each sets its torch
  thread count itself (the rank's placement, ``dipaco/runtime/placement.py``; decoupled
  workers and synchronisers use one thread).
* A fork also shares the server's pseudo-random state. Python's ``random`` reseeds itself
  after a fork; numpy's global generator does not, and torch's default generator starts
  from the same seed in every process under ``spawn`` too. Nothing here draws from an
  unseeded generator in a child process.

Where ``forkserver`` does not exist (Windows), everything falls back to ``spawn``, and
``DIPACO_START_METHOD=spawn`` asks for it anywhere (a fresh interpreter per process, as
before this module existed).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import sys
from multiprocessing import reduction
from typing import Any, Mapping, Optional

# what every started process imports before its first step; a fork of the server finds
# them imported (an import that fails here is skipped by multiprocessing and paid later)
PRELOAD = (
    "torch",
    "torch._dynamo",  # torch.optim's step imports it (2.3 s of CPU in torch 2.13)
    "torch.distributed",
    "torch.distributed.elastic.multiprocessing",
    "dipaco.runtime.process_start",  # records the server's environment (enter() needs it)
    "dipaco.runtime.launch",
    "dipaco.rounds.loop",
    "dipaco.decoupled.worker",
    "dipaco.decoupled.supervisor",  # decoupled workers' and synchronisers' entry points
)

# this process's environment as it was when this module was imported: in a process forked
# from the server, the server's (every process of a launch inherited it from there)
_STARTING_ENV = dict(os.environ)


class LaunchError(RuntimeError):
    """A process could not be started, or a rank failed; the message says which and where
    its log is (one line at the console scripts, ``dipaco/cli/errors.py``)."""


START_METHOD_ENV = "DIPACO_START_METHOD"  # "spawn": fresh interpreters (slower start, no server)
START_METHODS = ("forkserver", "spawn")


def start_method() -> str:
    """``forkserver`` where the platform has it (its preloads set), else ``spawn``; the
    environment variable :data:`START_METHOD_ENV` can ask for ``spawn``.

    Raises:
        LaunchError: :data:`START_METHOD_ENV` names another method.
    """
    asked = os.environ.get(START_METHOD_ENV, "").strip() or "forkserver"
    if asked not in START_METHODS:
        raise LaunchError(f"{START_METHOD_ENV}={asked!r} is not a start method this package uses: "
                         f"use one of {', '.join(START_METHODS)} (or leave it unset)")
    if asked == "spawn" or "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    # read by the server when it starts (the first process started this way); later calls
    # change nothing, which is harmless since the list never changes
    mp.set_forkserver_preload(list(PRELOAD))
    return "forkserver"


def context() -> mp.context.BaseContext:
    """The multiprocessing context of :func:`start_method`."""
    return mp.get_context(start_method())


class Handover:
    """What a started process takes over from its launcher: the launcher's environment and
    its standard output and error, as they are when the process is started (:func:`enter`).

    Pickled for a child, the two streams travel as file descriptors (multiprocessing's
    ``DupFd``: passed to the forkserver with the request, inherited under ``spawn``);
    pickled anywhere else, they are left out and the child keeps its own.
    """

    def __init__(self, env: Mapping[str, str], stdio: Optional[tuple[Any, Any]] = None) -> None:
        self.env, self.stdio = dict(env), stdio

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        if mp.context.get_spawning_popen() is None:  # not being sent to a child
            return Handover, (self.env,)
        sys.stdout.flush()  # what this process wrote goes first
        sys.stderr.flush()
        return Handover, (self.env, (reduction.DupFd(1), reduction.DupFd(2)))


def handover() -> Handover:
    """What a process started now must take over from this one (pass it to :func:`enter`)."""
    return Handover(os.environ)


def child_env(launch: Mapping[str, str], starting: Mapping[str, str], current: Mapping[str, str]) -> dict[str, str]:
    """The environment a started process must have: the launcher's snapshot ``launch``, plus
    what its starter set in it since it began (``current`` against ``starting``: torch's
    agent sets ``RANK``, ``MASTER_PORT`` and the like between the fork and the entry point)."""
    own = {k: v for k, v in current.items() if starting.get(k) != v}
    return {**launch, **own}


def enter(h: Optional[Handover]) -> None:
    """A started process's first act: its environment becomes :func:`child_env`'s and its
    standard output and error the launcher's (no-op for ``None``: a process started some
    other way, e.g. by torchrun, which owns both)."""
    if h is None:
        return
    want = child_env(h.env, _STARTING_ENV, os.environ)
    for k in [k for k in os.environ if k not in want]:
        del os.environ[k]
    for k, v in want.items():
        if os.environ.get(k) != v:
            os.environ[k] = v
    if h.stdio is not None:
        for stream, target, dup in ((sys.stdout, 1, h.stdio[0]), (sys.stderr, 2, h.stdio[1])):
            fd = dup.detach()
            if fd != target:
                stream.flush()
                os.dup2(fd, target)
                os.close(fd)
        h.stdio = None
