"""The synchronous DiPaCo rounds on one rank: build → resume → loop → record.

``run_rank(cfg, run, rank, world_size)`` (:mod:`dipaco.rounds.loop`) is what the job
(:mod:`dipaco.job.train`) and the re-shard (:mod:`dipaco.job.reshard`) launch on every rank.

The names are re-exported lazily (PEP 562), as in :mod:`dipaco.data`: importing a leaf such
as :mod:`dipaco.rounds.early_stopping` (inference reads kept best weights through it)
runs this file, and must not load the whole training loop with it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["run_rank", "run_round"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'dipaco.rounds' has no attribute {name!r}")
    from dipaco.rounds import loop

    value = getattr(loop, name)
    globals()[name] = value  # next access skips __getattr__
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # static checkers and IDEs see the real names
    from dipaco.rounds.loop import run_rank, run_round
