"""Failure drills of decoupled mode across hosts (docs/decoupled.md, "Failure drills").

Three "hosts" on this machine share one directory store: each is a process group holding
``dipaco-decoupled worker STORE`` (one worker) and ``dipaco-decoupled sync STORE`` (one
synchroniser), with their process servers and roles. The run (tiny model, [2,2] grid, 4
paths x 8 phases of 8 steps, ``lease_s`` 2 s, workers slowed by sleeping) is made in the store by the library, as
``dipaco-train`` makes it, and finished by ``dipaco-decoupled finish``. Each drill hits
one host while it holds a path lease and module leases:

* (a) SIGKILL the whole host: the run finishes, its path and modules are taken over;
* (b) SIGSTOP it for twice ``lease_s``, then SIGCONT: its expired leases are refused (its
  worker abandons the phase, its synchroniser writes nothing and drops its modules);
* (c) its store fails until its leases have lapsed (at least ``lease_s``) (``DIPACO_FAULT=store_error``): it backs off
  and rejoins (its worker ends phases again, its synchroniser takes modules again).

After each: every path has its budget, every pushed update is applied or dropped with a
reason and none twice, every phase of every path is applied once per module or recorded
as wasted, and the final model's routed loss is within ``LOSS_TOL`` of an undisturbed
one-host run with as many workers.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import shutil
import signal
import time
from pathlib import Path
from typing import Optional

import pytest

from _decoupled_hosts import (DRILL, DRILL_DCFG, LEASE_S, Host, check_accounts, host_slots, lease_events,
                              make_store, phases_done, prepare_run, routed_loss, wait_for)
from dipaco.config import compose_config
from dipaco.decoupled.lease import Lease
from dipaco.decoupled.metrics import worker_events
from dipaco.decoupled.owner import PLAN_KEY
from dipaco.decoupled.run import run_decoupled
from dipaco.cli.infer import main as infer_main
from dipaco.fleet.cli import main
from dipaco.run.run_dir import RunDir

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
# Decoupled runs of this size differ by timing alone: the drills measured 0.005-0.04 nats
# from the undisturbed run on a 2-core host at load 16 (docs/decoupled.md); the bound
# leaves room for other timings, and is far below what a lost or doubly applied update
# costs (the chaos test's 6.92 nats).
LOSS_TOL = 0.25


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    """The prepared run directory, and the routed loss of an undisturbed one-host run of it
    (3 workers, the drills' settings) for the drills to compare with."""
    base = tmp_path_factory.mktemp("drills")
    prepare_run(base / "run")
    ref = base / "reference"
    shutil.copytree(base / "run", ref)
    res = run_decoupled(compose_config(DRILL, ref), RunDir.at(ref), dataclasses.replace(DRILL_DCFG, workers=3))
    return base / "run", routed_loss(ref, Path(res.checkpoint))


class Drill:
    """Three hosts on a fresh store over a copy of the prepared run directory."""

    def __init__(self, prepared: Path, tmp: Path, envs: dict[str, dict] = {}) -> None:
        self.run_dir = tmp / "run"
        shutil.copytree(prepared, self.run_dir)
        self.store_dir = tmp / "store"
        self.store = make_store(self.run_dir, self.store_dir)
        self.plan = self.store.get_json(PLAN_KEY)
        self.hosts = [Host(n, self.store_dir, tmp, env=envs.get(n)) for n in "ABC"]

    def names(self, h: Host) -> tuple[str, str]:
        """A host's worker-id prefix and synchroniser name (from its commands' PIDs)."""
        worker_cli, sync_cli = h.procs[0].pid, h.procs[1].pid
        slot = next(s for s, host in host_slots(self.store).items() if host.endswith(f"-{worker_cli}"))
        sync = next(n[:-5] for n in self.store.list("syncs") if f"-{sync_cli}-" in n)
        return f"W{slot}.", sync

    def holds(self, h: Host, both: bool = False) -> bool:
        """Whether host ``h``'s worker holds a live path lease and (``both``) / or its
        synchroniser a live module lease."""
        try:
            w, s = self.names(h)
        except StopIteration:
            return False
        paths = [Lease.holder(self.store, f"path_{p}") or "" for p in range(self.plan["num_paths"])]
        mods = [Lease.holder(self.store, f"module_{m}") for m in self.plan["module_ids"]]
        path, module = any(x.startswith(w) for x in paths), s in mods
        return path and module if both else path or module

    def hit(self, i: int, sig: Optional[int] = None, min_phases: int = 4) -> tuple[str, str, float]:
        """Wait until the run is under way and host ``i`` holds a path lease and a module
        lease, then send its process group ``sig``: its worker-id prefix, its
        synchroniser's name, and when."""
        h = self.hosts[i]
        wait_for(f"host {h.name} busy", lambda: phases_done(self.store, self.plan["num_paths"]) >= min_phases
                 and self.holds(h, both=True), timeout=200, poll=0.05)
        worker, sync = self.names(h)
        if sig is not None:
            h.signal(sig)
        return worker, sync, time.time()

    def finish(self, prepared_loss: float, survivors: list[Host], **timings: float) -> dict:
        for h in survivors:
            assert h.wait(timeout=240) == [0, 0], h.name
        counts = check_accounts(self.store, self.plan)
        with pytest.raises(SystemExit) as done:
            main(["finish", str(self.store_dir), str(self.run_dir)])
        assert done.value.code == 0
        ckpt = self.run_dir / "checkpoints" / f"round_{self.plan['rounds']:06d}"
        loss = routed_loss(self.run_dir, ckpt)
        counts.update({"loss": round(loss, 4), "reference_loss": round(prepared_loss, 4),
                       **{k: round(v, 2) for k, v in timings.items()}})
        print("drill:", json.dumps(counts))
        assert abs(loss - prepared_loss) <= LOSS_TOL, counts
        return counts

    def __enter__(self) -> "Drill":
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.hosts:  # whatever is left of them (a failed drill)
            h.stop()


@pytest.mark.timeout(420)
def test_drill_a_a_host_killed_mid_run(prepared, tmp_path: Path) -> None:
    with Drill(prepared[0], tmp_path) as d:
        worker, sync, killed = d.hit(0, signal.SIGKILL)

        def paths() -> list[float]:
            return [e["t"] for e in worker_events(d.store) if e["e"] == "takeover" and e["from"].startswith(worker)]

        def mods() -> list[float]:
            return [e["t"] for e in lease_events(d.store, "sync-", "takeover") if e["from"] == sync]

        # its path is taken over by another host's worker, its modules by another synchroniser
        wait_for("the takeovers", lambda: bool(paths() and mods()), timeout=120, poll=0.5)
        counts = d.finish(prepared[1], d.hosts[1:], path_taken_after_s=min(paths()) - killed,
                          modules_taken_after_s=min(mods()) - killed)
        # dipaco-infer scores the checkpoint dipaco-decoupled finish wrote, as the job's evaluation did
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            infer_main(["score", str(d.run_dir), "--validation"])
        assert abs(math.log(json.loads(out.getvalue().splitlines()[-1])["ppl"]) - counts["loss"]) < 1e-3


@pytest.mark.timeout(420)
def test_drill_b_a_host_paused_past_its_leases(prepared, tmp_path: Path) -> None:
    with Drill(prepared[0], tmp_path) as d:
        worker, sync, stopped = d.hit(1, signal.SIGSTOP)
        time.sleep(2 * LEASE_S)
        d.hosts[1].signal(signal.SIGCONT)
        d.finish(prepared[1], d.hosts, stopped_s=time.time() - stopped)
        # woken, it found its leases expired: its worker abandoned the phase it held, its
        # synchroniser dropped its modules; nothing it computed meanwhile was applied (the ledger)
        aborts = [e for e in worker_events(d.store) if e["e"] == "abort" and e["worker"].startswith(worker)
                  and e["t"] > stopped]
        assert aborts and any("expired" in e.get("why", "") or "taken over" in e.get("why", "") for e in aborts)
        assert [e for e in lease_events(d.store, sync, "lost") if e["t"] > stopped]


@pytest.mark.timeout(420)
def test_drill_c_a_host_whose_store_fails_for_a_while(prepared, tmp_path: Path) -> None:
    flag = tmp_path / "outage"
    with Drill(prepared[0], tmp_path, envs={"C": {"DIPACO_FAULT": f"store_error:file={flag}"}}) as d:
        # lifted once its leases have lapsed, not after a fixed time: work must remain for it
        # to rejoin, whatever the speed of the phases on this machine (a host hit in its
        # path's first phase leaves that path's whole budget to the end, a measure of the
        # run's shortness: hit once the run is under way, as the other drills)
        worker, sync, _ = d.hit(2)
        flag.write_text("")
        time.sleep(LEASE_S)
        wait_for("its leases to lapse", lambda: not d.holds(d.hosts[2]), timeout=60, poll=0.05)
        flag.unlink()
        back = time.time()

        def rejoined() -> list[float]:
            return [e["t"] for e in worker_events(d.store)
                    if e["e"] == "end" and e["worker"].startswith(worker) and e["t"] > back]

        wait_for("the rejoin", lambda: bool(rejoined()), timeout=120, poll=0.5)
        d.finish(prepared[1], d.hosts, phase_ended_after_outage_s=min(rejoined()) - back)
        # it backed off (its commands said so) and rejoined: phases ended, modules taken again
        logs = "".join((tmp_path / f"C-{v}.log").read_text() for v in ("worker", "sync"))
        assert "the store failed" in logs and "the store answers again" in logs
        assert [e for e in lease_events(d.store, sync, "take") + lease_events(d.store, sync, "takeover")
                if e["t"] > back]
