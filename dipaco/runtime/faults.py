"""Fault injection for both sync modes (docs/reliability.md, docs/decoupled.md): off
unless ``DIPACO_FAULT`` is set.

One mechanism for both modes, and it is the environment, not the config: ranks started
by the elastic launcher and decoupled workers and synchronisers started by the
supervisor (``multiprocessing`` spawn) inherit the environment, so they see the same
faults as the launching test process; and a fault can never end up in a saved
``config.yaml`` and be replayed on resume (decoupled mode's former ``chaos_*`` config
keys could). With the variable unset (every real run) every call here returns at once.

Syntax: ``;``-separated faults, each ``kind:key=value:key=value``::

    DIPACO_FAULT="kill:rank=1:round=2"            # rank 1 SIGKILLs itself in round 2's inner phase
    DIPACO_FAULT="node_kill:rank=1:round=2:start=0"  # rank 1 SIGKILLs its elastic agent, then itself
                                                  # (a lost machine), only in the first start
                                                  # of the ranks (restarts re-run round 2)
    DIPACO_FAULT="nan:path=1:round=2:module=L1.0" # path 1's L1.0 holds NaN after its inner steps
    DIPACO_FAULT="inf:path=0:round=1"             # +inf in every module of path 0, round 1
    DIPACO_FAULT="signal:sig=USR2:round=2"        # every rank gets SIGUSR2 as round 2 starts
                                                  # (SLURM's warning before the time limit)
    DIPACO_FAULT="worker_kill:every_s=1:max=4:seed=3"  # decoupled: the supervisor SIGKILLs a
                                                       # random (preferably busy) worker about
                                                       # every 1 s (×U(0.5, 1.5)), 4 times
    DIPACO_FAULT="worker_delay:prob=0.5:s=0.8:seed=3"  # decoupled: a worker stalls U(0, 0.8) s
                                                       # inside a phase, with probability 0.5
    DIPACO_FAULT="store_error:file=/tmp/outage"        # decoupled: every store call of this
                                                       # process raises OSError while the file
                                                       # exists (a store outage for this host)

``round`` is 1-based (the round being trained). ``rank`` is the global rank (the local
backend is rank 0). ``start`` is which start of the ranks of an elastic launch this is (0
the first; :mod:`dipaco.runtime.elastic` sets it), so a fault that a restart would meet
again fires once. ``module`` defaults to every module of the path. Sync mode calls
:func:`inject` in the rounds loop; decoupled mode reads :func:`worker_chaos` and wraps
its stores with :func:`store_outage`.
"""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

ENV = "DIPACO_FAULT"
START_ENV = "DIPACO_START"  # which start of an elastic launch's ranks this process is (0 the first)
NODE_ENV = "DIPACO_NODE"  # the name of this rank's elastic agent (dipaco.runtime.elastic)
# the PID of this rank's elastic agent, which sets it: a rank forked from the agent's server
# (dipaco.runtime.process_start) has that server, not the agent, as its parent
AGENT_PID_ENV = "DIPACO_AGENT_PID"
KINDS = ("kill", "node_kill", "signal", "nan", "inf", "worker_kill", "worker_delay", "store_error")
# field name -> type; which fields a kind reads is in the module doc
FIELDS = {"round": int, "rank": int, "path": int, "module": str, "every_s": float, "max": int, "prob": float,
          "s": float, "seed": int, "sig": str, "start": int, "file": str}


def agent_pid() -> int:
    """This rank's agent: the PID its agent announced (:data:`AGENT_PID_ENV`), else its
    parent (torchrun's agent starts its ranks as its own children)."""
    return int(os.environ.get(AGENT_PID_ENV) or os.getppid())


@dataclass(frozen=True)
class Fault:
    """One injected fault; ``None`` fields match anything."""

    kind: str
    round: Optional[int] = None
    rank: Optional[int] = None
    path: Optional[int] = None
    module: Optional[str] = None
    every_s: Optional[float] = None
    max: Optional[int] = None
    prob: Optional[float] = None
    s: Optional[float] = None
    seed: Optional[int] = None
    sig: Optional[str] = None
    start: Optional[int] = None
    file: Optional[str] = None


@dataclass(frozen=True)
class WorkerChaos:
    """Decoupled mode's faults (``worker_kill`` / ``worker_delay``); the default: none."""

    kill_every_s: Optional[float] = None
    max_kills: int = 0
    delay_prob: float = 0.0
    delay_s: float = 0.0
    seed: int = 0


def parse(spec: str) -> list[Fault]:
    """Parse a ``DIPACO_FAULT`` value; a typo raises instead of silently injecting nothing."""
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        kind, *pairs = item.split(":")
        if kind not in KINDS:
            raise ValueError(f"{ENV}: unknown fault kind {kind!r} in {item!r}; use one of {KINDS}")
        kw: dict[str, Any] = {}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep or key not in FIELDS:
                raise ValueError(f"{ENV}: bad field {pair!r} in {item!r}; use one of {', '.join(FIELDS)}")
            try:
                kw[key] = FIELDS[key](value)
            except ValueError:
                raise ValueError(f"{ENV}: {key}={value!r} in {item!r} is not a {FIELDS[key].__name__}") from None
        f = Fault(kind, **kw)
        if kind == "worker_kill" and not (f.every_s and f.every_s > 0 and (f.max or 0) > 0):
            raise ValueError(f"{ENV}: {item!r} needs every_s > 0 and max > 0, e.g. worker_kill:every_s=5:max=3")
        if kind == "signal" and not isinstance(getattr(signal, f"SIG{f.sig or 'USR2'}", None), signal.Signals):
            raise ValueError(f"{ENV}: {item!r} names no signal; use e.g. signal:sig=USR2 or signal:sig=TERM")
        if kind == "store_error" and not f.file:
            raise ValueError(f"{ENV}: {item!r} needs file=PATH (the store fails while PATH exists)")
        if kind == "worker_delay" and not (0 <= (f.prob or 0) <= 1 and (f.s or 0) > 0):
            raise ValueError(f"{ENV}: {item!r} needs prob in [0, 1] and s > 0, e.g. worker_delay:prob=0.2:s=1")
        faults.append(f)
    return faults


_SIGNALLED: set[Fault] = set()  # ``signal`` faults already sent by this process


def active() -> list[Fault]:
    """The faults the environment asks for (read each call: tests set and clear it)."""
    spec = os.environ.get(ENV)
    return parse(spec) if spec else []


def _matches(f: Fault, round_idx: int, rank: Optional[int], path: Optional[int]) -> bool:
    return ((f.round is None or f.round == round_idx)
            and (f.rank is None or f.rank == (rank or 0))
            and (f.path is None or f.path == path)
            and (f.start is None or f.start == int(os.environ.get(START_ENV, "0"))))


def inject(where: str, *, round_idx: int, rank: Optional[int], path: int, grid: Any = None,
           module_ids: Optional[list[str]] = None) -> None:
    """Apply the faults that match this point of the round loop.

    ``where="before_inner"``: a matching ``kill`` fault sends SIGKILL to this process (a
    preempted or crashed machine: no cleanup, no exception, no checkpoint); a matching
    ``signal`` fault sends ``SIG<sig>`` (default USR2), as SLURM does to every task of a
    job before its time limit.
    ``where="after_inner"``: a matching ``nan``/``inf`` fault overwrites the first element
    of every parameter of the chosen module(s) of ``path`` in ``grid``, so the path's
    pseudo-gradient for that module is non-finite this round.
    """
    if ENV not in os.environ:  # the production fast path
        return
    for f in active():
        if not _matches(f, round_idx, rank, path):
            continue
        if where == "before_inner" and f.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if where == "before_inner" and f.kind == "node_kill":
            # the agent first: were this rank gone first, the agent would see its death
            # and restart it (a failed rank, not a lost machine). Other ranks of the same
            # agent (group_size > 1) are orphaned and fail at their next collective.
            if NODE_ENV not in os.environ:  # the parent is the launching process (a test's!)
                raise RuntimeError(f"{ENV}: node_kill needs ranks under an agent of their own "
                                   "(launcher.elastic=true, or torchrun)")
            os.kill(agent_pid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        if where == "before_inner" and f.kind == "signal" and f not in _SIGNALLED:
            _SIGNALLED.add(f)  # once per process, as SLURM sends it: a second one means "stop now"
            os.kill(os.getpid(), getattr(signal, f"SIG{f.sig or 'USR2'}"))
        if where == "after_inner" and f.kind in ("nan", "inf") and grid is not None:
            value = float("nan") if f.kind == "nan" else float("inf")
            targets = [f.module] if f.module else list(module_ids or [])
            with torch.no_grad():
                for mid in targets:
                    for p in grid.module(mid).parameters():
                        p.view(-1)[0] = value


def worker_chaos() -> WorkerChaos:
    """Decoupled mode's faults from the environment (the last of each kind wins)."""
    out = WorkerChaos()
    for f in active():
        if f.kind == "worker_kill":
            out = replace(out, kill_every_s=f.every_s, max_kills=int(f.max or 0), seed=f.seed or out.seed)
        elif f.kind == "worker_delay":
            out = replace(out, delay_prob=float(f.prob or 0.0), delay_s=float(f.s or 0.0), seed=f.seed or out.seed)
    return out


class _FailingStore:
    """A store whose every call raises OSError while ``flag`` exists (``store_error``)."""

    def __init__(self, store: Any, flag: str) -> None:
        self._store, self._flag = store, flag

    def __repr__(self) -> str:
        return repr(self._store)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            if os.path.exists(self._flag):
                raise OSError(f"{ENV}: injected store outage ({self._flag} exists)")
            return attr(*args, **kwargs)

        return call


def store_outage(store: Any) -> Any:
    """``store``, or a wrapper failing while a ``store_error`` fault's file exists: a
    decoupled role's store (worker, synchroniser, a host's supervisor) cut off for a while."""
    if ENV not in os.environ:  # the production fast path
        return store
    flags = [f.file for f in active() if f.kind == "store_error" and f.file]
    return _FailingStore(store, flags[-1]) if flags else store
