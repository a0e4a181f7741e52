"""Paths by rule (dipaco/run/path_guard.py, docs/design.md contract 8): one function decides
whether a command may write or replace a path. Unit cases for each part of the rule, the
decoupled store's owner (dipaco/decoupled/owner.py), and a fixed-seed walk over random
trees of run directories, plain folders, files, FIFOs and symlinks that checks every
verdict against the rule and that deciding never changes the disk."""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from dipaco.decoupled.owner import OWNER_KEY, check_store, claim_store
from dipaco.run.path_guard import check_run_root, check_target, enclosing_run
from dipaco.run.run_dir import RunDir, RunDirError

SEED = 32


def make_run(d: Path) -> Path:
    """A minimal run directory: config.yaml and fingerprints.json."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.yaml").write_text("seed: 0\n")
    (d / "fingerprints.json").write_text("{}\n")
    (d / "checkpoints").mkdir(exist_ok=True)
    return d


def listing(root: Path) -> dict[str, str]:
    """Every entry under ``root`` (links not followed) with its kind and bytes."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            kind = "link:" + os.readlink(p) if p.is_symlink() else ("dir" if p.is_dir() else
                                                                    "fifo" if not p.is_file() else p.read_text())
            out[str(p.relative_to(root))] = kind
    return out


# ------------------------------------------------------------------ each rule


def test_a_file_of_a_run_is_never_a_target(tmp_path):
    run = make_run(tmp_path / "run")
    for target in (run / "config.yaml", run / "checkpoints" / "round_000099", run, run / "new.json"):
        with pytest.raises(RunDirError, match="lies in the run directory"):
            check_target(target, "score --out")
    assert check_target(tmp_path / "out.json", "score --out") == (tmp_path / "out.json").resolve()


def test_its_own_run_only_where_it_owns(tmp_path):
    run = make_run(tmp_path / "run")
    assert check_target(run / "cache" / "x", "data.cache_dir", own_run=run, owned=("cache",))
    for bad in (run, run / "config.yaml", run / "checkpoints"):
        with pytest.raises(RunDirError, match="may write only cache/"):
            check_target(bad, "data.cache_dir", own_run=run, owned=("cache",))


def test_symlinks_are_resolved_before_the_rule(tmp_path):
    run = make_run(tmp_path / "run")
    (tmp_path / "innocent").symlink_to(run / "checkpoints")
    with pytest.raises(RunDirError, match="lies in the run directory"):
        check_target(tmp_path / "innocent" / "round_000099", "export --out")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "fine").symlink_to(tmp_path / "elsewhere")
    assert check_target(tmp_path / "fine" / "x", "export --out") == tmp_path / "elsewhere" / "x"


def test_special_files_are_never_targets(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(RunDirError, match="special file"):
        check_target(fifo, "score --out")
    with pytest.raises(RunDirError, match="special file"):
        check_run_root(fifo)


def test_a_folder_it_did_not_make_is_never_replaced(tmp_path):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "thesis.tex").write_text("a week of writing")
    with pytest.raises(RunDirError, match="did not make"):
        check_target(notes, "--out", replaces=True, marker=".dipaco-export")
    (notes / ".dipaco-export").write_text("")
    assert check_target(notes, "--out", replaces=True, marker=".dipaco-export")


def test_a_run_directory_is_a_folder_outside_every_other_run(tmp_path):
    run = make_run(tmp_path / "run")
    (tmp_path / "file").write_text("x")
    for bad, why in ((tmp_path / "file", "a file"), (run / "checkpoints", "lies in the run directory"),
                     (run / "new", "lies in the run directory")):
        with pytest.raises(RunDirError, match=why):
            check_run_root(bad)
    assert check_run_root(run) == run and check_run_root(tmp_path / "new") == tmp_path / "new"


# ------------------------------------------------------------------ the store's owner


def test_a_fresh_run_never_empties_another_runs_store(tmp_path):
    """The issue's example: store_url at a directory whose store belongs to another run."""
    other, mine = make_run(tmp_path / "other"), make_run(tmp_path / "mine")
    store = tmp_path / "shared-store"
    claim_store(str(store), RunDir.at(other), resume=False)
    (store / "plan.json").write_text("{}")
    before = listing(store)
    for resume in (False, True):
        with pytest.raises(RunDirError, match="store of another run"):
            claim_store(str(store), RunDir.at(mine), resume=resume)
    assert listing(store) == before
    assert json.loads((store / OWNER_KEY).read_text())["run_dir"] == str(other.resolve())


def test_a_store_without_an_owner_is_left_alone_outside_its_run(tmp_path):
    mine = make_run(tmp_path / "mine")
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "plan.json").write_text("{}")
    with pytest.raises(RunDirError, match="which run it belongs to is unknown"):
        check_store(str(legacy), RunDir.at(mine), resume=False)
    (tmp_path / "stuff").mkdir()
    (tmp_path / "stuff" / "a.txt").write_text("x")
    with pytest.raises(RunDirError, match="not a dipaco store"):
        check_store(str(tmp_path / "stuff"), RunDir.at(mine), resume=False)
    assert (legacy / "plan.json").is_file() and (tmp_path / "stuff" / "a.txt").is_file()


def test_its_own_store_is_emptied_for_a_fresh_run_and_kept_on_resume(tmp_path):
    mine = RunDir.at(make_run(tmp_path / "mine"))
    default = mine.root / "decoupled"
    claim_store(str(default), mine, resume=False)
    (default / "plan.json").write_text("{}")
    claim_store(str(default), mine, resume=True)
    assert (default / "plan.json").is_file()
    claim_store(str(default), mine, resume=False)
    assert not (default / "plan.json").exists() and (default / OWNER_KEY).is_file()
    with pytest.raises(RunDirError, match="may write only decoupled/"):
        check_store(str(mine.root / "checkpoints"), mine, resume=False)


# ------------------------------------------------------------------ the walk


def random_tree(root: Path, rng: random.Random) -> tuple[list[Path], list[Path]]:
    """Random folders, run directories, files, FIFOs and symlinks under ``root``;
    returns (every path made, the run directories made)."""
    made, runs = [root], []
    for i in range(40):
        parent = rng.choice([p for p in made if p.is_dir() and not p.is_symlink()])
        p = parent / f"n{i}"
        kind = rng.choice(["dir", "dir", "run", "file", "fifo", "link"])
        if kind == "dir":
            p.mkdir()
        elif kind == "run":
            runs.append(make_run(p))
            made += [p / "config.yaml", p / "checkpoints"]
        elif kind == "file":
            p.write_text("data")
        elif kind == "fifo":
            os.mkfifo(p)
        else:
            p.symlink_to(rng.choice(made))
        made.append(p)
    return made, runs


def expected(target: Path, runs: list[Path], own: Path | None, owned: tuple[str, ...], special: bool) -> bool:
    """The rule, from what the tree was built as (not from the guard's own detection)."""
    real = Path(os.path.realpath(target))
    if special:
        return False
    if own is not None and (real == own or own in real.parents):
        return any(real == own / o or own / o in real.parents for o in owned)
    return not any(real == r or r in real.parents for r in runs)


def test_random_trees_every_verdict_follows_the_rule_and_nothing_changes(tmp_path):
    rng = random.Random(SEED)
    checked = refused = 0
    for t in range(6):
        root = tmp_path / f"t{t}"
        root.mkdir()
        made, runs = random_tree(root, rng)
        runs = [Path(os.path.realpath(r)) for r in runs]
        before = listing(root)
        for _ in range(150):
            base = rng.choice(made)
            target = base / rng.choice(["", "new", "cache/x", "decoupled"]) if base.is_dir() else base
            own = rng.choice(runs + [None]) if runs else None
            owned = tuple(rng.sample(["cache", "decoupled", "checkpoints"], rng.randint(0, 2)))
            real = Path(os.path.realpath(target))
            special = real.exists() and not (real.is_dir() or real.is_file())
            want = expected(target, runs, own, owned, special)
            try:
                check_target(target, "x", own_run=own, owned=owned)
                got = True
            except RunDirError as e:
                got = False
                assert "\n" not in str(e)
            assert got == want, (target, real, own, owned, enclosing_run(real))
            checked += 1
            refused += not got
        assert listing(root) == before  # deciding writes nothing
    assert checked == 900 and 100 < refused < 800
