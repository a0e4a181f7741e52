"""The per-module core both sync modes share (torchft's fragment shape).

:class:`ModuleCore` owns, for ONE module: its global flat weights θ_global and their
outer optimiser (any ``torch.optim.Optimizer`` built by
:func:`dipaco.sync.outer.make_outer_optimizer`); the outer update (the weighted average
ΣαΔ / Σα, the √ rescale and the no-step rule, :meth:`ModuleCore.step`); the
error-feedback residuals of the contributors it plays; and one ``state_dict`` layout,
saved as ``outer/<module>.safetensors`` in every checkpoint:

* ``global``: θ_global, flat fp32;
* ``outer.<key>``: the outer optimiser's per-parameter state (hyper-parameters come
  from the config);
* ``residual.<c>`` / ``residual.<c>.owner``: error feedback of contributor ``c`` and,
  with the two-phase exchange, of the reduced chunks it owns.

Beside it live the functions every holder of a module uses, each written once: the
flatten/load pair (:func:`flatten_params`, :func:`load_flat`), the pseudo-gradient's
sign (:func:`pseudo_gradient`), how a contribution α·Δ is formed (:func:`contribution`,
:class:`Contributions`), the rule that a module of one contributor travels exact
(:func:`wire_codec`) and encoding with error feedback (:func:`encode_with_feedback`).

Synchronous mode is this core + a communicator (:class:`dipaco.sync.module_sync.CollectiveModuleSync`);
decoupled mode is this core + a quorum/staleness policy
(:class:`dipaco.decoupled.merge.MergingModuleSync`). Both hold it as ``.core``.

Where the residuals live: with their contributor. In sync mode a contributor is a worker
group, whose ranks hold the module's core, so they live in :attr:`ModuleCore.residuals`.
In decoupled mode a contributor is a path whose phases run on any decoupled worker, and
the synchroniser holding the core never encodes; so a path's residuals travel with its
state through the store, and the final checkpoint writes them into this layout as
``residual.<path>`` (a sync run resumed from it reads one path per worker group).
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from dipaco.plan.codecs import Codec, Payload, make_codec
from dipaco.sync.outer import make_outer_optimizer

__all__ = ["Contributions", "ModuleCore", "OuterUpdate", "contribution", "encode_with_feedback",
           "flatten_params", "load_flat", "params_hash", "pseudo_gradient", "wire_codec"]

RESIDUAL = "residual."


# ----------------------------------------------------------------- flat layout
def _views(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like ``params``, in order (the flat layout of a module)."""
    sizes = [p.numel() for p in params]
    if sum(sizes) != flat.numel():
        raise ValueError(f"flat vector of {flat.numel()} values for parameters of {sum(sizes)} values")
    return [v.view(p.shape) for v, p in zip(flat.split(sizes), params)]


def flatten_params(params: Sequence[torch.Tensor], device: torch.device | str = "cpu") -> torch.Tensor:
    """Concatenate parameters into one flat fp32 tensor on ``device`` (a copy)."""
    if not params:
        return torch.zeros(0, dtype=torch.float32, device=device)
    return torch.cat([p.detach().reshape(-1).to(device, torch.float32) for p in params])


@torch.no_grad()
def load_flat(params: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy a flat vector into parameters, in order (the inverse of :func:`flatten_params`).

    One ``torch._foreach_copy_`` over every parameter: no per-parameter Python loop (the
    vector crosses to the parameters' device first, in one transfer, when it lives elsewhere)."""
    params = [p.detach() for p in params]
    if params:
        torch._foreach_copy_(params, _views(flat.detach().to(params[0].device), params))
    elif flat.numel():
        raise ValueError(f"flat vector of {flat.numel()} values for parameters of 0 values")


def params_hash(params: Sequence[torch.Tensor]) -> str:
    """sha256 hex digest of parameters (dtype, shape and bytes, in order)."""
    h = hashlib.sha256()
    for p in params:
        t = p.detach().to("cpu").contiguous()
        h.update(f"{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ----------------------------------------------------------------- contributions
def pseudo_gradient(global_flat: torch.Tensor, path_flat: torch.Tensor) -> torch.Tensor:
    """DiLoCo's pseudo-gradient: ``Δ = θ_global_before_round − θ_path_after_round``.

    With this sign, an outer SGD step ``θ ← θ − lr·Δ`` moves θ_global towards the paths.
    """
    return global_flat - path_flat


# below this norm a Δ counts as zero in the cosine (torch's cosine_similarity eps)
_COSINE_EPS = 1e-12


def contribution(delta: torch.Tensor, alpha: float, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """α·Δ added into ``out`` (a fresh fp32 zero vector when None): the one way both modes
    form a contribution, so their sums agree bit for bit."""
    if out is None:
        out = torch.zeros(delta.numel(), dtype=torch.float32, device=delta.device)
    return out.add_(delta.reshape(-1), alpha=float(alpha))


class Contributions:
    """One round's α-weighted pseudo-gradients of one module, per contributor.

    Args:
        contributors: the contributors (worker groups) this holder accepts.
        padded_numel: length of each contributor's buffer (the module, zero-padded to
            the exchange's slices); Δ fills the first ``len(Δ)`` entries.
        device: where the buffers live.
        track_cosine: tally the accepted Δs for the mean pairwise cosine between them
            (:meth:`cosine`): one running sum of their unit vectors, not a copy of each.
    """

    def __init__(self, contributors: Sequence[int], padded_numel: int, device: torch.device,
                 track_cosine: bool = False) -> None:
        self.padded_numel, self.device, self.track_cosine = int(padded_numel), device, track_cosine
        self.values: dict[int, torch.Tensor] = {}
        self.alpha = {c: 0.0 for c in contributors}
        self.count = {c: 0 for c in contributors}
        self.dropped = {c: 0 for c in contributors}
        # the cosine's tally: Σ u_i, Σ ‖u_i‖² and n over the accepted Δs, u_i = Δ_i / ‖Δ_i‖
        # (0 for Δ = 0). Kept instead of the Δs: n copies of the module made the round's
        # peak grow with the paths sharing it, and n(n−1)/2 pairwise products cost 2.5 s
        # of a 15 s round at 16 paths a module ([16,16] smoke, docs/gpu.md).
        self._unit_sum: Optional[torch.Tensor] = None
        self._unit_sq: Optional[torch.Tensor] = None  # Σ ‖u_i‖²: the Δs counted (0-d, on the device)
        self._kept = 0

    @torch.no_grad()
    def add(self, contributor: int, delta: torch.Tensor, alpha: float, finite: bool) -> bool:
        """Add α·Δ to the contributor's buffer; a non-finite Δ is counted and dropped."""
        if not finite:
            self.dropped[contributor] += 1
            return False
        buf = self.values.get(contributor)
        if buf is None:
            buf = self.values[contributor] = torch.zeros(self.padded_numel, dtype=torch.float32, device=self.device)
        contribution(delta, alpha, buf[: delta.numel()])
        self.alpha[contributor] += float(alpha)
        self.count[contributor] += 1
        if self.track_cosine:
            self._tally(delta)
        return True

    @torch.no_grad()
    def _tally(self, delta: torch.Tensor) -> None:
        # On the device throughout: reading ‖Δ‖ back to the host here would wait for the
        # device once per contribution (every path, every module, every round); the tally
        # is read once, by cosine().
        flat = delta.detach().reshape(-1).float()
        norm = torch.linalg.vector_norm(flat, dtype=torch.float64)
        if self._unit_sum is None:
            self._unit_sum = torch.zeros(flat.numel(), dtype=torch.float32, device=flat.device)
            self._unit_sq = torch.zeros((), dtype=torch.float64, device=flat.device)
        self._kept += 1
        counted = norm > _COSINE_EPS  # a zero Δ is orthogonal to every other (as cosine_similarity says)
        scale = torch.where(counted, 1.0 / norm, torch.zeros_like(norm)).to(torch.float32)
        self._unit_sum.addcmul_(flat, scale)
        self._unit_sq += counted

    def meta(self, contributor: int) -> torch.Tensor:
        """``[Σα, contributions, dropped]`` of a contributor (float64: exchanged with the sums)."""
        c = contributor
        return torch.tensor([self.alpha[c], self.count[c], self.dropped[c]], dtype=torch.float64)

    def cosine(self) -> Optional[float]:
        """Mean pairwise cosine similarity of the accepted Δs (None: fewer than 2).

        Σ_{i≠j} u_i·u_j = ‖Σ u_i‖² − Σ ‖u_i‖², so the mean over the n(n−1)/2 pairs comes
        from the running sum in O(size) instead of O(n² · size).
        """
        n = self._kept
        if n < 2 or self._unit_sum is None or self._unit_sq is None:
            return None
        total = float(torch.linalg.vector_norm(self._unit_sum, dtype=torch.float64)) ** 2
        return (total - float(self._unit_sq)) / (n * (n - 1))


# ----------------------------------------------------------------- encoding
def wire_codec(codec: Codec, error_feedback: bool, shared: bool) -> tuple[Codec, bool]:
    """The codec a module travels with and whether it keeps error feedback: a module held
    by one contributor sends nothing that needs compressing, so it stays exact."""
    if not shared:
        return make_codec("none"), False
    return codec, bool(error_feedback) and codec.lossy


@torch.no_grad()
def encode_with_feedback(value: torch.Tensor, codec: Codec, residual: Optional[torch.Tensor], *,
                         feedback: bool) -> tuple[Payload, Optional[torch.Tensor]]:
    """Encode ``value`` (+ ``residual``, the last encoding's error, when given).

    Returns the payload and, with ``feedback``, the new residual (this encoding's error);
    None without. The one error-feedback encoder: contributions in both modes and the
    two-phase exchange's re-encoded chunks go through it.
    """
    if residual is not None:
        value = value + residual
    payload = codec.encode(value)
    return payload, (value - codec.decode(payload, value.numel()) if feedback else None)


# ----------------------------------------------------------------- the core
@dataclass(frozen=True)
class OuterUpdate:
    """What :meth:`ModuleCore.step` did."""

    stepped: bool
    norm: float  # ‖Σα·Δ / Σα‖ before any rescale; 0 without a step
    momentum_applied: bool = False


class ModuleCore:
    """Global weights, outer optimiser and error-feedback residuals of one module.

    Args:
        module_id: the module's id.
        weights: initial global weights, flat (copied to fp32).
        outer: keyword arguments of :func:`make_outer_optimizer`.
        device: where θ_global, the outer optimiser's state and the residuals live (default
            the CPU; a GPU keeps the per-round arithmetic next to the live module,
            ``diloco.outer_device``).
    """

    def __init__(self, module_id: str, weights: torch.Tensor, outer: Optional[dict[str, Any]] = None,
                 device: Optional[torch.device | str] = None) -> None:
        self.module_id = module_id
        self.device = torch.device(device or "cpu")
        flat = weights.detach().to(self.device, torch.float32).reshape(-1).clone()
        self.global_weights = nn.Parameter(flat, requires_grad=True)
        self.outer_optimizer = make_outer_optimizer([self.global_weights], **(outer or {}))
        self.residuals: dict[int, torch.Tensor] = {}
        # second-encoding error of the two-phase exchange, per owning contributor
        self.owner_residuals: dict[int, torch.Tensor] = {}

    @property
    def numel(self) -> int:
        return self.global_weights.numel()

    @property
    def weights(self) -> torch.Tensor:
        """θ_global (a detached view: read it, do not write it)."""
        return self.global_weights.detach()

    # ----------------------------------------------------------------- live weights
    def restore(self, params: Sequence[torch.Tensor]) -> None:
        """Replace live parameters by θ_global (in :func:`flatten_params` order)."""
        load_flat(params, self.weights)

    @torch.no_grad()
    def mix_into(self, params: Sequence[torch.Tensor], weight: float) -> None:
        """``live ← live + weight·(θ_global − live)``: weight 1 replaces (:meth:`restore`);
        less keeps part of what the path learnt since (streaming DiLoCo mixes)."""
        if weight == 1.0:
            self.restore(params)
            return
        params = [p.detach() for p in params]
        views = _views(self.weights.to(params[0].device), params)
        torch._foreach_lerp_(params, [v.to(p.dtype) for v, p in zip(views, params)], float(weight))

    @torch.no_grad()
    def pseudo_gradient(self, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """Δ = θ_global − live, flat fp32 on the core's device: the live parameters are
        copied out with one ``torch._foreach_copy_`` (on their device, then in one transfer
        to the core's when it lives elsewhere), then subtracted in place."""
        params = [p.detach() for p in params]
        live = torch.empty(self.numel, dtype=torch.float32, device=params[0].device if params else self.device)
        if params:
            torch._foreach_copy_(_views(live, params), params)
        live = live.to(self.device)
        return torch.sub(self.weights, live, out=live)

    # ----------------------------------------------------------------- the outer update
    @torch.no_grad()
    def step(self, total: torch.Tensor, denom: float, count: int, rescale: bool = False) -> OuterUpdate:
        """The outer update from the summed contributions ``total`` = Σα·Δ.

        The outer gradient is ``total / denom`` (denom = Σα: the α-weighted mean), times
        √count with ``rescale`` (the average of ``count`` roughly independent
        pseudo-gradients has ~1/√count of their norm). No contribution or ``denom`` ≤ 0:
        no step, so θ_global and the optimiser state (momentum) stay as they are.
        """
        if count <= 0 or not denom > 0:
            return OuterUpdate(False, 0.0)
        avg = total[: self.numel].to(self.device) / denom  # a communicator may hand it back on the CPU
        norm = float(avg.norm())
        if rescale:
            avg = avg * math.sqrt(count)
        return OuterUpdate(True, norm, self.outer_step(avg))

    @torch.no_grad()
    def outer_step(self, grad: torch.Tensor) -> bool:
        """One outer step with outer gradient ``grad``; True if momentum was applied
        (always for momentum optimisers but :class:`~dipaco.sync.outer.DelayedNesterov`,
        which applies it every N steps)."""
        self.global_weights.grad = grad.to(self.global_weights.dtype)
        self.outer_optimizer.step()
        self.global_weights.grad = None
        st = self.outer_optimizer.state.get(self.global_weights, {})
        if "momentum_applied" in st:
            return bool(st["momentum_applied"])
        group = self.outer_optimizer.param_groups[0]
        return float(group.get("momentum", 0.0) or 0.0) > 0 or "betas" in group

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors only, in the layout of the module doc."""
        out: dict[str, torch.Tensor] = {"global": self.global_weights.detach().clone()}
        for key, val in self.outer_optimizer.state.get(self.global_weights, {}).items():
            if isinstance(val, torch.Tensor):
                out[f"outer.{key}"] = val.detach().clone()
            elif isinstance(val, (int, float)):
                out[f"outer.{key}"] = torch.tensor(val, dtype=torch.float64)
        for c, res in self.residuals.items():
            out[f"{RESIDUAL}{c}"] = res.detach().clone()
        for c, res in self.owner_residuals.items():
            out[f"{RESIDUAL}{c}.owner"] = res.detach().clone()
        return out

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor],
                        keep_residual: Optional[Callable[[int, bool, torch.Tensor], bool]] = None) -> None:
        """Inverse of :meth:`state_dict`.

        ``keep_residual(contributor, owner, tensor)`` decides which residuals this holder
        takes (None: all of them). The optimiser state of either mode loads into the other:
        keys an optimiser lacks are created on its first step
        (:class:`dipaco.sync.outer.DelayedNesterov` adds its step count and delay buffer).
        """
        g = state["global"].to(torch.float32).reshape(-1)
        if g.numel() != self.numel:
            raise ValueError(
                f"module {self.module_id!r}: checkpoint has {g.numel()} parameters, the model has {self.numel}"
            )
        self.global_weights.copy_(g)
        # per-element state (momentum) goes where θ_global is; scalars (a step count) stay put
        opt_state = {k[len("outer."):]: (v.to(self.device) if v.dim() and v.numel() == self.numel else v.clone())
                     for k, v in state.items() if k.startswith("outer.")}
        self.outer_optimizer.state.clear()
        if opt_state:
            self.outer_optimizer.state[self.global_weights] = opt_state
        self.residuals, self.owner_residuals = {}, {}
        for key, val in state.items():
            if not key.startswith(RESIDUAL):
                continue
            name = key[len(RESIDUAL):]
            owner = name.endswith(".owner")
            c = int(name[: -len(".owner")] if owner else name)
            if keep_residual is not None and not keep_residual(c, owner, val):
                continue
            (self.owner_residuals if owner else self.residuals)[c] = val.to(self.device, torch.float32).reshape(-1).clone()
