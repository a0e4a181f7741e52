"""DiLoCo of a module whose parameters are FSDP2-sharded inside the worker group
(``launcher.group_parallel=fsdp``).

Local rank ``r`` of a worker group holds shard ``r`` of the module (its rows of every
parameter, :mod:`dipaco.sync.fsdp`) and therefore only shard ``r`` of θ_global, of the
outer optimiser's state and of the round's Σα·Δ. The exchange is one all-reduce of that
shard over the module subgroup ``r`` (rank ``r`` of every worker group holding the
module: HSDP-style), and the outer step updates the shard in place. No rank ever holds
a whole module during the exchange, and nothing is all-gathered inside the worker group
afterwards (the replicated exchange all-gathers the G reduced slices,
:class:`dipaco.sync.comm.TorchComm`).

The weights are those of a replicated worker group (docs/design.md contract 1).
Only codec ``none`` is supported (validation refuses the others with ``fsdp``).
Checkpoints keep the full layout: :meth:`ShardedCollectiveModuleSync.state_dict` gathers the
shards (a collective over the worker group) and :meth:`~ShardedCollectiveModuleSync.load_state_dict`
keeps this rank's shard, so a run may resume with another ``launcher.group_size`` or
with ``group_parallel=replicate``.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
from torch import nn

from dipaco.sync.comm import CommBytes, Exchanged
from dipaco.sync.fsdp import gather_flat, local_shard, shard_flat
from dipaco.sync.module_core import Contributions
from dipaco.sync.module_sync import CollectiveModuleSync
from dipaco.sync.torch_comm import TorchComm

__all__ = ["ShardedCollectiveModuleSync"]


class ShardedCollectiveModuleSync(CollectiveModuleSync):
    """:class:`CollectiveModuleSync` over this rank's shard of a module (arguments as there; ``comm``
    must be a :class:`TorchComm`)."""

    def __init__(self, module_id: str, params: Sequence[nn.Parameter], comm: TorchComm, **kw: Any) -> None:
        if not isinstance(comm, TorchComm):
            raise ValueError("a sharded module needs real ranks (TorchComm): launcher.group_parallel=fsdp "
                             "does not run under launcher=local")
        self.shapes = [torch.Size(p.shape) for p in params]  # global shapes (a DTensor's .shape)
        super().__init__(module_id, params, comm, **kw)
        if self.shared and self.codec.lossy:
            raise ValueError(f"module {module_id!r}: diloco.codec={self.codec.name} is not supported with "
                             "launcher.group_parallel=fsdp; use diloco.codec=none")
        self.full_numel = sum(math.prod(s) for s in self.shapes)
        # the shard is the unit of exchange: one "slice", no padding (shards are even)
        self.slice_numel = self.padded_numel = self.numel
        self.contributions = self._new_round()

    def _live(self) -> list[torch.Tensor]:
        """This rank's rows of every parameter (views: writing them writes the parameters)."""
        return [local_shard(p) for p in self.params]

    def _exchange_job(self, round_: Contributions) -> tuple[Callable[[], Exchanged], None, None]:
        (c,) = self.contributors  # a rank plays its own worker group only
        value = round_.values.get(c)
        if value is None:
            value = torch.zeros(self.numel, dtype=torch.float32)
        meta, comm, m = round_.meta(c), self.comm, self.module_id

        def job() -> Exchanged:
            total, nbytes = comm.exchange_shard(m, value)
            summed, meta_bytes = comm.reduce_meta(m, {c: meta})
            return total, summed, CommBytes(nbytes.cross, meta_bytes, nbytes.intra)

        return job, None, None

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full layout of :meth:`CollectiveModuleSync.state_dict`: every shard-sized tensor is
        gathered over the worker group (a collective: every rank of the group calls it)."""
        G = self.group_size
        comm: TorchComm = self.comm  # type: ignore[assignment]
        group = comm.pg.worker_group(comm.group)
        return {k: gather_flat(v, self.shapes, group, G, comm.device) if v.numel() == self.numel else v
                for k, v in self.core.state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Keep this rank's shard of every full-size tensor of ``state``, then load it."""
        G, r = self.group_size, self.comm.local_rank
        mine = {k: shard_flat(v.reshape(-1).to(torch.float32), self.shapes, G, r)
                if v.numel() == self.full_numel else v for k, v in state.items()}
        super().load_state_dict(mine)
