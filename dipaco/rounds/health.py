"""The rounds' health metrics: per-step records from the path learners' intervals, and
a validation loss per round on a fixed small sample (docs/metrics.md).

Every rank builds the records of the paths it trains (:func:`step_records`), with what
only it knows (its device's peak FLOP/s and memory); rank 0 merges every rank's records
of one path and step (:func:`merge_step_records`: the ranks of a worker group each
trained a slice of the batch) and the writer persists them
(:meth:`dipaco.runtime.tracking.MetricsWriter.log_steps`). Nothing here touches the
training: intervals are read from the learners after their turns, and the validation
sample is scored in eval mode without gradients, with no random numbers and no batch
taken from any training stream.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Optional

import torch

from dipaco.config import Config
from dipaco.rounds.evaluate import evaluate_single
from dipaco.rounds.learner import PathLearner
from dipaco.run.run_dir import RunDir
from dipaco.runtime.hardware import flops_per_token, peak_flops
from modules import ModuleGrid, PathModel
from router import load_shard

__all__ = ["SampleValidation", "interval_records", "merge_step_records", "step_records"]


def interval_records(cfg: Config, grid: ModuleGrid, device: torch.device, round_idx: int, path: int,
                     intervals: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Path ``path``'s logging intervals (:class:`dipaco.rounds.turn_log.TurnLog`) as step
    records of round ``round_idx`` (1-based): ``kind: "step"``, throughput, TFLOP/s and
    MFU (None where the device's peak is unknown) added."""
    if not intervals:
        return []
    peak = peak_flops(device, cfg.trainer.precision, cfg.logging.peak_tflops)
    fpt = flops_per_token(grid.path_param_count(path // cfg.grid.replicas),
                          len(cfg.grid.levels) * cfg.model.layers_per_level, cfg.model.d_model, cfg.trainer.seq_len)
    out = []
    for iv in intervals:
        tps = iv["tokens"] / iv["seconds"] if iv["seconds"] > 0 else None
        out.append({"kind": "step", "step": iv["step"], "round": round_idx, "path": int(path), **iv,
                    "tokens_per_s": tps, "tflops": fpt * tps / 1e12 if tps else None,
                    "mfu_pct": 100.0 * fpt * tps / peak if tps and peak else None})
    return out


def step_records(cfg: Config, grid: ModuleGrid, device: torch.device, round_idx: int,
                 learners: dict[int, PathLearner]) -> list[dict[str, Any]]:
    """This rank's per-step records of round ``round_idx``: every path's intervals since
    the last call (:func:`interval_records`)."""
    return [rec for p, learner in learners.items()
            for rec in interval_records(cfg, grid, device, round_idx, p, learner.take_intervals())]


def _weighted(recs: list[dict], key: str) -> Optional[float]:
    pairs = [(r[key], r["tokens"]) for r in recs if r.get(key) is not None]
    weight = sum(w for _, w in pairs)
    if not pairs:
        return None
    return sum(v * w for v, w in pairs) / weight if weight else sum(v for v, _ in pairs) / len(pairs)


def _mean(recs: list[dict], key: str) -> Optional[float]:
    vals = [r[key] for r in recs if r.get(key) is not None]
    return sum(vals) / len(vals) if vals else None


def _max(recs: list[dict], key: str) -> Optional[float]:
    return max((r[key] for r in recs if r.get(key) is not None), default=None)


def merge_step_records(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One record per (path, step) from every rank's records, in step then path order.

    The ranks of a worker group trained one batch in slices: the loss is their
    token-weighted mean, tokens add up, time is the slowest rank's, throughput, TFLOP/s
    and MFU are per device (the mean of the ranks'), memory the largest. The gradient
    norm, learning rate and skips are the group's and agree on every rank.
    """
    groups: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for recs in per_rank:
        for rec in recs:
            groups[(int(rec["step"]), int(rec["path"]))].append(rec)
    out = []
    for (_step, _path), recs in sorted(groups.items()):
        if len(recs) == 1:
            out.append(recs[0])
            continue
        memory: dict[str, int] = {}
        for r in recs:
            for k, v in r["memory"].items():
                memory[k] = max(memory.get(k, v), v)
        out.append({**recs[0], "loss": _weighted(recs, "loss"), "loss_max": _max(recs, "loss_max"),
                    "grad_norm": _mean(recs, "grad_norm"), "grad_norm_max": _max(recs, "grad_norm_max"),
                    "skipped_steps": max(r["skipped_steps"] for r in recs),
                    "tokens": sum(r["tokens"] for r in recs), "seconds": max(r["seconds"] for r in recs),
                    "data_s": _max(recs, "data_s"), "tokens_per_s": _mean(recs, "tokens_per_s"), "tflops": _mean(recs, "tflops"),
                    "mfu_pct": _mean(recs, "mfu_pct"), "memory": memory})
    return out


class SampleValidation:
    """Each grid path's loss on a fixed sample: the first ``logging.val_documents``
    documents of its validation shard (``val_shards/``, the validation documents the
    router sends it), scored like the final evaluation (first ``trainer.seq_len + 1``
    tokens, the routing prefix carries no loss).

    Args:
        cfg: the run's config.
        run: the run directory (a run without ``val_shards/``, e.g. one built by hand,
            has no sample).
        grid: the live grid (after the outer step its modules hold the global weights).
        paths: the grid paths this process scores.
    """

    def __init__(self, cfg: Config, run: RunDir, grid: ModuleGrid, paths: list[int]) -> None:
        self.cfg, self.grid = cfg, grid
        n = cfg.logging.val_documents
        self.docs = {}
        if n and (run.val_shards / "shards.json").is_file():
            for q in paths:
                docs = load_shard(run.val_shards, q)
                if len(docs):
                    self.docs[q] = docs[: min(n, len(docs))].in_memory()  # read once, not per round

    def losses(self) -> dict[int, tuple[float, int]]:
        """``{grid path: (mean loss, scored tokens)}`` of the sample under the live weights."""
        t, out = self.cfg.trainer, {}
        for q, docs in self.docs.items():
            ev = evaluate_single(docs, PathModel(self.grid, q), seq_len=t.seq_len,
                                 prefix_tokens=self.cfg.router.prefix_tokens, batch_size=t.eval_batch_size)
            if ev["num_tokens"]:
                out[q] = (float(ev["loss"]), int(ev["num_tokens"]))
        return out
