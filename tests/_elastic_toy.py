"""A toy rounds loop for the elastic launch test (tests/test_elastic.py).

It runs under the real machinery (torch's elastic agents and c10d rendezvous started by
:func:`dipaco.runtime.elastic_spawn.run_agents`, :func:`dipaco.runtime.launch._rank_entry`,
:mod:`dipaco.runtime.elastic`'s join/started) but trains nothing: a round is one gloo
all-reduce, a short sleep and rank 0 committing an empty ``checkpoints/round_NNNNNN``, so a
departure and a rejoin cost seconds instead of a real run's minutes. Module level, so the
spawned ranks can import it.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dipaco.runtime import elastic, faults
from dipaco.runtime.launch import stop_requested

LAST_START_ENV = "DIPACO_TOY_LAST_START"  # the start that ends the run after two rounds (default 2)
MAX_ROUNDS = 80  # a bound: the run normally ends as soon as the group is back (below)
ROUND_S = 0.25


@dataclass
class ToyResult:
    rounds: int
    world_size: int
    finished: bool  # read by _rank_entry: False exits RESTART_EXIT (a stop for a restart)


def _newest(run) -> int:
    rounds = [int(p.name[6:]) for p in run.checkpoints.glob("round_*") if (p / "manifest.json").is_file()]
    return max(rounds, default=0)


def toy_rounds(cfg, run, rank: int, world: int) -> ToyResult:
    """Rounds until start ``DIPACO_TOY_LAST_START`` has trained two rounds (or MAX_ROUNDS)."""
    start = _newest(run) if cfg.resume else 0
    elastic.started(run, rank, 1, start, log=lambda m: print(f"[dipaco] {m}", flush=True))
    # the departure test: start 0 has four groups, 1 three, 2 four again
    rejoined = _start_no() >= int(os.environ.get(LAST_START_ENV, "2"))
    for r in range(start, MAX_ROUNDS):
        faults.inject("before_inner", round_idx=r + 1, rank=rank, path=rank)
        t = torch.ones(1)
        dist.all_reduce(t)  # every rank of this start takes part, or this raises
        time.sleep(ROUND_S)
        if rank == 0:
            d = run.checkpoints / f"round_{r + 1:06d}"
            d.mkdir(parents=True, exist_ok=True)
            (d / "manifest.json").write_text("{}")
            with open(run.root / "toy_rounds.jsonl", "a") as f:
                f.write(json.dumps({"round": r + 1, "world": world, "sum": t.item()}) + "\n")
        dist.barrier()
        if rejoined and r + 1 - start >= 2:
            return ToyResult(r + 1, world, True)
        if stop_requested(True):
            return ToyResult(r + 1, world, False)
    return ToyResult(MAX_ROUNDS, world, True)


def _start_no() -> int:
    return int(os.environ.get(faults.START_ENV, "0"))
