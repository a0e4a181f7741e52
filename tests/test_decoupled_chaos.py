"""Decoupled mode with real processes: chaos (SIGKILL + delays), sync equivalence, the CLI path.

One synchronous run of the smoke experiment (6 rounds of H=8 on a [2,2] grid) is the
reference. On its prepared run directory (same tokenizer, router and shards):

* the chaos run: 4 decoupled worker processes, randomly stalled inside phases, 4 of them SIGKILLed
  and restarted; it must finish, every pushed update must be applied or dropped with a
  reason (none lost, none applied twice), and the routed validation loss must stay
  within ``LOSS_TOL`` nats of the synchronous run at the same number of inner steps;
* the degenerate run: quorum 1, workers wait for their own update, no grace expiry —
  decoupled mode then *is* the synchronous algorithm, and ends on the same weights.

Bounded: about 60-80 s in all on a quiet 2-core machine (most of it process start-up).
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from dipaco.storage.tensor_io import load_state
from dipaco.config import compose_config
from dipaco.config.decoupled import DecoupledConfig
from dipaco.decoupled.metrics import ledger_report, pushed_ids
from dipaco.decoupled.run import run_decoupled
from dipaco.decoupled.store import FileStore
from dipaco.decoupled.merge import DROP_REASONS
from dipaco.decoupled.module_leases import read_module
from dipaco.decoupled.service import progress_key
from dipaco.job.prepare import prepare
from dipaco.run.run_dir import RunDir
from dipaco.job.train import _evaluate, train

R, H = 6, 8
SMOKE = ["experiment=smoke", "data.max_documents=200", f"trainer.rounds={R}", f"diloco.inner_steps={H}",
         "trainer.dense_baseline=false", "trainer.progress=false"]
# |ln ppl_decoupled − ln ppl_sync| = difference of mean validation loss in nats. How much
# staleness the kills and stalls cause depends on the host's load and on the seed. Twelve
# fault seeds (1..12) on a 2-core host with nothing else running: 0.09 to 0.20 nats above
# the sync run with delayed Nesterov (momentum_every=4, the default). Until run_decoupled
# forced decoupled mode's optimiser, this test stepped with plain Nesterov: 0.03 to 0.41
# over the same seeds, and once 1.8 in CI. The ledger assertions above are what catch lost
# or doubly applied updates; the bound leaves room for a loaded CI host.
LOSS_TOL = 0.4


def routed_loss(run_dir: Path, ckpt: Path) -> float:
    cfg = compose_config(SMOKE, run_dir)
    run = RunDir.at(run_dir)
    return math.log(_evaluate(cfg, run, prepare(cfg, run), ckpt)["once"]["ppl"])


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float, dict]:
    run_dir = tmp_path_factory.mktemp("sync")
    summary = train(compose_config(SMOKE, run_dir))
    ckpt = run_dir / "checkpoints" / f"round_{R:06d}"
    weights = {p.stem: load_state(p) for p in (ckpt / "modules").glob("*.safetensors")}
    return run_dir, math.log(summary["routed_ppl"]), weights


def _fresh(run_dir: Path) -> None:
    """Reuse the prepared run directory for another training run (drop the old weights)."""
    import shutil

    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_chaos_killed_and_delayed_learners(sync_run: tuple[Path, float, dict],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir, sync_loss, _ = sync_run
    _fresh(run_dir)
    cfg = compose_config(SMOKE, run_dir)
    # the one fault-injection mechanism of both modes (dipaco/runtime/faults.py); spawned workers inherit it
    monkeypatch.setenv("DIPACO_FAULT", "worker_kill:every_s=0.4:max=4:seed=3;worker_delay:prob=0.5:s=0.8:seed=3")
    dcfg = DecoupledConfig(workers=4, lease_s=1.5, heartbeat_s=0.3, timeout_s=200)
    res = run_decoupled(cfg, RunDir.at(run_dir), dcfg)
    m = res.decoupled
    assert res.completed_rounds == R
    assert m["kills"] == 4 and m["restarts"] >= 4
    # kills land mid-phase (the supervisor prefers lease holders): those paths were taken
    # over by other workers after the lease expired
    assert m["lease_takeovers"] >= 1 and m["killed_phases"] >= 1

    # the ledger: every pushed update applied XOR dropped with a known reason, none twice
    store = FileStore(run_dir / "decoupled")
    modules = list(m["module_versions"])
    report = ledger_report(store, modules)
    assert report["ok"], report
    for mid in modules:
        _, state, meta = read_module(store, mid)
        pushed = pushed_ids(store, mid)
        applied, dropped = set(state["applied"]), set(state["dropped"])
        assert pushed == applied | dropped and not applied & dropped, mid
        assert set(state["dropped"].values()) <= set(DROP_REASONS), state["dropped"]
        # each applied id went into exactly one version, versions 1..V all used
        assert set(state["applied"].values()) == set(range(1, meta["version"] + 1)), mid
    for p in range(4):  # phases may be shorter than H (dynamic steps for stalled workers)
        assert store.get_json(progress_key(p))["steps_done"] == R * H
    # the work that counted: every path's R·H steps, once each, in every module of the path
    assert m["useful_inner_steps"] >= 4 * R * H - 1e-6
    assert 0 < m["step_goodput"] <= 1.0

    loss = routed_loss(run_dir, Path(res.checkpoint))
    assert abs(loss - sync_loss) <= LOSS_TOL, (loss, sync_loss)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_full_quorum_and_waiting_learners_reproduce_sync(sync_run: tuple[Path, float, dict]) -> None:
    run_dir, sync_loss, sync_weights = sync_run
    _fresh(run_dir)
    cfg = compose_config(SMOKE, run_dir)
    dcfg = DecoupledConfig(workers=4, quorum=1.0, pull_wait_s=120, pull_wait_fraction=None, grace_init_s=120,
                           grace_min_s=120, grace_max_s=120, dynamic_steps=False, momentum_every=1,
                           timeout_s=200)
    res = run_decoupled(cfg, RunDir.at(run_dir), dcfg)
    # one outer step per module per round, every update fresh: the synchronous schedule
    assert set(res.decoupled["staleness_histogram"]) == {"0"}
    assert set(res.decoupled["module_versions"].values()) == {R}
    ckpt = Path(res.checkpoint)
    for mid, ref in sync_weights.items():
        got = load_state(ckpt / "modules" / f"{mid}.safetensors")
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], atol=2e-4, rtol=1e-3, msg=f"{mid}/{k}")


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_train_dispatches_decoupled_mode(tmp_path: Path) -> None:
    """``dipaco-train diloco.mode=decoupled launcher.nproc=4``: same outputs as a sync run."""
    summary = train(compose_config(["experiment=smoke", "data.max_documents=200", "diloco.mode=decoupled",
                                    "launcher.nproc=4", "trainer.dense_baseline=false"], tmp_path))
    assert summary["rounds"] == 2 and 1.0 < summary["routed_ppl"] < 512 and summary["bytes_sent"] > 0
    assert (tmp_path / "checkpoints" / "round_000002" / "manifest.json").is_file()
    assert (tmp_path / "decoupled_metrics.json").is_file()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
