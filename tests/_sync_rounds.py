"""Shared by the sync tests: synchronous rounds driven through the one object that runs
the rounds (:class:`dipaco.sync.round_driver.RoundDriver`), the shape of
:func:`dipaco.rounds.loop.run_round` with the inner steps done by the test."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from dipaco.plan.schedule import RoundSchedule
from dipaco.sync.diloco import DiLoCoSync
from dipaco.sync.module_sync import RoundStats
from dipaco.sync.round_driver import RoundDriver


def synchronous(sync: DiLoCoSync, inner_steps: int = 1) -> RoundDriver:
    """A driver of ``sync``'s modules by DiLoCo's synchronous round."""
    return RoundDriver(sync, RoundSchedule.synchronous(list(sync.syncs), inner_steps))


def sync_round(driver: RoundDriver, r: int, turn: Callable[[int], Optional[float]],
               paths: Optional[list[int]] = None) -> RoundStats:
    """Round ``r``: each path of ``paths`` (default: every path of the driver) goes live and
    ``turn(p)`` trains it and returns its α (None: the path contributes nothing); then the
    sync point at H and the round's end."""
    H = driver.schedule.inner_steps
    driver.begin_round(r)
    for p in driver.paths if paths is None else paths:
        driver.activate(p)
        a = turn(p)
        if a is not None:
            driver.contribute(p, H, 0, lambda _p, _tokens, a=a: float(a))
    driver.sync_point(H)
    return driver.end_round()


def sync_state(sync: DiLoCoSync) -> dict[str, torch.Tensor]:
    """Every module's :meth:`CollectiveModuleSync.state_dict`, flat as ``<module>/<key>``."""
    return {f"{m}/{k}": v for m, s in sync.syncs.items() for k, v in s.state_dict().items()}


def load_sync_state(sync: DiLoCoSync, state: dict[str, torch.Tensor]) -> None:
    """Inverse of :func:`sync_state` (restores the live modules too)."""
    for m, s in sync.syncs.items():
        s.load_state_dict({k[len(m) + 1:]: v for k, v in state.items() if k.startswith(m + "/")})
