"""Totals from each round's own record: a run's bytes sent and DDP-equivalent bytes are
sums over its rounds' metrics.jsonl records, each made on the topology that trained it
(dipaco/run/run_dir.py: bytes_totals; dipaco/rounds/record.py writes ddp_bytes_equivalent)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dipaco.run.run_dir import RunDir, bytes_totals

# launch histories as (rounds, bytes sent per round, DDP bytes per round) per launch
HISTORIES = {
    "one launcher": [(4, 210, 1000)],
    "resumed on another launcher": [(2, 210, 1000), (2, 500, 2000)],  # 0.21 then 0.25
    "elastic departure (4 -> 3 groups)": [(1, 400, 1600), (3, 300, 1200)],
    "three launches": [(1, 10, 100), (2, 30, 100), (1, 5, 50)],
}


def _write(run: RunDir, history: list[tuple[int, int, int]]) -> None:
    run.metrics.parent.mkdir(parents=True, exist_ok=True)
    lines, r = [], 0
    for rounds, sent, ddp in history:
        for _ in range(rounds):
            r += 1
            lines.append(json.dumps({"round": r, "mode": "sync", "bytes_sent": sent, "ddp_bytes_equivalent": ddp}))
    run.metrics.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("case", sorted(HISTORIES))
def test_totals_are_sums_of_each_rounds_record(case: str, tmp_path: Path) -> None:
    """Whatever launched each round, the run's ratio lies between its rounds' ratios and
    neither total is ever 0 while its rounds sent bytes (final topology × rounds gave 0.444
    for 0.21 and 0.25, and 0 DDP bytes after an elastic departure)."""
    history = HISTORIES[case]
    run = RunDir(tmp_path)
    _write(run, history)
    rounds = sum(n for n, _, _ in history)
    sent, ddp = bytes_totals(run, rounds, ddp_per_round=999_999)  # the fallback is never used here
    assert sent == sum(n * s for n, s, _ in history) and ddp == sum(n * d for n, _, d in history)
    ratios = [s / d for _, s, d in history]
    assert min(ratios) <= sent / ddp <= max(ratios)
    assert bytes_totals(run, rounds - 1, 999_999)[0] == sent - history[-1][1]  # only rounds up to the end


def test_a_finished_run_records_ddp_bytes_per_round_and_sums_them(finished) -> None:
    """The shared smoke run: every round's record carries its DDP-equivalent bytes and the
    summary's totals are their sums."""
    run_dir, summary = finished
    records = RunDir(run_dir).records()
    assert records and all("ddp_bytes_equivalent" in r for r in records)
    assert summary["ddp_bytes_equivalent"] == sum(r["ddp_bytes_equivalent"] for r in records)
    assert summary["bytes_sent"] == sum(r["bytes_sent"] for r in records)
