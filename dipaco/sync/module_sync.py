"""DiLoCo for ONE module: global weights, outer optimiser, error-feedback residuals.

Per round (see :class:`dipaco.sync.diloco.DiLoCoSync` for the driver):

1. before each path's turn, :meth:`ModuleSync.restore` copies the global weights into
   the live module, so every path starts the round from the same θ_global;
2. after the path's H inner steps, :meth:`ModuleSync.contribute` records its
   pseudo-gradient ``Δ = θ_global − θ_path`` weighted by α (the path's tokens);
3. :meth:`ModuleSync.reduce_and_step` sums Σα·Δ and Σα over the module group, sets the
   outer gradient to ``Σα·Δ / Σα`` and steps the outer optimiser; the live module gets
   the new global weights.

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

import hashlib
import logging
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from dipaco.sync.codecs import Codec, make_codec
from dipaco.sync.comm import CommBytes, Communicator
from dipaco.sync.module_state import ModuleState

__all__ = ["ModuleRoundStats", "ModuleSync", "pseudo_gradient", "params_hash"]

log = logging.getLogger(__name__)


def pseudo_gradient(global_flat: torch.Tensor, path_flat: torch.Tensor) -> torch.Tensor:
    """THE sign convention (docs/design.md, glossary): ``Δ = θ_global_before_round − θ_path_after_round``.

    With this sign, an outer SGD step ``θ ← θ − lr·Δ`` moves θ_global towards the paths.
    """
    return global_flat - path_flat


def flatten_params(params: Sequence[torch.Tensor], device: torch.device | str = "cpu") -> torch.Tensor:
    """Concatenate parameters into one flat fp32 tensor on ``device`` (a copy)."""
    if not params:
        return torch.zeros(0, dtype=torch.float32, device=device)
    return torch.cat([p.detach().reshape(-1).to(device, torch.float32) for p in params])


def params_hash(params: Sequence[torch.Tensor]) -> str:
    """sha256 hex digest of parameters (dtype, shape and bytes, in order)."""
    h = hashlib.sha256()
    for p in params:
        t = p.detach().to("cpu").contiguous()
        h.update(f"{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


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


class ModuleSync:
    """Global weights, outer optimiser, EF residuals and communicator of one module.

    Args:
        module_id: the module's id.
        params: the live parameters of the module in this process (in a fixed order).
        comm: communicator; its ``contributors(module_id)`` are the worker groups whose
            contributions this object accepts.
        codec: codec object or name; ignored (exact) for a module held by one worker group.
        error_feedback: keep per-contributor residuals ``value − decode(encode(value))``
            and add them to the next round's contribution; with the two-phase exchange
            also the owner residuals of the reduced chunks' re-encoding (see module doc).
        outer: keyword arguments of :func:`make_outer_optimizer`.
        sharing_rescale: multiply the averaged pseudo-gradient by √(contributions): the
            average of s roughly independent pseudo-gradients has ~1/√s of their norm, so
            without it modules shared by many paths move slower than private ones.
        track_cosine: keep this round's Δs (one copy per contribution) to report their
            mean pairwise cosine similarity.
        state_device: where θ_global, the outer state and the round's Σα·Δ live: the CPU
            (default) or the live parameters' device (``diloco.outer_device=auto`` on a
            GPU: Δ, the outer step and the restore then never cross PCIe; costs about
            3 copies of the module in GPU memory, more with ``track_cosine``).
    """

    def __init__(
        self,
        module_id: str,
        params: Sequence[nn.Parameter],
        comm: Communicator,
        *,
        codec: Codec | str = "none",
        error_feedback: bool = False,
        outer: dict[str, Any] | None = None,
        sharing_rescale: bool = False,
        track_cosine: bool = True,
        state_device: torch.device | str = "cpu",
    ) -> None:
        self.module_id = module_id
        self.params = list(params)
        self.state_device = torch.device(state_device)
        self.comm = comm
        topo = comm.topology
        self.shared = len(topo.groups_of_module(module_id)) > 1
        self.codec = make_codec(codec) if isinstance(codec, str) else codec
        # a module held by one worker group sends nothing: keep it exact
        self._wire_codec = self.codec if self.shared else make_codec("none")
        self.error_feedback = bool(error_feedback) and self.shared and self.codec.lossy
        self.sharing_rescale = bool(sharing_rescale)
        self.track_cosine = bool(track_cosine)
        flat = self._live_flat()  # this process's part of the module: all of it, or a shard
        self.numel = flat.numel()
        self.full_numel = self.numel  # the whole module's size (a sharded sync holds a part)
        self.group_size = topo.group_size
        self.slice_numel = topo.slice_numel(self.numel)
        self.padded_numel = self.slice_numel * self.group_size
        self.exchange = comm.exchange_for(module_id, self.numel, self._wire_codec)
        self.contributors = list(comm.contributors(module_id))
        # θ_global, outer optimiser, residuals: the core shared with decoupled mode
        self.state = ModuleState(module_id, flat, outer, device=self.state_device)
        self.dropped_total = 0
        self._reset_round()

    @property
    def global_weights(self) -> nn.Parameter:
        return self.state.global_weights

    @property
    def outer_optimizer(self) -> torch.optim.Optimizer:
        return self.state.outer_optimizer

    @property
    def residuals(self) -> dict[int, torch.Tensor]:
        return self.state.residuals

    @property
    def owner_residuals(self) -> dict[int, torch.Tensor]:
        return self.state.owner_residuals

    # ----------------------------------------------------------------- round state
    def _reset_round(self) -> None:
        self._acc: dict[int, torch.Tensor] = {}
        self._alpha: dict[int, float] = {c: 0.0 for c in self.contributors}
        self._count: dict[int, int] = {c: 0 for c in self.contributors}
        self._dropped: dict[int, int] = {c: 0 for c in self.contributors}
        self._deltas: list[torch.Tensor] = []

    def _live_flat(self) -> torch.Tensor:
        """The live parameters as one flat fp32 vector (the layout of θ_global)."""
        return flatten_params(self.params, self.state_device)

    def restore(self) -> None:
        """Copy the global weights into the live parameters (before each path's turn)."""
        self.state.restore(self.params)

    @torch.no_grad()
    def contribute(self, path_id: int, tokens: float, contributor: int) -> bool:
        """Record the path's pseudo-gradient with weight α = ``tokens``.

        Returns False (and counts it) when Δ has a NaN/inf: it is dropped for this
        module and round, never applied.
        """
        if contributor not in self._alpha:
            raise ValueError(
                f"module {self.module_id!r}: contributor (worker group) {contributor} is not one of {self.contributors}"
            )
        alpha = float(tokens)
        if not alpha >= 0 or math.isinf(alpha):
            raise ValueError(f"path {path_id}: tokens={tokens} must be a finite number ≥ 0")
        delta = pseudo_gradient(self.global_weights.detach(), self._live_flat())
        if not bool(torch.isfinite(delta).all()):
            self._dropped[contributor] += 1
            self.dropped_total += 1
            log.warning(
                "module %s: dropped the non-finite pseudo-gradient of path %d this round", self.module_id, path_id
            )
            return False
        acc = self._acc.get(contributor)
        if acc is None:
            acc = self._acc[contributor] = torch.zeros(self.padded_numel, dtype=torch.float32,
                                                       device=self.state_device)
        acc[: self.numel].add_(delta, alpha=alpha)
        self._alpha[contributor] += alpha
        self._count[contributor] += 1
        if self.track_cosine:
            self._deltas.append(delta)
        return True

    def _cosine(self) -> float | None:
        ds = self._deltas
        if len(ds) < 2:
            return None
        sims = []
        for i in range(len(ds)):
            for j in range(i + 1, len(ds)):
                sims.append(float(torch.nn.functional.cosine_similarity(ds[i], ds[j], dim=0, eps=1e-12)))
        return sum(sims) / len(sims)

    def _encode(self, contributor: int) -> list[list[tuple[torch.Tensor, ...]]]:
        """Encode a contributor's Σα·Δ: ``[slice r][chunk j]`` payloads (plus its EF residual).

        Each slice is zero-padded to ``exchange.num_chunks * exchange.chunk_numel`` and
        encoded chunk by chunk (one chunk = the whole slice unless the exchange is the
        two-phase ``reduce_scatter``).
        """
        value = self._acc.get(contributor)
        # a contributor with nothing this round keeps its residual for the round it next
        # contributes in (re-encoding a lone residual would overwrite it with its error)
        feedback = self.error_feedback and value is not None
        if value is None:
            value = torch.zeros(self.padded_numel, dtype=torch.float32, device=self.state_device)
        if feedback:
            res = self.residuals.get(contributor)
            if res is not None:
                value = value + res
        s, codec, ex = self.slice_numel, self._wire_codec, self.exchange
        c, pad = ex.chunk_numel, ex.padded_slice_numel - self.slice_numel
        # every rank of a worker group encodes ALL slices (it sends only its own): the
        # residual then stays identical on the G ranks, so any of them can checkpoint it
        payloads = []
        for r in range(self.group_size):
            sl = value[r * s : (r + 1) * s]
            if pad:
                sl = torch.cat([sl, sl.new_zeros(pad)])
            payloads.append([codec.encode(sl[j * c : (j + 1) * c]) for j in range(ex.num_chunks)])
        if feedback:
            decoded = torch.cat([torch.cat([codec.decode(pl, c) for pl in chunks])[:s] for chunks in payloads])
            self.residuals[contributor] = value - decoded
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

    def _exchange(self) -> tuple[torch.Tensor, CommBytes, dict[int, torch.Tensor] | None,
                                 dict[int, torch.Tensor] | None]:
        """Encode every contributor's buffer and sum them over the module group.

        Returns the sum, the bytes, the owner residuals the exchange updated in place and
        a copy of them from before (to put back when the round takes no step).
        """
        payloads = {c: self._encode(c) for c in self.contributors}
        owner = self._owner_feedback()
        # the exchange re-encodes owner residuals in place; whether there is a step is known
        # only after it (from the reduced totals), so keep a copy to put back without one
        kept = {c: r.clone() for c, r in owner.items()} if owner else None
        total, nbytes = self.comm.exchange(self.module_id, payloads, self._wire_codec, self.exchange, owner)
        return total, nbytes, owner, kept

    @torch.no_grad()
    def reduce_and_step(self) -> ModuleRoundStats:
        """Exchange, average with weights α, outer step, copy into the live params.

        Every rank of the module group must call this in the same round (collectives).
        If nobody contributed (or Σα = 0), θ_global is left unchanged, no outer step (so no
        momentum) is applied and every error-feedback residual is kept as it was; the live
        params are reset to θ_global either way.
        """
        metas = {
            c: torch.tensor([self._alpha[c], self._count[c], self._dropped[c]], dtype=torch.float64)
            for c in self.contributors
        }
        total, nbytes, owner, kept = self._exchange()
        meta, meta_bytes = self.comm.reduce_meta(self.module_id, metas)
        nbytes = CommBytes(nbytes.cross, meta_bytes, nbytes.intra)
        alpha_sum, count, dropped = float(meta[0]), int(round(float(meta[1]))), int(round(float(meta[2])))
        stepped = count > 0 and alpha_sum > 0
        norm = 0.0
        if stepped:
            avg = total[: self.numel].to(self.state_device) / alpha_sum  # the torch comm may return it on the CPU
            norm = float(avg.norm())
            if self.sharing_rescale:
                avg = avg * math.sqrt(count)
            self.state.outer_step(avg)
        elif kept is not None:
            for c, r in kept.items():
                owner[c].copy_(r)
        cosine = self._cosine()
        self.restore()
        self._reset_round()
        return ModuleRoundStats(
            module_id=self.module_id,
            bytes_sent=nbytes.total,
            bytes_cross=nbytes.cross,
            bytes_meta=nbytes.meta,
            bytes_intra=nbytes.intra,
            pseudo_grad_norm=norm,
            contributions=count,
            dropped=dropped,
            alpha_sum=alpha_sum,
            stepped=stepped,
            cosine=cosine,
        )

    # ----------------------------------------------------------------- state
    def weights_hash(self) -> str:
        """sha256 of the global weights (fp32 flat)."""
        return params_hash([self.global_weights])

    def live_hash(self) -> str:
        """sha256 of the live parameters, flattened to fp32 like the global weights
        (equal to :meth:`weights_hash` right after ``restore``)."""
        return params_hash([self._live_flat()])

    def state_dict(self) -> dict[str, torch.Tensor]:
        """:meth:`ModuleState.state_dict`: ``global``, ``outer.<key>``, ``residual.<group>``
        and ``residual.<group>.owner`` (every residual key starts with ``residual.``, so a
        caller can drop them all)."""
        return self.state.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Inverse of :meth:`state_dict`; also restores the live parameters.

        Residuals of worker groups that do not contribute here are skipped; owner
        residuals written with another exchange or chunking belong to no chunk now.
        """
        owner_numel = self.group_size * self.exchange.chunk_numel

        def keep(group: int, owner: bool, val: torch.Tensor) -> bool:
            if group not in self._alpha:
                return False
            if owner and not (val.numel() == owner_numel and self.exchange.kind == "reduce_scatter"):
                log.warning("module %s: dropped the owner residual of worker group %d (chunking changed)",
                            self.module_id, group)
                return False
            return True

        self.state.load_state_dict(state, keep)
        self.restore()
        self._reset_round()
