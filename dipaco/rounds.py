"""The DiPaCo rounds on one rank (or, in the local backend, on every worker group in turn).

Per round, for each path this rank's worker group owns (every path in the local
backend): restore the path's modules to the round's global weights, run H inner AdamW
steps (data parallel over the worker group), and contribute the pseudo-gradients of its
modules weighted by α (``diloco.alpha``: tokens, or tokens × relative shard size). Then every module this rank holds takes its outer step,
after a reduce over exactly the ranks that hold it. Checkpoints are taken at round
boundaries; resume reloads the newest valid one and continues bit-for-bit.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch.distributed as dist

from dipaco import faults
from dipaco.build import build_grid, build_topology
from dipaco.checkpoint import CheckpointManager, atomic_write_text
from dipaco.config import Config
from dipaco.data import Tokenizer, TokenStream
from dipaco.dense import load_dense_state
from dipaco.device import peak_memory_bytes, rank_device, reset_peak_memory, set_deterministic
from dipaco.early_stopping import PathEarlyStopping
from dipaco.fingerprint import checkpoint_stamp
from dipaco.launch import stop_requested
from dipaco.learner import PathLearner
from dipaco.progress import progress_bar
from dipaco.results import RoundsResult
from dipaco.run_dir import RunDir
from dipaco.schedule import lr_at, total_inner_steps, warmup_steps
from dipaco.sync.alpha import PathAlpha
from dipaco.sync.checkpointing import load_checkpoint, save_checkpoint
from dipaco.sync.data_parallel import allreduce_gradients
from dipaco.sync.diloco import DiLoCoSync, RoundStats
from dipaco.sync.fsdp import apply_fsdp, worker_mesh
from dipaco.sync.groups import ProcessGroups
from dipaco.sync.records import round_record
from dipaco.tracking import MetricsWriter
from modules import PathModel, init_grid_from_dense


def _log(rank: Optional[int], msg: str) -> None:
    if rank is None or rank == 0:
        print(f"[dipaco] {msg}", flush=True)


def _gather(obj: Any, distributed: bool) -> list[Any]:
    """All ranks' ``obj`` (a JSON-able dict) on every rank; ``[obj]`` in the local backend."""
    if not distributed:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _barrier(distributed: bool) -> None:
    if distributed:
        dist.barrier()


def run_rank(cfg: Config, run: RunDir, rank: Optional[int], world_size: int) -> RoundsResult:
    """Train the DiPaCo rounds; ``rank=None`` is the local backend (all groups here)."""
    distributed = rank is not None
    set_deterministic(cfg.trainer.deterministic)  # spawned ranks are fresh interpreters
    # this rank's device (GPU LOCAL_RANK % count; the local backend: every path on one)
    placement = rank_device(cfg.trainer.device, cfg.launcher.backend)
    device = placement.device
    if not distributed:
        _log(rank, placement.describe())
    reset_peak_memory(device)
    grid = build_grid(cfg, device)
    topo = build_topology(cfg, grid, world_size, distributed)
    if distributed:
        group = topo.group_of_rank(rank)
        local_rank, my_groups = topo.local_rank(rank), [group]
    else:
        local_rank, my_groups = 0, list(range(topo.num_groups))
    my_paths = sorted(p for g in my_groups for p in topo.paths_of_group(g))
    my_modules = [m for m in grid.module_ids if any(m in topo.path_modules[p] for p in my_paths)]

    n_warm = warmup_steps(cfg)
    if n_warm > 0:
        # Warm start: every copy of every module begins from the dense warm-up model.
        init_grid_from_dense(grid, load_dense_state(run.warmup))
    modules = {m: grid.module(m) for m in my_modules}

    pgroups = None
    worker_pg = None
    if distributed:
        pgroups = ProcessGroups(topo, rank, cfg.launcher.backend)
        worker_pg = pgroups.worker_group(topo.group_of_rank(rank))
    # launcher.group_parallel=fsdp: shard every held module over the worker group BEFORE the
    # sync and the learners take its (then DTensor) parameters
    fsdp = distributed and cfg.launcher.group_parallel == "fsdp"
    if fsdp:
        apply_fsdp(modules, worker_mesh(worker_pg, device))
    sync = DiLoCoSync.from_config(cfg.diloco, topo, modules, rank=rank, process_groups=pgroups, sharded=fsdp)

    G = topo.group_size if distributed else 1
    alpha = PathAlpha.from_config(cfg.diloco.alpha, run.shards)
    eos = _eos_id(run)
    total = total_inner_steps(cfg)
    learners: dict[int, PathLearner] = {}
    for p in my_paths:
        # memory-mapped: batches are read from the shard's token file by offset
        stream = TokenStream.from_shard(run.shards, p, seq_len=cfg.trainer.seq_len,
                                        batch_size=cfg.trainer.batch_size, seed=cfg.seed, eos_id=eos,
                                        rank=local_rank, world=G)
        grad_sync = None
        if G > 1 and not fsdp:  # FSDP2 reduce-scatters the gradients itself
            grad_sync = (lambda params, _pg=worker_pg: allreduce_gradients(params, _pg, G))
        learners[p] = PathLearner(p, PathModel(grid, p // cfg.grid.replicas), stream, cfg.trainer, total,
                                  grad_sync=grad_sync, step_offset=n_warm)

    ckpts = CheckpointManager(run.checkpoints, keep_last=cfg.trainer.keep_last, stamp=checkpoint_stamp(run))
    start_round = 0
    if cfg.resume:
        latest = ckpts.latest_valid(log=lambda m: _log(rank, m))
        if latest is not None:
            start_round = load_checkpoint(latest, grid, sync, learners, my_modules, topo, rank)
            _log(rank, f"resumed from {latest.name} (round {start_round})")
        if rank is None or rank == 0:
            _truncate_metrics(run, start_round)
    writer = None
    if rank is None or rank == 0:
        writer = MetricsWriter(run, cfg, purge_from_round=start_round + 1 if start_round else None)
    stopping = None
    if cfg.trainer.path_early_stopping and local_rank == 0:
        # one process per grid path checks it: the holder of its first replica
        R = cfg.grid.replicas
        stopping = PathEarlyStopping(cfg, run, grid, [p // R for p in my_paths if p % R == 0], start_round)
    if start_round == 0:
        # docs/design.md contract 4: all copies of a module start from the same weights.
        sync.check_identical_start()

    H, R = cfg.diloco.inner_steps, cfg.trainer.rounds
    train_s = wait_s = sync_s = 0.0
    tokens = bytes_sent = 0
    last_ckpt: Optional[Path] = None
    bar = None
    if rank is None or rank == 0:
        bar = progress_bar(cfg.trainer.progress, (R - start_round) * H * len(my_paths), "rounds", "step")
    for r in range(start_round, R):
        t0 = time.perf_counter()
        path_stats = {}
        for p in my_paths:
            faults.inject("before_inner", round_idx=r + 1, rank=rank, path=p)  # no-op unless DIPACO_FAULT
            sync.begin_path(p)
            stats = learners[p].train_steps(H, on_step=(lambda _l: bar.update(1)) if bar else None)
            faults.inject("after_inner", round_idx=r + 1, rank=rank, path=p, grid=grid,
                          module_ids=list(topo.path_modules[p]))
            accepted = sync.end_path(p, alpha(p, stats.tokens))
            path_stats[p] = {"loss": stats.loss, "tokens": stats.tokens, "seconds": stats.seconds,
                             # the inner lr of the round's last step (the schedule is per step)
                             "lr": lr_at(learners[p].step - 1 + n_warm, total, cfg.trainer),
                             # non-finite updates: skipped inner steps, dropped pseudo-gradients
                             "skipped_steps": stats.skipped,
                             "dropped_modules": sorted(m for m, ok in accepted.items() if not ok)}
            tokens += stats.tokens
        t1 = time.perf_counter()
        # Waiting for the slowest worker group is not communication: a barrier first
        # separates that wait from the exchange and outer step that follow.
        _barrier(distributed)
        tb = time.perf_counter()
        round_stats = sync.finish_round()
        t2 = time.perf_counter()
        train_s += t1 - t0
        wait_s += tb - t1
        sync_s += t2 - tb
        if stopping is not None and stopping.due(r + 1):
            # after the outer step: the live modules hold the global weights
            for q, loss in stopping.update(r + 1).items():
                path_stats[q * cfg.grid.replicas]["val_loss"] = loss
        module_stats = _module_stats(round_stats)
        sent = sum(int(m.get("bytes_sent", 0)) for m in module_stats.values())
        bytes_sent += sent
        record = {"paths": path_stats, "modules": module_stats, "bytes_sent": sent,
                  "tokens": sum(v["tokens"] for v in path_stats.values()),
                  "compute_s": t1 - t0, "wait_s": tb - t1, "sync_s": t2 - tb}
        everyone = _gather(record, distributed)
        if writer is not None:
            writer.log_round(_round_record(r + 1, everyone, outer_lr=cfg.diloco.outer.lr))
            losses = {int(p): v["loss"] for rec in everyone for p, v in rec["paths"].items()}
            _log(rank, f"round {r + 1}/{R}: mean path loss {np.mean(list(losses.values())):.4f}, "
                       f"bytes sent {sum(x['bytes_sent'] for x in everyone):,}")
        stop = cfg.trainer.stop_after_rounds is not None and r + 1 >= cfg.trainer.stop_after_rounds
        stop = stop_requested(distributed) or stop  # SIGTERM/SIGINT: every rank stops after this round
        if (r + 1) % cfg.trainer.checkpoint_every == 0 or r + 1 == R or stop:
            last_ckpt = save_checkpoint(ckpts, r + 1, grid, sync, learners, topo, rank, distributed, my_modules)
        if stop:
            _log(rank, f"stopping after round {r + 1} (checkpoint written)")
            break
    if bar is not None:
        bar.close()
    if writer is not None:
        writer.close()
    if last_ckpt is None and start_round >= R:
        last_ckpt = ckpts.latest_valid()
    totals = _gather({"tokens": tokens, "bytes_sent": bytes_sent, "train_s": train_s, "wait_s": wait_s,
                      "sync_s": sync_s},
                     distributed)
    return RoundsResult(
        rounds=R,
        completed_rounds=r + 1 if start_round < R else R,
        start_round=start_round,
        world_size=world_size,
        tokens=sum(t["tokens"] for t in totals),
        bytes_sent=sum(t["bytes_sent"] for t in totals),
        compute_s=max(t["train_s"] for t in totals),
        wait_s=max(t["wait_s"] for t in totals),
        sync_s=max(t["sync_s"] for t in totals),
        checkpoint=str(last_ckpt) if last_ckpt else None,
        device=str(device),
        # the largest peak of any rank (CUDA allocator peak, or peak RSS on the CPU)
        peak_memory_bytes=max(_gather(peak_memory_bytes(device), distributed)),
    )



def _eos_id(run: RunDir) -> int:
    return Tokenizer.load(run.tokenizer).eos_id


def _module_stats(round_stats: RoundStats) -> dict[str, dict]:
    """Per-module sync statistics as JSON-able dicts."""
    out = {}
    for mid, s in round_stats.modules.items():
        d = s.to_dict()
        out[mid] = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}
    return out


def _truncate_metrics(run: RunDir, keep_rounds: int) -> None:
    """Drop metrics of rounds past the checkpoint we resume from: they are re-run."""
    if not run.metrics.exists():
        return
    lines = [x for x in run.metrics.read_text(encoding="utf-8").splitlines() if x.strip()]
    kept = [x for x in lines if json.loads(x).get("round", 0) <= keep_rounds]
    if len(kept) != len(lines):
        atomic_write_text(run.metrics, "".join(x + "\n" for x in kept))


def _round_record(round_idx: int, records: list[dict], outer_lr: float) -> dict[str, Any]:
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
                        wait_s=max(r["wait_s"] for r in records), sync_s=max(r["sync_s"] for r in records))
    return {**line, "outer_lr": outer_lr}
