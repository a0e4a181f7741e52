"""Path-specific early stopping (the DiPaCo paper, Table 3): ``trainer.path_early_stopping``.

Each path keeps the weights of its whole path (every module on it) from the round where
its loss on **its own validation shard** — the validation documents routed to it — was
lowest. The check runs every ``trainer.eval_every`` rounds (and after the last), on the
global weights right after the outer step, with the job's scoring rule
(:mod:`dipaco.rounds.evaluate`; the long protocol when ``trainer.eval_long``).

On disk (``RunDir.best_paths``, i.e. ``<run_dir>/checkpoints/best_paths/``)::

    path_<p>.safetensors   {module_id: state_dict} of path p's modules (dipaco.run.checkpoint.save_state)
    path_<p>.json          {"round", "loss", "ppl", "num_tokens", "sha256"} (written after the weights)

The validation shards are written by the preparation phase into ``<run_dir>/val_shards/``
(same format as the training shards; one path per document, the router's best). The
job's final evaluation and ``dipaco-infer`` load a path from its best file when one
exists; a path whose validation shard is empty keeps its last weights.

Known bias: the same validation documents choose the weights and are reported by the
final evaluation; report on a split the selection never saw when that matters.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import numpy as np
from torch import nn

from dipaco.run.checkpoint import CheckpointError, load_state, save_state, sha256_file, write_json
from dipaco.config import Config, eval_window
from dipaco.rounds.evaluate import evaluate_single
from dipaco.run.run_dir import RunDir
from modules import ModuleGrid, PathModel
from router import load_shard, write_shards


def write_validation_shards(run: RunDir, best_paths: np.ndarray, val_ids: Any, num_paths: int) -> None:
    """Each validation document into the shard of its routed path (``best_paths[i]``).

    A path with no validation document keeps its last weights (its best round is None)."""
    write_shards(val_ids, [[int(p)] for p in best_paths], num_paths, run.val_shards, warn_empty=False)


def best_path_files(run: RunDir, path_id: int) -> tuple[Path, Path]:
    """``(weights, record)`` files of path ``path_id``'s kept weights."""
    return run.best_paths / f"path_{path_id}.safetensors", run.best_paths / f"path_{path_id}.json"


def read_best_record(run: RunDir, path_id: int) -> Optional[dict]:
    """The record of path ``path_id``'s kept weights, or None when there are none."""
    weights, record = best_path_files(run, path_id)
    if not (record.is_file() and weights.is_file()):
        return None
    return run.read_json(record)


def load_best_path(run: RunDir, grid: ModuleGrid, path_id: int) -> Optional[dict]:
    """Load path ``path_id``'s kept weights into ``grid``; return their record (None: none kept).

    The weights file is checked against the sha256 in its record.
    """
    rec = read_best_record(run, path_id)
    if rec is None:
        return None
    weights, _ = best_path_files(run, path_id)
    if sha256_file(weights) != rec.get("sha256"):
        raise CheckpointError(f"{weights} does not match the sha256 in its record; delete {run.best_paths} "
                              "to use the last checkpoint's weights")
    for mid, sd in load_state(weights).items():
        grid.load_module_state_dict(mid, sd)
    return rec


class PathEarlyStopping:
    """Tracks and keeps the best weights of the grid paths this process evaluates.

    Args:
        cfg: the run's config.
        run: the run directory (validation shards in, best weights out).
        grid: the live grid (its modules hold the global weights after each outer step).
        paths: grid path ids this process checks (each path is checked by one process).
        start_round: the round training resumes from; records of later rounds (written
            after that checkpoint) are forgotten, since those rounds are trained again.
    """

    def __init__(self, cfg: Config, run: RunDir, grid: ModuleGrid, paths: list[int], start_round: int = 0) -> None:
        self.cfg, self.run, self.grid = cfg, run, grid
        self.docs = {p: load_shard(run.val_shards, p) for p in paths}
        self.best: dict[int, float] = {}
        for p in paths:
            rec = read_best_record(run, p)
            if rec is not None and int(rec["round"]) <= start_round:
                self.best[p] = float(rec["loss"])

    def due(self, round_idx: int) -> bool:
        """Whether the check runs after round ``round_idx`` (1-based)."""
        t = self.cfg.trainer
        return round_idx % t.eval_every == 0 or round_idx == t.rounds

    def update(self, round_idx: int) -> dict[int, float]:
        """Score every path on its validation shard; keep the weights that improved.

        Returns ``{path: validation loss}`` (paths with an empty shard are left out).
        """
        t, losses = self.cfg.trainer, {}
        for p, docs in self.docs.items():
            if len(docs) == 0:
                continue
            model = PathModel(self.grid, p)
            ev = evaluate_single(docs, model, seq_len=eval_window(self.cfg) if t.eval_long else t.seq_len,
                                 prefix_tokens=self.cfg.router.prefix_tokens, batch_size=t.eval_batch_size,
                                 whole_documents=t.eval_long)
            if not ev["num_tokens"]:
                continue
            losses[p] = float(ev["loss"])
            if losses[p] < self.best.get(p, float("inf")):
                self.best[p] = losses[p]
                self._save(p, model, round_idx, ev)
        return losses

    def _save(self, path_id: int, model: nn.Module, round_idx: int, ev: dict) -> None:
        weights, record = best_path_files(self.run, path_id)
        save_state(weights, {mid: m.state_dict() for mid, m in model.path_modules().items()})
        write_json(record, {"round": round_idx, "loss": ev["loss"], "ppl": ev["ppl"],
                            "num_tokens": ev["num_tokens"], "sha256": sha256_file(weights)})
