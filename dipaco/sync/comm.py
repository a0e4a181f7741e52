"""Communicators: how one module's encoded contributions are summed across worker groups.

Both communicators compute the same numbers (docs/design.md contract 1):

* the module's buffer (padded to ``G*s`` elements) is cut into G slices; slice ``r`` of
  every contributor (worker group) is decoded and summed IN ASCENDING GROUP ORDER, and
  the G reduced slices are concatenated;
* codec ``none`` in :class:`TorchComm` uses ``all_reduce`` (gloo/nccl's own summation
  order, so equal up to fp32 rounding: allclose);
* lossy codecs, exchange ``reduce_scatter`` (default; see :meth:`Topology.exchange`): a
  compressed two-phase all-reduce. Every contributor encodes slice ``r`` as k equal,
  block-aligned chunks; chunk ``j`` of every contributor goes to member ``j`` (the j-th
  worker group holding the module, ascending), which decodes them and sums them in
  ascending group order, re-encodes the reduced chunk and all-gathers it; everybody
  decodes the k reduced chunks. The result carries the codec error twice (each
  contribution's encoding, then the reduced chunk's). With error feedback the first
  error goes into the contributor's residual (``ModuleSync``) and the second into the
  *owner residual* of the member that reduced the chunk (``owner_residuals``), added to
  its reduced chunk before next round's re-encoding;
* lossy codecs, exchange ``all_gather``: all payloads are all-gathered and summed in
  group order (one codec error, but bytes grow with k).

:class:`LocalComm` performs the very same decodes, ordered sums and re-encodings, so
lossy codecs are bit-identical between the backends (same kernels, same order).

:class:`LocalComm` is given every contributor's payloads (one process plays every
worker group) and counts the bytes every rank WOULD send; :class:`TorchComm` is given its
own worker group's payloads and counts the bytes THIS rank sends. Byte formulas are in
:mod:`dipaco.topology` (the planner uses the same functions).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from dipaco.sync.codecs import Codec, Payload
from dipaco.comm_plan import (
    LOSSY_EXCHANGES,
    META_BYTES,
    Exchange,
    allgather_bytes,
    module_exchange,
    ring_allreduce_bytes,
)
from dipaco.topology import Topology

__all__ = ["CommBytes", "Communicator", "LocalComm", "TorchComm"]


@dataclass
class CommBytes:
    """Bytes sent for one module in one round (by the ranks the communicator plays)."""

    cross: int = 0  # slices exchanged across worker groups (the module subgroups)
    meta: int = 0  # Σα / counts exchanged with them
    intra: int = 0  # reduced slices all-gathered inside each worker group

    @property
    def total(self) -> int:
        """cross + meta + intra."""
        return self.cross + self.meta + self.intra

    def __iadd__(self, other: "CommBytes") -> "CommBytes":
        self.cross += other.cross
        self.meta += other.meta
        self.intra += other.intra
        return self


#: ``payloads[c][r][j]``: chunk ``j`` of slice ``r`` of contributor (worker group) ``c``.
Chunked = dict[int, Sequence[Sequence[Payload]]]


class Communicator:
    """Interface used by :class:`dipaco.sync.module_sync.ModuleSync`.

    Args of subclasses: ``lossy_exchange`` is one of
    :data:`dipaco.comm_plan.LOSSY_EXCHANGES` (default ``"reduce_scatter"``).
    """

    topology: Topology
    lossy_exchange: str = "reduce_scatter"

    def _set_lossy_exchange(self, lossy_exchange: str) -> None:
        if lossy_exchange not in LOSSY_EXCHANGES:
            raise ValueError(f"lossy_exchange={lossy_exchange!r} must be one of {list(LOSSY_EXCHANGES)}")
        self.lossy_exchange = lossy_exchange

    def contributors(self, module_id: str) -> list[int]:
        """Worker groups whose contributions this process holds for ``module_id``."""
        raise NotImplementedError

    def exchange_for(self, module_id: str, numel: int, codec: Codec) -> Exchange:
        """The exchange (kind, chunking, bytes) of a module: :func:`dipaco.comm_plan.module_exchange`."""
        return module_exchange(self.topology, module_id, numel, codec, self.lossy_exchange)

    def exchange(
        self,
        module_id: str,
        payloads: Chunked,
        codec: Codec,
        ex: Exchange,
        owner_residuals: dict[int, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, CommBytes]:
        """Sum the contributors' slices; ``payloads[c][r]`` are the ``ex.num_chunks``
        encoded chunks of slice ``r`` of contributor ``c``.

        ``owner_residuals`` (error feedback of the two-phase exchange): for each worker
        group ``g`` this process plays, a ``G*ex.chunk_numel`` fp32 tensor whose part
        ``r`` is added to the chunk ``g`` reduces in slice ``r`` before re-encoding, and
        replaced by that encoding's error (updated in place). None: no feedback.

        Returns the full padded sum (``G*ex.slice_numel`` fp32) and the bytes sent.
        """
        raise NotImplementedError

    def reduce_meta(self, module_id: str, metas: dict[int, torch.Tensor]) -> tuple[torch.Tensor, int]:
        """Sum the contributors' float64 ``[Σα, contributions, dropped]``; returns (sum, bytes)."""
        raise NotImplementedError


def _ordered_sum(decoded: list[torch.Tensor], numel: int) -> torch.Tensor:
    out = torch.zeros(numel, dtype=torch.float32, device=decoded[0].device if decoded else "cpu")
    for d in decoded:  # ascending group order, in both backends
        out += d
    return out


def _reencode(reduced: torch.Tensor, codec: Codec, residual: torch.Tensor | None) -> Payload:
    """Phase 2 of the two-phase exchange: encode a reduced chunk on its owner.

    With ``residual`` (the owner's error feedback, a view updated in place) the chunk
    is encoded with last round's error added, and the new error is kept.
    """
    value = reduced if residual is None else reduced + residual
    payload = codec.encode(value)
    if residual is not None:
        residual.copy_(value - codec.decode(payload, value.numel()))
    return payload


def _owner_part(owner_residuals: dict[int, torch.Tensor] | None, group: int, r: int, c: int) -> torch.Tensor | None:
    """Part ``r`` (slice ``r``'s chunk, ``c`` elements) of worker group ``group``'s owner residual."""
    if owner_residuals is None:
        return None
    return owner_residuals[group][r * c : (r + 1) * c]


class LocalComm(Communicator):
    """In-process: every worker group's contribution is already here."""

    def __init__(self, topology: Topology, lossy_exchange: str = "reduce_scatter") -> None:
        self.topology = topology
        self._set_lossy_exchange(lossy_exchange)

    def contributors(self, module_id: str) -> list[int]:
        return self.topology.groups_of_module(module_id)

    def exchange(
        self,
        module_id: str,
        payloads: Chunked,
        codec: Codec,
        ex: Exchange,
        owner_residuals: dict[int, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, CommBytes]:
        G, s, c = self.topology.group_size, ex.slice_numel, ex.chunk_numel
        groups = sorted(payloads)  # ascending: member j of every module subgroup is groups[j]
        nbytes = CommBytes()
        slices = []
        for r in range(G):
            if ex.kind == "reduce_scatter":
                # exactly TorchComm's arithmetic: member j sums chunk j of every contributor
                # in ascending group order, re-encodes it; everyone decodes the k results
                reduced = []
                for j, owner in enumerate(groups):
                    part = _ordered_sum([codec.decode(payloads[g][r][j], c) for g in groups], c)
                    payload = _reencode(part, codec, _owner_part(owner_residuals, owner, r, c))
                    reduced.append(codec.decode(payload, c))
                slices.append(torch.cat(reduced)[:s])
            else:
                slices.append(_ordered_sum([codec.decode(payloads[g][r][0], s) for g in groups], s))
        if ex.k > 1:  # each of the k ranks of each of the G subgroups sends the planned bytes
            nbytes.cross = ex.k * G * ex.cross_bytes
            nbytes.intra = ex.k * G * allgather_bytes(G, 4 * s)
        return torch.cat(slices), nbytes

    def reduce_meta(self, module_id: str, metas: dict[int, torch.Tensor]) -> tuple[torch.Tensor, int]:
        out = torch.zeros(3, dtype=torch.float64)
        for c in sorted(metas):
            out += metas[c]
        k = len(self.topology.groups_of_module(module_id))
        return out, (k * self.topology.group_size * ring_allreduce_bytes(k, META_BYTES) if k > 1 else 0)


def _pack(payload: Payload) -> torch.Tensor:
    """Payload → one flat uint8 tensor (any dtype travels; one collective per payload)."""
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in payload])


def _unpack(buf: torch.Tensor, template: Payload) -> Payload:
    out, off = [], 0
    for t in template:
        nb = t.numel() * t.element_size()
        out.append(buf[off : off + nb].clone().view(t.dtype).reshape(t.shape))  # clone: aligned storage
        off += nb
    return tuple(out)


class TorchComm(Communicator):
    """Real ranks: this rank is local rank ``r`` of worker group ``g``.

    Who must call what: every rank of a module's module group must call
    :meth:`exchange` then :meth:`reduce_meta` for that module in the same round, even
    with a zero contribution, and all ranks must visit modules in the global module
    order (then any two ranks meet their shared collectives in the same order, so no
    cycle of waits can form). ``trace`` records ``(module, kind, ranks, bytes)`` of every
    collective this rank joined.
    """

    def __init__(
        self, topology: Topology, rank: int, process_groups: Any, lossy_exchange: str = "reduce_scatter"
    ) -> None:
        self.topology = topology
        self._set_lossy_exchange(lossy_exchange)
        self.rank = int(rank)
        self.group = topology.group_of_rank(rank)
        self.local_rank = topology.local_rank(rank)
        self.pg = process_groups
        # nccl only moves CUDA tensors: stage buffers on the current device, keep results on CPU
        use_cuda = getattr(process_groups, "backend", "gloo") == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
        self.trace: list[tuple[str, str, tuple[int, ...], int]] = []

    def contributors(self, module_id: str) -> list[int]:
        if self.group not in self.topology.groups_of_module(module_id):
            raise ValueError(f"rank {self.rank} (worker group {self.group}) does not hold module {module_id!r}")
        return [self.group]

    def exchange(
        self,
        module_id: str,
        payloads: Chunked,
        codec: Codec,
        ex: Exchange,
        owner_residuals: dict[int, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, CommBytes]:
        topo, r, s = self.topology, self.local_rank, ex.slice_numel
        G = topo.group_size
        sub_ranks = tuple(topo.module_subgroup_ranks(module_id, r))
        k = len(sub_ranks)
        mine = payloads[self.group][r]
        nbytes = CommBytes()
        if k <= 1:
            # held by one worker group: nothing crosses groups, and every rank of the group
            # already holds every slice (identical after the data-parallel inner phase)
            return torch.cat([codec.decode(payloads[self.group][q][0], s) for q in range(G)]), nbytes
        sub = self.pg.module_subgroup(module_id, r)
        # Ordering hazard: every member of ``sub`` reaches this point for the same module
        # in the same round (modules are visited in the global order on every rank), and
        # each branch below issues the same collectives in the same order on every member
        # (the branch depends only on the codec and the exchange, identical everywhere).
        if ex.kind == "all_reduce":
            reduced = mine[0][0].to(self.device, torch.float32, copy=True)
            dist.all_reduce(reduced, group=sub)
            reduced = reduced.to(mine[0][0].device)  # back where the caller keeps its state
            nbytes.cross = ring_allreduce_bytes(k, 4 * s)
            self.trace.append((module_id, "all_reduce", sub_ranks, nbytes.cross))
        elif ex.kind == "reduce_scatter":
            reduced, nbytes.cross = self._two_phase(module_id, sub, sub_ranks, mine, codec, ex, owner_residuals)
        else:
            buf = _pack(mine[0]).to(self.device)
            gathered = [torch.empty_like(buf) for _ in range(k)]
            dist.all_gather(gathered, buf, group=sub)  # list index = ascending rank = ascending group
            gathered = [b.cpu() for b in gathered]
            reduced = _ordered_sum([codec.decode(_unpack(b, mine[0]), s) for b in gathered], s)
            nbytes.cross = allgather_bytes(k, buf.numel())
            self.trace.append((module_id, "all_gather", sub_ranks, nbytes.cross))
        if G == 1:
            return reduced, nbytes
        wg_ranks = tuple(topo.ranks_of_group(self.group))
        parts = [torch.empty(s, dtype=torch.float32, device=self.device) for _ in range(G)]
        dist.all_gather(parts, reduced.to(self.device).contiguous(), group=self.pg.worker_group(self.group))
        parts = [t.cpu() for t in parts]
        nbytes.intra = allgather_bytes(G, 4 * s)
        self.trace.append((module_id, "all_gather_slices", wg_ranks, nbytes.intra))
        return torch.cat(parts), nbytes

    def exchange_shard(self, module_id: str, shard: torch.Tensor) -> tuple[torch.Tensor, CommBytes]:
        """``group_parallel=fsdp``, codec ``none``: sum this rank's shard of Σα·Δ over its
        module subgroup (local rank ``r`` of every holder: the same shard index, HSDP-style).

        The shard is this rank's rows of every parameter (:mod:`dipaco.sync.fsdp`), so
        nothing is all-gathered inside the worker group afterwards: each rank keeps its
        shard of θ_global. Same call-order contract as :meth:`exchange`.
        """
        sub_ranks = tuple(self.topology.module_subgroup_ranks(module_id, self.local_rank))
        k = len(sub_ranks)
        if k <= 1:
            return shard.to(torch.float32, copy=True), CommBytes()
        reduced = shard.to(self.device, torch.float32, copy=True)
        dist.all_reduce(reduced, group=self.pg.module_subgroup(module_id, self.local_rank))
        nbytes = CommBytes(cross=ring_allreduce_bytes(k, 4 * shard.numel()))
        self.trace.append((module_id, "all_reduce_shard", sub_ranks, nbytes.cross))
        return reduced.cpu(), nbytes

    def _two_phase(
        self,
        module_id: str,
        sub: Any,
        sub_ranks: tuple[int, ...],
        mine: Sequence[Payload],
        codec: Codec,
        ex: Exchange,
        owner_residuals: dict[int, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, int]:
        """Compressed all-reduce of this rank's slice over ``sub``; returns (slice sum, bytes sent).

        Phase 1 is ONE ``all_to_all_single`` with equal splits: the chunks have equal
        sizes and a codec's payload size depends only on numel, so every rank's send
        buffer is k segments of ``nb`` bytes, segment ``j`` for member ``j``. gloo (torch
        2.13) and nccl both implement it; it is a single collective, so unlike k-1
        hand-ordered ``isend``/``irecv`` pairs it cannot deadlock and needs no pairing
        schedule. Member index = position in ``sub_ranks`` (ascending global rank =
        ascending worker group), the same order the local backend uses.
        Phase 2 is one ``all_gather`` of the re-encoded reduced chunks over ``sub``.
        Both collectives are issued in this order by every member.
        """
        k, c, s = len(sub_ranks), ex.chunk_numel, ex.slice_numel
        me = sub_ranks.index(self.rank)
        send = torch.cat([_pack(p) for p in mine])
        nb = send.numel() // k
        recv = torch.empty_like(send, device=self.device)
        dist.all_to_all_single(recv, send.to(self.device), group=sub)
        recv = recv.cpu()
        received = [codec.decode(_unpack(recv[i * nb : (i + 1) * nb], mine[me]), c) for i in range(k)]
        part = _ordered_sum(received, c)  # contributions to chunk ``me`` in ascending group order
        sent1 = (k - 1) * nb  # the own segment never leaves the rank
        self.trace.append((module_id, "reduce_scatter", sub_ranks, sent1))
        payload = _reencode(part, codec, _owner_part(owner_residuals, self.group, self.local_rank, c))
        buf = _pack(payload).to(self.device)
        gathered = [torch.empty_like(buf) for _ in range(k)]
        dist.all_gather(gathered, buf, group=sub)
        out = torch.cat([codec.decode(_unpack(b.cpu(), payload), c) for b in gathered])[:s]
        sent2 = allgather_bytes(k, buf.numel())
        self.trace.append((module_id, "all_gather_reduced", sub_ranks, sent2))
        return out, sent1 + sent2

    def reduce_meta(self, module_id: str, metas: dict[int, torch.Tensor]) -> tuple[torch.Tensor, int]:
        sub_ranks = tuple(self.topology.module_subgroup_ranks(module_id, self.local_rank))
        meta = metas[self.group].to(torch.float64).clone()
        if len(sub_ranks) <= 1:
            return meta, 0
        meta = meta.to(self.device)
        dist.all_reduce(meta, group=self.pg.module_subgroup(module_id, self.local_rank))
        meta = meta.cpu()
        nb = ring_allreduce_bytes(len(sub_ranks), META_BYTES)
        self.trace.append((module_id, "all_reduce_meta", sub_ranks, nb))
        return meta, nb
