"""Communicators: how one module's encoded contributions are summed across worker groups.

Both communicators compute the same numbers (contract 1):

* the module's buffer (padded to ``G*s`` elements) is cut into G slices; slice ``r`` of
  every contributor (worker group) is decoded and summed IN ASCENDING GROUP ORDER, and
  the G reduced slices are concatenated;
* codec ``none`` in :class:`TorchComm` uses ``all_reduce`` (gloo/nccl's own summation
  order, so equal up to fp32 rounding: allclose); lossy codecs all-gather the payloads
  and sum them in group order, bit-identical to :class:`LocalComm`.

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

from dipaco.sync.codecs import Codec, Payload, payload_nbytes
from dipaco.topology import META_BYTES, Topology, allgather_bytes, ring_allreduce_bytes

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


class Communicator:
    """Interface used by :class:`dipaco.sync.module_sync.ModuleSync`."""

    topology: Topology

    def contributors(self, module_id: str) -> list[int]:
        """Worker groups whose contributions this process holds for ``module_id``."""
        raise NotImplementedError

    def exchange(
        self, module_id: str, payloads: dict[int, Sequence[Payload]], codec: Codec, slice_numel: int
    ) -> tuple[torch.Tensor, CommBytes]:
        """Sum the contributors' slices: ``payloads[c][r]`` is slice ``r`` of contributor ``c``.

        Returns the full padded sum (``G*slice_numel`` fp32) and the bytes sent.
        """
        raise NotImplementedError

    def reduce_meta(self, module_id: str, metas: dict[int, torch.Tensor]) -> tuple[torch.Tensor, int]:
        """Sum the contributors' float64 ``[Σα, contributions, dropped]``; returns (sum, bytes)."""
        raise NotImplementedError


def _ordered_sum(decoded: list[torch.Tensor], numel: int) -> torch.Tensor:
    out = torch.zeros(numel, dtype=torch.float32)
    for d in decoded:  # ascending group order, in both backends
        out += d
    return out


class LocalComm(Communicator):
    """In-process: every worker group's contribution is already here."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology

    def contributors(self, module_id: str) -> list[int]:
        return self.topology.groups_of_module(module_id)

    def exchange(
        self, module_id: str, payloads: dict[int, Sequence[Payload]], codec: Codec, slice_numel: int
    ) -> tuple[torch.Tensor, CommBytes]:
        G = self.topology.group_size
        groups = sorted(payloads)
        k = len(self.topology.groups_of_module(module_id))
        nbytes = CommBytes()
        slices = []
        for r in range(G):
            slices.append(_ordered_sum([codec.decode(payloads[c][r], slice_numel) for c in groups], slice_numel))
            if k > 1:
                for c in groups:  # rank r of group c sends its slice-r payload
                    b = payload_nbytes(payloads[c][r])
                    nbytes.cross += ring_allreduce_bytes(k, b) if codec.name == "none" else allgather_bytes(k, b)
        if k > 1:
            nbytes.intra = k * G * allgather_bytes(G, 4 * slice_numel)
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

    def __init__(self, topology: Topology, rank: int, process_groups: Any) -> None:
        self.topology = topology
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
        self, module_id: str, payloads: dict[int, Sequence[Payload]], codec: Codec, slice_numel: int
    ) -> tuple[torch.Tensor, CommBytes]:
        topo, r, s = self.topology, self.local_rank, slice_numel
        G = topo.group_size
        sub_ranks = tuple(topo.module_subgroup_ranks(module_id, r))
        k = len(sub_ranks)
        mine = payloads[self.group][r]
        nbytes = CommBytes()
        if k <= 1:
            # held by one worker group: nothing crosses groups, and every rank of the group
            # already holds every slice (identical after the data-parallel inner phase)
            return torch.cat([codec.decode(payloads[self.group][q], s) for q in range(G)]), nbytes
        sub = self.pg.module_subgroup(module_id, r)
        if codec.name == "none":
            reduced = mine[0].to(self.device, torch.float32, copy=True)
            dist.all_reduce(reduced, group=sub)
            reduced = reduced.cpu()
            nbytes.cross = ring_allreduce_bytes(k, 4 * s)
            self.trace.append((module_id, "all_reduce", sub_ranks, nbytes.cross))
        else:
            buf = _pack(mine).to(self.device)
            gathered = [torch.empty_like(buf) for _ in range(k)]
            dist.all_gather(gathered, buf, group=sub)  # list index = ascending rank = ascending group
            gathered = [b.cpu() for b in gathered]
            reduced = _ordered_sum([codec.decode(_unpack(b, mine), s) for b in gathered], s)
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
