"""``train(cfg)``: the whole DiPaCo job, callable from tests and wrapped by ``dipaco-train``.

    validate config → prepare (corpus, tokenizer, warm-up, router, shards)
    → launch ranks: DiPaCo rounds with per-module DiLoCo (checkpoints each round)
    → dense same-size baseline (same inner steps) → routed evaluation → summary.json
"""
from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

from dipaco.run.checkpoint import atomic_write_text, write_json
from dipaco.storage.jsonl import append_json_lines
from dipaco.config import Config, ConfigError, eval_window
from dipaco.decoupled.owner import check_store
from dipaco.decoupled.run import join_task, run_decoupled
from dipaco.rounds.dense import BASELINE_STREAM_ID, load_dense_grid, load_dense_state, save_dense, train_dense
from dipaco.runtime.device import set_deterministic
from dipaco.rounds.evaluate import evaluate_single
from dipaco.run.fingerprint import preflight_resume
from dipaco.run.provenance import PROVENANCE, record as record_provenance
from dipaco.job.evaluation import evaluate_run
from dipaco.runtime import elastic
from dipaco.runtime.launch import StopSignals, init_distributed, launch, require_torchrun_env
from dipaco.runtime.placement import apply_placement, placement_of
from dipaco.run.path_guard import check_run_root, check_target
from dipaco.job.plots import write_plots
from dipaco.runtime.preempt import RequeueDeadline, requeued_resume, stopped
from dipaco.job.prepare import Prepared, prepare
from dipaco.run.results import RoundsResult
from dipaco.job.reshard import reshard_rounds, run_rounds_with_reshards
from dipaco.run.resume import check_fresh, finished_summary, has_saved_config, resume_config
from dipaco.run.record import write_run_config
from dipaco.run.routed import holds_prepared_run, routed_config
from dipaco.rounds import run_rank
from dipaco.run.run_dir import RunDir, disk_full_guard, prior_totals
from dipaco.run.lock import RunLock, check_unlocked
from dipaco.config.schedule import extension_note
from dipaco.runtime.slurm import slurm_rendezvous
from dipaco.runtime.progress import log, open_run_log, run_log, say_plain
from dipaco.job.summary import build_summary, summary_table
from dipaco.runtime.record_tail import RecordTail
from dipaco.runtime.tracking import MetricsWriter, writer_for
from dipaco.job.preflight import preflight
from modules import PathModel


def _log(msg: str) -> None:
    log.info(msg)  # the "dipaco" logger: the console and the run's train.log


def train(cfg: Config, overrides: Optional[list[str]] = None,
          hydra_files: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """Run the job described by ``cfg`` in ``cfg.run_dir``; return its summary.

    The summary is a :class:`~dipaco.job.summary.RunSummary` (what ``summary.json``
    holds) when the run finished, in this process or earlier (an already finished run is
    not trained again); ``{"stopped_at_round", "checkpoint"}`` when it stopped before its
    last round; ``{}`` on a torchrun rank other than 0.

    With ``resume=true`` the run's saved ``config.yaml`` is the config; ``overrides``
    (the command line, as Hydra's task overrides) says which keys were asked for, and
    only keys that do not shape the run may change (:mod:`dipaco.run.resume`). ``None``:
    every key of ``cfg`` counts as asked for. Nothing is written to the run directory
    before every check has passed (docs/design.md contract 9): a resume is checked
    against ``fingerprints.json`` and writes its config and ``resumes.jsonl`` only after
    preparation accepted the data. ``hydra_files`` (relative path → text: Hydra's
    ``.hydra/`` record, which the CLIs hold back) is written into a fresh run once accepted.
    The job's messages go to ``train.log`` in the run directory from then on (those
    before are held until then; a refused run writes none: :func:`run_log`).
    """
    with run_log():
        return _train_job(cfg, overrides, hydra_files)


def _train_job(cfg: Config, overrides: Optional[list[str]], hydra_files: Optional[dict[str, str]]) -> dict[str, Any]:
    """:func:`train`'s body."""
    preflight(cfg)
    cfg = requeued_resume(cfg, os.environ, _log)  # a requeued SLURM job continues its run
    if not cfg.run_dir:
        raise ConfigError("run_dir", "no run directory", "pass run_dir=DIR (the CLI uses hydra.run.dir)")
    check_run_root(cfg.run_dir)
    if cfg.launcher.name == "slurm" and cfg.diloco.mode == "decoupled" and os.environ.get("SLURM_PROCID", "0") != "0":
        return _decoupled_task(cfg)
    run = RunDir.at(cfg.run_dir)
    changes: dict[str, list] = {}
    if holds_prepared_run(run):  # a routed directory: continued, never rebuilt (dipaco/run/routed.py)
        cfg, changes = routed_config(cfg, run, overrides, _log)  # checked as a resume is (preflight_resume)
        preflight(cfg)
    elif cfg.resume and has_saved_config(run):
        saved_rounds = run.load_config().trainer.rounds
        cfg, changes = resume_config(cfg, run, overrides, log=_log)
        preflight(cfg)
        done = finished_summary(cfg, run, _log)
        if done is not None:
            _log(f"{run.root} is already finished ({done.get('rounds')} rounds, summary.json); nothing to do "
                 "(to train longer: resume=true trainer.rounds=N)")
            return done
        preflight_resume(run, cfg)
        if cfg.trainer.rounds > saved_rounds:
            _log(extension_note(cfg, saved_rounds))
    elif cfg.resume:
        _log(f"resume=true: {run.root} holds no run yet (no config.yaml); starting a new run from round 0")
    else:
        check_fresh(run)
    _check_write_targets(cfg, run)
    set_deterministic(cfg.trainer.deterministic)  # before any CUDA work (the warm-up, the features)
    if cfg.launcher.name == "slurm":  # each srun task's SLURM env becomes the torchrun env
        os.environ.update(slurm_rendezvous(os.environ, cfg.launcher.master_port))
        # the task's GPU and CPUs (launcher.cpus_per_task), not GPU 0 and every core of the node
        apply_placement(placement_of(cfg))
    if cfg.launcher.name in ("torchrun", "slurm"):
        require_torchrun_env()
        if int(os.environ["RANK"]) != 0:  # rank 0 holds the lock and writes the shared files
            with StopSignals():  # SIGTERM / SLURM's SIGUSR2: this rank too stops at the round boundary
                return _train_under_torchrun(cfg, run, changes)
    check_unlocked(run.root)
    with RunLock(run.root, log=_log), disk_full_guard(run), StopSignals():
        if hydra_files and not cfg.resume:  # a new run, accepted: Hydra's record beside its config.yaml
            for rel, text in hydra_files.items():
                atomic_write_text(run.root / rel, text)
        if cfg.launcher.name in ("torchrun", "slurm") and cfg.diloco.mode == "sync":
            return _train_under_torchrun(cfg, run, changes)
        return _train(cfg, run, changes)  # a decoupled SLURM job's task 0 too: it makes the run


def _decoupled_task(cfg: Config) -> dict[str, Any]:
    """A task of a ``launcher=slurm`` decoupled job other than task 0: it joins the run
    task 0 makes in the store (:func:`dipaco.decoupled.run.join_task`), on its own GPU."""
    os.environ.update(slurm_rendezvous(os.environ, cfg.launcher.master_port))
    apply_placement(placement_of(cfg))
    with StopSignals():  # SLURM's SIGUSR2: this task's share stops; task 0 requeues the job
        return join_task(cfg, RunDir.at(cfg.run_dir), int(os.environ["RANK"]))


def _check_write_targets(cfg: Config, run: RunDir) -> None:
    """Every place the run will write, by the rule of :mod:`dipaco.run.path_guard`, before it
    writes anything: the token cache, the checkpoints folder, the decoupled store."""
    fix = "leave it null (the run's own folder) or choose a path outside every run directory"
    check_target(cfg.data.cache_dir or run.cache, "data.cache_dir", own_run=run.root, owned=("cache",), fix=fix,
                 folder=True)
    check_target(run.checkpoints, "checkpoints/", own_run=run.root, owned=("checkpoints",), folder=True,
                 fix="make checkpoints/ a folder of this run (or a link to storage outside every run)")
    if cfg.diloco.mode == "decoupled":
        check_store(cfg.diloco.decoupled.store_url or str(run.root / "decoupled"), run, cfg.resume)


def _save_config(cfg: Config, run: RunDir, changes: dict[str, list]) -> None:
    """The run is accepted: its train.log opens (the held messages first), then
    config.yaml (atomically), and the allowed changes a resume made, one JSON line each."""
    open_run_log(run.log_file, fresh=not (cfg.resume and run.config.is_file()))
    _log(f"run directory: {run.root}")
    if changes:
        _log("resume changes " + ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changes.items()))
        append_json_lines(run.root / "resumes.jsonl", [{"time": time.time(), "changes": changes}])
    resumed = cfg.resume and run.config.is_file()
    if changes or not run.config.is_file() or not cfg.resume:
        write_run_config(run, cfg)  # and what it says, in fingerprints.json (dipaco/run/record.py)
    if not cfg.resume:
        for stale in (run.metrics, run.steps, run.root / PROVENANCE):  # a fresh run starts fresh logs
            stale.unlink(missing_ok=True)
        # events of an earlier attempt in this directory would mix into the new curves
        shutil.rmtree(run.tensorboard, ignore_errors=True)
    record_provenance(run.root, "resume" if resumed else "start")  # what made the run, per launch
    if cfg.launcher.name == "local" and cfg.launcher.nproc > 1:
        _log(f"launcher=local runs one process; launcher.nproc={cfg.launcher.nproc} only sets the simulated "
             "worker groups (launcher=spawn starts that many ranks)")


def _train(cfg: Config, run: RunDir, changes: dict[str, list]) -> dict[str, Any]:
    """The job, with the checks passed and the directory locked."""
    wall0 = time.perf_counter()
    if not cfg.resume or not run.config.is_file():
        _save_config(cfg, run, changes)
    prep = prepare(cfg, run)  # on resume: refuses other data before it writes anything
    if cfg.resume and run.config.is_file():
        _save_config(cfg, run, changes)  # the resume is accepted: its changes are recorded

    # the job's one writer (one W&B run): the rounds, decoupled mode and the summary use it
    with MetricsWriter(run, cfg, shared=True) as writer:
        writer.log_curve("warmup", prep.warmup_intervals, offset=-prep.warmup_steps)  # ends at step 0
        t0 = time.perf_counter()
        # a spawned rank 0 writes metrics.jsonl without W&B: the job streams it there meanwhile
        with RecordTail(writer) if cfg.launcher.name == "spawn" else contextlib.nullcontext():
            if cfg.diloco.mode == "decoupled":
                # asynchronous workers + per-module synchronisers (docs/decoupled.md); same RoundsResult
                result = run_decoupled(cfg, run)
            else:
                result = _run_rounds(cfg, run, prep)
        rounds_s = time.perf_counter() - t0
        return _finish(cfg, run, prep, result, rounds_s, wall0)


def _finish(cfg: Config, run: RunDir, prep: Prepared, result: RoundsResult, rounds_s: float,
            wall0: float) -> dict[str, Any]:
    """After the rounds (launching process / rank 0): baseline, evaluation, summary
    (a :class:`~dipaco.job.summary.RunSummary`; a stopped run's stop instead)."""
    if not result.finished and StopSignals.received:  # under SLURM: a decoupled job's task 0, which requeues
        raise stopped(cfg, run, result, StopSignals.received, requeue_here=cfg.launcher.name == "slurm")
    if not result.finished:
        _log(f"stopped after round {result.completed_rounds} of {result.rounds}; continue with: "
             f"dipaco-train hydra.run.dir={run.root} resume=true")
        return {"stopped_at_round": result.completed_rounds, "checkpoint": result.checkpoint}

    if result.start_round > 0 and cfg.diloco.mode == "sync":
        # totals of the whole run, not of this launch: the resumed-from rounds' traffic,
        # tokens and time come from metrics.jsonl, cut to the checkpoint on resume
        timed_from = elastic.launch_first_round(run) if cfg.launcher.elastic else None
        result, rounds_s = prior_totals(run, result, rounds_s, timed_from)
    baseline = _dense_baseline(cfg, run, prep)
    routed = _evaluate(cfg, run, prep, Path(result.checkpoint))
    summary = build_summary(cfg, run, prep, result, rounds_s, baseline, routed, time.perf_counter() - wall0)
    write_json(run.summary, summary)
    with writer_for(run, cfg) as writer:  # plotted at the last round's last inner step
        writer.log_summary(summary, step=cfg.trainer.rounds * cfg.diloco.inner_steps)
    if cfg.trainer.plots:
        write_plots(run)
    say_plain(summary_table(summary))
    _log(f"run directory: {run.root}")
    return summary


def _train_under_torchrun(cfg: Config, run: RunDir, changes: dict[str, list]) -> dict[str, Any]:
    """Every process is already a rank: rank 0 prepares, all train, rank 0 finishes.

    All ranks must see the same run directory (pass ``hydra.run.dir`` on a shared
    filesystem); the other ranks wait at a barrier while rank 0 routes and shards.
    Under ``launcher=slurm`` each srun task's SLURM env becomes the torchrun env first.
    """
    if cfg.launcher.name == "slurm":
        os.environ.update(slurm_rendezvous(os.environ, cfg.launcher.master_port))

    if cfg.router.reshard_at_round is not None:
        raise ConfigError("router.reshard_at_round", "re-sharding is not supported under torchrun yet",
                          "use launcher=spawn on one host, or drop the re-shard")
    rank, world = init_distributed(placement_of(cfg), cfg.launcher.timeout_s)
    deadline = None
    if cfg.launcher.name == "slurm" and rank == 0:  # a round that cannot end in time is abandoned
        deadline = RequeueDeadline(cfg, os.environ, log=_log)
        StopSignals.on_signal = deadline.arm
    wall0 = time.perf_counter()
    prep = None
    if rank == 0:
        resumed = cfg.resume and run.config.is_file()
        if not resumed:
            _save_config(cfg, run, changes)
        prep = prepare(cfg, run)
        if resumed:
            _save_config(cfg, run, changes)
    dist.barrier()
    # rank 0 is the job's process: its writer is the rounds' and the summary's (one W&B run)
    with MetricsWriter(run, cfg, shared=True) if rank == 0 else contextlib.nullcontext():
        t0 = time.perf_counter()
        result = launch(run_rank, cfg, run)
        rounds_s = time.perf_counter() - t0
        if not result.finished and StopSignals.received:
            # every rank stopped after the same round (dipaco.runtime.launch.stop_requested) and knows the
            # signal: all leave together; under SLURM rank 0 requeues the job (dipaco/runtime/preempt.py)
            dist.barrier()
            dist.destroy_process_group()
            raise stopped(cfg, run, result, StopSignals.received,
                          requeue_here=rank == 0 and (deadline is None or deadline.claim()))
        summary: dict[str, Any] = {}
        if rank == 0:
            assert prep is not None
            summary = _finish(cfg, run, prep, result, rounds_s, wall0)
    dist.barrier()
    dist.destroy_process_group()
    if deadline is not None:
        deadline.cancel()
    return summary


def _run_rounds(cfg: Config, run: RunDir, prep: Prepared) -> RoundsResult:
    """Launch the ranks for the DiPaCo rounds, stopping for each EM re-shard phase
    (``router.reshard_at_round``, ``router.reshard_every``; :mod:`dipaco.job.reshard`)."""
    if not reshard_rounds(cfg):
        return launch(run_rank, cfg, run)
    return run_rounds_with_reshards(cfg, run, prep)


def _dense_baseline(cfg: Config, run: RunDir, prep: Prepared) -> dict[str, Any]:
    """Dense model of one path's size, same inner steps as a path, all training data."""
    if not cfg.trainer.dense_baseline:
        return {}
    steps = cfg.trainer.rounds * cfg.diloco.inner_steps
    t = cfg.trainer
    saved = run.baseline / "info.json"
    if (run.baseline / "modules.safetensors").exists() and saved.is_file() \
            and run.read_json(saved).get("steps") == steps + prep.warmup_steps:  # not from fewer rounds
        grid = load_dense_grid(cfg, run.baseline)
        info = run.read_json(run.baseline / "info.json")
    else:
        _log(f"dense baseline: {steps} steps (+{prep.warmup_steps} warm-up)")
        init = load_dense_state(run.warmup) if prep.warmup_steps else None
        grid, stats = train_dense(cfg, prep.train_ids, prep.tokenizer.eos_id, steps=steps,
                                  stream_id=BASELINE_STREAM_ID, step_offset=prep.warmup_steps,
                                  init=init, progress_desc="dense baseline", log_every=cfg.logging.every_steps)
        with writer_for(run, cfg) as writer:  # beside the paths' curves, at the same inner steps
            writer.log_curve("dense_baseline", stats.intervals)
        info = {"steps": steps + prep.warmup_steps, "train_loss": stats.loss, "tokens": stats.tokens,
                "seconds": stats.seconds, "tokens_per_s": stats.tokens / max(stats.seconds, 1e-9)}
        save_dense(run.baseline, grid, info)
    ev = evaluate_single(prep.eval_ids, PathModel(grid, 0), seq_len=t.seq_len,
                         prefix_tokens=cfg.router.prefix_tokens, batch_size=t.eval_batch_size)
    out = {"info": info, "eval": ev}
    if t.eval_long:
        out["eval_long"] = evaluate_single(prep.eval_ids, PathModel(grid, 0), seq_len=eval_window(cfg),
                                           prefix_tokens=cfg.router.prefix_tokens, batch_size=t.eval_batch_size,
                                           whole_documents=True)
    return out


def _evaluate(cfg: Config, run: RunDir, prep: Prepared, ckpt: Path) -> dict[str, Any]:
    """Routed perplexity on ``trainer.eval_split`` (:func:`dipaco.job.evaluation.evaluate_run`)."""
    return evaluate_run(cfg, run, prep.router, prep.eval_ids, ckpt)
