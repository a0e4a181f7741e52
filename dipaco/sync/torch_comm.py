"""The torch backend's communicator: real ranks, gloo or nccl collectives.

:class:`TorchComm` sums one module's contributions over its module group with the
arithmetic of :class:`dipaco.sync.comm.LocalComm` (see :mod:`dipaco.sync.comm`).

Overlap (``overlap=True``): :meth:`TorchComm.start` queues each module's exchange on ONE
communication thread of this process and returns at once; the thread runs the jobs in
the order they were started. Every rank starts its modules in the global module order,
so every rank issues the collectives of every module subgroup in one order, from one
thread: no cycle of waits can form. HAZARD: while a job is in flight the caller must
not issue collectives on a process group the job uses. The module subgroups are used
by the exchange only; the worker group's all-gather of reduced slices (G > 1) runs on
:meth:`~dipaco.sync.groups.ProcessGroups.exchange_worker_group`: in the synchronous
round the worker group itself, which the inner loop's gradient all-reduce and FSDP2
also use (every exchange finishes before the next inner step, so they never overlap);
under streaming, where exchanges stay in flight across inner steps, a second group of
the same ranks that only the exchange uses.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from dipaco.plan.comm_plan import META_BYTES, Exchange, allgather_bytes, ring_allreduce_bytes
from dipaco.plan.codecs import Codec, Payload
from dipaco.sync.comm import (Chunked, CommBytes, Communicator, Exchanged, Pending, ordered_sum, owner_part,
                              reencode)
from dipaco.plan.topology import Topology

__all__ = ["TorchComm"]


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
        self, topology: Topology, rank: int, process_groups: Any, lossy_exchange: str = "auto",
        overlap: bool = False,
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
        # one thread: jobs (and so collectives) run in the order they were started; the
        # current CUDA device is per thread, so the thread takes this rank's
        self._thread = None
        if overlap:
            init = (lambda: torch.cuda.set_device(self.device)) if self.device.type == "cuda" else None
            self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"dipaco-comm-{rank}", initializer=init)

    def start(self, job: Callable[[], Exchanged]) -> Pending:
        """Run a module's exchange: at once, or queued on the communication thread
        (``overlap``; see the module doc for the ordering rule it keeps)."""
        if self._thread is None:
            return Pending.done(job())
        return Pending(self._thread.submit(job))

    def close(self) -> None:
        """Stop the communication thread once its queued exchanges have run."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None

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
            reduced = ordered_sum([codec.decode(_unpack(b, mine[0]), s) for b in gathered], s)
            nbytes.cross = allgather_bytes(k, buf.numel())
            self.trace.append((module_id, "all_gather", sub_ranks, nbytes.cross))
        if G == 1:
            return reduced, nbytes
        wg_ranks = tuple(topo.ranks_of_group(self.group))
        parts = [torch.empty(s, dtype=torch.float32, device=self.device) for _ in range(G)]
        dist.all_gather(parts, reduced.to(self.device).contiguous(), group=self.pg.exchange_worker_group(self.group))
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
        part = ordered_sum(received, c)  # contributions to chunk ``me`` in ascending group order
        sent1 = (k - 1) * nb  # the own segment never leaves the rank
        self.trace.append((module_id, "reduce_scatter", sub_ranks, sent1))
        payload = reencode(part, codec, owner_part(owner_residuals, self.group, self.local_rank, c))
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
