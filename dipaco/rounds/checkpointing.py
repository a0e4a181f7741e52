"""Checkpoints of the rounds: per-module and per-path files of one round boundary.

Layout of ``checkpoints/round_NNNNNN/`` (both sync modes; decoupled mode writes the same
files at its end, :func:`dipaco.decoupled.run.write_checkpoint`):

* ``modules/<module>.safetensors``: the module's weights (its ``state_dict``);
* ``outer/<module>.safetensors``: :meth:`dipaco.sync.module_core.ModuleCore.state_dict`
  (θ_global, outer optimiser state, error-feedback residuals);
* ``outer/<module>.rank<r>.safetensors``: residuals of the other holders (torch backend);
* ``paths/path_<p>.safetensors``: each path's inner state (AdamW, step, data position);
* ``streams/path_<p>.safetensors`` (``diloco.streaming``): each path's own copy of its
  modules and its tokens since each module's last launch
  (:meth:`dipaco.sync.round_driver.RoundDriver.path_state`). No exchange is in flight at a
  round boundary (the staggered schedule lands every one in its round), so nothing else
  of the stream needs saving: none is lost or applied twice on resume;
* ``state.json`` (:func:`checkpoint_state`, one layout for both modes): round, mode,
  grid, and the worker grouping the residuals are keyed by (``residual.<group>``; in
  decoupled mode every path is a group of its own); decoupled mode adds each module's
  version. Checkpoints written before ``mode`` existed read as sync mode's.

Files hold whole tensors in every case: with ``launcher.group_parallel=fsdp`` the shards
of the weights, of θ_global and its outer state and of the AdamW moments are gathered
over the worker group on save (:mod:`dipaco.sync.fsdp`) and each rank keeps its rows on
load, so a run resumes with another group size or with ``group_parallel=replicate``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from dipaco.run.checkpoint import CheckpointError, CheckpointManager, load_state, save_state
from dipaco.runtime.progress import say
from dipaco.sync.diloco import DiLoCoSync
from dipaco.sync.round_driver import RoundDriver
from dipaco.sync.fsdp import full_module_state, load_module_state
from dipaco.plan.topology import Topology
from modules import ModuleGrid

__all__ = ["checkpoint_state", "save_checkpoint", "load_checkpoint", "write_module_files"]


def _barrier(distributed: bool) -> None:
    if distributed:
        dist.barrier()


def write_module_files(part: Path, grid: ModuleGrid, module_id: str, outer: dict[str, torch.Tensor],
                       weights: Optional[dict[str, torch.Tensor]] = None) -> None:
    """``modules/<module>`` (the live module's weights, or ``weights``) and ``outer/<module>``
    (its ModuleCore)."""
    weights = grid.module_state_dict(module_id) if weights is None else weights
    save_state(part / "modules" / f"{module_id}.safetensors", weights)
    save_state(part / "outer" / f"{module_id}.safetensors", outer)


def checkpoint_state(round_idx: int, grid: ModuleGrid, *, mode: str, worker_groups: int, group_size: int,
                     versions: Optional[dict[str, int]] = None) -> dict[str, Any]:
    """``state.json`` of a checkpoint, either mode: the round, the grid, and the worker
    grouping error-feedback residuals are keyed by (resume needs to know which grouping
    they belong to); ``versions``: decoupled mode's module versions."""
    out = {"round": int(round_idx), "mode": mode, "num_paths": grid.num_paths, "module_ids": list(grid.module_ids),
           "levels": list(grid.levels), "worker_groups": int(worker_groups), "group_size": int(group_size)}
    return out if versions is None else {**out, "versions": dict(versions)}


def save_checkpoint(ckpts: CheckpointManager, round_idx: int, grid: ModuleGrid, sync: DiLoCoSync,
                    learners: dict[int, Any], topo: Topology, rank: Optional[int],
                    distributed: bool, my_modules: list[str], driver: Optional[RoundDriver] = None) -> Path:
    """Every rank writes only its own files into the partial directory; rank 0 commits.

    ``driver``: the round driver; under a staggered schedule each path's copies are
    written beside its inner state.

    A module is written by the lowest rank that holds it; a path's inner state by local
    rank 0 of the worker group that trains it. Barriers order mkdir → writes → commit.
    """
    if rank is None or rank == 0:
        ckpts.begin(round_idx)
    _barrier(distributed)
    part = ckpts.partial_dir(round_idx)
    for mid in my_modules:
        # sharded modules (group_parallel=fsdp) are gathered whole here: both calls are then
        # collectives over the worker group, made by its every rank in the same module order
        outer = sync.syncs[mid].state_dict()
        weights = full_module_state(grid.module(mid)) if sync.sharded else None
        if not distributed or min(topo.module_ranks(mid)) == rank:
            write_module_files(part, grid, mid, outer, weights)
        else:
            # Error-feedback residuals are per rank (its worker group's, and the chunk it
            # owns in the two-phase exchange): the other holders save theirs too, or an
            # exact resume would lose them.
            mine = {k: v for k, v in outer.items() if k.startswith("residual.")}
            if mine:
                save_state(part / "outer" / f"{mid}.rank{rank}.safetensors", mine)
    for p, learner in learners.items():
        state = learner.state_dict()  # every rank: a collective when sharded
        if not distributed or topo.local_rank(rank) == 0:
            save_state(part / "paths" / f"path_{p}.safetensors", state)
            if driver is not None and driver.holds_path_state:
                save_state(part / "streams" / f"path_{p}.safetensors", driver.path_state(p))
    _barrier(distributed)
    final = ckpts.final_dir(round_idx)
    if rank is None or rank == 0:
        ckpts.commit(round_idx, checkpoint_state(round_idx, grid, mode="sync", worker_groups=topo.num_groups,
                                                 group_size=topo.group_size))
        ckpts.prune()
    _barrier(distributed)
    return final


def load_checkpoint(path: Path, grid: ModuleGrid, sync: DiLoCoSync, learners: dict[int, Any],
                    my_modules: list[str], topo: Topology, rank: Optional[int] = None,
                    driver: Optional[RoundDriver] = None) -> int:
    """Load this rank's modules, outer states and paths (under a staggered schedule each
    path's copies too: ``driver``); return the round to start from.

    The worker grouping may differ from the checkpoint's (compute joined or left between
    rounds): module weights, outer optimiser states and per-path states do not depend on
    it and are loaded as they are; paths are simply dealt to the new groups. Only the
    error-feedback residuals are per worker group; with a different grouping they belong
    to no one, so they are dropped (logged): the next round sends uncompensated codec
    error once, which is what a fresh group would do anyway.
    """
    state = json.loads((path / "state.json").read_text())
    if list(state.get("levels", [])) != list(grid.levels):
        raise CheckpointError(f"checkpoint {path} is for grid {state.get('levels')}, not {grid.levels}")
    saved_groups = (state.get("worker_groups"), state.get("group_size"))
    regrouped = saved_groups != (topo.num_groups, topo.group_size)
    if regrouped:
        say(f"checkpoint {path.name} was written by {saved_groups[0]} worker group(s) of "
            f"{saved_groups[1]} rank(s); now {topo.num_groups} of {topo.group_size}: paths are "
            "re-dealt and error-feedback residuals are dropped", rank)
    for mid in my_modules:
        weights = load_state(path / "modules" / f"{mid}.safetensors")
        if sync.sharded:  # full tensors: this rank keeps its rows (any group size, either group_parallel)
            load_module_state(grid.module(mid), weights)
        else:
            grid.load_module_state_dict(mid, weights)
        outer = load_state(path / "outer" / f"{mid}.safetensors")
        own = path / "outer" / f"{mid}.rank{rank}.safetensors"
        if rank is not None and own.exists():
            outer.update(load_state(own))
        if regrouped:
            outer = {k: v for k, v in outer.items() if not k.startswith("residual.")}
        # restores the live weights from the module's global copy as well
        sync.syncs[mid].load_state_dict(outer)
    for p, learner in learners.items():
        learner.load_state_dict(load_state(path / "paths" / f"path_{p}.safetensors"))
        if driver is not None and driver.holds_path_state:  # synchronous rounds wrote none: θ_global
            own = path / "streams" / f"path_{p}.safetensors"
            driver.load_path_state(p, load_state(own) if own.exists() else None)
    return int(state["round"])
