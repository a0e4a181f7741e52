"""``dipaco-plan --simulate`` (dipaco/sim/): the simulated clock reproduces the plan's
compute time, a failure's exact cost, decoupled mode's own quorum decisions, a seed's
history; a bad cluster is refused in one line; the CLI writes its JSON."""
from __future__ import annotations

import dataclasses
import json
import math
from types import SimpleNamespace

import pytest
import torch

from _sim_jobs import TINY, on, tiny_job
from dipaco.cli import plan as plan_cli
from dipaco.config import compose_config
from dipaco.config.decoupled import DecoupledConfig
from dipaco.decoupled.merge import MergingModuleSync, Update
from dipaco.decoupled.lease import Lease
from dipaco.decoupled.scheduling import PathPicker
from dipaco.decoupled.store import FileStore
from dipaco.decoupled.worker import DecoupledWorker
from dipaco.sim.decoupled import Synchronizers, _DecoupledSim, simulate_decoupled
from dipaco.sim.job import SimJob, sim_job
from dipaco.sim.modes import MODES, make_mode, simulate_mode
from dipaco.sim.report import simulate_job


@pytest.fixture(scope="module")
def job() -> SimJob:
    return tiny_job()


def test_no_failures_and_an_infinitely_fast_link_take_the_plans_compute_time(job: SimJob) -> None:
    fast = on(job, link_gbps=1e12)
    compute = fast.inner_steps * fast.step_s  # one path per group: a round is H inner steps
    for r in simulate_job(fast, MODES).results:
        assert r.wall_per_round_s == pytest.approx(compute, rel=1e-6), r.mode
        assert r.time_to_tokens_s == pytest.approx(fast.rounds * compute, rel=1e-6), r.mode
        assert r.failures == 0 and r.steps_lost == 0
        if r.mode != "decoupled":
            assert r.goodput == pytest.approx(1.0, rel=1e-6), r.mode
    # a link of finite rate: sync exposes the whole exchange, as the plan's bytes say
    slow = on(job, link_gbps=0.01)
    r = simulate_mode(slow, "sync")
    assert r.exposed_per_round_s == pytest.approx(slow.rank_bytes() * 8 / 0.01e9)
    assert r.bytes_per_round == slow.rank_bytes() * slow.groups


def test_a_failure_costs_exactly_the_work_since_the_checkpoint_plus_the_restart(job: SimJob) -> None:
    j = dataclasses.replace(on(job, link_gbps=1e12, detect_s=7.0, restart_s=100.0), rounds=6, checkpoint_every=2)
    rnd = j.inner_steps * j.step_s
    clean = simulate_mode(j, "sync")
    at = 2 * rnd + 1.5 * rnd  # in round 4: round 3 ran since the checkpoint after round 2
    hit = simulate_mode(j, "sync", failures_at=[at])
    lost = 1.5 * rnd  # round 3 and half of round 4
    assert hit.wall_s == pytest.approx(clean.wall_s + lost + 7.0 + 100.0)
    assert hit.steps_lost == pytest.approx(1.5 * j.inner_steps * j.paths)
    assert hit.failures == 1 and hit.goodput < clean.goodput
    # elastic: the survivors lose only the round in flight and go on without the group
    el = simulate_mode(dataclasses.replace(j, checkpoint_every=1), "elastic", failures_at=[at])
    assert el.steps_lost == pytest.approx(0.5 * j.inner_steps * j.paths)


def _real_triggers(arrivals: list[tuple[float, int, int]], sharing: list[int], cfg: DecoupledConfig) -> list[tuple]:
    """The trainer's MergingModuleSync on the arrivals, checked at each arrival and at
    each grace expiry (what its service loop does, without the polling delay)."""
    sync = MergingModuleSync("m", torch.zeros(3), sharing, cfg, {"name": "sgd", "lr": 1.0, "momentum": 0.0, "nesterov": False})
    out, queue = [], list(arrivals)
    while queue or sync.pending:
        deadline = (sync.first_pending_at + sync.grace_s()) if sync.pending else math.inf
        if queue and queue[0][0] < deadline:
            now, path, base = queue.pop(0)
            sync.offer(Update(f"u{len(out)}-{now}", "m", path, int(now * 1000), base, 1.0, torch.ones(3)), now)
        else:
            now = deadline
        why = sync.due(now)
        if why:
            rec = sync.step(now, why)
            out.append((now, why, sorted(rec.paths), rec.version))
    return out


def test_decoupled_quorum_decisions_equal_the_real_policy() -> None:
    import simpy

    cfg = DecoupledConfig(quorum=0.5, grace_init_s=2.0, grace_factor=2.0, grace_min_s=0.1, grace_max_s=30.0,
                          max_staleness=1)
    sharing = [0, 1, 2, 3]
    # (time, path, base version): quorum fills, a straggler waits out the grace window, stale ones drop
    arrivals = [(0.0, 0, 0), (0.5, 1, 0), (1.0, 2, 0), (4.0, 3, 0), (4.2, 0, 1), (9.0, 1, 1), (9.1, 2, 0),
                (9.3, 3, 2), (20.0, 0, 3)]
    env = simpy.Environment()
    sim = Synchronizers(env, cfg, {"m": sharing}, lambda p: None, lambda p, s, t: None)

    def feed():
        for t, path, base in arrivals:
            yield env.timeout(t - env.now)
            sim.offer("m", path, base, 1.0)

    env.process(feed())
    env.run(until=100)
    got = [(pytest.approx(t), why, paths, v) for t, why, paths, v in sim.modules["m"].steps]
    assert got == _real_triggers(arrivals, sharing, cfg)
    assert {w for _, w, _, _ in sim.modules["m"].steps} == {"quorum", "grace"}


def _real_worker(store: FileStore, d: DecoupledConfig, H: int, rounds: int, progress: list[int],
                 ratio: float | None, last_path: int | None) -> DecoupledWorker:
    """A DecoupledWorker with only what its scheduling reads: ``progress`` per path, a
    speed ``ratio`` against 3 others, its last path; ties broken as the simulator does."""
    w = DecoupledWorker.__new__(DecoupledWorker)
    w.cfg = SimpleNamespace(diloco=SimpleNamespace(inner_steps=H), trainer=SimpleNamespace(rounds=rounds))
    w.dcfg, w.store, w.id, w.index = d, store, "W0.0-test", 0
    w.grid = SimpleNamespace(num_paths=len(progress))
    w.rng = SimpleNamespace(random=lambda: 0.0)
    w.sps = None if ratio is None else 0.01 * ratio
    w._others_sps = lambda: (0.01, 3)
    w._progress = lambda p: progress[p]
    w.picker = PathPicker(d, H, rounds * H)
    w.picker.held(last_path) if last_path is not None else None
    return w


@pytest.mark.parametrize("progress, held, ratio, last_path, path", [
    ([20, 10, 30, 10], [], None, None, 1),     # speed not known yet: the least advanced, lowest first
    ([20, 10, 30, 10], [1], 1.1, 2, 3),        # within the threshold: the least advanced free one
    ([20, 10, 30, 10], [], 3.0, None, 2),      # markedly slow: the most advanced
    ([20, 10, 30, 10], [], 3.0, 2, 0),         # ... but not the one it just held
    ([20, 10, 30, 10], [0], 3.0, 2, 1),        # ... nor a held one
    ([38, 39, 40, 37], [], 3.0, None, None),   # the tail: the others finish what is left
    ([40, 40, 40, 40], [], None, None, None),  # every path has its budget
])
def test_the_simulator_picks_paths_and_phases_with_the_workers_own_rules(
        tmp_path, progress: list[int], held: list[int], ratio: float | None, last_path: int | None,
        path: int | None) -> None:
    """The simulated worker and a real one, in the same state, lease the same path and run
    a phase of the same length (one :class:`PathPicker`, driven by two clocks)."""
    d = DecoupledConfig(slow_threshold=1.5)
    H, rounds = 10, 4
    store = FileStore(tmp_path)
    for p in held:
        assert Lease(store, f"path_{p}", "W9.0-other", 60.0).acquire()
    real = _real_worker(store, d, H, rounds, progress, ratio, last_path)
    lease, _ = real.pick()
    want = None if lease is None else int(lease.name.split("_")[1])
    assert want == path

    job = sim_job(compose_config(TINY + ["diloco.mode=decoupled", "grid=2x2", f"trainer.rounds={rounds}",
                                         f"diloco.inner_steps={H}", "diloco.decoupled.slow_threshold=1.5",
                                         "diloco.decoupled.workers=4", "cluster.chips=4"]))
    sim = _DecoupledSim(job, None)
    sim.progress = [float(k) for k in progress]
    sim.held = set(held)
    sim.slowness[0] = ratio
    if last_path is not None:
        sim.pickers[0].held(last_path)
    assert sim._pick(0) == want
    if want is not None:
        left = rounds * H - progress[want]
        assert sim.pickers[0].phase_steps(left, ratio) == real.phase_steps(left)


def test_a_seed_gives_one_history(job: SimJob) -> None:
    rough = on(job, mtbf_hours=0.02, detect_s=1.0, restart_s=3.0, straggler="lognormal", straggler_sigma=0.3,
               link_gbps=0.05)
    a = [r.to_dict() for r in simulate_job(rough, MODES).results]
    b = [r.to_dict() for r in simulate_job(rough, MODES).results]
    c = [r.to_dict() for r in simulate_job(on(rough, seed=1), MODES).results]
    assert a == b and a != c
    assert simulate_decoupled(rough).failures >= 0


@pytest.mark.parametrize("override, key", [("cluster.link_gbps=0", "cluster.link_gbps"),
                                           ("cluster.mtbf_hours=-5", "cluster.mtbf_hours"),
                                           ("cluster.chips_per_group=8", "cluster.chips_per_group")])
def test_a_bad_cluster_is_refused_in_one_line(override: str, key: str, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        plan_cli.main(["--simulate", *TINY, override])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and key in err, err


def test_the_cli_simulates_a_tiny_config_and_writes_json(tmp_path, capsys) -> None:
    out = tmp_path / "sim.json"
    plan_cli.main(["--simulate", *TINY, "--json", str(out)])
    text = capsys.readouterr().out
    assert all(m in text for m in MODES) and "goodput" in text
    data = json.loads(out.read_text())
    assert set(data["modes"]) == set(MODES) and data["job"]["paths"] == 4
    assert data["modes"]["sync"]["wall_per_round_s"] > 0


def test_a_horizon_keeps_the_rounds_that_ended_before_it(job: SimJob) -> None:
    slow = on(job, link_gbps=0.01)
    rnd = slow.inner_steps * slow.step_s + slow.rank_bytes() * 8 / 0.01e9
    r = simulate_mode(slow, "sync", horizon_s=10.5 * rnd)  # inside the first block of rounds
    assert r.rounds == 10 and r.exposed_share > 0
    assert r.tokens_applied == 10 * slow.paths * slow.inner_steps * slow.tokens_per_step


def test_only_the_simulator_reads_the_cluster() -> None:
    """A cluster key set for dipaco-train (or any command that does not simulate) is
    refused in one line naming it; dipaco-plan --simulate takes it; the default passes."""
    from dipaco.config import ConfigError
    from dipaco.job.preflight import compose, preflight

    preflight(compose(["experiment=smoke"]))  # the default cluster: nothing to refuse
    cfg = compose(TINY)
    with pytest.raises(ConfigError) as e:
        preflight(cfg)
    assert "cluster.chips" in str(e.value) and "dipaco-plan --simulate" in str(e.value)
    preflight(compose(TINY), simulating=True)


@pytest.mark.parametrize("fragments", [None, 1, 2, 3])
def test_a_paths_streaming_fragments_carry_what_its_round_sends(fragments: int | None) -> None:
    """Each path's simulated fragments add up to the bytes its synchronous round sends (the
    smoke config: 303,928 per rank), whatever the fragments group: a sync point holding
    several stages carries the path's module of each, not one module."""
    extra = [] if fragments is None else [f"diloco.streaming_fragments={fragments}"]
    job = sim_job(compose_config(TINY + ["diloco.streaming=true"] + extra))
    shares = make_mode("streaming", job).shares
    assert [sum(n for _, _, n in share) for share in shares] == [job.rank_bytes()] * len(shares)
    assert job.rank_bytes() == 303_928 and len(shares[0]) == (fragments or 3)


def test_streaming_with_one_fragment_and_no_delay_costs_the_synchronous_round(job: SimJob) -> None:
    """One fragment at step H, landing at once: the synchronous round, exactly (a slow
    link, stragglers and failures drawn alike in both)."""
    one = sim_job(compose_config(TINY + ["diloco.streaming=true", "diloco.streaming_fragments=1",
                                         "diloco.streaming_delay=0"]))
    rough = on(one, link_gbps=0.01, straggler="lognormal", straggler_sigma=0.3, mtbf_hours=0.05)
    sync, stream = (simulate_mode(rough, m).to_dict() for m in ("sync", "streaming"))
    assert stream.pop("mode") == "streaming" and sync.pop("mode") == "sync"
    assert stream == sync and sync["exposed_per_round_s"] > 0 and sync["failures"] > 0
