"""Process groups of a run: module groups, module subgroups, worker groups.

HAZARD (docs/design.md contract 2): ``torch.distributed.new_group`` is a collective over the WORLD.
Every rank must call it for every group, members or not, in exactly the same order; a
rank that skips one call (or calls them in another order) makes the NEXT collective
hang until its timeout, far from the cause. :class:`ProcessGroups` therefore creates
every group, once, in one global order computed from the :class:`Topology` alone:

1. for each module id in ``topology.module_ids`` order:
   a. its module group (every rank of every worker group holding it),
   b. for each local rank ``r`` in ``0..G-1``: its module subgroup (rank ``r`` of each
      holder), which exchanges slice ``r`` of the module's buffer;
2. for each worker group ``g``: its ranks (data parallel inside a path);
3. with ``exchange_groups`` (streaming sync), for each worker group ``g`` a second group
   of the same ranks, used only by the exchange's all-gather of reduced slices: a
   streaming exchange runs on the communication thread while the inner loop all-reduces
   gradients (or FSDP2 gathers) on the first one, and two threads must never issue
   collectives on one process group (their order would differ between ranks).

Groups of one rank are not created (they need no collective), and a rank set already
created is reused; both decisions depend only on the topology, so every rank makes
them identically. Construct ``ProcessGroups`` on every rank right after
``init_process_group`` and before any other collective.
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

from dipaco.plan.topology import Topology

__all__ = ["ProcessGroups", "resolve_backend"]


def resolve_backend(backend: str = "auto") -> str:
    """``auto`` → the world group's backend, which :mod:`dipaco.runtime.device` chose at init.

    So a run's subgroups never disagree with its world group: nccl only when every rank
    of the host owns a distinct GPU, gloo otherwise (and on the CPU).
    """
    if backend == "auto":
        return str(dist.get_backend()) if dist.is_available() and dist.is_initialized() else "gloo"
    if backend not in ("gloo", "nccl", "mpi"):
        raise ValueError(f"launcher.backend={backend!r} must be one of auto, gloo, nccl, mpi")
    return backend


class ProcessGroups:
    """Every process group the sync needs, created once on every rank.

    Args:
        topology: the run's topology (identical on every rank).
        rank: this process's global rank.
        backend: ``auto`` | ``gloo`` | ``nccl``.
    """

    def __init__(self, topology: Topology, rank: int, backend: str = "auto", exchange_groups: bool = False) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ProcessGroups needs torch.distributed.init_process_group() to have run on every rank")
        if dist.get_world_size() != topology.world_size:
            raise ValueError(
                f"launcher.nproc={topology.world_size} but torch.distributed has world size {dist.get_world_size()}"
            )
        self.topology = topology
        self.rank = int(rank)
        self.backend = resolve_backend(backend)
        self._cache: dict[tuple[int, ...], Any] = {}
        #: rank tuples in creation order (identical on every rank; tests assert on it)
        self.creation_order: list[tuple[int, ...]] = []
        self._module_group: dict[str, Any] = {}
        self._subgroup: dict[tuple[str, int], Any] = {}
        self._worker_group: dict[int, Any] = {}
        # ---- the ONE global order; every rank runs this whole loop (see module doc) ----
        for m in topology.module_ids:
            self._module_group[m] = self._make(topology.module_ranks(m))
            for r in range(topology.group_size):
                self._subgroup[(m, r)] = self._make(topology.module_subgroup_ranks(m, r))
        for g in range(topology.num_groups):
            self._worker_group[g] = self._make(topology.ranks_of_group(g))
        self._exchange_group: dict[int, Any] = {}
        if exchange_groups:  # the same decision on every rank (a config key): see 3. above
            for g in range(topology.num_groups):
                self._exchange_group[g] = self._make(topology.ranks_of_group(g), fresh=True)

    def _make(self, ranks: list[int], fresh: bool = False) -> Any:
        key = tuple(sorted(ranks))
        if len(key) <= 1:
            return None  # no collective needed; skipped identically on every rank
        if fresh:  # a group of its own even when these ranks already have one
            self.creation_order.append(key)
            return dist.new_group(list(key), backend=self.backend)
        if key not in self._cache:
            # called by EVERY rank, member or not (non-members get NON_GROUP_MEMBER)
            self._cache[key] = dist.new_group(list(key), backend=self.backend)
            self.creation_order.append(key)
        return self._cache[key]

    def _member(self, ranks: list[int], what: str) -> None:
        if self.rank not in ranks:
            raise ValueError(f"rank {self.rank} is not a member of {what} (ranks {ranks})")

    def module_group(self, module_id: str) -> Any:
        """Group of every rank holding ``module_id`` (None if that is one rank)."""
        self._member(self.topology.module_ranks(module_id), f"the module group of {module_id!r}")
        return self._module_group[module_id]

    def module_subgroup(self, module_id: str, local_rank: int) -> Any:
        """Group exchanging slice ``local_rank`` of ``module_id`` (None if one rank)."""
        self._member(
            self.topology.module_subgroup_ranks(module_id, local_rank), f"subgroup {local_rank} of {module_id!r}"
        )
        return self._subgroup[(module_id, local_rank)]

    def worker_group(self, g: int | None = None) -> Any:
        """Group of worker group ``g`` (default: this rank's); None when G = 1."""
        if g is None:
            g = self.topology.group_of_rank(self.rank)
        self._member(self.topology.ranks_of_group(g), f"worker group {g}")
        return self._worker_group[g]

    def exchange_worker_group(self, g: int | None = None) -> Any:
        """The group the exchange all-gathers reduced slices over in worker group ``g``:
        its own (``exchange_groups``) or, in synchronous sync, the worker group itself."""
        if g is None:
            g = self.topology.group_of_rank(self.rank)
        group = self.worker_group(g)
        return self._exchange_group.get(g, group)
