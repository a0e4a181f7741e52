"""What one rank holds for the rounds, built once (:func:`build_rank`) and resumed from
the newest checkpoint (:func:`resume`).

A rank (or, in the local backend, the one process playing every worker group) holds:
its device, the grid, the topology, the modules of its paths (FSDP2-sharded over the
worker group with ``launcher.group_parallel=fsdp``), its per-module syncs
(:class:`dipaco.sync.diloco.DiLoCoSync`) and the one object that runs their rounds by the
run's schedule (:class:`dipaco.sync.round_driver.RoundDriver`), one path learner per path
it trains (its own AdamW state and data stream, docs/design.md contract 3), the α rule
and the checkpoint manager.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from dipaco.plan.build import build_grid, build_schedule, build_topology
from dipaco.run.checkpoint import CheckpointManager
from dipaco.config import Config
from dipaco.data import Tokenizer, TokenStream
from dipaco.rounds.dense import load_dense_state
from dipaco.run.fingerprint import checkpoint_stamp
from dipaco.runtime.device import reset_peak_memory, set_deterministic
from dipaco.runtime.placement import placement_of
from dipaco.rounds.learner import PathLearner
from dipaco.runtime.progress import say
from dipaco.run.run_dir import RunDir
from dipaco.config.schedule import total_inner_steps, warmup_steps
from dipaco.sync.alpha import PathAlpha
from dipaco.rounds.checkpointing import load_checkpoint
from dipaco.sync.data_parallel import allreduce_gradients
from dipaco.sync.diloco import DiLoCoSync
from dipaco.sync.fsdp import apply_fsdp, worker_mesh
from dipaco.sync.groups import ProcessGroups
from dipaco.sync.round_driver import RoundDriver
from dipaco.plan.topology import Topology
from modules import ModuleGrid, PathModel, init_grid_from_dense

__all__ = ["RankState", "build_rank", "resume"]


@dataclass
class RankState:
    """Everything one rank trains with (``rank=None``: the local backend, every group here)."""

    cfg: Config
    run: RunDir
    rank: Optional[int]
    world_size: int
    device: torch.device
    grid: ModuleGrid
    topo: Topology
    local_rank: int
    paths: list[int]  # the paths this rank trains each round, in order
    modules: list[str]  # the modules of those paths, in the global module order
    sync: DiLoCoSync
    learners: dict[int, PathLearner]
    alpha: PathAlpha
    warmup_steps: int  # dense warm-up steps before the paths fork (the schedule continues them)
    ckpts: CheckpointManager
    driver: RoundDriver  # the rounds of ``sync`` by the run's schedule (synchronous or staggered)

    @property
    def distributed(self) -> bool:
        return self.rank is not None

    @property
    def is_rank0(self) -> bool:
        return self.rank is None or self.rank == 0


def build_rank(cfg: Config, run: RunDir, rank: Optional[int], world_size: int) -> RankState:
    """Device, grid, topology, process groups, FSDP, sync and learners of one rank."""
    distributed = rank is not None
    set_deterministic(cfg.trainer.deterministic)  # spawned ranks are fresh interpreters
    # this rank's device (GPU host rank % count; the local backend: every path on one)
    placement = placement_of(cfg).rank_device
    device = placement.device
    if not distributed:
        say(placement.describe())
    reset_peak_memory(device)
    grid = build_grid(cfg, device)
    topo = build_topology(cfg, grid, world_size, distributed)
    if distributed:
        local_rank, my_groups = topo.local_rank(rank), [topo.group_of_rank(rank)]
    else:
        local_rank, my_groups = 0, list(range(topo.num_groups))
    my_paths = sorted(p for g in my_groups for p in topo.paths_of_group(g))
    my_modules = [m for m in grid.module_ids if any(m in topo.path_modules[p] for p in my_paths)]

    n_warm = warmup_steps(cfg)
    if n_warm > 0:
        # Warm start: every copy of every module begins from the dense warm-up model.
        init_grid_from_dense(grid, load_dense_state(run.warmup))
    modules = {m: grid.module(m) for m in my_modules}

    pgroups = worker_pg = None
    if distributed:
        # streaming: the exchange gets worker groups of its own (dipaco/sync/groups.py, 3.)
        pgroups = ProcessGroups(topo, rank, cfg.launcher.backend, exchange_groups=cfg.diloco.streaming)
        worker_pg = pgroups.worker_group(topo.group_of_rank(rank))
    # launcher.group_parallel=fsdp: shard every held module over the worker group BEFORE the
    # sync and the learners take its (then DTensor) parameters
    fsdp = distributed and cfg.launcher.group_parallel == "fsdp"
    if fsdp:
        apply_fsdp(modules, worker_mesh(worker_pg, device))
    sync = DiLoCoSync.from_config(cfg.diloco, topo, modules, rank=rank, process_groups=pgroups, sharded=fsdp)
    driver = RoundDriver.from_config(sync, cfg.diloco, cfg.trainer.rounds, build_schedule(cfg, grid))

    G = topo.group_size if distributed else 1
    eos = Tokenizer.load(run.tokenizer).eos_id
    total = total_inner_steps(cfg)
    learners: dict[int, PathLearner] = {}
    for p in my_paths:
        # memory-mapped: batches are read from the shard's token file by offset
        stream = TokenStream.from_shard(run.shards, p, seq_len=cfg.trainer.seq_len,
                                        batch_size=cfg.trainer.batch_size, seed=cfg.seed, eos_id=eos,
                                        rank=local_rank, world=G)
        grad_sync = None
        if G > 1 and not fsdp:  # FSDP2 reduce-scatters the gradients itself
            grad_sync = (lambda params, _pg=worker_pg: allreduce_gradients(params, _pg, G))
        learners[p] = PathLearner(p, PathModel(grid, p // cfg.grid.replicas), stream, cfg.trainer, total,
                                  grad_sync=grad_sync, step_offset=n_warm, log_every=cfg.logging.every_steps)
    return RankState(cfg=cfg, run=run, rank=rank, world_size=world_size, device=device, grid=grid, topo=topo,
                     local_rank=local_rank, paths=my_paths, modules=my_modules, sync=sync, learners=learners,
                     alpha=PathAlpha.from_config(cfg.diloco.alpha, run.shards), warmup_steps=n_warm,
                     ckpts=CheckpointManager(run.checkpoints, keep_last=cfg.trainer.keep_last,
                                             stamp=checkpoint_stamp(run)), driver=driver)


def resume(rs: RankState) -> int:
    """Load the newest valid checkpoint when ``cfg.resume`` asks for it; the round to start at.

    A fresh start checks that every copy of every module holds the same weights
    (docs/design.md contract 4) instead.
    """
    start_round = 0
    if rs.cfg.resume:
        latest = rs.ckpts.latest_valid(log=lambda m: say(m, rs.rank))
        if latest is not None:
            start_round = load_checkpoint(latest, rs.grid, rs.sync, rs.learners, rs.modules, rs.topo, rs.rank,
                                          driver=rs.driver)
            say(f"resumed from {latest.name} (round {start_round})", rs.rank)
    if start_round == 0:
        # docs/design.md contract 4: all copies of a module start from the same weights.
        rs.sync.check_identical_start()
    return start_round
