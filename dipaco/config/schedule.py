"""Step counts and the learning-rate schedule of a run, in one place.

A path's inner steps, the dense warm-up that precedes them and the schedule over both
are computed from the config alone, so the rounds loop, the decoupled workers and the
dense models agree on them without importing each other.

The schedule is one or more **segments**, each a linear warm-up of
``trainer.warmup_steps`` then a cosine from ``trainer.lr`` to ``min_lr_ratio x lr`` at
the segment's end; outside every segment the floor ``min_lr_ratio x lr`` holds.
``trainer.lr_segments`` lists each segment's first and last round, flat
(``[start, end, start, end, ...]``); empty (every launch) means one segment over all of
``trainer.rounds``. The dense warm-up (``trainer.warmup_fraction``) belongs to the first
segment and is sized by it, so a run extended on resume keeps the warm-up it was
launched with. What more rounds do is ``trainer.extend_schedule``
(:func:`extended_segments`): ``continue`` (the default) keeps the launch's schedule, so
the added rounds train at the floor; ``restart`` adds a segment (warm-up and cosine) over
the added rounds. ``summary.json`` records the segments (:func:`describe_segments`).
"""
from __future__ import annotations

import math
from typing import Any, Sequence, Union

from dipaco.config import Config, TrainerConfig


def segment_rounds(cfg: Config) -> list[tuple[int, int]]:
    """``(first round, end round)`` of each learning-rate segment; ``[(0, trainer.rounds)]``
    by default."""
    flat = [int(r) for r in cfg.trainer.lr_segments] or [0, int(cfg.trainer.rounds)]
    return list(zip(flat[0::2], flat[1::2]))


def total_inner_steps(cfg: Config) -> list[tuple[int, int]]:
    """``(first step, end step)`` of each schedule segment, counted from the first warm-up
    step (the first segment starts at 0 and holds the dense warm-up): what :func:`lr_at`
    takes as ``segments``."""
    H, warm = cfg.diloco.inner_steps, warmup_steps(cfg)
    return [(warm + s * H if s else 0, warm + e * H) for s, e in segment_rounds(cfg)]


def warmup_steps(cfg: Config) -> int:
    """Dense warm-up steps: ``warmup_fraction`` of the first segment's inner steps (the
    launch's rounds: extending a run does not change its warm-up)."""
    f = cfg.trainer.warmup_fraction
    if f <= 0:
        return 0
    main = segment_rounds(cfg)[0][1] * cfg.diloco.inner_steps
    # f of the total: W = f·(W + main)  ⇒  W = f·main / (1 − f)
    return max(1, int(round(f * main / (1.0 - f))))


def lr_at(step: int, segments: Union[int, Sequence[tuple[int, int]]], cfg: TrainerConfig) -> float:
    """The learning rate of ``step``: in the segment holding it, a linear warm-up for
    ``cfg.warmup_steps``, then cosine to ``min_lr_ratio · lr`` at the segment's end; the
    floor outside every segment. ``segments``: one total (one segment from step 0) or
    :func:`total_inner_steps`."""
    spans = [(0, int(segments))] if isinstance(segments, int) else [(int(a), int(b)) for a, b in segments]
    floor = cfg.lr * cfg.min_lr_ratio
    for start, end in spans:
        if start <= step < end:
            break
    else:
        return floor  # (the cosine's own value at its end: cos(pi) = -1 exactly)
    local = step - start
    if cfg.warmup_steps > 0 and local < cfg.warmup_steps:
        return cfg.lr * (local + 1) / cfg.warmup_steps
    span = max(1, end - start - cfg.warmup_steps)
    progress = min(1.0, (local - cfg.warmup_steps) / span)
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * progress))


def extended_segments(saved_rounds: int, saved_segments: Sequence[int], rounds: int, how: str) -> list[int]:
    """``trainer.lr_segments`` of a resume that takes a run of ``saved_rounds`` rounds to
    ``rounds``: ``continue`` keeps the launch's segments (the added rounds at the floor);
    ``restart`` adds a segment from ``saved_rounds`` to ``rounds``."""
    flat = [int(r) for r in saved_segments] or [0, int(saved_rounds)]
    if rounds > saved_rounds and how == "restart":
        flat += [int(saved_rounds), int(rounds)]
    return flat


def describe_segments(cfg: Config) -> list[dict[str, Any]]:
    """What the learning rate did, round by round, for ``summary.json``: each segment
    (rounds, inner steps with the warm-up in the first, warm-up and cosine) and each
    stretch at the floor (rounds an extension added with ``extend_schedule=continue``)."""
    t = cfg.trainer
    floor = f"floor {t.lr * t.min_lr_ratio:g} (trainer.extend_schedule=continue kept the schedule before)"
    steps = dict(zip(segment_rounds(cfg), total_inner_steps(cfg)))
    H, warm, out, done = cfg.diloco.inner_steps, warmup_steps(cfg), [], 0
    for s, e in segment_rounds(cfg):
        if s > done:
            out.append({"rounds": [done, s], "steps": [warm + done * H, warm + s * H], "lr": floor})
        out.append({"rounds": [s, e], "steps": list(steps[(s, e)]),
                    "lr": f"warm-up {t.warmup_steps} steps, cosine {t.lr:g} -> {t.lr * t.min_lr_ratio:g}"})
        done = e
    if t.rounds > done:
        out.append({"rounds": [done, t.rounds], "steps": [warm + done * H, warm + t.rounds * H], "lr": floor})
    return out


def extension_note(cfg: Config, saved_rounds: int) -> str:
    """One log line: what the learning rate does over the rounds a resume adds."""
    t = cfg.trainer
    if segment_rounds(cfg)[-1][1] >= t.rounds:
        return (f"trainer.rounds {saved_rounds} -> {t.rounds}: a new learning-rate segment over rounds "
                f"{saved_rounds}-{t.rounds} (warm-up, cosine to {t.lr * t.min_lr_ratio:g}; "
                "trainer.extend_schedule=restart)")
    return (f"trainer.rounds {saved_rounds} -> {t.rounds}: the learning-rate schedule continues the launch's, so "
            f"the added rounds train at its floor {t.lr * t.min_lr_ratio:g} (trainer.extend_schedule=continue; "
            "=restart runs a new warm-up and cosine over them)")
