"""Decoupled mode (``diloco.mode=decoupled``): asynchronous decoupled workers and per-module
synchronisers that meet only through a shared store.

* :mod:`~dipaco.decoupled.store`: the store (a shared directory, atomic writes);
  :mod:`~dipaco.decoupled.fsspec_store`: object stores and ``open_store``;
  :mod:`~dipaco.decoupled.lease`: path leases;
* :mod:`~dipaco.decoupled.worker`: the decoupled worker process loop, and
  :mod:`~dipaco.decoupled.scheduling` its choice of path and phase length;
* :mod:`~dipaco.decoupled.alternatives`: which of a path's updates are alternatives;
* :mod:`~dipaco.decoupled.merge`: per-module quorum, grace window, staleness and the
  merge rule on the core shared with sync mode (:mod:`dipaco.sync.module_core`);
* :mod:`~dipaco.decoupled.service`: the synchroniser process loop and the ledger;
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
