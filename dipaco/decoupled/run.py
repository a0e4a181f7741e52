"""``run_decoupled(cfg, run)``: decoupled mode on one host.

It writes version 0 of every module to the store, has the supervisor
(:class:`dipaco.decoupled.supervisor.Supervisor`) start and watch the synchroniser
process(es) and N decoupled worker processes, then, when every path has its budget,
writes the final module weights as an ordinary checkpoint
(``checkpoints/round_NNNNNN/modules/*.safetensors`` + manifest) so evaluation and
``dipaco-infer`` work unchanged, and returns the same :class:`~dipaco.run.results.RoundsResult`
as the rounds loop of sync mode.

The run lives in its store (``run.json``: config, code version; ``plan.json``; the
modules' versions): more hosts join it from anywhere with ``dipaco-decoupled worker|sync
STORE`` (docs/decoupled.md, "Across hosts"), and :func:`finish_run` (this host's, or
``dipaco-decoupled finish``) waits for their synchronisers to drain before it accounts.
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from dipaco.plan.build import build_grid
from dipaco.run.checkpoint import CheckpointManager, save_state
from dipaco.config import Config, ConfigError, to_config
from dipaco.config.decoupled import DecoupledConfig, validate_decoupled
from dipaco.decoupled.owner import FINISHED_KEY, PLAN_KEY, NoRunYet, claim_store, open_run, write_run_record
from dipaco.decoupled.merge import MergingModuleSync
from dipaco.decoupled.metrics import compute_metrics, worker_events
from dipaco.decoupled.module_leases import live_synchronisers, module_folder, read_module, write_module
from dipaco.decoupled.service import archive, inbox, path_steps_done, progress_key, read_path_state
from dipaco.decoupled.store import Store, encode_state
from dipaco.decoupled.versions import publish
from dipaco.decoupled.supervisor import DecoupledError, Supervisor, run_config_dict, sync_main
from dipaco.decoupled.worker import RESIDUALS
from dipaco.run.fingerprint import checkpoint_stamp
from dipaco.rounds.dense import load_dense_state
from dipaco.run.lock import restart_count
from dipaco.runtime.launch import StopSignals
from dipaco.runtime.progress import say
from dipaco.run.run_dir import RunDir
from dipaco.config.schedule import warmup_steps
from dipaco.rounds.checkpointing import checkpoint_state, write_module_files
from dipaco.sync.module_core import flatten_params, load_flat
from dipaco.sync.outer import outer_options
from dipaco.rounds.round_line import round_record
from dipaco.runtime.tracking import writer_for
from dipaco.run.results import RoundsResult
from modules import init_grid_from_dense
from dipaco.storage.atomic import write_json

__all__ = ["run_decoupled", "decoupled_config", "DecoupledError", "sync_main", "finish_run", "init_store",
           "join_task"]


def decoupled_config(cfg: Config, override: Optional[DecoupledConfig] = None) -> DecoupledConfig:
    """``diloco.decoupled`` of the config (defaults if the schema has none yet)."""
    if override is not None:
        return override
    d = getattr(cfg.diloco, "decoupled", None)
    if d is None:
        return DecoupledConfig()
    if isinstance(d, DecoupledConfig):
        return d
    return DecoupledConfig(**dict(d))


def outer_settings(cfg: Config, dcfg: DecoupledConfig) -> dict[str, Any]:
    """The outer optimiser of every module (``diloco.outer``, delayed per ``dcfg``).

    Decoupled whatever ``cfg.diloco.mode`` says: :func:`run_decoupled` is also called
    directly (tests, notebooks) on a config composed in the default sync mode, and
    :func:`~dipaco.sync.outer.outer_options` delays the momentum only in decoupled mode.
    Without this, those runs stepped with undelayed Nesterov, which stale updates can
    make diverge (the chaos test once ended at 7.1 nats against the sync run's 5.3).
    """
    return outer_options(dataclasses.replace(cfg.diloco, decoupled=dcfg, mode="decoupled"))


# ------------------------------------------------------------------------ setup


def init_store(cfg: Config, run: RunDir, store: Store, dcfg: DecoupledConfig) -> dict[str, Any]:
    """Write the plan, version 0 of every module (kept as is when resuming) and the run
    record (:func:`dipaco.decoupled.owner.write_run_record`); worker slots start at 0."""
    grid = build_grid(cfg)
    if warmup_steps(cfg) > 0:
        init_grid_from_dense(grid, load_dense_state(run.warmup))
    sharing = {m: grid.paths_of_module(m) for m in grid.module_ids}
    plan = {"rounds": cfg.trainer.rounds, "inner_steps": cfg.diloco.inner_steps, "num_paths": grid.num_paths,
            "module_ids": list(grid.module_ids), "sharing": sharing, "levels": list(grid.levels)}
    old = store.get_json(PLAN_KEY)
    if old is not None and (old["module_ids"] != plan["module_ids"] or old["num_paths"] != plan["num_paths"]):
        raise ConfigError("resume", f"the decoupled store was made for another grid ({old['levels']})",
                          "resume with the same grid.levels, or start a fresh run directory")
    store.put_json(PLAN_KEY, plan)
    outer = outer_settings(cfg, dcfg)
    for m in grid.module_ids:
        if read_module(store, m, meta_only=True) is None:
            theta = flatten_params(list(grid.module(m).parameters()))
            write_module(store, MergingModuleSync(m, theta, sharing[m], dcfg, outer), 0)
    write_run_record(store, run_config_dict(cfg, dcfg), run.root,
                     slurm=slurm_attempt(os.environ) if cfg.launcher.name == "slurm" else None)
    return plan


# ------------------------------------------------------------------- processes


def run_decoupled(cfg: Config, run: RunDir, dcfg: Optional[DecoupledConfig] = None) -> RoundsResult:
    """Train every path for ``trainer.rounds`` phases of H steps, asynchronously: prepare
    the store → supervise the processes → account → record → checkpoint.

    Returns the :class:`~dipaco.run.results.RoundsResult` of sync mode's rounds loop, with
    ``decoupled`` set (the metrics of :mod:`dipaco.decoupled.metrics`).
    """
    dcfg = decoupled_config(cfg, dcfg)
    problems = validate_decoupled(dcfg)
    if problems:
        raise ConfigError(*problems[0])
    store_url = dcfg.store_url or str(run.root / "decoupled")
    # this run's store only: another run's is never emptied or continued (owner.json)
    store = claim_store(store_url, run, resume=cfg.resume)
    plan = init_store(cfg, run, store, dcfg)
    R, P, H = plan["rounds"], plan["num_paths"], plan["inner_steps"]
    start_round = min(_rounds_done(store, p, H) for p in range(P))
    n_workers = dcfg.num_workers or (cfg.launcher.nproc if cfg.launcher.nproc > 1 else P)
    n_syncs = None  # dcfg.sync_procs
    if cfg.launcher.name == "slurm":  # task 0 of the job: its share, as every task's (join_task)
        n_workers, n_syncs = 1, 1
    for key in dcfg.deprecated_keys():
        say(f"{key} is deprecated: the decoupled process is a decoupled worker")
    sup = Supervisor(cfg, run, store, store_url, plan, dcfg, outer_settings(cfg, dcfg), n_workers, n_syncs=n_syncs)
    say(f"decoupled: {n_workers} workers, {sup.nsync} synchroniser(s), {P} paths x {R} phases of "
        f"{cfg.diloco.inner_steps} steps; store {store_url}")
    t0 = time.time()
    sup.start()
    stopped = sup.watch()
    train_s = time.time() - t0
    metrics, ckpt, done_rounds = finish_run(cfg, run, store, plan, dcfg, n_workers, stopped=stopped,
                                            own=sup.sync_names, supervised={"kills": sup.kills, "restarts":
                                                                            sup.restarts, "supervisor_s": train_s})
    say(f"decoupled: done in {train_s:.1f}s, goodput {metrics['goodput']:.2f}, "
        f"versions {metrics['module_versions']}, dropped {metrics['dropped'] or 'none'}, "
        f"ledger {'ok' if metrics['ledger_ok'] else 'VIOLATED'}")
    per_worker: dict[str, float] = {}
    for e in worker_events(store):
        if e["e"] == "end":
            per_worker[e["worker"]] = per_worker.get(e["worker"], 0.0) + float(e["seconds"])
    compute_s = max(per_worker.values(), default=0.0)
    return RoundsResult(
        rounds=R,
        completed_rounds=done_rounds,
        start_round=start_round,
        # for the summary's DDP-bytes plan: one worker group per decoupled worker, at most one per path
        world_size=min(n_workers, P) * cfg.launcher.group_size,
        tokens=int(metrics["tokens"]),
        bytes_sent=int(metrics["bytes_pushed"]),
        compute_s=compute_s,
        sync_s=max(0.0, train_s - compute_s),
        checkpoint=str(ckpt) if ckpt is not None else None,
        decoupled={k: v for k, v in metrics.items() if k != "ledger"},
        resumed_from_round=start_round if cfg.resume and start_round > 0 else None,
    )


def slurm_attempt(env: Mapping[str, str]) -> dict:
    """This SLURM job and attempt (``SLURM_RESTART_COUNT``): what a task's run record names."""
    return {"job": env.get("SLURM_JOB_ID"), "restart": restart_count(env)}


def join_task(cfg: Config, run: RunDir, task: int) -> dict:
    """A task of a ``launcher=slurm`` decoupled job other than task 0: wait until task 0
    has made (or, requeued, resumed) the run in the store, then run one decoupled worker,
    and a synchroniser on the first ``sync_procs`` tasks, until every path has its budget
    or a stop signal (the run goes on from the store: a requeued task rejoins it). Returns
    ``{}``, as a rank other than 0 does."""
    dcfg = decoupled_config(cfg)
    url, attempt = dcfg.store_url or str(run.root / "decoupled"), slurm_attempt(os.environ)
    deadline = time.time() + (dcfg.timeout_s if dcfg.timeout_s is not None else math.inf)
    while not StopSignals.received:
        try:
            store, record = open_run(url, to_train=False)
            if record.get("slurm") == attempt:
                break
        except NoRunYet:
            pass
        if time.time() > deadline:
            raise DecoupledError(f"task {task}: task 0 made no run for SLURM job {attempt['job']} in {url} "
                                 f"within diloco.decoupled.timeout_s={dcfg.timeout_s}s (its log says why)")
        time.sleep(1.0)
    else:
        return {}
    joined, jd = to_config(record["config"]), DecoupledConfig(**record["config"]["diloco"]["decoupled"])
    sup = Supervisor(joined, run, store, url, store.get_json(PLAN_KEY), jd, outer_settings(joined, jd), 1,
                     n_syncs=int(task < jd.sync_procs), role=f"slurm task {task}")
    say(f"task {task} joined the run in {url}: 1 decoupled worker, {sup.nsync} synchroniser(s)")
    sup.start()
    stopped = sup.watch()
    say(f"task {task}: " + (f"stopped by {stopped}; the run goes on from its store" if stopped else "done"))
    return {}


def finish_run(cfg: Config, run: RunDir, store: Store, plan: dict, dcfg: DecoupledConfig, n_workers: int, *,
               stopped: Optional[str] = None, own: tuple[str, ...] | list[str] = (),
               supervised: Optional[dict[str, Any]] = None) -> tuple[dict[str, Any], Optional[Path], int]:
    """After training (this host's processes have stopped): let the other hosts'
    synchronisers drain, account, record, checkpoint; ``(metrics, checkpoint, rounds)``.

    Finished (not ``stopped``): once every inbox is drained or no synchroniser is left
    (``own``: this host's, stopped), updates still in an inbox are dropped as
    ``unprocessed_after_finish``, the final checkpoint is written and the store marked
    finished (no role joins it any more). Stopped: the checkpoint is that of the last
    phase every path finished, and the store keeps every finished phase (a resume, or the
    other hosts, continue from it).
    """
    R, P, H = plan["rounds"], plan["num_paths"], plan["inner_steps"]
    finished = not stopped and min(_rounds_done(store, p, H) for p in range(P)) >= R
    if finished:
        _settle(store, plan, dcfg, own)
    if not set(live_synchronisers(store, dcfg.lease_s)) - set(own):
        _account_leftovers(store, plan["module_ids"])
    workers = max(n_workers, len(store.list("slots")))
    metrics = compute_metrics(store, plan["module_ids"], workers)
    metrics.update(supervised or {})
    write_json(run.root / "decoupled_metrics.json", metrics)  # atomic, strict JSON
    _append_round_metrics(cfg, run, store)
    done_rounds = min(_rounds_done(store, p, H) for p in range(P))
    # stopped: the checkpoint is that of the last phase every path finished, not the run's last round
    ckpt = write_checkpoint(cfg, run, store, plan, None if finished else done_rounds) \
        if finished or done_rounds > 0 else None
    if finished:
        store.put_json(FINISHED_KEY, {"t": time.time(), "checkpoint": str(ckpt), "run_dir": str(run.root)})
    return metrics, ckpt, done_rounds


def _settle(store: Store, plan: dict, dcfg: DecoupledConfig, own: Any) -> None:
    """Every path has its budget: wait while another host's synchroniser still drains an
    inbox (a dead one stops counting after ``lease_s``; at most ``timeout_s`` when set), printing what is left every 30 s."""
    t0 = last = time.time()
    while time.time() - t0 < (dcfg.timeout_s if dcfg.timeout_s is not None else math.inf):
        left = {m: n for m in plan["module_ids"]
                if (n := sum(x.endswith(".st") for x in store.list(inbox(m))))}
        live = set(live_synchronisers(store, dcfg.lease_s)) - set(own)
        if not left or not live:
            return
        if time.time() - last > 30:
            say(f"decoupled: waiting for {len(live)} synchroniser(s) to drain {sum(left.values())} update(s)")
            last = time.time()
        time.sleep(max(dcfg.poll_s, 0.1))


def _rounds_done(store: Store, p: int, inner_steps: int) -> int:
    """Whole rounds' worth of inner steps path ``p`` has done (phases may be shorter)."""
    return path_steps_done(store.get_json(progress_key(p)), inner_steps) // inner_steps


def _account_leftovers(store: Store, module_ids: list[str]) -> None:
    """Inbox files left after every synchroniser stopped (a zombie's late push) → dropped,
    with reason, in the module's next revision."""
    for m in module_ids:
        names = [n for n in store.list(inbox(m)) if n.endswith(".st")]
        if not names:
            continue
        while True:  # the next revision, write-once: a late writer's revision is re-read
            rev, state, meta = read_module(store, m)
            fresh = [n[:-3] for n in names if n[:-3] not in state["applied"] and n[:-3] not in state["dropped"]]
            if not fresh:
                break
            state["dropped"].update({uid: "unprocessed_after_finish" for uid in fresh})
            meta = {**meta, "revision": rev + 1, "writer": "finish", "t": time.time()}
            if publish(store, module_folder(m), rev + 1, encode_state(state, meta)):
                break
        for n in names:
            store.move(f"{inbox(m)}/{n}", f"{archive(m)}/{n}")


def _append_round_metrics(cfg: Config, run: RunDir, store: Store) -> None:
    """One round record per phase index (:func:`dipaco.rounds.round_line.round_record`) and the
    workers' step records (docs/metrics.md), persisted by sync mode's writer (metrics.jsonl,
    steps.jsonl, TensorBoard, W&B), in step order: W&B drops a step below the last one."""
    by_phase: dict[int, dict[str, dict]] = {}
    steps: list[dict] = []
    for e in worker_events(store):
        if e["e"] == "end" and str(e["path"]) not in by_phase.get(int(e["phase"]), {}):
            by_phase.setdefault(int(e["phase"]), {})[str(e["path"])] = \
                {"loss": e["loss"], "tokens": e["tokens"], "seconds": e["seconds"]}
            steps += e.get("step_records", [])
    steps.sort(key=lambda r: (r["step"], r["path"]))
    with writer_for(run, cfg) as writer:  # the job's writer: one W&B run
        for k in sorted(by_phase):
            paths = by_phase[k]
            record = round_record(k + 1, "decoupled", paths, {}, bytes_sent=0,
                                  compute_s=max(v["seconds"] for v in paths.values()))
            at = writer.round_step(record)  # a phase's record after the steps up to its step
            writer.log_steps([r for r in steps if r["step"] <= at])
            steps = [r for r in steps if r["step"] > at]
            writer.log_round(record)
        writer.log_steps(steps)


def write_checkpoint(cfg: Config, run: Any, store: Store, plan: dict, round_idx: Optional[int] = None) -> Path:
    """The final versions as an ordinary checkpoint ``round_<R>``, in sync mode's layout.

    ``outer/<module>`` holds the module's core state (θ_global, outer optimiser state) and
    the error-feedback residuals of its paths as ``residual.<path>``: in decoupled mode
    each path is its own contributor, i.e. a worker group of one path, which
    ``state.json`` records (a sync resume with another grouping drops them).
    """
    grid = build_grid(cfg)
    R = int(plan["rounds"]) if round_idx is None else int(round_idx)  # round_idx: a stopped run's
    ckpts = CheckpointManager(run.checkpoints, keep_last=cfg.trainer.keep_last, stamp=checkpoint_stamp(run))
    part = ckpts.begin(R)
    residuals: dict[str, dict[str, torch.Tensor]] = {m: {} for m in plan["module_ids"]}
    for p in range(plan["num_paths"]):
        got = read_path_state(store, p)
        if got is not None:
            state = dict(got[1])
            for m, res in state.pop(RESIDUALS, {}).items():
                residuals[m][f"residual.{p}"] = res
            save_state(part / "paths" / f"path_{p}.safetensors", state)
    versions = {}
    for m in plan["module_ids"]:
        _, state, _ = read_module(store, m)
        load_flat(list(grid.module(m).parameters()), state["global"])
        core = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        write_module_files(part, grid, m, {**core, **residuals[m]})
        versions[m] = int(state["version"])
    final = ckpts.commit(R, checkpoint_state(R, grid, mode="decoupled", worker_groups=plan["num_paths"],
                                             group_size=1, versions=versions))
    ckpts.prune()
    return final
