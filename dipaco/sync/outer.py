"""Outer optimiser factory (``diloco.outer``).

DiLoCo's default outer optimiser is SGD with Nesterov momentum, lr 0.7, momentum 0.9.
Plain averaging of the paths' weights is SGD with lr 1.0 and momentum 0: with the
pseudo-gradient ``Δ = θ_global − θ_path`` averaged with weights α, one such step gives
``θ_global − Σα·Δ/Σα = Σα·θ_path/Σα``.
"""
from __future__ import annotations

import inspect
from typing import Any, Iterable

import torch

__all__ = ["make_outer_optimizer", "resolve_optimizer_class"]


def _optimizer_classes() -> dict[str, type[torch.optim.Optimizer]]:
    out = {}
    for attr in dir(torch.optim):
        obj = getattr(torch.optim, attr)
        if isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer) and obj is not torch.optim.Optimizer:
            out[attr.lower()] = obj
    return out


def resolve_optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The ``torch.optim`` class called ``name`` (case-insensitive)."""
    classes = _optimizer_classes()
    cls = classes.get(str(name).lower())
    if cls is None:
        raise ValueError(f"diloco.outer.name={name!r} is not a torch.optim optimiser; valid choices: {sorted(classes)}")
    return cls


def make_outer_optimizer(
    params: Iterable[torch.nn.Parameter],
    name: str = "sgd",
    lr: float = 0.7,
    momentum: float = 0.9,
    nesterov: bool = True,
    **kw: Any,
) -> torch.optim.Optimizer:
    """Build the outer optimiser of one module's global weights.

    ``momentum`` and ``nesterov`` are passed only to optimisers that accept them (SGD,
    RMSprop takes ``momentum``); other keyword arguments go to the optimiser as is.

    Raises:
        ValueError: unknown optimiser name, an option it does not accept, lr ≤ 0,
            negative momentum, or nesterov with momentum 0.
    """
    cls = resolve_optimizer_class(name)
    if not float(lr) > 0:
        raise ValueError(f"diloco.outer.lr={lr} must be > 0 (plain averaging: lr=1.0 momentum=0 nesterov=false)")
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
    opts: dict[str, Any] = {"lr": float(lr)}
    if "momentum" in accepted:
        if float(momentum) < 0:
            raise ValueError(f"diloco.outer.momentum={momentum} must be ≥ 0")
        opts["momentum"] = float(momentum)
    if "nesterov" in accepted:
        if nesterov and float(momentum) <= 0:
            raise ValueError(
                f"diloco.outer.nesterov=true needs diloco.outer.momentum > 0 (got {momentum}): "
                "DiLoCo's default is lr=0.7 momentum=0.9 nesterov=true; plain averaging is "
                "lr=1.0 momentum=0 nesterov=false"
            )
        opts["nesterov"] = bool(nesterov)
    unknown = sorted(set(kw) - accepted)
    if unknown:
        raise ValueError(
            f"diloco.outer options {unknown} are not accepted by torch.optim.{cls.__name__}; "
            f"it accepts {sorted(accepted)}"
        )
    opts.update(kw)
    try:
        return cls(params, **opts)
    except (ValueError, TypeError) as e:
        raise ValueError(f"diloco.outer: torch.optim.{cls.__name__}({opts}) rejected the options: {e}") from None
