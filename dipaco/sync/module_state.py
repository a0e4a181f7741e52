"""The state of ONE module that both sync modes share (torchft's fragment shape).

:class:`ModuleState` owns the module's global flat weights θ_global, its outer optimiser
(any ``torch.optim.Optimizer`` built by :func:`dipaco.sync.outer.make_outer_optimizer`),
the error-feedback residuals of the contributors it plays, and one ``state_dict``
layout, saved as ``outer/<module>.safetensors`` in every checkpoint:

* ``global``: θ_global, flat fp32;
* ``outer.<key>``: the outer optimiser's per-parameter state (hyper-parameters come
  from the config);
* ``residual.<c>`` / ``residual.<c>.owner``: error feedback of contributor ``c`` (a
  worker group in sync mode, a path in decoupled mode, which is a worker group of one
  path) and, with the two-phase exchange, of the reduced chunks it owns.

Synchronous mode is this core + a communicator (:class:`dipaco.sync.module_sync.ModuleSync`);
decoupled mode is this core + a quorum/staleness policy
(:class:`dipaco.decoupled.merge.ModuleSynchronizer`).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from dipaco.sync.codecs import Codec
from dipaco.sync.outer import make_outer_optimizer

__all__ = ["ModuleState", "encode_with_feedback", "load_flat"]

RESIDUAL = "residual."


@torch.no_grad()
def load_flat(params: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy a flat vector into parameters, in order (the inverse of ``flatten_params``)."""
    off = 0
    for p in params:
        n = p.numel()
        p.copy_(flat[off : off + n].view_as(p).to(p.dtype))
        off += n
    if off != flat.numel():
        raise ValueError(f"flat vector of {flat.numel()} values for parameters of {off} values")


@torch.no_grad()
def encode_with_feedback(value: torch.Tensor, codec: Codec,
                         residual: Optional[torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], Optional[torch.Tensor]]:
    """Encode ``value + residual``; return the payload and the new residual (its error).

    ``residual=None``: no error feedback (the second element is None).
    """
    if residual is None:
        return codec.encode(value), None
    value = value + residual
    payload = codec.encode(value)
    return payload, value - codec.decode(payload, value.numel())


class ModuleState:
    """Global weights, outer optimiser and error-feedback residuals of one module.

    Args:
        module_id: the module's id.
        weights: initial global weights, flat (copied to fp32).
        outer: keyword arguments of :func:`make_outer_optimizer`.
        device: where θ_global, the outer optimiser's state and the residuals live (default
            the CPU: host memory is plentiful; a GPU keeps the per-round arithmetic next to
            the live module, ``diloco.outer_device``).
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

    def restore(self, params: Sequence[torch.Tensor]) -> None:
        """Copy θ_global into live parameters (in ``flatten_params`` order)."""
        load_flat(params, self.global_weights.detach())

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
        takes (None: all of them).
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
