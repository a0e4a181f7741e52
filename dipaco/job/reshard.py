"""EM re-sharding between synchronous rounds: when the phases happen, and one phase.

Phases come after round ``k = router.reshard_at_round``, then ``k + R``, ``k + 2R``, ...
(``R = router.reshard_every``) while below ``trainer.rounds``. The ranks stop after the
phase's round (checkpoint written); this process scores ``router.reshard_documents``
training documents under every path of that checkpoint (the E step), re-assigns them
(the M step, ``router.reshard_assign``; :mod:`router.em`), fits the classifier that routes
the other documents and the prompts, rewrites the shards; then the ranks resume from that
round on the new shards. Both backends and every launcher share this, since ranks read
their shards when they start.

Each phase is appended to ``routing_report.json["reshards"]`` (``["reshard"]`` is the
latest). A resumed run skips the recorded phases; one whose round was reached but not
recorded (stopped in between) re-shards from that round's checkpoint before training on.
"""
from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

from dipaco.storage.atomic import write_json
from dipaco.run.checkpoint import CheckpointManager
from dipaco.config import Config
from dipaco.data import progress_bars
from dipaco.rounds.evaluate import per_document_losses
from dipaco.run.fingerprint import Fingerprints
from dipaco.job.evaluation import load_grid_from_checkpoint
from dipaco.runtime.launch import StopSignals, launch
from dipaco.job.prepare import Prepared, shards_fingerprint
from dipaco.run.results import RoundsResult
from dipaco.rounds import run_rank
from dipaco.runtime.progress import log
from dipaco.run.run_dir import RunDir
from modules import PathModel
from router import (
    compare_assignments,
    expand_replicas,
    mean_assigned_loss,
    read_assignments,
    reshard_assignments,
    routing_report,
    write_shards,
)


def _log(msg: str) -> None:
    log.info(msg)  # the "dipaco" logger: the console and the run's train.log


def reshard_rounds(cfg: Config) -> list[int]:
    """The rounds after which a re-shard phase runs (empty when re-sharding is off)."""
    k, every, rounds = cfg.router.reshard_at_round, cfg.router.reshard_every, cfg.trainer.rounds
    if k is None or k >= rounds:
        return []
    return list(range(k, rounds, every)) if every else [k]


def phases_done(report: dict[str, Any], cfg: Config) -> set[int]:
    """Rounds whose phase ``routing_report.json`` records (a run from before the phase list
    recorded its single re-shard under ``reshard`` only)."""
    done = {int(p["round"]) for p in report.get("reshards", []) if "round" in p}
    if "reshard" in report and "reshards" not in report and cfg.router.reshard_at_round is not None:
        done.add(int(cfg.router.reshard_at_round))
    return done


def run_rounds_with_reshards(cfg: Config, run: RunDir, prep: Prepared) -> RoundsResult:
    """Launch the ranks for the rounds, stopping for each re-shard phase not yet done."""
    report = run.read_json(run.routing_report) if run.routing_report.is_file() else {}
    todo = [r for r in reshard_rounds(cfg) if r not in phases_done(report, cfg)]
    user_stop = cfg.trainer.stop_after_rounds
    ckpts = CheckpointManager(run.checkpoints)
    result: Optional[RoundsResult] = None
    resume = cfg.resume
    for r in todo:
        reached = _latest_round(ckpts) if resume else 0
        if reached > r:  # cannot happen unless the run was trained past it without re-sharding
            _log(f"re-shard after round {r} skipped: the run already holds round {reached}")
            continue
        if reached < r:
            part = copy.deepcopy(cfg)
            part.resume = resume
            part.trainer.stop_after_rounds = r if user_stop is None else min(r, user_stop)
            got = launch(run_rank, part, run)
            result = got if result is None else got.after(result)
            resume = True
            if got.completed_rounds < r:  # stopped early (trainer.stop_after_rounds, a signal)
                return result
        if StopSignals.received:  # a stop that came in the round before the re-shard: stop here
            return result if result is not None else _stopped_at(cfg, reached, ckpts.final_dir(reached))
        reshard(cfg, run, prep, ckpts.final_dir(r), r)
        resume = True
        if user_stop is not None and user_stop <= r:
            return result if result is not None else _stopped_at(cfg, r, ckpts.final_dir(r))
    if StopSignals.received and result is not None:  # it came during the last re-shard
        return result
    last = copy.deepcopy(cfg)
    last.resume = resume
    got = launch(run_rank, last, run)
    # one result for the whole run: traffic, tokens and time of every launch
    return got if result is None else got.after(result)


def _latest_round(ckpts: CheckpointManager) -> int:
    latest = ckpts.latest_valid()
    return int(CheckpointManager.verify(latest)["round"]) if latest is not None else 0


def _stopped_at(cfg: Config, r: int, ckpt: Path) -> RoundsResult:
    """A resume that only ran a pending re-shard before ``trainer.stop_after_rounds``."""
    return RoundsResult(rounds=cfg.trainer.rounds, completed_rounds=r, start_round=r, world_size=1,
                        checkpoint=str(ckpt))


def reshard(cfg: Config, run: RunDir, prep: Prepared, ckpt: Path, round_idx: int) -> dict[str, Any]:
    """One EM phase from checkpoint ``ckpt``: score, re-assign, fit, rewrite the shards, report."""
    t0 = time.perf_counter()
    r = cfg.router
    grid = load_grid_from_checkpoint(cfg, ckpt)
    # the same sample every phase: the scored documents' assignment follows their losses
    rng = np.random.default_rng(cfg.seed)
    n = min(len(prep.train_ids), r.reshard_documents)
    pick = np.sort(rng.choice(len(prep.train_ids), size=n, replace=False))
    sample = [prep.train_ids[int(i)] for i in pick]
    losses = np.stack([  # the E step: [n, P]
        per_document_losses(sample, PathModel(grid, p), seq_len=cfg.trainer.seq_len,
                            prefix_tokens=r.prefix_tokens, batch_size=cfg.trainer.eval_batch_size)
        for p in range(grid.num_paths)], axis=1)
    keep = np.isfinite(losses).all(axis=1)  # a document with no token after its prefix has no loss
    scored, losses = pick[keep], losses[keep]
    previous = read_assignments(run.shards, cfg.grid.replicas)
    if len(previous) != len(prep.train_ids):  # a document with no path was left out: rows != documents
        previous = None
    best = losses.argmin(axis=1)
    info: dict[str, Any] = {
        "round": int(round_idx), "assign": r.reshard_assign, "documents": int(keep.sum()),
        # how often the lowest-loss path is the one k-means would pick (argmin, no balance)
        "agreement_with_kmeans": float(np.mean(prep.router.method_costs(
            [prep.train_ids[int(i)] for i in scored]).argmin(axis=1) == best)) if scored.size else None,
    }
    assignments, fit = reshard_assignments(prep.router, prep.train_ids, scored, losses, mode=r.reshard_assign)
    info.update(fit)
    if assignments is not None:
        prep.router.save(run.router)
        with progress_bars(cfg.trainer.progress):
            write_shards(prep.train_dataset, expand_replicas(assignments, cfg.grid.replicas, cfg.seed),
                         grid.num_paths * cfg.grid.replicas, run.shards)
        fps = Fingerprints(run, cfg, _log)
        fps.record("shards", shards_fingerprint(fps, run))
        info.update(_moved(assignments, previous, scored, losses))
        # training shards (overlap counted) and, with labels, NMI of each document's first path
        info.update(routing_report(assignments, num_paths=grid.num_paths, labels=prep.train_labels,
                                   grid=prep.router.grid))
        if len(prep.val_ids):
            val_best = prep.router.route_batch(prep.val_ids.prefixes(r.prefix_tokens))
            labels = prep.val_labels if prep.train_labels is not None else None
            info["validation"] = routing_report(val_best, num_paths=grid.num_paths, labels=labels)
    info["seconds"] = time.perf_counter() - t0
    report = run.read_json(run.routing_report)
    report["reshards"] = report.get("reshards", []) + [info]
    report["reshard"] = info
    write_json(run.routing_report, report)
    prep.report["reshards"] = report["reshards"]  # summary.json lists them
    nmi = f", NMI vs labels {info['nmi']:.3f}" if info.get("nmi") is not None else ""
    moved = f", {info['reassigned']:.1%} of documents moved" if info.get("reassigned") is not None else ""
    _log(f"re-shard after round {round_idx} ({r.reshard_assign}): classifier fitted={info['fitted']}, "
         f"shard sizes {info.get('shard_sizes')}{moved}{nmi} ({info['seconds']:.0f} s)")
    return info


def _moved(assignments: list[list[int]], previous: Optional[list[list[int]]], scored: np.ndarray,
           losses: np.ndarray) -> dict[str, Any]:
    """How far the phase moved the shards, and the scored documents' mean loss on their
    paths before and after (the M step lowers it unless balance forbids)."""
    if previous is None:
        return {"reassigned": None, "agreement_with_previous": None}
    moved = compare_assignments(assignments, previous)
    return {"reassigned": moved["reassigned"], "agreement_with_previous": moved["agreement"],
            "scored_loss_previous": mean_assigned_loss([previous[int(i)] for i in scored], losses)
            if scored.size else None,
            "scored_loss_new": mean_assigned_loss([assignments[int(i)] for i in scored], losses)
            if scored.size else None}
