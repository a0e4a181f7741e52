"""No traceback reaches a user (dipaco/cli/errors.py): every console script of setup.cfg
goes through one error boundary, and a table of hostile arguments for every script ends
in one line on stderr, never a "Traceback"; an unknown error is one line naming the file
that holds its traceback. A store that cannot work across processes is refused before
work."""
from __future__ import annotations

import configparser
import importlib
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

from _hostile import SMOKE, run_cli

ROOT = Path(__file__).resolve().parents[1]


def console_scripts() -> dict[str, str]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = [x.strip() for x in cfg["options.entry_points"]["console_scripts"].splitlines() if x.strip()]
    return dict(tuple(part.strip() for part in x.split("=", 1)) for x in lines)  # type: ignore[misc]


def entry(target: str) -> Callable[..., Any]:
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("script", sorted(console_scripts()))
def test_every_console_script_goes_through_the_error_boundary(script: str) -> None:
    assert getattr(entry(console_scripts()[script]), "error_boundary", False), \
        f"{script}'s main is not wrapped by dipaco.cli.errors.entry_point"


BAD_UTF8 = os.fsdecode(b"caf\xe9 \xff")  # what the shell hands Python for bytes that are not UTF-8


def hostile_cases(tmp: Path) -> list[tuple[str, list[str]]]:
    """(console script, arguments) that must each end in one line."""
    a_file = tmp / "a_file"
    a_file.write_text("not a folder")
    run = [f"hydra.run.dir={tmp / 'run'}"]
    dec = ["diloco.mode=decoupled"]
    return [
        ("dipaco-train", SMOKE + run + ["launcher=spawn", "launcher.nproc=2", "launcher.timeout_s=0.001"]),
        ("dipaco-train", SMOKE + run + [f"data.cache_dir={a_file}"]),
        ("dipaco-train", SMOKE + run + [f"data.cache_dir={a_file}/cache"]),
        ("dipaco-train", SMOKE + run + dec + ["diloco.decoupled.store_url=memory://shared/run"]),
        ("dipaco-train", SMOKE + run + dec + [f"diloco.decoupled.store_url={a_file}"]),
        ("dipaco-train", SMOKE + run + dec + ["diloco.decoupled.store_url=s3://bucket/run"]),
        ("dipaco-train", SMOKE + [f"hydra.run.dir={a_file}/run"]),
        ("dipaco-train", SMOKE + run + [f"data.path={BAD_UTF8}"]),
        ("dipaco-route", SMOKE + run + [f"data.cache_dir={a_file}/cache"]),
        ("dipaco-route", SMOKE + [f"hydra.run.dir={a_file}"]),
        ("dipaco-route", SMOKE + run + [f"tag={BAD_UTF8}"]),
        ("dipaco-infer", ["route", str(tmp / "no_run"), "--text", "x"]),
        ("dipaco-infer", ["route", str(a_file), "--text", BAD_UTF8]),
        ("dipaco-infer", ["generate", str(tmp), "--prompt", BAD_UTF8]),
        ("dipaco-infer", ["score", str(a_file), "--file", str(a_file)]),
        ("dipaco-report", [str(a_file)]),
        ("dipaco-report", [str(tmp / "none")]),
        ("dipaco-report", [BAD_UTF8]),
        ("dipaco-plan", SMOKE + ["launcher.timeout_s=0.001"]),
        ("dipaco-plan", SMOKE + ["grid.levels=[0]"]),
        ("dipaco-plan", [f"tag={BAD_UTF8}"]),
        ("dipaco-serve", [str(tmp / "no_run")]),
        ("dipaco-serve", [str(a_file)]),
        ("dipaco-serve", [BAD_UTF8]),
        ("dipaco-serve", [str(tmp), "--port", "99999"]),
        ("dipaco-decoupled", ["worker", str(tmp / "no_store")]),
        ("dipaco-decoupled", ["status", str(a_file)]),
        ("dipaco-decoupled", ["sync", BAD_UTF8]),
        ("dipaco-decoupled", ["finish", str(tmp), str(tmp / "run")]),
    ]


@pytest.mark.slow  # every console script's parser, many times: out of the fast lane
def test_hostile_arguments_of_every_console_script_end_in_one_line(tmp_path: Path, capsys, monkeypatch) -> None:
    scripts = console_scripts()
    cases = hostile_cases(tmp_path)
    assert {s for s, _ in cases} == set(scripts), "every console script has hostile cases"
    for script, argv in cases:
        code, err = run_cli(entry(scripts[script]), argv, capsys, monkeypatch)
        lines = [x for x in err.splitlines() if x.strip()]
        assert code != 0 and "Traceback" not in err, (script, argv, err[-2000:])
        assert len(lines) == 1 and lines[0].startswith("dipaco: error:"), (script, argv, err[-2000:])
        assert "internal error" not in err, (script, argv, err)  # each is a known, named cause
        assert not (tmp_path / "run").exists(), (script, argv, "a refused command wrote its run directory")


def test_the_memory_store_is_refused_before_work(tmp_path: Path, capsys, monkeypatch) -> None:
    from dipaco.cli import train as train_cli
    code, err = run_cli(train_cli.main, SMOKE + [f"hydra.run.dir={tmp_path / 'run'}", "diloco.mode=decoupled",
                                                 "diloco.decoupled.store_url=memory://x/run"], capsys, monkeypatch)
    assert code == 2 and "separate processes" in err and "store_url" in err


def test_an_unknown_error_is_one_line_naming_its_traceback_file(tmp_path: Path, capsys, monkeypatch) -> None:
    from dipaco.cli import plan as plan_cli

    def broken(cfg: Any) -> Any:
        raise RuntimeError("a bug\nover two lines")

    monkeypatch.setattr(plan_cli, "plan_for", broken)
    monkeypatch.setenv("DIPACO_CRASH_DIR", str(tmp_path))
    monkeypatch.delenv("DIPACO_DEBUG", raising=False)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    code, err = run_cli(plan_cli.main, SMOKE, capsys, monkeypatch)
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 1 and len(lines) == 1 and "Traceback" not in err and "RuntimeError: a bug over two lines" in err
    dumps = list(tmp_path.glob("dipaco-crash-*.txt"))
    assert len(dumps) == 1 and str(dumps[0]) in err and "Traceback" in dumps[0].read_text()


@pytest.mark.multiprocess
def test_a_read_only_place_is_refused_before_work(tmp_path: Path, monkeypatch) -> None:
    """Root may write anywhere, so the read-only folder is simulated by os.access."""
    from dipaco.run.path_guard import check_run_root, check_target
    from dipaco.run.run_dir import RunDirError
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, m, **kw: False if Path(p) == ro and m & os.W_OK else real(p, m))
    for call in (lambda: check_run_root(ro / "run"), lambda: check_target(ro / "cache", "data.cache_dir", folder=True),
                 lambda: check_run_root(ro)):
        with pytest.raises(RunDirError, match="read-only"):
            call()
    check_target(tmp_path / "cache", "data.cache_dir", folder=True)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_real_console_script_prints_no_traceback(tmp_path: Path) -> None:
    """The installed entry point, in its own process: a non-UTF-8 --text."""
    proc = subprocess.run([sys.executable, "-c", "from dipaco.cli.infer import main; main()", "route",
                           str(tmp_path), "--text", BAD_UTF8], capture_output=True, timeout=120,
                          env=dict(os.environ, PYTHONIOENCODING="utf-8"))
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 2 and "Traceback" not in err and "UTF-8" in err, err
