"""Per-module synchronisers: quorum, adaptive grace window, staleness, delayed Nesterov,
and the ledger of applied update ids.

:class:`ModuleSynchronizer` is pure logic on tensors with an injected clock (unit tests
drive it in-process). :class:`SyncService` is the process loop that feeds it from the
store and writes each new module version atomically *together with* its ledger.

Merge rule (one outer step of module m, over the pending updates U):

    g = Σ_{u∈U} α_u·d(s_u)·Δ_u / max(Σ_{u∈U} α_u, A_m)        d(s) = (1 + s)^(−staleness_power)

where α_u is the update's tokens, s_u its staleness in versions of m, and A_m the tokens
one full "round" of m would bring (sharing paths × the mean α seen). With every sharing
path present and fresh this is the sync mode's token-weighted mean; with only part of
them, the step moves only by their share, and the others' updates (arriving later,
started from the same version) add theirs: with lr 1 and no momentum the result equals
the synchronous average. Updates with s > max_staleness are dropped ("stale").

Delayed Nesterov (our reading of Liu et al. 2024, "Asynchronous Local-SGD Training for
Language Modeling", Alg. DN), with β the momentum, N = momentum_every, c = momentum_scale:

    buffer += g;  t += 1
    if t % N == 0:  m = β·m + buffer/N;  θ -= lr·(β·m + g);  buffer = 0      (nesterov)
                                          θ -= lr·m                           (heavy ball)
    else:           θ -= lr·(g + c·β·m)

Momentum sees one averaged pseudo-gradient every N steps instead of each stale one, so
stale updates arriving in bursts do not get amplified by 1/(1−β). N=1 is exactly
torch's SGD(nesterov=True) (``buf = β·buf + g; θ -= lr·(g + β·buf)``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from dipaco.decoupled.config import DecoupledConfig
from dipaco.decoupled.store import decode_state
from dipaco.sync.codecs import make_codec

__all__ = ["Update", "DelayedNesterov", "ModuleSynchronizer", "StepRecord", "DROP_REASONS"]

# Every update that reaches a synchroniser ends in exactly one of: applied, or dropped
# for one of these reasons (metrics count them per reason).
DROP_REASONS = (
    "stale",  # staleness > max_staleness
    "duplicate_phase",  # this path's phase already applied/pending (a re-run after a crash, a zombie)
    "non_finite",  # NaN/inf in the decoded pseudo-gradient
    "bad_shape",  # numel does not match the module
    "corrupt",  # the update file cannot be decoded
    "unprocessed_after_finish",  # found in the inbox after every learner and synchroniser stopped
)


@dataclass
class Update:
    """One path's pseudo-gradient for one module, as the synchroniser sees it."""

    update_id: str
    module_id: str
    path_id: int
    phase: int
    base_version: int
    tokens: float
    delta: torch.Tensor  # decoded, flat fp32: θ_base − θ_path (dipaco.sync.module_sync.pseudo_gradient)
    arrived_at: float = 0.0
    inner_steps: int = 0


@dataclass
class StepRecord:
    """One outer step of one module (written to the event log)."""

    module_id: str
    version: int  # the version this step produced
    time: float
    update_ids: list[str]
    paths: list[int]
    staleness: list[int]
    weights: list[float]  # α·d(s) per update
    norm: float  # ‖g‖
    trigger: str  # "quorum" | "grace" | "flush"
    momentum_applied: bool

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class DelayedNesterov:
    """Outer SGD with delayed momentum on one flat parameter vector (see module doc)."""

    def __init__(self, numel: int, lr: float, momentum: float, nesterov: bool = True,
                 every: int = 1, scale: float = 0.0) -> None:
        if lr <= 0 or momentum < 0 or every < 1 or scale < 0:
            raise ValueError(f"bad delayed-Nesterov settings lr={lr} momentum={momentum} every={every} scale={scale}")
        self.lr, self.beta, self.nesterov = float(lr), float(momentum), bool(nesterov)
        self.every, self.scale = int(every), float(scale)
        self.m = torch.zeros(numel, dtype=torch.float32)
        self.buffer = torch.zeros(numel, dtype=torch.float32)
        self.t = 0

    @torch.no_grad()
    def step(self, theta: torch.Tensor, g: torch.Tensor) -> bool:
        """Update ``theta`` in place with outer gradient ``g``; True if momentum was activated."""
        if self.beta == 0:  # plain SGD (lr 1: averaging); nothing to delay
            theta.add_(g, alpha=-self.lr)
            self.t += 1
            return False
        self.buffer.add_(g)
        self.t += 1
        if self.t % self.every == 0:
            self.m.mul_(self.beta).add_(self.buffer, alpha=1.0 / self.every)
            self.buffer.zero_()
            if self.nesterov:
                theta.add_(g + self.beta * self.m, alpha=-self.lr)
            else:
                theta.add_(self.m, alpha=-self.lr)
            return True
        theta.add_(g + self.scale * self.beta * self.m, alpha=-self.lr)
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"m": self.m.clone(), "buffer": self.buffer.clone(), "t": self.t}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.m.copy_(state["m"])
        self.buffer.copy_(state["buffer"])
        self.t = int(state["t"])


class ModuleSynchronizer:
    """The global weights of one module and the rules for stepping them.

    Args:
        module_id: the module.
        weights: its initial global weights, flat fp32 (copied).
        sharing_paths: the paths that contain the module (its module group).
        cfg: quorum, grace, staleness and delayed-momentum settings.
        outer: ``{"lr", "momentum", "nesterov"}`` (``diloco.outer``).
        now: the clock time at creation (grace windows are measured from it).
    """

    def __init__(self, module_id: str, weights: torch.Tensor, sharing_paths: Sequence[int],
                 cfg: DecoupledConfig, outer: dict[str, Any], now: float = 0.0) -> None:
        self.module_id = module_id
        self.theta = weights.detach().to(torch.float32).reshape(-1).clone()
        self.sharing_paths = sorted(int(p) for p in sharing_paths)
        self.cfg = cfg
        self.quorum = max(1, math.ceil(cfg.quorum * len(self.sharing_paths) - 1e-9))
        self.opt = DelayedNesterov(self.theta.numel(), lr=float(outer.get("lr", 1.0)),
                                   momentum=float(outer.get("momentum", 0.0)),
                                   nesterov=bool(outer.get("nesterov", False)),
                                   every=cfg.momentum_every, scale=cfg.momentum_scale)
        self.version = 0
        # ledger (persisted with every version): id → version it went into / drop reason
        self.applied: dict[str, int] = {}
        self.dropped: dict[str, str] = {}
        self.phases: dict[str, str] = {}  # "path:phase" → update id holding that slot
        self.pending: list[Update] = []
        self.first_pending_at: Optional[float] = None
        self.fill_ema: Optional[float] = None  # seconds from first pending update to quorum
        self.alpha_ema: Optional[float] = None  # tokens per update
        self.last_step_at = now
        self.created_at = now

    # ----------------------------------------------------------------- intake
    def seen(self, update_id: str) -> bool:
        """Whether this id is already applied, dropped or pending (idempotent intake)."""
        return (update_id in self.applied or update_id in self.dropped
                or any(u.update_id == update_id for u in self.pending))

    def _drop(self, u: Update, reason: str) -> str:
        assert reason in DROP_REASONS, reason
        self.dropped[u.update_id] = reason
        return reason

    def offer(self, u: Update, now: float) -> Optional[str]:
        """Take an update; return None (pending), a drop reason, or "seen" (ignored).

        "seen" means the id is already accounted for (a re-read after a crash between
        writing the version and archiving the file): it is NOT applied again.
        """
        if self.seen(u.update_id):
            return "seen"
        if u.delta.numel() != self.theta.numel():
            return self._drop(u, "bad_shape")
        if not bool(torch.isfinite(u.delta).all()):
            return self._drop(u, "non_finite")
        slot = f"{u.path_id}:{u.phase}"
        if slot in self.phases:
            return self._drop(u, "duplicate_phase")
        if self.version - u.base_version > self.cfg.max_staleness:
            return self._drop(u, "stale")
        self.phases[slot] = u.update_id
        u.arrived_at = now
        self.pending.append(u)
        if self.first_pending_at is None:
            self.first_pending_at = now
        a = float(u.tokens)
        self.alpha_ema = a if self.alpha_ema is None else 0.8 * self.alpha_ema + 0.2 * a
        return None

    # --------------------------------------------------------------- triggers
    def pending_paths(self) -> int:
        return len({u.path_id for u in self.pending})

    def grace_s(self) -> float:
        """The current grace window: grace_factor × EMA(fill time), clipped."""
        c = self.cfg
        base = c.grace_init_s if self.fill_ema is None else c.grace_factor * self.fill_ema
        return min(c.grace_max_s, max(c.grace_min_s, base))

    def due(self, now: float, done: Optional[set[int]] = None) -> Optional[str]:
        """Why a step is due now ("quorum" / "grace"), or None.

        ``done``: paths that finished their budget. They send nothing more, so the
        quorum is capped at the number of sharing paths still running (waiting for a
        path that has finished would only ever end by the grace window).
        """
        if not self.pending:
            return None
        quorum = self.quorum
        if done:
            # paths that can still count: those running, and finished ones whose last
            # update is pending (a finished path's last update must not step alone while
            # the others' updates of the same phase are still coming)
            can = {p for p in self.sharing_paths if p not in done} | {u.path_id for u in self.pending}
            quorum = max(1, min(quorum, len(can)))
        if self.pending_paths() >= quorum:
            return "quorum"
        if now - float(self.first_pending_at) >= self.grace_s():
            return "grace"
        return None

    # ------------------------------------------------------------------ step
    def discount(self, staleness: int) -> float:
        return (1.0 + max(0, staleness)) ** (-self.cfg.staleness_power)

    @torch.no_grad()
    def step(self, now: float, trigger: str = "quorum") -> Optional[StepRecord]:
        """Merge the pending updates into one outer step; None if nothing is pending.

        Staleness is re-checked here: an update that was fresh on arrival may have aged
        while it waited (other steps of this module in between) — it is then dropped.
        """
        if not self.pending:
            return None
        if trigger == "quorum" and self.first_pending_at is not None:
            fill = now - self.first_pending_at
            self.fill_ema = fill if self.fill_ema is None else 0.7 * self.fill_ema + 0.3 * fill
        # (a grace expiry leaves the EMA alone: widening it would make every learner that
        # waits for this module wait longer whenever one sharing path is slow)
        keep: list[Update] = []
        for u in self.pending:
            if self.version - u.base_version > self.cfg.max_staleness:
                self._drop(u, "stale")
            else:
                keep.append(u)
        self.pending, self.first_pending_at = [], None
        if not keep:
            return None
        stal = [self.version - u.base_version for u in keep]
        w = [float(u.tokens) * self.discount(s) for u, s in zip(keep, stal)]
        alpha_sum = sum(float(u.tokens) for u in keep)
        full_round = len(self.sharing_paths) * float(self.alpha_ema or 0.0)
        denom = max(alpha_sum, full_round, 1e-12)
        g = torch.zeros_like(self.theta)
        for u, wi in zip(keep, w):
            g.add_(u.delta.to(torch.float32), alpha=wi / denom)
        momentum = self.opt.step(self.theta, g)
        self.version += 1
        for u in keep:
            self.applied[u.update_id] = self.version
        self.last_step_at = now
        return StepRecord(self.module_id, self.version, now, [u.update_id for u in keep],
                          [u.path_id for u in keep], stal, w, float(g.norm()), trigger, momentum)

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue: weights, version, optimiser, ledger, EMAs.

        Pending updates are *not* saved: their files stay in the inbox until the version
        that applies them is written, so a restarted synchroniser re-reads them.
        """
        return {
            "theta": self.theta.clone(),
            "version": self.version,
            "opt": self.opt.state_dict(),
            "applied": dict(self.applied),
            "dropped": dict(self.dropped),
            "phases": {k: v for k, v in self.phases.items()
                       if v in self.applied or v in self.dropped},
            "fill_ema": self.fill_ema,
            "alpha_ema": self.alpha_ema,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.theta.copy_(state["theta"])
        self.version = int(state["version"])
        self.opt.load_state_dict(state["opt"])
        self.applied = {str(k): int(v) for k, v in state["applied"].items()}
        self.dropped = {str(k): str(v) for k, v in state["dropped"].items()}
        self.phases = {str(k): str(v) for k, v in state["phases"].items()}
        self.fill_ema = state.get("fill_ema")
        self.alpha_ema = state.get("alpha_ema")
        self.pending, self.first_pending_at = [], None


# =========================================================================== service


def module_key(module_id: str) -> str:
    """Store key of a module's current version (weights + optimiser + ledger, one blob)."""
    return f"modules/{module_id}.st"


def inbox(module_id: str) -> str:
    return f"updates/{module_id}"


def archive(module_id: str) -> str:
    return f"archive/{module_id}"


def progress_key(path_id: int) -> str:
    return f"paths/path_{path_id}.json"


def path_steps_done(prog: Optional[dict], inner_steps: int) -> int:
    """Inner steps a path has completed, from its progress file (None: not started).

    Files written before dynamic local updates hold only ``phases_done`` (phases of H).
    """
    if prog is None:
        return 0
    return int(prog.get("steps_done", int(prog.get("phases_done", 0)) * inner_steps))


def path_finished(prog: Optional[dict], rounds: int, inner_steps: int) -> bool:
    """Whether a path has its whole budget of ``rounds × inner_steps`` inner steps."""
    return path_steps_done(prog, inner_steps) >= rounds * inner_steps


def write_module(store: Any, sync: ModuleSynchronizer) -> int:
    """Write the module's version, weights, optimiser state and ledger in ONE atomic put.

    This is the idempotence hinge: an update id is in the ledger iff the weights that
    include it are the ones on disk. Return the blob size.
    """
    state = sync.state_dict()
    return store.put_state(module_key(sync.module_id), state,
                           meta={"module_id": sync.module_id, "version": sync.version})


def read_update(blob: bytes) -> Update:
    """Decode an update file pushed by a learner (codec named in its header)."""
    state, meta = decode_state(blob)
    codec = make_codec(meta["codec"], **meta.get("codec_kw", {}))
    delta = codec.decode(tuple(state["payload"]), int(meta["numel"]))
    return Update(update_id=meta["update_id"], module_id=meta["module_id"], path_id=int(meta["path_id"]),
                  phase=int(meta["phase"]), base_version=int(meta["base_version"]),
                  tokens=float(meta["tokens"]), delta=delta, inner_steps=int(meta.get("inner_steps", 0)))


class SyncService:
    """The loop of one synchroniser process: inbox → :class:`ModuleSynchronizer` → store.

    Args:
        store: the shared store.
        module_ids: the modules this process synchronises (each module has exactly one
            synchroniser: two would race on its version file).
        sharing: module id → paths that contain it.
        rounds, inner_steps: a path is done at ``rounds × inner_steps`` inner steps.
        cfg, outer: see :class:`ModuleSynchronizer`.
        name: this process's name in event logs.
    """

    def __init__(self, store: Any, module_ids: Sequence[str], sharing: dict[str, list[int]], rounds: int,
                 cfg: DecoupledConfig, outer: dict[str, Any], name: str = "sync-0",
                 clock: Any = None, *, inner_steps: int) -> None:
        import time as _time

        self.store = store
        self.cfg = cfg
        self.rounds = int(rounds)
        self.inner_steps = int(inner_steps)
        self.name = name
        self.clock = clock or _time.time
        self.sharing = {m: list(sharing[m]) for m in module_ids}
        self.syncs: dict[str, ModuleSynchronizer] = {}
        now = self.clock()
        for m in module_ids:
            got = store.get_state(module_key(m))
            if got is None:
                raise RuntimeError(f"module {m}: no initial version in {store} (the supervisor writes version 0)")
            state, _ = got
            s = ModuleSynchronizer(m, state["theta"], self.sharing[m], cfg, outer, now=now)
            s.load_state_dict(state)
            self.syncs[m] = s
        self._decoded: set[str] = set()  # inbox files already offered (pending or accounted)

    def _event(self, obj: dict) -> None:
        import json

        obj.setdefault("t", self.clock())
        self.store.append_line(f"events/{self.name}.jsonl", json.dumps(obj))

    def paths_done(self) -> set[int]:
        done = set()
        for p in {p for ps in self.sharing.values() for p in ps}:
            prog = self.store.get_json(progress_key(p))
            if path_finished(prog, self.rounds, self.inner_steps):
                done.add(p)
        return done

    def _intake(self, m: str, events: list[dict]) -> bool:
        """Offer every new inbox file of module ``m``; True if the ledger changed."""
        s, changed = self.syncs[m], False
        for name in self.store.list(inbox(m)):
            if not name.endswith(".st") or name in self._decoded:
                continue
            blob = self.store.get(f"{inbox(m)}/{name}")
            if blob is None:  # archived by a previous incarnation between list and get
                continue
            try:
                u = read_update(blob)
            except Exception as e:  # a corrupt blob must not kill the synchroniser
                u = None
                events.append({"e": "drop", "module": m, "id": name[:-3], "reason": "corrupt",
                               "error": str(e)[:200]})
                s.dropped[name[:-3]] = "corrupt"
                changed = True
            self._decoded.add(name)
            if u is None:
                continue
            why = s.offer(u, self.clock())
            if why is None:
                events.append({"e": "arrive", "module": m, "id": u.update_id, "path": u.path_id,
                             "phase": u.phase, "base": u.base_version, "version": s.version})
            elif why != "seen":
                changed = True
                events.append({"e": "drop", "module": m, "id": u.update_id, "reason": why,
                             "path": u.path_id, "phase": u.phase})
        return changed

    def _archive(self, m: str) -> None:
        """Move accounted-for inbox files out (AFTER the version holding them is written)."""
        s = self.syncs[m]
        for name in self.store.list(inbox(m)):
            uid = name[:-3] if name.endswith(".st") else name
            if uid in s.applied or uid in s.dropped:
                if self.cfg.keep_archive:
                    self.store.move(f"{inbox(m)}/{name}", f"{archive(m)}/{name}")
                else:
                    self.store.delete(f"{inbox(m)}/{name}")
                self._decoded.discard(name)

    def poll_once(self, done: Optional[set[int]] = None) -> int:
        """One pass over this process's modules; return the number of outer steps taken."""
        steps = 0
        for m, s in self.syncs.items():
            events: list[dict] = []
            changed = self._intake(m, events)
            now = self.clock()
            trigger = s.due(now, done)
            # every sharing path finished: nothing more can arrive, step at once
            if trigger is None and s.pending and done is not None and set(s.sharing_paths) <= done:
                trigger = "flush"
            if trigger is not None:
                before = set(s.dropped)
                rec = s.step(now, trigger)
                for uid in sorted(set(s.dropped) - before):
                    events.append({"e": "drop", "module": m, "id": uid, "reason": s.dropped[uid]})
                changed = True
                if rec is not None:
                    steps += 1
                    events.append({"e": "step", **rec.to_dict()})
            if changed:
                # Order matters: (1) the version + ledger, in one atomic put; (2) the event
                # log (a crash here loses log lines, never weights: the ledger is the
                # truth); (3) archiving the inbox files the ledger now accounts for (a
                # crash before it leaves files that a restart finds in the ledger, "seen").
                write_module(self.store, s)
            for ev in events:
                self._event(ev)
            if changed:
                self._archive(m)
        return steps

    def run(self) -> None:
        """Serve until every path has finished its budget and every inbox is drained."""
        import time as _time

        while True:
            done = self.paths_done()
            all_done = len(done) == len({p for ps in self.sharing.values() for p in ps})
            # A path is marked done only AFTER its last update files were written, so an
            # intake after seeing "all done" is guaranteed to see every last update.
            self.poll_once(done)
            if all_done:
                self.poll_once(done)  # flush whatever the last intake left pending
                if all(not s.pending for s in self.syncs.values()):
                    break
            # event logs on object stores are buffered chunks: publish this poll's lines
            # (step/drop events) before sleeping, so a crash loses at most one poll's worth
            self.store.flush()
            _time.sleep(self.cfg.poll_s)
        self.store.flush()
        self.store.put_json(f"done/{self.name}.json", {"t": self.clock(),
                                                       "versions": {m: s.version for m, s in self.syncs.items()}})
