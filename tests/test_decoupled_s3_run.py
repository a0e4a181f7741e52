"""A whole decoupled run on ``s3://`` (the local S3 server of tests/_s3.py), as a user
runs it: ``dipaco-train diloco.mode=decoupled diloco.decoupled.store_url=s3://bucket/run``
in a process of its own, whose workers and synchroniser reach the server through the
inherited ``AWS_*`` variables; two workers SIGKILLed mid-run (``DIPACO_FAULT``). Then the
ledger is read back from the bucket (every pushed update applied or dropped, none
twice), every path has its budget, and ``dipaco-infer score`` scores the checkpoint.

Bounded: about a minute on an idle 2-core host (process start-up, then 4 paths x 4
phases of 8 steps of the tiny model).
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from _s3 import LocalS3, s3  # noqa: F401 (fixture)

from dipaco.decoupled.fsspec_store import FsspecStore, open_store
from dipaco.decoupled.merge import DROP_REASONS
from dipaco.decoupled.metrics import ledger_report, pushed_ids
from dipaco.decoupled.module_leases import read_module
from dipaco.decoupled.service import progress_key

R, H, PATHS = 4, 8, 4
TRAIN = ["experiment=smoke", "data.max_documents=200", f"trainer.rounds={R}", f"diloco.inner_steps={H}",
         "trainer.dense_baseline=false", "trainer.progress=false", "diloco.mode=decoupled", f"launcher.nproc={PATHS}",
         "diloco.decoupled.lease_s=1.5", "diloco.decoupled.heartbeat_s=0.3", "diloco.decoupled.timeout_s=300"]


def _cli(module: str, args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", f"from {module} import main; main()", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_a_decoupled_run_on_s3_survives_killed_workers_and_scores(s3: LocalS3, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir, url = tmp_path / "run", s3.url("runs/first")
    monkeypatch.setenv("DIPACO_FAULT", "worker_kill:every_s=1:max=2:seed=5")  # inherited by the CLI's processes
    train = _cli("dipaco.cli.train", [*TRAIN, f"diloco.decoupled.store_url={url}", f"hydra.run.dir={run_dir}"],
                 tmp_path, timeout=360)
    assert train.returncode == 0, (train.stdout[-3000:], train.stderr[-3000:])
    metrics = json.loads((run_dir / "decoupled_metrics.json").read_text())
    assert metrics["kills"] == 2 and metrics["restarts"] >= 2 and metrics["ledger_ok"], metrics
    assert not (run_dir / "decoupled").exists()  # the store is the bucket, not the run directory

    store = open_store(url)
    assert isinstance(store, FsspecStore)
    modules = store.get_json("plan.json")["module_ids"]
    report = ledger_report(store, modules)
    assert report["ok"], report
    for m in modules:
        _, state, meta = read_module(store, m)
        applied, dropped = set(state["applied"]), set(state["dropped"])
        assert pushed_ids(store, m) == applied | dropped and not applied & dropped, m
        assert set(state["dropped"].values()) <= set(DROP_REASONS), state["dropped"]
        assert set(state["applied"].values()) == set(range(1, meta["version"] + 1)), m
    for p in range(PATHS):
        assert store.get_json(progress_key(p))["steps_done"] == R * H
    # the run's events came back from the bucket's chunked logs: the kills are in them
    assert metrics["killed_workers"] >= 1 and metrics["useful_inner_steps"] >= PATHS * R * H - 1e-6

    score = _cli("dipaco.cli.infer", ["score", str(run_dir), "--validation"], tmp_path, timeout=180)
    assert score.returncode == 0, score.stderr[-3000:]
    report = json.loads(score.stdout.strip().splitlines()[-1])
    assert math.isfinite(report["ppl"]) and 1.0 < report["ppl"] < 4096, report
