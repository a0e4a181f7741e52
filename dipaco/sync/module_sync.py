"""Synchronous DiLoCo for ONE module: the per-module core + a communicator.

Per round (:class:`dipaco.sync.round_driver.RoundDriver` calls these when its schedule says):

1. before each path's turn, :meth:`CollectiveModuleSync.restore` copies θ_global into the live
   module, so every path starts the round from the same weights;
2. after the path's inner steps, :meth:`CollectiveModuleSync.contribute` adds its pseudo-gradient
   ``Δ = θ_global − θ_path`` weighted by α (the path's tokens) to its worker group's
   buffer;
3. :meth:`CollectiveModuleSync.launch` encodes each buffer (with its error-feedback residual) and
   starts the exchange over the module group; contributions made after it go to the
   next round's buffers;
4. :meth:`CollectiveModuleSync.land` waits for the exchange, sets the outer gradient to
   ``Σα·Δ / Σα`` and steps the outer optimiser (:meth:`ModuleCore.step`). The new global
   weights are then the caller's to put into the live module: replaced
   (:meth:`restore`, the synchronous round) or mixed (:meth:`mix`, :meth:`mix_into`).

A *contributor* is a worker group index: contributions of one group's paths are summed
into one buffer (in the order the paths were trained), which is encoded once per slice
(per chunk of a slice with the two-phase exchange, see :mod:`dipaco.sync.comm`) with
that group's error-feedback residual.

Error feedback has two parts with the two-phase (``reduce_scatter``) exchange:
``residuals[g]`` (each contribution's encoding error, on every rank of group ``g``) and
``owner_residuals[g]`` (the error of re-encoding the reduced chunks group ``g`` owns: in
the torch backend rank ``r`` of the group holds only part ``r``, the chunk it reduces).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from dipaco.runtime.progress import log
from dipaco.plan.codecs import Codec, Payload, make_codec
from dipaco.sync.comm import CommBytes, Communicator, Exchanged, Pending
from dipaco.sync.module_core import (Contributions, ModuleCore, encode_with_feedback, flatten_params, params_hash,
                                     wire_codec)

__all__ = ["ModuleRoundStats", "CollectiveModuleSync", "RoundStats"]


@dataclass
class ModuleRoundStats:
    """What happened to one module in one round."""

    module_id: str
    bytes_sent: int  # by the ranks this process plays (local: all ranks; torch: this rank)
    bytes_cross: int
    bytes_meta: int
    bytes_intra: int
    pseudo_grad_norm: float  # ‖Σα·Δ/Σα‖ (before any sharing rescale); 0 when no step
    contributions: int  # paths that contributed, over the whole module group
    dropped: int  # non-finite contributions dropped, over the whole module group
    alpha_sum: float
    stepped: bool
    cosine: float | None  # mean pairwise cosine of the Δs seen by this process (≥ 2 needed)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly view."""
        return dict(self.__dict__)


@dataclass
class RoundStats:
    """Per-round sync statistics (``modules`` in the global module order)."""

    round: int
    modules: dict[str, ModuleRoundStats] = field(default_factory=dict)
    # streaming sync (dipaco/sync/round_driver.py), bytes per rank: the most one path had in
    # flight at once by the schedule as run, and by wall time on this process (exchanges
    # from launch until their collectives completed); 0 in the synchronous round
    inflight_peak_bytes: int = 0
    inflight_peak_wall_bytes: int = 0
    blocked_s: float = 0.0  # streaming: time the inner steps waited for exchanges to complete

    @property
    def bytes_sent(self) -> int:
        """Bytes sent by the ranks this process plays (local: all ranks; torch: this rank)."""
        return sum(s.bytes_sent for s in self.modules.values())

    @property
    def dropped(self) -> int:
        """Non-finite contributions dropped this round (module-group totals, summed)."""
        return sum(s.dropped for s in self.modules.values())

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly view."""
        return {"round": self.round, "bytes_sent": self.bytes_sent, "dropped": self.dropped,
                "inflight_peak_bytes": self.inflight_peak_bytes,
                "inflight_peak_wall_bytes": self.inflight_peak_wall_bytes, "blocked_s": self.blocked_s,
                "modules": {m: s.to_dict() for m, s in self.modules.items()}}


@dataclass
class _InFlight:
    """A launched exchange and what its landing needs."""

    pending: Pending
    round: Contributions
    owner: Optional[dict[int, torch.Tensor]]  # owner residuals the exchange updates in place
    kept: Optional[dict[int, torch.Tensor]]  # their values before it (put back without a step)


class CollectiveModuleSync:
    """One module's synchronous DiLoCo: :class:`ModuleCore` (``.core``) + a communicator.

    Args:
        module_id: the module's id.
        params: the live parameters of the module in this process (in a fixed order).
        comm: communicator; its ``contributors(module_id)`` are the worker groups whose
            contributions this object accepts.
        codec: codec object or name; ignored (exact) for a module held by one worker group.
        error_feedback: keep per-contributor residuals ``value − decode(encode(value))``
            and add them to the next round's contribution; with the two-phase exchange
            also the owner residuals of the reduced chunks' re-encoding (see module doc).
        outer: keyword arguments of :func:`dipaco.sync.outer.make_outer_optimizer`.
        sharing_rescale: multiply the averaged pseudo-gradient by √(contributions), so
            modules shared by many paths move as fast as private ones.
        track_cosine: report the mean pairwise cosine similarity of this round's Δs (a
            running sum of their unit vectors: one more copy of the module).
        state_device: where θ_global, the outer state and the round's Σα·Δ live: the CPU
            (default) or the live parameters' device (``diloco.outer_device=auto`` on a
            GPU: Δ, the outer step and the restore then never cross PCIe; costs about
            3 copies of the module in GPU memory, 4 with ``track_cosine``).
    """

    def __init__(self, module_id: str, params: Sequence[nn.Parameter], comm: Communicator, *,
                 codec: Codec | str = "none", error_feedback: bool = False, outer: dict[str, Any] | None = None,
                 sharing_rescale: bool = False, track_cosine: bool = True,
                 state_device: torch.device | str = "cpu") -> None:
        self.module_id = module_id
        self.params = list(params)
        self.state_device = torch.device(state_device)
        self.comm = comm
        topo = comm.topology
        self.shared = len(topo.groups_of_module(module_id)) > 1
        self.codec = make_codec(codec) if isinstance(codec, str) else codec
        self._wire_codec, self.error_feedback = wire_codec(self.codec, error_feedback, self.shared)
        self.sharing_rescale = bool(sharing_rescale)
        self.track_cosine = bool(track_cosine)
        flat = flatten_params(self._live(), self.state_device)  # this process's part: all of it, or a shard
        self.numel = flat.numel()
        self.full_numel = self.numel  # the whole module's size (a sharded sync holds a part)
        self.group_size = topo.group_size
        self.slice_numel = topo.slice_numel(self.numel)
        self.padded_numel = self.slice_numel * self.group_size
        self.exchange = comm.exchange_for(module_id, self.numel, self._wire_codec)
        self.contributors = list(comm.contributors(module_id))
        self.core = ModuleCore(module_id, flat, outer, device=self.state_device)
        self.dropped_total = 0
        self.contributions = self._new_round()
        self._inflight: Optional[_InFlight] = None

    @property
    def global_weights(self) -> nn.Parameter:
        return self.core.global_weights

    @property
    def outer_optimizer(self) -> torch.optim.Optimizer:
        return self.core.outer_optimizer

    @property
    def residuals(self) -> dict[int, torch.Tensor]:
        return self.core.residuals

    @property
    def owner_residuals(self) -> dict[int, torch.Tensor]:
        return self.core.owner_residuals

    @property
    def in_flight(self) -> bool:
        """Whether an exchange was launched and not yet finished."""
        return self._inflight is not None

    @property
    def pending(self) -> Optional[Pending]:
        """The launched exchange not yet finished (None: none): its ``wait()`` blocks until
        the collectives complete, after which :meth:`land` does not block."""
        return None if self._inflight is None else self._inflight.pending

    def _new_round(self) -> Contributions:
        return Contributions(self.contributors, self.padded_numel, self.state_device, track_cosine=self.track_cosine)

    def _live(self) -> list[torch.Tensor]:
        """The live parameters this process synchronises (a sharded sync: its shards)."""
        return self.params

    # ----------------------------------------------------------------- a path's turn
    def restore(self) -> None:
        """Replace the live parameters by the global weights (before each path's turn)."""
        self.core.restore(self._live())

    def mix(self, weight: float) -> None:
        """``live ← live + weight·(θ_global − live)`` (weight 1: :meth:`restore`)."""
        self.core.mix_into(self._live(), weight)

    def snapshot(self) -> torch.Tensor:
        """A flat fp32 copy of θ_global on the live parameters' device (a path's own copy)."""
        return self.core.weights.to(self.params[0].device, copy=True)

    def mix_into(self, copy: torch.Tensor, weight: float) -> None:
        """``copy ← copy + weight·(θ_global − copy)`` for a flat copy set aside by a path."""
        self.core.mix_into([copy], weight)

    def pseudo_gradient(self) -> torch.Tensor:
        """Δ = θ_global − live, flat fp32 on the state device."""
        return self.core.pseudo_gradient(self._live())

    @torch.no_grad()
    def contribute(self, path_id: int, tokens: float, contributor: int, delta: Optional[torch.Tensor] = None,
                   finite: Optional[bool] = None) -> bool:
        """Record the path's pseudo-gradient with weight α = ``tokens``.

        ``delta`` / ``finite``: Δ and whether it is finite, when the caller computed them
        (the driver reads every module's finiteness of a path in one device read).
        Returns False (and counts it) when Δ has a NaN/inf: it is dropped for this module
        and round, never applied.
        """
        if contributor not in self.contributions.alpha:
            raise ValueError(
                f"module {self.module_id!r}: contributor (worker group) {contributor} is not one of {self.contributors}"
            )
        alpha = float(tokens)
        if not alpha >= 0 or alpha == float("inf"):
            raise ValueError(f"path {path_id}: tokens={tokens} must be a finite number ≥ 0")
        if delta is None:
            delta = self.pseudo_gradient()
        if finite is None:
            finite = bool(torch.isfinite(delta).all())
        if not self.contributions.add(contributor, delta, alpha, finite):
            self.dropped_total += 1
            log.warning("module %s: dropped the non-finite pseudo-gradient of path %d this round",
                        self.module_id, path_id)
            return False
        return True

    # ----------------------------------------------------------------- the exchange
    def _encode(self, round_: Contributions, contributor: int) -> list[list[Payload]]:
        """Encode a contributor's Σα·Δ: ``[slice r][chunk j]`` payloads (plus its EF residual).

        Each slice is zero-padded to ``exchange.num_chunks * exchange.chunk_numel`` and
        encoded chunk by chunk (one chunk = the whole slice unless the exchange is the
        two-phase ``reduce_scatter``).
        """
        value = round_.values.get(contributor)
        # a contributor with nothing this round keeps its residual for the round it next
        # contributes in (re-encoding a lone residual would overwrite it with its error)
        feedback = self.error_feedback and value is not None
        if value is None:
            value = torch.zeros(self.padded_numel, dtype=torch.float32, device=self.state_device)
        res = self.residuals.get(contributor) if feedback else None
        s, codec, ex = self.slice_numel, self._wire_codec, self.exchange
        c, pad = ex.chunk_numel, ex.padded_slice_numel - self.slice_numel
        # every rank of a worker group encodes ALL slices (it sends only its own): the
        # residual then stays identical on the G ranks, so any of them can checkpoint it
        payloads, errors = [], []
        for r in range(self.group_size):
            sl = value[r * s : (r + 1) * s]
            rs = None if res is None else res[r * s : (r + 1) * s]
            if pad:
                sl = torch.cat([sl, sl.new_zeros(pad)])
                rs = None if rs is None else torch.cat([rs, rs.new_zeros(pad)])
            row, err = [], []
            for j in range(ex.num_chunks):
                part = slice(j * c, (j + 1) * c)
                payload, e = encode_with_feedback(sl[part], codec, None if rs is None else rs[part], feedback=feedback)
                row.append(payload)
                err.append(e)
            payloads.append(row)
            if feedback:
                errors.append(torch.cat(err)[:s])
        if feedback:
            self.residuals[contributor] = torch.cat(errors)
        return payloads

    def _owner_feedback(self) -> dict[int, torch.Tensor] | None:
        """The owner residuals handed to the communicator (None: no second-stage feedback)."""
        if not (self.error_feedback and self.exchange.kind == "reduce_scatter"):
            return None
        n = self.group_size * self.exchange.chunk_numel
        for c in self.contributors:
            if c not in self.owner_residuals:
                self.owner_residuals[c] = torch.zeros(n, dtype=torch.float32)
        return self.owner_residuals

    def _exchange_job(self, round_: Contributions) -> tuple[Callable[[], Exchanged], Optional[dict], Optional[dict]]:
        """Encode every contributor's buffer now; return the job that sums them over the
        module group (exchange, then meta), the owner residuals it updates in place and a
        copy of them from before (to put back when the round takes no step)."""
        payloads = {c: self._encode(round_, c) for c in self.contributors}
        metas = {c: round_.meta(c) for c in self.contributors}
        owner = self._owner_feedback()
        kept = {c: r.clone() for c, r in owner.items()} if owner else None
        codec, ex, comm, m = self._wire_codec, self.exchange, self.comm, self.module_id

        def job() -> Exchanged:
            total, nbytes = comm.exchange(m, payloads, codec, ex, owner)
            meta, meta_bytes = comm.reduce_meta(m, metas)
            return total, meta, CommBytes(nbytes.cross, meta_bytes, nbytes.intra)

        return job, owner, kept

    @torch.no_grad()
    def launch(self) -> None:
        """Encode this round's contributions and start their exchange over the module group.

        Every rank of the module group must launch in the same round, modules in the
        global module order (collectives; see :mod:`dipaco.sync.comm`). Contributions
        made after it belong to the next round.
        """
        if self._inflight is not None:
            raise RuntimeError(f"module {self.module_id!r}: launch() while the previous exchange is in flight")
        round_, self.contributions = self.contributions, self._new_round()
        job, owner, kept = self._exchange_job(round_)
        self._inflight = _InFlight(self.comm.start(job), round_, owner, kept)

    @torch.no_grad()
    def land(self) -> ModuleRoundStats:
        """Wait for the launched exchange, average with weights α and take the outer step.

        If nobody contributed (or Σα = 0), θ_global is left unchanged, no outer step (so no
        momentum) is applied and every error-feedback residual is kept as it was. The live
        parameters are not touched: the caller replaces (:meth:`restore`) or mixes them.
        """
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            raise RuntimeError(f"module {self.module_id!r}: land() without launch()")
        total, meta, nbytes = inflight.pending.wait()
        alpha_sum, count, dropped = float(meta[0]), int(round(float(meta[1]))), int(round(float(meta[2])))
        update = self.core.step(total, alpha_sum, count, rescale=self.sharing_rescale)
        if not update.stepped and inflight.kept is not None:
            for c, r in inflight.kept.items():
                inflight.owner[c].copy_(r)
        return ModuleRoundStats(module_id=self.module_id, bytes_sent=nbytes.total, bytes_cross=nbytes.cross,
                                bytes_meta=nbytes.meta, bytes_intra=nbytes.intra, pseudo_grad_norm=update.norm,
                                contributions=count, dropped=dropped, alpha_sum=alpha_sum, stepped=update.stepped,
                                cosine=inflight.round.cosine())

    # ----------------------------------------------------------------- state
    def weights_hash(self) -> str:
        """sha256 of the global weights (fp32 flat)."""
        return params_hash([self.global_weights])

    def live_hash(self) -> str:
        """sha256 of the live parameters, flattened to fp32 like the global weights
        (equal to :meth:`weights_hash` right after ``restore``)."""
        return params_hash([flatten_params(self._live(), self.state_device)])

    def state_dict(self) -> dict[str, torch.Tensor]:
        """:meth:`ModuleCore.state_dict`: ``global``, ``outer.<key>``, ``residual.<group>``
        and ``residual.<group>.owner`` (every residual key starts with ``residual.``, so a
        caller can drop them all)."""
        return self.core.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Inverse of :meth:`state_dict`; also restores the live parameters.

        Residuals of worker groups that do not contribute here are skipped; owner
        residuals written with another exchange or chunking belong to no chunk now.
        """
        owner_numel = self.group_size * self.exchange.chunk_numel

        def keep(group: int, owner: bool, val: torch.Tensor) -> bool:
            if group not in self.contributors:
                return False
            if owner and not (val.numel() == owner_numel and self.exchange.kind == "reduce_scatter"):
                log.warning("module %s: dropped the owner residual of worker group %d (chunking changed)",
                            self.module_id, group)
                return False
            return True

        self.core.load_state_dict(state, keep)
        self.restore()
        self.contributions = self._new_round()
        self._inflight = None
