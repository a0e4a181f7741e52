"""The dense model: the warm-up every path starts from, and the same-size baseline.

Both are one path of a ``[1] * levels`` grid, i.e. exactly the size of one DiPaCo path,
trained on all training documents with the paths' inner loop (same batch, schedule and
optimiser). The warm-up runs for ``warmup_fraction`` of a path's steps before routing;
the baseline continues from the warm-up (or from the same seed) for the same number of
inner steps a path takes, so the two are compared at equal steps per model.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from dipaco.plan.build import run_device
from dipaco.run.checkpoint import load_state, save_state, write_json
from dipaco.config import Config
from dipaco.data import TokenStream
from dipaco.rounds.learner import InnerStats, PathLearner
from dipaco.runtime.progress import progress_bar
from dipaco.config.schedule import total_inner_steps
from modules import ModuleGrid, PathModel

# Streams of different models must not see the same batches: the dense streams use
# path ids past every real path.
WARMUP_STREAM_ID = 1_000_001
BASELINE_STREAM_ID = 1_000_002


def dense_grid(cfg: Config) -> ModuleGrid:
    """A freshly seeded dense grid of the size of one path, on the run's device."""
    return ModuleGrid(cfg.model, [1] * len(cfg.grid.levels), seed=cfg.seed, device=run_device(cfg))


def train_dense(
    cfg: Config,
    docs: Sequence[np.ndarray],
    eos_id: int,
    *,
    steps: int,
    stream_id: int,
    step_offset: int = 0,
    init: Optional[dict[str, dict[str, torch.Tensor]]] = None,
    progress_desc: str = "dense",
    log_every: int = 0,
) -> tuple[ModuleGrid, InnerStats]:
    """Train a dense path for ``steps`` inner steps; return the grid and stats (with
    ``log_every``, its per-step intervals: the warm-up's and baseline's curves)."""
    grid = dense_grid(cfg)
    if init:
        for mid, sd in init.items():
            grid.load_module_state_dict(mid, sd)
    model = PathModel(grid, 0)
    stream = TokenStream(docs, seq_len=cfg.trainer.seq_len, batch_size=cfg.trainer.batch_size,
                         seed=cfg.seed, path_id=stream_id, eos_id=eos_id)
    learner = PathLearner(0, model, stream, cfg.trainer, total_inner_steps(cfg), step_offset=step_offset,
                          log_every=log_every)
    bar = progress_bar(cfg.trainer.progress, steps, progress_desc, "step")

    # the bar counts steps only: the loss stays on the device until the turn ends
    stats = learner.train_steps(steps, on_step=(lambda: bar.update(1)) if bar is not None else None)
    if bar is not None:
        bar.close()
    return grid, stats


def save_dense(directory: Path, grid: ModuleGrid, info: dict) -> None:
    """Save a dense grid's module weights (safetensors) and an info JSON."""
    directory.mkdir(parents=True, exist_ok=True)
    save_state(directory / "modules.safetensors",
               {mid: grid.module_state_dict(mid) for mid in grid.module_ids})
    write_json(directory / "info.json", info)


def load_dense_state(directory: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Module state dicts saved by :func:`save_dense`."""
    return load_state(directory / "modules.safetensors")


def load_dense_grid(cfg: Config, directory: Path) -> ModuleGrid:
    """The dense grid saved by :func:`save_dense` in ``directory`` (warm-up or baseline)."""
    grid = dense_grid(cfg)
    for mid, sd in load_dense_state(directory).items():
        grid.load_module_state_dict(mid, sd)
    return grid
