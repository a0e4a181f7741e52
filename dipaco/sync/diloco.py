"""The per-module syncs of the modules a process holds: what it builds once, before
round 0, and what the :class:`dipaco.sync.round_driver.RoundDriver` (the one object that
runs the rounds) drives.

:class:`DiLoCoSync` builds, from ``cfg.diloco`` and the topology, the communicator
(:class:`~dipaco.sync.comm.LocalComm`, or :class:`~dipaco.sync.torch_comm.TorchComm` over
the module groups' process groups) and one :class:`~dipaco.sync.module_sync.CollectiveModuleSync`
per held module, in the global module order (docs/design.md contract 2); it checks that
every copy of a module starts identical (contract 4). It keeps no round state.

In the ``local`` backend (``rank=None``) this process plays every worker group: it holds
every module and trains every path in turn. In the ``torch`` backend it is one rank of
worker group ``g`` and holds ``topology.modules_of_group(g)``.

Cosine similarity between contributions is computed from the pseudo-gradients this
process saw (local: all; torch: its group's; None under 2): exchanging them costs traffic.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dipaco.plan.comm_plan import LOSSY_EXCHANGES
from dipaco.config import DiLoCoConfig, codec_kwargs
from dipaco.sync.checks import check_disjoint_parameters, check_identical_modules
from dipaco.plan.codecs import make_codec
from dipaco.sync.comm import LocalComm
from dipaco.sync.groups import ProcessGroups
from dipaco.sync.module_sync import CollectiveModuleSync
from dipaco.sync.outer import outer_options
from dipaco.sync.sharded import ShardedCollectiveModuleSync
from dipaco.sync.torch_comm import TorchComm
from dipaco.plan.topology import Topology

__all__ = ["DiLoCoSync", "OUTER_DEVICES"]

#: diloco.outer_device choices (see DiLoCoSync._state_device)
OUTER_DEVICES = ("auto", "cpu")
_DEFAULTS = DiLoCoConfig()  # one source of the defaults: the config schema


class DiLoCoSync:
    """The per-module syncs of the modules this process holds (module doc).

    Args:
        topology: the run's topology.
        modules: live module objects held by this process, by module id (extra ids are
            ignored; ones the process must hold are required).
        rank: None for the local backend; this process's global rank for torch.
        codec, codec_kw: ``diloco.codec`` and its options.
        error_feedback: carry codec errors to the next round (per module, per worker group).
        outer: keyword arguments of :func:`dipaco.sync.outer.make_outer_optimizer`
            (default: SGD Nesterov lr 0.7 momentum 0.9).
        sharing_rescale: see :class:`CollectiveModuleSync`.
        process_groups: a :class:`dipaco.sync.groups.ProcessGroups`; created here if None
            (torch backend only; a collective: every rank must construct DiLoCoSync).
        backend: process-group backend when creating them (``auto``|``gloo``|``nccl``).
        track_cosine: report the cosine similarity between contributions.
        lossy_exchange: how lossy codecs cross a module subgroup of k worker groups:
            ``"reduce_scatter"`` (compressed two-phase all-reduce, ~2·(k−1)/k of an encoded
            slice per rank, two codec errors), ``"all_gather"`` ((k−1) encoded slices per
            rank, one codec error) or ``"auto"`` (default, as ``diloco.lossy_exchange``:
            fewer bytes, per module). Codec ``none`` always uses all_reduce. See
            :func:`dipaco.plan.comm_plan.module_exchange`.
        sharded: ``launcher.group_parallel=fsdp``: the modules are FSDP2-sharded inside the
            worker group (:func:`dipaco.sync.fsdp.apply_fsdp`) and each rank synchronises its
            shard (:class:`dipaco.sync.sharded.ShardedCollectiveModuleSync`); torch backend only.
        outer_device: ``diloco.outer_device`` (default ``auto``, as the schema).
        overlap: torch backend: run each launched exchange on a communication thread, so
            the outer steps of finished modules overlap the exchanges of later ones
            (:mod:`dipaco.sync.torch_comm`); same numbers. Call :meth:`close` at the end.
    """

    def __init__(self, topology: Topology, modules: dict[str, nn.Module], *, rank: int | None = None,
                 codec: str = _DEFAULTS.codec, codec_kw: dict[str, Any] | None = None,
                 error_feedback: bool = _DEFAULTS.error_feedback, outer: dict[str, Any] | None = None,
                 sharing_rescale: bool = _DEFAULTS.sharing_rescale, process_groups: Any = None,
                 backend: str = "auto", track_cosine: bool = True, lossy_exchange: str = _DEFAULTS.lossy_exchange,
                 sharded: bool = False, outer_device: str = _DEFAULTS.outer_device,
                 overlap: bool = False) -> None:
        self.topology = topology
        self.sharded = bool(sharded)
        self.rank = rank
        self.codec = make_codec(codec, **(codec_kw or {}))
        if lossy_exchange not in LOSSY_EXCHANGES:  # before any collective (process groups)
            raise ValueError(f"lossy_exchange={lossy_exchange!r} must be one of {list(LOSSY_EXCHANGES)}")
        self.lossy_exchange = lossy_exchange
        self.overlap = bool(overlap) and rank is not None
        if rank is None:
            self.comm: LocalComm | TorchComm = LocalComm(topology, lossy_exchange)
            self.group: int | None = None
            held = list(topology.module_ids)
            self.process_groups = None
        else:
            if process_groups is None:
                process_groups = ProcessGroups(topology, rank, backend)
            self.process_groups = process_groups
            self.comm = TorchComm(topology, rank, process_groups, lossy_exchange, overlap=self.overlap)
            self.group = topology.group_of_rank(rank)
            held = topology.modules_of_group(self.group)
        missing = [m for m in held if m not in modules]
        if missing:
            where = "the local backend" if rank is None else f"rank {rank} (worker group {self.group})"
            raise ValueError(f"{where} must hold modules {missing} but they were not passed to DiLoCoSync")
        self.modules = {m: modules[m] for m in held}
        check_disjoint_parameters(self.modules)
        kind = ShardedCollectiveModuleSync if self.sharded else CollectiveModuleSync
        extra = {} if self.sharded else {"state_device": self._state_device(outer_device, modules, held)}
        self.syncs: dict[str, CollectiveModuleSync] = {
            m: kind(m, list(modules[m].parameters()), self.comm, codec=self.codec, error_feedback=error_feedback,
                    outer=outer, sharing_rescale=sharing_rescale, track_cosine=track_cosine, **extra)
            for m in held
        }

    def _state_device(self, outer_device: str, modules: dict[str, nn.Module], held: list[str]) -> torch.device:
        """``diloco.outer_device``: ``auto`` keeps the outer state on the modules' device
        when the exchange is exact (lossy codecs and their residuals stay on the CPU)."""
        if outer_device not in OUTER_DEVICES:
            raise ValueError(f"diloco.outer_device={outer_device!r} must be one of {', '.join(OUTER_DEVICES)}")
        first = next((p for m in held for p in modules[m].parameters()), None)
        if outer_device == "cpu" or first is None or self.codec.lossy:
            return torch.device("cpu")
        return first.device

    @classmethod
    def from_config(cls, d: DiLoCoConfig, topology: Topology, modules: dict[str, nn.Module], *,
                    rank: int | None = None, process_groups: Any = None, backend: str = "auto",
                    track_cosine: bool = True, sharded: bool = False) -> "DiLoCoSync":
        """Build it from ``cfg.diloco``: codec and its options, error feedback, the outer
        optimiser (:func:`dipaco.sync.outer.outer_options`), √P rescale, lossy exchange, and
        with ``streaming`` the exchanges on the communication thread (``overlap``)."""
        return cls(topology, modules, rank=rank, codec=d.codec, codec_kw=codec_kwargs(d),
                   error_feedback=d.error_feedback, outer=outer_options(d), sharing_rescale=d.sharing_rescale,
                   process_groups=process_groups, backend=backend, track_cosine=track_cosine,
                   lossy_exchange=d.lossy_exchange, sharded=sharded, outer_device=d.outer_device,
                   overlap=d.streaming)

    def close(self) -> None:
        """Stop the communication thread (``overlap``); nothing to do otherwise."""
        if isinstance(self.comm, TorchComm):
            self.comm.close()

    # ----------------------------------------------------------------- who trains what
    def paths_to_train(self) -> list[int]:
        """Paths this process trains each round, in order (local: all; torch: my group's)."""
        if self.group is None:
            return list(range(self.topology.num_paths))
        return self.topology.paths_of_group(self.group)

    # ----------------------------------------------------------------- checks and state
    def weights_hash(self) -> dict[str, str]:
        """sha256 of each held module's global weights."""
        return {m: s.weights_hash() for m, s in self.syncs.items()}

    def check_identical_start(self) -> dict[str, str]:
        """docs/design.md contract 4: every copy of each module holds the same weights.

        Local: the live modules equal the global copies. Torch: digests are all-gathered
        over each module group (a collective: every rank calls it). Raises RuntimeError
        naming the module and ranks on mismatch.
        """
        if self.rank is None:
            bad = [m for m, s in self.syncs.items() if s.live_hash() != s.weights_hash()]
            if bad:
                raise RuntimeError(f"modules {bad} changed since DiLoCoSync was built; rebuild it after loading weights")
            return self.weights_hash()
        return check_identical_modules(self.modules, self.topology, self.rank, self.process_groups,
                                       sharded=self.sharded)
