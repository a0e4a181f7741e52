"""What one turn of a path's inner steps did, kept on the device and read once.

:class:`TurnLog` is the path learner's record of a turn (:meth:`PathLearner.train_steps
<dipaco.rounds.learner.PathLearner.train_steps>`): each step writes its loss, gradient
norm (the one clipping computed) and skip flag into a row of one device tensor, without
reading anything back; the host adds what it already knows (the step's target tokens,
counted on the host batch, and its learning rate). At the end of the turn the rows are
read in one device → host copy, and the host derives

* the turn's totals (:class:`InnerStats`: the applied steps' loss sum, steps, skips and
  tokens, α of the round), summed in float64 in step order as before;
* with ``every > 0``, one *interval* per ``every`` steps of the path's step count (and
  one for the turn's last steps when the turn does not end on a multiple): the
  per-step health metrics of docs/metrics.md. Its time is the device's: CUDA events
  recorded at the interval's ends (read after the copy, so no extra synchronisation),
  or the host clock on the CPU, where every kernel has finished when it returns.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from dipaco.runtime.hardware import memory_snapshot

__all__ = ["InnerStats", "TurnLog"]


@dataclass
class InnerStats:
    """What one turn of inner steps did."""

    steps: int = 0
    tokens: int = 0  # target tokens that carried loss: the path's α this round
    loss_sum: float = 0.0
    seconds: float = 0.0
    skipped: int = 0  # steps whose gradient was NaN/inf: not applied (docs/reliability.md)
    # with per-step metrics on: one dict per logging interval of the turn (TurnLog)
    intervals: list[dict[str, Any]] = field(default_factory=list)

    @property
    def loss(self) -> float:
        return self.loss_sum / max(1, self.steps)


def _mean(xs: list[float]) -> Optional[float]:
    return sum(xs) / len(xs) if xs else None


class TurnLog:
    """One turn's per-step values on the device, read once by :meth:`read`.

    Args:
        device: where the steps run.
        n: the most steps the turn takes.
        every: an interval ends after each step whose count (``step``) is a multiple of
            it; 0: no intervals (the dense models, decoupled workers).
        step0: the path's step count before the turn.
    """

    def __init__(self, device: torch.device, n: int, every: int, step0: int) -> None:
        self.device, self.every, self.step0 = device, int(every), int(step0)
        self.rows = torch.empty((max(1, n), 3), dtype=torch.float64, device=device)  # loss, norm, skipped
        self.k = 0
        self.tokens: list[int] = []
        self.lrs: list[float] = []
        self.data_s: list[float] = []  # host seconds each step waited for its batch
        self.marks: list[tuple[int, Any, dict[str, int]]] = []  # (steps before, clock, memory)
        if self.every:
            self._mark()

    def add(self, loss: torch.Tensor, norm: torch.Tensor, bad: torch.Tensor, tokens: int, lr: float,
            step: int, data_s: float = 0.0) -> None:
        """Step ``step`` (the path's count after it): device values stay on the device;
        ``data_s``: the host seconds the step waited for its batch."""
        self.rows[self.k] = torch.stack([loss.detach().to(torch.float64), norm.detach().to(torch.float64),
                                         bad.to(torch.float64)])
        self.k += 1
        self.tokens.append(tokens)
        self.lrs.append(lr)
        self.data_s.append(float(data_s))
        if self.every and step % self.every == 0:
            self._mark()

    def _mark(self) -> None:
        if self.device.type == "cuda":
            clock: Any = torch.cuda.Event(enable_timing=True)
            clock.record()
        else:
            clock = time.perf_counter()
        self.marks.append((self.k, clock, memory_snapshot(self.device)))

    def _seconds(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1e3 if self.device.type == "cuda" else b - a

    def read(self) -> InnerStats:
        """The turn's totals and intervals, from one device → host copy."""
        if self.every and self.marks[-1][0] != self.k:
            self._mark()  # the turn's last steps, short of a multiple of `every`
        rows = self.rows[: self.k].tolist()  # the turn's one device → host read
        stats = InnerStats()
        for (loss, _norm, bad), tokens in zip(rows, self.tokens):
            if bad:
                stats.skipped += 1
            else:  # float64, in step order: the sum the device accumulated before
                stats.loss_sum += loss
                stats.steps += 1
                stats.tokens += tokens
        for (ka, ta, _), (kb, tb, memory) in zip(self.marks, self.marks[1:]):
            ok = [r for r in rows[ka:kb] if not r[2]]
            losses = [r[0] for r in ok if math.isfinite(r[0])]
            norms = [r[1] for r in ok]
            stats.intervals.append({
                "step": self.step0 + kb, "steps": kb - ka, "skipped_steps": kb - ka - len(ok),
                "loss": _mean(losses), "loss_max": max(losses, default=None),
                "grad_norm": _mean(norms), "grad_norm_max": max(norms, default=None),
                "lr": self.lrs[kb - 1], "tokens": sum(self.tokens[ka:kb]),
                "seconds": self._seconds(ta, tb), "data_s": sum(self.data_s[ka:kb]), "memory": memory})
        return stats
