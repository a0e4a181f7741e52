"""Lease renewal on a slow store, in-process and fast: a renewal is one put when on time
and checks the epochs when late, a late one warns once with the fix, and a synchroniser
whose pass over its modules outlasts ``lease_s`` keeps its leases (renewed between
modules), while one that loses a lease mid-pass stops touching that module
(docs/decoupled.md, "Leases on a slow store")."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import pytest
import torch

from dipaco.config.decoupled import DecoupledConfig
from dipaco.decoupled import lease as lease_mod
from dipaco.decoupled.lease import LATE_SHARE, Lease, LeaseLost, RenewalMargin
from dipaco.decoupled.merge import MergingModuleSync
from dipaco.decoupled.metrics import ledger_report, load_events
from dipaco.decoupled.module_leases import read_module, write_module
from dipaco.decoupled.service import SyncService, inbox
from dipaco.decoupled.store import FileStore, encode_state
from dipaco.plan.codecs import make_codec

AVG = {"lr": 1.0, "momentum": 0.0, "nesterov": False}


def _request(op: str):
    """FileStore's ``op``, recorded and delayed as one request (see :class:`SlowStore`)."""
    def call(self: "SlowStore", key: str, *rest):
        self._req(op, key)
        return getattr(FileStore, op)(self, key, *rest)
    return call


class SlowStore(FileStore):
    """A FileStore that records every request and sleeps ``delay`` s in each (an object
    store's round trip); ``stall`` (key prefix, seconds) pauses once on the first request
    under that prefix."""

    def __init__(self, root: Path, delay: float = 0.0) -> None:
        super().__init__(root, fsync=False)
        self.delay, self.calls = delay, []
        self.stall: Optional[tuple[str, float]] = None

    def _req(self, op: str, key: str) -> None:
        self.calls.append((op, key))
        time.sleep(self.delay)
        if self.stall and key.startswith(self.stall[0]):
            time.sleep(self.stall[1])
            self.stall = None

    put, put_new, get, list, delete, move, append_line = (
        _request(op) for op in ("put", "put_new", "get", "list", "delete", "move", "append_line"))


@pytest.fixture(autouse=True)
def _fresh_margin(monkeypatch) -> list[str]:
    """A fresh process-wide renewal margin per test, and its warnings captured."""
    said: list[str] = []
    monkeypatch.setattr(Lease, "margin", RenewalMargin())
    monkeypatch.setattr(lease_mod, "say", said.append)
    return said


def test_an_on_time_renewal_is_one_put_and_a_late_one_checks_the_epochs(tmp_path: Path) -> None:
    st = SlowStore(tmp_path)
    lease = Lease(st, "path_0", "w0", lease_s=30.0)
    assert lease.acquire() and not lease.due()
    st.calls.clear()
    lease.renew()
    assert [op for op, _ in st.calls] == ["put"]  # no listing: a taker cannot have read it as expired
    lease.expires_at = time.time() + 0.25 * lease.lease_s  # renewed 3/4 of a lease ago
    assert lease.due()
    st.calls.clear()
    lease.renew()
    assert [op for op, _ in st.calls] == ["put", "list"]  # late: a taker may have been quicker
    assert Lease(st, "path_0", "w1", 1.0).acquire() is False  # the renewal holds it
    # a taker with a clock ahead took epoch 2 while our renewal was late: the late check sees it
    assert st.put_new("leases/path_0/0000000002.json", b'{"owner": "w1", "expires_at": 1e12, "released": false}')
    lease.expires_at = time.time() + 0.25 * lease.lease_s
    with pytest.raises(LeaseLost, match="taken over"):
        lease.renew()
    lease.expires_at = time.time() - 1.0  # stalled past its expiry: lost, nothing written
    st.calls.clear()
    with pytest.raises(LeaseLost, match="expired"):
        lease.renew()
    assert st.calls == []


def test_a_late_renewal_warns_once_naming_the_fix_and_is_published(tmp_path: Path, _fresh_margin) -> None:
    st = FileStore(tmp_path, fsync=False)
    lease = Lease(st, "module_a", "sync-0", lease_s=3.0)
    assert lease.acquire()
    lease.renew()
    assert not _fresh_margin and Lease.margin.worst < LATE_SHARE * 3.0  # on time: silent
    for _ in range(2):
        lease.expires_at = time.time() + 0.6  # renewed 2.4 s ago: 4/5 of the lease
        lease.renew()
    assert len(_fresh_margin) == 1  # once per process
    line = _fresh_margin[0]
    assert "\n" not in line and "lease module_a" in line and "diloco.decoupled.lease_s=3" in line
    assert "raise lease_s" in line and "diloco.decoupled.lease_s=9" in line  # 6 x (2.4 - 1.0) s, rounded up
    assert Lease.margin.worst == pytest.approx(2.4, abs=0.2)
    s = SyncService(st, ["a"], {"a": [0]}, rounds=1, cfg=DecoupledConfig(lease_s=3.0, heartbeat_s=1.0), outer=AVG,
                    name="sync-0", inner_steps=1)
    s._beat(time.time())
    assert st.get_json("syncs/sync-0.json")["renewal_s"] == pytest.approx(Lease.margin.worst, abs=1e-3)


def _slow_run(tmp_path: Path, modules: list[str], delay: float, lease_s: float) -> tuple[SlowStore, SyncService]:
    """``modules`` at version 0, one update each in its inbox (quorum 1: each steps on
    it), and a synchroniser holding them all on a store with ``delay`` s per request."""
    st = SlowStore(tmp_path)
    cfg = DecoupledConfig(quorum=1.0, grace_init_s=60, lease_s=lease_s, heartbeat_s=lease_s / 3, poll_s=0.01)
    for m in modules:
        assert write_module(st, MergingModuleSync(m, torch.zeros(2), [0], cfg, AVG), 0)
        d = torch.ones(2)
        meta = {"update_id": f"u-{m}", "module_id": m, "path_id": 0, "phase": 0, "base_version": 0,
                "tokens": 10.0, "codec": "none", "codec_kw": {}, "numel": 2}
        assert st.put_new(f"{inbox(m)}/u-{m}.st", encode_state({"payload": list(make_codec("none").encode(d))}, meta))
    s = SyncService(st, modules, {m: [0] for m in modules}, rounds=9, cfg=cfg, outer=AVG, name="A", inner_steps=1)
    s.balance()
    assert sorted(s.leases) == modules
    st.delay = delay
    return st, s


@pytest.mark.slow  # waits out a lease on a slowed store: out of the fast lane
def test_a_pass_that_outlasts_the_lease_keeps_the_leases(tmp_path: Path) -> None:
    """Eight modules at ~10 requests each, 20 ms a request: a pass takes about two
    leases of 1 s. Renewed once a balance, the later modules' leases lapse mid-pass;
    renewed when due between modules, none does and every module steps."""
    modules = [f"m{i}" for i in range(8)]
    st, s = _slow_run(tmp_path, modules, delay=0.02, lease_s=1.0)
    t0 = time.time()
    steps = s.poll_once()
    assert time.time() - t0 > 1.0  # the pass did outlast the lease
    lost = [e for e in load_events(st, "A") if e.get("e") == "lease" and e["what"] == "lost"]
    assert lost == [] and steps == len(modules) and sorted(s.leases) == modules
    for m in modules:
        rev, state, meta = read_module(st, m)
        assert rev == 1 and state["applied"] == {f"u-{m}": 1} and meta["writer"] == "A"
        assert st.list(inbox(m)) == []  # archived after the pass: accounted for by revision 1
    assert ledger_report(st, modules)["ok"]
    assert Lease.margin.worst < 1.0  # every renewal landed inside the lease


def test_a_lease_lost_mid_pass_stops_all_work_on_its_module(tmp_path: Path) -> None:
    """A stalls (a store hiccup longer than the lease) on its first module's intake: its
    second module's lease lapsed meanwhile, so A drops it before touching it (no read of
    its inbox, no write); B takes both over and steps each update once."""
    st, a = _slow_run(tmp_path, ["m0", "m1"], delay=0.0, lease_s=0.4)
    first, second = list(a.syncs)  # the pass's order
    st.stall = (f"{inbox(first)}/", 0.5)  # on the first module's intake: every lease of A lapses
    st.calls.clear()
    assert a.poll_once() == 0  # the first is lost too: found at its publish check, nothing written
    keys = [k for _, k in st.calls]
    after = keys[keys.index(f"{inbox(first)}/u-{first}.st") + 1:]
    assert not any(second in k and not k.startswith("leases/") for k in after)  # untouched
    assert not any(k.startswith("modules/") for k in after)
    assert not a.leases and [(e["module"], e["what"]) for e in load_events(st, "A")
                             if e.get("e") == "lease"][-2:] == [(first, "lost"), (second, "lost")]
    b = SyncService(st, ["m0", "m1"], {"m0": [0], "m1": [0]}, rounds=9, cfg=a.cfg, outer=AVG, name="B",
                    inner_steps=1)
    assert b.poll_once() == 2
    for m in ("m0", "m1"):
        rev, state, meta = read_module(st, m)
        assert rev == 1 and state["applied"] == {f"u-{m}": 1} and meta["writer"] == "B"
    assert ledger_report(st, ["m0", "m1"])["ok"]
