"""One stop contract in every mode and phase: whatever is running when SIGTERM comes, the
run writes the last complete round's checkpoint and stops (RunStopped: exit code 1 in the
CLI) within one round, never one round late and never by running to the end.

A table over modes (synchronous, streaming, decoupled) and phases (the inner steps, the
write of a periodic checkpoint, the round just before a re-shard). The signal is real
(``os.kill`` of this process, caught by :class:`dipaco.runtime.launch.StopSignals`); the
phase is reached by wrapping the function that runs it. The ranks of ``spawn`` and
elastic launches take the same decision in the same loop (:func:`dipaco.rounds.loop.run_rank`,
one all-reduce per round); their rows send SIGTERM to the launching process once rank 0 has
recorded a round (SIGUSR2 under SLURM: tests/test_preempt.py; a lost group: tests/test_elastic.py).
"""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from dipaco.config import compose_config
from dipaco.job.train import train
from dipaco.run.checkpoint import CheckpointManager
from dipaco.run.run_dir import RunStopped

# three rounds: a stop that came one round late would run round 3, the last, and finish; two
# paths (grid=2x1): the contract is about rounds, and a round of four paths costs twice as much
BASE = ["experiment=smoke", "grid=2x1", "data.max_documents=200", "trainer.rounds=3", "diloco.inner_steps=2",
        "trainer.dense_baseline=false", "trainer.plots=false", "trainer.eval_max_documents=8", "trainer.threads=1"]
MODES = {"sync": [], "streaming": ["diloco.streaming=true"],
         "decoupled": ["diloco.mode=decoupled", "launcher.nproc=2"]}


def _term() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


def _during(monkeypatch: pytest.MonkeyPatch, target: object, name: str, round_idx: int) -> None:
    """SIGTERM while ``target.name`` runs for round ``round_idx`` (its first argument)."""
    original = getattr(target, name)

    def wrapped(self, r, *args, **kwargs):
        if r == round_idx:
            _term()
        return original(self, r, *args, **kwargs)

    monkeypatch.setattr(target, name, wrapped)


def _rounds(run: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in (run / "checkpoints").glob("round_*")
                  if CheckpointManager.verify(p) is not None)


CASES = [("sync", "inner steps"), ("sync", "checkpoint write"), ("sync", "before re-shard"),
         ("streaming", "inner steps"), ("streaming", "checkpoint write"), ("decoupled", "inner steps")]
# decoupled mode's workers are processes of their own
PARAMS = [pytest.param(m, p, id=f"{m}-{p}", marks=[pytest.mark.multiprocess] if m == "decoupled" else [])
          for m, p in CASES]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("mode", "phase"), PARAMS)
def test_a_stop_checkpoints_the_last_complete_round_and_exits_within_one(
        mode: str, phase: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM in round 2 (sync, streaming) or after the first phase (decoupled): RunStopped
    naming the last complete checkpoint, which is round 2 (1 for decoupled) at the latest."""
    from dipaco.rounds.record import RoundRecorder

    extra = list(MODES[mode])
    if phase == "checkpoint write":
        extra.append("trainer.checkpoint_every=2")
        _during(monkeypatch, RoundRecorder, "checkpoint", 2)  # while round 2's checkpoint is written
    elif phase == "before re-shard":
        extra.append("router.reshard_at_round=2")
        _during(monkeypatch, RoundRecorder, "round_done", 1)  # the round before the re-shard's round
    elif mode == "decoupled":
        def watch() -> None:  # the first phase of some path is done: stop
            while not list((tmp_path / "run").glob("decoupled/paths/*")):
                time.sleep(0.05)
            _term()

        threading.Thread(target=watch, daemon=True).start()
    else:
        _during(monkeypatch, RoundRecorder, "round_done", 1)  # while round 2 trains (stop_requested follows)
    with pytest.raises(RunStopped) as stop:
        train(compose_config(BASE + extra, str(tmp_path / "run")))
    done = _rounds(tmp_path / "run")
    if mode != "decoupled":
        assert done and max(done) == 2, done  # round 2's checkpoint, and not round 3's
    assert max(done, default=0) < 3  # not run to the end
    where = f"round_{max(done):06d}" if done else "before the first checkpoint"
    assert where in str(stop.value) and "resume=true" in str(stop.value)
    assert not (tmp_path / "run" / "summary.json").exists()


LAUNCHERS = {"spawn": ["launcher=spawn", "launcher.nproc=2", "launcher.backend=gloo"],
             "elastic": ["launcher=spawn", "launcher.nproc=2", "launcher.backend=gloo", "launcher.elastic=true"]}
# BASE's rounds of 2 inner steps take about 0.1 s on a warm host: shorter than the way a
# stop takes from the launching process to the ranks (the elastic launcher looks at the
# signal every 20 ms, its agents then pass it on), so "round 2 in flight" needs a longer round
LONG_ROUNDS = ["diloco.inner_steps=16"]
# under torch's 30 s wait for ranks to exit after a stop, over what a stop takes on a busy host
STOP_GRACE_S = 20.0


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_a_stop_of_a_spawned_launch_checkpoints_the_last_complete_round_and_exits_within_one(
        launcher: str, tmp_path: Path) -> None:
    """The rows for ``launcher=spawn`` and the elastic launcher: the ranks are other
    processes, so the phase is found from the outside: SIGTERM to the launching process
    once rank 0 has recorded round 1 (round 2 in flight). RunStopped naming the last
    complete checkpoint, round 1 or 2, never round 3 (the last) and no summary; and it
    comes within seconds: torch's agent waits 30 s for a rank that returns a value it
    no longer reads (SIGKILL after), so a stopped rank exits instead."""
    run = tmp_path / "run"
    sent: list[float] = []

    def watch() -> None:
        metrics = run / "metrics.jsonl"
        while not (metrics.is_file() and '"round": 1' in metrics.read_text(encoding="utf-8")):
            time.sleep(0.05)
        sent.append(time.monotonic())
        _term()

    threading.Thread(target=watch, daemon=True).start()
    with pytest.raises(RunStopped) as stop:
        train(compose_config(BASE + LONG_ROUNDS + LAUNCHERS[launcher], str(run)))
    assert sent and time.monotonic() - sent[0] < STOP_GRACE_S
    done = _rounds(run)
    assert done and max(done) in (1, 2), done
    assert f"round_{max(done):06d}" in str(stop.value) and "resume=true" in str(stop.value)
    assert not (run / "summary.json").exists()


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_signal_to_the_spawned_ranks_alone_stops_the_launch_as_one_to_the_launcher(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """SIGTERM to every rank as round 2 starts, none to the launching process (a scheduler
    that signals the ranks, a user's ``kill`` of them): the ranks finish round 2, write its
    checkpoint and exit; the launch ends in the same RunStopped as a stop of the launcher,
    without a rank's failure report, not in a run that looks finished."""
    monkeypatch.setenv("DIPACO_FAULT", "signal:sig=TERM:round=2")
    run = tmp_path / "run"
    t0 = time.monotonic()
    with pytest.raises(RunStopped) as stop:
        train(compose_config(BASE + LONG_ROUNDS + LAUNCHERS["spawn"], str(run)))
    assert time.monotonic() - t0 < 120
    assert _rounds(run) == [1, 2]
    assert "stopped by SIGTERM after round 2" in str(stop.value) and "resume=true" in str(stop.value)
    assert not (run / "summary.json").exists()
    # torch's record of a failed rank (a traceback on the console) is not made for a stopped one
    failed = [r.getMessage() for r in caplog.records if "failed (exitcode" in r.getMessage()]
    assert not failed, failed
