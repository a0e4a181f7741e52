"""The round as a schedule of per-module sync points, and launch() / finish() per module."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from dipaco.sync.diloco import DiLoCoSync, RoundSchedule, SyncEvent, SyncPoint
from dipaco.plan.topology import Topology

IDS = ["embed", "L0.0", "L0.1", "head"]
PATHS = [["embed", "L0.0", "head"], ["embed", "L0.1", "head"]]
AVG = dict(name="sgd", lr=1.0, momentum=0.0, nesterov=False)


def _sync(value: float = 0.0) -> tuple[DiLoCoSync, dict[str, nn.Module]]:
    mods = {m: nn.Linear(2, 1, bias=False) for m in IDS}
    with torch.no_grad():
        for lin in mods.values():
            lin.weight.fill_(value)
    return DiLoCoSync(Topology(IDS, PATHS, world_size=1), mods, outer=AVG), mods


def _train(sync: DiLoCoSync, mods: dict[str, nn.Module], p: int, to: float, tokens: float = 1.0) -> None:
    sync.begin_path(p)
    with torch.no_grad():
        for m in PATHS[p]:
            mods[m].weight.fill_(to)
    sync.end_path(p, tokens)


def test_the_synchronous_schedule_is_one_sync_point_at_step_h() -> None:
    s = RoundSchedule.synchronous(IDS, 50)
    assert s.is_synchronous
    assert s.events() == [SyncEvent(50, tuple(IDS), tuple(IDS))]
    assert s.restrict(["head", "embed"]).events() == [SyncEvent(50, ("embed", "head"), ("embed", "head"))]


def test_a_staggered_schedule_lists_its_sync_points_in_step_order() -> None:
    s = RoundSchedule(4, {"embed": SyncPoint(1, 2), "L0.0": SyncPoint(2, 4), "head": SyncPoint(4, 4)})
    assert not s.is_synchronous
    assert s.events() == [SyncEvent(1, ("embed",), ()), SyncEvent(2, ("L0.0",), ("embed",)),
                          SyncEvent(4, ("head",), ("L0.0", "head"))]
    for bad in (SyncPoint(0, 1), SyncPoint(3, 2), SyncPoint(2, 5)):
        with pytest.raises(ValueError, match="launch <= finish <= H"):
            RoundSchedule(4, {"embed": bad})
    with pytest.raises(ValueError, match="synchronous schedules"):  # not built yet: streaming
        DiLoCoSync(Topology(IDS, PATHS, world_size=1), {m: nn.Linear(2, 1) for m in IDS}, schedule=s)


def test_launch_hands_later_contributions_to_the_next_round_and_finish_leaves_the_live_weights() -> None:
    sync, mods = _sync()
    _train(sync, mods, 0, 1.0)
    ms = sync.syncs["L0.0"]
    with pytest.raises(RuntimeError, match="without launch"):
        ms.finish()
    ms.launch()
    assert ms.in_flight
    with pytest.raises(RuntimeError, match="in flight"):
        ms.launch()
    # a contribution made while the exchange is in flight belongs to the next round
    with torch.no_grad():
        mods["L0.0"].weight.fill_(5.0)
    assert ms.contribute(0, 1.0, 0)
    stats = ms.finish()
    assert stats.stepped and stats.contributions == 1
    assert float(ms.core.weights[0]) == pytest.approx(1.0)  # the first contribution only
    assert float(mods["L0.0"].weight.detach()[0, 0]) == 5.0  # finish leaves the live weights alone
    ms.launch()
    assert ms.finish().contributions == 1
    # its Δ = 0 − 5 was taken against the θ_global of its own time (0): the step adds 5
    assert float(ms.core.weights[0]) == pytest.approx(1.0 + 5.0)


@pytest.mark.parametrize("mix", [1.0, 0.25])
def test_finish_replaces_or_mixes_the_new_global_weights_into_the_live_ones(mix: float) -> None:
    sync, mods = _sync()
    for p, to in ((0, 2.0), (1, 4.0)):
        _train(sync, mods, p, to)
    with torch.no_grad():
        mods["embed"].weight.fill_(10.0)  # what the path learnt since (streaming keeps part of it)
    sync.launch(["head", "embed"])  # launched in the global module order whatever the order asked
    stats = sync.finish(["embed", "head"], mix=mix)
    assert list(stats) == ["embed", "head"]
    theta = float(sync.syncs["embed"].core.weights[0])
    assert theta == pytest.approx(3.0)  # the mean of the two paths
    assert float(mods["embed"].weight.detach()[0, 0]) == pytest.approx(10.0 + mix * (theta - 10.0))
    assert float(mods["head"].weight.detach()[0, 0]) == pytest.approx(4.0 + mix * (theta - 4.0))
