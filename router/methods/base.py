"""What a routing method is: a config dataclass that builds it, and the protocol the Router calls.

A method turns the routing features (and token prefixes) of documents into path costs
``[N, P]`` (float32, lower is better); everything else a router does (prefixes, the
featurizer, balanced top-k shards, the fallback path, the prompt classifier, saving) is
:class:`router.Router`'s and the same for every method.

* :class:`MethodConfig`: a method's settings, one dataclass field each, the only place
  they are listed. The Router's ``fit`` arguments, the ``method_settings`` of a saved
  router, and dipaco's ``router.<name>`` config keys, their domains (:func:`setting`) and
  the router's fingerprint all come from these fields. ``build`` makes the method.
* :class:`RoutingMethod`: ``fit`` on the features of the training documents, ``costs``,
  and its fitted state as named arrays (``arrays`` / ``load_arrays``), saved without
  pickle.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Optional, Protocol, Sequence, Union

import numpy as np

Grid = tuple[int, ...]
# a bound of a setting's domain: a number, or "paths" (the number of paths of the grid)
Bound = Union[int, float, str, None]
COSTLY = "a larger value exhausts memory or time"


def setting(default: Any, *, lo: Bound = None, hi: Bound = None, why: str = "") -> Any:
    """A method setting: its default and its domain, checked before any work (dipaco's
    ``validate_config`` reads it: ``lo``/``hi`` are numbers or ``"paths"``, ``why`` says
    why the upper bound holds). ``None`` as the default makes null a valid value."""
    return field(default=default, metadata={"lo": lo, "hi": hi, "why": why})


class RoutingMethod(Protocol):
    """One fitted (or loaded) way of turning features into path costs for one grid."""

    config: "MethodConfig"  # its settings, defaults resolved: what a saved router records

    def fit(self, features: np.ndarray, prefixes: Sequence[np.ndarray]) -> None:
        """Fit on the training documents: ``features`` ``[N, d]`` of their non-empty ``prefixes``."""

    def costs(self, features: np.ndarray, prefixes: Sequence[np.ndarray]) -> np.ndarray:
        """Path costs float32 ``[N, P]``, lower is better, of documents given by both views."""

    def arrays(self) -> dict[str, np.ndarray]:
        """The fitted state as named numpy arrays (saved as an .npz, no pickle)."""

    def load_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Take the state :meth:`arrays` saved; raise KeyError for a missing array and
        ValueError for an inconsistent one (the loader names the file)."""


@dataclass
class MethodConfig:
    """A routing method's settings (a subclass per method, registered in ``router.methods``)."""

    name: ClassVar[str]
    # why the method is experimental (no measurement in docs/results.md supports it), or None
    experimental: ClassVar[Optional[str]] = None
    # False for a control whose shards carry no content: no prompt classifier can learn them
    learns_content: ClassVar[bool] = True

    def build(self, grid: Grid, *, seed: int, dim: int) -> RoutingMethod:
        """The unfitted method for ``grid`` (path ids: mixed radix, level 0 most significant)
        on features of ``dim`` dimensions; refuses (ValueError) a grid or dim it cannot route."""
        raise NotImplementedError

    def min_documents(self, grid: Grid) -> int:
        """Non-empty training documents the fit needs: the most clusters one k-means makes."""
        return max(grid)


@dataclass
class KMeansConfig(MethodConfig):
    """The setting every k-means method shares."""

    # Lloyd iterations of each k-means (router/kmeans.py stops earlier once it converges)
    niter: int = setting(20, lo=1, hi=10_000, why=COSTLY)


def num_paths(grid: Grid) -> int:
    return int(np.prod(grid))


__all__ = ["COSTLY", "Grid", "KMeansConfig", "MethodConfig", "RoutingMethod", "num_paths", "setting"]
