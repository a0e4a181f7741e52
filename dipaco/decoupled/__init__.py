"""Decoupled mode (``diloco.mode=decoupled``): asynchronous decoupled workers and per-module
synchronisers that meet only through a shared store.

* :mod:`~dipaco.decoupled.store`: the store (a shared directory, atomic writes);
  :mod:`~dipaco.decoupled.fsspec_store`: object stores and ``open_store``;
  :mod:`~dipaco.decoupled.lease`: path and module leases;
  :mod:`~dipaco.decoupled.versions`: write-once revisions (module and path states);
  :mod:`~dipaco.decoupled.owner`: whose store it is, the run record, joining a run;
* :mod:`~dipaco.decoupled.worker`: the decoupled worker process loop, and
  :mod:`~dipaco.decoupled.scheduling` its choice of path and phase length;
* :mod:`~dipaco.decoupled.alternatives`: which of a path's updates are alternatives;
* :mod:`~dipaco.decoupled.merge`: per-module quorum, grace window, staleness and the
  merge rule on the core shared with sync mode (:mod:`dipaco.sync.module_core`);
* :mod:`~dipaco.decoupled.service`: the synchroniser process loop and the ledger;
  :mod:`~dipaco.decoupled.module_leases`: which synchroniser steps which module;
* :mod:`~dipaco.decoupled.supervisor`: one host's processes (the run's creator, or a host
  that joined it); :mod:`~dipaco.decoupled.run`: ``run_decoupled(cfg, run)`` and the finish;
* :mod:`~dipaco.decoupled.metrics`: goodput, staleness, version rates, drops, ledger check.

See docs/decoupled.md.
"""
from __future__ import annotations

from typing import Any

__all__ = ["run_decoupled"]


def __getattr__(name: str) -> Any:
    # lazy (PEP 562): `python -m dipaco.decoupled worker ...` and the store tools import this
    # package without paying for the supervisor's imports (torch, the grid, the rounds' records)
    if name == "run_decoupled":
        from dipaco.decoupled.run import run_decoupled

        return run_decoupled
    raise AttributeError(name)
