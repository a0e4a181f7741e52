"""Random routing (``method="random"``, ``router=random``): the control, blind to content.

Each document goes to the paths a seeded hash of its prefix tokens draws: deterministic
and balanced, but carrying no information about what the document says. Routed
specialists should beat it; docs/results.md measures them against it (§10, §12, §13, §16,
§17, §19: k-means ÷ random 0.95-0.97 at top-2). It has no settings and no fitted state.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import ClassVar, Mapping, Sequence

import numpy as np

from .base import Grid, MethodConfig, num_paths

__all__ = ["RandomConfig", "RandomMethod"]


@dataclass
class RandomConfig(MethodConfig):
    """The random control: no settings."""

    name: ClassVar[str] = "random"
    learns_content: ClassVar[bool] = False  # its shards carry no content for a prompt classifier

    def build(self, grid: Grid, *, seed: int, dim: int) -> "RandomMethod":
        return RandomMethod(self, grid, seed=seed)


class RandomMethod:
    """Costs from a seeded hash of each prefix (the features are not read)."""

    def __init__(self, config: RandomConfig, grid: Grid, *, seed: int) -> None:
        self.config, self.grid, self.seed = config, grid, seed

    def fit(self, features: np.ndarray, prefixes: Sequence[np.ndarray]) -> None:
        """Nothing to fit: the hash is the whole method."""

    def costs(self, features: np.ndarray, prefixes: Sequence[np.ndarray]) -> np.ndarray:
        out = np.empty((len(prefixes), num_paths(self.grid)), np.float32)
        for i, x in enumerate(prefixes):
            key = zlib.crc32(np.asarray(x, np.int64).tobytes()) ^ (self.seed * 2654435761 & 0xFFFFFFFF)
            out[i] = np.random.default_rng(key).random(out.shape[1])
        return out

    def arrays(self) -> dict[str, np.ndarray]:
        return {}

    def load_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Nothing to load (a router saved before the registry kept a placeholder centroid: ignored)."""
