"""Synchroniser leases, in-process and fast (real time, leases of a fraction of a second):
synchronisers split the modules and rebalance when one joins, a dead one's modules are
taken over from the store, and one that lost its lease (paused past it) writes nothing:
the write-once revisions fence the window between its lease check and its put, in both
orders, and no update is applied twice or lost (docs/decoupled.md, "Leases")."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from dipaco.config.decoupled import DecoupledConfig
from dipaco.decoupled.merge import MergingModuleSync
from dipaco.decoupled.metrics import ledger_report, load_events
from dipaco.decoupled.module_leases import module_folder, read_module, write_module
from dipaco.decoupled.service import SyncService, inbox, progress_key
from dipaco.decoupled.store import FileStore, encode_state
from dipaco.decoupled.versions import KEEP, latest, publish, revisions
from dipaco.plan.codecs import make_codec

AVG = {"lr": 1.0, "momentum": 0.0, "nesterov": False}
MODULES = ["a", "b", "c", "d"]
LEASE = 0.4
CFG = DecoupledConfig(quorum=1.0, grace_init_s=60, lease_s=LEASE, heartbeat_s=0.1, poll_s=0.01)


def _store(tmp_path: Path, modules=MODULES, paths=(0,)) -> FileStore:
    st = FileStore(tmp_path)
    for m in modules:
        assert write_module(st, MergingModuleSync(m, torch.zeros(2), list(paths), CFG, AVG), 0)
    return st


def _sync(st: FileStore, name: str, modules=MODULES, paths=(0,)) -> SyncService:
    return SyncService(st, modules, {m: list(paths) for m in modules}, rounds=1, cfg=CFG, outer=AVG, name=name,
                       inner_steps=1)


def _push(st: FileStore, module: str, uid: str, path: int, phase: int, delta) -> None:
    d = torch.as_tensor(delta, dtype=torch.float32)
    meta = {"update_id": uid, "module_id": module, "path_id": path, "phase": phase, "base_version": 0,
            "tokens": 10.0, "codec": "none", "codec_kw": {}, "numel": d.numel()}
    assert st.put_new(f"{inbox(module)}/{uid}.st", encode_state({"payload": list(make_codec("none").encode(d))}, meta))


def test_revisions_are_write_once_pruned_behind_and_read_legacy_keys(tmp_path: Path) -> None:
    st = FileStore(tmp_path)
    assert latest(st, "x") is None
    st.put("x.st", b"legacy")  # a store from before revisions: its single key is revision 0
    assert latest(st, "x") == (0, b"legacy")
    for n in range(8):
        assert publish(st, "x", n, f"r{n}".encode())
    assert not publish(st, "x", 7, b"again") and latest(st, "x") == (7, b"r7")  # write-once
    from dipaco.decoupled.versions import prune
    prune(st, "x", 7, everything=True)
    assert revisions(st, "x") == list(range(7 - KEEP, 8))


def test_synchronisers_split_the_modules_and_hand_over_when_one_joins(tmp_path: Path) -> None:
    st = _store(tmp_path)
    a, b = _sync(st, "A"), _sync(st, "B")
    a.balance()
    assert sorted(a.leases) == MODULES  # alone: every module
    b.balance()
    assert not b.leases  # B's share is 2, but nothing is free yet
    a.balance()  # A sees B: gives back its surplus
    b.balance()
    assert len(a.leases) == len(b.leases) == 2 and set(a.leases) | set(b.leases) == set(MODULES)
    c = _sync(st, "C")
    for s in (c, a, b, c):
        s.balance()
    held = [set(s.leases) for s in (a, b, c)]
    assert sum(len(h) for h in held) == 4 and set().union(*held) == set(MODULES)
    assert max(len(h) for h in held) == 2  # ceil(4 / 3)
    b.release_all()  # a clean exit: its modules are free at once, and it no longer counts
    a.balance()
    c.balance()
    assert set(a.leases) | set(c.leases) == set(MODULES)


def test_a_dead_synchronisers_modules_are_taken_over_from_the_store_after_lease_s(tmp_path: Path) -> None:
    st = _store(tmp_path, modules=["a"], paths=(0, 1))
    a = _sync(st, "A", modules=["a"], paths=(0, 1))
    _push(st, "a", "u0", 0, 0, [1.0, 1.0])
    a.poll_once()  # A holds a, u0 pending (quorum 2): then A dies (no release, no heartbeat)
    assert "a" in a.leases and len(a.syncs["a"].pending) == 1
    b = _sync(st, "B", modules=["a"], paths=(0, 1))
    b.poll_once()
    assert not b.leases  # A's lease is live
    time.sleep(LEASE + 0.05)
    _push(st, "a", "u1", 1, 0, [3.0, 3.0])
    b.next_balance = 0
    assert b.poll_once() == 1  # taken over, u0 re-read from the inbox, one full-quorum step
    rev, state, meta = read_module(st, "a")
    assert state["applied"] == {"u0": 1, "u1": 1} and meta["writer"] == "B"
    torch.testing.assert_close(state["global"], torch.full((2,), -2.0))
    ev = [e for e in load_events(st, "B") if e.get("e") == "lease"]
    assert ev and ev[0]["what"] == "takeover" and ev[0]["from"] == "A"


def _paused_and_successor(tmp_path: Path) -> tuple[FileStore, SyncService, SyncService]:
    """A holds module a with u0 pending (quorum 1 path) and is paused past its lease; B
    took a over and has loaded it, u0 pending there too; neither has stepped yet."""
    st = _store(tmp_path, modules=["a"], paths=(0,))
    cfg = DecoupledConfig(quorum=1.0, grace_init_s=60, lease_s=LEASE, heartbeat_s=60, poll_s=0.01)
    a = SyncService(st, ["a"], {"a": [0]}, rounds=9, cfg=cfg, outer=AVG, name="A", inner_steps=1)
    a.balance()
    time.sleep(LEASE + 0.05)  # A is paused past its lease
    b = SyncService(st, ["a"], {"a": [0]}, rounds=9, cfg=cfg, outer=AVG, name="B", inner_steps=1)
    b.balance()
    assert "a" in b.leases
    _push(st, "a", "u0", 0, 0, [1.0, 1.0])
    return st, a, b


def _applied_once(st: FileStore) -> None:
    rev, state, meta = read_module(st, "a")
    assert state["applied"] == {"u0": 1} and meta["version"] == 1 and rev == 1
    torch.testing.assert_close(state["global"], torch.full((2,), -1.0))  # one step of u0, not two
    assert ledger_report(st, ["a"])["ok"]


def test_a_synchroniser_that_lost_its_lease_writes_nothing(tmp_path: Path) -> None:
    st, a, b = _paused_and_successor(tmp_path)
    assert a.poll_once() == 0  # wakes, intakes u0, steps: its lease check refuses the write
    assert "a" not in a.leases and revisions(st, module_folder("a")) == [0]
    assert b.poll_once() == 1
    _applied_once(st)
    assert [e["what"] for e in load_events(st, "A") if e.get("e") == "lease"][-1] == "lost"


def test_the_race_between_the_lease_check_and_the_put_is_fenced_either_way(tmp_path: Path, monkeypatch) -> None:
    """The paused synchroniser's check passes (it woke just before its successor took
    over), then the two race for revision 1: whichever creates it first, the other's put
    fails and it reloads, instead of applying u0 a second time or losing an update."""
    st, a, b = _paused_and_successor(tmp_path / "successor_first")
    # A's renewals pass (it woke just before B's takeover), A checks its lease, then
    # pauses while B intakes u0, steps and writes revision 1
    monkeypatch.setattr(a, "keep_alive", lambda: set())
    monkeypatch.setattr(a.leases["a"], "check", lambda: b.poll_once())
    assert a.poll_once() == 0  # A's put of revision 1 fails: fenced, reloaded
    assert a.syncs["a"].version == 1 and "u0" in a.syncs["a"].applied
    _applied_once(st)
    assert [e["what"] for e in load_events(st, "A") if e.get("e") == "lease"] == ["take", "fenced"]

    st, a, b = _paused_and_successor(tmp_path / "zombie_first")
    monkeypatch.setattr(a, "keep_alive", lambda: set())
    monkeypatch.setattr(a.leases["a"], "check", lambda: None)
    assert a.poll_once() == 1  # the zombie's revision 1 lands first: complete, weights and ledger together
    _applied_once(st)
    _push(st, "a", "u1", 0, 1, [1.0, 1.0])
    assert b.poll_once() == 0  # B steps from its stale load: its put of revision 1 fails, it reloads
    assert b.poll_once() == 1  # and applies u1 on top of the zombie's revision
    rev, state, _ = read_module(st, "a")
    assert rev == 2 and state["applied"] == {"u0": 1, "u1": 2} and ledger_report(st, ["a"])["ok"]
    assert [e["what"] for e in load_events(st, "B") if e.get("e") == "lease"] == ["takeover", "fenced"]


def test_a_zombie_put_into_a_pruned_revision_is_fenced_too(tmp_path: Path, monkeypatch) -> None:
    """A, paused between its lease check and its put, wakes after B wrote KEEP + 1 revisions
    past A's and pruned the one A is about to write: the free slot must not let A's stale
    step through (the drills' SIGSTOP found this: its step was logged as a second
    application of updates B had applied)."""
    st, a, b = _paused_and_successor(tmp_path)
    monkeypatch.setattr(b, "_archive", lambda m, names: None)  # A read the inbox before its pause: it still holds them
    for k in range(KEEP + 2):  # B steps u0, u1, ... into revisions 1 .. KEEP + 2, pruning behind
        if k:
            _push(st, "a", f"u{k}", 0, k, [1.0, 1.0])
        assert b.poll_once() == 1
    written = revisions(st, module_folder("a"))
    assert 1 not in written and written[-1] == KEEP + 2
    monkeypatch.setattr(a, "keep_alive", lambda: set())
    monkeypatch.setattr(a.leases["a"], "check", lambda: None)  # its check passed before the pause
    assert a.poll_once() == 0  # its put of revision 1 lands in the hole, sees the newer ones, takes itself back
    assert revisions(st, module_folder("a")) == written and ledger_report(st, ["a"])["ok"]
    assert [e["what"] for e in load_events(st, "A") if e.get("e") == "lease"] == ["take", "fenced"]
    assert not [e for e in load_events(st, "A") if e.get("e") == "step"]


def test_the_service_runs_to_the_end_and_releases_its_modules(tmp_path: Path) -> None:
    st = _store(tmp_path, modules=["a", "b"])
    s = _sync(st, "A", modules=["a", "b"])
    _push(st, "a", "u0", 0, 0, [1.0, 1.0])
    st.put_json(progress_key(0), {"phases_done": 1, "steps_done": 1})
    s.run()
    assert not s.leases and st.get_json("syncs/A.json")["ended"]
    assert st.get_json("done/A.json")["versions"] == {"a": 1, "b": 0}
    assert ledger_report(st, ["a", "b"])["ok"]


def test_a_store_error_fault_fails_every_store_call_while_its_file_exists(tmp_path: Path, monkeypatch) -> None:
    import pytest

    from dipaco.runtime import faults

    st = FileStore(tmp_path / "store")
    assert faults.store_outage(st) is st  # no DIPACO_FAULT: the store itself
    monkeypatch.setenv(faults.ENV, "store_error")
    with pytest.raises(ValueError, match="file=PATH"):
        faults.store_outage(st)
    flag = tmp_path / "outage"
    monkeypatch.setenv(faults.ENV, f"store_error:file={flag}")
    cut = faults.store_outage(st)
    cut.put_json("k.json", {"a": 1})
    flag.write_text("")
    for use in (lambda: cut.get_json("k.json"), lambda: cut.list(""), lambda: cut.put("x", b"1")):
        with pytest.raises(OSError, match="injected store outage"):
            use()
    flag.unlink()
    assert cut.get_json("k.json") == {"a": 1} and cut.root == st.root


def test_the_final_weights_are_the_ledgers_updates_applied_once(tmp_path: Path, monkeypatch) -> None:
    """Six rounds of updates from two paths, stepped by three synchronisers in turn through
    a death (no release), a pause past the lease and the check/put race: the final weights
    equal the initial ones minus, for every version in the ledger, the mean of the updates
    it lists as applied at that version (full quorum, lr 1, no momentum): every update
    applied exactly once, none lost, whoever stepped it."""
    cfg = DecoupledConfig(quorum=1.0, grace_init_s=60, lease_s=LEASE, heartbeat_s=0.1, poll_s=0.01)
    st = FileStore(tmp_path)
    assert write_module(st, MergingModuleSync("m", torch.zeros(3), [0, 1], cfg, AVG), 0)
    gen = torch.Generator().manual_seed(0)
    deltas = {}

    def sync(name: str) -> SyncService:
        return SyncService(st, ["m"], {"m": [0, 1]}, rounds=99, cfg=cfg, outer=AVG, name=name, inner_steps=1)

    def push(k: int) -> None:
        for p in (0, 1):
            uid = f"u{p}.{k}"
            deltas[uid] = torch.randn(3, generator=gen)
            _push_at(st, uid, p, k, deltas[uid])

    a = sync("A")
    push(0)
    assert a.poll_once() == 1
    push(1)
    a._intake("m", [])  # A intakes round 1 (it would step at its next poll) and dies
    time.sleep(LEASE + 0.05)  # A is dead: no release, no heartbeat
    b = sync("B")
    assert b.poll_once() == 1  # takes over, re-reads round 1 from the inbox, steps it
    push(2)
    assert b.poll_once() == 1
    push(3)
    b._intake("m", [])
    time.sleep(LEASE + 0.05)  # B paused past its lease with round 3 pending
    c = sync("C")
    assert c.poll_once() == 1  # C steps round 3
    assert b.poll_once() == 0  # B wakes: its lease expired, it writes nothing
    push(4)
    c._intake("m", [])  # C has round 4 pending; A2 took over after C's lease ran out ...
    time.sleep(LEASE + 0.05)
    a2 = sync("A2")
    a2.balance()
    monkeypatch.setattr(c.leases["m"], "check", lambda: None)  # ... but C's check passed just before
    c.next_balance = float("inf")  # (and its renewals too: the balance's and those between modules)
    monkeypatch.setattr(c, "keep_alive", lambda: set())
    assert c.poll_once() == 1  # the late writer's revision lands first
    assert a2.poll_once() == 0  # A2's put of the same revision is fenced: reload
    push(5)
    a2.poll_once()
    assert a2.poll_once() + a2.poll_once() <= 1
    rev, state, meta = read_module(st, "m")
    assert set(state["applied"]) == set(deltas) and not state["dropped"] and meta["version"] == 6
    by_version: dict[int, list[str]] = {}
    for uid, v in state["applied"].items():
        by_version.setdefault(v, []).append(uid)
    expected = -sum(torch.stack([deltas[u] for u in ids]).mean(0) for ids in by_version.values())
    torch.testing.assert_close(state["global"], expected)
    assert sorted(len(ids) for ids in by_version.values()) == [2] * 6 and ledger_report(st, ["m"])["ok"]


def _push_at(st: FileStore, uid: str, path: int, base: int, delta: torch.Tensor) -> None:
    meta = {"update_id": uid, "module_id": "m", "path_id": path, "phase": base, "base_version": base,
            "tokens": 10.0, "codec": "none", "codec_kw": {}, "numel": delta.numel()}
    assert st.put_new(f"{inbox('m')}/{uid}.st", encode_state({"payload": list(make_codec("none").encode(delta))}, meta))
