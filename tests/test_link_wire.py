"""benchmarks/link_wire.py and bench_link's run directory: bytes on the wire per round, read
from the interface counters, and a hand-built run the rounds accept."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from benchmarks import bench_link, link_wire
from dipaco.run.fingerprint import read_fingerprints


def test_the_loopback_counter_is_read_from_this_namespace() -> None:
    a = link_wire.lo_tx_bytes()
    assert isinstance(a, int) and a >= 0 and link_wire.lo_tx_bytes() >= a


def test_the_meter_splits_the_loopback_bytes_at_each_round_line(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Round i's bytes are the counter's growth between the appearance of line i-1 and line i;
    the steady figure is the median of rounds 2..R-1 (round 1 holds the set-up)."""
    tx = [1000]
    monkeypatch.setattr(link_wire, "lo_tx_bytes", lambda: tx[0])
    metrics = tmp_path / "metrics.jsonl"
    sent = [5000, 300, 310, 9000, 290, 700]  # set-up, three steady rounds, a stray, the last round
    with link_wire.WireMeter(metrics, every_s=0.001) as meter:
        for i, nbytes in enumerate(sent):
            tx[0] += nbytes
            with open(metrics, "a") as f:
                f.write(f'{{"round": {i + 1}}}\n')
            deadline = time.monotonic() + 5
            while len(meter.marks) <= i and time.monotonic() < deadline:
                time.sleep(0.002)
    assert meter.per_round() == sent
    assert meter.steady() == 305.0  # median of 300, 310, 9000, 290


def test_the_benchmarks_run_directory_is_one_the_rounds_accept(tmp_path: Path) -> None:
    """A tokenizer and shards made by hand carry a fingerprints record, as a prepared run does:
    without it every reader refuses them (the benchmark failed on its first setting)."""
    run = bench_link.build_run(tmp_path / "run", 4)
    assert read_fingerprints(run) == {}


def test_the_probe_times_a_whole_message_idle_and_back_to_back() -> None:
    """The shaper probe delivers every byte both ways and times each (unshaped here: well
    under a second for 1 MB on the loopback)."""
    t = link_wire.transfer_times(1 << 20, repeats=1, idle_s=0.0)
    assert set(t) == {"idle_s", "behind_s"} and all(0 < v < 5 for v in t.values())
