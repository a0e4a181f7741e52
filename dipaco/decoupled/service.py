"""The synchroniser process of decoupled mode: store inbox → :class:`MergingModuleSync`
→ a new module version written atomically *together with* its ledger.

Store keys: ``modules/<m>.st`` (the module's version: the core's state in the
``outer/<module>`` layout + version + ledger), ``updates/<m>/`` (the inbox),
``archive/<m>/``, ``paths/path_<p>.json`` (progress), ``events/sync-*.jsonl``.
"""
from __future__ import annotations

import json
import time
from typing import Any, Optional, Sequence

from dipaco.config.decoupled import DecoupledConfig
from dipaco.decoupled.merge import MergingModuleSync, Update
from dipaco.decoupled.store import Store, decode_state
from dipaco.plan.codecs import make_codec

__all__ = ["SyncService", "module_key", "inbox", "archive", "progress_key", "path_steps_done", "path_finished",
           "write_module", "read_update"]



def module_key(module_id: str) -> str:
    """Store key of a module's current version (weights + optimiser + ledger, one blob)."""
    return f"modules/{module_id}.st"


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


def write_module(store: Store, sync: MergingModuleSync) -> int:
    """Write the module's version, weights, optimiser state and ledger in ONE atomic put.

    This is the idempotence hinge: an update id is in the ledger iff the weights that
    include it are the ones on disk. Return the blob size.
    """
    state = sync.state_dict()
    return store.put_state(module_key(sync.module_id), state,
                           meta={"module_id": sync.module_id, "version": sync.version})


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


class SyncService:
    """The loop of one synchroniser process: inbox → :class:`MergingModuleSync` → store.

    Args:
        store: the shared store.
        module_ids: the modules this process synchronises (each module has exactly one
            synchroniser: two would race on its version file).
        sharing: module id → paths that contain it.
        rounds, inner_steps: a path is done at ``rounds × inner_steps`` inner steps.
        cfg, outer, sharing_rescale: see :class:`MergingModuleSync`.
        name: this process's name in event logs.
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
        self.sharing = {m: list(sharing[m]) for m in module_ids}
        self.syncs: dict[str, MergingModuleSync] = {}
        now = self.clock()
        for m in module_ids:
            got = store.get_state(module_key(m))
            if got is None:
                raise RuntimeError(f"module {m}: no initial version in {store} (the supervisor writes version 0)")
            state, _ = got
            s = MergingModuleSync(m, state["global"], self.sharing[m], cfg, outer, now=now,
                                   sharing_rescale=sharing_rescale)
            s.load_state_dict(state)
            self.syncs[m] = s
        self._decoded: set[str] = set()  # inbox files already offered (pending or accounted)

    def _event(self, obj: dict) -> None:
        obj.setdefault("t", self.clock())
        self.store.append_line(f"events/{self.name}.jsonl", json.dumps(obj))

    def paths_done(self) -> set[int]:
        done = set()
        for p in {p for ps in self.sharing.values() for p in ps}:
            prog = self.store.get_json(progress_key(p))
            if path_finished(prog, self.rounds, self.inner_steps):
                done.add(p)
        return done

    def _intake(self, m: str, events: list[dict]) -> bool:
        """Offer every new inbox file of module ``m``; True if the ledger changed."""
        s, changed = self.syncs[m], False
        for name in self.store.list(inbox(m)):
            if not name.endswith(".st") or name in self._decoded:
                continue
            blob = self.store.get(f"{inbox(m)}/{name}")
            if blob is None:  # archived by a previous incarnation between list and get
                continue
            try:
                u = read_update(blob)
            except Exception as e:  # a corrupt blob must not kill the synchroniser
                u = None
                events.append({"e": "drop", "module": m, "id": name[:-3], "reason": "corrupt",
                               "error": str(e)[:200]})
                s.dropped[name[:-3]] = "corrupt"
                changed = True
            self._decoded.add(name)
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

    def _archive(self, m: str) -> None:
        """Move accounted-for inbox files out (AFTER the version holding them is written)."""
        s = self.syncs[m]
        for name in self.store.list(inbox(m)):
            uid = name[:-3] if name.endswith(".st") else name
            if uid in s.applied or uid in s.dropped:
                if self.cfg.keep_archive:
                    self.store.move(f"{inbox(m)}/{name}", f"{archive(m)}/{name}")
                else:
                    self.store.delete(f"{inbox(m)}/{name}")
                self._decoded.discard(name)

    def poll_once(self, done: Optional[set[int]] = None) -> int:
        """One pass over this process's modules; return the number of outer steps taken."""
        steps = 0
        for m, s in self.syncs.items():
            events: list[dict] = []
            changed = self._intake(m, events)
            now = self.clock()
            trigger = s.due(now, done)
            # every sharing path finished: nothing more can arrive, step at once
            if trigger is None and s.pending and done is not None and set(s.sharing_paths) <= done:
                trigger = "flush"
            if trigger is not None:
                before = set(s.dropped)
                rec = s.step(now, trigger)
                for uid in sorted(set(s.dropped) - before):
                    events.append({"e": "drop", "module": m, "id": uid, "reason": s.dropped[uid]})
                changed = True
                if rec is not None:
                    steps += 1
                    events.append({"e": "step", **rec.to_dict()})
            if changed:
                # Order matters: (1) the version + ledger, in one atomic put; (2) the event
                # log (a crash here loses log lines, never weights: the ledger is the
                # truth); (3) archiving the inbox files the ledger now accounts for (a
                # crash before it leaves files that a restart finds in the ledger, "seen").
                write_module(self.store, s)
            for ev in events:
                self._event(ev)
            if changed:
                self._archive(m)
        return steps

    def run(self) -> None:
        """Serve until every path has finished its budget and every inbox is drained."""
        while True:
            done = self.paths_done()
            all_done = len(done) == len({p for ps in self.sharing.values() for p in ps})
            # A path is marked done only AFTER its last update files were written, so an
            # intake after seeing "all done" is guaranteed to see every last update.
            self.poll_once(done)
            if all_done:
                self.poll_once(done)  # flush whatever the last intake left pending
                if all(not s.pending for s in self.syncs.values()):
                    break
            # event logs on object stores are buffered chunks: publish this poll's lines
            # (step/drop events) before sleeping, so a crash loses at most one poll's worth
            self.store.flush()
            time.sleep(self.cfg.poll_s)
        self.store.flush()
        self.store.put_json(f"done/{self.name}.json", {"t": self.clock(),
                                                       "versions": {m: s.version for m, s in self.syncs.items()}})
