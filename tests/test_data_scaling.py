"""Data scaled with paths (``data.documents_per_path``, ``sweep=paths``) as a specification.

A paths sweep compares perplexities of grids that train on different amounts of data. The
comparison is only fair when every run is scored on the same documents with the same
tokenizer (a perplexity is per token), so only the training split grows with the paths.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

from dipaco.config import compose_config
from dipaco.config.validate import validate_config
from dipaco.job.prepare import prepare
from dipaco.run.run_dir import RunDir

CONF = Path(__file__).resolve().parents[1] / "conf"

SMOKE = ["experiment=smoke", "data.max_documents=300", "trainer.dense_baseline=false"]


def _prepared(tmp_path, grid: str):
    cfg = compose_config(SMOKE + [f"grid={grid}", "data.documents_per_path=50"], tmp_path / grid)
    validate_config(cfg)
    run = RunDir.at(tmp_path / grid)
    return prepare(cfg, run), run


def test_more_paths_train_on_more_documents_but_share_tokenizer_and_evaluation(tmp_path) -> None:
    small, run_small = _prepared(tmp_path, "2x1")
    large, run_large = _prepared(tmp_path, "2x2")
    assert len(small.train_ids) == 100 and len(large.train_ids) == 200
    # one tokenizer (trained on the whole training split), one evaluation set
    assert run_small.tokenizer.read_bytes() == run_large.tokenizer.read_bytes()
    assert len(small.eval_ids) == len(large.eval_ids) > 0
    for a, b in zip(small.eval_ids, large.eval_ids):
        np.testing.assert_array_equal(a, b)


def test_the_paths_sweep_scales_data_and_reports_on_the_test_split() -> None:
    """`sweep=paths` is the issue's data-scaled sweep: one path per document, a fixed number
    of documents per path, dense → 2x2 → 4x4 on two seeds, scored on the test split."""
    cfg = compose_config(["sweep=paths"])
    assert cfg.data.documents_per_path is not None and cfg.router.top_k == 1
    assert cfg.trainer.eval_split == "test"
    params = OmegaConf.load(CONF / "sweep" / "paths.yaml").hydra.sweeper.params
    assert params.grid == "dense,2x2,4x4" and params.seed == "0,1"
