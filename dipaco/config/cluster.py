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
from typing import Any, Callable, Optional

__all__ = ["ClusterConfig", "CLUSTER_APPLIES", "CLUSTER_DOMAINS", "STRAGGLERS", "LINK_SCOPES", "cluster_problems",
           "worker_groups"]

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


# Where a cluster key is read, inside a simulation (dipaco/config/applies.py turns these into
# its rows): ``(when(cluster), says, fix)``. A key set where the simulator would not read
# it is refused naming the setting that switches it off, never ignored.
_FAILURES = (lambda c: c.mtbf_hours is not None, "with failures (cluster.mtbf_hours set)",
             "set cluster.mtbf_hours=10000")
_DERIVED_STEP = (lambda c: c.step_s is None, "when an inner step's time is derived from FLOPs (cluster.step_s "
                 "is null; a given step_s replaces chip_tflops x mfu)", "set cluster.step_s=null")
CLUSTER_APPLIES: dict[str, tuple[Callable[[ClusterConfig], bool], str, str]] = {
    "cluster.chip_tflops": _DERIVED_STEP, "cluster.mfu": _DERIVED_STEP,
    "cluster.detect_s": _FAILURES, "cluster.restart_s": _FAILURES, "cluster.rendezvous_s": _FAILURES,
    "cluster.wan_gbps": (lambda c: c.regions > 1, "when module groups span regions (cluster.regions > 1)",
                         "set cluster.regions=2"),
    "cluster.regions": (lambda c: c.wan_gbps is not None, "with a WAN between the regions (cluster.wan_gbps set)",
                        "set cluster.wan_gbps=10"),
    "cluster.straggler_sigma": (lambda c: c.straggler != "none", "with stragglers (cluster.straggler=lognormal or "
                                "exponential)", "set cluster.straggler=lognormal"),
    "cluster.slow_factor": (lambda c: c.slow_groups > 0, "with slow worker groups (cluster.slow_groups > 0)",
                            "set cluster.slow_groups=1"),
    "cluster.slow_groups": (lambda c: c.slow_factor > 1, "with cluster.slow_factor > 1 (a slow group at factor 1 "
                            "is a normal one)", "set cluster.slow_factor=2"),
    "cluster.seed": (lambda c: c.straggler != "none" or c.mtbf_hours is not None, "with stragglers or failures "
                     "(the draws it seeds)", "set cluster.straggler=lognormal"),
}


def worker_groups(c: ClusterConfig, paths: int) -> tuple[int, int]:
    """``(chips per worker group, worker groups)`` of ``c`` for ``paths`` training paths:
    ``cluster.chips_per_group``, or the chips shared out over the paths (at least one each)."""
    per = c.chips_per_group or max(1, c.chips // max(1, paths))
    return per, max(1, c.chips // per)


def cluster_problems(c: ClusterConfig, paths: int) -> list[tuple[str, str, str]]:
    """What ``dipaco-plan --simulate`` would silently reshape, as ``(key, problem, fix)``:
    chips that whole worker groups leave idle, more slow groups or regions than groups, a
    straggler distribution of spread 0 (the simulation of a cluster must be the cluster the
    user described)."""
    per, groups = worker_groups(c, paths)
    out = []
    used = per * groups
    if used != c.chips:
        how = (f"cluster.chips_per_group={per}" if c.chips_per_group else
               f"{c.chips} chips shared over {paths} training paths")
        out.append(("cluster.chips", f"cluster.chips={c.chips} makes {groups} whole worker groups of {per} chips "
                    f"({how}): {c.chips - used} chip(s) would sit idle, so {used} chips would be simulated",
                    f"use cluster.chips={used}, or a cluster.chips_per_group that divides {c.chips}"))
    for key, value in (("cluster.slow_groups", c.slow_groups), ("cluster.regions", c.regions)):
        if value > groups:
            out.append((key, f"{key}={value} is more than the {groups} worker groups the cluster has (they would be "
                        f"capped at {groups})", f"use {key}={groups}"))
    if c.straggler != "none" and c.straggler_sigma == 0:
        out.append(("cluster.straggler_sigma", f"cluster.straggler_sigma=0 draws no straggler, so cluster.straggler="
                    f"{c.straggler} would do nothing", "use cluster.straggler_sigma=0.1, or cluster.straggler=none"))
    return out
