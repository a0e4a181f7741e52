"""What the rounds leave behind: per-round records, checkpoints and the run's totals.

:class:`RoundRecorder` is the bookkeeping of :func:`dipaco.rounds.loop.run_rank`: the
progress bar, per-path early stopping, the per-step health records of every path
(``logging.every_steps``) and one round record per round with the sample's validation
loss (``logging.val_documents``; rank 0 writes all ranks' records merged through the
job's writer, :mod:`dipaco.runtime.tracking`; docs/metrics.md), a checkpoint at round
boundaries (:mod:`dipaco.rounds.checkpointing`) and, at the end, the
:class:`~dipaco.run.results.RoundsResult` of every rank's totals.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch.distributed as dist

from dipaco.plan.build import build_comm_plan
from dipaco.run.checkpoint import atomic_write_text
from dipaco.runtime import elastic
from dipaco.runtime.device import peak_memory_bytes
from dipaco.rounds.early_stopping import PathEarlyStopping
from dipaco.rounds.health import SampleValidation, merge_step_records, step_records
from dipaco.runtime.progress import progress_bar, say
from dipaco.run.results import RoundsResult
from dipaco.rounds.rank import RankState
from dipaco.run.run_dir import RunDir
from dipaco.rounds.checkpointing import save_checkpoint
from dipaco.sync.module_sync import RoundStats
from dipaco.rounds.round_line import round_record
from dipaco.runtime.tracking import MetricsWriter

__all__ = ["RoundOutcome", "RoundRecorder"]


@dataclass
class RoundOutcome:
    """One round on one rank: per-path statistics, the sync's, and the time split."""

    paths: dict[int, dict[str, Any]]
    sync: RoundStats
    compute_s: float  # this rank's inner steps
    wait_s: float  # waiting at the barrier for the slowest worker group
    sync_s: float  # the round's sync points: exchanges and outer steps


@dataclass
class _Totals:
    tokens: int = 0
    bytes_sent: int = 0
    train_s: float = 0.0
    wait_s: float = 0.0
    sync_s: float = 0.0
    rounds_done: list[int] = field(default_factory=list)


def gather(obj: Any, distributed: bool) -> list[Any]:
    """All ranks' ``obj`` (a JSON-able dict) on every rank; ``[obj]`` in the local backend."""
    if not distributed:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def gather_to_rank0(obj: Any, distributed: bool) -> Optional[list[Any]]:
    """All ranks' ``obj`` on rank 0 (``None`` on the others); ``[obj]`` in the local backend.

    The round's record is read by rank 0 alone (it writes the metrics): a gather sends
    each record once, where an all-gather sent every record to every rank (measured on 4
    gloo ranks: 15 kB instead of 39 kB of control traffic a round, a fifth of int4's
    payload; docs/results.md, bytes on the wire)."""
    if not distributed:
        return [obj]
    out: Optional[list[Any]] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


class RoundRecorder:
    """Records, checkpoints and totals of the rounds from ``start_round`` on."""

    def __init__(self, rs: RankState, start_round: int) -> None:
        self.rs, self.start_round = rs, start_round
        cfg = rs.cfg
        self.writer = self.bar = self.stopping = None
        self.owns_writer = False
        if rs.is_rank0:
            # the job's writer (one W&B run per job); a spawned rank 0 has none and writes
            # metrics.jsonl and TensorBoard itself, the job mirrors them to W&B afterwards
            self.writer = MetricsWriter.shared(rs.run)
            if self.writer is None:
                self.writer, self.owns_writer = MetricsWriter(rs.run, cfg, wandb=False), True
            if cfg.resume:  # the rounds past the checkpoint are re-run: their records go
                self.writer.rewind(start_round)
            steps = (cfg.trainer.rounds - start_round) * cfg.diloco.inner_steps * len(rs.paths)
            self.bar = progress_bar(cfg.trainer.progress, steps, "rounds", "step")
        R = cfg.grid.replicas
        if cfg.trainer.path_early_stopping and rs.local_rank == 0:
            # one process per grid path checks it: the holder of its first replica
            self.stopping = PathEarlyStopping(cfg, rs.run, rs.grid, [p // R for p in rs.paths if p % R == 0],
                                              start_round)
        # every rank of a worker group scores its grid paths (in lockstep: a sharded
        # module's forward is a collective); the group's first rank reports
        self.validation = SampleValidation(cfg, rs.run, rs.grid, [p // R for p in rs.paths if p % R == 0]) \
            if cfg.logging.val_documents else None
        self.totals = _Totals()
        self.last_checkpoint: Optional[Path] = None
        # DDP's bytes for one round of this launch's topology: each round records its own
        self.ddp_bytes = build_comm_plan(cfg, rs.world_size).ddp_bytes_per_round

    def on_step(self) -> None:
        """After each inner step (the progress bar)."""
        if self.bar is not None:
            self.bar.update(1)

    def round_done(self, r: int, out: RoundOutcome) -> None:
        """Round ``r + 1`` ended (outer step taken): early stopping, totals, the metrics line."""
        rs, cfg = self.rs, self.rs.cfg
        if self.stopping is not None and self.stopping.due(r + 1):
            # after the outer step: the live modules hold the global weights
            for q, loss in self.stopping.update(r + 1).items():
                out.paths[q * cfg.grid.replicas]["val_loss"] = loss
        if self.validation is not None:
            for q, (loss, tokens) in self.validation.losses().items():
                if rs.local_rank == 0:
                    out.paths[q * cfg.grid.replicas].update(val_sample_loss=loss, val_sample_tokens=tokens)
        modules = _module_stats(out.sync)
        sent = sum(int(m.get("bytes_sent", 0)) for m in modules.values())
        t = self.totals
        t.tokens += sum(v["tokens"] for v in out.paths.values())
        t.bytes_sent += sent
        t.train_s += out.compute_s
        t.wait_s += out.wait_s
        t.sync_s += out.sync_s
        t.rounds_done.append(r + 1)
        record = {"paths": out.paths, "modules": modules, "bytes_sent": sent,
                  "tokens": sum(v["tokens"] for v in out.paths.values()),
                  "compute_s": out.compute_s, "wait_s": out.wait_s, "sync_s": out.sync_s,
                  # streaming (dipaco/sync/round_driver.py): bytes per rank one path had in
                  # flight at once, and the time the inner steps stood waiting for exchanges
                  "inflight_peak_bytes": out.sync.inflight_peak_bytes, "blocked_s": out.sync.blocked_s,
                  # the turns' logging intervals: read from the device with the turn's totals
                  "steps": step_records(cfg, rs.grid, rs.device, r + 1, rs.learners)}
        everyone = gather_to_rank0(record, rs.distributed)
        if self.writer is not None:  # rank 0, the one that holds everyone's records
            self.writer.log_steps(merge_step_records([rec.pop("steps") for rec in everyone]))
            line = _round_record(r + 1, everyone, outer_lr=cfg.diloco.outer.lr, ddp_bytes=self.ddp_bytes)
            if cfg.launcher.elastic:  # other runs' lines stay as they were
                line["worker_groups"] = rs.topo.num_groups  # changes with the membership
            if r == self.start_round and elastic.current_change() is not None:
                line["membership"] = elastic.current_change()  # the change this start began with
            self.writer.log_round({**line, "step": (r + 1) * cfg.diloco.inner_steps})
            losses = {int(p): v["loss"] for rec in everyone for p, v in rec["paths"].items()}
            say(f"round {r + 1}/{cfg.trainer.rounds}: mean path loss {np.mean(list(losses.values())):.4f}, "
                f"bytes sent {sum(x['bytes_sent'] for x in everyone):,}")

    def checkpoint(self, round_idx: int) -> None:
        """A checkpoint after ``round_idx`` rounds (a collective in the torch backend)."""
        rs = self.rs
        self.last_checkpoint = save_checkpoint(rs.ckpts, round_idx, rs.grid, rs.sync, rs.learners, rs.topo,
                                               rs.rank, rs.distributed, rs.modules, rs.driver)

    def result(self) -> RoundsResult:
        """Close the writer and bar; every rank's totals (a collective in the torch backend)."""
        rs, t, R = self.rs, self.totals, self.rs.cfg.trainer.rounds
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None and self.owns_writer:
            self.writer.close()
        rs.sync.close()
        if self.last_checkpoint is None and self.start_round >= R:
            self.last_checkpoint = rs.ckpts.latest_valid()
        totals = gather({"tokens": t.tokens, "bytes_sent": t.bytes_sent, "train_s": t.train_s,
                         "wait_s": t.wait_s, "sync_s": t.sync_s}, rs.distributed)
        return RoundsResult(
            rounds=R,
            completed_rounds=t.rounds_done[-1] if t.rounds_done else R,  # none run: resumed at the end
            start_round=self.start_round,
            world_size=rs.world_size,
            tokens=sum(x["tokens"] for x in totals),
            bytes_sent=sum(x["bytes_sent"] for x in totals),
            compute_s=max(x["train_s"] for x in totals),
            wait_s=max(x["wait_s"] for x in totals),
            sync_s=max(x["sync_s"] for x in totals),
            checkpoint=str(self.last_checkpoint) if self.last_checkpoint else None,
            device=str(rs.device),
            # the largest peak of any rank (CUDA allocator peak, or peak RSS on the CPU)
            peak_memory_bytes=max(gather(peak_memory_bytes(rs.device), rs.distributed)),
        )


def _module_stats(round_stats: RoundStats) -> dict[str, dict]:
    """Per-module sync statistics as JSON-able dicts."""
    out = {}
    for mid, s in round_stats.modules.items():
        d = s.to_dict()
        out[mid] = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}
    return out


def _round_record(round_idx: int, records: list[dict], outer_lr: float, ddp_bytes: int) -> dict[str, Any]:
    """All ranks' records of one round merged: per-path loss and lr, per-module sync stats,
    bytes, time split (slowest rank)."""
    paths: dict[str, dict] = {}
    modules: dict[str, dict] = {}
    for rec in records:
        paths.update({str(p): v for p, v in rec["paths"].items()})
        for mid, s in rec["modules"].items():
            modules.setdefault(mid, s)  # every holder reports the same outer step
    line = round_record(round_idx, "sync", paths, modules,
                        bytes_sent=sum(r["bytes_sent"] for r in records),
                        # every rank's tokens (the ranks of a worker group split its batches)
                        tokens=sum(r["tokens"] for r in records),
                        compute_s=max(r["compute_s"] for r in records),
                        wait_s=max(r["wait_s"] for r in records), sync_s=max(r["sync_s"] for r in records),
                        ddp_bytes=ddp_bytes)
    streaming = {"inflight_peak_bytes": max(r["inflight_peak_bytes"] for r in records),
                 "blocked_s": max(r["blocked_s"] for r in records)}
    return {**line, "outer_lr": outer_lr, **streaming}
