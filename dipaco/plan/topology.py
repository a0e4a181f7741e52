"""Topology: who trains what, and who synchronises which module with whom (membership only).

Pure Python (no torch.distributed): the same answers on every rank and in the local
backend, so the process groups and the communication plan (:mod:`dipaco.plan.comm_plan`,
the byte-cost model built on these answers) follow from it alone.

Vocabulary (docs/design.md, glossary): ranks are cut into **worker groups** of ``group_size`` (G)
consecutive ranks; worker group ``g`` holds ranks ``g*G .. g*G+G-1``. Paths are dealt to
worker groups round-robin and STATICALLY: path ``p`` belongs to group ``p % num_groups``
in every round. When there are more paths than groups a group trains its paths in turn
within a round (docs/design.md contract 3: none is dropped). Because the dealing never changes, every
**module group** (the ranks of the worker groups holding a module) is fixed for the run
and its process groups are created once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol, Sequence

__all__ = ["GridLike", "Topology"]

class GridLike(Protocol):
    """What :meth:`Topology.from_grid` needs from a grid (``modules.ModuleGrid`` has it)."""

    module_ids: Sequence[str]
    num_paths: int

    def module_ids_of_path(self, path_id: int) -> Sequence[str]: ...



@dataclass(frozen=True)
class Topology:
    """Ranks ↔ worker groups ↔ paths ↔ modules. Validated at construction.

    Args:
        module_ids: every module id, in the ONE global order used everywhere (process
            group creation, reductions, checkpoints).
        path_modules: the module ids of each path; index = path_id.
        world_size: number of ranks (``launcher.nproc``; 1 for the local backend's view
            is NOT required: the local backend plays every rank of this topology).
        group_size: G, ranks per worker group (``launcher.group_size``).
    """

    module_ids: tuple[str, ...]
    path_modules: tuple[tuple[str, ...], ...]
    world_size: int
    group_size: int = 1
    _groups_of_module: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __init__(
        self,
        module_ids: Sequence[str],
        path_modules: Sequence[Sequence[str]],
        world_size: int,
        group_size: int = 1,
    ) -> None:
        object.__setattr__(self, "module_ids", tuple(str(m) for m in module_ids))
        object.__setattr__(self, "path_modules", tuple(tuple(str(m) for m in pm) for pm in path_modules))
        object.__setattr__(self, "world_size", int(world_size))
        object.__setattr__(self, "group_size", int(group_size))
        object.__setattr__(self, "_groups_of_module", {})
        self._validate()
        gom: dict[str, tuple[int, ...]] = {}
        for m in self.module_ids:
            gom[m] = tuple(g for g in range(self.num_groups) if m in self._module_set_of_group(g))
        object.__setattr__(self, "_groups_of_module", gom)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_grid(cls, grid: GridLike, world_size: int, group_size: int = 1) -> "Topology":
        """Build from any object with ``module_ids``, ``num_paths``, ``module_ids_of_path(p)``."""
        paths = [list(grid.module_ids_of_path(p)) for p in range(int(grid.num_paths))]
        return cls(list(grid.module_ids), paths, world_size, group_size)

    def _validate(self) -> None:
        W, G = self.world_size, self.group_size
        if G < 1:
            raise ValueError(f"launcher.group_size={G} must be ≥ 1: set launcher.group_size=1 (one rank per path)")
        if W < 1:
            raise ValueError(f"launcher.nproc={W} must be ≥ 1")
        if W % G != 0:
            lo, hi = max(G, W // G * G), (W // G + 1) * G
            raise ValueError(
                f"launcher.nproc={W} is not a multiple of launcher.group_size={G}: "
                f"set launcher.nproc to a multiple of launcher.group_size (e.g. {lo} or {hi}) "
                f"or change launcher.group_size"
            )
        if not self.module_ids:
            raise ValueError("the grid has no modules: check grid.levels (every level needs K ≥ 1)")
        if len(set(self.module_ids)) != len(self.module_ids):
            dup = sorted({m for m in self.module_ids if self.module_ids.count(m) > 1})
            raise ValueError(f"duplicate module ids {dup} in the grid's module_ids")
        if not self.path_modules:
            raise ValueError("the grid has no paths: set grid.levels to a non-empty list of K ≥ 1, e.g. grid.levels=[2,2]")
        known = set(self.module_ids)
        for p, mods in enumerate(self.path_modules):
            if not mods:
                raise ValueError(f"path {p} has no modules: check grid.levels")
            for m in mods:
                if m not in known:
                    raise ValueError(
                        f"path {p} uses module {m!r} which is not in the grid's module_ids {list(self.module_ids)}: "
                        "check grid.levels and the grid's module naming"
                    )
            if len(set(mods)) != len(mods):
                raise ValueError(f"path {p} lists a module twice: {list(mods)}")
        used = {m for mods in self.path_modules for m in mods}
        unused = [m for m in self.module_ids if m not in used]
        if unused:
            raise ValueError(f"modules {unused} are in no path and would never train: check grid.levels")
        P, NG = len(self.path_modules), W // G
        if NG > P:
            raise ValueError(
                f"launcher.nproc={W} with launcher.group_size={G} makes {NG} worker groups but the grid has only "
                f"{P} paths, so {(NG - P) * G} ranks would sit idle: set launcher.nproc ≤ {P * G} "
                f"or raise launcher.group_size to {math.ceil(W / P)} (with launcher.nproc a multiple of it)"
            )

    # ------------------------------------------------------------------ basic answers
    @property
    def num_paths(self) -> int:
        """Number of paths P."""
        return len(self.path_modules)

    @property
    def num_groups(self) -> int:
        """Number of worker groups, ``world_size // group_size``."""
        return self.world_size // self.group_size

    def _check_rank(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside [0, {self.world_size})")
        return rank

    def _check_group(self, g: int) -> int:
        if not 0 <= g < self.num_groups:
            raise ValueError(f"worker group {g} outside [0, {self.num_groups})")
        return g

    def _check_module(self, m: str) -> str:
        if m not in self._groups_of_module:
            raise ValueError(f"unknown module {m!r}; known: {list(self.module_ids)}")
        return m

    def group_of_rank(self, rank: int) -> int:
        """Worker group of a rank."""
        return self._check_rank(rank) // self.group_size

    def local_rank(self, rank: int) -> int:
        """Position of a rank inside its worker group, in ``[0, G)``."""
        return self._check_rank(rank) % self.group_size

    def ranks_of_group(self, g: int) -> list[int]:
        """The G consecutive ranks of worker group ``g``."""
        g = self._check_group(g)
        return list(range(g * self.group_size, (g + 1) * self.group_size))

    def group_of_path(self, path_id: int) -> int:
        """Worker group that trains ``path_id`` (static round-robin: ``p % num_groups``)."""
        if not 0 <= path_id < self.num_paths:
            raise ValueError(f"path_id {path_id} outside [0, {self.num_paths})")
        return path_id % self.num_groups

    def paths_of_group(self, g: int) -> list[int]:
        """Paths group ``g`` trains, in turn, every round (ascending path id)."""
        g = self._check_group(g)
        return list(range(g, self.num_paths, self.num_groups))

    def _module_set_of_group(self, g: int) -> set[str]:
        return {m for p in self.paths_of_group(g) for m in self.path_modules[p]}

    def modules_of_group(self, g: int) -> list[str]:
        """Union of the modules of group ``g``'s paths, in the global module order."""
        held = self._module_set_of_group(g)
        return [m for m in self.module_ids if m in held]

    def paths_of_module(self, m: str) -> list[int]:
        """Paths containing module ``m`` (its sharers)."""
        self._check_module(m)
        return [p for p, mods in enumerate(self.path_modules) if m in mods]

    def groups_of_module(self, m: str) -> list[int]:
        """Worker groups holding module ``m`` (ascending)."""
        return list(self._groups_of_module[self._check_module(m)])

    def module_ranks(self, m: str) -> list[int]:
        """Every rank of the module group of ``m`` (ascending)."""
        return [r for g in self.groups_of_module(m) for r in self.ranks_of_group(g)]

    def module_subgroup_ranks(self, m: str, local_rank: int) -> list[int]:
        """Rank ``local_rank`` of each worker group holding ``m``: who exchanges slice ``local_rank``."""
        if not 0 <= local_rank < self.group_size:
            raise ValueError(f"local_rank {local_rank} outside [0, {self.group_size})")
        return [g * self.group_size + local_rank for g in self.groups_of_module(m)]

    # ------------------------------------------------------------------ slicing
    def slice_numel(self, numel: int) -> int:
        """Elements of the slice each local rank exchanges: ``ceil(numel / G)``."""
        return -(-int(numel) // self.group_size)
