"""Communicators: how one module's encoded contributions are summed across worker groups.

Both communicators compute the same numbers (docs/design.md contract 1):

* the module's buffer (padded to ``G*s`` elements) is cut into G slices; slice ``r`` of
  every contributor (worker group) is decoded and summed IN ASCENDING GROUP ORDER, and
  the G reduced slices are concatenated;
* codec ``none`` in :class:`~dipaco.sync.torch_comm.TorchComm` uses ``all_reduce``
  (gloo/nccl's own summation order, so equal up to fp32 rounding: allclose);
* lossy codecs, exchange ``reduce_scatter`` (see :func:`dipaco.plan.comm_plan.module_exchange`):
  a compressed two-phase all-reduce. Every contributor encodes slice ``r`` as k equal,
  block-aligned chunks; chunk ``j`` of every contributor goes to member ``j`` (the j-th
  worker group holding the module, ascending), which decodes them and sums them in
  ascending group order, re-encodes the reduced chunk and all-gathers it; everybody
  decodes the k reduced chunks. The result carries the codec error twice (each
  contribution's encoding, then the reduced chunk's). With error feedback the first
  error goes into the contributor's residual and the second into the *owner residual*
  of the member that reduced the chunk (``owner_residuals``), added to its reduced chunk
  before next round's re-encoding; both through
  :func:`dipaco.sync.module_core.encode_with_feedback`;
* lossy codecs, exchange ``all_gather``: all payloads are all-gathered and summed in
  group order (one codec error, but bytes grow with k).

:class:`LocalComm` performs the very same decodes, ordered sums and re-encodings, so
lossy codecs are bit-identical between the backends (same kernels, same order).

:class:`LocalComm` is given every contributor's payloads (one process plays every
worker group) and counts the bytes every rank WOULD send; ``TorchComm`` is given its
own worker group's payloads and counts the bytes THIS rank sends. Byte formulas are in
:mod:`dipaco.plan.comm_plan` (the planner uses the same functions).

An exchange is *started* (:meth:`Communicator.start`, from
:meth:`dipaco.sync.module_sync.CollectiveModuleSync.launch`) and *waited for*
(:meth:`Pending.wait`, from ``CollectiveModuleSync.land``). :class:`LocalComm` completes it at
once; ``TorchComm`` does too, or, with ``overlap``, runs it on its communication thread
while the caller goes on (:mod:`dipaco.sync.torch_comm`).
"""
from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from dipaco.plan.codecs import Codec, Payload
from dipaco.sync.module_core import encode_with_feedback
from dipaco.plan.comm_plan import (
    LOSSY_EXCHANGES,
    META_BYTES,
    Exchange,
    allgather_bytes,
    module_exchange,
    ring_allreduce_bytes,
)
from dipaco.plan.topology import Topology

__all__ = ["CommBytes", "Communicator", "Exchanged", "LocalComm", "Pending", "ordered_sum", "owner_part",
           "reencode"]


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

#: What an exchange hands back: the summed contributions (``G*s`` fp32), the summed
#: ``[Σα, contributions, dropped]`` and the bytes sent.
Exchanged = tuple[torch.Tensor, torch.Tensor, CommBytes]


class Pending:
    """An exchange started by :meth:`Communicator.start`; :meth:`wait` gives its result.

    ``started_at`` / ``done_at``: ``time.perf_counter()`` when it was started and when its
    collectives completed (None until then): the wall-time interval it was in flight,
    which the streaming driver measures its bytes in flight from.
    """

    def __init__(self, future: "Future[Exchanged]") -> None:
        self._future = future
        self.started_at = time.perf_counter()
        self.done_at: float | None = None
        future.add_done_callback(self._mark_done)  # runs at once when already done

    def _mark_done(self, _: "Future[Exchanged]") -> None:
        self.done_at = time.perf_counter()

    @classmethod
    def done(cls, result: Exchanged) -> "Pending":
        """An exchange that completed when it was started."""
        f: "Future[Exchanged]" = Future()
        f.set_result(result)
        return cls(f)

    def ready(self) -> bool:
        """Whether :meth:`wait` would return at once."""
        return self._future.done()

    def wait(self) -> Exchanged:
        """Block until the exchange has completed; re-raises its error."""
        return self._future.result()


class Communicator:
    """Interface used by :class:`dipaco.sync.module_sync.CollectiveModuleSync`.

    Args of subclasses: ``lossy_exchange`` is one of
    :data:`dipaco.plan.comm_plan.LOSSY_EXCHANGES` (default ``"auto"``, as ``diloco.lossy_exchange``).
    """

    topology: Topology
    lossy_exchange: str = "auto"

    def _set_lossy_exchange(self, lossy_exchange: str) -> None:
        if lossy_exchange not in LOSSY_EXCHANGES:
            raise ValueError(f"lossy_exchange={lossy_exchange!r} must be one of {list(LOSSY_EXCHANGES)}")
        self.lossy_exchange = lossy_exchange

    def contributors(self, module_id: str) -> list[int]:
        """Worker groups whose contributions this process holds for ``module_id``."""
        raise NotImplementedError

    def exchange_for(self, module_id: str, numel: int, codec: Codec) -> Exchange:
        """The exchange (kind, chunking, bytes) of a module: :func:`dipaco.plan.comm_plan.module_exchange`."""
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

    def start(self, job: Callable[[], Exchanged]) -> Pending:
        """Run ``job`` (one module's collectives: its exchange, then its meta reduction).

        Here it runs at once and the exchange is complete when this returns; a
        communicator with a communication thread queues it there instead (jobs run in
        the order they were started: the order every rank starts its modules in).
        """
        return Pending.done(job())


def ordered_sum(decoded: list[torch.Tensor], numel: int) -> torch.Tensor:
    """The decoded contributions summed in the order given (ascending worker group)."""
    out = torch.zeros(numel, dtype=torch.float32, device=decoded[0].device if decoded else "cpu")
    for d in decoded:  # ascending group order, in both backends
        out += d
    return out


def reencode(reduced: torch.Tensor, codec: Codec, residual: torch.Tensor | None) -> Payload:
    """Phase 2 of the two-phase exchange: encode a reduced chunk on its owner.

    With ``residual`` (the owner's error feedback, a view updated in place) the chunk
    is encoded with last round's error added, and the new error is kept.
    """
    payload, error = encode_with_feedback(reduced, codec, residual, feedback=residual is not None)
    if residual is not None:
        residual.copy_(error)
    return payload


def owner_part(owner_residuals: dict[int, torch.Tensor] | None, group: int, r: int, c: int) -> torch.Tensor | None:
    """Part ``r`` (slice ``r``'s chunk, ``c`` elements) of worker group ``group``'s owner residual."""
    if owner_residuals is None:
        return None
    return owner_residuals[group][r * c : (r + 1) * c]


class LocalComm(Communicator):
    """In-process: every worker group's contribution is already here."""

    def __init__(self, topology: Topology, lossy_exchange: str = "auto") -> None:
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
                    part = ordered_sum([codec.decode(payloads[g][r][j], c) for g in groups], c)
                    payload = reencode(part, codec, owner_part(owner_residuals, owner, r, c))
                    reduced.append(codec.decode(payload, c))
                slices.append(torch.cat(reduced)[:s])
            else:
                slices.append(ordered_sum([codec.decode(payloads[g][r][0], s) for g in groups], s))
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


