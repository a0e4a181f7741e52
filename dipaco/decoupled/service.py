"""The synchroniser process of decoupled mode: module leases → store inbox →
:class:`MergingModuleSync` → a new module revision, written once, *together with* its ledger.

Store keys: ``modules/<m>/<revision>.st`` (the module's state: the core's state in the
``outer/<module>`` layout + version + ledger, in write-once revisions:
:mod:`dipaco.decoupled.versions`), ``updates/<m>/`` (the inbox), ``archive/<m>/``,
``paths/path_<p>.json`` (progress), ``leases/module_<m>/`` (who steps the module),
``syncs/<name>.json`` (each synchroniser's heartbeat and modules), ``events/sync-*.jsonl``.

Any number of synchronisers, on any hosts, split the modules between them by leases
(:mod:`dipaco.decoupled.module_leases`: fair shares, takeover after ``lease_s``, and why
one that lost its lease cannot write).
"""
from __future__ import annotations

import math
import time
from typing import Any, Optional, Sequence

from dipaco.config.decoupled import DecoupledConfig
from dipaco.decoupled.lease import Lease
from dipaco.decoupled.merge import MergingModuleSync, Update
from dipaco.decoupled.module_leases import ModuleLeases
from dipaco.decoupled.store import Store, decode_state
from dipaco.decoupled.versions import read_latest
from dipaco.plan.codecs import make_codec
from dipaco.runtime.progress import say

__all__ = ["SyncService", "inbox", "archive", "progress_key", "path_steps_done", "path_finished", "path_folder",
           "read_path_state", "read_update", "wait_out_outage"]


def inbox(module_id: str) -> str:
    return f"updates/{module_id}"


def archive(module_id: str) -> str:
    return f"archive/{module_id}"


def progress_key(path_id: int) -> str:
    return f"paths/path_{path_id}.json"


def path_steps_done(prog: Optional[dict], inner_steps: int) -> int:
    """Inner steps a path has completed, from its progress file (None: not started).

    Files written before dynamic local updates hold only ``phases_done`` (phases of H).
    """
    if prog is None:
        return 0
    return int(prog.get("steps_done", int(prog.get("phases_done", 0)) * inner_steps))


def path_finished(prog: Optional[dict], rounds: int, inner_steps: int) -> bool:
    """Whether a path has its whole budget of ``rounds × inner_steps`` inner steps."""
    return path_steps_done(prog, inner_steps) >= rounds * inner_steps


def path_folder(path_id: int) -> str:
    """Store folder of a path's state revisions (revision k: after k phases)."""
    return f"paths/path_{path_id}"


def read_path_state(store: Store, path_id: int) -> Optional[tuple[int, Any, dict]]:
    """``(revision, state, meta)`` of a path's newest state, or None before its first phase."""
    return read_latest(store, path_folder(path_id))


def wait_out_outage(who: str, e: OSError, backoff: float, cfg: DecoupledConfig) -> float:
    """A role's store failed: say so (once per outage), sleep the next backoff (doubling
    from 0.25 s up to half a lease) and return it; the caller retries and resets it."""
    if not backoff:
        say(f"{who}: the store failed ({type(e).__name__}: {' '.join(str(e).split())[:120]}); retrying with backoff")
    backoff = min(max(2 * backoff, 0.25), max(cfg.heartbeat_s, cfg.lease_s / 2))
    time.sleep(backoff)
    return backoff


def read_update(blob: bytes) -> Update:
    """Decode an update file pushed by a worker (codec named in its header).

    Files of this version carry the contribution α·Δ (``weighted``); older ones carry Δ.
    """
    state, meta = decode_state(blob)
    codec = make_codec(meta["codec"], **meta.get("codec_kw", {}))
    delta = codec.decode(tuple(state["payload"]), int(meta["numel"]))
    return Update(update_id=meta["update_id"], module_id=meta["module_id"], path_id=int(meta["path_id"]),
                  phase=int(meta["phase"]), base_version=int(meta["base_version"]),
                  tokens=float(meta["tokens"]), delta=delta, inner_steps=int(meta.get("inner_steps", 0)),
                  weighted=bool(meta.get("weighted", False)), phase_s=meta.get("phase_s"))


class SyncService(ModuleLeases):
    """The loop of one synchroniser process: module leases → inbox → :class:`MergingModuleSync` → store.

    Args:
        store: the shared store.
        module_ids: every module of the run; this process steps those it holds a lease on
            (its fair share, see the module doc).
        sharing: module id → paths that contain it.
        rounds, inner_steps: a path is done at ``rounds × inner_steps`` inner steps.
        cfg, outer, sharing_rescale: see :class:`MergingModuleSync` (``cfg.lease_s`` and
            ``cfg.heartbeat_s`` time the module leases).
        name: this process's name: its lease owner, heartbeat and event log. Unique among
            live synchronisers; a restart under the same name takes its leases back at once.
    """

    def __init__(self, store: Store, module_ids: Sequence[str], sharing: dict[str, list[int]], rounds: int,
                 cfg: DecoupledConfig, outer: dict[str, Any], name: str = "sync-0",
                 clock: Any = None, *, inner_steps: int, sharing_rescale: bool = False) -> None:
        self.store = store
        self.cfg = cfg
        self.rounds = int(rounds)
        self.inner_steps = int(inner_steps)
        self.name = name
        self.clock = clock or time.time
        self.outer, self.sharing_rescale = outer, sharing_rescale
        self.modules = list(module_ids)
        self.sharing = {m: list(sharing[m]) for m in module_ids}
        self.paths = sorted({p for ps in self.sharing.values() for p in ps})
        self.leases: dict[str, Lease] = {}  # the modules this process holds
        self.syncs: dict[str, MergingModuleSync] = {}  # ... and has loaded from the store
        self.revision: dict[str, int] = {}  # the revision each loaded module was read or written at
        self.last_step: dict[str, Optional[dict]] = {}
        self._decoded: dict[str, set[str]] = {}  # per module: inbox files already offered
        self.next_balance = -math.inf
        self._next_drain_check = -math.inf
        self._next_done_check = -math.inf
        self._done: set[int] = set()  # paths known to have their budget (it only grows)
        self.started = time.time()

    # ----------------------------------------------------------------- merge
    def paths_done(self) -> set[int]:
        """The paths that have their budget, read at most every ``heartbeat_s`` (one
        progress file per path not yet known done: a finished path stays finished).

        Read before an intake, a path seen done has written its last updates: the
        intake after it sees them all (the drain's guarantee). A path that finished since
        the last read is seen up to ``heartbeat_s`` late: its modules' quorum cap and
        flush wait that much longer, where reading every file on every poll made most of a
        synchroniser's requests to an object store."""
        if time.time() >= self._next_done_check:
            self._next_done_check = time.time() + self.cfg.heartbeat_s
            for p in self.paths:
                if p not in self._done and path_finished(self.store.get_json(progress_key(p)), self.rounds,
                                                         self.inner_steps):
                    self._done.add(p)
        return set(self._done)

    def _intake(self, m: str, events: list[dict], names: Optional[list[str]] = None) -> bool:
        """Offer every new inbox file of module ``m`` (``names``: its inbox as listed;
        None: list it now); True if the ledger changed."""
        s, seen, changed = self.syncs[m], self._decoded[m], False
        for name in self.store.list(inbox(m)) if names is None else names:
            if not name.endswith(".st") or name in seen:
                continue
            if s.seen(name[:-3]):  # accounted for, not archived yet (a crash, a new holder): no read
                seen.add(name)
                continue
            if m in self.keep_alive():  # a long inbox on a slow store: leases first
                return False
            blob = self.store.get(f"{inbox(m)}/{name}")
            if blob is None:  # archived by a previous holder between list and get
                continue
            try:
                u = read_update(blob)
            except Exception as e:  # a corrupt blob must not kill the synchroniser
                u = None
                events.append({"e": "drop", "module": m, "id": name[:-3], "reason": "corrupt",
                               "error": str(e)[:200]})
                s.dropped[name[:-3]] = "corrupt"
                changed = True
            seen.add(name)
            if u is None:
                continue
            why = s.offer(u, self.clock())
            if why is None:
                events.append({"e": "arrive", "module": m, "id": u.update_id, "path": u.path_id,
                               "phase": u.phase, "base": u.base_version, "version": s.version})
            elif why != "seen":
                changed = True
                events.append({"e": "drop", "module": m, "id": u.update_id, "reason": why,
                               "path": u.path_id, "phase": u.phase})
        return changed

    def _archive(self, m: str, names: list[str]) -> None:
        """Move accounted-for inbox files (of ``names``, the inbox as listed) out, AFTER
        the version holding them is written."""
        for name in names:
            s = self.syncs.get(m)
            uid = name[:-3] if name.endswith(".st") else name
            if s is not None and (uid in s.applied or uid in s.dropped):
                if m in self.keep_alive():  # the rest is archived by the module's next holder
                    return
                if self.cfg.keep_archive:
                    self.store.move(f"{inbox(m)}/{name}", f"{archive(m)}/{name}")
                else:
                    self.store.delete(f"{inbox(m)}/{name}")
                self._decoded[m].discard(name)

    def poll_once(self, done: Optional[set[int]] = None) -> int:
        """One pass over the modules I hold: intake, step and write each, then archive
        what the written versions account for (bookkeeping after every module's step: on
        a slow store it is most of a pass's requests); leases balanced every
        ``heartbeat_s``, and each renewed when due between modules. Returns the number of
        outer steps taken."""
        if time.time() >= self.next_balance:
            self.balance()
        steps = 0
        accounted: dict[str, list[str]] = {}
        for m in list(self.syncs):
            self.keep_alive()  # renewed between modules, not once a pass: a pass may outlast the lease
            if m not in self.syncs:
                continue
            s = self.syncs[m]
            events: list[dict] = []
            names = self.store.list(inbox(m))
            changed = self._intake(m, events, names)
            if m not in self.syncs:  # lost during a long intake: its successor re-reads the inbox
                continue
            now = self.clock()
            trigger = s.due(now, done)
            # every sharing path finished: nothing more can arrive, step at once
            if trigger is None and s.pending and done is not None and set(s.sharing_paths) <= done:
                trigger = "flush"
            rec = None
            if trigger is not None:
                before = set(s.dropped)
                rec = s.step(now, trigger)
                for uid in sorted(set(s.dropped) - before):
                    events.append({"e": "drop", "module": m, "id": uid, "reason": s.dropped[uid]})
                changed = True
                if rec is not None:
                    self.last_step[m] = {"trigger": rec.trigger, "t": rec.time, "version": rec.version}
                    events.append({"e": "step", **rec.to_dict()})
            # Order matters: (1) the version + ledger, in one write-once put (nothing else
            # happened if it is refused); (2) the event log (a crash here loses log lines,
            # never weights: the ledger is the truth); (3) archiving the inbox files the
            # ledger now accounts for (a crash before it leaves files a successor finds in
            # the ledger, "seen").
            if changed and not self._publish(m):
                continue
            steps += rec is not None
            for ev in events:
                self._event(ev)
            if any(n[:-3] in s.applied or n[:-3] in s.dropped for n in names if n.endswith(".st")):
                accounted[m] = names
        for m, names in accounted.items():
            self._archive(m, names)
        return steps

    def _inboxes_empty(self) -> bool:
        """Every module's inbox drained (read at most every ``heartbeat_s``: one listing per module)."""
        if time.time() < self._next_drain_check:
            return False
        self._next_drain_check = time.time() + self.cfg.heartbeat_s
        return not any(n.endswith(".st") for m in self.modules for n in self.store.list(inbox(m)))

    def run(self) -> None:
        """Serve until every path has finished its budget and every module's inbox is
        drained (whoever holds it: a synchroniser that stayed takes over a dead one's);
        a store that fails is retried with backoff, reloading what I hold."""
        backoff = 0.0
        while True:
            try:
                done = self.paths_done()
                all_done = len(done) == len(self.paths)
                # A path is marked done only AFTER its last update files were written, so an
                # intake after seeing "all done" is guaranteed to see every last update.
                self.poll_once(done)
                if all_done:
                    self.poll_once(done)  # flush whatever the last intake left pending
                    if all(not s.pending for s in self.syncs.values()) and self._inboxes_empty():
                        break
                # event logs on object stores are buffered chunks: publish this poll's lines
                # (step/drop events) before sleeping, so a crash loses at most one poll's worth
                self.store.flush()
                if backoff:
                    say(f"{self.name}: the store answers again; reloading my modules")
                backoff = 0.0
                time.sleep(self.cfg.poll_s)
            except OSError as e:
                backoff = self._outage(e, backoff)
        versions = {m: s.version for m, s in self.syncs.items()}
        self.release_all()
        self.store.flush()
        self.store.put_json(f"done/{self.name}.json", {"t": self.clock(), "versions": versions})

    def _outage(self, e: OSError, backoff: float) -> float:
        """The store failed: forget every loaded module (a write may or may not have
        landed), keep the leases (renewed, or found lost, at the next balance), wait."""
        for m in list(self.syncs):
            self._forget(m, keep_lease=True)
        self.next_balance = -math.inf
        return wait_out_outage(self.name, e, backoff, self.cfg)
