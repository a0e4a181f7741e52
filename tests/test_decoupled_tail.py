"""The tail rule of :class:`dipaco.decoupled.scheduling.PathPicker`: a slow worker leaves
the last steps to the others only while they make progress. Every worker judging itself
slow (extreme stragglers) used to leave them to each other forever: ``dipaco-plan
--simulate`` in decoupled mode never ended. The real worker and the simulated one still
choose alike, through the one shared picker."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import simpy

from _sim_jobs import TINY
from dipaco.config import compose_config
from dipaco.config.decoupled import DecoupledConfig
from dipaco.decoupled.lease import Lease
from dipaco.decoupled.scheduling import PathPicker, WorkerScheduling
from dipaco.decoupled.store import FileStore
from dipaco.sim.decoupled import _DecoupledSim
from dipaco.sim.job import sim_job

H, ROUNDS = 10, 4
NEAR_THE_END = [38, 39, 40, 37]  # 6 steps left: fewer than the 3 others' one phase each


class _Scheduler(WorkerScheduling):
    """The scheduling part of a decoupled worker on a store, 3× slower than 3 others."""

    def __init__(self, store: FileStore, progress: list[int]) -> None:
        self.store, self.index, self.id = store, 0, "W0.0-tail"
        self.dcfg = DecoupledConfig(slow_threshold=1.5)
        self.grid = SimpleNamespace(num_paths=len(progress))
        self.rng = SimpleNamespace(random=lambda: 0.0)
        self.sps, self.progress = 0.03, progress
        self.picker = PathPicker(self.dcfg, H, ROUNDS * H)

    def _others_sps(self) -> tuple[Optional[float], int]:
        return 0.01, 3

    def _progress(self, p: int) -> int:
        return self.progress[p]

    def event(self, obj: dict) -> None:
        pass


def _sim(progress: list[int]) -> _DecoupledSim:
    job = sim_job(compose_config(TINY + ["diloco.mode=decoupled", "grid=2x2", f"trainer.rounds={ROUNDS}",
                                         f"diloco.inner_steps={H}", "diloco.decoupled.slow_threshold=1.5",
                                         "diloco.decoupled.workers=4", "cluster.chips=4"]))
    sim = _DecoupledSim(job, None)
    sim.progress = [float(k) for k in progress]
    sim.slowness[0] = 3.0
    return sim


def _real_pick(w: _Scheduler) -> Optional[int]:
    lease, _ = w.pick()
    if lease is None:
        return None
    lease.release()
    return int(lease.name.split("_")[1])


def _wait_out(picker: PathPicker) -> None:
    """As if the worker had sat out far longer than the others' phase, with no progress."""
    since, left = picker.sitting_out
    picker.sitting_out = (since - 1e6, left)


def test_a_slow_worker_sits_out_the_tail_only_while_the_others_progress(tmp_path) -> None:
    progress = list(NEAR_THE_END)
    real, sim = _Scheduler(FileStore(tmp_path), progress), _sim(progress)
    # the others can finish the 6 steps left sooner: both sit out
    assert _real_pick(real) is None and sim._pick(0) is None
    # one of the others' phases passes with no progress: both take the most advanced unfinished path
    _wait_out(real.picker)
    _wait_out(sim.pickers[0])
    assert _real_pick(real) == sim._pick(0) == 1
    # the others progress: the sitting out starts again, and lasts while they do
    progress[1] = sim.progress[1] = 40
    assert _real_pick(real) is None and sim._pick(0) is None
    progress[3] = sim.progress[3] = 39
    assert _real_pick(real) is None and sim._pick(0) is None
    assert real.picker.sitting_out[1] == sim.pickers[0].sitting_out[1] == 3  # 2 + 1 steps left


def test_a_held_path_is_not_taken_when_the_wait_runs_out(tmp_path) -> None:
    store = FileStore(tmp_path)
    assert Lease(store, "path_1", "W9.0-other", 60.0).acquire()
    real, sim = _Scheduler(store, list(NEAR_THE_END)), _sim(NEAR_THE_END)
    sim.held = {1}
    assert _real_pick(real) is None and sim._pick(0) is None
    _wait_out(real.picker)
    _wait_out(sim.pickers[0])
    assert _real_pick(real) == sim._pick(0) == 0


def test_decoupled_simulation_ends_under_extreme_stragglers() -> None:
    """``dipaco-plan --simulate experiment=smoke cluster.straggler=exponential
    cluster.straggler_sigma=100``: every worker's phase is slowed ~100x at random, every
    worker judges itself slow, and the run still ends (it used to poll forever)."""
    job = sim_job(compose_config(["experiment=smoke", "diloco.mode=decoupled", "cluster.straggler=exponential",
                                  "cluster.straggler_sigma=100"]))
    sim = _DecoupledSim(job, None)
    for _ in range(50_000):  # it ends within a few hundred; it used to poll on past 300,000
        if sim.finished.triggered or sim.env.peek() == simpy.core.Infinity:
            break
        sim.env.step()
    assert sim.finished.triggered, "the simulated workers left the tail to each other"
    assert all(p >= job.rounds * job.inner_steps for p in sim.progress)
