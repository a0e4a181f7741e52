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

__all__ = ["quorum_size", "grace_window", "step_due", "is_stale", "rounds_late", "discount", "next_fill_ema"]


def quorum_size(share: float, sharing: int) -> int:
    """How many of ``sharing`` paths must have reported before an outer step (>= 1)."""
    return max(1, math.ceil(share * sharing - 1e-9))


def grace_window(cfg: DecoupledConfig, fill_ema: Optional[float]) -> float:
    """The grace window: ``grace_factor`` x EMA(fill time), clipped to [min, max]; the
    initial window until a quorum has filled once."""
    base = cfg.grace_init_s if fill_ema is None else cfg.grace_factor * fill_ema
    return min(cfg.grace_max_s, max(cfg.grace_min_s, base))


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


def next_fill_ema(fill_ema: Optional[float], fill_s: float) -> float:
    """The EMA of seconds from the first pending update to quorum, after a quorum step
    (a grace expiry leaves it alone: widening it would make every worker that waits for
    this module wait longer whenever one sharing path is slow)."""
    return fill_s if fill_ema is None else 0.7 * fill_ema + 0.3 * fill_s
