"""Hostile input against a run directory: every case asserts the exit code (or the
exception the CLI turns into it), the one line, and that the files it must not touch
are byte-identical (sha256 of every file under the directory, before and after).

Two tiny runs are shared by the session (tests/_hostile.py): a finished one (in-process
``train``) and one stopped by SIGTERM through the real ``dipaco-train`` CLI. Tests work
on copies. The cases of issue #32 (rules for config values, paths, fingerprints,
resumes, run extension) are in tests/test_hostile_rules.py.

The table in docs/reliability.md ("Hostile input") is generated from the test
docstrings of both files (first line: the attack; the rest: what dipaco does), and
``test_reliability_table_is_current`` fails when the two drift apart::

    .venv/bin/python tests/test_hostile.py     # prints the table
"""
from __future__ import annotations

import ast
import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dipaco.run.checkpoint import CheckpointManager
from dipaco.cli import infer as infer_cli
from dipaco.cli import route as route_cli
from dipaco.cli import train as train_cli
from dipaco.cli.errors import report_user_errors
from dipaco.config import ConfigError, compose_config
from dipaco.data import DataError
from dipaco.runtime.launch import LaunchError
from dipaco.run.run_dir import RunDirError, RunStopped, _is_disk_full
from dipaco.run.lock import LOCK_NAME, RunLock
from dipaco.job.train import train
from dipaco.config.validate import validate_config

from _hostile import SMOKE, copy_run, one_line, run_cli, snapshot, subprocess_cli, tiny_jsonl

DOCS = Path(__file__).resolve().parents[1] / "docs" / "reliability.md"
# the hostile-input tests of issue #32, kept beside this file (files stay small); one table
RULES = Path(__file__).resolve().parent / "test_hostile_rules.py"


# ------------------------------------------------------------------ resume


@pytest.mark.slow
@pytest.mark.parametrize("override", ["grid=4x4", "model=small", "data.max_documents=100", "seed=1",
                                      "diloco.inner_steps=8", "router.top_k=1", "trainer.lr=0.1",
                                      "trainer.rounds=1"])
def test_resume_with_a_shaping_override_is_refused(finished, tmp_path, override):
    """`resume=true` plus an override of a key that shapes the run (grid, model, data, seed, DiLoCo, router, schedule, fewer rounds)
    — `config error: KEY: D was trained with KEY=saved; this resume asks for given ... Fix: drop KEY=... (resume=true needs only hydra.run.dir), or start a new run in another hydra.run.dir`; exit 2; the directory is byte-identical."""
    run_dir = copy_run(finished[0], tmp_path / "run")
    before = snapshot(run_dir)
    with pytest.raises(ConfigError) as err:
        train(compose_config([override, "resume=true"], run_dir), overrides=[override, "resume=true"])
    key = override.split("=")[0]
    assert err.value.key.startswith(key) and "was trained with" in str(err.value) and "\n" not in str(err.value)
    assert snapshot(run_dir) == before


@pytest.mark.slow
@pytest.mark.parametrize("args", [["resume=true", "grid=4x4"], []], ids=["shaping_override", "fresh_run"])
@pytest.mark.multiprocess
def test_cli_refusal_leaves_even_hydra_files_untouched(finished, tmp_path, args):
    """The real `dipaco-train hydra.run.dir=D resume=true grid=4x4`, and a fresh run (no resume) into a run directory
    — one line, exit 2; Hydra's own `.hydra/` and log file are switched off for an existing run, so D is byte-identical."""
    run_dir = copy_run(finished[0], tmp_path / "run")
    before = snapshot(run_dir)
    proc = subprocess_cli("dipaco.cli.train", f"hydra.run.dir={run_dir}", *args, cwd=tmp_path)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    one_line(err, "grid.levels" if args else "already holds checkpoints")
    assert snapshot(run_dir) == before


@pytest.mark.slow
def test_resume_of_a_finished_run_changes_nothing(finished, tmp_path, capsys, monkeypatch):
    """`dipaco-train hydra.run.dir=D resume=true` on a finished run
    — `D is already finished (2 rounds, summary.json); nothing to do`; exit 0; byte-identical."""
    run_dir = copy_run(finished[0], tmp_path / "run")
    before = snapshot(run_dir)
    code, _ = run_cli(train_cli.main, [f"hydra.run.dir={run_dir}", "resume=true"], capsys, monkeypatch)
    assert code == 0
    assert snapshot(run_dir) == before


@pytest.mark.slow
def test_sigterm_stops_at_a_round_boundary_in_one_line(sigterm_stopped):
    """SIGTERM to `dipaco-train` (local launcher)
    — the rounds stop after the current round, its checkpoint written; `stopped by SIGTERM after round 1; last complete checkpoint D/checkpoints/round_000001; continue with: dipaco-train hydra.run.dir=D resume=true`; exit 1."""
    run_dir, err = sigterm_stopped
    one_line(err, "stopped by SIGTERM after round 1", "round_000001", f"hydra.run.dir={run_dir} resume=true")
    CheckpointManager.verify(run_dir / "checkpoints" / "round_000001")
    assert not (run_dir / "summary.json").exists() and not (run_dir / LOCK_NAME).exists()


@pytest.mark.slow
def test_resume_with_no_arguments_finishes_with_the_uninterrupted_totals(finished, sigterm_stopped, tmp_path):
    """`dipaco-train hydra.run.dir=D resume=true` (nothing else) after a SIGTERM, one allowed change (`trainer.keep_last=3`)
    — the saved config is used; `summary.json` equals the uninterrupted run's (perplexities, bytes, DDP bytes, tokens; times summed); the allowed change is logged and recorded in `resumes.jsonl`."""
    run_dir = copy_run(sigterm_stopped[0], tmp_path / "run")
    given = ["resume=true", "trainer.keep_last=3"]
    summary = train(compose_config(given, run_dir), overrides=given)
    whole = finished[1]
    for key in ("routed_ppl", "dense_ppl", "bytes_sent", "ddp_bytes_equivalent", "train_tokens", "rounds"):
        assert summary[key] == whole[key], key
    assert json.loads((run_dir / "resumes.jsonl").read_text())["changes"] == {"trainer.keep_last": [2, 3]}


@pytest.mark.slow
def test_resume_refuses_artefacts_made_from_other_data(sigterm_stopped, tmp_path):
    """Resume when the data on disk changed since the run was made (simulated: the recorded data fingerprint differs)
    — `tokenizer.json in D was made from something else than this run (data: made with ..., this run has ...); start a new run in another hydra.run.dir`; exit 2; byte-identical."""
    run_dir = copy_run(sigterm_stopped[0], tmp_path / "run")
    fps = json.loads((run_dir / "fingerprints.json").read_text())
    fps["tokenizer"]["data"] = "0" * 64
    (run_dir / "fingerprints.json").write_text(json.dumps(fps))
    before = snapshot(run_dir)
    with pytest.raises(RunDirError, match="made from something else than this run"):
        train(compose_config(["resume=true"], run_dir), overrides=["resume=true"])
    assert snapshot(run_dir) == before


@pytest.mark.slow
def test_resume_of_a_run_from_before_a_new_null_option(sigterm_stopped, tmp_path):
    """Resume a run directory recorded by a dipaco that did not know `router.cluster_tokens`,
    `router.fine_clusters` or `router.prompt_classifier` (simulated: the keys are absent
    from its router fingerprint) — resumes and finishes; a run that recorded another value
    is still refused."""
    run_dir = copy_run(sigterm_stopped[0], tmp_path / "run")
    fps = json.loads((run_dir / "fingerprints.json").read_text())
    for key in ("router.cluster_tokens", "router.fine_clusters", "router.prompt_classifier"):
        del fps["router"][key]
    (run_dir / "fingerprints.json").write_text(json.dumps(fps))
    other = copy_run(run_dir, tmp_path / "other")
    summary = train(compose_config(["resume=true"], run_dir), overrides=["resume=true"])
    assert "routed_ppl" in summary and "stopped_at_round" not in summary  # finished
    fps["router"]["router.cluster_tokens"] = 64
    (other / "fingerprints.json").write_text(json.dumps(fps))
    with pytest.raises(RunDirError, match="router.cluster_tokens: made with 64"):
        train(compose_config(["resume=true"], other), overrides=["resume=true"])


@pytest.mark.slow
def test_disk_full_while_checkpointing_is_one_line_and_keeps_the_last_checkpoint(sigterm_stopped, tmp_path,
                                                                                   monkeypatch):
    """Disk full (`OSError: [Errno 28]`, or safetensors' `StorageFull`) while writing a checkpoint
    — `disk full while writing FILE; last complete checkpoint: D/checkpoints/round_000001; free space, then continue with: dipaco-train hydra.run.dir=D resume=true`; exit 1; the earlier checkpoint still verifies."""
    import dipaco.storage.tensor_io as tensor_io  # every checkpoint tensor file is written there

    run_dir = copy_run(sigterm_stopped[0], tmp_path / "run")

    def full(_tensors: Any, filename: str, metadata: Any = None) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", filename)

    monkeypatch.setattr(tensor_io, "save_file", full)
    with pytest.raises(RunStopped) as err:
        train(compose_config(["resume=true"], run_dir), overrides=["resume=true"])
    msg = str(err.value)
    assert "disk full while writing" in msg and "round_000001" in msg and "resume=true" in msg
    CheckpointManager.verify(run_dir / "checkpoints" / "round_000001")
    assert _is_disk_full(type("SafetensorError", (Exception,), {})(
        "Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: \"No space left\" })"))


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["no_config", "garbled_config"])
def test_resume_refuses_a_run_without_a_readable_config(finished, tmp_path, damage):
    """Resume a run whose `config.yaml` is deleted or garbled
    — `D holds checkpoints but no config.yaml ...` / `unreadable config D/config.yaml ...`; exit 2; byte-identical."""
    run_dir = copy_run(finished[0], tmp_path / "run")
    if damage == "no_config":
        (run_dir / "config.yaml").unlink()
    else:
        (run_dir / "config.yaml").write_text("grid: [unclosed\n")
    before = snapshot(run_dir)
    with pytest.raises(RunDirError, match="no config.yaml" if damage == "no_config" else "unreadable config"):
        train(compose_config(["resume=true"], run_dir), overrides=["resume=true"])
    assert snapshot(run_dir) == before


def test_resume_of_an_empty_directory_says_it_starts_a_new_run(tmp_path, capsys):
    """`resume=true` on a directory that holds no run
    — logs `resume=true: D holds no run yet (no config.yaml); starting a new run from round 0` (here the run then stops on too few documents)."""
    with pytest.raises(DataError):
        train(compose_config(SMOKE + tiny_jsonl(tmp_path / "d.jsonl", 3) + ["resume=true"], tmp_path / "run"))
    assert "holds no run yet" in capsys.readouterr().out


# ------------------------------------------------------------------ never destroy a run


@pytest.mark.slow
@pytest.mark.parametrize("target", ["run_dir", "other_dir", "file"])
def test_export_force_never_replaces_what_it_did_not_write(finished, tmp_path, capsys, monkeypatch, target):
    """`dipaco-infer export D --path 1 --out X --force` where X is the run directory itself, a folder of other files, or a file
    — `--out X is a dipaco run directory; it is never replaced` / `is not empty and is not a dipaco export` / `is a file`; exit 2; X byte-identical; no `*.partial*` left behind."""
    run_dir = copy_run(finished[0], tmp_path / "run")
    out = {"run_dir": run_dir, "other_dir": tmp_path / "notes", "file": tmp_path / "notes.txt"}[target]
    if target == "other_dir":
        out.mkdir()
        (out / "thesis.tex").write_text("a week of writing")
    elif target == "file":
        out.write_text("keep me")
    before = snapshot(tmp_path)
    code, err = run_cli(infer_cli.main, ["export", run_dir, "--path", "1", "--out", out, "--force"], capsys,
                        monkeypatch)
    assert code == 2
    one_line(err, str(out))
    assert snapshot(tmp_path) == before


@pytest.mark.slow
def test_export_force_replaces_only_an_earlier_export(finished, tmp_path, capsys, monkeypatch):
    """`--force` over an earlier export of the same run
    — replaced (marker `.dipaco-export` present), nothing else left in its parent."""
    out = tmp_path / "exp"
    for _ in range(2):
        code, err = run_cli(infer_cli.main, ["export", finished[0], "--path", "1", "--out", out, "--force"],
                            capsys, monkeypatch)
        assert code == 0, err
    assert (out / ".dipaco-export").is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["exp"]


@pytest.mark.slow
def test_dipaco_route_refuses_an_existing_run(finished, tmp_path, capsys, monkeypatch):
    """`dipaco-route hydra.run.dir=D` where D holds a run
    — `D already holds a run (config.yaml); dipaco-route writes a new run directory`; exit 2; byte-identical."""
    run_dir = copy_run(finished[0], tmp_path / "run")
    before = snapshot(run_dir)
    code, err = run_cli(route_cli.main, [*SMOKE, f"hydra.run.dir={run_dir}"], capsys, monkeypatch)
    assert code == 2
    one_line(err, "already holds a run")
    assert snapshot(run_dir) == before


@pytest.mark.slow
def test_fresh_run_refuses_a_foreign_tokenizer_and_router(finished, tmp_path, capsys):
    """A fresh run in a directory holding a `tokenizer.json` and `router/` from elsewhere (no fingerprint)
    — `D holds tokenizer.json, router/ but no fingerprints.json: what they were made from cannot be checked, so they are not used`; exit 2; D byte-identical (they used to be rebuilt: no command overwrites what a run directory holds)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copy(finished[0] / "tokenizer.json", run_dir / "tokenizer.json")
    shutil.copytree(finished[0] / "router", run_dir / "router")
    before = snapshot(run_dir)
    with pytest.raises(RunDirError, match="but no fingerprints.json"):
        train(compose_config(SMOKE + ["data.max_documents=120"], run_dir))
    assert snapshot(run_dir) == before


@pytest.mark.multiprocess
def test_second_run_in_a_locked_directory_is_refused_with_the_pid(tmp_path):
    """A second run while another holds the directory (live PID in `.dipaco.lock`)
    — `D is in use by another dipaco run (PID n on host); wait for it to finish or use another hydra.run.dir`; exit 2; byte-identical."""
    run_dir = tmp_path / "run"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        run_dir.mkdir()
        import socket

        (run_dir / LOCK_NAME).write_text(json.dumps({"pid": sleeper.pid, "host": socket.gethostname()}))
        before = snapshot(run_dir)
        with pytest.raises(RunDirError, match=f"PID {sleeper.pid}"):
            train(compose_config(SMOKE, run_dir))
        assert snapshot(run_dir) == before
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.multiprocess
def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
    """A lock left by a killed run (its PID no longer exists)
    — taken over, logged: `taking over the stale lock D/.dipaco.lock (...: that process is gone)`; removed on exit."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    import socket

    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname()}))
    said: list[str] = []
    with RunLock(tmp_path, log=said.append):
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert "stale lock" in said[0] and not (tmp_path / LOCK_NAME).exists()


# ------------------------------------------------------------------ one line, right exit code


def test_too_few_documents_for_the_splits_names_the_minimum(tmp_path):
    """A corpus too small to leave a validation document (3 documents)
    — `3 usable documents left no validation document (data.val_fraction=0.05, ...); use at least 40 documents`; exit 2."""
    with pytest.raises(DataError, match="use at least 40 documents"):
        train(compose_config(SMOKE + tiny_jsonl(tmp_path / "d.jsonl", 3), tmp_path / "run"))


@pytest.mark.parametrize(("override", "key"), [
    ("model.vocab_size=5", "model.vocab_size"),
    ("launcher.group_size=2", "launcher.group_size"),
])
def test_impossible_values_are_refused_at_validation(override, key):
    """`model.vocab_size=5`; `launcher.group_size=2` under `launcher=local` (an option the launcher never reads)
    — `config error: model.vocab_size: 5 is out of range: must be >= 257 and <= 1048576 (a byte-level BPE needs 257; ...)` / `launcher=local runs one process ...`; before the corpus loads; exit 2."""
    with pytest.raises(ConfigError) as err:
        validate_config(compose_config(SMOKE + [override]))
    assert err.value.key == key


def test_unknown_key_is_refused_even_with_plus(tmp_path, capsys, monkeypatch):
    """`+trainer.foo=1` (Hydra's own suggestion for a key the schema lacks)
    — `config error: trainer.foo: unknown key: no such setting in dipaco's config schema`; exit 2; nothing written."""
    code, err = run_cli(train_cli.main, [*SMOKE, "+trainer.foo=1", f"hydra.run.dir={tmp_path}/run"], capsys,
                        monkeypatch)
    assert code == 2
    one_line(err, "trainer.foo", "unknown key")
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_torchrun_launcher_outside_torchrun_is_one_line(tmp_path, capsys, monkeypatch):
    """`launcher=torchrun` without torchrun's environment variables
    — `launcher=torchrun but RANK, WORLD_SIZE, ... are not set: start with torchrun ...`; exit 2; nothing written."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    code, err = run_cli(train_cli.main, [*SMOKE, "launcher=torchrun", f"hydra.run.dir={tmp_path}/run"], capsys,
                        monkeypatch)
    assert code == 2
    one_line(err, "RANK", "torchrun")
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_environment_failures_exit_1_and_user_errors_exit_2(capsys):
    """How the CLIs end: a user error (config, data, run directory, launch), a stop by the environment (signal, disk full), Ctrl-C twice
    — one line each; exit 2, 1 and 1; `HYDRA_FULL_ERROR=1` or `--debug` keeps the traceback instead."""
    cases = [(ConfigError("k", "bad", "fix"), 2), (RunDirError("x"), 2), (LaunchError("y"), 2),
             (RunStopped("stopped"), 1), (KeyboardInterrupt(), 1)]
    for exc, code in cases:
        def boom() -> None:
            raise exc

        with pytest.raises(SystemExit) as ended:
            report_user_errors(boom)()
        assert ended.value.code == code
        one_line(capsys.readouterr().err, "dipaco: error:")
    os.environ["DIPACO_DEBUG"] = "1"
    try:
        with pytest.raises(RunStopped):
            report_user_errors(lambda: (_ for _ in ()).throw(RunStopped("x")))()
    finally:
        del os.environ["DIPACO_DEBUG"]


# ------------------------------------------------------------------ the docs table


def table() -> str:
    """The markdown table of docs/reliability.md's "Hostile input" section."""
    rows = ["| attack | what dipaco does | test |", "|---|---|---|"]
    nodes = [n for f in (Path(__file__), RULES) for n in ast.parse(f.read_text(encoding="utf-8")).body]
    for node in nodes:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_") and node.name != \
                "test_reliability_table_is_current":
            doc = " ".join((ast.get_docstring(node) or "").split())
            attack, _, outcome = doc.partition(" — ")
            rows.append(f"| {attack} | {outcome} | `{node.name}` |")
    return "\n".join(rows) + "\n"


def test_reliability_table_is_current():
    """docs/reliability.md carries exactly the table generated from this file."""
    assert table() in DOCS.read_text(encoding="utf-8"), "regenerate: .venv/bin/python tests/test_hostile.py"


if __name__ == "__main__":
    print(table(), end="")
