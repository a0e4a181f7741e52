"""The merge rule of decoupled mode: one module's quorum, grace window, staleness and
outer step, on top of the per-module core both modes share
(:class:`dipaco.sync.module_core.ModuleCore`).

:class:`MergingModuleSync` is pure logic on tensors with an injected clock (unit tests
drive it in-process); :class:`dipaco.decoupled.service.SyncService` feeds it from the store.

An update carries its contribution c_u = α_u·Δ_u (α_u the path's tokens this phase, times
its relative shard size with ``diloco.alpha=shard_size``; Δ_u = θ_base − θ_path; encoded
as a sync worker group encodes its contribution). One outer step over the pending updates U:

    g = Σ_{u∈U} d(r_u)·c_u / (n_u·D)   d(r) = (1 + r)^(−staleness_power)
    D = Σ_{u∈U} α_u / n_u                        if every sharing path is in U
        max(Σ_{u∈U} α_u / n_u, n_sharing·EMA(α)) otherwise (a partial step)
    g ← g·√n_sharing                             with diloco.sharing_rescale

where r_u is how late the update is in rounds (:func:`dipaco.decoupled.quorum.rounds_late`:
the share of a round applied since its base version, beyond the rest of its own round;
each step applies ``Σα/n / D`` of a round), and n_u the number of pending *alternatives* of u (updates of u's path with the same anchor,
:mod:`dipaco.decoupled.alternatives`). A decoupled worker starts each phase from the
pulled θ_global, which cannot contain the path's own still-pending update, so such
phases are two displacements from about the same point, not increments (summing them
moved the module n times as far). A path's alternatives therefore weigh as one
contributor with their mean; one that lands after its siblings were applied adds only
the difference between the mean of all of them and what was applied, so the module
ends where applying them together would have put it, whatever the timing. Updates are
summed in (path, phase) order, the order the synchronous exchange sums worker groups in,
so with every sharing path present and fresh the step is synchronous mode's, bit for
bit, whatever the arrival order. A partial step (quorum < 1) moves only by its share of
a full round: the others' updates, arriving later from the same version, add theirs
(with lr 1 and no momentum the result equals the synchronous average when α is as
expected). Updates more than max_staleness versions behind are dropped ("stale").

The outer optimiser is any of ``diloco.outer`` (:func:`dipaco.sync.outer.outer_options`):
SGD with momentum becomes :class:`dipaco.sync.outer.DelayedNesterov` when
``momentum_every > 1``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from dipaco.decoupled.alternatives import Alternatives, MergeGroups
from dipaco.decoupled import quorum as rules
from dipaco.config.decoupled import DecoupledConfig
from dipaco.sync.module_core import RESIDUAL, ModuleCore, contribution

__all__ = ["Update", "MergingModuleSync", "StepRecord", "DROP_REASONS"]

# Every update that reaches a synchroniser ends in exactly one of: applied, or dropped
# for one of these reasons (metrics count them per reason).
DROP_REASONS = (
    "stale",  # staleness > max_staleness
    "duplicate_phase",  # this path's phase already applied/pending (a re-run after a crash, a zombie)
    "non_finite",  # NaN/inf in the decoded pseudo-gradient
    "bad_shape",  # numel does not match the module
    "corrupt",  # the update file cannot be decoded
    "unprocessed_after_finish",  # found in the inbox after every decoupled worker and synchroniser stopped
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
    # flat fp32: Δ = θ_base − θ_path (dipaco.sync.module_core.pseudo_gradient), or, with
    # ``weighted``, the decoded contribution α·Δ as a worker pushes it
    delta: torch.Tensor
    arrived_at: float = 0.0
    inner_steps: int = 0
    weighted: bool = False
    phase_s: Optional[float] = None  # the phase's seconds on its worker (the grace window's scale)

    def contribution(self) -> torch.Tensor:
        """α·Δ (computed like a sync worker group's accumulator when not ``weighted``)."""
        if self.weighted:
            return self.delta.to(torch.float32)
        return contribution(self.delta, self.tokens)


@dataclass
class StepRecord:
    """One outer step of one module (written to the event log)."""

    module_id: str
    version: int  # the version this step produced
    time: float
    update_ids: list[str]
    paths: list[int]
    staleness: list[int]  # versions behind
    weights: list[float]  # α·d(r)/n per update (r: rounds late, n: pending updates of its path)
    norm: float  # ‖g‖
    trigger: str  # "quorum" | "grace" | "flush"
    momentum_applied: bool
    # late alternatives only: the previous step was taken again with them (see _amend)
    amended: bool = False
    rounds_late: list[float] = field(default_factory=list)  # r per update

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class MergingModuleSync:
    """The global weights of one module and the rules for stepping them.

    Args:
        module_id: the module.
        weights: its initial global weights, flat fp32 (copied).
        sharing_paths: the paths that contain the module (its module group).
        cfg: quorum, grace and staleness settings.
        outer: keyword arguments of :func:`dipaco.sync.outer.make_outer_optimizer`
            (:func:`dipaco.sync.outer.outer_options` of ``diloco``).
        now: the clock time at creation (grace windows are measured from it).
        sharing_rescale: ``diloco.sharing_rescale`` (see the module doc).
    """

    def __init__(self, module_id: str, weights: torch.Tensor, sharing_paths: Sequence[int],
                 cfg: DecoupledConfig, outer: dict[str, Any], now: float = 0.0, *,
                 sharing_rescale: bool = False) -> None:
        self.module_id = module_id
        # θ_global, outer optimiser (and the residual layout): the core shared with sync mode
        self.core = ModuleCore(module_id, weights, outer)
        self.sharing_paths = sorted(int(p) for p in sharing_paths)
        self.cfg = cfg
        self.sharing_rescale = bool(sharing_rescale)
        self.quorum = rules.quorum_size(cfg.quorum, len(self.sharing_paths))
        self.version = 0
        # ledger (persisted with every version): id → version it went into / drop reason
        self.applied: dict[str, int] = {}
        self.dropped: dict[str, str] = {}
        self.phases: dict[str, str] = {}  # "path:phase" → update id holding that slot
        self.alternatives = Alternatives()  # anchors and applied groups of alternatives
        self.pending: list[Update] = []
        self.first_pending_at: Optional[float] = None
        self.fill_ema: Optional[float] = None  # seconds from first pending update to quorum
        self.phase_ema: Optional[float] = None  # seconds of a phase, as the workers measured them
        self.alpha_ema: Optional[float] = None  # tokens per update
        self.last_step_at = now
        self.created_at = now
        # rounds applied up to each recent version (Σ of each step's Σα/n / D): lateness in rounds
        self.rounds_at: dict[int, float] = {0: 0.0}
        # the last step, to take it again when late alternatives of its groups land (_amend):
        # the core's state before it, its outer gradient, its groups; None for plain SGD
        self._last: Optional[tuple[dict[str, torch.Tensor], torch.Tensor, set[tuple[int, int]], float]] = None

    @property
    def theta(self) -> torch.Tensor:
        """θ_global of the module (flat fp32)."""
        return self.core.weights

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
        if u.delta.numel() != self.core.numel:
            return self._drop(u, "bad_shape")
        if not bool(torch.isfinite(u.delta).all()):
            return self._drop(u, "non_finite")
        slot = f"{u.path_id}:{u.phase}"
        if slot in self.phases:
            return self._drop(u, "duplicate_phase")
        if rules.is_stale(self.version, u.base_version, self.cfg.max_staleness):
            return self._drop(u, "stale")
        self.phases[slot] = u.update_id
        u.arrived_at = now
        self.phase_ema = rules.next_phase_ema(self.phase_ema, u.phase_s)
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
        """The current grace window: grace_factor × EMA(fill time), within bounds derived
        from the phases' seconds (:func:`dipaco.decoupled.quorum.grace_bounds`)."""
        return rules.grace_window(self.cfg, self.fill_ema, self.phase_ema, self.quorum, len(self.sharing_paths))

    def due(self, now: float, done: Optional[set[int]] = None) -> Optional[str]:
        """Why a step is due now ("quorum" / "grace"), or None.

        ``done``: paths that finished their budget. They send nothing more, so the
        quorum is capped at the number of sharing paths still running (waiting for a
        path that has finished would only ever end by the grace window).
        """
        if not self.pending:
            return None
        return rules.step_due({u.path_id for u in self.pending}, self.sharing_paths, self.quorum,
                              self.first_pending_at, now, self.grace_s(), done)

    # ------------------------------------------------------------------ step
    def discount(self, staleness: int) -> float:
        return rules.discount(staleness, self.cfg.staleness_power)

    @torch.no_grad()
    def step(self, now: float, trigger: str = "quorum") -> Optional[StepRecord]:
        """Merge the pending updates into one outer step; None if nothing is pending.

        Staleness is re-checked here: an update that was fresh on arrival may have aged
        while it waited (other steps of this module in between) — it is then dropped.
        """
        self._note_fill(now, trigger)
        keep = self._take_fresh()
        if not keep:  # nothing pending, or all of it aged past max_staleness
            return None
        merge = MergeGroups.weigh(keep, self.version, self.alternatives)
        denom = max(self._denominator(merge), 1e-12)
        late = self._rounds_late(merge, denom)
        merge.discounts = [self.discount(r) for r in late]
        contribs = [u.contribution() for u in keep]
        share = merge.alpha_sum() / denom  # of a round: 1 for a whole one
        update, amended = self._outer_step(merge.numerator(contribs, self.core.numel), denom, set(merge.groups),
                                           merge.all_late(), share)
        self.version += 1
        self._record(merge, contribs, now, share)
        return StepRecord(self.module_id, self.version, now, [u.update_id for u in keep],
                          [u.path_id for u in keep], merge.staleness, merge.weights(), update.norm, trigger,
                          update.momentum_applied, amended, late)

    def _note_fill(self, now: float, trigger: str) -> None:
        """A quorum step measures how long the quorum took to fill (the grace window's EMA;
        a grace expiry leaves it alone: :func:`dipaco.decoupled.quorum.next_fill_ema`)."""
        if trigger == "quorum" and self.pending and self.first_pending_at is not None:
            self.fill_ema = rules.next_fill_ema(self.fill_ema, now - self.first_pending_at)

    def _take_fresh(self) -> list[Update]:
        """Empty the pending list: the updates still fresh enough, in (path, phase) order
        (the synchronous exchange's), the aged ones dropped as stale."""
        keep: list[Update] = []
        for u in self.pending:
            if rules.is_stale(self.version, u.base_version, self.cfg.max_staleness):
                self._drop(u, "stale")
            else:
                keep.append(u)
        self.pending, self.first_pending_at = [], None
        keep.sort(key=lambda u: (u.path_id, u.phase))
        return keep

    def _denominator(self, merge: "MergeGroups") -> float:
        """D: the tokens of a whole round when every sharing path is present (synchronous
        mode's token-weighted mean), else at least a round's expected tokens (a partial step
        moves by its share only)."""
        if {u.path_id for u in merge.updates} >= set(self.sharing_paths):
            return merge.alpha_sum()
        return max(merge.alpha_sum(), len(self.sharing_paths) * float(self.alpha_ema or 0.0))

    def _rounds_late(self, merge: "MergeGroups", denom: float) -> list[float]:
        """r per update (:func:`dipaco.decoupled.quorum.rounds_late`): the rounds applied since
        its base version (one a version where that is no longer known) beyond the rest of
        its own round, its share being α/n / D."""
        out = []
        for i, u in enumerate(merge.updates):
            lag = self._rounds(self.version) - self._rounds(u.base_version)
            out.append(rules.rounds_late(lag, float(u.tokens) / merge.size(i) / denom))
        return out

    def _rounds(self, version: int) -> float:
        """Rounds applied up to ``version``; one a version from the nearest one known."""
        if version in self.rounds_at:
            return self.rounds_at[version]
        near = min(self.rounds_at, key=lambda v: abs(v - version))
        return self.rounds_at[near] + (version - near)

    def _record(self, merge: "MergeGroups", contribs: list[torch.Tensor], now: float, share: float) -> None:
        """After the step to ``self.version``, which applied ``share`` of a round: the rounds
        clock, the groups applied (for late alternatives) and the ledger (each update's
        version, each path's applied phases)."""
        self.rounds_at[self.version] = self._rounds(self.version - 1) + share
        for v in [v for v in self.rounds_at if v < self.version - self.cfg.max_staleness - 1]:
            del self.rounds_at[v]  # older bases are dropped as stale anyway
        for key, members in merge.groups.items():
            self.alternatives.record(*key, [contribs[j] for j in members], [merge.discounts[j] for j in members])
        for u in merge.updates:
            self.applied[u.update_id] = self.version
            self.alternatives.note_applied(u.path_id, u.phase, self.version)
        self.last_step_at = now

    def _outer_step(self, g: torch.Tensor, denom: float, keys: set[tuple[int, int]], late: bool,
                    share: float = 1.0) -> tuple[Any, bool]:
        """The outer step of ``g / denom``; ``(update, amended)``.

        Late alternatives (``late``: every group was applied before) of the groups of the
        last step land as a correction. With plain SGD a correction step is where the
        updates together would have gone; an optimiser with state (momentum, delayed
        Nesterov, Adam) would take a second step and land elsewhere, by arrival order.
        So the last step is taken again from the state before it, with its outer gradient
        plus the correction's: the result of one step with all of them, whatever the
        order. (After a restart, or when another step came between, the correction is a
        step of its own, as before; docs/decoupled.md gives the bound.)"""
        count = len(self.sharing_paths)
        stateful = _has_state(self.core.outer_optimizer)
        last, self._last = self._last, None
        amend = late and last is not None and keys <= last[2]
        avg = g[: self.core.numel] / denom
        if amend:
            before, last_avg, last_keys, share = last  # type: ignore[misc]
            residuals = {k: v for k, v in self.core.state_dict().items() if k.startswith(RESIDUAL)}
            self.core.load_state_dict({**before, **residuals})
            avg, keys = last_avg + avg, last_keys
        if stateful:
            state = {k: v for k, v in self.core.state_dict().items() if not k.startswith(RESIDUAL)}
            self._last = (state, avg.clone(), set(keys), share)
        # delayed Nesterov counts its momentum period in rounds (dipaco.sync.outer.DelayedNesterov)
        self.core.outer_optimizer.param_groups[0]["share"] = share
        return self.core.step(avg, 1.0, count, rescale=self.sharing_rescale), amend

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue: the core's state (``global``, ``outer.<key>``:
        the checkpoint layout of ``outer/<module>``), version, ledger, EMAs.

        Pending updates are *not* saved: their files stay in the inbox until the version
        that applies them is written, so a restarted synchroniser re-reads them.
        """
        return {
            **self.core.state_dict(),
            "version": self.version,
            "applied": dict(self.applied),
            "dropped": dict(self.dropped),
            "phases": {k: v for k, v in self.phases.items()
                       if v in self.applied or v in self.dropped},
            "fill_ema": self.fill_ema,
            "phase_ema": self.phase_ema,
            "alpha_ema": self.alpha_ema,
            "rounds_at": {str(v): r for v, r in self.rounds_at.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict`; a sync-mode ``outer/<module>`` state (no ledger)
        loads as version 0 with an empty ledger."""
        self.core.load_state_dict({k: v for k, v in state.items() if isinstance(v, torch.Tensor)})
        self.version = int(state.get("version", 0))
        self.applied = {str(k): int(v) for k, v in state.get("applied", {}).items()}
        self.dropped = {str(k): str(v) for k, v in state.get("dropped", {}).items()}
        self.phases = {str(k): str(v) for k, v in state.get("phases", {}).items()}
        self.fill_ema = state.get("fill_ema")
        self.phase_ema = state.get("phase_ema")
        self.alpha_ema = state.get("alpha_ema")
        self.rounds_at = {int(v): float(r) for v, r in (state.get("rounds_at") or {}).items()}
        self.rounds_at.setdefault(self.version, float(self.version))  # a store written before the rounds clock
        self.pending, self.first_pending_at = [], None
        self._last = None  # the state before the last step is not saved: a late alternative then steps alone
        self.alternatives.rebuild(self.phases, self.applied)


def _has_state(opt: torch.optim.Optimizer) -> bool:
    """Whether an optimiser's step depends on more than the gradient (momentum, Adam's
    moments): plain SGD (momentum 0) needs no snapshot to be order-independent."""
    group = opt.param_groups[0]
    return float(group.get("momentum", 0.0) or 0.0) > 0 or "betas" in group
