"""The cluster a job is planned on (``cluster.*``): read by ``dipaco-plan --simulate`` only.

Chips, their failures and stragglers, the links between worker groups: what the
discrete-event simulator (:mod:`dipaco.sim`) needs to turn the run's config into wall
time per round, exposed communication and goodput. Training never reads these keys.

:data:`CLUSTER_DOMAINS` gives each key's domain as plain tuples
``(kind, lo, hi, lo_open, null, choices)``, which :mod:`dipaco.config.domains` turns into
its ``Domain`` rows, so the schema, the domains table and the checks of the rest of the
config refuse a bad cluster in one line (``ConfigError(key, problem, fix)``), before any
simulation. No torch, no other dipaco package.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["ClusterConfig", "CLUSTER_DOMAINS", "STRAGGLERS", "LINK_SCOPES"]

#: cluster.straggler: how a worker group's round (or phase) time is slowed
STRAGGLERS = ("none", "lognormal", "exponential")
#: cluster.link_scope: every worker group has its own link of link_gbps, or all share one
LINK_SCOPES = ("per_group", "shared")


@dataclass
class ClusterConfig:
    """A cluster described by its chips, failures, stragglers and links (docs/planning.md)."""

    chips: int = 64
    # chips of one worker group (one path's data-parallel replica); null: chips / training paths
    chips_per_group: Optional[int] = None
    # seconds of one inner step of a path on its worker group; null: derived from the path's
    # FLOPs per token (6 x its parameters) x tokens per step / (chips_per_group x chip_tflops x mfu)
    step_s: Optional[float] = None
    chip_tflops: float = 400.0  # one chip's dense peak (bf16), TFLOP/s
    mfu: float = 0.4  # the share of that peak a path's step reaches
    # mean time between failures of ONE chip, hours; null: no failures
    mtbf_hours: Optional[float] = None
    detect_s: float = 30.0  # from a failure to the job knowing of it
    restart_s: float = 600.0  # replace the failed machine and restart its group from a checkpoint
    rendezvous_s: float = 30.0  # elastic: the survivors re-form the job without the lost group
    link_gbps: float = 100.0  # each group's link (or the one shared link), Gbit/s
    link_scope: str = "per_group"
    latency_s: float = 0.0  # added to each module exchange
    regions: int = 1  # >1: module groups span regions over a WAN of wan_gbps per region
    wan_gbps: Optional[float] = None
    straggler: str = "none"
    straggler_sigma: float = 0.1  # lognormal sigma, or the exponential's mean extra share
    slow_groups: int = 0  # this many worker groups always run slow_factor x slower
    slow_factor: float = 1.0
    # simulated time; null: until the config's rounds (trainer.rounds x H inner steps a path) are applied
    horizon_hours: Optional[float] = None
    seed: int = 0


_BIG = 10**9
CLUSTER_DOMAINS: dict[str, tuple[Any, ...]] = {
    "cluster.chips": ("int", 1, 10**9),
    "cluster.chips_per_group": ("int", 1, "cluster.chips", False, True),
    "cluster.step_s": ("real", 0, 10**6, True, True),
    "cluster.chip_tflops": ("real", 0, 10**7, True),
    "cluster.mfu": ("real", 0, 1, True),
    "cluster.mtbf_hours": ("real", 0, 10**12, True, True),
    "cluster.detect_s": ("real", 0, 10**7),
    "cluster.restart_s": ("real", 0, 10**7),
    "cluster.rendezvous_s": ("real", 0, 10**7),
    "cluster.link_gbps": ("real", 0, 10**7, True),
    "cluster.link_scope": ("choice", None, None, False, False, LINK_SCOPES),
    "cluster.latency_s": ("real", 0, 10**4),
    "cluster.regions": ("int", 1, 10**4),
    "cluster.wan_gbps": ("real", 0, 10**7, True, True),
    "cluster.straggler": ("choice", None, None, False, False, STRAGGLERS),
    "cluster.straggler_sigma": ("real", 0, 100),
    "cluster.slow_groups": ("int", 0, _BIG),
    "cluster.slow_factor": ("real", 1, 10**4),
    "cluster.horizon_hours": ("real", 0, 10**6, True, True),
    "cluster.seed": ("int", 0, 2**32 - 1),
}
