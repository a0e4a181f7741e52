"""Who steps a module: module leases, and the module state a holder reads and writes.

A module's state (the core's state in the ``outer/<module>`` layout, its version, its
ledger) is a folder of write-once revisions ``modules/<m>/<revision>.st``
(:mod:`dipaco.decoupled.versions`). Its lease ``leases/module_<m>/`` names the one
synchroniser that may step it. :class:`ModuleLeases`, a part of
:class:`dipaco.decoupled.service.SyncService`, holds a synchroniser's share:

* it renews each lease once a third of ``lease_s`` has passed, between any two pieces
  of store work (a lost one is dropped); every ``heartbeat_s`` it counts the live
  synchronisers (``syncs/<name>.json`` heartbeats younger than ``lease_s``), gives back
  its surplus over the fair share ``ceil(modules / live)`` when one joined, and takes free
  modules up to it (expired leases included: a dead synchroniser's modules are taken
  over from the state in the store);
* before writing a revision it checks its lease (lost: it writes nothing), and the
  revision is created only if absent: a writer that lost its lease between the check and
  the put finds revision n+1 written by its successor and writes nothing; if its put
  came first, the successor's fails, and the successor reloads the store's revision
  (complete and consistent: weights and ledger in one blob) and goes on from it.
  No update is applied twice (the ledger travels with the weights) or lost (an update
  file leaves the inbox only once a written revision accounts for it).
"""
from __future__ import annotations

import json
import math
import os
import socket
import time
import zlib
from collections import Counter
from typing import Any, Optional

from dipaco.config.decoupled import DecoupledConfig
from dipaco.decoupled.lease import Lease, LeaseLost
from dipaco.decoupled.merge import MergingModuleSync
from dipaco.decoupled.store import Store, encode_state
from dipaco.decoupled.versions import prune, publish, read_latest

__all__ = ["ModuleLeases", "module_folder", "module_lease", "read_module", "write_module", "live_synchronisers"]


def module_folder(module_id: str) -> str:
    """Store folder of a module's revisions (weights + optimiser + ledger, one blob each)."""
    return f"modules/{module_id}"


def module_lease(module_id: str) -> str:
    """Lease name of a module (held by the synchroniser stepping it)."""
    return f"module_{module_id}"


def read_module(store: Store, module_id: str, meta_only: bool = False) -> Optional[tuple[int, Any, dict]]:
    """``(revision, state, meta)`` of a module's newest revision (``state`` None with
    ``meta_only``: the header alone is decoded, unverified: see ``peek_meta``), or None before version 0 exists."""
    return read_latest(store, module_folder(module_id), meta_only)


def write_module(store: Store, sync: MergingModuleSync, revision: int = 0, **meta: Any) -> bool:
    """Write the module's version, weights, optimiser state and ledger as revision
    ``revision``, in ONE create-if-absent put; False (nothing written) if it exists.

    This is the idempotence hinge: an update id is in the ledger iff the weights that
    include it are the ones in the store. ``meta`` (the writer, its last step) goes in
    the header with the ledger's counts, for ``dipaco-decoupled status``.
    """
    state = sync.state_dict()
    head = {"module_id": sync.module_id, "version": sync.version, "revision": int(revision),
            "applied": len(sync.applied), "dropped": dict(Counter(sync.dropped.values())), "t": time.time(), **meta}
    return publish(store, module_folder(sync.module_id), revision, encode_state(state, head))


def live_synchronisers(store: Store, within_s: float, now: Optional[float] = None) -> dict[str, dict]:
    """The heartbeat records (``syncs/<name>.json``) of synchronisers alive within ``within_s``."""
    now = time.time() if now is None else now
    out = {}
    for name in store.list("syncs"):
        rec = store.get_json(f"syncs/{name}")
        if rec and not rec.get("ended") and now - float(rec.get("t", 0.0)) < within_s:
            out[name[:-5] if name.endswith(".json") else name] = rec
    return out


class ModuleLeases:
    """A synchroniser's module leases and the module states it loaded (see the module doc)."""

    store: Store
    cfg: DecoupledConfig
    name: str
    clock: Any
    modules: list[str]
    sharing: dict[str, list[int]]
    outer: dict[str, Any]
    sharing_rescale: bool
    leases: dict[str, Lease]
    syncs: dict[str, MergingModuleSync]
    revision: dict[str, int]
    last_step: dict[str, Optional[dict]]
    _decoded: dict[str, set[str]]
    next_balance: float
    started: float

    def _event(self, obj: dict) -> None:
        obj.setdefault("t", self.clock())
        self.store.append_line(f"events/{self.name}.jsonl", json.dumps(obj))

    def _lease_event(self, m: str, what: str, **kw: Any) -> None:
        lease = self.leases.get(m)
        self._event({"e": "lease", "module": m, "what": what, "epoch": lease.epoch if lease else None, **kw})

    def keep_alive(self) -> set[str]:
        """Renew each lease that is due (:data:`~dipaco.decoupled.lease.RENEW_SHARE` of
        ``lease_s`` since its last renewal), dropping lost ones; the modules lost. Called
        between the modules of a pass, between the files of a long intake or archive, and
        between the loads of a balance: a pass over many modules on a slow store must not
        outlast the lease (docs/decoupled.md, "Leases on a slow store"). Costs nothing
        when none is due."""
        lost = set()
        for m in list(self.leases):
            if not self.leases[m].due():
                continue
            try:
                self.leases[m].renew()
            except LeaseLost:
                self._lease_event(m, "lost")
                self._forget(m, keep_lease=False)
                lost.add(m)
        return lost

    def balance(self) -> None:
        """Renew my module leases (dropping lost ones), give back my surplus, take free
        modules up to my fair share, load what I hold, and publish my heartbeat."""
        now = time.time()
        self.keep_alive()
        live = set(live_synchronisers(self.store, self.cfg.lease_s, now)) | {self.name}
        target = math.ceil(len(self.modules) / len(live))
        if len(self.leases) > target:  # another synchroniser joined: hand over, idle modules first
            idle_first = sorted(self.leases, key=lambda m: (len(self.syncs[m].pending) if m in self.syncs else 0, m))
            for m in idle_first[: len(self.leases) - target]:
                self._lease_event(m, "release")
                self.leases[m].release()
                self._forget(m, keep_lease=False)
        if len(self.leases) < target:
            start = zlib.crc32(self.name.encode()) % max(1, len(self.modules))  # spread racing joiners
            for m in self.modules[start:] + self.modules[:start]:
                if len(self.leases) >= target:
                    break
                self.keep_alive()
                if m in self.leases or not (Lease.is_free(self.store, module_lease(m))
                                            or Lease.holder(self.store, module_lease(m)) == self.name):
                    continue
                lease = Lease(self.store, module_lease(m), self.name, self.cfg.lease_s)
                if lease.acquire(reclaim=True):
                    self.leases[m] = lease
                    self._lease_event(m, "takeover" if lease.took_over_from else "take",
                                      **({"from": lease.took_over_from} if lease.took_over_from else {}))
        for m in list(self.leases):
            if m in self.leases and m not in self.syncs:
                self._load(m)
                self.keep_alive()
        self._beat(time.time())  # not ``now``: a balance on a slow store takes a while
        self.next_balance = now + self.cfg.heartbeat_s

    def _beat(self, now: float, ended: bool = False) -> None:
        self.store.put_json(f"syncs/{self.name}.json", {
            "name": self.name, "host": socket.gethostname(), "pid": os.getpid(), "started": self.started, "t": now,
            "modules": sorted(self.leases), "ended": now if ended else None,
            "renewal_s": round(Lease.margin.worst, 3)})  # the longest renewal interval (vs lease_s)

    def _load(self, m: str) -> None:
        """Load module ``m``'s newest revision (a lease was taken, or a write was fenced)."""
        got = read_module(self.store, m)
        if got is None:
            raise RuntimeError(f"module {m}: no version 0 in {self.store} (the run's creator writes it)")
        rev, state, meta = got
        s = MergingModuleSync(m, state["global"], self.sharing[m], self.cfg, self.outer, now=self.clock(),
                              sharing_rescale=self.sharing_rescale)
        s.load_state_dict(state)
        self.syncs[m], self.revision[m], self._decoded[m] = s, rev, set()
        self.last_step[m] = meta.get("last_step")
        prune(self.store, module_folder(m), rev, everything=True)  # what a dead holder left behind

    def _forget(self, m: str, keep_lease: bool) -> None:
        self.syncs.pop(m, None)
        self.revision.pop(m, None)
        self._decoded.pop(m, None)
        if not keep_lease:
            self.leases.pop(m, None)

    def release_all(self) -> None:
        """Give every module back (a clean exit: no one waits ``lease_s`` for them)."""
        for m in list(self.leases):
            self.leases[m].release()
            self._forget(m, keep_lease=False)
        self._beat(time.time(), ended=True)

    def _publish(self, m: str) -> bool:
        """Write module ``m``'s next revision; False if I may not (lease lost) or could not
        (fenced: another writer created that revision first), the module then dropped or
        reloaded and this poll's work on it forgotten."""
        try:
            self.leases[m].check()  # lost: a successor may be writing; write nothing
        except LeaseLost:
            self._lease_event(m, "lost")
            self._forget(m, keep_lease=False)
            return False
        rev = self.revision[m] + 1
        if not write_module(self.store, self.syncs[m], rev, writer=self.name, last_step=self.last_step[m]):
            # A predecessor that had lost its lease wrote this revision between its check
            # and its put: its revision is complete and consistent; build on it instead.
            self._lease_event(m, "fenced", revision=rev)
            self._forget(m, keep_lease=True)
            self._load(m)
            return False
        self.revision[m] = rev
        prune(self.store, module_folder(m), rev)
        return True

