"""The round's record reaches rank 0 alone (dipaco/rounds/record.py ``gather_to_rank0``):
rank 0 holds every rank's record in rank order, the others hold nothing, and the local
backend's list is the record itself. Rank 0 alone writes the metrics, so an all-gather
sent every record to every rank for nothing (docs/results.md, bytes on the wire)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from _dist import run_ranks
from dipaco.rounds.record import gather_to_rank0


def _worker(rank: int, world_size: int, out: str) -> None:
    got = gather_to_rank0({"rank": rank, "loss": 1.0 / (rank + 1)}, distributed=True)
    Path(out, f"{rank}.json").write_text(json.dumps(got))


def test_local_backend_gives_the_record_itself() -> None:
    rec = {"rank": None}
    assert gather_to_rank0(rec, distributed=False) == [rec]


@pytest.mark.multiprocess
def test_rank0_gets_every_record_in_rank_order_and_the_others_nothing(tmp_path: Path) -> None:
    run_ranks(_worker, world_size=3, args=(str(tmp_path),), timeout=120)
    assert json.loads((tmp_path / "0.json").read_text()) == [
        {"rank": r, "loss": 1.0 / (r + 1)} for r in range(3)]
    assert json.loads((tmp_path / "1.json").read_text()) is None
    assert json.loads((tmp_path / "2.json").read_text()) is None
