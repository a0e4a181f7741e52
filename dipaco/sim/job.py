"""What the simulator knows of a job: the run's config on a described cluster, in numbers.

Everything here comes from the project's own planners: the training paths and their
modules from the grid (:func:`dipaco.plan.build.build_grid`), who holds what from the
topology (paths dealt to worker groups round-robin, :mod:`dipaco.plan.topology`), the
bytes each rank sends per module exchange from the communication plan
(:func:`dipaco.plan.comm_plan.module_bytes_per_rank`), streaming's round from
:func:`dipaco.plan.build.build_streaming_schedule`. The cluster
(``cluster.*``, :mod:`dipaco.config.cluster`) adds chips, step time and links.

Aggregation: a cluster of 10^6 chips has more worker groups than the config has paths.
The bytes are planned on ``min(groups, paths)`` worker groups (a ring all-reduce sends
about twice the payload whatever its size, so the per-rank bytes do not depend on the
replica count); failures and stragglers are drawn for every group (:mod:`dipaco.sim.faults`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from dipaco.config import Config, codec_kwargs
from dipaco.config.cluster import ClusterConfig, worker_groups
from dipaco.config.decoupled import DecoupledConfig
from dipaco.plan.build import build_grid, build_streaming_schedule, build_topology
from dipaco.plan.codecs import make_codec
from dipaco.plan.comm_plan import module_bytes_per_rank, ring_allreduce_bytes
from dipaco.plan.schedule import RoundSchedule

__all__ = ["SimJob", "sim_job"]


@dataclass(frozen=True)
class SimJob:
    """The job in the simulator's numbers (seconds, bytes, chips)."""

    cluster: ClusterConfig
    paths: int  # training paths (grid paths x replicas)
    groups: int  # worker groups on the cluster
    chips_per_group: int
    inner_steps: int  # H
    step_s: float  # one inner step of one path on its worker group
    rounds: int  # trainer.rounds: the budget when no horizon is set
    checkpoint_every: int  # rounds between checkpoints (a failure rolls back to the last)
    tokens_per_step: int  # of one path: trainer.batch_size x trainer.seq_len
    path_params: int
    path_modules: tuple[tuple[str, ...], ...]
    module_bytes: dict[str, int]  # bytes one rank sends per exchange of the module, per round
    ranks_per_group: int  # launcher.group_size
    plan_groups: int  # worker groups the bytes were planned on (min(groups, paths))
    streaming: RoundSchedule  # streaming's round with the config's streaming settings
    ddp_rank_bytes_per_step: int  # a path's all-reduce over every rank, each inner step
    decoupled: DecoupledConfig
    workers: int  # decoupled workers (diloco.decoupled.workers, else one per path)

    @property
    def chips(self) -> int:
        """Chips in use: whole worker groups."""
        return self.groups * self.chips_per_group

    def path_load(self, groups_up: int) -> int:
        """Paths the busiest worker group trains in a round when ``groups_up`` are up (the
        topology deals paths round-robin; a group trains its paths in turn)."""
        return math.ceil(self.paths / max(1, min(groups_up, self.paths))) if groups_up else 0

    def rank_bytes(self, modules: Optional[list[str]] = None) -> int:
        """Bytes one rank sends for ``modules`` (default: every module a path holds), the
        largest over paths."""
        if modules is not None:
            return sum(self.module_bytes[m] for m in modules)
        return max(sum(self.module_bytes[m] for m in pm) for pm in self.path_modules)

    def transfer_s(self, rank_bytes: float) -> float:
        """Seconds for exchanges where every rank sends ``rank_bytes`` at once.

        ``link_scope=per_group``: each rank has its own link of ``link_gbps``;
        ``shared``: every rank of the cluster sends over one link (the shaped loopback of
        benchmarks/bench_link.py). With ``regions`` > 1 and a WAN, a region's groups
        share its ``wan_gbps``. Plus ``latency_s`` once.
        """
        c = self.cluster
        if rank_bytes <= 0:
            return 0.0
        senders = self.plan_groups * self.ranks_per_group if c.link_scope == "shared" else 1
        t = rank_bytes * senders * 8 / (c.link_gbps * 1e9)
        if c.regions > 1 and c.wan_gbps:
            per_region = math.ceil(self.groups / c.regions) * self.ranks_per_group
            t = max(t, rank_bytes * per_region * 8 / (c.wan_gbps * 1e9))
        return c.latency_s + t


def derived_step_s(cfg: Config, path_params: int, chips_per_group: int) -> float:
    """An inner step's seconds from FLOPs: 6 x parameters x tokens over the group's chips
    at ``chip_tflops`` x ``mfu`` (``cluster.step_s`` overrides it)."""
    c = cfg.cluster
    if c.step_s is not None:
        return float(c.step_s)
    flops = 6.0 * path_params * cfg.trainer.batch_size * cfg.trainer.seq_len
    return flops / (chips_per_group * c.chip_tflops * 1e12 * c.mfu)


def sim_job(cfg: Config) -> SimJob:
    """The :class:`SimJob` of a validated ``cfg`` (module sizes only: no weights trained)."""
    c = cfg.cluster
    grid = build_grid(cfg, torch.device("cpu"))
    paths = grid.num_paths * cfg.grid.replicas
    cpg, groups = worker_groups(c, paths)  # the chips in whole groups (preflight refused idle chips)
    G = cfg.launcher.group_size
    plan_groups = min(groups, paths)
    topo = build_topology(cfg, grid, plan_groups * G, True)
    d = cfg.diloco
    codec = make_codec(d.codec, **codec_kwargs(d))
    counts = {m: grid.param_count(m) for m in grid.module_ids}
    nbytes = {m: module_bytes_per_rank(topo, m, counts[m], codec, d.lossy_exchange,
                                       cfg.launcher.group_parallel == "fsdp") for m in grid.module_ids}
    path_params = grid.path_param_count(0)
    # the streaming mode's schedule with the config's streaming settings, whether or not
    # this config streams (a delay of H or more cannot stream: every module at step H)
    streaming = (build_streaming_schedule(cfg, grid) if d.streaming_delay < d.inner_steps
                 else RoundSchedule.synchronous(grid.module_ids, d.inner_steps))
    workers = d.decoupled.num_workers or paths
    return SimJob(cluster=c, paths=paths, groups=groups, chips_per_group=cpg, inner_steps=d.inner_steps,
                  step_s=derived_step_s(cfg, path_params, cpg), rounds=cfg.trainer.rounds,
                  checkpoint_every=cfg.trainer.checkpoint_every,
                  tokens_per_step=cfg.trainer.batch_size * cfg.trainer.seq_len, path_params=path_params,
                  path_modules=tuple(tuple(pm) for pm in topo.path_modules), module_bytes=nbytes,
                  ranks_per_group=G, plan_groups=plan_groups, streaming=streaming,
                  ddp_rank_bytes_per_step=ring_allreduce_bytes(plan_groups * G, 4 * path_params),
                  decoupled=d.decoupled, workers=min(workers, groups))
