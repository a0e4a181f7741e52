"""The byte-cost model of one DiLoCo round: how each module crosses its module group.

Built on :class:`dipaco.plan.topology.Topology` (who holds what) and a codec object (anything
with ``name``, ``lossy``, ``chunk_align`` and ``nbytes_for``, e.g. from
:func:`dipaco.plan.codecs.make_codec`): the planner (``dipaco-plan``, the summary) and
both communicators call :func:`module_exchange`, so planned and measured bytes agree
exactly. No import of :mod:`dipaco.sync` here: the communicators import this file.

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
  ``allgather_bytes(G, 4*s)`` per rank; not with ``launcher.group_parallel=fsdp``, where
  rank ``r`` keeps slice ``r`` (its FSDP shard, ``sharded=True``).
* a module held by a single worker group (k = 1) sends nothing: no codec, no collective.
* the DDP equivalent: a dense data-parallel run of the same path model over all W ranks
  all-reduces every gradient every inner step: ``H * ring_allreduce_bytes(W, 4*N_path)``
  per rank per round (``N_path`` = mean parameter count of a path).

Totals are per-rank bytes summed over the ranks that send them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from dipaco.plan.topology import Topology

__all__ = [
    "LOSSY_EXCHANGES",
    "META_BYTES",
    "CodecLike",
    "CommPlan",
    "Exchange",
    "ModulePlan",
    "allgather_bytes",
    "chunk_numel",
    "format_plan",
    "module_bytes_per_rank",
    "module_exchange",
    "plan_round",
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


class CodecLike(Protocol):
    """What the cost model needs from a codec (:mod:`dipaco.plan.codecs` codecs have it)."""

    name: str

    def nbytes_for(self, numel: int) -> int: ...


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


def module_exchange(topo: Topology, m: str, numel: int, codec: CodecLike,
                    lossy_exchange: str = "reduce_scatter") -> Exchange:
    """How module ``m`` (``numel`` parameters) crosses its module subgroups with ``codec``.

    The one place that decides the exchange and its payload bytes: the planner and
    both communicators use it, so planned and measured counts agree exactly.
    ``lossy_exchange`` is one of :data:`LOSSY_EXCHANGES`.
    """
    if lossy_exchange not in LOSSY_EXCHANGES:
        raise ValueError(f"lossy_exchange={lossy_exchange!r} must be one of {list(LOSSY_EXCHANGES)}")
    k = len(topo.groups_of_module(m))
    s = topo.slice_numel(numel)
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


def module_bytes_per_rank(topo: Topology, m: str, numel: int, codec: CodecLike,
                          lossy_exchange: str = "reduce_scatter", sharded: bool = False) -> int:
    """Bytes one rank of ``m``'s module group sends per round (formulas in the module doc).

    ``sharded`` (``launcher.group_parallel=fsdp``): rank ``r`` keeps its reduced slice (its
    FSDP shard, :mod:`dipaco.sync.sharded`), so nothing is all-gathered inside the group.
    """
    ex = module_exchange(topo, m, numel, codec, lossy_exchange)
    if ex.k <= 1:
        return 0
    meta = ring_allreduce_bytes(ex.k, META_BYTES)
    intra = 0 if sharded else allgather_bytes(topo.group_size, 4 * ex.slice_numel)
    return ex.cross_bytes + meta + intra


def plan_round(
    topo: Topology,
    param_counts: dict[str, int],
    codec: CodecLike,
    inner_steps: int = 1,
    lossy_exchange: str = "reduce_scatter",
    sharded: bool = False,
) -> CommPlan:
    """Bytes per round per module for ``codec``, and the DDP equivalent.

    Args:
        topo: who holds which module.
        param_counts: parameter count of every module id.
        codec: the codec object (``make_codec(diloco.codec, **codec_kwargs(diloco))``).
        inner_steps: H, for the DDP equivalent (DDP all-reduces every inner step).
        lossy_exchange: how lossy codecs cross module subgroups (:data:`LOSSY_EXCHANGES`).
        sharded: modules are FSDP-sharded inside each worker group (no intra-group gather).
    """
    missing = [m for m in topo.module_ids if m not in param_counts]
    if missing:
        raise ValueError(f"param_counts lacks modules {missing}")
    if inner_steps < 1:
        raise ValueError(f"diloco.inner_steps={inner_steps} must be ≥ 1")
    rows = []
    for m in topo.module_ids:
        n = int(param_counts[m])
        groups = tuple(topo.groups_of_module(m))
        per_rank = module_bytes_per_rank(topo, m, n, codec, lossy_exchange, sharded)
        rows.append(ModulePlan(
            module_id=m,
            sharers=tuple(topo.paths_of_module(m)),
            groups=groups,
            params=n,
            bytes_per_rank=per_rank,
            bytes_total=per_rank * len(groups) * topo.group_size,
            exchange=module_exchange(topo, m, n, codec, lossy_exchange).kind,
        ))
    path_params = sum(sum(int(param_counts[m]) for m in mods) for mods in topo.path_modules) / topo.num_paths
    ddp_rank = inner_steps * ring_allreduce_bytes(topo.world_size, int(round(4 * path_params)))
    return CommPlan(
        codec=codec.name,
        inner_steps=int(inner_steps),
        world_size=topo.world_size,
        group_size=topo.group_size,
        modules=tuple(rows),
        bytes_per_round=sum(r.bytes_total for r in rows),
        ddp_bytes_per_round=ddp_rank * topo.world_size,
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
