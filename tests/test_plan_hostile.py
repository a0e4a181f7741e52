"""Hostile input to ``dipaco-plan --simulate``: a simulation that would not finish is
refused in one line naming the key, goodput stays a share, and ``--json`` / ``--plot``
never write into a run directory."""
from __future__ import annotations

from pathlib import Path

import pytest

from _sim_jobs import TINY, on, tiny_job
from dipaco.cli import plan as plan_cli
from dipaco.config import ConfigError, compose_config
from dipaco.sim.cost import check_cost
from dipaco.sim.job import SimJob, sim_job
from dipaco.sim.modes import MODES, simulate_mode


@pytest.fixture(scope="module")
def job() -> SimJob:
    return tiny_job()


@pytest.mark.parametrize("cluster, key", [
    ({"mtbf_hours": 1e-9}, "cluster.mtbf_hours"),  # every checkpoint interval fails: never ends
    ({"horizon_hours": 1e6}, "cluster.horizon_hours"),  # 10^10 rounds
])
def test_a_simulation_that_would_not_finish_is_refused_naming_the_key(job: SimJob, cluster, key) -> None:
    j = on(job, **cluster)
    with pytest.raises(ConfigError) as e:
        check_cost(j, MODES)
    assert e.value.key == key


def test_the_refusals_fix_and_the_papers_cluster_pass(job: SimJob) -> None:
    j = on(job, horizon_hours=1e6)
    with pytest.raises(ConfigError) as e:
        check_cost(j, MODES)
    fit = float(str(e.value).split("cluster.horizon_hours=")[-1].split()[0])
    check_cost(on(job, horizon_hours=fit), MODES)
    paper = sim_job(compose_config(["experiment=paper", "cluster=paper_1m"]))
    check_cost(paper, MODES)


def test_the_cli_refuses_in_one_line_before_simulating(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        plan_cli.main(["--simulate", *TINY, "cluster.mtbf_hours=1e-9"])
    assert e.value.code == 2
    assert "cluster.mtbf_hours" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["sync", "ddp"])
def test_goodput_is_a_share_under_a_heavy_tail(job: SimJob, mode: str) -> None:
    r = simulate_mode(on(job, straggler="lognormal", straggler_sigma=5.0), mode)
    assert 0.0 <= r.goodput <= 1.0


def test_json_and_plot_never_write_into_a_run(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("keep: 1\n")
    (run / "metrics.jsonl").write_text("")
    for flag, name in (("--json", "config.yaml"), ("--plot", "sim.png")):
        with pytest.raises(SystemExit):
            plan_cli.main(["--simulate", *TINY, flag, str(run / name)])
        assert "run directory" in capsys.readouterr().err
    assert (run / "config.yaml").read_text() == "keep: 1\n"
    assert not (run / "sim.png").exists()


@pytest.mark.parametrize("argv, words", [
    (["--plot", "sim.txt"], "suffix names its format"),
    (["--json", "."], "is a folder"),
    (["--json="], "names no file"),  # an empty shell variable: nothing was written, silently
    (["--force"], "drop --force"),
    (["--json", "sim.png", "--plot", "sim.png"], "name the same file"),
])
def test_outputs_it_cannot_write_are_refused_before_simulating(tmp_path: Path, capsys, monkeypatch,
                                                                argv, words) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(plan_cli, "compose", lambda *a: pytest.fail("simulated before refusing"))
    with pytest.raises(SystemExit) as e:
        plan_cli.main(["--simulate", *argv])
    assert e.value.code == 2 and words in capsys.readouterr().err
