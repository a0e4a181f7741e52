"""Builders shared by every stage of a run: the module grid, the rank topology, the comm plan.

Training (:mod:`dipaco.rounds`, :mod:`dipaco.decoupled`), inference, planning and the
benchmarks all build the same objects from a :class:`~dipaco.config.Config`; keeping the
builders here, below all of them, means none of them imports the rank loop.
"""
from __future__ import annotations

from typing import Optional

import torch

from dipaco.plan.comm_plan import CommPlan, module_bytes_per_rank, plan_round
from dipaco.config import Config, codec_kwargs
from dipaco.runtime.placement import placement_of
from dipaco.plan.codecs import make_codec
from dipaco.plan.schedule import RoundSchedule
from dipaco.plan.stagger import format_stagger, streaming_schedule
from dipaco.plan.topology import Topology
from modules import ModuleGrid


def run_device(cfg: Config) -> torch.device:
    """This process's device for ``cfg`` (``trainer.device``; GPU ``host rank % count``,
    :mod:`dipaco.runtime.placement`)."""
    return placement_of(cfg).device


def build_grid(cfg: Config, device: Optional[torch.device] = None) -> ModuleGrid:
    """The run's module grid on ``device`` (default :func:`run_device`); modules are built
    lazily, on first use, from the same CPU-seeded weights on every device."""
    g = cfg.grid
    return ModuleGrid(cfg.model, list(g.levels), private_embed=g.private_embed,
                      private_head=g.private_head, seed=cfg.seed,
                      device=run_device(cfg) if device is None else device)


def build_topology(cfg: Config, grid: ModuleGrid, world_size: int, distributed: bool) -> Topology:
    """Ranks ↔ worker groups ↔ paths ↔ modules.

    The local backend simulates one worker group per path unless ``launcher.nproc``
    asks for fewer, so that bytes on the wire are counted as a real deployment with one
    group per path would send them (and so that, with the same number of groups, the
    local and torch backends partition contributions identically).
    """
    R = cfg.grid.replicas
    # training path t = p·R + r is replica r of grid path p: same modules, own data
    path_modules = [grid.module_ids_of_path(t // R) for t in range(grid.num_paths * R)]
    if distributed:
        return Topology(grid.module_ids, path_modules, world_size, cfg.launcher.group_size)
    groups = cfg.launcher.nproc if cfg.launcher.nproc > 1 else len(path_modules)
    return Topology(grid.module_ids, path_modules, min(groups, len(path_modules)), 1)


def build_comm_plan(cfg: Config, world_size: int) -> CommPlan:
    """Bytes per round of ``cfg``'s modules with its codec, for ``world_size`` ranks.

    Module sizes only (no data, no training): ``dipaco-plan`` prints it before a run and
    the job's summary compares the bytes a run sent with it.
    """
    grid = build_grid(cfg)
    topo = build_topology(cfg, grid, world_size, cfg.launcher.name != "local")
    counts = {m: grid.param_count(m) for m in grid.module_ids}
    d = cfg.diloco
    return plan_round(topo, counts, make_codec(d.codec, **codec_kwargs(d)), d.inner_steps, d.lossy_exchange,
                      sharded=cfg.launcher.group_parallel == "fsdp")


def build_streaming_schedule(cfg: Config, grid: ModuleGrid) -> RoundSchedule:
    """``diloco.streaming``'s staggered round (:mod:`dipaco.plan.stagger`).

    ``streaming_spread=size`` weighs each module by its encoded payload
    (``codec.nbytes_for(parameters)``), which depends on the module alone: every rank, and
    the local backend, compute the same points whatever the worker grouping.
    """
    d = cfg.diloco
    codec = make_codec(d.codec, **codec_kwargs(d))
    sizes = {m: codec.nbytes_for(grid.param_count(m)) for m in grid.module_ids}
    return streaming_schedule(grid.module_ids, d.inner_steps, d.streaming_delay, fragments=d.streaming_fragments,
                              spread=d.streaming_spread, sizes=sizes)


def build_schedule(cfg: Config, grid: ModuleGrid) -> RoundSchedule:
    """The run's round schedule, the one place it is built: synchronous (every module
    launches and lands after step H), or with ``diloco.streaming`` the staggered round of
    :func:`build_streaming_schedule` (the run's last round synchronous:
    :meth:`RoundSchedule.of_round`)."""
    if not cfg.diloco.streaming:
        return RoundSchedule.synchronous(grid.module_ids, cfg.diloco.inner_steps)
    return build_streaming_schedule(cfg, grid)


def format_streaming_plan(cfg: Config, world_size: int) -> str:
    """``dipaco-plan``'s streaming table: each fragment's launch and landing step and the
    peak bytes one path has in flight (per rank, by :func:`module_bytes_per_rank`)."""
    grid = build_grid(cfg, torch.device("cpu"))
    topo = build_topology(cfg, grid, world_size, cfg.launcher.name != "local")
    d = cfg.diloco
    codec = make_codec(d.codec, **codec_kwargs(d))
    nbytes = {m: module_bytes_per_rank(topo, m, grid.param_count(m), codec, d.lossy_exchange)
              for m in grid.module_ids}
    return format_stagger(build_streaming_schedule(cfg, grid), topo.path_modules, nbytes)
