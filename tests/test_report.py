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
    rows, skipped = find_runs(*two_sweeps)
    assert len(rows) == 4 and skipped == []
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
    header, _, records = build_table(find_runs(*two_sweeps)[0], ignore=frozenset({"sweep"}))
    assert "trainer.threads" in header  # resolved from config.yaml for the outer runs
    assert {r["setting"]["trainer.threads"] for r in records} == {"1", "2"}


def test_cli_writes_the_report_into_the_first_directory(two_sweeps: tuple[Path, Path], capsys) -> None:
    paths, outer = two_sweeps
    report_main([str(paths), str(outer), "--metric", "routed_ppl"])
    out = capsys.readouterr().out
    assert "| grid | seeds |" in out
    assert (paths / "report.md").read_text().strip() == out.strip()
    assert json.loads((paths / "report.json").read_text())["settings"][0]["seeds"] == 2
    assert (paths / "report.png").stat().st_size > 0


def test_a_metric_no_run_has_is_refused_naming_those_they_have(two_sweeps: tuple[Path, Path], capsys) -> None:
    from dipaco.config import ConfigError
    from dipaco.job.report import plot_metric

    records = build_table(find_runs(*two_sweeps)[0], ignore=frozenset({"sweep"}))[2]
    with pytest.raises(ConfigError, match=r"--metric.*'nope'.*routed_ppl") as e:
        plot_metric(records, "nope")  # was: routed_ppl plotted instead, silently
    assert "seeds" not in str(e.value)  # a count of runs, not a metric to plot
    assert plot_metric(records, None) == "ratio_vs_dense" and plot_metric(records, "dense_ppl") == "dense_ppl"
    assert plot_metric([{k: v for k, v in r.items() if k != "ratio_vs_dense"} for r in records], None) == "routed_ppl"
    paths, _ = two_sweeps
    with pytest.raises(SystemExit):
        report_main([str(paths), "--metric", "nope"])
    assert "no run has a value of 'nope'" in capsys.readouterr().err and not (paths / "report.md").exists()


def test_every_run_found_is_in_a_row_or_named_with_the_reason(two_sweeps: tuple[Path, Path], capsys) -> None:
    """Rule 7: an unfinished run, an unreadable or non-object summary.json, a run reached
    twice through overlapping folders, a metric a seed lacks or holds as NaN, and two runs
    that the overrides do not tell apart but trained otherwise — each in a row its label
    describes, or named with the reason it is not; report.md and report.json say so."""
    paths, outer = two_sweeps
    (outer / "unfinished" / "config.yaml").write_text(yaml.safe_dump({"trainer": {"rounds": 16}}))
    _run(outer, "garbled", ["seed=5", "sweep=outer"], "2x2", 1.0)
    (outer / "garbled" / "summary.json").write_text("{not json")
    _run(outer, "listed", ["seed=6", "sweep=outer"], "2x2", 1.0)
    (outer / "listed" / "summary.json").write_text("[1, 2]")
    _run(paths, "4x4_s2", ["grid=4x4", "seed=2", "sweep=paths", "trainer.threads=1"], "4x4", float("nan"), threads=1)
    # the same overrides as the outer runs, but another H in what ran
    _run(outer, "longer_h", ["seed=0", "sweep=outer"], "2x2", 50.0)
    (outer / "longer_h" / "config.yaml").write_text(yaml.safe_dump({"trainer": {"threads": 2, "rounds": 16},
                                                                    "diloco": {"inner_steps": 100}}))
    for r in ("default_s0", "default_s1"):
        (outer / r / "config.yaml").write_text(yaml.safe_dump({"trainer": {"threads": 2, "rounds": 16},
                                                               "diloco": {"inner_steps": 50}}))
    report_main([str(paths), str(outer), str(outer / "default_s0"), "--metric", "routed_ppl"])
    text = (paths / "report.md").read_text()
    assert "Runs found: 9 (1 reached twice, counted once); in the table: 6." in text
    for name, why in (("unfinished", "unfinished: no summary.json"), ("garbled", "summary.json is unreadable"),
                      ("listed", "holds a list"), ("default_s0", "found twice")):
        assert any(name in line and why in line for line in text.splitlines()), (name, why, text)
    doc = json.loads((paths / "report.json").read_text())
    rows = {(r["setting"].get("grid"), r["setting"].get("diloco.inner_steps")): r for r in doc["settings"]}
    assert rows[("2x2", "50")]["seeds"] == 2 and rows[("2x2", "100")]["seeds"] == 1  # H told apart
    assert rows[("4x4", "")]["seeds"] == 3 and rows[("4x4", "")]["routed_ppl"] == pytest.approx(11.0)
    assert "(2 of 3)" in text and "4x4_s2: routed_ppl (nan is not a finite number)" in text
    assert len(doc["not_in_table"]) == 4


def test_an_evaluation_table_names_every_task_and_metric_it_leaves_out() -> None:
    """dipaco-infer eval's table: a task asked for that lm-eval returned nothing (or nothing
    numeric) for, and a metric whose value is not a number, are named with the reason."""
    from dipaco.cli.infer_eval import comparison, not_in_table

    report = {"tasks": ["a", "b", "c"], "dense": None, "routed": {"results": {
        "a": {"acc,none": 0.5, "acc_stderr,none": "N/A", "alias": "a"},
        "b": {"acc,none": "N/A", "alias": "b"}}}}
    rows = comparison(report)
    assert [r["task"] for r in rows] == ["a"]
    left = {(x["task"], x.get("metric")): x["why"] for x in not_in_table(report, rows)}
    assert set(left) == {("b", None), ("b", "acc"), ("c", None)}
    assert "no results" in left[("c", None)] and "'N/A' is not a number" in left[("b", "acc")]
