"""``launcher=slurm diloco.mode=decoupled`` against the fake SLURM (tests/fake_slurm.py),
through Hydra's submitit launcher as on a login node: the job's tasks are the run's
hosts (task 0 makes the run and finishes it; every task runs a decoupled worker, the
first ``sync_procs`` a synchroniser). SIGUSR2 to every task mid-run (as SLURM sends it
before the time limit): task 0 checkpoints the last phase every path finished and
requeues the job; the requeued tasks rejoin the run in the store and finish it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import fake_slurm
from _decoupled_hosts import check_accounts, wait_for
from dipaco.decoupled.owner import PLAN_KEY, RUN_KEY
from dipaco.decoupled.service import path_steps_done, progress_key
from dipaco.decoupled.store import FileStore

DECOUPLED = ["experiment=smoke", "data.max_documents=200", "diloco.mode=decoupled", "trainer.rounds=8",
             "diloco.inner_steps=8", "trainer.dense_baseline=false", "trainer.threads=1",
             "diloco.decoupled.sync_procs=2", "diloco.decoupled.lease_s=3", "diloco.decoupled.heartbeat_s=0.5",
             # every worker sleeps 2x its step time: the run lasts long enough to be signalled mid-way
             "diloco.decoupled.slow_workers=[0,1,2]", "diloco.decoupled.slow_factor=3"]
SLURM = ["launcher=slurm", "launcher.partition=fake", "launcher.nproc=3", "launcher.group_size=1",
         "launcher.gpus_per_node=null", "launcher.cpus_per_task=1", "launcher.backend=gloo"]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_decoupled_job_runs_its_roles_as_tasks_requeues_and_rejoins(tmp_path: Path) -> None:
    env = dict(os.environ, **fake_slurm.install(tmp_path / "bin", tmp_path / "slurm"), HYDRA_FULL_ERROR="0",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    login = subprocess.Popen([sys.executable, "-c", "from dipaco.cli.train import main; main()", *DECOUPLED, *SLURM,
                              f"hydra.sweep.dir={tmp_path}/sweep", "hydra.sweep.subdir=run"], cwd=tmp_path, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_dir = tmp_path / "sweep" / "run"
    try:
        wait_for("the run in the store", lambda: (run_dir / "decoupled" / RUN_KEY).is_file(), timeout=300, poll=0.5)
        store = FileStore(run_dir / "decoupled")
        plan = store.get_json(PLAN_KEY)
        # every task is a host of the run; signal them once every path has a round's steps
        wait_for("three tasks mid-run", lambda: len(store.list("hosts")) == 3 and min(
            path_steps_done(store.get_json(progress_key(p)), 8) for p in range(plan["num_paths"])) >= 8,
                 timeout=300, poll=0.2)
        pids = [store.get_json(f"hosts/{n}")["pid"] for n in store.list("hosts")]
        for pid in pids:
            os.kill(pid, signal.SIGUSR2)
        out, err = login.communicate(timeout=500)
    finally:
        if login.poll() is None:
            login.kill()
    logs = tmp_path / "sweep" / ".submitit" / "1"
    err0 = (logs / "1_0_log.err").read_text()
    assert login.returncode == 0, (err[-3000:], err0[-3000:])
    assert (tmp_path / "slurm" / "requeues.log").read_text().splitlines() == ["requeue 1 SLURM_RESTART_COUNT=0"]
    assert (tmp_path / "slurm" / "attempts_1").read_text().split() == ["0", "1"]
    assert "stopped by SIGUSR2" in err0 and "requeued SLURM job 1 (requeue 1 of" in err0
    for t in (1, 2):
        assert "the run goes on from its store" in (logs / f"1_{t}_log.out").read_text()
    # both attempts' tasks were hosts of the run; the second attempt's rejoined and finished it
    roles = sorted(store.get_json(f"hosts/{n}")["role"] for n in store.list("hosts"))
    assert roles == ["slurm task 1"] * 2 + ["slurm task 2"] * 2 + ["train"] * 2
    assert store.get_json(RUN_KEY)["slurm"] == {"job": "1", "restart": 1}
    counts = check_accounts(store, plan)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds"] == 8 and summary["launcher"] == "slurm" and summary["resumed_from_round"] >= 1
    print("slurm:", json.dumps(counts))
