"""The per-module syncs of the modules a process holds, and the round's one event loop
(:meth:`DiLoCoSync.sync_point`).

A synchronous round driven by hand (tests, benchmarks; the same code in both backends;
the rounds loop drives it through :class:`dipaco.sync.round_driver.RoundDriver`)::

    sync = DiLoCoSync.from_config(cfg.diloco, topology, modules, rank=None or rank)
    sync.check_identical_start()                 # once, before round 0 (collective in torch)
    for round in range(R):
        for p in sync.paths_to_train():          # local: every path; torch: my group's paths
            sync.begin_path(p)                   # live modules of p ← θ_global
            ...H inner AdamW steps of path p...
            sync.end_path(p, alpha)              # contribute α·Δ, α = tokens of p this round (sync/alpha.py)
        stats = sync.end_round()                 # the sync point of step H: collectives in torch

A sync point of module m is two calls, :meth:`DiLoCoSync.launch` (encode, start the
exchange) and :meth:`DiLoCoSync.land` (wait, average, outer step, put the new global
weights into the live module), run by the one event loop :meth:`DiLoCoSync.sync_point`
at the steps of a :class:`dipaco.plan.schedule.RoundSchedule`. In the synchronous
schedule (DiLoCo's round) every module launches after the round's H-th inner step and
lands at once; the modules of one sync point are launched in the global module order on
every rank (docs/design.md contract 2).

In the ``local`` backend (``rank=None``) this process plays every worker group: it holds
every module and trains every path in turn. In the ``torch`` backend it is one rank of
worker group ``g`` and holds ``topology.modules_of_group(g)``.

Cosine similarity between contributions is computed from the pseudo-gradients this
process saw (local: all; torch: its group's; None under 2): exchanging them costs traffic.
The rounds loop drives it through :class:`dipaco.sync.round_driver.RoundDriver`, which
cuts the turns at the schedule's steps (streaming's staggered ones, or just H).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

from dipaco.plan.comm_plan import LOSSY_EXCHANGES, CommPlan, plan_round
from dipaco.config import DiLoCoConfig, codec_kwargs
from dipaco.sync.checks import check_disjoint_parameters, check_identical_modules
from dipaco.plan.codecs import make_codec
from dipaco.sync.comm import LocalComm
from dipaco.sync.groups import ProcessGroups
from dipaco.sync.module_sync import ModuleRoundStats, CollectiveModuleSync, RoundStats
from dipaco.sync.outer import outer_options
from dipaco.sync.sharded import ShardedCollectiveModuleSync
from dipaco.sync.torch_comm import TorchComm
from dipaco.plan.schedule import RoundSchedule
from dipaco.plan.topology import Topology

__all__ = ["DiLoCoSync", "OUTER_DEVICES", "RoundStats"]

#: diloco.outer_device choices (see DiLoCoSync._state_device)
OUTER_DEVICES = ("auto", "cpu")
_DEFAULTS = DiLoCoConfig()  # one source of the defaults: the config schema


# ----------------------------------------------------------------- the driver
class DiLoCoSync:
    """DiLoCo per module over the modules this process holds, driven by a round schedule.

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
        # the synchronous round of end_round(); its length does not matter there: H = 1
        self.schedule = RoundSchedule.synchronous(held, 1)
        kind = ShardedCollectiveModuleSync if self.sharded else CollectiveModuleSync
        extra = {} if self.sharded else {"state_device": self._state_device(outer_device, modules, held)}
        self.syncs: dict[str, CollectiveModuleSync] = {
            m: kind(m, list(modules[m].parameters()), self.comm, codec=self.codec, error_feedback=error_feedback,
                    outer=outer, sharing_rescale=sharing_rescale, track_cosine=track_cosine, **extra)
            for m in held
        }
        self.round = 0
        self._active: int | None = None
        self._ended: set[int] = set()

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

    @property
    def worker_group(self) -> Any:
        """This rank's worker-group process group for ``allreduce_gradients`` (None: G = 1 or local)."""
        if self.process_groups is None:
            return None
        return self.process_groups.worker_group(self.group)

    def _check_path(self, path_id: int) -> None:
        if not 0 <= path_id < self.topology.num_paths:
            raise ValueError(f"path_id {path_id} outside [0, {self.topology.num_paths})")
        if self.group is not None and self.topology.group_of_path(path_id) != self.group:
            raise ValueError(
                f"rank {self.rank} (worker group {self.group}) does not train path {path_id}; "
                f"its paths are {self.paths_to_train()}"
            )

    # ----------------------------------------------------------------- a path's turn
    def begin_path(self, path_id: int) -> None:
        """Reset path ``path_id``'s modules to the global weights before its inner steps."""
        self._check_path(path_id)
        if path_id in self._ended:
            raise ValueError(f"path {path_id} already contributed this round")
        for m in self.topology.path_modules[path_id]:
            self.syncs[m].restore()
        self._active = path_id

    def end_path(self, path_id: int, tokens: float) -> dict[str, bool]:
        """Contribute path ``path_id``'s pseudo-gradients with α = ``tokens``
        (:meth:`contribute` of all its modules); ``{module_id: accepted}``."""
        self._check_path(path_id)
        if self._active != path_id:
            raise ValueError(f"end_path({path_id}) without begin_path({path_id}) (active: {self._active})")
        out = self.contribute(path_id, {m: tokens for m in self.topology.path_modules[path_id]})
        self._active = None
        self._ended.add(path_id)
        return out

    @torch.no_grad()
    def contribute(self, path_id: int, alphas: dict[str, float]) -> dict[str, bool]:
        """Add α·Δ of each of path ``path_id``'s live modules in ``alphas`` (``{module: α}``)
        to its round: ``{module_id: accepted}`` (False: non-finite Δ, dropped and counted).
        The finiteness of every Δ is read from the device once for the whole call. The one
        contribution of both entries: :meth:`end_path` and the round driver's."""
        if not alphas:
            return {}
        contributor = self.topology.group_of_path(path_id)
        deltas = {m: self.syncs[m].pseudo_gradient() for m in alphas}
        finite = torch.stack([torch.isfinite(d).all() for d in deltas.values()]).tolist()
        return {m: self.syncs[m].contribute(path_id, a, contributor, deltas[m], ok)
                for (m, a), ok in zip(alphas.items(), finite)}

    # ----------------------------------------------------------------- sync points
    def _ordered(self, modules: Iterable[str]) -> list[str]:
        want = set(modules)
        return [m for m in self.syncs if m in want]  # the global module order, on every rank

    def launch(self, modules: Iterable[str]) -> None:
        """Encode each module's contributions and start its exchange (global module order).

        Torch backend: collectives, started on every rank of each module group in the
        same order; with ``overlap`` they run on the communication thread meanwhile.
        """
        for m in self._ordered(modules):
            self.syncs[m].launch()

    def land(self, modules: Iterable[str], mix: float = 1.0) -> dict[str, ModuleRoundStats]:
        """Wait for each module's exchange, take its outer step and put the new global
        weights into the live module: replace them (``mix=1``, the synchronous round) or
        mix them in, ``live ← live + mix·(θ_global − live)``."""
        out = {}
        for m in self._ordered(modules):
            s = self.syncs[m]
            out[m] = s.land()
            s.mix(mix)
        return out

    def sync_point(self, step: int, schedule: RoundSchedule,
                   land: Optional[Callable[[str], ModuleRoundStats]] = None) -> dict[str, ModuleRoundStats]:
        """The round's one event loop: the sync point after inner step ``step`` of ``schedule``.

        Always in this order, on every rank: the modules launched earlier that land at
        ``step``; the modules launching at ``step``, in the global module order (encode,
        start; on the communication thread with ``overlap``); those of them that land at
        once (launch = land), each right after its own launch (one exchange in flight, as
        little memory as one module's sums) unless the exchanges overlap: then after every
        launch, so the outer steps run while later modules are still being exchanged.
        ``land(m)`` lands one module (default: :meth:`land` replacing the live weights; the
        round driver's mixes into each path's copy).
        """
        land = land or (lambda m: self.land([m])[m])
        pts = schedule.points
        ordered = [m for m in self.syncs if m in pts]  # the global module order, on every rank
        done = {m: land(m) for m in ordered if pts[m].land == step and pts[m].launch < step}
        now = [m for m in ordered if pts[m].launch == step]
        for m in now:
            self.syncs[m].launch()
            if pts[m].land == step and not self.overlap:
                done[m] = land(m)
        for m in now:
            if pts[m].land == step and m not in done:
                done[m] = land(m)
        return done

    def end_round(self) -> RoundStats:
        """The synchronous round's sync point (:meth:`sync_point` at H) for the turns of
        :meth:`begin_path` / :meth:`end_path` (tests, benchmarks; the rounds loop drives
        :class:`dipaco.sync.round_driver.RoundDriver`, whose ``end_round`` ends a round
        of any schedule), and the round's end.

        Torch backend: a collective. Every rank calls it once per round; modules are
        visited in the global module order on every rank (see :mod:`dipaco.sync.torch_comm`).
        """
        if self._active is not None:
            raise ValueError(f"end_round() while path {self._active} has begun but not ended")
        stats = RoundStats(round=self.round)
        stats.modules = self.sync_point(self.schedule.inner_steps, self.schedule)
        self.round += 1
        self._ended.clear()
        return stats

    def total_bytes(self, stats: RoundStats) -> int:
        """Bytes sent by ALL ranks this round (torch: a world all-reduce, every rank calls it)."""
        if self.rank is None:
            return stats.bytes_sent
        t = torch.tensor([stats.bytes_sent], dtype=torch.int64, device=self.comm.device)
        dist.all_reduce(t)
        return int(t)

    def plan(self, inner_steps: int) -> CommPlan:
        """The communication plan of this run's modules with this codec."""
        counts = {m: s.full_numel for m, s in self.syncs.items()}
        missing = [m for m in self.topology.module_ids if m not in counts]
        if missing:
            raise ValueError(f"this rank does not hold {missing}; call dipaco.plan.comm_plan.plan_round with every module's size")
        return plan_round(self.topology, counts, self.codec, inner_steps, self.lossy_exchange,
                          sharded=self.sharded)

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

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Flat ``{"<module>/<key>": tensor}`` plus ``"diloco/round"``: safetensors-ready."""
        out: dict[str, torch.Tensor] = {"diloco/round": torch.tensor(self.round, dtype=torch.int64)}
        for m, s in self.syncs.items():
            for k, v in s.state_dict().items():
                out[f"{m}/{k}"] = v
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Inverse of :meth:`state_dict` (restores the live modules too)."""
        missing = [m for m in self.syncs if f"{m}/global" not in state]
        if missing:
            raise ValueError(f"sync state lacks modules {missing}")
        for m, s in self.syncs.items():
            prefix = f"{m}/"
            s.load_state_dict({k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)})
        if "diloco/round" in state:
            self.round = int(state["diloco/round"])
        self._active = None
        self._ended.clear()
