"""Decoupled mode, in-process and fast: the synchroniser's rules, the store and leases.

Quorum, grace window (with an injected clock), staleness discount and drop, delayed
Nesterov against torch's SGD and a hand-written reference, token-weighted merging,
idempotence across a simulated crash, and the ledger invariant of a whole service.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from dipaco.config import DiLoCoConfig, to_config
from dipaco.config.decoupled import DecoupledConfig, validate_decoupled
from dipaco.decoupled.metrics import ledger_report, worker_events
from dipaco.decoupled.fsspec_store import open_store
from dipaco.decoupled.lease import Lease, LeaseLost
from dipaco.decoupled.scheduling import PathPicker
from dipaco.decoupled.merge import MergingModuleSync, Update
from dipaco.decoupled.module_leases import read_module, write_module
from dipaco.decoupled.service import SyncService, archive, inbox, path_finished, path_steps_done, progress_key
from dipaco.decoupled.store import FileStore, decode_state, encode_state
from dipaco.decoupled.worker import DecoupledWorker
from dipaco.plan.codecs import make_codec
from dipaco.sync.module_core import ModuleCore
from dipaco.sync.outer import DelayedNesterov, make_outer_optimizer, outer_options

AVG = {"lr": 1.0, "momentum": 0.0, "nesterov": False}


def upd(uid: str, path: int, delta, *, phase: int = 0, base: int = 0, tokens: float = 100.0,
        module: str = "m") -> Update:
    return Update(uid, module, path, phase, base, tokens, torch.as_tensor(delta, dtype=torch.float32))


def sync_of(paths=(0, 1), theta=(0.0, 0.0), outer=None, **kw) -> MergingModuleSync:
    cfg = DecoupledConfig(**kw)
    return MergingModuleSync("m", torch.tensor(theta), list(paths), cfg, outer or AVG, now=0.0)


# ------------------------------------------------------------------ delayed Nesterov


def dn_run(theta: torch.Tensor, gs, **kw) -> tuple[torch.Tensor, list[bool], DelayedNesterov]:
    """Step a DelayedNesterov over the gradients ``gs``: (θ, momentum fired per step, optimiser)."""
    p = torch.nn.Parameter(theta.clone())
    opt = DelayedNesterov([p], **kw)
    fired = []
    for g in gs:
        p.grad = torch.as_tensor(g, dtype=torch.float32).clone()
        opt.step()
        fired.append(bool(opt.state[p]["momentum_applied"]))
    return p.detach(), fired, opt


def test_delayed_nesterov_every_1_is_torch_sgd_nesterov() -> None:
    torch.manual_seed(0)
    theta = torch.randn(7)
    ref = torch.nn.Parameter(theta.clone())
    opt = make_outer_optimizer([ref], name="sgd", lr=0.7, momentum=0.9, nesterov=True)
    gs = []
    for _ in range(6):
        g = torch.randn(7)
        gs.append(g)
        ref.grad = g.clone()
        opt.step()
    mine, _, _ = dn_run(theta, gs, lr=0.7, momentum=0.9, nesterov=True, every=1)
    torch.testing.assert_close(mine, ref.detach(), rtol=1e-6, atol=1e-6)


def test_delayed_nesterov_matches_hand_reference() -> None:
    lr, beta, N, c = 0.5, 0.8, 3, 0.25
    gs = [torch.tensor([1.0, -2.0]), torch.tensor([0.5, 0.5]), torch.tensor([-1.0, 3.0]),
          torch.tensor([2.0, 0.0]), torch.tensor([0.0, 1.0]), torch.tensor([1.0, 1.0]), torch.tensor([3.0, -1.0])]
    # reference, written out element by element
    th, m, buf = [1.0, 1.0], [0.0, 0.0], [0.0, 0.0]
    for t, g in enumerate(gs, start=1):
        g = g.tolist()
        buf = [b + x for b, x in zip(buf, g)]
        if t % N == 0:
            m = [beta * mi + bi / N for mi, bi in zip(m, buf)]
            th = [x - lr * (gi + beta * mi) for x, gi, mi in zip(th, g, m)]
            buf = [0.0, 0.0]
        else:
            th = [x - lr * (gi + c * beta * mi) for x, gi, mi in zip(th, g, m)]
    mine, fired, _ = dn_run(torch.tensor([1.0, 1.0]), gs, lr=lr, momentum=beta, nesterov=True, every=N, scale=c)
    assert fired == [False, False, True, False, False, True, False]
    torch.testing.assert_close(mine, torch.tensor(th), rtol=1e-6, atol=1e-6)
    # the state round-trips through the per-module core's layout (outer/<module>)
    kw = {"name": "delayed_nesterov", "lr": lr, "momentum": beta, "nesterov": True, "every": N, "scale": c}
    a, b = ModuleCore("m", torch.tensor([1.0, 1.0]), kw), ModuleCore("m", torch.zeros(2), kw)
    for g in gs:
        a.outer_step(g)
    b.load_state_dict(a.state_dict())
    assert a.outer_step(torch.ones(2)) == b.outer_step(torch.ones(2))
    torch.testing.assert_close(a.weights, b.weights, rtol=0, atol=0)


# ------------------------------------------------------------------ merge, quorum, grace


def test_partial_steps_from_one_base_equal_the_synchronous_average() -> None:
    """lr 1, no momentum: two half-quorum steps = one step over all four (sync) paths."""
    deltas = {0: [4.0, 0.0], 1: [0.0, 4.0], 2: [2.0, 2.0], 3: [-2.0, 0.0]}
    toks = {0: 100.0, 1: 300.0, 2: 100.0, 3: 100.0}
    full = sync_of(paths=range(4), quorum=1.0, staleness_power=0.0)
    for p in range(4):
        assert full.offer(upd(f"u{p}", p, deltas[p], tokens=toks[p]), 0.0) is None
    assert full.due(0.0) == "quorum"
    full.step(0.0)
    half = sync_of(paths=range(4), quorum=0.5, staleness_power=0.0)
    # all four report once first so the α estimate is the same as above
    half.alpha_ema = sum(toks.values()) / 4
    for p in (0, 1):
        half.offer(upd(f"u{p}", p, deltas[p], tokens=toks[p]), 0.0)
        half.alpha_ema = sum(toks.values()) / 4
    assert half.due(0.0) == "quorum" and half.step(0.0) is not None
    for p in (2, 3):  # started from version 0, applied at version 1: staleness 1
        half.offer(upd(f"u{p}", p, deltas[p], tokens=toks[p]), 0.0)
        half.alpha_ema = sum(toks.values()) / 4
    rec = half.step(0.0)
    assert rec.staleness == [1, 1] and half.version == 2
    torch.testing.assert_close(half.theta, full.theta)
    expected = -sum(torch.tensor(deltas[p]) * toks[p] for p in range(4)) / sum(toks.values())
    torch.testing.assert_close(full.theta, expected)


def test_quorum_counts_distinct_paths() -> None:
    s = sync_of(paths=(0, 1, 2), quorum=0.6)  # ceil(1.8) = 2 paths
    assert s.quorum == 2
    s.offer(upd("a", 0, [1.0, 0.0], phase=0), 0.0)
    s.offer(upd("b", 0, [1.0, 0.0], phase=1), 0.0)  # same path again: still one path
    assert s.due(0.1) is None
    s.offer(upd("c", 2, [1.0, 0.0]), 0.2)
    assert s.due(0.2) == "quorum"


def test_grace_window_fires_and_adapts() -> None:
    s = sync_of(paths=(0, 1), quorum=1.0, grace_init_s=2.0, grace_factor=2.0, grace_min_s=0.1, grace_max_s=10)
    s.offer(upd("a", 0, [1.0, 1.0]), 5.0)
    assert s.due(6.9) is None and s.due(7.0) == "grace"
    rec = s.step(7.0, "grace")
    assert rec.trigger == "grace" and rec.paths == [0]
    assert s.grace_s() == 2.0  # no fill time observed yet: still the initial window
    # quorum now fills fast, repeatedly: the window shrinks towards grace_factor × fill time
    for k in range(30):
        t = 100.0 + k
        s.offer(upd(f"x{k}", 0, [0.0, 0.0], phase=k + 1, base=s.version), t)
        s.offer(upd(f"y{k}", 1, [0.0, 0.0], phase=k + 1, base=s.version), t + 0.05)
        assert s.due(t + 0.05) == "quorum"
        s.step(t + 0.05)
    assert s.grace_s() == pytest.approx(0.1, abs=0.02)  # 2 × 0.05 = 0.1, the floor


def test_quorum_is_capped_by_the_paths_still_running() -> None:
    s = sync_of(paths=(0, 1, 2, 3), quorum=1.0, grace_init_s=100)
    s.offer(upd("a", 0, [1.0, 1.0]), 0.0)
    assert s.due(1.0) is None
    assert s.due(1.0, done={1, 2, 3}) == "quorum"  # the others have finished their budget
    # path 0 finished, path 1 still running: 0's last update waits for 1's
    assert s.due(1.0, done={0, 2, 3}) is None


def test_staleness_discount_and_drop() -> None:
    s = sync_of(paths=(0,), quorum=1.0, staleness_power=1.0, max_staleness=2)
    s.alpha_ema = 100.0
    for v in range(3):  # advance to version 3 with zero updates
        s.offer(upd(f"z{v}", 0, [0.0, 0.0], phase=v, base=v), 0.0)
        s.step(0.0)
    assert s.version == 3
    assert s.offer(upd("old", 0, [1.0, 1.0], phase=10, base=0), 0.0) == "stale"  # s = 3 > 2
    assert s.offer(upd("ok", 0, [2.0, 4.0], phase=11, base=1), 0.0) is None  # s = 2: weight 1/3
    rec = s.step(0.0)
    assert rec.staleness == [2] and rec.weights == [pytest.approx(100.0 / 3)]
    torch.testing.assert_close(s.theta, torch.tensor([-2.0 / 3, -4.0 / 3]))
    assert s.dropped == {"old": "stale"}


def test_update_that_ages_while_pending_is_dropped_at_step() -> None:
    s = sync_of(paths=(0, 1), quorum=1.0, max_staleness=0)
    s.offer(upd("a", 0, [1.0, 0.0]), 0.0)  # fresh on arrival, pending (quorum is 2)
    s.version = 1  # another writer advanced the module meanwhile (simulated)
    assert s.step(0.0, "grace") is None
    assert s.dropped == {"a": "stale"} and not s.applied


def test_idempotent_intake_and_duplicate_phase() -> None:
    s = sync_of(paths=(0,), quorum=1.0)
    assert s.offer(upd("a", 0, [1.0, 1.0]), 0.0) is None
    assert s.offer(upd("a", 0, [1.0, 1.0]), 0.0) == "seen"  # same id again: ignored
    s.step(0.0)
    theta = s.theta.clone()
    # a crash after writing the version: a new synchroniser from the saved state re-reads the file
    s2 = sync_of(paths=(0,), quorum=1.0)
    s2.load_state_dict(s.state_dict())
    assert s2.offer(upd("a", 0, [1.0, 1.0]), 0.0) == "seen"
    assert s2.step(0.0) is None
    torch.testing.assert_close(s2.theta, theta)
    # a re-run of the same path phase under a new id (learner died before recording it)
    assert s2.offer(upd("a-rerun", 0, [5.0, 5.0]), 0.0) == "duplicate_phase"
    assert s2.applied == {"a": 1} and s2.dropped == {"a-rerun": "duplicate_phase"}


def test_non_finite_and_bad_shape_are_dropped() -> None:
    s = sync_of(paths=(0,))
    assert s.offer(upd("nan", 0, [float("nan"), 0.0]), 0.0) == "non_finite"
    assert s.offer(upd("short", 0, [1.0], phase=1), 0.0) == "bad_shape"
    assert s.step(0.0) is None and s.version == 0


def test_momentum_is_delayed_in_the_synchroniser() -> None:
    # decoupled mode turns sgd with momentum into delayed Nesterov (momentum_every > 1)
    d = DiLoCoConfig(mode="decoupled", decoupled=DecoupledConfig(momentum_every=2))
    outer = outer_options(d)
    assert outer["name"] == "delayed_nesterov" and outer["every"] == 2
    s = sync_of(paths=(0,), outer=outer, quorum=1.0, momentum_every=2)
    fired = []
    for k in range(4):
        s.offer(upd(f"u{k}", 0, [1.0, 0.0], phase=k, base=s.version), 0.0)
        fired.append(s.step(0.0).momentum_applied)
    assert fired == [False, True, False, True]



def test_run_decoupled_delays_momentum_whatever_the_config_mode() -> None:
    """run_decoupled is decoupled mode even on a config composed in sync mode (tests and
    notebooks call it directly): its synchronisers must get delayed Nesterov too."""
    from dipaco.config import compose_config
    from dipaco.decoupled.run import outer_settings

    cfg = compose_config(["experiment=smoke"])
    assert cfg.diloco.mode == "sync"
    outer = outer_settings(cfg, DecoupledConfig(momentum_every=4))
    assert outer["name"] == "delayed_nesterov" and outer["every"] == 4
    assert outer_settings(cfg, DecoupledConfig(momentum_every=1))["name"] == "sgd"

# ------------------------------------------------------------------ store and leases


def test_store_atomic_put_new_and_listing(tmp_path: Path) -> None:
    st = FileStore(tmp_path / "s")
    st.put("a/b.bin", b"one")
    st.put("a/b.bin", b"two")
    assert st.get("a/b.bin") == b"two" and st.get("a/missing") is None
    assert st.put_new("a/c.bin", b"x") and not st.put_new("a/c.bin", b"y")
    assert st.get("a/c.bin") == b"x"
    (tmp_path / "s" / "a" / ".tmp-b.bin.host-1.abcd").write_bytes(b"torn")  # a killed writer's leftover
    assert st.list("a") == ["b.bin", "c.bin"]
    st.move("a/c.bin", "z/c.bin")
    assert st.list("a") == ["b.bin"] and st.get("z/c.bin") == b"x"
    st.append_line("log.jsonl", "1")
    with open(tmp_path / "s" / "log.jsonl", "a") as f:
        f.write('{"torn"')  # a writer killed mid-line
    assert st.read_lines("log.jsonl") == ["1"]
    blob = encode_state({"w": torch.arange(3.0), "k": 2}, meta={"id": "u"})
    state, meta = decode_state(blob)
    assert meta == {"id": "u"} and state["k"] == 2 and torch.equal(state["w"], torch.arange(3.0))
    with pytest.raises(ValueError):
        st.path("../escape")
    with pytest.raises(ValueError, match="store_url"):
        open_store("s3://bucket/x")


def test_lease_exclusive_expiry_takeover_and_release(tmp_path: Path) -> None:
    st = FileStore(tmp_path)
    a = Lease(st, "path_0", "A", lease_s=0.3)
    b = Lease(st, "path_0", "B", lease_s=0.3)
    assert a.acquire() and not b.acquire()
    assert not Lease.is_free(st, "path_0")
    a.renew()
    time.sleep(0.35)  # A stops heartbeating
    assert Lease.is_free(st, "path_0") and b.acquire() and b.epoch == a.epoch + 1
    with pytest.raises(LeaseLost):
        a.renew()  # the zombie learns it lost the path
    with pytest.raises(LeaseLost):
        a.check()
    b.release()
    assert Lease.is_free(st, "path_0")
    c = Lease(st, "path_0", "C", lease_s=5)
    assert c.acquire() and c.epoch == b.epoch + 1


# ------------------------------------------------------------------ service end to end


def _push(st: FileStore, module: str, uid: str, path: int, phase: int, base: int, delta, codec="none",
          tokens: float = 10.0) -> None:
    c = make_codec(codec)
    d = torch.as_tensor(delta, dtype=torch.float32)
    meta = {"update_id": uid, "module_id": module, "path_id": path, "phase": phase, "base_version": base,
            "tokens": tokens, "codec": codec, "codec_kw": {}, "numel": d.numel()}
    assert st.put_new(f"{inbox(module)}/{uid}.st", encode_state({"payload": list(c.encode(d))}, meta))


def test_service_applies_each_update_once_across_a_crash(tmp_path: Path) -> None:
    st = FileStore(tmp_path)
    cfg = DecoupledConfig(quorum=1.0, poll_s=0.01, grace_init_s=60)
    write_module(st, MergingModuleSync("m", torch.zeros(4), [0, 1], cfg, AVG))
    write_module(st, MergingModuleSync("p", torch.zeros(4), [1], cfg, AVG))
    svc = SyncService(st, ["m", "p"], {"m": [0, 1], "p": [1]}, rounds=1, cfg=cfg, outer=AVG, inner_steps=1)
    _push(st, "m", "u0", 0, 0, 0, [1.0, 1.0, 1.0, 1.0], codec="fp16")
    assert svc.poll_once() == 0  # quorum 2 of m's paths: waiting
    _push(st, "m", "u1", 1, 0, 0, [3.0, 3.0, 3.0, 3.0])
    _push(st, "p", "v1", 1, 0, 0, [2.0, 0.0, 0.0, 0.0])
    assert svc.poll_once() == 2
    _, state, meta = read_module(st, "m")
    assert meta["version"] == 1 and state["applied"] == {"u0": 1, "u1": 1}
    torch.testing.assert_close(state["global"], torch.full((4,), -2.0))
    assert st.list(inbox("m")) == [] and len(st.list(archive("m"))) == 2
    # crash window: the version is written but the files were not archived yet
    st.move(f"{archive('m')}/u0.st", f"{inbox('m')}/u0.st")
    _push(st, "m", "u0-rerun", 0, 0, 0, [9.0, 9.0, 9.0, 9.0])  # the phase redone by another learner
    svc2 = SyncService(st, ["m", "p"], {"m": [0, 1], "p": [1]}, rounds=1, cfg=cfg, outer=AVG, inner_steps=1)
    svc2.poll_once()
    _, state, meta = read_module(st, "m")
    assert meta["version"] == 1 and state["dropped"] == {"u0-rerun": "duplicate_phase"}
    torch.testing.assert_close(state["global"], torch.full((4,), -2.0))
    # a corrupt file is dropped with a reason, not lost and not fatal
    st.put(f"{inbox('p')}/junk.st", b"\x00\x01not a blob")
    svc2.poll_once()
    report = ledger_report(st, ["m", "p"])
    assert report["ok"], report
    assert report["modules"]["m"] == {**report["modules"]["m"], "pushed": 3, "applied": 2, "dropped": 1}
    assert report["modules"]["p"]["dropped_by_reason"] == {"corrupt": 1}
    # paths done → run() drains and exits, leaving a done marker
    st.put_json(progress_key(0), {"phases_done": 1})
    st.put_json(progress_key(1), {"phases_done": 1})
    _push(st, "m", "late", 0, 1, 1, [0.0, 0.0, 0.0, 0.0])  # m's quorum can no longer fill: flushed
    svc2.run()
    assert st.get_json("done/sync-0.json")["versions"] == {"m": 2, "p": 1}
    assert ledger_report(st, ["m", "p"])["ok"]


def test_ledger_report_flags_lost_updates(tmp_path: Path) -> None:
    st = FileStore(tmp_path)
    write_module(st, MergingModuleSync("m", torch.zeros(2), [0], DecoupledConfig(), AVG))
    _push(st, "m", "orphan", 0, 0, 0, [1.0, 1.0])
    rep = ledger_report(st, ["m"])
    assert not rep["ok"] and rep["modules"]["m"]["lost"] == ["orphan"]


def test_validate_decoupled_names_the_key() -> None:
    assert validate_decoupled(DecoupledConfig()) == []
    probs = validate_decoupled(DecoupledConfig(quorum=0.0, lease_s=1.0, heartbeat_s=1.0))
    keys = [k for k, _, _ in probs]
    assert "diloco.decoupled.quorum" in keys and "diloco.decoupled.lease_s" in keys


def test_the_old_name_of_the_decoupled_worker_keys_still_loads(tmp_path: Path) -> None:
    """``diloco.decoupled.learners`` / ``slow_learners`` (run directories written before
    the decoupled process was named a decoupled worker) load as ``workers`` /
    ``slow_workers``; set both ways at once they must agree. Event logs of such stores
    (``events/learner-*.jsonl``, events naming a ``learner``) are read as workers'."""
    cfg = to_config(OmegaConf.from_dotlist(["diloco.mode=decoupled", "diloco.decoupled.learners=3",
                                            "diloco.decoupled.slow_learners=[1]"]))
    d = cfg.diloco.decoupled
    assert (d.num_workers, d.slow) == (3, [1]) and len(d.deprecated_keys()) == 2
    assert validate_decoupled(d) == []
    assert DecoupledConfig(workers=2).num_workers == 2 and DecoupledConfig().num_workers is None
    keys = [k for k, _, _ in validate_decoupled(DecoupledConfig(workers=2, learners=3))]
    assert keys == ["diloco.decoupled.learners"]
    st = FileStore(tmp_path)
    st.append_line("events/learner-L0.1-abc.jsonl", json.dumps({"t": 1.0, "e": "begin", "learner": "L0.1-abc"}))
    st.append_line("events/worker-W1.0-def.jsonl", json.dumps({"t": 2.0, "e": "begin", "worker": "W1.0-def"}))
    assert [e["worker"] for e in worker_events(st)] == ["L0.1-abc", "W1.0-def"]


def _bare_learner(dcfg: DecoupledConfig, my_sps: float | None, others_sps: float | None, H: int = 48):
    """A DecoupledWorker with only what its scheduling rules read (no grid, shards or store)."""
    lr = DecoupledWorker.__new__(DecoupledWorker)
    lr.cfg = SimpleNamespace(diloco=SimpleNamespace(inner_steps=H), trainer=SimpleNamespace(rounds=4))
    lr.dcfg, lr.sps = dcfg, my_sps
    lr.picker = PathPicker(dcfg, H, 4 * H)
    lr._others_sps = lambda: (others_sps, 3 if others_sps is not None else 0)
    return lr


def test_dynamic_local_updates_shorten_only_a_markedly_slow_learners_phase() -> None:
    d = DecoupledConfig()
    assert _bare_learner(d, None, None).phase_steps(1000) == 48  # no speed data yet: H
    assert _bare_learner(d, 0.012, 0.010).phase_steps(1000) == 48  # 1.2x: within noise, H
    assert _bare_learner(d, 0.030, 0.010).phase_steps(1000) == 16  # 3x slower: H / 3
    assert _bare_learner(d, 1.0, 0.010).phase_steps(1000) == d.min_phase_steps  # floor
    assert _bare_learner(d, 0.030, 0.010).phase_steps(5) == 5  # never past the path's budget
    assert _bare_learner(DecoupledConfig(dynamic_steps=False), 0.030, 0.010).phase_steps(1000) == 48


def test_path_progress_counts_steps_and_reads_old_files() -> None:
    assert path_steps_done(None, 50) == 0
    assert path_steps_done({"phases_done": 3}, 50) == 150  # written before dynamic steps
    assert path_steps_done({"phases_done": 5, "steps_done": 170}, 50) == 170
    assert not path_finished({"phases_done": 5, "steps_done": 170}, 4, 50)
    assert path_finished({"phases_done": 6, "steps_done": 200}, 4, 50)
