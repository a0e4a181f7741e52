"""The decoupled merge does not depend on arrival order within a version, whatever the
outer optimiser: two stale phases of a path from the same base land where both at once
would, with plain SGD, Nesterov every step, the default delayed Nesterov and AdamW
(dipaco/decoupled/merge.py, MergingModuleSync._outer_step; docs/decoupled.md)."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from dipaco.config import DiLoCoConfig
from dipaco.config.decoupled import DecoupledConfig
from dipaco.decoupled.merge import MergingModuleSync, Update
from dipaco.sync.outer import outer_options

OUTERS = {
    "sgd": {"name": "sgd", "lr": 1.0, "momentum": 0.0, "nesterov": False},
    "nesterov": {"name": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True},
    "delayed_nesterov": outer_options(DiLoCoConfig(mode="decoupled")),  # the default
    "adamw": {"name": "adamw", "lr": 0.05, "betas": (0.9, 0.95)},
}


def phase(s: MergingModuleSync, path: int, k: int, base: int, delta: float, tokens: float = 1.0) -> None:
    assert s.offer(Update(f"p{path}k{k}", "m", path, k, base, tokens, torch.full((3,), delta)), 0.0) is None


def history(s: MergingModuleSync) -> None:
    """A few earlier fresh steps, so the optimiser state (momentum, moments) is not zero."""
    for k in range(3):
        phase(s, 0, 10 + k, s.version, -0.3)
        phase(s, 1, 10 + k, s.version, -0.2)
        s.step(0.0)


@pytest.mark.parametrize("outer", sorted(OUTERS))
@pytest.mark.parametrize("d1,d2", [(-0.9, -0.9), (-0.9, -0.5)])
def test_two_stale_phases_from_one_base_land_the_same_in_either_order(outer: str, d1: float, d2: float) -> None:
    cfg: Any = DecoupledConfig(quorum=0.5, max_staleness=8)
    runs = []
    for order in ("together", "first_then_second", "second_then_first"):
        s = MergingModuleSync("m", torch.zeros(3), [0, 1], cfg, OUTERS[outer])
        history(s)
        base = s.version
        phase(s, 1, 20, base, -0.4)  # the other path's fresh update: the version moves on
        s.step(0.0)
        if order == "together":
            phase(s, 0, 21, base, d1)
            phase(s, 0, 22, base, d2)
            s.step(0.0)
        else:
            first, second = ((21, d1), (22, d2)) if order == "first_then_second" else ((22, d2), (21, d1))
            phase(s, 0, first[0], base, first[1])
            s.step(0.0)
            phase(s, 0, second[0], base, second[1])
            assert s.step(0.0).amended == (outer != "sgd")  # plain SGD needs no second take
        runs.append(s.theta.clone())
    for other in runs[1:]:
        torch.testing.assert_close(other, runs[0], rtol=0, atol=1e-6)


def test_a_restart_between_them_falls_back_to_a_correction_step() -> None:
    """The state before the last step is not saved: after a restart the late phase steps
    alone (the bounded, order-dependent case docs/decoupled.md measures)."""
    s = MergingModuleSync("m", torch.zeros(3), [0, 1], DecoupledConfig(quorum=0.5), OUTERS["nesterov"])
    phase(s, 0, 1, 0, -0.9)
    s.step(0.0)
    state = s.state_dict()
    t = MergingModuleSync("m", torch.zeros(3), [0, 1], DecoupledConfig(quorum=0.5), OUTERS["nesterov"])
    t.load_state_dict(state)
    phase(t, 0, 2, 0, -0.9)
    assert not t.step(0.0).amended
