"""The across-hosts acceptance, end to end (docs/decoupled.md, "Across hosts"): from one
shell ``dipaco-train diloco.mode=decoupled`` on a directory store, from two others
``dipaco-decoupled worker STORE --count 2`` and ``dipaco-decoupled sync STORE``; the run
uses all of them (``status`` shows the second host's workers and the second
synchroniser's modules) and finishes with a checkpoint ``dipaco-infer`` scores. The same
on ``s3://`` (the local S3 server of tests/_s3.py, reached by every process through the
inherited ``AWS_*`` variables), with half the rounds: one request at a time for three
process trees is a slow store (docs/decoupled.md, "Leases on a slow store")."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _decoupled_hosts import DRILL, REPO
from _s3 import s3  # noqa: F401 (fixture, of the s3 case)
from dipaco.decoupled.fsspec_store import open_store
from dipaco.decoupled.metrics import load_events, worker_events


def _cli(module: str, *args: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("on, rounds", [("directory", 8), ("s3", 4)])
def test_a_run_joined_by_a_worker_host_and_a_synchroniser_host(on: str, rounds: int, tmp_path: Path,
                                                                request: pytest.FixtureRequest) -> None:
    run_dir = tmp_path / "run"
    # a directory store: the run directory's default; S3: a bucket of the local server
    store = str(run_dir / "decoupled") if on == "directory" else request.getfixturevalue("s3").url("runs/hosts")
    where = [] if on == "directory" else [f"diloco.decoupled.store_url={store}"]
    # every worker slot sleeps 7x its step time: the run must outlast the joining hosts'
    # start-up (a run of 2.5 s ended before the joined synchroniser's first step in CI)
    drill = [o for o in DRILL if not o.startswith("trainer.rounds=")] + [
        f"trainer.rounds={rounds}", "diloco.decoupled.slow_workers=[0,1,2,3]", "diloco.decoupled.slow_factor=8"]
    train = _cli("dipaco.cli.train", *drill, *where, "launcher.nproc=2",
                 f"hydra.run.dir={run_dir}", log=tmp_path / "train.log")
    # started with it, as a scheduler would: they wait for the store to hold the run
    worker = _cli("dipaco.fleet.cli", "worker", str(store), "--count", "2", "--wait", "300", log=tmp_path / "w.log")
    sync = _cli("dipaco.fleet.cli", "sync", str(store), "--wait", "300", log=tmp_path / "s.log")
    try:
        codes = [p.wait(timeout=500) for p in (train, worker, sync)]
    finally:
        for p in (train, worker, sync):
            p.kill()
    logs = {n: (tmp_path / n).read_text() for n in ("train.log", "w.log", "s.log")}
    assert codes == [0, 0, 0], {n: t[-3000:] for n, t in logs.items()}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds"] == rounds and math.isfinite(summary["routed_ppl"])
    assert (run_dir / "decoupled").exists() == (on == "directory")  # on S3 the store is the bucket

    status = subprocess.run([sys.executable, "-m", "dipaco.fleet.cli", "status", str(store), "--json"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert status.returncode == 0, status.stderr
    st = json.loads(status.stdout)
    roles = {r["role"]: r for r in st["hosts"].values()}
    assert set(roles) == {"train", "worker", "sync"} and st["finished"]
    joined = [w["slot"] for w in roles["worker"]["workers"]]
    assert len(joined) == 2 and len(roles["train"]["workers"]) == 2
    # the joined host's workers trained phases; the joined synchroniser stepped modules
    ended = {e["worker"].split(".")[0] for e in worker_events(open_store(store)) if e["e"] == "end"}
    assert {f"W{s}" for s in joined} <= ended, ended
    theirs = roles["sync"]["syncs"][0]
    steps = [e for e in load_events(open_store(store), theirs) if e.get("e") == "step"]
    assert steps, f"{theirs} stepped no module"
    assert all(p["steps_done"] == p["budget"] for p in st["paths"])

    score = subprocess.run([sys.executable, "-m", "dipaco.cli.infer", "score", str(run_dir), "--validation"],
                           cwd=REPO, capture_output=True, text=True, timeout=300)
    assert score.returncode == 0, score.stderr[-2000:]
    got = json.loads(score.stdout.strip().splitlines()[-1])
    assert math.isfinite(got["ppl"]) and abs(got["ppl"] - summary["routed_ppl"]) / summary["routed_ppl"] < 1e-3
