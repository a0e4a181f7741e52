"""A path means one thing (dipaco/config/paths.py): the folder a command checks is the folder
it writes, and a run records its paths so that they mean the same from any directory."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from dipaco.cli.hydra_app import _run_dir_argument, pin_run_dir
from dipaco.config import compose_config
from dipaco.config.paths import LOCAL_PATH_KEYS, pin
from dipaco.run.path_guard import resolved

SPELLINGS = ["'~/runs/a'", '"~/runs/a b"', "runs/a", "./runs/a/", "'runs/it\\'s'", "runs/../b"]
COMMANDS = [[], ["launcher=slurm"]]  # a single run; launcher=slurm (Hydra's sweep directory otherwise)


@pytest.mark.parametrize("extra", COMMANDS, ids=["single", "slurm"])
@pytest.mark.parametrize("spelling", SPELLINGS)
def test_the_run_directory_checked_is_the_one_written(spelling: str, extra: list[str], tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the spelling of hydra.run.dir (quoted ~, relative, trailing slash), the
    command line Hydra reads names, from the working directory, the path the guard checked;
    under launcher=slurm the job's run_dir is that same folder."""
    home = tmp_path / "home"
    (tmp_path / "work").mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path / "work")
    argv = pin_run_dir([*extra, f"hydra.run.dir={spelling}"])
    checked = resolved(_run_dir_argument([f"hydra.run.dir={spelling}"]))  # what the guard checks
    written = _run_dir_argument(argv)  # what Hydra makes: this string, from the working directory
    assert "~" not in written.split(os.sep)
    assert Path(os.path.join(os.getcwd(), written)).resolve() == checked
    if extra:
        job = [a for a in argv if a.startswith("run_dir=")]
        assert len(job) == 1 and compose_config(job).run_dir == written


@pytest.mark.parametrize("key", [k for k in LOCAL_PATH_KEYS if k != "data.tokenizer"])  # read at composition
@pytest.mark.parametrize("spelling", ["'~/d'", "d", "./d/", "sub/../d"])
def test_every_path_setting_is_recorded_absolute(key: str, spelling: str, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Each setting naming a place here is recorded as the absolute path it meant where
    the command ran: a resume from another directory reads the same files."""
    (tmp_path / "sub").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    extra = ["data=jsonl"] if key == "data.path" else []
    cfg = compose_config([*extra, f"{key}={spelling}"])
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    assert os.path.isabs(value) and Path(value).resolve() == (tmp_path / "d").resolve()
    monkeypatch.chdir(tmp_path / "sub")  # another working directory: the same place
    assert pin(value) == value


def test_urls_hub_names_and_interpolations_are_left_alone(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert pin("s3://bucket/store") == "s3://bucket/store" and pin("${oc.env:X}") == "${oc.env:X}"
    assert compose_config(["data=hub", "data.path=org/dataset"]).data.path == "org/dataset"
    (tmp_path / "org").mkdir()
    assert compose_config(["data=hub", "data.path=org"]).data.path == str(tmp_path / "org")  # a folder here


def test_a_quoted_tilde_makes_no_folder_named_tilde(tmp_path: Path, monkeypatch) -> None:
    """End to end through dipaco-train's Hydra app: a refused run under a quoted ``~`` leaves
    no ``./~`` behind (the refusal names the expanded path, the one checked)."""
    home = tmp_path / "home"
    (home / "runs").mkdir(parents=True)
    (home / "runs" / "a").write_text("a file, not a folder")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    from dipaco.cli import train as train_cli

    monkeypatch.setattr(sys, "argv", ["dipaco-train", "hydra.run.dir='~/runs/a'"])
    with pytest.raises(SystemExit) as done:
        train_cli.main()
    assert done.value.code == 2
    assert not (tmp_path / "~").exists()
