"""What a new user meets first: ``--help`` that fits a screen, ``dipaco-plan`` that does
not guess the ranks of torchrun, and progress bars in a terminal for the smoke run."""
from __future__ import annotations

import io
import sys

import pytest

from dipaco.cli import plan as plan_cli
from dipaco.cli import route as route_cli
from dipaco.cli import train as train_cli
from dipaco.cli.help import config_groups
from dipaco.config import compose_config
from dipaco.runtime.progress import progress_bar


def _run(main, argv: list[str], capsys, monkeypatch) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["dipaco", *argv])
    capsys.readouterr()
    try:
        main()
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(("main", "tool"), [(train_cli.main, "dipaco-train"), (route_cli.main, "dipaco-route")])
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_fits_a_screen_and_describes_the_tool(main, tool: str, flag: str, capsys, monkeypatch) -> None:
    code, out, err = _run(main, [flag], capsys, monkeypatch)
    assert code == 0 and not err
    lines = out.rstrip("\n").splitlines()
    assert len(lines) <= 40 and max(map(len, lines)) <= 79, (len(lines), max(map(len, lines)))
    assert lines[0].startswith(f"usage: {tool}") and "schema" not in out
    assert "Train a DiPaCo model" in out if tool == "dipaco-train" else "Fit the router" in out
    for group in ("data", "model", "grid", "router"):
        assert any(x.split()[:1] == [group] for x in lines), group
    assert "hydra.run.dir=DIR" in out


def test_help_lists_every_choice_of_conf_and_marks_the_default() -> None:
    groups = config_groups()
    assert groups["data"][0] == "multidomain" and "python_sources" in groups["data"]
    assert groups["launcher"] == ["local", "slurm", "spawn", "torchrun"]
    assert not any("schema" in c for choices in groups.values() for c in choices)


def test_plan_under_torchrun_refuses_to_guess_the_ranks(capsys, monkeypatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code, out, err = _run(plan_cli.main, ["launcher=torchrun"], capsys, monkeypatch)
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and not out and len(lines) == 1
    assert "launcher=spawn launcher.nproc=N" in lines[0] and "torchrun" in lines[0]
    monkeypatch.setenv("WORLD_SIZE", "4")  # inside torchrun: its world size
    code, out, _ = _run(plan_cli.main, ["launcher=torchrun"], capsys, monkeypatch)
    assert code == 0 and "world_size=4" in out


def test_plan_under_slurm_counts_every_node(capsys, monkeypatch) -> None:
    code, out, err = _run(plan_cli.main, ["launcher=slurm", "launcher.partition=p", "launcher.nodes=2",
                                          "launcher.nproc=2", "launcher.gpus_per_node=null"], capsys, monkeypatch)
    assert code == 0, err
    assert "world_size=4" in out


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_smoke_run_draws_bars_on_a_terminal_only(monkeypatch) -> None:
    """experiment=smoke leaves trainer.progress on; bars need a terminal on stderr."""
    assert compose_config(["experiment=smoke"]).trainer.progress is True
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    bar = progress_bar(compose_config(["experiment=smoke"]).trainer.progress, 8, "rounds", "step")
    assert bar is not None
    bar.update(8)
    bar.close()
    assert "rounds:" in terminal.getvalue()
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # a log file: no bar
    assert progress_bar(True, 8, "rounds", "step") is None
