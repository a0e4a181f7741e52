"""The round as a schedule of per-module sync points, launch() / land() per module, and the
round driver that runs every schedule (a synchronous round keeps no per-path copy)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import dipaco.sync.round_driver as round_driver
from dipaco.plan.schedule import RoundSchedule, SyncPoint
from dipaco.sync.diloco import DiLoCoSync
from dipaco.sync.round_driver import RoundDriver
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
    """Path ``p``'s turn on the module syncs themselves: θ_global live, trained to ``to``, α·Δ."""
    for m in PATHS[p]:
        sync.syncs[m].restore()
        with torch.no_grad():
            mods[m].weight.fill_(to)
        sync.syncs[m].contribute(p, tokens, sync.topology.group_of_path(p))


def test_the_synchronous_schedule_is_one_sync_point_at_step_h() -> None:
    s = RoundSchedule.synchronous(IDS, 50)
    assert s.is_synchronous and s.replaces_only
    assert s.boundaries() == [50]
    assert s.launching(50) == IDS
    assert s.restrict(["head", "embed"]).launching(50) == ["embed", "head"]  # the global order kept
    assert s.of_round(0, 3) is s


def test_a_staggered_schedule_cuts_the_turns_at_its_steps_and_ends_synchronous() -> None:
    s = RoundSchedule(4, {"embed": SyncPoint(1, 2), "L0.0": SyncPoint(2, 4), "head": SyncPoint(4, 4)})
    assert not s.is_synchronous and not s.replaces_only
    assert s.boundaries() == [1, 2, 4]
    assert s.launching(2) == ["L0.0"] and s.launching(4, ["embed", "head"]) == ["head"]
    assert s.of_round(1, 3) is s and s.of_round(2, 3).is_synchronous  # the run's last round
    for bad in (SyncPoint(0, 1), SyncPoint(3, 2), SyncPoint(2, 5)):
        with pytest.raises(ValueError, match="launch <= land <= H"):
            RoundSchedule(4, {"embed": bad})


def _round_by_driver(driver: RoundDriver, mods: dict[str, nn.Module], targets: dict[int, float]) -> None:
    schedule = driver.begin_round(0)
    for step in schedule.boundaries():
        for p, to in targets.items():
            driver.activate(p)
            with torch.no_grad():
                for m in PATHS[p]:
                    mods[m].weight.add_(to)
            driver.contribute(p, step, 1, lambda p, tokens: float(tokens))
        driver.sync_point(step)
    driver.end_round()


def test_a_synchronous_round_by_the_driver_keeps_no_copy_and_equals_diloco_on_the_module_syncs(monkeypatch) -> None:
    """Every landing replaces: no path's copy is set aside (no flatten, no memory), and the
    global and live weights are DiLoCo's round on the module syncs themselves, bit for bit."""
    ref, ref_mods = _sync(0.5)
    for p, to in ((0, 2.0), (1, -1.0)):
        _train(ref, ref_mods, p, 0.5 + to)
    for s in ref.syncs.values():
        s.launch()
        s.land()
        s.restore()

    def no_copy(*a, **k):
        raise AssertionError("a synchronous round set a path's copy aside")
    monkeypatch.setattr(round_driver, "flatten_params", no_copy)
    sync, mods = _sync(0.5)
    driver = RoundDriver(sync, RoundSchedule.synchronous(IDS, 3), rounds=2)
    _round_by_driver(driver, mods, {0: 2.0, 1: -1.0})
    assert driver.copies == {} and set(driver.resident.values()) == {None}
    for m in IDS:
        assert torch.equal(sync.syncs[m].global_weights, ref.syncs[m].global_weights), m
        assert torch.equal(mods[m].weight, ref_mods[m].weight), m


def test_a_mixing_schedule_keeps_each_paths_copy() -> None:
    """The control: a landing that mixes (τ > 0) sets the other path's copy aside."""
    sync, mods = _sync(0.5)
    driver = RoundDriver(sync, RoundSchedule(2, {m: SyncPoint(1, 2) for m in IDS}), rounds=2)
    _round_by_driver(driver, mods, {0: 2.0, 1: -1.0})
    assert driver.copies and driver.holds_path_state


def test_launch_hands_later_contributions_to_the_next_round_and_land_leaves_the_live_weights() -> None:
    sync, mods = _sync()
    _train(sync, mods, 0, 1.0)
    ms = sync.syncs["L0.0"]
    with pytest.raises(RuntimeError, match="without launch"):
        ms.land()
    ms.launch()
    assert ms.in_flight
    with pytest.raises(RuntimeError, match="in flight"):
        ms.launch()
    # a contribution made while the exchange is in flight belongs to the next round
    with torch.no_grad():
        mods["L0.0"].weight.fill_(5.0)
    assert ms.contribute(0, 1.0, 0)
    stats = ms.land()
    assert stats.stepped and stats.contributions == 1
    assert float(ms.global_weights.detach()[0]) == pytest.approx(1.0)  # the first contribution only
    assert float(mods["L0.0"].weight.detach()[0, 0]) == 5.0  # land leaves the live weights alone
    ms.launch()
    assert ms.land().contributions == 1
    # its Δ = 0 − 5 was taken against the θ_global of its own time (0): the step adds 5
    assert float(ms.global_weights.detach()[0]) == pytest.approx(1.0 + 5.0)


@pytest.mark.parametrize("mix", [1.0, 0.25])
def test_land_replaces_or_mixes_the_new_global_weights_into_the_live_ones(mix: float) -> None:
    sync, mods = _sync()
    for p, to in ((0, 2.0), (1, 4.0)):
        _train(sync, mods, p, to)
    with torch.no_grad():
        mods["embed"].weight.fill_(10.0)  # what the path learnt since (streaming keeps part of it)
    for m in ("embed", "head"):
        sync.syncs[m].launch()
        sync.syncs[m].land()
        sync.syncs[m].mix(mix)
    theta = float(sync.syncs["embed"].global_weights.detach()[0])
    assert theta == pytest.approx(3.0)  # the mean of the two paths
    assert float(mods["embed"].weight.detach()[0, 0]) == pytest.approx(10.0 + mix * (theta - 10.0))
    assert float(mods["head"].weight.detach()[0, 0]) == pytest.approx(4.0 + mix * (theta - 4.0))
