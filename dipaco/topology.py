"""Topology: who trains what, and who synchronises which module with whom.

Pure Python (no torch.distributed): the same answers on every rank and in the local
backend, so the process groups and the communication plan follow from it alone.

Vocabulary (see DESIGN.md): ranks are cut into **worker groups** of ``group_size`` (G)
consecutive ranks; worker group ``g`` holds ranks ``g*G .. g*G+G-1``. Paths are dealt to
worker groups round-robin and STATICALLY: path ``p`` belongs to group ``p % num_groups``
in every round. When there are more paths than groups a group trains its paths in turn
within a round (contract 3: none is dropped). Because the dealing never changes, every
**module group** (the ranks of the worker groups holding a module) is fixed for the run
and its process groups are created once.

Communication model (the byte formulas used for planning AND for measured counts, so
the two agree exactly):

* Every module's flat fp32 buffer of ``n`` elements is padded to ``G*s`` with
  ``s = ceil(n / G)`` and cut into G slices; local rank ``r`` of every worker group that
  holds the module exchanges slice ``r`` with the local rank ``r`` of the other holders
  (a *module subgroup* of ``k`` ranks, ``k`` = number of worker groups holding it).
* codec ``none``: ring all-reduce of the slice; each rank sends
  ``ring_allreduce_bytes(k, b) = 2*(k-1)*b // k`` bytes for a ``b``-byte buffer.
* lossy codecs, ``lossy_exchange="reduce_scatter"`` (the default): a compressed
  two-phase all-reduce. The slice is padded to ``k*c`` elements and cut into k chunks of
  ``c = chunk_numel(s, k, codec.chunk_align)`` (``ceil(s/k)`` rounded up to the codec's
  alignment, e.g. the int8 block, so no block scale straddles two chunks). Phase 1
  (reduce-scatter): every member sends its encoded chunk ``j`` to member ``j``; member
  ``j`` decodes the k payloads and sums them in ascending worker-group order. Phase 2
  (all-gather): member ``j`` re-encodes its reduced chunk and sends it to the k-1 others.
  Each rank sends ``reduce_scatter_bytes(k, e) = 2*(k-1)*e`` bytes, ``e =
  codec.nbytes_for(c)`` ≈ ``b/k``: about ``2*(k-1)/k*b``, like a ring all-reduce.
* lossy codecs, ``lossy_exchange="all_gather"``: all-gather of the encoded slice; each
  rank sends ``allgather_bytes(k, b) = (k-1)*b`` bytes (its payload to each other member),
  growing linearly with the number of worker groups sharing the module. Exact sum of the
  decoded contributions (one encoding error instead of two).
* ``lossy_exchange="auto"``: per module, whichever of the two sends fewer bytes per rank
  (ties go to all_gather: one encoding error fewer). Small modules (k*c padding) and
  k = 2 usually pick all_gather.
* the weights of the round (Σα, number of contributions, number dropped; 3 float64,
  ``META_BYTES`` = 24 bytes) are all-reduced in the same subgroup: ring formula.
* with G > 1 the worker group then all-gathers the reduced fp32 slices:
  ``allgather_bytes(G, 4*s)`` per rank.
* a module held by a single worker group (k = 1) sends nothing: no codec, no collective.
* the DDP equivalent: a dense data-parallel run of the same path model over all W ranks
  all-reduces every gradient every inner step: ``H * ring_allreduce_bytes(W, 4*N_path)``
  per rank per round (``N_path`` = mean parameter count of a path).

Totals are per-rank bytes summed over the ranks that send them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

__all__ = [
    "LOSSY_EXCHANGES",
    "META_BYTES",
    "CommPlan",
    "Exchange",
    "ModulePlan",
    "Topology",
    "allgather_bytes",
    "chunk_numel",
    "format_plan",
    "reduce_scatter_bytes",
    "ring_allreduce_bytes",
]

#: bytes of the per-module round weights exchanged with every reduction (3 float64).
META_BYTES = 24


def ring_allreduce_bytes(k: int, nbytes: int) -> int:
    """Bytes one rank sends in a ring all-reduce of an ``nbytes`` buffer over ``k`` ranks."""
    if k <= 1:
        return 0
    return 2 * (k - 1) * nbytes // k


def allgather_bytes(k: int, nbytes: int) -> int:
    """Bytes one rank sends in an all-gather of an ``nbytes`` payload over ``k`` ranks."""
    if k <= 1:
        return 0
    return (k - 1) * nbytes


def reduce_scatter_bytes(k: int, chunk_nbytes: int) -> int:
    """Bytes one rank sends in the compressed two-phase all-reduce over ``k`` ranks.

    Phase 1 sends k-1 encoded chunks (one to each other member), phase 2 sends the
    rank's re-encoded reduced chunk to the k-1 others: ``2*(k-1)*chunk_nbytes``.
    """
    if k <= 1:
        return 0
    return 2 * (k - 1) * chunk_nbytes


def chunk_numel(slice_numel: int, k: int, align: int = 1) -> int:
    """Elements per chunk when a ``slice_numel`` slice is split among ``k`` members.

    ``ceil(slice_numel / k)`` rounded up to a multiple of ``align`` (a codec's
    ``chunk_align``, e.g. the int8 block size), so every chunk has the same size (the
    slice is zero-padded to ``k*c``) and no codec block straddles two chunks.
    """
    a = max(1, int(align))
    per = -(-int(slice_numel) // max(1, int(k)))
    return -(-per // a) * a


#: values of ``lossy_exchange`` (how lossy codecs combine encoded slices).
LOSSY_EXCHANGES = ("reduce_scatter", "all_gather", "auto")


@dataclass(frozen=True)
class Exchange:
    """How one module's slice crosses its module subgroup (the same for every slice).

    ``kind``: ``"local"`` (k ≤ 1, nothing crosses), ``"all_reduce"`` (codec none),
    ``"all_gather"`` or ``"reduce_scatter"`` (lossy codecs). Every slice (padded to
    ``num_chunks * chunk_numel`` elements) is encoded as ``num_chunks`` chunks of
    ``chunk_numel`` elements (1 chunk of ``slice_numel`` unless ``reduce_scatter``).
    """

    kind: str
    k: int
    slice_numel: int
    num_chunks: int
    chunk_numel: int
    cross_bytes: int  # bytes each rank of the subgroup sends (codec payloads only)

    @property
    def padded_slice_numel(self) -> int:
        """``num_chunks * chunk_numel`` (≥ ``slice_numel``)."""
        return self.num_chunks * self.chunk_numel


class GridLike(Protocol):
    """What :meth:`Topology.from_grid` needs from a grid (``modules.ModuleGrid`` has it)."""

    module_ids: Sequence[str]
    num_paths: int

    def module_ids_of_path(self, path_id: int) -> Sequence[str]: ...


@dataclass(frozen=True)
class ModulePlan:
    """Communication of one module per round (see the module docstring for formulas)."""

    module_id: str
    sharers: tuple[int, ...]  # paths containing the module
    groups: tuple[int, ...]  # worker groups holding it (its module group, by group)
    params: int
    bytes_per_rank: int  # bytes each rank of the module group sends per round
    bytes_total: int  # summed over the module group's ranks
    exchange: str = ""  # Exchange.kind: local | all_reduce | all_gather | reduce_scatter


@dataclass(frozen=True)
class CommPlan:
    """Per-module bytes per round for one codec, and the dense DDP equivalent."""

    codec: str
    inner_steps: int
    world_size: int
    group_size: int
    modules: tuple[ModulePlan, ...]
    bytes_per_round: int
    ddp_bytes_per_round: int
    path_params: float
    lossy_exchange: str = "reduce_scatter"

    @property
    def ratio_vs_ddp(self) -> float:
        """DiPaCo bytes ÷ DDP bytes per round (0 when DDP sends nothing, e.g. 1 rank)."""
        return self.bytes_per_round / self.ddp_bytes_per_round if self.ddp_bytes_per_round else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly view."""
        return {
            "codec": self.codec,
            "inner_steps": self.inner_steps,
            "world_size": self.world_size,
            "group_size": self.group_size,
            "lossy_exchange": self.lossy_exchange,
            "bytes_per_round": self.bytes_per_round,
            "ddp_bytes_per_round": self.ddp_bytes_per_round,
            "ratio_vs_ddp": self.ratio_vs_ddp,
            "modules": [
                {
                    "module": m.module_id,
                    "sharers": list(m.sharers),
                    "groups": list(m.groups),
                    "params": m.params,
                    "bytes_per_rank": m.bytes_per_rank,
                    "bytes_total": m.bytes_total,
                    "exchange": m.exchange,
                }
                for m in self.modules
            ],
        }


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

    # ------------------------------------------------------------------ planning
    def slice_numel(self, numel: int) -> int:
        """Elements of the slice each local rank exchanges: ``ceil(numel / G)``."""
        return -(-int(numel) // self.group_size)

    def exchange(self, m: str, numel: int, codec: Any, lossy_exchange: str = "reduce_scatter") -> Exchange:
        """How module ``m`` (``numel`` parameters) crosses its module subgroups with ``codec``.

        The one place that decides the exchange and its payload bytes: the planner and
        both communicators use it, so planned and measured counts agree exactly.
        ``codec`` is a codec object (``name``, ``lossy``, ``chunk_align``, ``nbytes_for``)
        or a codec name; ``lossy_exchange`` is one of :data:`LOSSY_EXCHANGES`.
        """
        if lossy_exchange not in LOSSY_EXCHANGES:
            raise ValueError(f"lossy_exchange={lossy_exchange!r} must be one of {list(LOSSY_EXCHANGES)}")
        if isinstance(codec, str):
            from dipaco.sync.codecs import make_codec

            codec = make_codec(codec)
        k = len(self.groups_of_module(m))
        s = self.slice_numel(numel)
        if k <= 1:
            return Exchange("local", k, s, 1, s, 0)
        if codec.name == "none":
            return Exchange("all_reduce", k, s, 1, s, ring_allreduce_bytes(k, 4 * s))
        gather = Exchange("all_gather", k, s, 1, s, allgather_bytes(k, codec.nbytes_for(s)))
        if lossy_exchange == "all_gather":
            return gather
        c = chunk_numel(s, k, getattr(codec, "chunk_align", 1))
        two_phase = Exchange("reduce_scatter", k, s, k, c, reduce_scatter_bytes(k, codec.nbytes_for(c)))
        if lossy_exchange == "auto" and gather.cross_bytes <= two_phase.cross_bytes:
            return gather
        return two_phase

    def module_bytes_per_rank(self, m: str, numel: int, codec: Any, lossy_exchange: str = "reduce_scatter") -> int:
        """Bytes one rank of ``m``'s module group sends per round (formulas in module doc).

        ``codec`` is a codec object (``name`` and ``nbytes_for``) or a codec name.
        """
        ex = self.exchange(m, numel, codec, lossy_exchange)
        if ex.k <= 1:
            return 0
        meta = ring_allreduce_bytes(ex.k, META_BYTES)
        intra = allgather_bytes(self.group_size, 4 * ex.slice_numel)
        return ex.cross_bytes + meta + intra

    def plan(
        self,
        param_counts: dict[str, int],
        codec: str = "none",
        inner_steps: int = 1,
        lossy_exchange: str = "reduce_scatter",
        **codec_kw: Any,
    ) -> CommPlan:
        """Bytes per round per module for ``codec``, and the DDP equivalent.

        Args:
            param_counts: parameter count of every module id.
            codec: codec name (``diloco.codec``), with ``codec_kw`` its options.
            inner_steps: H, for the DDP equivalent (DDP all-reduces every inner step).
            lossy_exchange: how lossy codecs cross module subgroups (:data:`LOSSY_EXCHANGES`).
        """
        from dipaco.sync.codecs import make_codec

        missing = [m for m in self.module_ids if m not in param_counts]
        if missing:
            raise ValueError(f"param_counts lacks modules {missing}")
        if inner_steps < 1:
            raise ValueError(f"diloco.inner_steps={inner_steps} must be ≥ 1")
        cod = make_codec(codec, **codec_kw)
        rows = []
        for m in self.module_ids:
            n = int(param_counts[m])
            per_rank = self.module_bytes_per_rank(m, n, cod, lossy_exchange)
            kind = self.exchange(m, n, cod, lossy_exchange).kind
            groups = tuple(self.groups_of_module(m))
            rows.append(
                ModulePlan(
                    module_id=m,
                    sharers=tuple(self.paths_of_module(m)),
                    groups=groups,
                    params=n,
                    bytes_per_rank=per_rank,
                    bytes_total=per_rank * len(groups) * self.group_size,
                    exchange=kind,
                )
            )
        path_params = sum(sum(int(param_counts[m]) for m in mods) for mods in self.path_modules) / self.num_paths
        ddp_rank = inner_steps * ring_allreduce_bytes(self.world_size, int(round(4 * path_params)))
        return CommPlan(
            codec=cod.name,
            inner_steps=int(inner_steps),
            world_size=self.world_size,
            group_size=self.group_size,
            modules=tuple(rows),
            bytes_per_round=sum(r.bytes_total for r in rows),
            ddp_bytes_per_round=ddp_rank * self.world_size,
            path_params=path_params,
            lossy_exchange=lossy_exchange,
        )


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"  # pragma: no cover


def format_plan(plan: CommPlan) -> str:
    """A plain-text table of a :class:`CommPlan`."""
    head = (f"{'module':<12} {'paths':>5} {'groups':>6} {'params':>10} {'bytes/rank':>11} {'bytes total':>12}"
            f"  {'exchange':<14}")
    lossy = f" lossy_exchange={plan.lossy_exchange}" if plan.codec != "none" else ""
    lines = [
        f"communication plan: codec={plan.codec}{lossy} world_size={plan.world_size} group_size={plan.group_size} "
        f"H={plan.inner_steps} (per round)",
        head,
        "-" * len(head),
    ]
    for m in plan.modules:
        lines.append(
            f"{m.module_id:<12} {len(m.sharers):>5} {len(m.groups):>6} {m.params:>10} "
            f"{_fmt_bytes(m.bytes_per_rank):>11} {_fmt_bytes(m.bytes_total):>12}  {m.exchange:<14}"
        )
    lines.append("-" * len(head))
    lines.append(f"{'DiPaCo total':<37}{_fmt_bytes(plan.bytes_per_round):>25}")
    lines.append(f"{'DDP equivalent':<37}{_fmt_bytes(plan.ddp_bytes_per_round):>25}")
    if plan.ddp_bytes_per_round:
        inv = f" (1/{1 / plan.ratio_vs_ddp:.0f})" if plan.ratio_vs_ddp > 0 else ""
        lines.append(f"{'ratio DiPaCo / DDP':<37}{plan.ratio_vs_ddp:>25.4f}{inv}")
    return "\n".join(lines)
