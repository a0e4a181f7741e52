"""Failures and stragglers of a simulated cluster, drawn from one seeded generator.

* **Failures**: each chip fails as a Poisson process of mean ``mtbf_hours``; a failed chip
  takes its worker group down. The whole cluster's failures are one Poisson process of
  rate ``chips / mtbf`` whose failures hit a uniformly drawn group: one event per
  failure, whatever the chip count (failures of chips are independent: no correlated
  failures, docs/planning.md).
* **Stragglers**: a group's round (or phase) takes ``factor`` x its compute, with
  ``factor`` drawn per group and round: ``lognormal`` ``exp(sigma Z)`` (at least 1),
  ``exponential`` ``1 + Exp(sigma)``; ``slow_groups`` groups always run ``slow_factor`` x
  slower. A synchronous round waits for its slowest group: the maximum of n draws is
  drawn at once from its distribution, ``F^-1(U^(1/n))``, so a round is O(1) whatever n.
"""
from __future__ import annotations

import math
from statistics import NormalDist
from typing import Optional

import numpy as np

from dipaco.config.cluster import ClusterConfig

__all__ = ["Faults"]

_NORMAL = NormalDist()


class Faults:
    """The seeded draws of one simulation (one generator: a seed gives one history)."""

    def __init__(self, cluster: ClusterConfig, groups: int, chips_per_group: int) -> None:
        self.c = cluster
        self.groups = groups
        self.chips_per_group = chips_per_group
        self.rng = np.random.default_rng(cluster.seed)

    def failure_rate(self, groups: Optional[int] = None) -> float:
        """Failures per second among ``groups`` worker groups (default: all)."""
        if self.c.mtbf_hours is None:
            return 0.0
        n = self.groups if groups is None else groups
        return n * self.chips_per_group / (self.c.mtbf_hours * 3600.0)

    def next_failure_in(self, groups: Optional[int] = None) -> float:
        """Seconds to the next failure among ``groups`` groups (inf: none fail)."""
        rate = self.failure_rate(groups)
        return math.inf if rate <= 0 else float(self.rng.exponential(1.0 / rate))

    def failed_group(self, groups: Optional[int] = None) -> int:
        """Which of ``groups`` groups the failure hit."""
        return int(self.rng.integers(0, self.groups if groups is None else groups))

    def _factor(self, u: float) -> float:
        """The straggler factor at quantile ``u`` of its distribution."""
        c = self.c
        if c.straggler == "none" or c.straggler_sigma == 0:
            return 1.0
        u = min(max(u, 1e-12), 1 - 1e-12)
        if c.straggler == "lognormal":
            return max(1.0, math.exp(c.straggler_sigma * _NORMAL.inv_cdf(u)))
        return 1.0 - c.straggler_sigma * math.log(1.0 - u)  # exponential, mean extra sigma

    def slowest(self, groups: int) -> float:
        """The slowest of ``groups`` groups' factors this round (slow groups included)."""
        if groups <= 0:
            return 1.0
        drawn = self._factor(float(self.rng.random()) ** (1.0 / groups))
        slow = self.c.slow_factor if min(self.c.slow_groups, groups) > 0 else 1.0
        return max(drawn, slow)

    def mean_factor(self, groups: int) -> float:
        """The mean factor over ``groups`` groups (slow groups included): how much longer
        than nominal their steps take on average."""
        if not hasattr(self, "_mean"):
            c, u = self.c, (np.arange(4096) + 0.5) / 4096  # quantiles: a fixed, seed-free mean
            self._mean = float(np.mean([self._factor(float(x)) for x in u]))
        slow = min(self.c.slow_groups, groups)
        return self._mean * (groups - slow + slow * self.c.slow_factor) / max(1, groups)

    def factor(self, group: int) -> float:
        """One group's factor for one round or phase."""
        base = self._factor(float(self.rng.random()))
        return base * (self.c.slow_factor if group < self.c.slow_groups else 1.0)
