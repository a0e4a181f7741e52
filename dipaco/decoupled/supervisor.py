"""The processes of one decoupled run on this host (:class:`Supervisor`): the
synchroniser process(es) and N decoupled worker slots, started with ``multiprocessing``
spawn (fork is unsafe after torch/faiss started OpenMP threads: docs/design.md,
"Processes"), watched with a bounded timeout, dead ones restarted (and, in chaos runs,
some killed on purpose with SIGKILL) until every path has its budget or a stop signal.
"""
from __future__ import annotations

import dataclasses
import json
import math
import multiprocessing as mp
import os
import random
import signal
import time
from typing import Any, Optional

import torch
from omegaconf import OmegaConf

from dipaco.config import Config
from dipaco.config.decoupled import DecoupledConfig
from dipaco.decoupled.fsspec_store import open_store
from dipaco.decoupled.lease import Lease
from dipaco.decoupled.service import SyncService
from dipaco.decoupled.store import Store
from dipaco.decoupled.worker import worker_main
from dipaco.run.run_dir import RunDir
from dipaco.runtime import faults, process_start
from dipaco.runtime.launch import StopSignals

__all__ = ["DecoupledError", "Supervisor", "sync_main"]


class DecoupledError(RuntimeError):
    """The decoupled phase could not finish (timeout, too many restarts)."""


def sync_main(store_url: str, module_ids: list[str], sharing: dict[str, list[int]], rounds: int,
              dcfg_dict: dict, outer: dict, name: str, inner_steps: int, sharing_rescale: bool = False,
              handover: Optional[process_start.Handover] = None) -> None:
    """Entry point of a started synchroniser process (``handover``: :func:`process_start.enter`)."""
    process_start.enter(handover)
    torch.set_num_threads(1)
    SyncService(open_store(store_url), module_ids, sharing, rounds, DecoupledConfig(**dcfg_dict), outer,
                name=name, inner_steps=inner_steps, sharing_rescale=sharing_rescale).run()


class _Slot:
    """One decoupled worker slot: its current process and how often it was started."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.incarnation = -1
        self.proc: Optional[mp.process.BaseProcess] = None
        self.finished = False


class Supervisor:
    """Start, watch and stop one decoupled run's processes: :meth:`start`, then :meth:`watch`.

    Args:
        cfg, run: the run's config and directory.
        store, store_url: the run's store (the processes open ``store_url`` themselves).
        plan: the store's plan (:func:`dipaco.decoupled.run.init_store`).
        dcfg: decoupled settings; ``outer``: the synchronisers' outer optimiser settings.
        n_workers: decoupled worker slots.
    """

    def __init__(self, cfg: Config, run: RunDir, store: Store, store_url: str, plan: dict[str, Any],
                 dcfg: DecoupledConfig, outer: dict[str, Any], n_workers: int) -> None:
        self.cfg, self.run, self.store, self.store_url, self.plan = cfg, run, store, store_url, plan
        self.dcfg, self.outer, self.n_workers = dcfg, outer, n_workers
        self.cfg_dict = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
        self.dcfg_dict = dataclasses.asdict(dcfg)
        self.ctx = process_start.context()
        # modules dealt round-robin to synchroniser processes: exactly one owner per module
        self.nsync = min(dcfg.sync_procs, len(plan["module_ids"]))
        self.sync_mods = [plan["module_ids"][i::self.nsync] for i in range(self.nsync)]
        self.syncs: list[mp.process.BaseProcess] = []
        self.slots: list[_Slot] = []
        self.kills = self.restarts = 0
        self.chaos = faults.worker_chaos()  # DIPACO_FAULT worker_kill (none in real runs)
        self.rng = random.Random(self.chaos.seed)
        # the chaos clock starts once training does (the first path progress file): kills
        # during interpreter start-up would test nothing but process spawning
        self.next_kill = math.inf
        self.chaos_armed = not self.chaos.kill_every_s or self.chaos.max_kills <= 0
        self.started = False

    def event(self, obj: dict) -> None:
        """One line of ``events/supervisor.jsonl``."""
        obj.setdefault("t", time.time())
        self.store.append_line("events/supervisor.jsonl", json.dumps(obj))
        self.store.flush()  # rare events; on object stores, publish each at once

    def _start_sync(self, i: int) -> mp.process.BaseProcess:
        self.store.delete(f"done/sync-{i}.json")
        plan, H = self.plan, self.plan["inner_steps"]
        proc = self.ctx.Process(target=sync_main, name=f"dipaco-sync-{i}",
                                args=(self.store_url, self.sync_mods[i],
                                      {m: plan["sharing"][m] for m in self.sync_mods[i]}, plan["rounds"],
                                      self.dcfg_dict, self.outer, f"sync-{i}", H, self.cfg.diloco.sharing_rescale),
                                kwargs={"handover": process_start.handover()})
        proc.start()
        return proc

    def _start_worker(self, slot: _Slot) -> None:
        slot.incarnation += 1
        slot.proc = self.ctx.Process(target=worker_main, name=f"dipaco-worker-{slot.index}",
                                     args=(self.cfg_dict, str(self.run.root), self.store_url, slot.index,
                                           slot.incarnation, self.dcfg_dict),
                                     kwargs={"handover": process_start.handover()})
        slot.proc.start()
        self.event({"e": "start", "slot": slot.index, "incarnation": slot.incarnation, "pid": slot.proc.pid})

    def start(self) -> None:
        """The synchronisers, then every worker slot."""
        self.syncs = [self._start_sync(i) for i in range(self.nsync)]
        self.slots = [_Slot(i) for i in range(self.n_workers)]
        for s in self.slots:
            self._start_worker(s)

    def watch(self, deadline: float) -> Optional[str]:
        """Watch until every worker and synchroniser finished (None) or a stop signal came
        (its name: the store keeps every finished phase); every process ends here."""
        try:
            while True:
                now = time.time()
                if StopSignals.received:  # the one stop contract: end now, keep the last complete phase
                    self.event({"e": "stop", "signal": StopSignals.received})
                    return StopSignals.received
                if now > deadline:
                    raise DecoupledError(f"decoupled phase exceeded diloco.decoupled.timeout_s={self.dcfg.timeout_s}s")
                if not self.started and len(self.store.list("control")) >= self.n_workers:
                    self.store.put_json("control/start", {"t": now})  # every first worker is built: go
                    self.started = True
                self._chaos_kill(now)
                self._reap_workers()
                self._reap_syncs()
                if self._done():
                    return None
                time.sleep(0.05)
        finally:
            for proc in [s.proc for s in self.slots if s.proc is not None] + self.syncs:
                if proc.is_alive():
                    proc.kill()
                proc.join(timeout=10)

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
        busy = [s for s in alive if any(h and h.startswith(f"L{s.index}.{s.incarnation}-") for h in holders)]
        if alive:
            victim = self.rng.choice(busy or alive)
            os.kill(victim.proc.pid, signal.SIGKILL)
            self.kills += 1
            self.event({"e": "kill", "slot": victim.index, "incarnation": victim.incarnation,
                        "pid": victim.proc.pid})
        self.next_kill = now + self.chaos.kill_every_s * self.rng.uniform(0.5, 1.5)

    def _reap_workers(self) -> None:
        """A worker that exited: finished (0), or dead: restarted within the budget, else
        abandoned (the others take its paths after the lease expires)."""
        for s in self.slots:
            if s.finished or s.proc is None or s.proc.is_alive():
                continue
            code = s.proc.exitcode
            s.proc.join()
            if code == 0:
                s.finished = True
                continue
            self.event({"e": "died", "slot": s.index, "incarnation": s.incarnation, "exitcode": code})
            if not self.dcfg.restart_dead or self.restarts >= self.dcfg.max_restarts:
                s.proc = None
                continue
            self.restarts += 1
            self._start_worker(s)

    def _reap_syncs(self) -> None:
        """A synchroniser that died is restarted within the budget, else the run fails."""
        for i, proc in enumerate(self.syncs):
            if not proc.is_alive() and proc.exitcode != 0:
                self.event({"e": "sync_died", "index": i, "exitcode": proc.exitcode})
                if self.restarts >= self.dcfg.max_restarts:
                    raise DecoupledError(f"synchroniser {i} died with exit code {proc.exitcode}")
                self.restarts += 1
                self.syncs[i] = self._start_sync(i)

    def _done(self) -> bool:
        workers_done = all(s.finished or s.proc is None for s in self.slots)
        if workers_done and not any(s.finished for s in self.slots):
            raise DecoupledError("every decoupled worker slot was abandoned after repeated failures")
        return workers_done and all(not p.is_alive() and p.exitcode == 0 for p in self.syncs)
