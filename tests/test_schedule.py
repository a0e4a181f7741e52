"""The learning-rate schedule in segments (dipaco/config/schedule.py): one segment reproduces the
old schedule exactly; an extension that continues the launch's schedule trains the added
rounds at the floor and keeps the warm-up's size; a restart adds a segment; the summary's
record says what happened round by round."""
from __future__ import annotations

import math

import pytest

from dipaco.config import ConfigError, compose_config
from dipaco.config.schedule import (describe_segments, extended_segments, lr_at, segment_rounds, total_inner_steps,
                             warmup_steps)
from dipaco.config.validate import validate_config


def old_lr_at(step: int, total_steps: int, cfg) -> float:
    """The schedule before segments (57deba0), for comparison."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * progress))


@pytest.mark.parametrize("overrides", [["experiment=smoke"], ["trainer.warmup_fraction=0.25"], []])
def test_one_segment_is_the_schedule_every_run_had(overrides):
    cfg = compose_config(overrides)
    (ends,) = total_inner_steps(cfg)
    total = warmup_steps(cfg) + cfg.trainer.rounds * cfg.diloco.inner_steps
    assert ends == (0, total)
    for step in range(0, total + 5):
        assert lr_at(step, [ends], cfg.trainer) == old_lr_at(step, total, cfg.trainer), step
        assert lr_at(step, total, cfg.trainer) == old_lr_at(step, total, cfg.trainer), step


def test_continue_keeps_the_launch_schedule_and_warmup():
    launch = compose_config(["trainer.rounds=4", "trainer.warmup_fraction=0.25"])
    extended = compose_config(["trainer.rounds=8", "trainer.warmup_fraction=0.25",
                               f"trainer.lr_segments={extended_segments(4, [], 8, 'continue')}"])
    validate_config(extended)
    assert warmup_steps(extended) == warmup_steps(launch)
    (end,) = [e for _, e in total_inner_steps(launch)]
    for step in range(0, end + 4 * 50):
        want = old_lr_at(step, end, launch.trainer)
        assert lr_at(step, total_inner_steps(extended), extended.trainer) == want
    assert [s["lr"].split()[0] for s in describe_segments(extended)] == ["warm-up", "floor"]


def test_restart_adds_a_segment_from_where_the_run_stopped():
    assert extended_segments(2, [], 4, "restart") == [0, 2, 2, 4]
    assert extended_segments(4, [0, 2], 6, "restart") == [0, 2, 4, 6]  # rounds 2-4 stay at the floor
    assert extended_segments(4, [0, 2, 2, 4], 6, "continue") == [0, 2, 2, 4]
    cfg = compose_config(["experiment=smoke", "trainer.rounds=6", "trainer.lr_segments=[0,2,4,6]"])
    validate_config(cfg)
    assert segment_rounds(cfg) == [(0, 2), (4, 6)]
    lrs = [lr_at(s, total_inner_steps(cfg), cfg.trainer) for s in range(24)]
    floor = cfg.trainer.lr * cfg.trainer.min_lr_ratio
    assert lrs[8:16] == [floor] * 8 and lrs[16] < lrs[17] == cfg.trainer.lr  # a new warm-up at round 4
    assert [s["rounds"] for s in describe_segments(cfg)] == [[0, 2], [2, 4], [4, 6]]


@pytest.mark.parametrize("segments", ["[2]", "[0,3]", "[2,1]", "[0,2,1,3]", "[0,0]"])
def test_segments_that_are_not_pairs_inside_the_run_are_refused(segments):
    with pytest.raises(ConfigError) as err:
        validate_config(compose_config(["experiment=smoke", f"trainer.lr_segments={segments}"]))
    assert err.value.key == "trainer.lr_segments"
