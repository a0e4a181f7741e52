"""``run_decoupled(cfg, run)``: the supervisor of decoupled mode on one host.

It writes version 0 of every module to the store, starts the synchroniser process(es)
and N decoupled worker processes (``multiprocessing`` spawn: fork is unsafe after torch/faiss
started OpenMP threads: docs/design.md, "Processes"), watches them with a bounded timeout, restarts dead
ones (and, in chaos runs, kills some on purpose with SIGKILL), then, when every path
has its budget, writes the final module weights as an ordinary checkpoint
(``checkpoints/round_NNNNNN/modules/*.safetensors`` + manifest) so evaluation and
``dipaco-infer`` work unchanged, and returns the same :class:`~dipaco.run.results.RoundsResult`
as the rounds loop of sync mode.

More hosts: run decoupled workers (:func:`dipaco.decoupled.worker.worker_main`) anywhere that
mounts the store; exactly one synchroniser per module must run at a time.
"""
from __future__ import annotations

import dataclasses
import json
import math
import multiprocessing as mp
import os
import random
import signal
import time
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import OmegaConf

from dipaco.runtime import faults
from dipaco.plan.build import build_grid
from dipaco.run.checkpoint import CheckpointManager, save_state
from dipaco.config import Config, ConfigError
from dipaco.config.decoupled import DecoupledConfig, validate_decoupled
from dipaco.decoupled.fsspec_store import open_store
from dipaco.decoupled.lease import Lease
from dipaco.decoupled.owner import PLAN_KEY, claim_store
from dipaco.decoupled.merge import ModuleSynchronizer
from dipaco.decoupled.metrics import compute_metrics, worker_events
from dipaco.decoupled.service import (SyncService, archive, inbox, module_key, path_steps_done, progress_key,
                                      write_module)
from dipaco.decoupled.store import Store
from dipaco.decoupled.worker import RESIDUALS, path_state_key, worker_main
from dipaco.run.fingerprint import checkpoint_stamp
from dipaco.rounds.dense import load_dense_state
from dipaco.runtime.launch import StopSignals
from dipaco.runtime.progress import say
from dipaco.run.run_dir import RunDir
from dipaco.config.schedule import warmup_steps
from dipaco.rounds.checkpointing import write_module_files
from dipaco.sync.module_core import flatten_params, load_flat
from dipaco.sync.outer import outer_options
from dipaco.rounds.round_line import round_record
from dipaco.runtime.tracking import writer_for
from dipaco.run.results import RoundsResult
from modules import init_grid_from_dense

__all__ = ["run_decoupled", "decoupled_config", "DecoupledError", "sync_main"]


class DecoupledError(RuntimeError):
    """The decoupled phase could not finish (timeout, too many restarts)."""


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


def sync_main(store_url: str, module_ids: list[str], sharing: dict[str, list[int]], rounds: int,
              dcfg_dict: dict, outer: dict, name: str, inner_steps: int, sharing_rescale: bool = False) -> None:
    """Entry point of a spawned synchroniser process."""
    torch.set_num_threads(1)
    SyncService(open_store(store_url), module_ids, sharing, rounds, DecoupledConfig(**dcfg_dict), outer,
                name=name, inner_steps=inner_steps, sharing_rescale=sharing_rescale).run()


# ------------------------------------------------------------------------ setup


def init_store(cfg: Config, run: RunDir, store: Store, dcfg: DecoupledConfig) -> dict[str, Any]:
    """Write the plan and version 0 of every module (kept as is when resuming)."""
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
        if store.get(module_key(m)) is None:
            theta = flatten_params(list(grid.module(m).parameters()))
            write_module(store, ModuleSynchronizer(m, theta, sharing[m], dcfg, outer))
    return plan


# ------------------------------------------------------------------- processes


class _Slot:
    """One decoupled worker slot: its current process and how often it was started."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.incarnation = -1
        self.proc: Optional[mp.process.BaseProcess] = None
        self.finished = False


def run_decoupled(cfg: Config, run: RunDir, dcfg: Optional[DecoupledConfig] = None) -> RoundsResult:
    """Train every path for ``trainer.rounds`` phases of H steps, asynchronously.

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
    for key in dcfg.deprecated_keys():
        say(f"{key} is deprecated: the decoupled process is a decoupled worker")
    cfg_dict = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    dcfg_dict = dataclasses.asdict(dcfg)
    outer = outer_settings(cfg, dcfg)
    ctx = mp.get_context("spawn")

    def sup_event(obj: dict) -> None:
        obj.setdefault("t", time.time())
        store.append_line("events/supervisor.jsonl", json.dumps(obj))
        store.flush()  # rare events; on object stores, publish each at once

    # modules dealt round-robin to synchroniser processes: exactly one owner per module
    nsync = min(dcfg.sync_procs, len(plan["module_ids"]))
    sync_mods = [plan["module_ids"][i::nsync] for i in range(nsync)]

    def start_sync(i: int) -> mp.process.BaseProcess:
        store.delete(f"done/sync-{i}.json")
        proc = ctx.Process(target=sync_main, name=f"dipaco-sync-{i}",
                           args=(store_url, sync_mods[i], {m: plan["sharing"][m] for m in sync_mods[i]},
                                 R, dcfg_dict, outer, f"sync-{i}", H, cfg.diloco.sharing_rescale))
        proc.start()
        return proc

    def start_worker(slot: _Slot) -> None:
        slot.incarnation += 1
        slot.proc = ctx.Process(target=worker_main, name=f"dipaco-worker-{slot.index}",
                                args=(cfg_dict, str(run.root), store_url, slot.index, slot.incarnation, dcfg_dict))
        slot.proc.start()
        sup_event({"e": "start", "slot": slot.index, "incarnation": slot.incarnation, "pid": slot.proc.pid})

    say(f"decoupled: {n_workers} workers, {nsync} synchroniser(s), {P} paths x {R} phases of "
        f"{cfg.diloco.inner_steps} steps; store {store_url}")
    t0 = time.time()
    syncs = [start_sync(i) for i in range(nsync)]
    slots = [_Slot(i) for i in range(n_workers)]
    for s in slots:
        start_worker(s)
    chaos = faults.worker_chaos()  # DIPACO_FAULT worker_kill (none in real runs)
    rng = random.Random(chaos.seed)
    kills = restarts = 0
    # the chaos clock starts once training does (the first path progress file): kills
    # during interpreter start-up would test nothing but process spawning
    next_kill = math.inf
    chaos_armed = not chaos.kill_every_s or chaos.max_kills <= 0
    deadline = t0 + dcfg.timeout_s
    started = False
    stopped = None
    try:
        while True:
            now = time.time()
            if StopSignals.received:  # the one stop contract: end now, keep the last complete phase
                stopped = StopSignals.received
                sup_event({"e": "stop", "signal": stopped})
                break
            if now > deadline:
                raise DecoupledError(f"decoupled phase exceeded diloco.decoupled.timeout_s={dcfg.timeout_s}s")
            if not started and len(store.list("control")) >= n_workers:
                store.put_json("control/start", {"t": now})  # every first worker is built: go
                started = True
            if not chaos_armed and store.list("paths"):
                chaos_armed = True
                next_kill = now + chaos.kill_every_s * rng.uniform(0.5, 1.5)
            # chaos: SIGKILL a random live worker (no clean-up runs in it: the point)
            if now >= next_kill and kills < chaos.max_kills:
                alive = [s for s in slots if s.proc is not None and s.proc.is_alive() and not s.finished]
                # prefer a worker in the middle of a phase (holding a path lease): killing
                # one that is starting up or idle tests little
                holders = {Lease.holder(store, f"path_{p}") for p in range(P)}
                busy = [s for s in alive if any(h and h.startswith(f"L{s.index}.{s.incarnation}-") for h in holders)]
                if alive:
                    victim = rng.choice(busy or alive)
                    os.kill(victim.proc.pid, signal.SIGKILL)
                    kills += 1
                    sup_event({"e": "kill", "slot": victim.index, "incarnation": victim.incarnation,
                               "pid": victim.proc.pid})
                next_kill = now + chaos.kill_every_s * rng.uniform(0.5, 1.5)
            for s in slots:
                if s.finished or s.proc is None or s.proc.is_alive():
                    continue
                code = s.proc.exitcode
                s.proc.join()
                if code == 0:
                    s.finished = True
                    continue
                sup_event({"e": "died", "slot": s.index, "incarnation": s.incarnation, "exitcode": code})
                if not dcfg.restart_dead or restarts >= dcfg.max_restarts:
                    s.proc = None  # slot abandoned; the others take its paths after the lease expires
                    continue
                restarts += 1
                start_worker(s)
            for i, proc in enumerate(syncs):
                if not proc.is_alive() and proc.exitcode != 0:
                    sup_event({"e": "sync_died", "index": i, "exitcode": proc.exitcode})
                    if restarts >= dcfg.max_restarts:
                        raise DecoupledError(f"synchroniser {i} died with exit code {proc.exitcode}")
                    restarts += 1
                    syncs[i] = start_sync(i)
            workers_done = all(s.finished or s.proc is None for s in slots)
            if workers_done and not any(s.finished for s in slots):
                raise DecoupledError("every decoupled worker slot was abandoned after repeated failures")
            if workers_done and all(not p.is_alive() and p.exitcode == 0 for p in syncs):
                break
            time.sleep(0.05)
    finally:
        for proc in [s.proc for s in slots if s.proc is not None] + syncs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=10)
    train_s = time.time() - t0
    _account_leftovers(store, plan["module_ids"])
    metrics = compute_metrics(store, plan["module_ids"], n_workers)
    metrics.update({"kills": kills, "restarts": restarts, "supervisor_s": train_s})
    (run.root / "decoupled_metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    _append_round_metrics(cfg, run, store)
    done_rounds = min(_rounds_done(store, p, H) for p in range(P))
    # stopped: the store keeps every finished phase (a resume continues from it); the
    # checkpoint is that of the last phase every path finished, not the run's last round
    ckpt = write_checkpoint(cfg, run, store, plan, done_rounds if stopped else None) \
        if not stopped or done_rounds > 0 else None
    say(f"decoupled: done in {train_s:.1f}s, goodput {metrics['goodput']:.2f}, "
         f"versions {metrics['module_versions']}, dropped {metrics['dropped'] or 'none'}, "
         f"ledger {'ok' if metrics['ledger_ok'] else 'VIOLATED'}")
    lev = worker_events(store)
    per_worker: dict[str, float] = {}
    for e in lev:
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
    )


def _rounds_done(store: Store, p: int, inner_steps: int) -> int:
    """Whole rounds' worth of inner steps path ``p`` has done (phases may be shorter)."""
    return path_steps_done(store.get_json(progress_key(p)), inner_steps) // inner_steps


def _account_leftovers(store: Store, module_ids: list[str]) -> None:
    """Inbox files left after everyone stopped (a zombie's late push) → dropped, with reason.

    Runs only when no synchroniser is alive, so it may write the module files itself.
    """
    for m in module_ids:
        names = [n for n in store.list(inbox(m)) if n.endswith(".st")]
        if not names:
            continue
        state, meta = store.get_state(module_key(m))
        changed = False
        for n in names:
            uid = n[:-3]
            if uid not in state["applied"] and uid not in state["dropped"]:
                state["dropped"][uid] = "unprocessed_after_finish"
                changed = True
        if changed:
            store.put_state(module_key(m), state, meta=meta)
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
        got = store.get_state(path_state_key(p))
        if got is not None:
            state = dict(got[0])
            for m, res in state.pop(RESIDUALS, {}).items():
                residuals[m][f"residual.{p}"] = res
            save_state(part / "paths" / f"path_{p}.safetensors", state)
    versions = {}
    for m in plan["module_ids"]:
        state, meta = store.get_state(module_key(m))
        load_flat(list(grid.module(m).parameters()), state["global"])
        core = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        write_module_files(part, grid, m, {**core, **residuals[m]})
        versions[m] = int(state["version"])
    final = ckpts.commit(R, {"round": R, "num_paths": plan["num_paths"], "module_ids": plan["module_ids"],
                             "levels": plan["levels"], "mode": "decoupled", "versions": versions,
                             "worker_groups": plan["num_paths"], "group_size": 1})
    ckpts.prune()
    return final
