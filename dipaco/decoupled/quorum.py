"""The decisions of a decoupled module synchroniser, as pure functions of numbers.

:class:`dipaco.decoupled.merge.MergingModuleSync` asks these when to step (quorum, the
adaptive grace window, the cap for finished paths), which update is too stale, how a kept
update is discounted and how the fill-time EMA moves. They take the clock as an argument
and touch no tensor, so a simulated clock (:mod:`dipaco.sim.decoupled`) drives the very
same rules as the trainer: the simulator does not carry a second model of them.
"""
from __future__ import annotations

import math
from typing import Collection, Iterable, Optional

from dipaco.config.decoupled import DecoupledConfig

__all__ = ["quorum_size", "grace_bounds", "grace_window", "step_due", "is_stale", "rounds_late", "discount",
           "next_phase_ema", "next_fill_ema"]


def quorum_size(share: float, sharing: int) -> int:
    """How many of ``sharing`` paths must have reported before an outer step (>= 1)."""
    return max(1, math.ceil(share * sharing - 1e-9))


def grace_bounds(cfg: DecoupledConfig, phase_s: Optional[float], quorum: int, sharing: int) -> tuple[float, float]:
    """``(floor, cap)`` of a module's grace window: ``grace_min_s`` / ``grace_max_s`` when
    set, else derived from ``phase_s``, the EMA of the phases' seconds as the workers
    measured them (:func:`next_phase_ema`; None: none arrived yet).

    Each sharing path delivers one update per phase, so with phases spread over one the
    updates of ``quorum`` of the ``sharing`` paths arrive within ``quorum / sharing`` of
    a phase: the floor. A window shorter than that closes before the quorum can fill in
    the steady state, and the fill-time EMA, which only quorum steps feed, then sees only
    the quick fills and shrinks further (at 10^6 chips a fixed 0.1 s floor turned most
    steps into grace steps of a few updates: docs/planning.md). The cap is
    ``grace_factor`` phases: by then every live sharing path has delivered.
    """
    floor = cfg.grace_min_s
    if floor is None:
        floor = 0.0 if phase_s is None else quorum / max(1, sharing) * phase_s
    cap = cfg.grace_max_s
    if cap is None:
        cap = math.inf if phase_s is None else cfg.grace_factor * phase_s
    return float(floor), float(cap)


def grace_window(cfg: DecoupledConfig, fill_ema: Optional[float], phase_s: Optional[float] = None,
                 quorum: int = 1, sharing: int = 1) -> float:
    """The grace window: ``grace_factor`` x EMA(fill time) (``grace_init_s`` until a quorum
    has filled once), within :func:`grace_bounds` (the floor wins over the cap)."""
    base = cfg.grace_init_s if fill_ema is None else cfg.grace_factor * fill_ema
    floor, cap = grace_bounds(cfg, phase_s, quorum, sharing)
    return max(floor, min(cap, base))


def step_due(pending_paths: Collection[int], sharing_paths: Iterable[int], quorum: int,
             first_pending_at: Optional[float], now: float, grace_s: float,
             done: Optional[Collection[int]] = None) -> Optional[str]:
    """Why a step is due now (``"quorum"`` / ``"grace"``), or None.

    ``pending_paths``: the distinct paths with a pending update. ``done``: paths that
    finished their budget; they send nothing more, so the quorum is capped at the sharing
    paths still running plus those whose last update is pending (a finished path's last
    update must not step alone while the others' updates of the same phase are coming).
    """
    if not pending_paths:
        return None
    need = quorum
    if done:
        can = {p for p in sharing_paths if p not in done} | set(pending_paths)
        need = max(1, min(need, len(can)))
    if len(set(pending_paths)) >= need:
        return "quorum"
    if first_pending_at is not None and now - float(first_pending_at) >= grace_s:
        return "grace"
    return None


def is_stale(version: int, base_version: int, max_staleness: int) -> bool:
    """An update started from ``base_version`` is dropped once the module is more than
    ``max_staleness`` versions ahead of it."""
    return version - base_version > max_staleness


def rounds_late(lag_rounds: float, own_share: float) -> float:
    """How late an update is, in rounds: the share of a round applied to its module since
    the version it started from (``lag_rounds``), beyond the rest of its own round.

    A round is every sharing path's contribution once (a synchronous step's worth; a
    partial step applies ``Σα/D`` of one). While an update's path trained, the other
    paths contributed too: with paths at one pace, the rest of a round, ``1 − own_share``
    (``own_share`` = its α/D). Those are its round-mates, as the other worker groups'
    pseudo-gradients are in a synchronous step from the same base: no lateness. Only the
    lag beyond them (a slow path, a phase that waited) is.
    """
    return max(0.0, float(lag_rounds) - (1.0 - float(own_share)))


def discount(staleness: float, power: float) -> float:
    """A kept update's weight factor ``(1 + s)^(-power)`` (``s``: :func:`rounds_late`)."""
    return (1.0 + max(0.0, staleness)) ** (-power)


def next_phase_ema(phase_ema: Optional[float], phase_s: Optional[float]) -> Optional[float]:
    """The EMA of a module's phase seconds after an update of a phase of ``phase_s`` seconds
    arrives (None: the update does not say; the EMA is unchanged)."""
    if phase_s is None:
        return phase_ema
    return float(phase_s) if phase_ema is None else 0.7 * phase_ema + 0.3 * float(phase_s)


def next_fill_ema(fill_ema: Optional[float], fill_s: float) -> float:
    """The EMA of seconds from the first pending update to quorum, after a quorum step
    (a grace expiry leaves it alone: widening it would make every worker that waits for
    this module wait longer whenever one sharing path is slow)."""
    return fill_s if fill_ema is None else 0.7 * fill_ema + 0.3 * fill_s
