"""What a run of rounds hands back to the job: one type for both sync modes.

:func:`dipaco.rounds.run_rank` (synchronous DiLoCo, on every rank; the launcher keeps
rank 0's) and :func:`dipaco.decoupled.run.run_decoupled` (the decoupled supervisor) both
return a :class:`RoundsResult`; :mod:`dipaco.job.train` reads it to decide whether the run is
finished, which checkpoint to evaluate, and what goes into ``summary.json``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["RoundsResult"]


@dataclass
class RoundsResult:
    """Totals of one run of rounds (all ranks summed; times are the slowest rank's).

    Attributes:
        rounds: rounds the config asks for (``trainer.rounds``).
        completed_rounds: rounds done when the run stopped (``< rounds``: stopped early,
            resume continues it).
        start_round: the round this launch started from (> 0 after a resume).
        world_size: ranks that trained (for the DDP-bytes comparison of the summary).
        tokens: training tokens of every path in this launch.
        bytes_sent: pseudo-gradient bytes put on the wire, every rank summed.
        compute_s: inner steps (slowest rank).
        wait_s: waiting at the round barrier for the slowest worker group.
        sync_s: the exchange and outer step themselves.
        checkpoint: the newest checkpoint directory, or None when none was written.
        decoupled: decoupled mode's goodput / staleness / drop metrics; None in sync mode.
        device: where the paths trained (``cpu``, ``cuda:0``, ...).
        peak_memory_bytes: the largest peak of any rank (CUDA allocator, or RSS on the CPU).
        resumed_from_round: the round this run was resumed from (totals are then the whole
            run's: the rounds before come from ``metrics.jsonl``), None for a fresh run.
        totals_missing_rounds: rounds before the resume whose totals were not found.
    """

    rounds: int
    completed_rounds: int
    start_round: int
    world_size: int
    tokens: int = 0
    bytes_sent: int = 0
    compute_s: float = 0.0
    wait_s: float = 0.0
    sync_s: float = 0.0
    checkpoint: Optional[str] = None
    decoupled: Optional[dict[str, Any]] = None
    device: Optional[str] = None
    peak_memory_bytes: Optional[int] = None
    resumed_from_round: Optional[int] = None
    totals_missing_rounds: int = 0

    @property
    def finished(self) -> bool:
        """Every configured round is done."""
        return self.completed_rounds >= self.rounds

    def after(self, earlier: "RoundsResult") -> "RoundsResult":
        """This launch continued from ``earlier`` (a re-shard): one result for both.

        Traffic, tokens and times add up; the start round is the first launch's.
        """
        return dataclasses.replace(
            self,
            start_round=earlier.start_round,
            tokens=self.tokens + earlier.tokens,
            bytes_sent=self.bytes_sent + earlier.bytes_sent,
            compute_s=self.compute_s + earlier.compute_s,
            wait_s=self.wait_s + earlier.wait_s,
            sync_s=self.sync_s + earlier.sync_s,
        )
