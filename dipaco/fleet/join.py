"""Joining a decoupled run from its store: a host of workers, a synchroniser, the finish.

Each verb opens the run with :func:`dipaco.decoupled.owner.open_run` (refusals in one
line, nothing written), takes the run's config and plan from the store, and runs the same
:class:`~dipaco.decoupled.supervisor.Supervisor` as the run's creator, for this host's
share: ``worker`` N decoupled workers (they read the run directory's prepared data:
tokenizer, shards, warm-up), ``sync`` synchronisers (the store only). ``finish`` writes
the final checkpoint into the run directory once every path has its budget.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf

from dipaco.config import Config, to_config
from dipaco.config.decoupled import DecoupledConfig
from dipaco.decoupled.owner import PLAN_KEY, JoinRefused, NoRunYet, open_run
from dipaco.decoupled.run import finish_run, outer_settings
from dipaco.decoupled.service import path_steps_done, progress_key
from dipaco.decoupled.store import Store
from dipaco.decoupled.supervisor import DecoupledError, Supervisor, run_config_dict
from dipaco.run.fingerprint import check_config
from dipaco.run.lock import RunLock, check_unlocked
from dipaco.run.run_dir import RunDir, RunStopped
from dipaco.runtime.launch import StopSignals
from dipaco.runtime.progress import say

__all__ = ["Joined", "join", "check_data", "serve_host", "finish", "unfinished"]

# the artefacts a worker reads from the run directory (checked against the run's config)
_DATA = ("tokenizer", "warmup", "router", "shards")


class Joined:
    """A run opened from its store: record, config, plan, decoupled settings, run directory."""

    def __init__(self, url: str, store: Store, record: dict, run_dir: Optional[str]) -> None:
        self.url, self.store, self.record = url, store, record
        self.cfg: Config = to_config(record["config"])
        self.dcfg = DecoupledConfig(**record["config"]["diloco"]["decoupled"])
        self.plan: dict[str, Any] = store.get_json(PLAN_KEY) or {}
        self.run = RunDir.at(run_dir or record["run_dir"])


def _config_file(path: Optional[str]) -> Optional[dict]:
    """``--config FILE``: a config the role expects the run to have (a run's config.yaml)."""
    if path is None:
        return None
    cfg = to_config(OmegaConf.load(path))
    return run_config_dict(cfg, cfg.diloco.decoupled)


def join(url: str, *, run_dir: Optional[str] = None, config: Optional[str] = None, to_train: bool = True,
         needs_data: bool = False, wait_s: float = 0.0) -> Joined:
    """Open the run in ``url`` for a role; with ``needs_data``, also check that the run
    directory (``run_dir``, default the one the store records) holds data made for the
    run's config. Every refusal is one line (:class:`JoinRefused`); nothing is written.
    ``wait_s``: wait that long for a store that holds no run yet (its creator makes it
    once the data is prepared: roles started together with it, by a scheduler)."""
    cfg_dict = _config_file(config)
    deadline = time.time() + wait_s
    while True:
        try:
            store, record = open_run(url, cfg_dict=cfg_dict, to_train=to_train)
            break
        except NoRunYet:
            if time.time() >= deadline:
                raise
            time.sleep(1.0)
    j = Joined(url, store, record, run_dir)
    if needs_data:
        check_data(j)
    return j


def check_data(j: Joined) -> None:
    """Refuse (:class:`JoinRefused`) a run directory that does not hold data made for the
    run's config (the workers read it; the final checkpoint goes there)."""
    missing = [what for what, p in (("config.yaml", j.run.config), ("tokenizer.json", j.run.tokenizer),
                                    ("shards/", j.run.shards)) if not p.exists()]
    if missing:
        raise JoinRefused(f"{j.run.root} does not hold the run's prepared data ({', '.join(missing)} missing): "
                          "use the run directory as mounted on this host (--run-dir DIR for workers)")
    check_config(j.run, j.cfg, fix="use this run's directory", artefacts=_DATA)


def serve_host(j: Joined, *, workers: int = 0, syncs: int = 0, device: Optional[str] = None) -> Optional[str]:
    """Run this host's share of the run until every path has its budget (None) or a stop
    signal (its name); the run goes on elsewhere either way."""
    role = "worker" if workers else "sync"
    sup = Supervisor(j.cfg, j.run, j.store, j.url, j.plan, j.dcfg, outer_settings(j.cfg, j.dcfg), workers,
                     n_syncs=syncs, role=role, device=device)
    say(f"joined {j.url}: {workers} decoupled worker(s), {sup.nsync} synchroniser(s) on this host "
        f"({sup.host}); {unfinished(j) or 'every path has its budget'}")
    with StopSignals():
        sup.start()
        try:
            stopped = sup.watch()
        except DecoupledError as e:  # this host's share failed (timeout, restarts spent): one line, exit 1
            raise RunStopped(f"{role} host {sup.host}: {e}; the run goes on with the other hosts") from None
    say(f"{role} host {sup.host}: " + (f"stopped by {stopped}" if stopped else
                                       "done: every path has its budget" + (" and every inbox is drained" * bool(syncs))))
    return stopped


def unfinished(j: Joined) -> str:
    """What is left (``path 2: 40/48 steps, ...``), or "" when every path has its budget."""
    R, H = j.plan["rounds"], j.plan["inner_steps"]
    steps = [path_steps_done(j.store.get_json(progress_key(p)), H) for p in range(j.plan["num_paths"])]
    left = [f"path {p}: {s}/{R * H} steps" for p, s in enumerate(steps) if s < R * H]
    return ", ".join(left[:4]) + (f" (+{len(left) - 4} more)" if len(left) > 4 else "")


def finish(j: Joined, *, wait: bool, timeout_s: float) -> Path:
    """The final checkpoint (and metrics) into the run directory once every path has its
    budget; refused when a dipaco-train holds the directory or (without ``wait``) the
    run is not done."""
    check_unlocked(j.run.root)
    t0 = last = time.time()
    while (left := unfinished(j)):
        if not wait:
            raise JoinRefused(f"the run in {j.url} is not done ({left}): start workers, or pass --wait")
        if time.time() - t0 > timeout_s:
            raise JoinRefused(f"the run in {j.url} is still not done after --timeout {timeout_s:g}s ({left})")
        if time.time() - last > 30:
            say(f"waiting for the run: {left}")
            last = time.time()
        time.sleep(1.0)
    with RunLock(j.run.root):
        slots = len(j.store.list("slots"))
        metrics, ckpt, _ = finish_run(j.cfg, j.run, j.store, j.plan, j.dcfg, slots)
    say(f"finished: checkpoint {ckpt}; goodput {metrics['goodput']:.2f}, ledger "
        f"{'ok' if metrics['ledger_ok'] else 'VIOLATED'}; score it with dipaco-infer score {j.run.root} --validation")
    assert ckpt is not None
    return ckpt
