"""What one simulated mode reports: :class:`Tally` while it runs, :class:`ModeResult` after.

Goodput is applied inner-step time over chip time: a path's inner step counts the
seconds it took on its worker group (``step_s`` x its straggler factor) x the group's
chips once its outer step is applied (and not rolled back by a failure), over ``chips x
wall`` (docs/decoupled.md's definition: a slow group's steps are work, the others'
waiting for it is not). Waiting for the slowest group, exposed communication, failures,
restarts, idle groups and dropped updates lower it.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Optional

__all__ = ["Tally", "ModeResult"]


@dataclass
class Tally:
    """Running totals of one mode's simulation."""

    applied_steps: float = 0.0  # path inner steps whose outer step was applied
    applied_busy: float = 0.0  # the same in nominal steps x their straggler factor: the time they took
    executed_steps: float = 0.0  # path inner steps run (applied, rolled back, dropped)
    rounds: int = 0  # rounds (decoupled: module outer steps) applied
    exposed_s: float = 0.0  # the inner loop stood for the link
    compute_s: float = 0.0  # wall seconds of the rounds' compute (stragglers included)
    bytes: float = 0.0  # bytes every rank sent, all of them together
    failures: int = 0
    target_steps: float = math.inf  # applied path steps that make the run's budget
    target_at: Optional[float] = None  # when they were reached

    def apply(self, steps: float, now: float, factor: float = 1.0) -> None:
        """``steps`` more path inner steps, run ``factor`` x slower than nominal, are applied at ``now``."""
        self.applied_steps += steps
        self.applied_busy += steps * factor
        if self.target_at is None and self.applied_steps >= self.target_steps - 1e-9:
            self.target_at = now


@dataclass(frozen=True)
class ModeResult:
    """One sync mode's prediction (per round figures are means over the rounds run)."""

    mode: str
    wall_s: float
    rounds: int
    wall_per_round_s: float
    exposed_per_round_s: float
    exposed_share: float  # exposed communication / wall
    bytes_per_round: float
    goodput: float
    steps_lost: float  # path inner steps run but never applied (failures, drops)
    failures: int
    time_to_tokens_s: Optional[float]  # the config's budget of tokens applied (None: not within the horizon)
    tokens_applied: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def result(mode: str, t: Tally, wall: float, chips: int, chip_s_per_step: float, tokens_per_step: int,
           rounds: Optional[int] = None) -> ModeResult:
    """The :class:`ModeResult` of a finished tally over ``wall`` seconds on ``chips`` chips."""
    n = max(1, t.rounds if rounds is None else rounds)
    return ModeResult(
        mode=mode, wall_s=wall, rounds=n, wall_per_round_s=wall / n, exposed_per_round_s=t.exposed_s / n,
        exposed_share=t.exposed_s / wall if wall > 0 else 0.0, bytes_per_round=t.bytes / n,
        goodput=t.applied_busy * chip_s_per_step / (chips * wall) if wall > 0 else 0.0,
        steps_lost=max(0.0, t.executed_steps - t.applied_steps), failures=t.failures,
        time_to_tokens_s=t.target_at, tokens_applied=t.applied_steps * tokens_per_step)
