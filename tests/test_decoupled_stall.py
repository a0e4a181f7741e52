"""The decoupled supervisor's stall rule (dipaco/decoupled/supervisor.py, StallWatch): a
run stops when it no longer advances, measured against its own pace, never after a
wall-clock time (a large run takes days)."""
from __future__ import annotations

from pathlib import Path

import pytest

from dipaco.config.decoupled import DecoupledConfig, validate_decoupled
from dipaco.decoupled.service import progress_key
from dipaco.decoupled.store import FileStore
from dipaco.decoupled.supervisor import StallWatch

H, LEASE = 8, 2.0


def _commit(store: FileStore, p: int, steps: int) -> None:
    store.put_json(progress_key(p), {"phases_done": steps // H, "steps_done": steps})


def _watch(store: FileStore, paths: int = 2) -> StallWatch:
    return StallWatch(store, paths, H, stall_phases=20, lease_s=LEASE, heartbeat_s=0.5, now=0.0)


def test_no_stall_before_the_run_shows_its_pace(tmp_path: Path) -> None:
    w = _watch(FileStore(tmp_path))
    for t in (0.0, 100.0, 10_000.0, 1e6):  # start-up and a first phase take what they take
        assert w.check(t) is None
    assert w.window() is None


def test_a_run_stalls_after_stall_phases_of_its_slowest_advance(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    w = _watch(store)
    assert w.check(0.0) is None  # the baseline: nothing committed
    _commit(store, 0, H)
    assert w.check(30.0) is None  # path 0's first phase (with start-up): 30 s
    _commit(store, 1, H)
    assert w.check(40.0) is None
    assert w.window() == 20 * 40.0  # path 1's first advance took 40 s
    _commit(store, 0, 2 * H)
    assert w.check(60.0) is None  # 30 s between path 0's commits: the pace stays 40 s
    assert w.check(60.0 + 20 * 40.0) is None  # within the window
    msg = w.check(60.0 + 20 * 40.0 + 11.0)  # read again (every pace/4 = 10 s) past the window
    assert msg is not None and "no progress for 811s" in msg and "stall_phases=20" in msg


def test_the_window_is_at_least_stall_phases_leases(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    w = _watch(store, paths=1)
    w.check(0.0)
    _commit(store, 0, H)
    w.check(0.5)  # a phase of half a second: a takeover still needs a lease
    assert w.window() == 20 * LEASE
    assert w.check(0.5 + 20 * LEASE - 1) is None and w.check(0.5 + 20 * LEASE + 1) is not None


def test_a_host_joining_a_run_under_way_measures_whole_advances_only(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    _commit(store, 0, 3 * H)  # the run is under way when this host joins
    w = _watch(store, paths=1)
    w.check(0.0)
    _commit(store, 0, 4 * H)
    assert w.check(1.0) is None and w.window() is None  # joined mid-phase: 1 s is not a phase
    _commit(store, 0, 5 * H)
    assert w.check(601.0) is None and w.window() == 20 * 600.0  # a whole phase, 600 s


def test_a_failing_store_is_read_again_later(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = FileStore(tmp_path)
    w = _watch(store)
    w.check(0.0)

    def fail(key: str) -> None:
        raise OSError("outage")
    monkeypatch.setattr(store, "get_json", fail)
    assert w.check(5.0) is None  # an outage before any pace: no stall, no exception


def test_no_wall_clock_limit_by_default_and_stall_phases_checked() -> None:
    d = DecoupledConfig()
    assert d.timeout_s is None and d.stall_phases >= 2
    for bad in (1.0, float("nan"), float("inf")):
        assert [k for k, _, _ in validate_decoupled(DecoupledConfig(stall_phases=bad))] == [
            "diloco.decoupled.stall_phases"], bad
    assert [k for k, _, _ in validate_decoupled(DecoupledConfig(timeout_s=0.0))] == ["diloco.decoupled.timeout_s"]
