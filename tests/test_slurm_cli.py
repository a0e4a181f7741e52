"""launcher=slurm from the login node: the documented example works as written, the
script requeues, wasteful settings are warned about, and a submitted job is announced."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from dipaco.config import ConfigError, compose_config
from dipaco.config.validate import validate_config


def _dry_run(argv: list[str], tmp_path: Path, capsys, monkeypatch) -> tuple[int, str, str]:
    from dipaco.cli import train as train_cli

    monkeypatch.setenv("PATH", str(tmp_path))  # no srun, no sbatch: a dry run needs neither
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["dipaco-train", "launcher=slurm", "launcher.dry_run=true", *argv])
    with pytest.raises(SystemExit) as done:
        train_cli.main()
    captured = capsys.readouterr()
    return int(done.value.code or 0), captured.out, captured.err


def test_the_documented_dry_run_works_as_written(tmp_path: Path, capsys, monkeypatch) -> None:
    """`dipaco-train launcher=slurm launcher.dry_run=true` (--help, conf/launcher/slurm.yaml) on
    the default grid: 8 ranks in 4 worker groups of 2, a script that may be requeued."""
    code, out, err = _dry_run([], tmp_path, capsys, monkeypatch)
    assert code == 0, err
    lines = out.splitlines()
    assert "#SBATCH --requeue" in lines and "#SBATCH --ntasks-per-node=8" in lines
    assert "warning" not in out  # the preset wastes nothing
    assert "the run directory" in out
    assert not (tmp_path / "multirun").exists()


@pytest.mark.parametrize(("argv", "needle"), [
    (["launcher.nproc=4", "launcher.group_size=1"], "launcher.gpus_per_node=8: 4 GPU(s) of each node are held"),
    (["launcher.timeout_min=1"], "hydra.launcher.signal_delay_s=120 s before the time limit"),
    (["launcher.timeout_min=10", "hydra.launcher.signal_delay_s=900"], "signal_delay_s=900"),
])
def test_wasteful_settings_are_warned_about(argv: list[str], needle: str, tmp_path: Path, capsys,
                                            monkeypatch) -> None:
    code, out, err = _dry_run(argv, tmp_path, capsys, monkeypatch)
    assert code == 0, err
    warnings = [x for x in out.splitlines() if x.startswith("[dipaco] warning:")]
    assert len(warnings) == 1 and needle in warnings[0], out[:2000]


def test_too_many_ranks_names_group_size_and_the_fix_works() -> None:
    """The refusal of more worker groups than paths offers launcher.group_size; applying it passes."""
    base = ["launcher=slurm", "launcher.partition=p", "launcher.group_size=1"]
    with pytest.raises(ConfigError) as err:
        validate_config(compose_config(base))
    assert err.value.key == "launcher.nproc" and "launcher.group_size=2" in str(err.value).split("Fix:")[1]
    validate_config(compose_config(base + ["launcher.group_size=2"]))


def test_a_submitted_job_is_announced_with_its_id_logs_and_how_to_follow_it(monkeypatch, capsys) -> None:
    import submitit

    from dipaco.cli.slurm_launcher import announce_submissions

    paths = SimpleNamespace(stdout=Path("/s/.submitit/77/77_0_log.out"), stderr=Path("/s/.submitit/77/77_0_log.err"))
    submitted = [SimpleNamespace(job_id="77", paths=paths)]
    monkeypatch.setattr(submitit.AutoExecutor, "map_array", lambda self, *a, **k: submitted, raising=False)
    executor = SimpleNamespace(_executor=SimpleNamespace(parameters={"nodes": 2, "ntasks_per_node": 8}))
    with announce_submissions():
        assert submitit.AutoExecutor.map_array(executor, print, [1]) is submitted
    out = capsys.readouterr().out
    line = [x for x in out.splitlines() if x.startswith("[dipaco] submitted SLURM job 77")]
    assert len(line) == 1
    for needle in ("16 task(s) on 2 node(s)", "/s/.submitit/77/77_0_log.err", "tail -f", "squeue -j 77"):
        assert needle in line[0], needle
