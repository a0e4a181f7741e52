"""dipaco-report: runs grouped over seeds by their effective settings, across sweeps."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from dipaco.cli.report import main as report_main
from dipaco.job.report import build_table, find_runs


def _run(root: Path, name: str, overrides: list[str], grid: str, ppl: float, threads: int = 2) -> None:
    """A fake finished run: summary.json, .hydra/{overrides,hydra}.yaml, config.yaml."""
    d = root / name
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (d / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump(
        {"hydra": {"runtime": {"choices": {"grid": grid, "diloco": "nesterov"}}}}))
    (d / "config.yaml").write_text(yaml.safe_dump({"trainer": {"threads": threads, "rounds": 16}}))
    num_paths = math.prod(int(k) for k in grid.split("x"))  # "4x4" → 16
    (d / "summary.json").write_text(json.dumps({"routed_ppl": ppl, "dense_ppl": 2 * ppl, "ratio_vs_dense": 0.5,
                                                "num_paths": num_paths}))


@pytest.fixture
def two_sweeps(tmp_path: Path) -> tuple[Path, Path]:
    paths, outer = tmp_path / "paths", tmp_path / "outer"
    for seed, ppl in ((0, 10.0), (1, 12.0)):
        _run(paths, f"4x4_s{seed}", ["grid=4x4", f"seed={seed}", "sweep=paths", "trainer.threads=1"],
             "4x4", ppl, threads=1)
        # the default grid, from another sweep that never overrode grid
        _run(outer, f"default_s{seed}", [f"seed={seed}", "sweep=outer"], "2x2", ppl + 10)
    (outer / "unfinished").mkdir()
    return paths, outer


def test_runs_of_two_sweeps_line_up_by_effective_value(two_sweeps: tuple[Path, Path]) -> None:
    rows = find_runs(*two_sweeps)
    assert len(rows) == 4
    header, table, records = build_table(rows)
    # grid is read from the outer runs' group choice; sweep and threads do not split settings
    assert header[:2] == ["grid", "seeds"]
    assert [r["setting"]["grid"] for r in records] == ["2x2", "4x4"]  # fewer paths first
    by_grid = {r["setting"]["grid"]: r for r in records}
    assert set(by_grid) == {"4x4", "2x2"}
    assert by_grid["4x4"]["seeds"] == 2 and by_grid["4x4"]["routed_ppl"] == pytest.approx(11.0)
    assert by_grid["2x2"]["routed_ppl"] == pytest.approx(21.0)
    assert any("11 ± 1" in cell for row in table for cell in row)


def test_an_unignored_execution_key_splits_the_settings(two_sweeps: tuple[Path, Path]) -> None:
    header, _, records = build_table(find_runs(*two_sweeps), ignore=frozenset({"sweep"}))
    assert "trainer.threads" in header  # resolved from config.yaml for the outer runs
    assert {r["setting"]["trainer.threads"] for r in records} == {"1", "2"}


def test_cli_writes_the_report_into_the_first_directory(two_sweeps: tuple[Path, Path], capsys) -> None:
    paths, outer = two_sweeps
    report_main([str(paths), str(outer), "--metric", "routed_ppl"])
    out = capsys.readouterr().out
    assert "| grid | seeds |" in out
    assert (paths / "report.md").read_text().strip() == out.strip()
    assert json.loads((paths / "report.json").read_text())[0]["seeds"] == 2
    assert (paths / "report.png").stat().st_size > 0


def test_a_metric_no_run_has_is_refused_naming_those_they_have(two_sweeps: tuple[Path, Path], capsys) -> None:
    from dipaco.config import ConfigError
    from dipaco.job.report import plot_metric

    records = build_table(find_runs(*two_sweeps), ignore=frozenset({"sweep"}))[2]
    with pytest.raises(ConfigError, match=r"--metric.*'nope'.*routed_ppl"):
        plot_metric(records, "nope")  # was: routed_ppl plotted instead, silently
    assert plot_metric(records, None) == "ratio_vs_dense" and plot_metric(records, "dense_ppl") == "dense_ppl"
    assert plot_metric([{k: v for k, v in r.items() if k != "ratio_vs_dense"} for r in records], None) == "routed_ppl"
    paths, _ = two_sweeps
    with pytest.raises(SystemExit):
        report_main([str(paths), "--metric", "nope"])
    assert "no run has a value of 'nope'" in capsys.readouterr().err and not (paths / "report.md").exists()
