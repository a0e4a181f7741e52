"""Preemptible SLURM jobs (dipaco/runtime/preempt.py, dipaco/runtime/slurm.py, dipaco/cli/slurm_launcher.py).

The end-to-end test runs ``dipaco-train launcher=slurm`` against a fake SLURM
(tests/fake_slurm.py: ``sbatch``, ``srun``, ``scontrol``, ``sacct`` on PATH) through
Hydra's submitit launcher, as on a login node: SIGUSR2 in round 2 → the round's
checkpoint → ``scontrol requeue`` → the requeued job resumes, and its weights and
perplexity equal an uninterrupted run's bit for bit.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fake_slurm
from dipaco.config import ConfigError, compose_config
from dipaco.run.lock import restart_count
from dipaco.runtime.preempt import DEADLINE_MARGIN_S, RequeueDeadline, requeued_resume, stopped
from dipaco.run.results import RoundsResult
from dipaco.run.run_dir import RunDir, RunDirError
from dipaco.run.lock import LOCK_NAME, RunLock, check_unlocked
from dipaco.runtime.placement import place_rank
from dipaco.cli.slurm_launcher import describe_failure, report_failures
from dipaco.job.train import train
from dipaco.config.validate import validate_config

# deterministic kernels: on a CUDA host the requeued run and its reference are compared bit for bit
SMOKE = ["experiment=smoke", "trainer.rounds=4", "trainer.dense_baseline=false", "trainer.threads=1",
         "trainer.deterministic=true"]
SLURM = ["launcher=slurm", "launcher.partition=fake", "launcher.nproc=2", "launcher.group_size=1", "launcher.gpus_per_node=null",
         "launcher.cpus_per_task=1", "launcher.backend=gloo"]


def _documents(path: Path) -> list[str]:
    """240 small documents of four kinds as jsonl (quicker to load than the stdlib corpus)."""
    kinds = ("def f{i}(x):\n    return x * {i} + len('{i}')\n", "import os{i}\nprint(os{i}.getcwd())\n",
             "class C{i}:\n    value = {i}\n    name = 'c{i}'\n", "# note {i}: the quick brown fox {i} times\n")
    path.write_text("".join(json.dumps({"text": kinds[i % 4].format(i=i) * 4}) + "\n" for i in range(240)))
    return ["data=jsonl", f"data.path={path}"]


def _weights(run_dir: Path, round_idx: int) -> dict[str, dict[str, torch.Tensor]]:
    from dipaco.storage.tensor_io import load_state

    ckpt = run_dir / "checkpoints" / f"round_{round_idx:06d}" / "modules"
    return {p.stem: load_state(p) for p in sorted(ckpt.glob("*.safetensors"))}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_usr2_checkpoints_requeues_and_resumes_as_uninterrupted(tmp_path: Path) -> None:
    """SIGUSR2 reaches rank 1 as round 2 starts (rank 0 learns it at the round's end): both
    ranks finish round 2, its checkpoint is committed, rank 0 runs ``scontrol requeue``,
    and the requeued job (SLURM_RESTART_COUNT=1) runs with resume=true from round 2."""
    data = _documents(tmp_path / "docs.jsonl")
    env = dict(os.environ, **fake_slurm.install(tmp_path / "bin", tmp_path / "slurm"),
               DIPACO_FAULT="signal:sig=USR2:round=2:rank=1", HYDRA_FULL_ERROR="0", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", "from dipaco.cli.train import main; main()", *SMOKE, *data, *SLURM,
                           f"hydra.sweep.dir={tmp_path}/sweep", "hydra.sweep.subdir=run"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    logs = tmp_path / "sweep" / ".submitit" / "1"
    out0 = (logs / "1_0_log.out").read_text() if (logs / "1_0_log.out").exists() else ""
    assert proc.returncode == 0, (proc.stderr[-3000:], out0[-3000:])
    assert (tmp_path / "slurm" / "requeues.log").read_text().splitlines() == ["requeue 1 SLURM_RESTART_COUNT=0"]
    assert (tmp_path / "slurm" / "attempts_1").read_text().split() == ["0", "1"]  # ran twice
    err0 = (logs / "1_0_log.err").read_text()
    assert "stopped by SIGUSR2 after round 2" in err0 and "requeued SLURM job 1 (requeue 1 of" in err0
    assert "rank 0 requeues the job" in (logs / "1_1_log.err").read_text()
    assert "requeued (1 of launcher.max_requeues=3): resume=true" in out0
    assert "resumed from round_000002 (round 2)" in out0
    run = tmp_path / "sweep" / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from_round"] == 2 and summary["launcher"] == "slurm"

    # the same run, uninterrupted, in one process (local backend): the same bits
    reference = train(compose_config(SMOKE + data + ["launcher=local", "launcher.nproc=2"], tmp_path / "reference"))
    a, b = _weights(run, 4), _weights(tmp_path / "reference", 4)
    assert a.keys() == b.keys() and a
    for mid in a:
        for k in a[mid]:
            assert torch.equal(a[mid][k], b[mid][k]), (mid, k)
    assert summary["routed_ppl"] == reference["routed_ppl"]


def test_dry_run_prints_the_job_and_each_task_and_submits_nothing(tmp_path: Path, capsys, monkeypatch) -> None:
    from dipaco.cli import train as train_cli

    fake = fake_slurm.install(tmp_path / "bin", tmp_path / "slurm")
    monkeypatch.setenv("PATH", fake["PATH"])
    monkeypatch.setenv("FAKE_SLURM_DIR", fake["FAKE_SLURM_DIR"])
    monkeypatch.setattr(sys, "argv", ["dipaco-train", "launcher=slurm", "launcher.dry_run=true", "launcher.nodes=2",
                                      "launcher.partition=gpu", "grid=4x4", f"hydra.sweep.dir={tmp_path}/sweep"])
    with pytest.raises(SystemExit) as done:
        train_cli.main()
    assert done.value.code == 0
    out = capsys.readouterr().out.splitlines()
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=8", "#SBATCH --cpus-per-task=8",
                 "#SBATCH --signal=USR2@120", "#SBATCH --partition=gpu"):
        assert line in out, line
    assert any(x.startswith("srun ") and "submitit.core._submit" in x for x in out)
    rows = [x.split() for x in out if x[:2] == "# " and x[2:].split()[:1] and x[2:].split()[0].isdigit()]
    assert len(rows) == 16  # 2 nodes x 8 tasks: task, node, RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, ...
    assert rows[9][1:7] == ["9", "1", "9", "1", "16", "8"]
    assert rows[9][-1] == "8"  # threads = launcher.cpus_per_task
    assert not (tmp_path / "sweep").exists() and not (tmp_path / "slurm").exists()  # sbatch never ran


def test_dry_run_needs_neither_srun_nor_a_partition(tmp_path: Path, capsys, monkeypatch) -> None:
    from dipaco.cli import train as train_cli

    monkeypatch.setenv("PATH", str(tmp_path))  # no srun, no sbatch
    monkeypatch.setattr(sys, "argv", ["dipaco-train", "launcher=slurm", "launcher.dry_run=true", "launcher.nproc=2",
                                      f"hydra.sweep.dir={tmp_path}/sweep"])
    with pytest.raises(SystemExit) as done:
        train_cli.main()
    out = capsys.readouterr().out
    assert done.value.code == 0 and "#SBATCH --ntasks-per-node=2" in out and "--partition" not in out


@pytest.mark.parametrize(("override", "key"), [("launcher.cpus_per_task=0", "launcher.cpus_per_task"),
                                               ("launcher.max_requeues=-1", "launcher.max_requeues")])
def test_bad_preemption_settings_name_the_key(override: str, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate_config(compose_config(["launcher=slurm", "launcher.partition=p", "launcher.nproc=4", override]))
    assert err.value.key == key


def test_dry_run_outside_slurm_is_refused() -> None:
    with pytest.raises(ConfigError) as err:
        validate_config(compose_config(["launcher.dry_run=true"]))
    assert err.value.key == "launcher.dry_run"


def _result(done: int) -> RoundsResult:
    return RoundsResult(rounds=4, completed_rounds=done, start_round=0, world_size=2,
                        checkpoint=f"/r/checkpoints/round_{done:06d}")


@pytest.mark.parametrize(("sig", "env", "asked", "needle"), [
    ("SIGUSR2", {"SLURM_JOB_ID": "7"}, ["7"], "requeued SLURM job 7 (requeue 1 of launcher.max_requeues=3)"),
    ("SIGUSR2", {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "3"}, [], "launcher.max_requeues=3 reached"),
    ("SIGTERM", {"SLURM_JOB_ID": "7"}, [], "continue with: dipaco-train hydra.run.dir=/r resume=true"),
    ("SIGUSR2", {}, [], "SLURM_JOB_ID is not set"),
])
def test_requeue_only_on_usr2_and_within_max_requeues(sig: str, env: dict, asked: list, needle: str) -> None:
    """SIGTERM (scancel, or a scheduler that requeues by itself) never requeues; SIGUSR2
    requeues at most launcher.max_requeues times, counted by SLURM_RESTART_COUNT."""
    calls: list[str] = []
    cfg = compose_config(["launcher=slurm", "launcher.partition=p"])
    e = stopped(cfg, RunDir(Path("/r")), _result(2), sig, requeue_here=True, env=env, requeue=calls.append)
    assert calls == asked
    assert str(e).startswith(f"stopped by {sig} after round 2; last complete checkpoint /r/checkpoints/round_000002")
    assert needle in str(e) and "\n" not in str(e)


def test_a_failed_scontrol_is_said_and_the_resume_command_given() -> None:
    def refuse(job: str) -> None:
        raise subprocess.CalledProcessError(1, ["scontrol"], stderr="scontrol: error: Job is not requeueable\n")

    cfg = compose_config(["launcher=slurm", "launcher.partition=p"])
    e = stopped(cfg, RunDir(Path("/r")), _result(1), "SIGUSR2", requeue_here=True, env={"SLURM_JOB_ID": "9"},
                requeue=refuse)
    assert "`scontrol requeue 9` failed (scontrol: error: Job is not requeueable)" in str(e)
    assert str(e).endswith("resume=true")


def test_a_requeued_job_resumes_and_a_first_one_does_not() -> None:
    cfg = compose_config(["launcher=slurm", "launcher.partition=p"])
    said: list[str] = []
    assert requeued_resume(cfg, {}, said.append) is cfg and not said
    assert requeued_resume(cfg, {"SLURM_RESTART_COUNT": "2", "SLURM_JOB_ID": "5"}, said.append).resume
    assert said == ["SLURM job 5 requeued (2 of launcher.max_requeues=3): resume=true"]
    local = compose_config([])
    assert requeued_resume(local, {"SLURM_RESTART_COUNT": "2"}, said.append) is local  # only launcher=slurm
    assert restart_count({"SLURM_RESTART_COUNT": "x"}) == 0


def test_task_threads_follow_cpus_per_task_unless_trainer_threads() -> None:
    task = {"SLURM_LOCALID": "0", "SLURM_NTASKS_PER_NODE": "4"}
    assert place_rank("slurm", {**task, "SLURM_CPUS_PER_TASK": "6"}, cpu_count=64).threads == 6
    assert place_rank("slurm", {**task, "SLURM_CPUS_PER_TASK": "6"}, threads=2, cpu_count=64).threads == 2
    assert place_rank("slurm", task, cpu_count=64).threads == 16  # no cpus_per_task: the node's cores shared


def _task_logs(folder: Path, job: str, errors: dict[int, str], mtimes: dict[int, float]) -> None:
    folder.mkdir(parents=True)
    for t, text in errors.items():
        log = folder / f"{job}_{t}_log.err"
        log.write_text(text)
        os.utime(log, (mtimes[t], mtimes[t]))


def test_a_failed_job_is_one_line_naming_the_first_failing_task_and_its_log(tmp_path: Path) -> None:
    """Task 1 failed first (its own error); task 0 failed later, at a collective: task 1 is named."""
    folder = tmp_path / ".submitit" / "42"
    _task_logs(folder, "42", {0: "submitit INFO ...\nRuntimeError: Connection closed by peer\n",
                              1: "dipaco: error: launcher=slurm but SLURM_PROCID not set: submit with ...\n"},
               {0: 2000.0, 1: 1000.0})
    message = (f"Job 42 (task: 0) with path {folder}/42_0_result.pkl\nhas not produced any output (state: FAILED)\n"
               "Error stream produced:\n----\nRuntimeError: Connection closed by peer")
    line = describe_failure(message, str(tmp_path / ".submitit" / "%j"))
    assert line == (f"SLURM job 42 failed in task 1 (rank 1): dipaco: error: launcher=slurm but SLURM_PROCID not "
                    f"set: submit with ...; its log: {folder}/42_1_log.err")


def test_report_failures_exits_1_with_one_line(tmp_path: Path, capsys) -> None:
    from submitit.core.utils import UncompletedJobError

    folder = tmp_path / ".submitit" / "8"
    _task_logs(folder, "8", {0: "Traceback (most recent call last):\n  ...\nKeyboardInterrupt\n"}, {0: 1.0})

    def launch() -> None:
        raise UncompletedJobError(f"Job 8 (task: 0) with path {folder}/8_0_result.pkl\nhas not produced any output")

    with pytest.raises(SystemExit) as done:
        report_failures(launch, str(tmp_path / ".submitit" / "%j"))
    assert done.value.code == 1
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert err == [f"dipaco: error: SLURM job 8 failed in task 0 (rank 0): KeyboardInterrupt; its log: "
                   f"{folder}/8_0_log.err"]


def test_a_round_that_cannot_end_in_time_is_abandoned_at_the_deadline() -> None:
    """SIGUSR2 with the job's end 0.2 s past the margin: the deadline requeues by itself,
    once, and the normal path then does not requeue again."""
    import time

    cfg = compose_config(["launcher=slurm", "launcher.partition=p"])
    env = {"SLURM_JOB_ID": "3", "SLURM_JOB_END_TIME": str(int(time.time() + DEADLINE_MARGIN_S + 1))}
    calls: list[str] = []
    said: list[str] = []
    deadline = RequeueDeadline(cfg, env, requeue=calls.append, log=said.append)
    deadline.arm("SIGTERM")  # scancel / a preempting scheduler: no deadline
    assert deadline._timer is None
    deadline.arm("SIGUSR2")
    for _ in range(60):
        if calls:
            break
        time.sleep(0.05)
    assert calls == ["3"] and "abandoning it and requeueing now" in said[0]
    assert deadline.claim() is False  # the stop at the round boundary must not requeue twice
    on_time = RequeueDeadline(cfg, {**env, "SLURM_JOB_END_TIME": str(int(time.time() + 600))}, requeue=calls.append)
    on_time.arm("SIGUSR2")
    assert on_time.claim() is True  # the round ended in time: the normal path requeues
    time.sleep(0.1)
    assert calls == ["3"]
    unknown = RequeueDeadline(cfg, {"SLURM_JOB_ID": "3"}, requeue=calls.append)
    unknown.arm("SIGUSR2")  # SLURM < 21.08: no end time, nothing armed
    assert unknown._timer is None and unknown.seconds_left() is None


def test_a_requeued_attempt_takes_over_the_lock_of_an_earlier_one(tmp_path: Path, monkeypatch) -> None:
    """The earlier attempt ran on another node (its PID cannot be checked there); SLURM
    ended it before restarting the job, so the lock is stale for the next attempt only."""
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": 1, "host": "node-elsewhere", "slurm_job": "12",
                                                  "slurm_restart": 0}))
    monkeypatch.setenv("SLURM_JOB_ID", "12")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    with pytest.raises(RunDirError, match="in use by another dipaco run"):
        check_unlocked(tmp_path)  # the same attempt: a live holder elsewhere
    monkeypatch.setenv("SLURM_JOB_ID", "13")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    with pytest.raises(RunDirError):
        check_unlocked(tmp_path)  # another job's lock
    monkeypatch.setenv("SLURM_JOB_ID", "12")
    check_unlocked(tmp_path)
    with RunLock(tmp_path, log=lambda m: None):
        held = json.loads((tmp_path / LOCK_NAME).read_text())
        assert (held["slurm_job"], held["slurm_restart"]) == ("12", 1)
