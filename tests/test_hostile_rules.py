"""Hostile input by rule, not case by case (issue #32): the six examples of the issue and
the cases a fresh probe found, each a test that asserts the one line (or the correct
result) and that nothing on disk changed. Their docstrings join tests/test_hostile.py's
in docs/reliability.md's table (generated there).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from dipaco.run.checkpoint import CheckpointError
from dipaco.cli import infer as infer_cli
from dipaco.cli import train as train_cli
from dipaco.config import ConfigError, compose_config
from dipaco.job.prepare import prepare
from dipaco.run.resume import resume_config
from dipaco.run.run_dir import RunDir, RunDirError
from dipaco.config.schedule import describe_segments
from dipaco.job.train import train
from dipaco.config.validate import validate_config

from _hostile import SMOKE, copy_run, one_line, run_cli, snapshot, subprocess_cli


# ------------------------------------------------------------------ issue #32: by rule, not case by case


def store_of_another_run(tmp_path: Path, legacy: bool) -> Path:
    """A decoupled store made by another run (``owner.json``), or by an older dipaco (no owner)."""
    store = tmp_path / "shared-store"
    (store / "modules").mkdir(parents=True)
    (store / "plan.json").write_text(json.dumps({"rounds": 2, "levels": [2, 2]}))
    (store / "modules" / "L0.0.st").write_bytes(b"weeks of updates")
    if not legacy:
        (store / "owner.json").write_text(json.dumps({"run_dir": str(tmp_path / "other-run")}))
    return store


@pytest.mark.parametrize("legacy", [False, True], ids=["owned_by_another_run", "made_before_owners"])
def test_a_fresh_decoupled_run_never_deletes_another_runs_store(tmp_path, legacy):
    """A fresh decoupled run whose `diloco.decoupled.store_url` holds another run's store (its `owner.json` names that run, or a store from before owners)
    — `... is the store of another run (R, owner.json); a run never replaces or continues another run's store` / `... which run it belongs to is unknown, so it is left alone`; exit 2, before any file of the new run is written; the store is byte-identical. A fresh run empties only its own store."""
    store = store_of_another_run(tmp_path, legacy)
    before = snapshot(store)
    cfg = compose_config(SMOKE + ["diloco.mode=decoupled", f"diloco.decoupled.store_url={store}"], tmp_path / "run")
    with pytest.raises(RunDirError, match="unknown, so it is left alone" if legacy else "store of another run"):
        train(cfg)
    assert snapshot(store) == before and not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize("out", ["config.yaml", "checkpoints/round_000099/report.json", "."], ids=["config", "checkpoints",
                                                                                                  "run_dir"])
def test_score_out_never_writes_into_a_run(finished, tmp_path, capsys, monkeypatch, out):
    """`dipaco-infer score D --validation --out D/config.yaml` (or any path inside a run directory, the run itself)
    — `score --out X lies in the run directory D: no command writes into a run directory it does not own`; exit 2 before any scoring; D byte-identical (every writing command goes through one rule, dipaco/run/path_guard.py)."""
    run_dir = copy_run(finished[0], tmp_path / "run")
    before = snapshot(run_dir)
    code, err = run_cli(infer_cli.main, ["score", run_dir, "--validation", "--out", run_dir / out], capsys,
                        monkeypatch)
    assert code == 2
    one_line(err, "lies in the run directory")
    assert snapshot(run_dir) == before


@pytest.mark.slow
def test_export_into_a_runs_checkpoints_is_refused_and_a_planted_one_is_named(finished, tmp_path, capsys,
                                                                              monkeypatch):
    """`dipaco-infer export D --path 1 --out D/checkpoints/round_000099`; and an export copied there by hand
    — the export is refused (`--out ... lies in the run directory D`), exit 2, D byte-identical; a planted export is never taken for the newest checkpoint: `score` says `D/checkpoints/round_000099 has no state.json: it is not a checkpoint written by a dipaco run (an export?)` and `resume=true` refuses the same way, before writing."""
    run_dir = copy_run(finished[0], tmp_path / "run")
    before = snapshot(run_dir)
    planted = run_dir / "checkpoints" / "round_000099"
    code, err = run_cli(infer_cli.main, ["export", run_dir, "--path", "1", "--out", planted], capsys, monkeypatch)
    assert code == 2 and snapshot(run_dir) == before
    one_line(err, "lies in the run directory")
    code, err = run_cli(infer_cli.main, ["export", run_dir, "--path", "1", "--out", tmp_path / "exp"], capsys,
                        monkeypatch)
    assert code == 0, err
    shutil.copytree(tmp_path / "exp", planted)
    before = snapshot(run_dir)
    code, err = run_cli(infer_cli.main, ["score", run_dir, "--validation"], capsys, monkeypatch)
    assert code == 2
    one_line(err, "round_000099 has no state.json")
    with pytest.raises(CheckpointError, match="no state.json"):
        train(compose_config(["resume=true", "trainer.rounds=3"], run_dir), overrides=["resume=true", "trainer.rounds=3"])
    assert snapshot(run_dir) == before


@pytest.mark.slow
def test_extending_a_finished_run_continues_its_schedule_and_says_so(tmp_path, capsys):
    """`resume=true trainer.rounds=4` on a finished 2-round run
    — logs `trainer.rounds 2 -> 4: the learning-rate schedule continues the launch's, so the added rounds train at its floor ...`; `summary.json`'s `lr_schedule` has one record per segment (rounds 0-2 warm-up and cosine, 2-4 at the floor) and the result equals a fresh 4-round run given that schedule (`trainer.lr_segments=[0,2]`) to the last digit; `trainer.extend_schedule=restart` records a new warm-up and cosine over the added rounds instead (README: the default is continue)."""
    small = SMOKE + ["data.max_documents=120", "trainer.dense_baseline=false"]
    run_dir = tmp_path / "run"
    train(compose_config(small, run_dir))
    restart = copy_run(run_dir, tmp_path / "restart")
    given = ["resume=true", "trainer.rounds=4"]
    extended = train(compose_config(given, run_dir), overrides=given)
    assert "the added rounds train at its floor" in capsys.readouterr().out
    assert [s["rounds"] for s in extended["lr_schedule"]] == [[0, 2], [2, 4]]
    assert extended["lr_schedule"][1]["lr"].startswith("floor")
    fresh = train(compose_config(small + ["trainer.rounds=4", "trainer.lr_segments=[0,2]"], tmp_path / "fresh"))
    for key in ("routed_ppl", "lr_schedule", "rounds", "train_tokens"):
        assert extended[key] == fresh[key], key
    assert json.loads((run_dir / "resumes.jsonl").read_text().splitlines()[-1])["changes"]["trainer.lr_segments"] \
        == [[], [0, 2]]
    given = ["resume=true", "trainer.rounds=4", "trainer.extend_schedule=restart"]
    cfg, changes = resume_config(compose_config(given, restart), RunDir.at(restart), given)
    assert changes["trainer.lr_segments"] == [[], [0, 2, 2, 4]]
    assert [s["lr"].startswith("warm-up") for s in describe_segments(cfg)] == [True, True]


def test_a_label_missing_from_some_rows_or_null_does_not_crash_routing(tmp_path):
    """`data.label_field=topic` where some rows lack `topic` and others hold `null` (the README's own example field)
    — routing runs; NMI and purity are computed over the labelled documents (a missing label is an unknown domain, not a crash in `router/report.py`)."""
    rows = []
    for i in range(160):
        row: dict[str, Any] = {"text": f"def f{i}(x):\n    return x + {i}  # document {i}\n" * 3}
        if i % 3 == 0:
            row["topic"] = "a" if i % 2 else "b"
        elif i % 3 == 1:
            row["topic"] = None
        rows.append(json.dumps(row))
    (tmp_path / "d.jsonl").write_text("\n".join(rows) + "\n")
    cfg = compose_config(SMOKE + ["data=jsonl", f"data.path={tmp_path / 'd.jsonl'}", "data.label_field=topic"],
                         tmp_path / "run")
    validate_config(cfg)
    prep = prepare(cfg, RunDir.at(tmp_path / "run"))
    assert prep.report["nmi"] is not None and 0 <= prep.report["purity"] <= 1


@pytest.mark.slow
def test_a_tokenizer_copied_from_another_run_is_refused_on_every_read(finished, tmp_path, capsys, monkeypatch):
    """`tokenizer.json` of D replaced by another run's (same format, other merges), then `dipaco-infer score D` and `resume=true`
    — `D/tokenizer.json is not the tokenizer this run was made with (sha256 ..., fingerprints.json records ...): it was replaced or copied from another run`; exit 2; D byte-identical. The router, shards, warm-up and checkpoints are checked the same way (`fingerprints.json`, docs/design.md contract 9)."""
    from dipaco.data import Tokenizer

    run_dir = copy_run(finished[0], tmp_path / "run")
    Tokenizer.train([f"other corpus {i} " * 20 for i in range(200)], vocab_size=300).save(run_dir / "tokenizer.json")
    before = snapshot(run_dir)
    code, err = run_cli(infer_cli.main, ["score", run_dir, "--validation"], capsys, monkeypatch)
    assert code == 2
    one_line(err, "tokenizer.json is not the tokenizer this run was made with")
    with pytest.raises(RunDirError, match="not the tokenizer this run was made with"):
        train(compose_config(["resume=true", "trainer.rounds=3"], run_dir), overrides=["resume=true", "trainer.rounds=3"])
    assert snapshot(run_dir) == before


@pytest.mark.slow
@pytest.mark.parametrize("spelling", ["quoted", "symlink"])
@pytest.mark.multiprocess
def test_a_refused_resume_writes_nothing_however_the_directory_is_spelled(sigterm_stopped, tmp_path, spelling):
    """`dipaco-train hydra.run.dir=D resume=true trainer.keep_last=3` (an allowed change) when the data changed since D was made, with D spelled `'D'` (quoted, so the old check of `D/config.yaml` missed it) or through a symlink
    — refused in one line, exit 2, and D byte-identical: no `config.yaml` rewrite, no `resumes.jsonl` line, no `.hydra/`, no cache (a resume records its changes only once accepted; Hydra writes nothing into any single run)."""
    run_dir = copy_run(sigterm_stopped[0], tmp_path / "run")
    fps = json.loads((run_dir / "fingerprints.json").read_text())
    fps["tokenizer"]["data"] = "0" * 64
    (run_dir / "fingerprints.json").write_text(json.dumps(fps))
    shutil.rmtree(run_dir / "cache")
    (tmp_path / "link").symlink_to(run_dir)
    spelled = {"quoted": f"'{run_dir}'", "symlink": f"{tmp_path / 'link'}"}[spelling]
    before = snapshot(run_dir)
    proc = subprocess_cli("dipaco.cli.train", f"hydra.run.dir={spelled}", "resume=true", "trainer.keep_last=3",
                          cwd=tmp_path)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err[-2000:]
    one_line(err, "made from something else than this run")
    assert snapshot(run_dir) == before


@pytest.mark.slow
def test_resume_with_a_changed_router_setting_refuses_before_the_cache_is_written(sigterm_stopped, tmp_path):
    """Resume of D whose recorded router was fitted with other settings (simulated in `fingerprints.json`) and whose token cache was deleted
    — `router/ in D was made from something else than this run (router.niter: ...)`; exit 2; D byte-identical: the check runs before preparation tokenizes anything."""
    run_dir = copy_run(sigterm_stopped[0], tmp_path / "run")
    fps = json.loads((run_dir / "fingerprints.json").read_text())
    fps["router"]["router.niter"] = 99
    (run_dir / "fingerprints.json").write_text(json.dumps(fps))
    shutil.rmtree(run_dir / "cache")
    before = snapshot(run_dir)
    with pytest.raises(RunDirError, match="router/ in .*router.niter: made with 99"):
        train(compose_config(["resume=true"], run_dir), overrides=["resume=true"])
    assert snapshot(run_dir) == before


@pytest.mark.slow
def test_resume_may_change_where_the_outer_state_lives(sigterm_stopped, tmp_path):
    """`resume=true diloco.outer_device=cpu`: a key a resume may change, which the checkpoints' fingerprint also recorded
    — the resume runs and finishes (an allowed change is no longer refused as `checkpoints/ was made from something else`), and the change is in `resumes.jsonl`."""
    run_dir = copy_run(sigterm_stopped[0], tmp_path / "run")
    given = ["resume=true", "diloco.outer_device=cpu"]
    summary = train(compose_config(given, run_dir), overrides=given)
    assert "routed_ppl" in summary
    assert json.loads((run_dir / "resumes.jsonl").read_text())["changes"]["diloco.outer_device"] == ["auto", "cpu"]


@pytest.mark.parametrize(("target", "why"), [("file", "is a file, not a directory"), ("fifo", "special file"),
                                             ("inside_a_run", "lies in the run directory")])
def test_a_run_directory_that_cannot_be_one_is_refused_before_hydra_touches_it(tmp_path, capsys, monkeypatch,
                                                                             target, why):
    """`hydra.run.dir` naming a file, a FIFO, or a folder inside another run directory (`D/checkpoints/new`)
    — `run directory X is a file ...` / `... special file ...` / `... lies in the run directory D: a run never writes into another`; exit 2; nothing is created or changed."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.yaml").write_text("seed: 0\n")
    (other / "checkpoints").mkdir()
    path = {"file": tmp_path / "notes.txt", "fifo": tmp_path / "pipe", "inside_a_run": other / "checkpoints" / "new"}
    path["file"].write_text("keep me")
    os.mkfifo(path["fifo"])
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    code, err = run_cli(train_cli.main, [*SMOKE, f"hydra.run.dir={path[target]}"], capsys, monkeypatch)
    assert code == 2
    one_line(err, why)
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before and path["file"].read_text() == "keep me"


@pytest.mark.parametrize("where", ["cache_in_another_run", "checkpoints_linked_into_another_run"])
def test_a_run_never_writes_its_cache_or_checkpoints_into_another_run(tmp_path, where):
    """`data.cache_dir=OTHER/cache`, or a `checkpoints/` that is a symlink into another run directory
    — `data.cache_dir ... lies in the run directory OTHER: no command writes into a run directory it does not own` / the same for `checkpoints/`; exit 2 before any file is written; OTHER byte-identical."""
    other = tmp_path / "other"
    (other / "checkpoints").mkdir(parents=True)
    (other / "cache").mkdir()
    (other / "config.yaml").write_text("seed: 0\n")
    run_dir = tmp_path / "run"
    extra = []
    if where == "cache_in_another_run":
        extra = [f"data.cache_dir={other / 'cache'}"]
    else:
        run_dir.mkdir()
        (run_dir / "checkpoints").symlink_to(other / "checkpoints")
    before = snapshot(tmp_path)
    with pytest.raises(RunDirError, match="lies in the run directory"):
        train(compose_config(SMOKE + extra, run_dir))
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("override", ["trainer.lr=-1", "diloco.inner_steps=0", "trainer.warmup_fraction=0.99",
                                      "diloco.outer.name=lbfgs", "data.min_doc_chars=-1", "trainer.grad_clip=-1"])
def test_out_of_domain_values_are_refused_before_any_work(tmp_path, override):
    """A negative learning rate, zero inner steps, a warm-up fraction that multiplies the run's time by 99, an outer optimiser that cannot step without a closure (it crashed after round 1's compute), a negative minimum document size or clip norm (every key of the schema: tests/test_config_domains.py)
    — `config error: KEY: VALUE is out of range: must be ... Fix: e.g. KEY=default (the default)` / `torch.optim cannot take an outer step ...`; exit 2; nothing written."""
    with pytest.raises(ConfigError) as err:
        train(compose_config(SMOKE + [override], tmp_path / "run"))
    assert err.value.key == override.split("=")[0] and "\n" not in str(err.value)
    assert not (tmp_path / "run").exists()


def test_dipaco_plan_answers_an_absurd_grid_at_once(capsys):
    """`dipaco-plan grid.levels=[1000,1000]` (a million paths; it used to run for minutes) and `dipaco-plan trainer.lr=abc`
    — `config error: grid.levels: [1000, 1000] makes 1,000,000; at most 4,096 ...` / `trainer.lr: Value 'abc' ... could not be converted to Float`, exit 2, in well under a second of work."""
    import time

    from dipaco.cli import plan as plan_cli

    for override, needle in (("grid.levels=[1000,1000]", "at most 4,096"), ("trainer.lr=abc", "trainer.lr")):
        t0 = time.perf_counter()
        with pytest.raises(SystemExit) as ended:
            plan_cli.main([override])
        assert ended.value.code == 2 and time.perf_counter() - t0 < 10
        one_line(capsys.readouterr().err, needle)


def test_dipaco_infer_arguments_out_of_range_are_one_line_before_loading(tmp_path, capsys, monkeypatch):
    """`dipaco-infer generate D --seed 99999999999999999999999` (it ended in a traceback after loading the path), `--temperature inf`, `score --batch-size 0`
    — `argument --seed: --seed must lie in [0, 4294967295], ...`; exit 2; the run is not even opened."""
    for args in (["generate", tmp_path, "--prompt", "x", "--seed", "99999999999999999999999"],
                 ["generate", tmp_path, "--prompt", "x", "--temperature", "inf"],
                 ["score", tmp_path, "--validation", "--batch-size", "0"]):
        code, err = run_cli(infer_cli.main, args, capsys, monkeypatch)
        assert code == 2
        one_line(err, "argument --")


@pytest.mark.parametrize("holds", ["notes", "tensorboard_logs", "foreign_config"])
def test_a_fresh_run_never_writes_into_a_folder_of_other_files(tmp_path, capsys, monkeypatch, holds):
    """`dipaco-train hydra.run.dir=D` where D is an existing folder of other files (`notes.txt`; a `tb/` of other TensorBoard logs, which a fresh run used to delete; a `config.yaml` that is not dipaco's)
    — `D is not empty and is not a dipaco run directory (it holds ...); a new run writes only into a new or empty directory, or one dipaco made`; exit 2; D byte-identical."""
    run_dir = tmp_path / "project"
    run_dir.mkdir()
    if holds == "notes":
        (run_dir / "notes.txt").write_text("a week of notes")
    elif holds == "tensorboard_logs":
        (run_dir / "tb").mkdir()
        (run_dir / "tb" / "events.out.tfevents.1").write_text("another project's curves")
    else:
        (run_dir / "config.yaml").write_text("database: {host: localhost}\n")
    before = snapshot(run_dir)
    code, err = run_cli(train_cli.main, [*SMOKE, f"hydra.run.dir={run_dir}"], capsys, monkeypatch)
    assert code == 2
    one_line(err, "is not empty and is not a dipaco run directory")
    assert snapshot(run_dir) == before


@pytest.mark.slow
def test_dipaco_report_never_writes_into_a_checkpoint(finished, tmp_path, capsys):
    """`dipaco-report D/checkpoints/round_000002` (any folder inside a run: a report.md in a checkpoint would fail its manifest)
    — refused by the path rule before anything is read: `dipaco-report DIR .../report.md lies in the run directory D ...`; exit 2; D byte-identical. `dipaco-report D` still writes its report at D's top."""
    from dipaco.cli import report as report_cli

    run_dir = copy_run(finished[0], tmp_path / "run")
    before = snapshot(run_dir)
    with pytest.raises(SystemExit) as ended:
        report_cli.main([str(run_dir / "checkpoints" / "round_000002")])
    assert ended.value.code == 2
    one_line(capsys.readouterr().err, "lies in the run directory")
    assert snapshot(run_dir) == before
    report_cli.main([str(run_dir)])
    assert (run_dir / "report.md").is_file()
