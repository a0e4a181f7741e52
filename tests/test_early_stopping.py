"""Path-specific early stopping: each path keeps its whole path's weights from the round
with the best loss on its own validation shard; the final evaluation and inference use them."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dipaco.plan.build import build_grid
from dipaco.run.checkpoint import CheckpointError
from dipaco.storage.tensor_io import save_state
from dipaco.config import compose_config
from dipaco.rounds.early_stopping import PathEarlyStopping, load_best_path, read_best_record, write_validation_shards
from dipaco.job.evaluation import path_models
from dipaco.run.run_dir import RunDir


@pytest.fixture()
def setup(tmp_path: Path):
    cfg = compose_config(["model=tiny", "trainer=tiny", "trainer.path_early_stopping=true", "trainer.rounds=3",
                          "router.prefix_tokens=8"], tmp_path)
    run = RunDir.at(tmp_path)
    grid = build_grid(cfg)
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, cfg.model.vocab_size, size=int(n)).astype(np.int64) for n in rng.integers(20, 50, 12)]
    write_validation_shards(run, np.arange(len(docs)) % grid.num_paths, docs, grid.num_paths)
    return cfg, run, grid


def _weights(grid, path_id: int) -> dict[str, dict[str, torch.Tensor]]:
    return {m: {k: v.clone() for k, v in grid.module(m).state_dict().items()} for m in grid.module_ids_of_path(path_id)}


def _set(grid, weights: dict) -> None:
    for m, sd in weights.items():
        grid.module(m).load_state_dict(sd)


def _noisy(grid) -> None:
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in grid.module_ids:
            for p in grid.module(m).parameters():
                p.add_(torch.randn(p.shape, generator=g).to(p.device) * 3.0)


def test_a_bad_round_does_not_replace_the_kept_weights(setup) -> None:
    cfg, run, grid = setup
    es = PathEarlyStopping(cfg, run, grid, list(range(grid.num_paths)))
    clean = {p: _weights(grid, p) for p in range(grid.num_paths)}
    _noisy(grid)  # round 1: a bad model, kept only because nothing better exists yet
    noisy = {p: _weights(grid, p) for p in range(grid.num_paths)}
    bad = es.update(1)
    for p in range(grid.num_paths):
        _set(grid, clean[p])
    good = es.update(2)  # round 2: better on every path's shard
    _noisy(grid)  # round 3: a bad round again
    es.update(3)
    for p in range(grid.num_paths):
        assert good[p] < bad[p]
        assert read_best_record(run, p)["round"] == 2
        fresh = build_grid(cfg)
        load_best_path(run, fresh, p)
        kept = _weights(fresh, p)
        for m in kept:  # the whole path: every module on it, from the better round
            for k in kept[m]:
                assert torch.equal(kept[m][k], clean[p][m][k]), (p, m, k)
                assert not torch.equal(kept[m][k], noisy[p][m][k])


def test_the_final_evaluation_and_resume_use_the_records(setup, tmp_path: Path) -> None:
    cfg, run, grid = setup
    es = PathEarlyStopping(cfg, run, grid, [0, 1])
    clean = _weights(grid, 0)
    es.update(1)
    _noisy(grid)
    ckpt = tmp_path / "ckpt"
    for m in grid.module_ids:  # the last checkpoint holds the noisy weights
        save_state(ckpt / "modules" / f"{m}.safetensors", grid.module(m).state_dict())
    model = path_models(cfg, run, ckpt, best=True)(0)
    for m, sd in clean.items():
        for k, v in sd.items():
            assert torch.equal(model.path_modules()[m].state_dict()[k], v)
    last = path_models(cfg, run, ckpt, best=True)(2)  # no record for path 2: the checkpoint's weights
    assert torch.equal(last.embed.weight, grid.module("embed").weight)
    # resuming from round 0: the record of round 1 is forgotten (that round is trained again)
    assert PathEarlyStopping(cfg, run, grid, [0], start_round=0).best == {}
    assert 0 in PathEarlyStopping(cfg, run, grid, [0], start_round=1).best


def test_a_corrupt_weights_file_is_refused(setup) -> None:
    cfg, run, grid = setup
    PathEarlyStopping(cfg, run, grid, [0]).update(1)
    weights = run.best_paths / "path_0.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"xxxxxxxx")
    with pytest.raises(CheckpointError, match="best_paths"):
        load_best_path(run, build_grid(cfg), 0)
