"""The processes of one decoupled run on this host (:class:`Supervisor`): N decoupled
worker slots and S synchronisers, started with :mod:`dipaco.runtime.process_start` (fork
is unsafe after torch/faiss started OpenMP threads: docs/design.md, "Processes"), watched
until the run stalls (or a set ``timeout_s``), dead ones restarted (and, in chaos runs, some killed on purpose
with SIGKILL) until every path has its budget or a stop signal.

The same supervisor serves every host of a run: the run's creator (``dipaco-train``,
which also starts the run's clock and finishes it) and each host that joins
(``dipaco-decoupled worker|sync``). Worker slots are numbered across the run (``slots/``,
each number created once), synchronisers are named after their host and supervisor, and
the host publishes what it runs under ``hosts/`` every ``heartbeat_s``
(``dipaco-decoupled status`` reads it).
"""
from __future__ import annotations

import dataclasses
import json
import math
import multiprocessing as mp
import os
import random
import signal
import socket
import sys
import time
from typing import Any, Optional

import torch
from omegaconf import OmegaConf

from dipaco.config import Config, to_config
from dipaco.config.decoupled import DecoupledConfig
from dipaco.decoupled.fsspec_store import open_store
from dipaco.decoupled.lease import Lease
from dipaco.decoupled.owner import RUN_KEY, JoinRefused, check_role
from dipaco.decoupled.service import SyncService, path_steps_done, progress_key
from dipaco.decoupled.store import Store, encode_json
from dipaco.decoupled.worker import DecoupledWorker
from dipaco.run.run_dir import RunDir
from dipaco.runtime import faults, process_start
from dipaco.runtime.device import choose_device
from dipaco.runtime.launch import StopSignals

__all__ = ["DecoupledError", "StallWatch", "Supervisor", "sync_main", "worker_main", "run_config_dict", "REFUSED_EXIT"]

REFUSED_EXIT = 3  # a started role refused to join (another config or dipaco): not restarted


class DecoupledError(RuntimeError):
    """The decoupled phase could not finish (timeout, too many restarts)."""


def run_config_dict(cfg: Config, dcfg: DecoupledConfig) -> dict:
    """The run's config as a plain dict, with the decoupled settings it runs with: what
    the store records (``run.json``) and every started role receives."""
    out = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    out["diloco"]["decoupled"] = dataclasses.asdict(dcfg)
    return out


def _role_store(store_url: str, cfg_dict: dict) -> Store:
    """A started role's store, after checking that it is this run's (else exit
    :data:`REFUSED_EXIT` with one line: the supervisor does not restart it)."""
    store = faults.store_outage(open_store(store_url))  # DIPACO_FAULT store_error (none in real runs)
    try:
        check_role(store.get_json(RUN_KEY) or {}, store_url, cfg_dict)
    except JoinRefused as e:
        print(f"dipaco: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(REFUSED_EXIT) from None
    return store


def sync_main(store_url: str, cfg_dict: dict, plan: dict, outer: dict, name: str,
              handover: Optional[process_start.Handover] = None) -> None:
    """Entry point of a started synchroniser process (``handover``: :func:`process_start.enter`)."""
    process_start.enter(handover)
    torch.set_num_threads(1)
    store = _role_store(store_url, cfg_dict)
    dcfg = DecoupledConfig(**cfg_dict["diloco"]["decoupled"])
    SyncService(store, plan["module_ids"], plan["sharing"], plan["rounds"], dcfg, outer, name=name,
                inner_steps=plan["inner_steps"], sharing_rescale=bool(cfg_dict["diloco"]["sharing_rescale"])).run()


def worker_main(cfg_dict: dict, run_dir: str, store_url: str, index: int, incarnation: int,
                handover: Optional[process_start.Handover] = None, device: Optional[str] = None,
                local_index: int = 0, wait_start: bool = True) -> None:
    """Entry point of a started decoupled worker process (``handover``: :func:`process_start.enter`).

    ``device``: ``auto``/``cuda``/``cpu`` for the ``local_index``-th worker of this host
    (GPU ``local_index % GPUs``); None: ``trainer.device``'s placement.
    """
    process_start.enter(handover)
    torch.set_num_threads(1)  # several workers share the host's cores
    store = _role_store(store_url, cfg_dict)
    cfg = to_config(cfg_dict)
    dcfg = DecoupledConfig(**cfg_dict["diloco"]["decoupled"])
    where = None if device is None else choose_device(device, local_rank=local_index)
    DecoupledWorker(cfg, RunDir.at(run_dir), store, index, incarnation, dcfg, where, wait_start).serve()


def allocate_slots(store: Store, n: int, host: str) -> list[int]:
    """``n`` worker slot numbers of the run, the lowest free ones (``slots/<i>.json``,
    created once: two hosts never get the same number)."""
    out: list[int] = []
    taken = {int(name[:6]) for name in store.list("slots") if name[:6].isdigit()}
    i = 0
    while len(out) < n:
        if i not in taken and store.put_new(f"slots/{i:06d}.json",
                                            encode_json({"host": host, "t": time.time()})):
            out.append(i)
        i += 1
    return out


class _Slot:
    """One decoupled worker slot: its current process and how often it was started."""

    def __init__(self, index: int, local: int) -> None:
        self.index, self.local = index, local
        self.incarnation = -1
        self.proc: Optional[mp.process.BaseProcess] = None
        self.finished = False


class StallWatch:
    """When a decoupled run has stopped making progress; :meth:`check` says so.

    A decoupled run lasts what its budget takes: minutes on this machine's smoke runs, days
    for a large model. A wall-clock limit fit for one would kill the other, so none is set by
    default (``diloco.decoupled.timeout_s``, null). What stops a run that no longer advances
    (every worker stuck in a hung device call, a store that answers but never lets a write
    land) is measured from the run itself:

    * **progress** is a path's committed inner steps (its progress file in the store);
    * the run's **pace** is the longest any path has taken to advance, over the advances
      seen whole: from the watch's start to the first commit of a path that had none (start-up
      and a first phase included), and between two commits of a path (a phase with its pulls,
      pushes, waits and takeovers). A host that joins a run under way measures no pace from
      a path until it has seen that path commit twice;
    * the run has **stalled** when no path advanced for ``stall_phases`` × the pace (at
      least ``stall_phases`` × ``lease_s``: a dead worker's path is taken over after a lease).

    Before a pace is known there is no stall: start-up takes what it takes
    (a first phase of a large model on a slow store can take an hour); ``timeout_s`` bounds
    it when set. The progress files are read once per ``max(heartbeat_s, pace / 4)``:
    one small read per path about four times per phase, whatever the run's scale.
    """

    def __init__(self, store: Store, num_paths: int, inner_steps: int, stall_phases: float, lease_s: float,
                 heartbeat_s: float, now: Optional[float] = None) -> None:
        self.store, self.paths, self.inner_steps = store, range(num_paths), inner_steps
        self.stall_phases, self.lease_s, self.heartbeat_s = stall_phases, lease_s, heartbeat_s
        self.started = time.time() if now is None else now
        self.steps: Optional[dict[int, int]] = None  # per path: its committed steps when last read
        self.advanced: dict[int, float] = {}  # per path: when it last advanced, where known
        self.last_advance = self.started  # when any path last advanced (or the watch started)
        self.pace = 0.0  # the longest whole advance seen; 0 until one was
        self.next_read = self.started

    def window(self) -> Optional[float]:
        """Seconds without progress that count as a stall (None before a pace is known)."""
        return self.stall_phases * max(self.pace, self.lease_s) if self.pace > 0 else None

    def observe(self, now: float) -> None:
        """Read every path's committed steps; note who advanced and the pace."""
        seen = {p: path_steps_done(self.store.get_json(progress_key(p)), self.inner_steps) for p in self.paths}
        if self.steps is None:  # the baseline: a path with no commit yet is seen whole from here
            self.steps = seen
            self.advanced = {p: self.started for p, s in seen.items() if s == 0}
            return
        for p, steps in seen.items():
            if steps > self.steps[p]:
                if p in self.advanced:
                    self.pace = max(self.pace, now - self.advanced[p])
                self.advanced[p] = self.last_advance = now
                self.steps[p] = steps

    def check(self, now: Optional[float] = None) -> Optional[str]:
        """None while the run advances; else one line saying how long it has not (the
        caller stops the run). Reads the store at most once per its read interval; a
        failing store is read again at the next interval (a store outage longer than the
        window is a stall too)."""
        now = time.time() if now is None else now
        if now < self.next_read:
            return None
        self.next_read = now + max(self.heartbeat_s, self.pace / 4)
        try:
            self.observe(now)
        except OSError:
            pass
        window = self.window()
        if window is None or now - self.last_advance <= window:
            return None
        return (f"the run made no progress for {now - self.last_advance:.0f}s (no path committed a phase; "
                f"diloco.decoupled.stall_phases={self.stall_phases:g} x its slowest advance so far, "
                f"{max(self.pace, self.lease_s):.1f}s): every path is stuck; the store keeps every committed "
                "phase (dipaco-decoupled status says who held what)")


class Supervisor:
    """Start, watch and stop one host's processes of a decoupled run: :meth:`start`, then :meth:`watch`.

    Args:
        cfg, run: the run's config and directory (its prepared data: tokenizer, shards).
        store, store_url: the run's store (the processes open ``store_url`` themselves).
        plan: the store's plan (:func:`dipaco.decoupled.run.init_store`).
        dcfg: decoupled settings; ``outer``: the synchronisers' outer optimiser settings.
        n_workers: decoupled worker slots on this host.
        n_syncs: synchronisers on this host (default ``dcfg.sync_procs``).
        role: what this host is, for ``status`` (``train``: the run's creator, which starts
            the run's clock: its first workers wait for each other; others never wait).
        device: the workers' device (``auto``/``cuda``/``cpu``; None: ``trainer.device``).
    """

    def __init__(self, cfg: Config, run: RunDir, store: Store, store_url: str, plan: dict[str, Any],
                 dcfg: DecoupledConfig, outer: dict[str, Any], n_workers: int, *, n_syncs: Optional[int] = None,
                 role: str = "train", device: Optional[str] = None) -> None:
        self.cfg, self.run, self.store_url, self.plan = cfg, run, store_url, plan
        self.store = faults.store_outage(store)
        self.dcfg, self.outer, self.n_workers, self.role, self.device = dcfg, outer, n_workers, role, device
        self.creator = role == "train"
        self.cfg_dict = run_config_dict(cfg, dcfg)
        self.ctx = process_start.context()
        self.host = f"{socket.gethostname()}-{os.getpid()}"
        n = dcfg.sync_procs if n_syncs is None else n_syncs
        self.sync_names = [f"sync-{self.host}-{i}" for i in range(min(n, len(plan["module_ids"])))]
        self.syncs: list[mp.process.BaseProcess] = []
        self.slots: list[_Slot] = []
        self.kills = self.restarts = 0
        self.started_at = time.time()
        self.next_beat = 0.0
        self.chaos = faults.worker_chaos()  # DIPACO_FAULT worker_kill (none in real runs)
        self.rng = random.Random(self.chaos.seed)
        # the chaos clock starts once training does (the first path progress file): kills
        # during interpreter start-up would test nothing but process spawning
        self.next_kill = math.inf
        self.chaos_armed = not self.chaos.kill_every_s or self.chaos.max_kills <= 0
        self.started = not self.creator  # the start line: only the creator draws it

    @property
    def nsync(self) -> int:
        return len(self.sync_names)

    def event(self, obj: dict) -> None:
        """One line of ``events/supervisor-<host>.jsonl`` (a failing store: dropped)."""
        obj.setdefault("t", time.time())
        try:
            self.store.append_line(f"events/supervisor-{self.host}.jsonl", json.dumps(obj))
            self.store.flush()  # rare events; on object stores, publish each at once
        except OSError:
            pass

    def _start_sync(self, i: int) -> mp.process.BaseProcess:
        self.store.delete(f"done/{self.sync_names[i]}.json")
        proc = self.ctx.Process(target=sync_main, name=f"dipaco-sync-{i}",
                                args=(self.store_url, self.cfg_dict, self.plan, self.outer, self.sync_names[i]),
                                kwargs={"handover": process_start.handover()})
        proc.start()
        return proc

    def _start_worker(self, slot: _Slot) -> None:
        slot.incarnation += 1
        slot.proc = self.ctx.Process(target=worker_main, name=f"dipaco-worker-{slot.index}",
                                     args=(self.cfg_dict, str(self.run.root), self.store_url, slot.index,
                                           slot.incarnation),
                                     kwargs={"handover": process_start.handover(), "device": self.device,
                                             "local_index": slot.local, "wait_start": self.creator})
        slot.proc.start()
        self.event({"e": "start", "slot": slot.index, "incarnation": slot.incarnation, "pid": slot.proc.pid})

    def start(self) -> None:
        """This host's record, the synchronisers, then every worker slot."""
        indices = allocate_slots(self.store, self.n_workers, self.host)
        self.slots = [_Slot(i, k) for k, i in enumerate(indices)]
        self._beat(time.time())
        self.syncs = [self._start_sync(i) for i in range(self.nsync)]
        for s in self.slots:
            self._start_worker(s)

    def _beat(self, now: float, ended: bool = False) -> None:
        """This host's record (``hosts/<host>.json``): what it runs, and a heartbeat."""
        workers = [{"slot": s.index, "incarnation": s.incarnation, "pid": s.proc.pid if s.proc else None,
                    "finished": s.finished, "alive": bool(s.proc is not None and s.proc.is_alive())}
                   for s in self.slots]
        try:
            self.store.put_json(f"hosts/{self.host}.json", {
                "host": socket.gethostname(), "pid": os.getpid(), "role": self.role, "started": self.started_at,
                "t": now, "ended": now if ended else None, "workers": workers, "syncs": self.sync_names})
        except OSError:
            pass  # a failing store: the next beat tells
        self.next_beat = now + self.dcfg.heartbeat_s

    def watch(self) -> Optional[str]:
        """Watch until every worker and synchroniser finished (None) or a stop signal came
        (its name: the store keeps every finished phase); every process ends here. Raises
        :class:`DecoupledError` when the run stalls (:class:`StallWatch`) or
        this host's share outlasts ``timeout_s`` (when set)."""
        t0 = time.time()
        deadline = t0 + self.dcfg.timeout_s if self.dcfg.timeout_s is not None else math.inf
        stall = StallWatch(self.store, self.plan["num_paths"], self.plan["inner_steps"], self.dcfg.stall_phases,
                           self.dcfg.lease_s, self.dcfg.heartbeat_s, t0)
        try:
            while True:
                now = time.time()
                if StopSignals.received:  # the one stop contract: end now, keep the last complete phase
                    self.event({"e": "stop", "signal": StopSignals.received})
                    return StopSignals.received
                if now > deadline:
                    raise DecoupledError(f"decoupled phase exceeded diloco.decoupled.timeout_s={self.dcfg.timeout_s}s")
                try:
                    if not self.started and len(self.store.list("control")) >= self.n_workers:
                        self.store.put_json("control/start", {"t": now})  # every first worker is built: go
                        self.started = True
                    self._chaos_kill(now)
                except OSError:
                    pass  # the store is failing: the roles back off; supervision goes on
                self._reap_workers()
                self._reap_syncs()
                if now >= self.next_beat:
                    self._beat(now)
                if self._done():
                    return None
                stalled = stall.check(now)
                if stalled:
                    raise DecoupledError(stalled)
                time.sleep(0.05)
        finally:
            for proc in [s.proc for s in self.slots if s.proc is not None] + self.syncs:
                if proc.is_alive():
                    proc.kill()
                proc.join(timeout=10)
            self._beat(time.time(), ended=True)

    def _chaos_kill(self, now: float) -> None:
        """Chaos: SIGKILL a random live worker (no clean-up runs in it: the point)."""
        if not self.chaos_armed and self.store.list("paths"):
            self.chaos_armed = True
            self.next_kill = now + self.chaos.kill_every_s * self.rng.uniform(0.5, 1.5)
        if now < self.next_kill or self.kills >= self.chaos.max_kills:
            return
        alive = [s for s in self.slots if s.proc is not None and s.proc.is_alive() and not s.finished]
        # prefer a worker in the middle of a phase (holding a path lease): killing
        # one that is starting up or idle tests little
        holders = {Lease.holder(self.store, f"path_{p}") for p in range(self.plan["num_paths"])}
        busy = [s for s in alive if any(h and h.startswith(f"W{s.index}.{s.incarnation}-") for h in holders)]
        if alive:
            victim = self.rng.choice(busy or alive)
            os.kill(victim.proc.pid, signal.SIGKILL)
            self.kills += 1
            self.event({"e": "kill", "slot": victim.index, "incarnation": victim.incarnation,
                        "pid": victim.proc.pid})
        self.next_kill = now + self.chaos.kill_every_s * self.rng.uniform(0.5, 1.5)

    def _reap_workers(self) -> None:
        """A worker that exited: finished (0), refused (not restarted), or dead: restarted
        within the budget, else abandoned (the others take its paths after the lease expires)."""
        for s in self.slots:
            if s.finished or s.proc is None or s.proc.is_alive():
                continue
            code = s.proc.exitcode
            s.proc.join()
            if code == 0:
                s.finished = True
                continue
            if code == REFUSED_EXIT:
                raise DecoupledError(f"decoupled worker {s.index} refused to join the run (its line is above)")
            self.event({"e": "died", "slot": s.index, "incarnation": s.incarnation, "exitcode": code})
            if not self.dcfg.restart_dead or self.restarts >= self.dcfg.max_restarts:
                s.proc = None
                continue
            self.restarts += 1
            self._start_worker(s)

    def _reap_syncs(self) -> None:
        """A synchroniser that died is restarted under its name (it takes its leases back
        at once) within the budget, else the run fails."""
        for i, proc in enumerate(self.syncs):
            if not proc.is_alive() and proc.exitcode != 0:
                self.event({"e": "sync_died", "index": i, "exitcode": proc.exitcode})
                if proc.exitcode == REFUSED_EXIT or self.restarts >= self.dcfg.max_restarts:
                    raise DecoupledError(f"synchroniser {i} died with exit code {proc.exitcode}")
                self.restarts += 1
                self.syncs[i] = self._start_sync(i)

    def _done(self) -> bool:
        workers_done = all(s.finished or s.proc is None for s in self.slots)
        if self.slots and workers_done and not any(s.finished for s in self.slots):
            raise DecoupledError("every decoupled worker slot was abandoned after repeated failures")
        return workers_done and all(not p.is_alive() and p.exitcode == 0 for p in self.syncs)
