"""Lateness in rounds (dipaco/decoupled/quorum.py ``rounds_late``): a partial step applies
Σα/D of a round, and an update is discounted only for the rounds applied since its base
beyond the rest of its own round. Two half-quorum steps from one base are then the
synchronous step with the default discount on (it used to discount the second, a
round-mate, by (1 + 1)^-0.5: 0.71 of its weight)."""
from __future__ import annotations

import pytest
import torch

from dipaco.config.decoupled import DecoupledConfig
from dipaco.decoupled import quorum as rules
from dipaco.decoupled.merge import MergingModuleSync, Update

SGD = {"name": "sgd", "lr": 1.0, "momentum": 0.0, "nesterov": False}


def _update(uid: str, path: int, phase: int, base: int, delta: list[float], tokens: float = 100.0) -> Update:
    return Update(uid, "m", path, phase, base, tokens, torch.tensor(delta))


def test_round_mates_are_not_late_and_true_lag_is() -> None:
    assert rules.rounds_late(0.5, 0.5) == 0.0  # the other half of its round was applied first
    assert rules.rounds_late(0.75, 0.25) == 0.0  # three round-mates of four
    assert rules.rounds_late(1.5, 0.5) == pytest.approx(1.0)  # a round more than its round-mates
    assert rules.rounds_late(0.0, 1.0) == 0.0  # a whole synchronous round


def test_half_quorum_steps_from_one_base_are_the_synchronous_step_with_the_default_discount() -> None:
    """Two paths, quorum 0.5, lr 1: one path's half step, then the other's from the same
    base, land on the token-weighted mean, as one synchronous step does."""
    d = DecoupledConfig(quorum=0.5)
    assert d.staleness_power > 0  # the default discount is on
    full = MergingModuleSync("m", torch.zeros(2), [0, 1], DecoupledConfig(quorum=1.0), SGD)
    half = MergingModuleSync("m", torch.zeros(2), [0, 1], d, SGD)
    for s in (full, half):
        s.offer(_update("a", 0, 0, 0, [4.0, 0.0]), 0.0)
        if s is half:
            s.step(0.0)
        s.offer(_update("b", 1, 0, 0, [0.0, 2.0]), 0.0)
        rec = s.step(0.0)
    assert rec.staleness == [1] and rec.rounds_late == [0.0] and rec.weights == [100.0]
    torch.testing.assert_close(half.theta, full.theta)
    torch.testing.assert_close(full.theta, torch.tensor([-2.0, -1.0]))


def test_an_update_a_round_behind_its_round_mates_is_discounted() -> None:
    """Path 0 contributes three half rounds while path 1's phase from version 0 runs: path
    1's update is one round late (1.5 applied, 0.5 of them its round-mates'), weight 2^-0.5."""
    s = MergingModuleSync("m", torch.zeros(2), [0, 1], DecoupledConfig(quorum=0.5), SGD)
    for k in range(3):
        s.offer(_update(f"a{k}", 0, k, s.version, [0.0, 0.0]), 0.0)
        s.step(0.0)
    s.offer(_update("late", 1, 0, 0, [2.0, 2.0]), 0.0)
    rec = s.step(0.0)
    assert rec.staleness == [3] and rec.rounds_late == [pytest.approx(1.0)]
    assert rec.weights == [pytest.approx(100.0 * 2 ** -0.5)]
    torch.testing.assert_close(s.theta, torch.full((2,), -(2 ** -0.5)))  # its half of a round, discounted


def test_the_rounds_clock_is_kept_with_the_module_version() -> None:
    s = MergingModuleSync("m", torch.zeros(2), [0, 1], DecoupledConfig(quorum=0.5), SGD)
    for k in range(3):
        s.offer(_update(f"a{k}", 0, k, s.version, [1.0, 0.0]), 0.0)
        s.step(0.0)
    back = MergingModuleSync("m", torch.zeros(2), [0, 1], DecoupledConfig(quorum=0.5), SGD)
    back.load_state_dict(s.state_dict())
    assert back.rounds_at == s.rounds_at == {0: 0.0, 1: 0.5, 2: 1.0, 3: 1.5}
    old = s.state_dict()
    del old["rounds_at"]  # a store written before the clock: one round a version from here on
    back.load_state_dict(old)
    assert back.rounds_at == {3: 3.0}


@pytest.mark.parametrize("every", [1, 4])
def test_half_quorum_rounds_are_synchronous_rounds_momentum_included(every: int) -> None:
    """Delayed Nesterov counts its period in rounds: two half steps per round (quorum 0.5,
    two sharing paths) land where one full step per round does, momentum and all, over
    eight rounds (counted in steps, the momentum fired twice as often on half gradients)."""
    outer = {"name": "delayed_nesterov", "lr": 0.7, "momentum": 0.9, "nesterov": True, "every": every, "scale": 0.0}
    full = MergingModuleSync("m", torch.zeros(3), [0, 1], DecoupledConfig(quorum=1.0), outer)
    half = MergingModuleSync("m", torch.zeros(3), [0, 1], DecoupledConfig(quorum=0.5), outer)
    gen = torch.Generator().manual_seed(0)
    for r in range(8):
        deltas = [torch.randn(3, generator=gen).tolist() for _ in (0, 1)]
        for s in (full, half):
            base = s.version
            for p in (0, 1):
                s.offer(_update(f"r{r}p{p}", p, r, base, deltas[p]), 0.0)
                if s is half:
                    s.step(0.0)
            if s is full:
                s.step(0.0)
        torch.testing.assert_close(half.theta, full.theta, rtol=1e-5, atol=1e-6)
    assert half.version == 2 * full.version == 16
