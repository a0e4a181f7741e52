"""The decoupled worker process loop: lease a path, pull its modules, train H steps, push, repeat.

A decoupled worker is not bound to a path: each turn it leases a free unfinished path
(:mod:`dipaco.decoupled.scheduling`), and a dead worker's path is taken by another once
its lease expires. The path's inner state (AdamW moments, step count, data position,
phases and steps done, error-feedback residuals) travels through the store with the
path. A path's budget is ``trainer.rounds × H`` inner steps; a phase has H of them, or
fewer when a markedly slow worker runs it (dynamic local updates).

One phase of path p:

1. acquire the lease of p (``leases/path_p``), load the newest revision of ``paths/path_p/``
   (if any; write-once revisions, one per phase: :mod:`dipaco.decoupled.versions`);
2. pull the latest version of each of p's modules (optionally waiting up to
   ``pull_wait_s`` for the versions to include p's previous update);
3. H inner steps, or ``H × (others' time per step ÷ mine)`` for a slow worker
   (heartbeat: renew the lease every ``heartbeat_s``; a lost lease aborts the phase and
   its work is discarded, counted as wasted steps);
4. push, per module, ``Δ = θ_pulled − θ_path`` encoded with ``diloco.codec``, tagged with
   the version it started from, its α (``diloco.alpha``), path and phase, under a unique id;
5. save the path state as revision ``phases_done + 1``, then the progress file; release.
   A worker that lost its lease meanwhile (paused past it) finds the lease taken, or that
   revision written by the path's new holder: it writes neither; its phase is wasted.

Crash windows: killed in 3 → the phase is redone by whoever takes p next (from the same
data position, so with the same batches). Killed between 4 and 5 → the phase is redone
and pushed again under a new id; synchronisers keep the first and drop the re-run as
``duplicate_phase`` (a killed-mid-push update may thus land for some of p's modules from
the first attempt and for the others from the second; both are the same phase of p).
"""
from __future__ import annotations

import json
import os
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional

import torch

from dipaco.runtime import faults
from dipaco.plan.build import build_grid
from dipaco.config import Config, codec_kwargs
from dipaco.data import Tokenizer, TokenStream
from dipaco.config.decoupled import DecoupledConfig
from dipaco.decoupled.lease import Lease, LeaseLost
from dipaco.decoupled.module_leases import read_module
from dipaco.decoupled.scheduling import PathPicker, WorkerScheduling
from dipaco.decoupled.service import (inbox, path_folder, path_steps_done, progress_key, read_path_state,
                                      wait_out_outage)
from dipaco.decoupled.store import Store, encode_state
from dipaco.decoupled.versions import prune, publish
from dipaco.runtime.progress import say
from dipaco.rounds.dense import load_dense_state
from dipaco.rounds.health import interval_records
from dipaco.rounds.learner import InnerStats, PathLearner, make_inner_optimizer
from dipaco.run.run_dir import RunDir
from dipaco.config.schedule import total_inner_steps, warmup_steps
from dipaco.sync.alpha import PathAlpha
from dipaco.plan.codecs import Codec, make_codec
from dipaco.sync.module_core import (contribution, encode_with_feedback, flatten_params, load_flat, pseudo_gradient,
                                     wire_codec)
from modules import PathModel, init_grid_from_dense

__all__ = ["DecoupledWorker", "encode_contribution", "RESIDUALS"]

# the path state's error-feedback residuals: {module: residual of this path's contribution}
RESIDUALS = "error_feedback"


def encode_contribution(delta: torch.Tensor, tokens: float, codec: Codec,
                        residual: Optional[torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], Optional[torch.Tensor]]:
    """The contribution α·Δ of one path to one module, accumulated and encoded (with the
    path's error-feedback ``residual``, or None) exactly as a sync worker group of one
    path encodes it: ``(payload, new residual)``."""
    return encode_with_feedback(contribution(delta, tokens), codec, residual, feedback=residual is not None)


@dataclass
class _Phase:
    """One phase of a leased path, as its steps hand it on (:meth:`DecoupledWorker.run_phase`)."""
    path: int
    learner: PathLearner
    index: int = 0  # phases of the path done before this one
    steps_done: int = 0  # inner steps of the path done before this one
    last_ids: dict[str, str] = field(default_factory=dict)  # the path's previous update per module
    residuals: dict[str, torch.Tensor] = field(default_factory=dict)  # error feedback, per module
    steps: int = 0  # this phase's inner steps
    delay_at: int = -1  # chaos: the inner step after which the phase stalls (-1: none)
    delay: float = 0.0
    stalled: float = 0.0  # seconds stalled by chaos (not the worker's speed)
    pulled: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)  # version, weights
    seconds: float = 0.0
    ids: dict[str, str] = field(default_factory=dict)  # the update pushed per module
    nbytes: int = 0


class DecoupledWorker(WorkerScheduling):
    """One decoupled worker process's state (the grid copy, a path learner per path, the store).

    Args:
        cfg: the run's config.
        run: the run directory (tokenizer, shards, warm-up).
        store: the shared store.
        index: this worker's slot (0..N-1); ``slow_workers`` refer to it.
        incarnation: how many times this slot was (re)started; part of the worker id.
        dcfg: decoupled settings.
        device: where it trains (None: ``trainer.device``'s placement of this process).
        wait_start: wait for the run's start line (``control/start``) before the first
            phase: the run creator's first workers, so that they begin together.
    """

    def __init__(self, cfg: Config, run: RunDir, store: Store, index: int, incarnation: int,
                 dcfg: DecoupledConfig, device: Optional[torch.device] = None, wait_start: bool = True) -> None:
        self.cfg, self.dcfg, self.store = cfg, dcfg, store
        self.run = run
        self.index, self.incarnation = index, incarnation
        self.wait_start = wait_start
        self.id = f"W{index}.{incarnation}-{uuid.uuid4().hex[:6]}"
        self.grid = build_grid(cfg, device)
        self.n_warm = warmup_steps(cfg)
        if self.n_warm > 0:
            init_grid_from_dense(self.grid, load_dense_state(self.run.warmup))
        self.total_steps = total_inner_steps(cfg)
        # per module, as in sync mode: a module of one path sends exact, error feedback
        # only where a lossy codec crosses paths
        self.codec_kw = codec_kwargs(cfg.diloco)
        lossy = make_codec(cfg.diloco.codec, **self.codec_kw)
        wire = {m: wire_codec(lossy, cfg.diloco.error_feedback, len(self.grid.paths_of_module(m)) > 1)
                for m in self.grid.module_ids}
        self.codecs = {m: c for m, (c, _) in wire.items()}
        self.feedback = {m: f for m, (_, f) in wire.items()}
        self.learners: dict[int, PathLearner] = {}
        self.current: Optional[tuple[Lease, int, int]] = None  # the phase in flight: lease, path, phase
        # meta "tokens" is the α the merge weighs by; "trained_tokens" what the phase trained
        self.alpha = PathAlpha.from_config(cfg.diloco.alpha, self.run.shards)
        self.chaos = faults.worker_chaos()  # DIPACO_FAULT worker_delay (none in real runs)
        self.rng = random.Random(self.chaos.seed * 1000 + index * 17 + incarnation)
        self.slow_factor = float(dcfg.slow_factor) if index in dcfg.slow else 1.0
        self.eos = Tokenizer.load(self.run.tokenizer).eos_id
        # Build every path's learner (shard, stream, model view) BEFORE taking any lease:
        # loading shards can take seconds on a busy host, and a lease held through slow
        # set-up without heartbeats expires and gets taken over.
        for p in range(self.grid.num_paths):
            self._path_learner(p)
        self.sps: Optional[float] = None  # own seconds per inner step (EMA)
        H = cfg.diloco.inner_steps
        self.picker = PathPicker(dcfg, H, cfg.trainer.rounds * H)

    def event(self, obj: dict) -> None:
        obj.setdefault("t", time.time())
        obj.setdefault("worker", self.id)
        self.store.append_line(f"events/worker-{self.id}.jsonl", json.dumps(obj))

    # ------------------------------------------------------------------- paths
    def _path_learner(self, p: int) -> PathLearner:
        if p not in self.learners:
            t = self.cfg.trainer
            # memory-mapped: batches are read from the shard's token file by offset
            stream = TokenStream.from_shard(self.run.shards, p, seq_len=t.seq_len, batch_size=t.batch_size,
                                            seed=self.cfg.seed, eos_id=self.eos)
            self.learners[p] = PathLearner(p, PathModel(self.grid, p), stream, t, self.total_steps,
                                           step_offset=self.n_warm, log_every=self.cfg.logging.every_steps)
        return self.learners[p]

    def _progress(self, p: int) -> int:  # inner steps path ``p`` has completed (its progress file)
        return path_steps_done(self.store.get_json(progress_key(p)), self.cfg.diloco.inner_steps)

    # ---------------------------------------------------------------- scheduling
    def _pull(self, p: int, wait_for: dict[str, str], lease: Lease,
              max_wait_s: float) -> dict[str, tuple[int, torch.Tensor]]:
        """Latest version of each of p's modules: ``{module: (version, flat weights)}``.

        With ``max_wait_s > 0``, wait (polling, heartbeating) up to that long until each
        module's ledger accounts for p's previous update (applied or dropped), so that
        the phase starts from weights that include the path's own last contribution.
        """
        deadline = time.time() + max_wait_s
        while True:
            out, fresh = {}, True
            for m in self.grid.module_ids_of_path(p):
                got = read_module(self.store, m)
                if got is None:
                    raise RuntimeError(f"module {m} has no version in the store")
                _, state, meta = got
                out[m] = (int(meta["version"]), state["global"])
                if m in wait_for and wait_for[m] not in state["applied"] and wait_for[m] not in state["dropped"]:
                    fresh = False
            if fresh or time.time() >= deadline:
                return out
            time.sleep(self.dcfg.poll_s)
            lease.renew()

    def run_phase(self, lease: Lease) -> bool:
        """Train one phase of the leased path: open → pull → train → push → commit, on the
        same per-module core as the synchronous round; True if its update was pushed."""
        ph = self._open(lease)
        if ph is None:
            return False
        self._pull_phase(ph, lease)
        stats = self._train(ph, lease)
        if stats is None:
            return False
        self._push(ph, stats, lease)
        if not self._commit(ph, stats, lease):
            return False
        lease.release()
        self.picker.held(ph.path)
        self._publish_speed(ph.seconds - ph.stalled, stats.steps)
        return True

    def _open(self, lease: Lease) -> Optional[_Phase]:
        """The leased path's state (inner optimiser, data position, residuals) and its phase
        length; None (lease released) when the path has trained its budget."""
        p = int(lease.name.split("_")[1])
        H = self.cfg.diloco.inner_steps
        budget = self.cfg.trainer.rounds * H
        pl = self._path_learner(p)
        got = read_path_state(self.store, p)
        ph = _Phase(p, pl)
        if got is not None:
            _, state, meta = got
            ph.index = int(meta["phases_done"])
            ph.steps_done = path_steps_done(meta, H)
            if self._progress(p) < ph.steps_done:  # a zombie's late progress write: the state is the truth
                self.store.put_json(progress_key(p), {"phases_done": ph.index, "steps_done": ph.steps_done,
                                                      "worker": self.id})
            ph.last_ids = {str(k): str(v) for k, v in meta.get("last_ids", {}).items()}
            ph.residuals = dict(state.pop(RESIDUALS, {}))
            pl.load_state_dict(state)
        else:  # first phase of p anywhere: fresh inner optimiser, data from batch 0
            pl.optimizer = make_inner_optimizer(pl.model, self.cfg.trainer)
            pl.step = 0
            pl.stream.load_state_dict({"step": 0})
        self.current = (lease, p, ph.index)
        if ph.steps_done >= budget:
            lease.release()
            return None
        ph.steps = self.phase_steps(budget - ph.steps_done)
        # fault injection: this phase stalls for U(0, s) after a random inner step
        if self.chaos.delay_prob > 0 and self.rng.random() < self.chaos.delay_prob:
            ph.delay_at, ph.delay = self.rng.randrange(1, ph.steps + 1), self.rng.uniform(0, self.chaos.delay_s)
        lease.renew()  # set-up above may have taken a while
        return ph

    def _pull_phase(self, ph: _Phase, lease: Lease) -> None:
        """Pull: the latest version of each of the path's modules into the live ones."""
        max_wait = self.pull_wait_s(ph.steps)
        ph.pulled = self._pull(ph.path, ph.last_ids if max_wait > 0 else {}, lease, max_wait)
        for m, (version, flat) in ph.pulled.items():
            load_flat(list(self.grid.module(m).parameters()), flat)
        self.event({"e": "begin", "path": ph.path, "phase": ph.index, "steps": ph.steps,
                    "versions": {m: v for m, (v, _) in ph.pulled.items()}})

    def _train(self, ph: _Phase, lease: Lease) -> Optional[InnerStats]:
        """Train: the phase's inner steps, heartbeating; None if the lease was lost."""
        p, phase, pl = ph.path, ph.index, ph.learner
        t0 = time.time()
        last_beat, last_end = [t0], [t0]
        done_steps, stop_at = [0], [ph.steps]

        def on_step() -> None:
            done_steps[0] += 1
            if self.slow_factor > 1.0:  # benchmark: an artificially slow worker (slow_factor× per step)
                time.sleep((self.slow_factor - 1.0) * (time.time() - last_end[0]))
            if done_steps[0] == ph.delay_at:
                self.event({"e": "chaos_delay", "path": p, "phase": phase, "s": ph.delay})
                self._sleep_alive(lease, ph.delay)
                ph.stalled += ph.delay  # chaos delays: not the worker's speed
            last_end[0] = time.time()
            # one line per step: a killed phase's wasted steps are known exactly
            self.event({"e": "progress", "path": p, "phase": phase, "steps": done_steps[0]})
            if time.time() - last_beat[0] >= self.dcfg.heartbeat_s:
                lease.renew()  # raises LeaseLost → the phase is abandoned
                last_beat[0] = time.time()
                if self.dcfg.dynamic_steps:
                    # Speed is measured during the phase too, so a slow worker finds out
                    # in its FIRST phase (not after it) and ends it early: otherwise the
                    # path it holds falls a whole slow phase behind at the start.
                    self._publish_speed(time.time() - t0 - ph.stalled, done_steps[0])
                    stop_at[0] = max(done_steps[0], min(stop_at[0], self.phase_steps(ph.steps)))

        pl.take_intervals()  # an abandoned phase's intervals are not this phase's
        try:
            stats = pl.train_steps(ph.steps, on_step=on_step, should_stop=lambda: done_steps[0] >= stop_at[0])
            lease.check()  # narrow (not close) the window for a zombie push
        except LeaseLost as e:
            self.event({"e": "abort", "path": p, "phase": phase, "steps": done_steps[0], "why": str(e)})
            return None
        ph.seconds = time.time() - t0
        return stats

    def _push(self, ph: _Phase, stats: InnerStats, lease: Lease) -> None:
        """Push: each module's α·Δ against the version it pulled, encoded with the path's
        error-feedback residual, into the module's inbox (written once, never replaced)."""
        p, phase = ph.path, ph.index
        # flushed at once: killed before "end", its useful steps are known (buffered "progress" lines die with it)
        self.event({"e": "push", "path": p, "phase": phase, "steps": stats.steps})
        for m in self.grid.module_ids_of_path(p):
            lease.beat(self.dcfg.heartbeat_s)  # a slow store must not let the lease lapse mid-push
            base = ph.pulled[m][1]
            delta = pseudo_gradient(base, flatten_params(list(self.grid.module(m).parameters())))
            codec = self.codecs[m]
            res = ph.residuals.get(m, torch.zeros_like(delta)) if self.feedback[m] else None
            payload, res = encode_contribution(delta, self.alpha(p, stats.tokens), codec, res)
            if res is not None:
                ph.residuals[m] = res
            uid = f"{m}.p{p}.ph{phase}.{self.id}"
            meta = {"update_id": uid, "module_id": m, "path_id": p, "phase": phase,
                    "base_version": ph.pulled[m][0], "tokens": self.alpha(p, stats.tokens),
                    "trained_tokens": stats.tokens, "codec": codec.name,
                    "codec_kw": self.codec_kw if codec.lossy else {}, "numel": delta.numel(), "weighted": True,
                    "worker": self.id, "inner_steps": stats.steps, "created_at": time.time(),
                    "phase_s": ph.seconds}  # the synchronisers' grace window scales with it
            # put_new: an id is written once; a file name is never reused for other content
            self.store.put_new(f"{inbox(m)}/{uid}.st", encode_state({"payload": list(payload)}, meta))
            ph.ids[m] = uid
            ph.nbytes += codec.payload_nbytes(payload)

    def _commit(self, ph: _Phase, stats: InnerStats, lease: Lease) -> bool:
        """Commit: the path's state and progress, AFTER the pushes: "phases_done = k+1"
        implies the updates of phase k exist (the synchronisers' end-of-run drain relies
        on this order). False (nothing written, the phase wasted) when the lease was lost
        or the path's next revision exists (its new holder committed this phase first)."""
        p, phase, pl = ph.path, ph.index, ph.learner
        ph.steps_done += stats.steps + stats.skipped  # skipped (non-finite) steps consumed data too
        # the residuals travel with the path (in the same write-once put as its inner state)
        blob = encode_state({**pl.state_dict(), RESIDUALS: ph.residuals},
                            {"phases_done": phase + 1, "steps_done": ph.steps_done, "last_ids": ph.ids,
                             "base_versions": {m: v for m, (v, _) in ph.pulled.items()}, "worker": self.id})
        try:
            lease.check()
            if not publish(self.store, path_folder(p), phase + 1, blob):
                raise LeaseLost(f"path {p} phase {phase} was committed by another worker")
        except LeaseLost as e:
            self.event({"e": "abort", "path": p, "phase": phase, "steps": stats.steps, "why": str(e)})
            return False
        prune(self.store, path_folder(p), phase + 1)
        self.store.put_json(progress_key(p), {"phases_done": phase + 1, "steps_done": ph.steps_done,
                                              "worker": self.id})
        self.event({"e": "end", "path": p, "phase": phase, "steps": stats.steps, "seconds": ph.seconds,
                    "tokens": stats.tokens, "loss": stats.loss, "ids": ph.ids, "bytes": ph.nbytes,
                    # per-step health metrics (logging.every_steps), persisted by the job at the end
                    "step_records": interval_records(self.cfg, self.grid, pl.device, phase + 1, p,
                                                     pl.take_intervals())})
        return True

    def _sleep_alive(self, lease: Lease, seconds: float) -> None:
        end = time.time() + seconds
        while time.time() < end:
            time.sleep(min(self.dcfg.heartbeat_s, max(0.0, end - time.time())))
            lease.renew()

    def serve(self) -> None:
        """Phases until every path has its budget; idle-poll while all free paths are taken.
        A failing store costs the phase in flight: back off (doubling, up to half a lease), go on."""
        self.event({"e": "hello", "index": self.index, "incarnation": self.incarnation, "pid": os.getpid()})
        self.store.put_json(f"control/ready_{self.index}", {"worker": self.id})
        if self.incarnation == 0 and self.wait_start:
            # start line: the first workers begin together once all are built (process
            # start-up takes seconds and varies); a restarted worker never waits here
            deadline = time.time() + 120.0
            while self.store.get("control/start") is None and time.time() < deadline:
                time.sleep(self.dcfg.poll_s)
        backoff = 0.0
        while True:
            try:
                lease, finished = self.pick()
                if backoff:
                    say(f"worker {self.id}: the store answers again")
                backoff = 0.0
                if finished:
                    break
                if lease is None:
                    time.sleep(self.dcfg.poll_s)
                    continue
                try:
                    self.run_phase(lease)
                except LeaseLost as e:  # lost outside the inner steps (pull wait, push): the phase is wasted
                    path, phase = self.current[1:] if self.current else (None, None)
                    self.event({"e": "abort", "path": path, "phase": phase, "why": str(e)})
                self.current = None
            except OSError as e:
                backoff = self._outage(e, backoff)
        self.event({"e": "bye"})

    def _outage(self, e: OSError, backoff: float) -> float:
        """Wait out a failing store; then give back the lease of the phase it cost."""
        backoff = wait_out_outage(f"worker {self.id}", e, backoff, self.dcfg)
        if self.current is not None:
            lease, path, phase = self.current
            try:
                self.event({"e": "abort", "path": path, "phase": phase, "why": "store error"})
                lease.release()
                self.current = None
            except (OSError, LeaseLost):
                pass  # still down: the next round of the loop retries (or the lease expires)
        return backoff
