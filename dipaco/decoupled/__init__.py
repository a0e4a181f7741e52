"""Decoupled mode (``diloco.mode=decoupled``): asynchronous path learners and per-module
synchronisers that meet only through a shared store.

* :mod:`~dipaco.decoupled.store`: the store (a shared directory, atomic writes) and leases;
* :mod:`~dipaco.decoupled.worker`: the decoupled worker process loop;
* :mod:`~dipaco.decoupled.synchronizer`: per-module quorum, grace window, staleness,
  delayed Nesterov and the applied-id ledger;
* :mod:`~dipaco.decoupled.run`: the supervisor, ``run_decoupled(cfg, run)``;
* :mod:`~dipaco.decoupled.metrics`: goodput, staleness, version rates, drops, ledger check.

See docs/decoupled.md.
"""
from __future__ import annotations

from typing import Any

__all__ = ["DecoupledConfig", "run_decoupled"]


def __getattr__(name: str) -> Any:
    # lazy (PEP 562), for a real import cycle: dipaco.config imports dipaco.decoupled.config,
    # which runs this file first, and dipaco.decoupled.run imports dipaco.config
    if name == "DecoupledConfig":
        from dipaco.decoupled.config import DecoupledConfig

        return DecoupledConfig
    if name == "run_decoupled":
        from dipaco.decoupled.run import run_decoupled

        return run_decoupled
    raise AttributeError(name)
