"""The synchronous DiPaCo rounds on one rank: build → resume → loop → record.

``run_rank(cfg, run, rank, world_size)`` (:mod:`dipaco.rounds.loop`) is what the job
(:mod:`dipaco.job.train`) and the re-shard (:mod:`dipaco.job.reshard`) launch on every rank.
"""
from dipaco.rounds.loop import run_rank, run_round

__all__ = ["run_rank", "run_round"]
