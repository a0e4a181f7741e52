"""Outer optimiser factory (``diloco.outer``).

DiLoCo's default outer optimiser is SGD with Nesterov momentum, lr 0.7, momentum 0.9.
Plain averaging of the paths' weights is SGD with lr 1.0 and momentum 0: with the
pseudo-gradient ``Δ = θ_global − θ_path`` averaged with weights α, one such step gives
``θ_global − Σα·Δ/Σα = Σα·θ_path/Σα``.

:class:`DelayedNesterov` (``diloco.outer.name=delayed_nesterov``) is SGD whose momentum
is updated every N steps only; decoupled mode uses it for ``sgd`` with momentum when
``diloco.decoupled.momentum_every > 1`` (see :func:`outer_options`).
"""
from __future__ import annotations

import inspect
from typing import Any, Iterable

import torch

from dipaco.config import DiLoCoConfig

__all__ = ["DelayedNesterov", "make_outer_optimizer", "optimizer_names", "outer_options", "resolve_optimizer_class"]


class DelayedNesterov(torch.optim.Optimizer):
    """Outer SGD with delayed momentum (our reading of Liu et al. 2024, "Asynchronous
    Local-SGD Training for Language Modeling", Alg. DN), β the momentum, N = ``every``,
    c = ``scale``, counted in rounds: each step brings ``share`` of a round (the param
    group's ``"share"``, 1 unless the caller sets it before the step)::

        buffer += g;  r += share
        if r >= N:  m = β·m + buffer/r;  θ -= lr·(g + β·m);  buffer = 0;  r = 0   (nesterov)
                                          θ -= lr·m                               (heavy ball)
        else:       θ -= lr·(g + c·β·m)

    Momentum sees one averaged pseudo-gradient every N rounds instead of each stale one,
    so stale updates arriving in bursts are not amplified by 1/(1−β). A decoupled partial
    step applies part of a round (``Σα/D``; its g is that share of a round's mean), so
    the buffer over a round is about one round's pseudo-gradient, as a synchronous step's.
    With every share 1, N=1 is exactly torch's ``SGD(momentum=β, nesterov=...)``.
    ``state[p]["momentum_applied"]`` says whether the last step activated the momentum
    (decoupled mode logs it).
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float = 0.7, momentum: float = 0.9,
                 nesterov: bool = True, every: int = 1, scale: float = 0.0) -> None:
        if not (lr > 0 and momentum >= 0 and int(every) >= 1 and scale >= 0):
            raise ValueError(f"bad delayed-Nesterov settings lr={lr} momentum={momentum} every={every} scale={scale}")
        super().__init__(params, {"lr": float(lr), "momentum": float(momentum), "nesterov": bool(nesterov),
                                  "every": int(every), "scale": float(scale)})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """One outer step of every parameter that has a gradient."""
        for group in self.param_groups:
            lr, beta, every = group["lr"], group["momentum"], group["every"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g, st = p.grad, self.state[p]
                # key by key: a state loaded from the other mode (torch SGD's momentum buffer
                # alone, from a synchronous checkpoint) keeps its momentum and gains the rest
                if "step" not in st:
                    st["step"] = torch.zeros((), dtype=torch.float32)
                if "momentum_buffer" not in st:
                    st["momentum_buffer"] = torch.zeros_like(p)
                if "delay_buffer" not in st:
                    st["delay_buffer"] = torch.zeros_like(p)
                if "rounds" not in st:  # a state from before round counting: its steps were rounds
                    st["rounds"] = torch.tensor(float(int(st["step"]) % every), dtype=torch.float64)
                st["step"] += 1
                st["momentum_applied"] = False
                if beta == 0:  # plain SGD (lr 1: averaging); nothing to delay
                    p.add_(g, alpha=-lr)
                    continue
                m, buf = st["momentum_buffer"], st["delay_buffer"]
                buf.add_(g)
                st["rounds"] += float(group.get("share", 1.0))
                if float(st["rounds"]) >= every - 1e-6:
                    m.mul_(beta).add_(buf, alpha=1.0 / float(st["rounds"]))
                    buf.zero_()
                    st["rounds"].zero_()
                    p.add_(g + beta * m if group["nesterov"] else m, alpha=-lr)
                    st["momentum_applied"] = True
                else:
                    p.add_(g + group["scale"] * beta * m, alpha=-lr)


def _optimizer_classes() -> dict[str, type[torch.optim.Optimizer]]:
    out = {}
    for attr in dir(torch.optim):
        obj = getattr(torch.optim, attr)
        if isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer) and obj is not torch.optim.Optimizer:
            out[attr.lower()] = obj
    out["delayed_nesterov"] = DelayedNesterov
    return out


def optimizer_names() -> list[str]:
    """Every ``diloco.outer.name`` this install accepts (lower case), sorted."""
    return sorted(_optimizer_classes())


def resolve_optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The ``torch.optim`` class called ``name`` (case-insensitive), or ``delayed_nesterov``."""
    classes = _optimizer_classes()
    cls = classes.get(str(name).lower())
    if cls is None:
        raise ValueError(f"diloco.outer.name={name!r} is not a torch.optim optimiser; valid choices: {sorted(classes)}")
    return cls


def accepted_options(name: str) -> set[str]:
    """The keyword arguments the outer optimiser ``name`` takes (``momentum`` for SGD and
    RMSprop, ``nesterov`` for SGD, ...), besides its parameters."""
    return set(inspect.signature(resolve_optimizer_class(name).__init__).parameters) - {"self", "params"}


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
    accepted = accepted_options(name)
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


def outer_options(d: DiLoCoConfig) -> dict[str, Any]:
    """Keyword arguments of :func:`make_outer_optimizer` for ``diloco`` (both modes).

    ``delayed_nesterov`` takes N and c from ``diloco.decoupled.momentum_every`` /
    ``momentum_scale``. In decoupled mode, ``sgd`` with momentum and ``momentum_every > 1``
    becomes ``delayed_nesterov``: undelayed momentum diverged with stale updates
    (docs/decoupled.md), and with N = 1 the two are the same optimiser.
    """
    o, dec = d.outer, d.decoupled
    opts: dict[str, Any] = {"name": o.name, "lr": o.lr, "momentum": o.momentum, "nesterov": o.nesterov}
    delayed = str(o.name).lower() == "delayed_nesterov"
    if d.mode == "decoupled" and str(o.name).lower() == "sgd" and o.momentum > 0 and dec.momentum_every > 1:
        opts["name"], delayed = "delayed_nesterov", True
    if delayed:
        opts.update(every=dec.momentum_every, scale=dec.momentum_scale)
    return opts
