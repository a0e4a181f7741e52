"""Fault injection for reliability tests (docs/reliability.md): off unless ``DIPACO_FAULT`` is set.

The rounds loop (:mod:`dipaco.rounds`) calls :func:`inject` at a few points of a round. With the variable
unset (every real run) the call returns at once and changes nothing. The variable is
read from the environment, not the config, so that ranks started by the elastic launcher
(which inherit the environment) see the same faults as the launching test process, and
so that a fault can never end up in a saved ``config.yaml`` and be replayed on resume.

Syntax: ``;``-separated faults, each ``kind:key=value:key=value``::

    DIPACO_FAULT="kill:rank=1:round=2"            # rank 1 SIGKILLs itself in round 2's inner phase
    DIPACO_FAULT="nan:path=1:round=2:module=L1.0" # path 1's L1.0 holds NaN after its inner steps
    DIPACO_FAULT="inf:path=0:round=1"             # +inf in every module of path 0, round 1

``round`` is 1-based (the round being trained). ``rank`` is the global rank (the local
backend is rank 0). ``module`` defaults to every module of the path.
"""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Any, Optional

import torch

ENV = "DIPACO_FAULT"
KINDS = ("kill", "nan", "inf")


@dataclass(frozen=True)
class Fault:
    """One injected fault; ``None`` fields match anything."""

    kind: str
    round: Optional[int] = None
    rank: Optional[int] = None
    path: Optional[int] = None
    module: Optional[str] = None


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
            if not sep or key not in ("round", "rank", "path", "module"):
                raise ValueError(f"{ENV}: bad field {pair!r} in {item!r}; use round=, rank=, path=, module=")
            kw[key] = value if key == "module" else int(value)
        faults.append(Fault(kind, **kw))
    return faults


def active() -> list[Fault]:
    """The faults the environment asks for (read each call: tests set and clear it)."""
    spec = os.environ.get(ENV)
    return parse(spec) if spec else []


def _matches(f: Fault, round_idx: int, rank: Optional[int], path: Optional[int]) -> bool:
    return ((f.round is None or f.round == round_idx)
            and (f.rank is None or f.rank == (rank or 0))
            and (f.path is None or f.path == path))


def inject(where: str, *, round_idx: int, rank: Optional[int], path: int, grid: Any = None,
           module_ids: Optional[list[str]] = None) -> None:
    """Apply the faults that match this point of the round loop.

    ``where="before_inner"``: a matching ``kill`` fault sends SIGKILL to this process (a
    preempted or crashed machine: no cleanup, no exception, no checkpoint).
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
        if where == "after_inner" and f.kind in ("nan", "inf") and grid is not None:
            value = float("nan") if f.kind == "nan" else float("inf")
            targets = [f.module] if f.module else list(module_ids or [])
            with torch.no_grad():
                for mid in targets:
                    for p in grid.module(mid).parameters():
                        p.view(-1)[0] = value
