"""What made a run: provenance.jsonl per launch, shown by dipaco-report, carried into exports,
and the Hugging Face export's model card and training config (dipaco/run/provenance.py,
dipaco/inference/model_card.py)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dipaco.cli import infer as infer_cli
from dipaco.cli import report as report_cli
from dipaco.config import compose_config
from dipaco.job.train import _save_config
from dipaco.run.provenance import PROVENANCE, collect, git_commit, one_line, read, record
from dipaco.run.run_dir import RunDir

from _hostile import SMOKE, copy_run, run_cli

FIELDS = {"dipaco", "git", "python", "torch", "cuda", "faiss", "numpy", "tokenizers", "host", "devices", "time",
          "event"}


def test_a_record_names_versions_host_and_devices(tmp_path):
    rec = collect("start")
    assert FIELDS <= set(rec)
    assert rec["python"].count(".") == 2 and rec["torch"] and rec["numpy"] and rec["host"] and rec["devices"]
    assert "dipaco" in one_line(rec) and rec["host"] in one_line(rec)


def test_git_commit_is_none_outside_a_checkout_and_never_fails(tmp_path):
    assert git_commit(tmp_path) is None  # an installed wheel: no checkout above it
    here = git_commit()
    assert here is None or len(here["commit"]) == 40


def test_records_append_per_launch_and_a_bad_line_is_skipped(tmp_path):
    record(tmp_path, "start")
    with open(tmp_path / PROVENANCE, "a", encoding="utf-8") as f:
        f.write("{torn\n")
    record(tmp_path, "resume")
    assert [r["event"] for r in read(tmp_path)] == ["start", "resume"]
    assert read(tmp_path / "nowhere") == []


@pytest.mark.slow
def test_a_run_records_its_start_and_each_resume(finished, tmp_path):
    """The finished run holds one `start` record; an accepted resume appends a `resume` record."""
    recs = read(finished[0])
    assert [r["event"] for r in recs] == ["start"] and FIELDS <= set(recs[0])
    run_dir = copy_run(finished[0], tmp_path / "run")
    cfg = compose_config([*SMOKE, "resume=true"], str(run_dir))
    _save_config(cfg, RunDir.at(run_dir), {})
    assert [r["event"] for r in read(run_dir)] == ["start", "resume"]


@pytest.mark.slow
def test_report_shows_what_made_each_run(finished, tmp_path, capsys, monkeypatch):
    out = tmp_path / "report"
    out.mkdir()
    code, err = run_cli(report_cli.main, [out, finished[0]], capsys, monkeypatch)
    assert code == 0, err
    text = (out / "report.md").read_text(encoding="utf-8")
    assert "Provenance" in text and one_line(read(finished[0])[0]) in text


@pytest.mark.slow
@pytest.mark.parametrize("flags", [("--path", "1"), ("--path", "1", "--format", "hf"), ("--all", "--format", "hf")],
                         ids=["dipaco", "hf", "hf-all"])
def test_exports_carry_provenance_and_hf_exports_a_model_card(finished, tmp_path, capsys, monkeypatch, flags):
    out = tmp_path / "exp"
    code, err = run_cli(infer_cli.main, ["export", finished[0], *flags, "--out", out], capsys, monkeypatch)
    assert code == 0, err
    prov = json.loads((out / "provenance.json").read_text(encoding="utf-8"))
    assert [r["event"] for r in prov["run"]] == ["start"] and prov["export"]["event"] == "export"
    if "hf" not in flags:
        assert not (out / "README.md").exists()
        return
    card = (out / "README.md").read_text(encoding="utf-8")
    for section in ("## Modules and routing", "## Training", "## Perplexity", "## How to load it", "## Provenance"):
        assert section in card
    assert "load_routed" in card and "router.method=" in card and not re.search(r"\b(nan|None)\b", card)
    summary = json.loads((finished[0] / "summary.json").read_text(encoding="utf-8"))
    assert f"{summary['routed_ppl']:.4g}" in card
    assert (out / "training_config.yaml").read_text() == (finished[0] / "config.yaml").read_text()
    assert not (out / "config.yaml").exists()  # an export is never mistaken for a run directory
