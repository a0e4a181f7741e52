"""A resume takes its token splits from the run's record, not from the raw corpus
(dipaco/job/token_record.py): no corpus read, no tokenizing, no routing when every
recorded piece is on disk as recorded; a piece that is missing or does not match is
recomputed from the corpus, with one line saying so, never silently passed."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from _hostile import copy_run, tiny_jsonl
from dipaco.config import compose_config
from dipaco.job import prepare as prepare_mod
from dipaco.job import prepare_tokens as tokens_mod
from dipaco.job.prepare_tokens import prepare_tokens
from dipaco.job.token_record import RECORD
from dipaco.job.train import train
from dipaco.run.fingerprint import Fingerprints
from dipaco.run.run_dir import RunDir


def _no_corpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every way preparation reads a corpus or routes documents raises."""
    def refuse(*_a, **_k):
        raise AssertionError("the raw corpus was read (or documents routed) on a resume")

    for name in ("load_corpus", "load_token_corpus", "tokenize_to_docs"):
        monkeypatch.setattr(tokens_mod, name, refuse)
    monkeypatch.setattr(prepare_mod, "assign_in_batches", refuse)


def _splits(run_dir: Path, lines: list[str]):
    run = RunDir.at(run_dir)
    cfg = run.load_config()
    cfg.resume = True
    return prepare_tokens(cfg, run, Fingerprints(run, cfg, lines.append), lines.append)


def _same(a, b) -> None:
    assert a.data_fp == b.data_fp and a.tokenizer.sha256 == b.tokenizer.sha256
    for name in ("train_ids", "val_ids", "eval_ids"):
        x, y = getattr(a, name), getattr(b, name)
        assert len(x) == len(y) and x.num_tokens == y.num_tokens, name
        assert all(np.array_equal(x[i], y[i]) for i in range(len(x))), name
    assert a.val_labels == b.val_labels
    assert (a.train_labels is None) == (b.train_labels is None)
    if a.train_labels is not None:
        assert np.array_equal(a.train_labels, b.train_labels)


def test_the_recorded_splits_equal_the_corpus_read_and_need_no_corpus(finished, tmp_path, monkeypatch):
    """The splits a resume takes from the record are those a corpus read gives, bit for bit."""
    full_dir = copy_run(finished[0], tmp_path / "full")
    fps = json.loads((full_dir / "fingerprints.json").read_text())
    assert fps[RECORD]["data"] == fps["tokenizer"]["data"]
    del fps[RECORD]  # a run recorded before the record: the corpus is read
    (full_dir / "fingerprints.json").write_text(json.dumps(fps))
    from_corpus = _splits(full_dir, [])
    lines: list[str] = []
    _no_corpus(monkeypatch)
    from_record = _splits(copy_run(finished[0], tmp_path / "fast"), lines)
    _same(from_record, from_corpus)
    assert any("the corpus is not read again" in x for x in lines), lines


@pytest.mark.parametrize("damage", ["entry_deleted", "offsets_replaced", "record_of_other_data", "cache_moved"])
def test_a_recorded_piece_that_is_missing_or_differs_is_recomputed_with_a_line(finished, tmp_path, damage):
    """Missing or mismatched: one line says which, and the corpus is read again (same splits)."""
    reference = _splits(copy_run(finished[0], tmp_path / "ref"), [])
    run_dir = copy_run(finished[0], tmp_path / "run")
    fps_file = run_dir / "fingerprints.json"
    fps = json.loads(fps_file.read_text())
    entry = run_dir / "cache" / fps[RECORD]["splits"]["train"]["entry"]
    if damage == "entry_deleted":
        shutil.rmtree(entry)
    elif damage == "offsets_replaced":  # a well-formed entry, but not the recorded one
        offsets = np.load(entry / "offsets.npy")
        tokens = np.fromfile(entry / "tokens.bin", dtype="<i4")
        np.save(entry / "offsets.npy", np.array([0, offsets[-1]], dtype=np.int64))
        assert tokens.size == offsets[-1]
    elif damage == "record_of_other_data":
        fps[RECORD]["data"] = "0" * 64
        fps_file.write_text(json.dumps(fps))
    else:
        cache = tmp_path / "elsewhere"
        config = (run_dir / "config.yaml").read_text()
        (run_dir / "config.yaml").write_text(config.replace("cache_dir: null", f"cache_dir: {cache}"))
    lines: list[str] = []
    _same(_splits(run_dir, lines), reference)
    why = {"entry_deleted": "is missing", "offsets_replaced": "is not the one recorded",
           "record_of_other_data": "not those of the run's tokenizer record", "cache_moved": "is missing"}[damage]
    said = [x for x in lines if "reading the corpus again" in x]
    assert len(said) == 1 and why in said[0], lines


@pytest.mark.slow
def test_a_resume_needs_neither_the_corpus_nor_routing_and_lands_where_the_uninterrupted_run_does(
        finished, sigterm_stopped, tmp_path, monkeypatch, caplog):
    """SIGTERM after round 1, then `resume=true` with every corpus reader and the router's
    assignment raising: the run finishes with the uninterrupted run's numbers."""
    run_dir = copy_run(sigterm_stopped[0], tmp_path / "run")
    _no_corpus(monkeypatch)
    with caplog.at_level(logging.INFO, logger="dipaco"):
        summary = train(compose_config(["resume=true"], run_dir), overrides=["resume=true"])
    for key in ("routed_ppl", "dense_ppl", "bytes_sent", "train_tokens", "rounds"):
        assert summary[key] == finished[1][key], key
    assert "the corpus is not read again" in caplog.text


@pytest.mark.slow
@pytest.mark.timeout(900)  # three smoke-sized runs
def test_a_resume_after_the_data_folder_is_gone_gives_the_uninterrupted_digits(tmp_path):
    """`data.path`'s folder renamed after round 1: `resume=true` still finishes, with the
    routed perplexity of a run that was never interrupted."""
    (tmp_path / "data").mkdir()
    data = tiny_jsonl(tmp_path / "data" / "docs.jsonl", 200)
    data[1] = f"data.path={tmp_path / 'data'}"
    given = ["experiment=smoke", "trainer.dense_baseline=false", *data]
    whole = train(compose_config(given, tmp_path / "whole"))
    stopped = train(compose_config(given + ["trainer.stop_after_rounds=1"], tmp_path / "run"))
    assert stopped["stopped_at_round"] == 1
    (tmp_path / "data").rename(tmp_path / "gone")
    resumed = train(compose_config(["resume=true"], tmp_path / "run"), overrides=["resume=true"])
    assert resumed["routed_ppl"] == whole["routed_ppl"]
