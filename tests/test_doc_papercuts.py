"""Small things a reader meets first: help texts that agree with the README and read as
plain text, and a summary table without rows the run did not measure."""
from __future__ import annotations

import re
from pathlib import Path

from dipaco.cli.help import usage
from dipaco.cli.plan import main as plan_main
from dipaco.job.summary import summary_table

REPO = Path(__file__).resolve().parents[1]


def test_plan_help_shows_no_docstring_markup(capsys):
    plan_main(["--help"])
    out = capsys.readouterr().out
    assert "dipaco-plan grid=4x4" in out
    assert "``" not in out and ":mod:" not in out and "::" not in out


def test_train_help_and_readme_give_the_same_minutes():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    (minutes,) = re.findall(r"write a summary \(about (\d+) minutes", readme)
    assert f"about {minutes} minutes" in " ".join(usage("dipaco-train").split())
    wall = float(re.search(r"wall time \(s\)\s+([\d.]+)", readme).group(1))  # the README's measured run
    assert round(wall / 60) == int(minutes)


def test_readme_gives_the_cpu_index_for_a_stock_pip():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "--index-url https://download.pytorch.org/whl/cpu" in readme


def test_the_summary_table_leaves_out_what_was_not_measured():
    s = {"routed_ppl": 37.0, "dense_ppl": float("nan"), "ratio_vs_dense": None, "rerouted_ppl": None,
         "num_paths": 4, "rounds": 16, "inner_steps": 50, "bytes_sent": 10, "ddp_bytes_equivalent": 20.0,
         "tokens_per_s": 1.0, "wall_s": 2.0}
    table = summary_table(s)
    assert "routed perplexity" in table and "dense" not in table.replace("DDP", "")
    assert "nan" not in table and "None" not in table
    assert "ratio vs dense" in summary_table({**s, "dense_ppl": 45.6, "ratio_vs_dense": 0.81})
