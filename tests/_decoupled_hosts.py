"""What the across-hosts tests share (tests/test_decoupled_drills.py,
tests/test_decoupled_hosts.py): a prepared run directory with its store made by the
library (no training), "hosts" of ``dipaco-decoupled`` processes in their own process
group each, waits on the store, and the checks every drill ends with."""
from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from dipaco.config import compose_config
from dipaco.config.decoupled import DecoupledConfig
from dipaco.decoupled.metrics import ledger_report, load_events, pushed_ids, worker_events
from dipaco.decoupled.module_leases import read_module
from dipaco.decoupled.owner import claim_store
from dipaco.decoupled.run import init_store
from dipaco.decoupled.service import path_steps_done, progress_key
from dipaco.decoupled.store import FileStore
from dipaco.job.prepare import prepare
from dipaco.run.record import write_run_config
from dipaco.run.run_dir import RunDir

REPO = Path(__file__).resolve().parents[1]
# tiny model, [2,2] grid (4 paths, 6 modules), 8 phases of 8 steps per path: a drill is
# about its faults. Every worker sleeps 15x its step time after each step (slow_factor 16,
# all three slots), so that the run lasts long in wall time against lease_s at the CPU
# cost of a sixteenth of that: a lapsed lease costs the path it held a few of its rounds,
# not most of them, and work is left for a host to rejoin. (With slow_factor 4 a path hit
# early trained most of its budget after the others had finished and its late rounds
# weighed less: up to +0.32 nats; with 8, +0.01 to +0.23; with 16, -0.15 to +0.05.)
DRILL = ["experiment=smoke", "data.max_documents=200", "diloco.mode=decoupled", "trainer.rounds=8",
         "diloco.inner_steps=8", "trainer.dense_baseline=false", "trainer.progress=false"]
LEASE_S = 2.0
DRILL_DCFG = DecoupledConfig(lease_s=LEASE_S, heartbeat_s=0.4, timeout_s=240, grace_max_s=5.0,
                             slow_workers=[0, 1, 2], slow_factor=16.0)


def prepare_run(run_dir: Path, overrides: list[str] = DRILL) -> None:
    """Prepare a run directory (config.yaml, tokenizer, router, shards) without training."""
    cfg = compose_config(overrides, run_dir)
    run = RunDir.at(run_dir)
    write_run_config(run, cfg)
    prepare(cfg, run)


def make_store(run_dir: Path, store: Path, dcfg: DecoupledConfig = DRILL_DCFG,
               overrides: list[str] = DRILL) -> FileStore:
    """The run in a fresh store, as its creator makes it (version 0, plan, run record)."""
    cfg = compose_config(overrides, run_dir)
    run = RunDir.at(run_dir)
    st = claim_store(str(store), run, resume=False)
    init_store(cfg, run, st, dcfg)
    return FileStore(store)


class Host:
    """One "host": ``dipaco-decoupled worker`` and ``dipaco-decoupled sync`` processes in a
    process group of their own (a signal to the group reaches every process of the host:
    both commands, their process servers and their workers and synchronisers)."""

    def __init__(self, name: str, store: Path, logs: Path, *, workers: int = 1, syncs: int = 1,
                 env: Optional[dict[str, str]] = None) -> None:
        self.name, self.procs = name, []
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.pgid: Optional[int] = None
        for verb, n in (("worker", workers), ("sync", syncs)):
            if n:
                log = open(logs / f"{name}-{verb}.log", "w")
                group = {"process_group": 0 if self.pgid is None else self.pgid}
                p = subprocess.Popen([sys.executable, "-m", "dipaco.fleet.cli", verb, str(store), "--count", str(n)],
                                     cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT, **group)
                self.pgid = self.pgid or p.pid
                self.procs.append(p)

    def signal(self, sig: int) -> None:
        os.killpg(self.pgid, sig)

    def wait(self, timeout: float) -> list[int]:
        return [p.wait(timeout=max(1.0, timeout)) for p in self.procs]

    def stop(self) -> None:
        """Whatever is left of the host (a test that failed half way)."""
        try:
            os.killpg(self.pgid, signal.SIGCONT)
            os.killpg(self.pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for p in self.procs:
            p.wait(timeout=30)


def wait_for(what: str, cond: Callable[[], bool], timeout: float, poll: float = 0.1) -> None:
    deadline = time.time() + timeout
    while not cond():
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(poll)


def phases_done(store: FileStore, paths: int) -> int:
    return sum(int((store.get_json(progress_key(p)) or {}).get("phases_done", 0)) for p in range(paths))


def host_slots(store: FileStore) -> dict[int, str]:
    """Worker slot → the host (supervisor) that runs it."""
    out = {}
    for name in store.list("hosts"):
        rec = store.get_json(f"hosts/{name}") or {}
        for w in rec.get("workers", []):
            out[int(w["slot"])] = name[:-5]
    return out


def check_accounts(store: FileStore, plan: dict) -> dict[str, int]:
    """Every path has its budget; every pushed update is applied or dropped with a reason,
    none twice (the ledger); every phase of every path is applied once per module or
    recorded as wasted (dropped, or its phase aborted). Returns counts for the report."""
    R, H, P = plan["rounds"], plan["inner_steps"], plan["num_paths"]
    for p in range(P):
        assert path_steps_done(store.get_json(progress_key(p)), H) == R * H, p
    report = ledger_report(store, plan["module_ids"])
    assert report["ok"], report
    states = {m: read_module(store, m)[1] for m in plan["module_ids"]}
    applied = 0
    for p in range(P):
        done = int(store.get_json(progress_key(p))["phases_done"])
        for k in range(done):
            for m, paths in plan["sharing"].items():
                if p not in paths:
                    continue
                uid = states[m]["phases"].get(f"{p}:{k}")
                assert uid is not None and (uid in states[m]["applied"] or uid in states[m]["dropped"]), (p, k, m)
                applied += uid in states[m]["applied"]
    for m in plan["module_ids"]:  # an applied id went into exactly one version, versions 1..V all used
        assert set(states[m]["applied"].values()) == set(range(1, int(states[m]["version"]) + 1)), m
        assert set(states[m]["applied"]) | set(states[m]["dropped"]) == pushed_ids(store, m), m
    aborted = sum(1 for e in worker_events(store) if e["e"] == "abort")
    return {"applied_slots": applied, "aborted_phases": aborted,
            "dropped": sum(len(s["dropped"]) for s in states.values())}


def lease_events(store: FileStore, prefix: str, what: str) -> list[dict]:
    """Synchroniser lease events ``what`` (take, takeover, lost, release, fenced) of logs ``prefix``*."""
    return [e for e in load_events(store, prefix) if e.get("e") == "lease" and e.get("what") == what]


def routed_loss(run_dir: Path, ckpt: Path, overrides: list[str] = DRILL) -> float:
    """Mean validation loss (nats) of a checkpoint, routed: the job's evaluation."""
    from dipaco.job.train import _evaluate

    cfg = compose_config(overrides, run_dir)
    run = RunDir.at(run_dir)
    return math.log(_evaluate(cfg, run, prepare(cfg, run), ckpt)["once"]["ppl"])
