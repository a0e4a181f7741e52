"""Rule: a command replaces or deletes only files it wrote (dipaco/run/owned.py).

The table test runs every writer (export dipaco / hf / --all, dipaco-report, score --out,
a sweep's multirun.yaml) through the same cases: files of the user's beside its output are
kept by ``--force``; a file of the user's in the way (a recorded file the user changed) is
refused in one line with the folder byte-identical; a link in the way is never written
through; a staging folder an interrupted write left is cleaned by the next. The unit tests
pin the helper's API, which other writers adopt.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import pytest
from omegaconf import OmegaConf

from dipaco.cli import infer as infer_cli
from dipaco.cli import report as report_cli
from dipaco.cli import train as train_cli
from dipaco.cli.sweep_dir import SWEEP_RECORD, check_sweep_dir, record_sweep
from dipaco.run.owned import RECORD, STAGING_PREFIX, OwnedWrite, OwnershipError, check_owned, write_owned_file

from _hostile import SMOKE, one_line, run_cli, snapshot

DEAD_PID = 2**22 + 12345  # above Linux's default pid_max: never a live process


# ------------------------------------------------------------------ the helper


def test_write_owned_file_replaces_its_own_and_refuses_the_users(tmp_path):
    """`write_owned_file(F, ...)` over the user's F, over F changed since, through a link
    — refused (`dipaco did not write it` / `changed since dipaco wrote it` / `symbolic link`); its own F is replaced."""
    f = tmp_path / "out" / "score.json"
    write_owned_file(f, "1", "score --out")
    write_owned_file(f, "2", "score --out")
    assert f.read_text() == "2"
    f.write_text("my edit")
    with pytest.raises(OwnershipError, match="changed since dipaco wrote it"):
        write_owned_file(f, "3", "score --out")
    mine = tmp_path / "out" / "notes.json"
    mine.write_text("mine")
    with pytest.raises(OwnershipError, match="did not write it"):
        write_owned_file(mine, "3", "score --out")
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / "out" / "link.json").symlink_to(victim)
    with pytest.raises(OwnershipError, match="symbolic link"):
        write_owned_file(tmp_path / "out" / "link.json", "3", "score --out")
    assert victim.read_text() == "keep" and mine.read_text() == "mine" and f.read_text() == "my edit"


def test_owned_write_keeps_other_files_removes_its_stale_ones_and_fails_cleanly(tmp_path):
    """`OwnedWrite(out, replace=True)` twice, the second writing fewer files, the user's files beside; a failing write
    — the user's files stay, dipaco's file not rewritten is removed; a failure changes nothing and leaves no staging."""
    out = tmp_path / "exp"
    with OwnedWrite(out, "export --out", replace=True) as s:
        (s / "a").write_text("a1")
        (s / "sub").mkdir()
        (s / "sub" / "b").write_text("b1")
    (out / "eval").mkdir()
    (out / "eval" / "mine.txt").write_text("mine")
    with OwnedWrite(out, "export --out", replace=True) as s:
        (s / "a").write_text("a2")
    assert (out / "a").read_text() == "a2" and not (out / "sub").exists()
    assert (out / "eval" / "mine.txt").read_text() == "mine"
    before = snapshot(out)
    with pytest.raises(RuntimeError):
        with OwnedWrite(out, "export --out", replace=True) as s:
            (s / "a").write_text("a3")
            raise RuntimeError("killed halfway")
    assert snapshot(out) == before
    with pytest.raises(OwnershipError, match="pass --force"):
        with OwnedWrite(out, "export --out", replace=False) as s:
            (s / "a").write_text("a4")
    assert snapshot(out) == before
    new = tmp_path / "never"
    with pytest.raises(RuntimeError):
        with OwnedWrite(new, "export --out", replace=True):
            raise RuntimeError("failed")
    assert not new.exists()


def test_a_command_never_deletes_or_replaces_another_commands_file(tmp_path):
    """`score --out EXPORT/score.json`, then `export --force` into EXPORT writing fewer files; and a write of a name
    another command wrote — the score report stays; the write is refused (`was written by score --out`)."""
    out = tmp_path / "exp"
    with OwnedWrite(out, "export --out", replace=True) as s:
        (s / "a").write_text("a1")
        (s / "b").write_text("b1")
    write_owned_file(out / "score.json", "{}", "score --out")
    with OwnedWrite(out, "export --out", replace=True) as s:
        (s / "a").write_text("a2")
    assert (out / "score.json").read_text() == "{}" and not (out / "b").exists()
    with pytest.raises(OwnershipError, match="was written by score --out"):
        with OwnedWrite(out, "export --out", replace=True) as s:
            (s / "score.json").write_text("mine now")
    assert (out / "score.json").read_text() == "{}"


def test_a_write_killed_while_moving_in_leaves_a_folder_the_next_write_accepts(tmp_path, monkeypatch):
    """An export killed after moving one of its files into an earlier export, beside the user's notes
    — the next `--force` write succeeds, the user's notes intact, no staging left."""
    import dipaco.run.owned as owned

    out = tmp_path / "exp"
    with OwnedWrite(out, "export --out", replace=True) as s:
        for name in ("a", "b", "c"):
            (s / name).write_text(f"{name}1")
    (out / "notes.txt").write_text("mine")
    real, calls = os.replace, []

    def dies_on_the_third(src, dst):  # the record, file a, then file b
        calls.append(dst)
        if len(calls) == 3:
            raise KeyboardInterrupt("killed")
        real(src, dst)

    monkeypatch.setattr(owned.os, "replace", dies_on_the_third)
    with pytest.raises(KeyboardInterrupt):
        with OwnedWrite(out, "export --out", replace=True) as s:
            for name in ("a", "b", "c"):
                (s / name).write_text(f"{name}2")
    monkeypatch.setattr(owned.os, "replace", real)
    with OwnedWrite(out, "export --out", replace=True) as s:
        for name in ("a", "b", "c"):
            (s / name).write_text(f"{name}3")
    assert [(out / n).read_text() for n in ("a", "b", "c", "notes.txt")] == ["a3", "b3", "c3", "mine"]
    assert not [p for p in out.iterdir() if p.name.startswith(STAGING_PREFIX)]


def test_a_folder_inside_another_write_is_refused(tmp_path):
    """`check_owned(EXPORT/sub, ...)` where EXPORT's record lists files under sub/
    — `lies inside EXPORT, which another dipaco command wrote`."""
    with OwnedWrite(tmp_path / "routed", "export --out", replace=True) as s:
        (s / "path_000").mkdir()
        (s / "path_000" / "model.safetensors").write_text("w")
    with pytest.raises(OwnershipError, match="another dipaco command wrote"):
        check_owned(tmp_path / "routed" / "path_000", ["model.safetensors"], "export --out", replace=True)


# ------------------------------------------------------------------ every writer, one table


def _export(*flags: str) -> Callable:
    def write(run_dir: Path, out: Path, capsys, monkeypatch) -> tuple[int, str]:
        return run_cli(infer_cli.main, ["export", run_dir, *flags, "--out", out, "--force"], capsys, monkeypatch)
    return write


def _report(run_dir: Path, out: Path, capsys, monkeypatch) -> tuple[int, str]:
    out.mkdir(exist_ok=True)
    return run_cli(report_cli.main, [out, run_dir], capsys, monkeypatch)


def _score(run_dir: Path, out: Path, capsys, monkeypatch) -> tuple[int, str]:
    docs = out.parent / "docs.jsonl"  # one small document: the write is what is tested, not the scoring
    docs.write_text(json.dumps({"text": "def f(x):\n    return x + 1\n" * 8}) + "\n")
    return run_cli(infer_cli.main, ["score", run_dir, "--file", docs, "--out", out / "score.json", "--force"], capsys,
                   monkeypatch)


def _sweep(run_dir: Path, out: Path, capsys, monkeypatch) -> tuple[int, str]:
    """What a sweep does to its folder, in Hydra's order: the check, multirun.yaml, the record."""
    task = ["seed=0,1", *SMOKE]
    try:
        check_sweep_dir(out, task)
    except OwnershipError as e:
        return 2, f"dipaco: error: {e}\n"
    out.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create({"hydra": {"overrides": {"task": task}}}), out / SWEEP_RECORD)
    record_sweep(out)
    return 0, ""


# writer → (its call, one file it writes)
WRITERS = {
    "export dipaco": (_export("--path", "1"), "config.json"),
    "export hf": (_export("--path", "1", "--format", "hf"), "README.md"),
    "export hf --all": (_export("--all", "--format", "hf"), "routed.json"),
    "dipaco-report": (_report, "report.md"),
    "score --out": (_score, "score.json"),
    "sweep folder": (_sweep, SWEEP_RECORD),
}


@pytest.mark.slow
@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_every_writer_replaces_only_files_it_wrote(request, tmp_path, capsys, monkeypatch, writer):
    """Every writer (export dipaco / hf / --all, dipaco-report, score --out, a sweep folder) run again with `--force`
    over its earlier output beside the user's files, with one of its files edited by the user, or a link in its place,
    and after an interrupted write — the user's files are kept; the edited file and the link are refused in one line
    (`changed since dipaco wrote it` / `symbolic link`), the folder byte-identical and the link's target untouched;
    the staging folder left behind is removed by the next write."""
    write, owned = WRITERS[writer]
    run_dir = None if writer == "sweep folder" else request.getfixturevalue("finished")[0]  # only what it reads
    out = tmp_path / "out"
    code, err = write(run_dir, out, capsys, monkeypatch)
    assert code == 0, err
    assert (out / owned).is_file() and (out / RECORD).is_file()
    # the user's files beside the output survive a replacement
    (out / "eval").mkdir()
    (out / "eval" / "results.json").write_text("{}")
    (out / "notes.txt").write_text("my notes")
    code, err = write(run_dir, out, capsys, monkeypatch)
    assert code == 0, err
    assert (out / "eval" / "results.json").read_text() == "{}" and (out / "notes.txt").read_text() == "my notes"
    # one of its files, edited by the user: theirs now
    with open(out / owned, "a", encoding="utf-8") as f:
        f.write("\n")
    before = snapshot(tmp_path)
    code, err = write(run_dir, out, capsys, monkeypatch)
    assert code == 2
    one_line(err, "changed since dipaco wrote it")
    assert snapshot(tmp_path) == before
    # a link in its place is never written through
    (out / owned).unlink()
    victim = tmp_path / "victim.txt"
    victim.write_text("outside")
    (out / owned).symlink_to(victim)
    code, err = write(run_dir, out, capsys, monkeypatch)
    assert code == 2
    one_line(err, "symbolic link")
    assert victim.read_text() == "outside"
    # what an interrupted write left (a dead process's staging folder) is cleaned by the next
    (out / owned).unlink()
    stale = out / f"{STAGING_PREFIX}{DEAD_PID}-x"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"\0" * 4096)
    code, err = write(run_dir, out, capsys, monkeypatch)
    assert code == 0, err
    assert not stale.exists() and (out / owned).is_file()
    assert not [p for p in out.iterdir() if p.name.startswith(STAGING_PREFIX)]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["dipaco", "hf"])
def test_export_into_a_path_folder_of_a_routed_export_is_refused(finished, tmp_path, capsys, monkeypatch, fmt):
    """`dipaco-infer export D --path 1 --out ROUTED/path_001 --force` into a path folder of an `--all` export
    — `lies inside the dipaco export ROUTED`; exit 2; ROUTED byte-identical (load_routed keeps working)."""
    routed = tmp_path / "routed"
    code, err = run_cli(infer_cli.main, ["export", finished[0], "--all", "--format", "hf", "--out", routed],
                        capsys, monkeypatch)
    assert code == 0, err
    before = snapshot(routed)
    code, err = run_cli(infer_cli.main, ["export", finished[0], "--path", "1", "--format", fmt, "--out",
                                         routed / "path_001", "--force"], capsys, monkeypatch)
    assert code == 2
    one_line(err, "lies inside")
    assert snapshot(routed) == before


def test_a_sweep_never_rewrites_a_users_or_another_sweeps_multirun_yaml(tmp_path, capsys, monkeypatch):
    """`dipaco-train -m hydra.sweep.dir=D ...` where D holds the user's multirun.yaml, or another sweep's
    — refused in one line before the sweeper writes (`dipaco did not write it` / `holds another sweep`); D byte-identical."""
    d = tmp_path / "sweep"
    d.mkdir()
    (d / SWEEP_RECORD).write_text("my: notes\n")
    before = snapshot(d)
    code, err = run_cli(train_cli.main, ["-m", f"hydra.sweep.dir={d}", *SMOKE, "seed=0,1"], capsys, monkeypatch)
    assert code == 2
    one_line(err, "did not write it")
    assert snapshot(d) == before
    other = tmp_path / "other"
    assert _sweep(None, other, capsys, monkeypatch)[0] == 0
    before = snapshot(other)
    with pytest.raises(OwnershipError, match="holds another sweep"):
        check_sweep_dir(other, ["seed=2,3", *SMOKE])
    assert snapshot(other) == before
    assert check_sweep_dir(other, ["seed=0,1", *SMOKE]) == other.resolve()  # the same sweep again


def test_a_folder_that_cannot_be_written_is_one_line(tmp_path):
    """`OwnedWrite` / `write_owned_file` into a folder under a file (or a read-only one)
    — `cannot write into ...` (one line, no traceback), nothing written."""
    blocker = tmp_path / "a-file"
    blocker.write_text("mine")
    with pytest.raises(OwnershipError, match="cannot write into"):
        write_owned_file(blocker / "sub" / "score.json", "{}", "score --out")
    with pytest.raises(OwnershipError, match="cannot write into"):
        with OwnedWrite(blocker / "exp", "export --out", replace=True):
            pass
    assert blocker.read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_a_sweep_jobs_folder_is_one_short_component_whatever_its_overrides_hold() -> None:
    """`-m data.path=/x/y,...`: the job's folder name escapes `/` (and `%`, so names stay
    distinct), and a name over 200 bytes is cut with a hash of the whole (file systems
    refuse a component over 255 bytes)."""
    from dipaco.cli.sweep_dir import job_dirname

    assert job_dirname("data.path=/x/y,seed=1") == "data.path=%2Fx%2Fy,seed=1"
    assert job_dirname("a=50%/b") == "a=50%25%2Fb" != job_dirname("a=50%2Fb")
    long = [job_dirname("data.path=/" + "é" * 300 + tail) for tail in ("a", "b")]
    assert all(len(n.encode("utf-8")) <= 200 and "/" not in n for n in long)
    assert long[0] != long[1]  # the hash keeps apart what the cut made alike
    assert job_dirname("seed=1") == "seed=1"
