"""α: the weight of each path's pseudo-gradient in a module's average (``diloco.alpha``).

* ``tokens``: α = the tokens the path trained this round. In sync mode every path trains
  B·T·H tokens, so a module's average is uniform over the paths that share it.
* ``shard_size``: α = tokens × (the path's shard tokens / the mean shard tokens). The
  DiPaCo paper weighs a path's pseudo-gradient by the size of its shard: a module shared
  by a big and a small shard moves mostly toward the big one. The tokens factor keeps
  decoupled phases of different lengths weighted by the work they did; in sync mode it is
  the same for every path and cancels in the average.

Shard sizes come from the shards manifest (``tokens_per_path``), so a re-shard is picked
up when the ranks restart on the new shards.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from router import read_shards_manifest

__all__ = ["PathAlpha"]


@dataclass(frozen=True)
class PathAlpha:
    """``alpha(path, tokens)``: α of one trained path's contribution this round.

    Attributes:
        scale: per trained path (shard index), the factor applied to its tokens.
    """

    scale: tuple[float, ...]

    @classmethod
    def uniform(cls, num_paths: int) -> "PathAlpha":
        """α = tokens for every path (``diloco.alpha=tokens``)."""
        return cls(tuple(1.0 for _ in range(num_paths)))

    @classmethod
    def from_shard_tokens(cls, shard_tokens: Sequence[int]) -> "PathAlpha":
        """α = tokens × shard tokens / mean shard tokens.

        An empty shard counts as one token, so a module never sees Σα = 0 from a path
        that did train (its stream would fail first anyway).
        """
        sizes = [max(1, int(n)) for n in shard_tokens]
        mean = sum(sizes) / len(sizes)
        return cls(tuple(n / mean for n in sizes))

    @classmethod
    def from_config(cls, mode: str, shards_dir: Path | str) -> "PathAlpha":
        """The run's α rule, ``mode`` being ``diloco.alpha``."""
        manifest = read_shards_manifest(Path(shards_dir))
        if mode == "tokens":
            return cls.uniform(int(manifest["num_paths"]))
        if mode == "shard_size":
            return cls.from_shard_tokens(manifest["tokens_per_path"])
        raise ValueError(f"diloco.alpha={mode!r} must be 'tokens' or 'shard_size'")

    def __call__(self, path_id: int, tokens: float) -> float:
        return float(tokens) * self.scale[path_id]
