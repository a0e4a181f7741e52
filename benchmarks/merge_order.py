"""The decoupled merge by arrival order, and the staleness discount's pull (docs/decoupled.md).

``python -m benchmarks.merge_order``: the toy of loss (θ − 1)², where a phase moves θ 90% of
the way (Δ = −0.9 from θ = 0). Two phases of one path from the same base land in one step
("together") or one step apart ("apart"), after ``--history`` earlier fresh phases (so the
optimiser's state is not zero), per outer optimiser. Then two paths share a module, the
fresh one's Δ = −1 and the other's Δ = +1 from ``s`` full-quorum versions ago: the
undiscounted mean is 0, and the discount d(r) = (1 + r)^(−staleness_power), r = s − ½ the
rounds it is late beyond its round-mate (dipaco/decoupled/quorum.py ``rounds_late``), pulls
the result toward the fresh path. Pure arithmetic on one-element tensors: seconds on any CPU.
"""
from __future__ import annotations

import argparse

import torch

from dipaco.config import DiLoCoConfig
from dipaco.config.decoupled import DecoupledConfig
from dipaco.decoupled.merge import MergingModuleSync, Update
from dipaco.sync.outer import outer_options

OUTERS = {"sgd (lr 1, no momentum)": {"name": "sgd", "lr": 1.0, "momentum": 0.0, "nesterov": False},
          "nesterov every step (lr 0.7, 0.9)": {"name": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True},
          "delayed nesterov (the default)": outer_options(DiLoCoConfig(mode="decoupled")),
          "adamw (lr 0.05)": {"name": "adamw", "lr": 0.05, "betas": (0.9, 0.95)}}


def _update(i: int, path: int, phase: int, base: int, delta: float) -> Update:
    return Update(f"u{i}", "m", path, phase, base, 1.0, torch.full((1,), delta))


def arrival(outer: dict, apart: bool, history: int) -> float:
    """θ after two phases of path 0 from the same base, one step apart or together."""
    s = MergingModuleSync("m", torch.zeros(1), [0], DecoupledConfig(quorum=1.0), outer)
    for k in range(history):
        s.offer(_update(10 + k, 0, 10 + k, s.version, -0.1), 0.0)
        s.step(0.0)
    base = s.version
    s.offer(_update(0, 0, 0, base, -0.9), 0.0)
    if apart:
        s.step(0.0)
    s.offer(_update(1, 0, 1, base, -0.9), 0.0)
    s.step(0.0)
    return float(s.theta[0])


def discount_pull(staleness: int, power: float) -> float:
    """θ after one fresh (Δ = −1) and one stale (Δ = +1) update of two sharing paths (SGD, lr 1)."""
    s = MergingModuleSync("m", torch.zeros(1), [0, 1], DecoupledConfig(quorum=1.0, staleness_power=power),
                           OUTERS["sgd (lr 1, no momentum)"])
    s.version = staleness
    s.offer(_update(0, 0, 0, staleness, -1.0), 0.0)
    s.offer(_update(1, 1, 0, 0, 1.0), 0.0)
    s.step(0.0)
    return float(s.theta[0])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.merge_order", description=__doc__.splitlines()[0])
    ap.add_argument("--history", type=int, default=0, help="earlier fresh phases before the two")
    args = ap.parse_args(argv)
    for name, outer in OUTERS.items():
        print(f"{name:36s} together {arrival(outer, False, args.history):.3f}  "
              f"apart {arrival(outer, True, args.history):.3f}")
    power = DecoupledConfig().staleness_power
    for s in (1, 2, 4):
        print(f"staleness {s} (staleness_power {power}): theta {discount_pull(s, power):+.3f} "
              "(undiscounted mean +0.000, the fresh path alone +1.000)")


if __name__ == "__main__":
    main()
