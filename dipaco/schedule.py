"""Step counts and the learning-rate schedule of a run, in one place.

A path's inner steps, the dense warm-up that precedes them and the schedule over both
are computed from the config alone, so the rounds loop, the decoupled workers and the
dense models agree on them without importing each other.
"""
from __future__ import annotations

import math

from dipaco.config import Config, TrainerConfig


def total_inner_steps(cfg: Config) -> int:
    """Steps of one path over the whole run, warm-up included (sets the LR schedule)."""
    return warmup_steps(cfg) + cfg.trainer.rounds * cfg.diloco.inner_steps


def warmup_steps(cfg: Config) -> int:
    """Dense warm-up steps: ``warmup_fraction`` of a path's total inner steps."""
    f = cfg.trainer.warmup_fraction
    if f <= 0:
        return 0
    main = cfg.trainer.rounds * cfg.diloco.inner_steps
    # f of the total: W = f·(W + main)  ⇒  W = f·main / (1 − f)
    return max(1, int(round(f * main / (1.0 - f))))


def lr_at(step: int, total_steps: int, cfg: TrainerConfig) -> float:
    """Linear warm-up for ``cfg.warmup_steps``, then cosine to ``min_lr_ratio · lr``."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * progress))
