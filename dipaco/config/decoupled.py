"""Settings of decoupled mode (``diloco.mode=decoupled``), under ``diloco.decoupled``.

The outer optimiser's lr/momentum/nesterov come from ``diloco.outer`` as in sync mode;
the codec from ``diloco.codec``; the budget from ``trainer.rounds`` × ``diloco.inner_steps``
(every path runs ``trainer.rounds`` × H inner steps, as many as a sync run, so the two
compare at equal steps; phases have H steps, fewer for a slow decoupled worker with
``dynamic_steps``).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import List, Optional

__all__ = ["DecoupledConfig", "validate_decoupled", "mode_problems"]


@dataclass
class DecoupledConfig:
    """Asynchronous decoupled workers + per-module synchronisers (see docs/decoupled.md)."""

    # decoupled worker processes on this host; None: launcher.nproc if > 1, else one per path
    workers: Optional[int] = None
    # deprecated name of `workers` (runs written before the rename keep loading)
    learners: Optional[int] = None
    # synchroniser processes on this host; modules are dealt round-robin among them
    sync_procs: int = 1
    # the shared directory (path or file:// URL); None: <run_dir>/decoupled
    store_url: Optional[str] = None

    # ---- per-module synchroniser
    # outer step once this share of the module's sharing paths has reported (ceil, >= 1) ...
    quorum: float = 0.5
    # ... or once the grace window since the first pending update expires. The window is
    # adaptive: grace_factor × EMA of how long quorum took to fill (grace_init_s before one
    # filled), within [min, max]. null: derived from T, the EMA of the phases' seconds (each
    # update carries its phase's, as its worker measured them): min = quorum share × T (when
    # quorum paths' updates arrive with phases spread over one), max = grace_factor × T
    # (dipaco/decoupled/quorum.py grace_bounds; the simulator calls the same rule)
    grace_factor: float = 2.0
    grace_init_s: float = 2.0
    grace_min_s: Optional[float] = None
    grace_max_s: Optional[float] = None
    # staleness = module version now − version the update started from
    max_staleness: int = 8  # versions; more: dropped (reason "stale")
    # kept updates weigh tokens · (1 + r)^(−power), r how late the update is in rounds beyond
    # the rest of its own round (dipaco/decoupled/quorum.py rounds_late): a round-mate
    # applied in an earlier partial step does not make it late
    staleness_power: float = 0.5
    # delayed Nesterov (Liu et al. 2024; dipaco.sync.outer.DelayedNesterov): momentum is
    # updated and applied every N rounds of contributions (a partial step brings Σα/D of one)
    # with the buffered pseudo-gradients' mean per round; between activations the step is
    # −lr·(g + momentum_scale·β·m). Applies to diloco.outer.name=sgd with momentum in
    # decoupled mode, and to diloco.outer.name=delayed_nesterov in both modes; other
    # optimisers step as torch does. N=1 is sync mode's Nesterov, which on stale updates did
    # worse in benchmarks/bench_decoupled.py (docs/decoupled.md), as Liu et al. report for
    # async Nesterov.
    momentum_every: int = 4
    momentum_scale: float = 0.0

    # ---- decoupled workers
    lease_s: float = 10.0  # a path whose holder stops heartbeating is free after this
    heartbeat_s: float = 1.0
    # before a phase, wait up to this long for each module's ledger to account for this
    # path's previous update (applied, or dropped), so a phase never starts from weights
    # that miss the path's own last contribution. The synchroniser's grace window bounds
    # the actual wait; 0: never wait, pull whatever is latest (more staleness).
    pull_wait_s: float = 10.0
    # ... and at most this share of the worker's own expected phase time (None: only
    # pull_wait_s bounds it). Waiting longer than a sliver of a phase costs more goodput
    # than the staleness it saves: the path's own update still lands, one version later.
    pull_wait_fraction: Optional[float] = 0.1
    # Dynamic local updates (DyLU, Liu et al. 2024): a worker markedly slower than the
    # others (> slow_threshold × their median time per step) runs proportionally fewer
    # inner steps per phase (at least min_phase_steps), so its phases end about when the
    # fast workers' do and the path it holds does not fall behind. A path's budget stays
    # trainer.rounds × H inner steps; its updates weigh by their tokens as always.
    dynamic_steps: bool = True
    min_phase_steps: int = 4
    slow_threshold: float = 1.5
    poll_s: float = 0.05

    # ---- supervisor
    # A run stops when it stalls (no path committed a phase for stall_phases x the slowest
    # advance it has shown: StallWatch in dipaco/decoupled/supervisor.py), not after a
    # wall-clock time fit for one run's length: none is set by default (a run takes days).
    stall_phases: float = 20.0
    timeout_s: Optional[float] = None  # a wall-clock limit on this host's share, when set
    restart_dead: bool = True  # restart a worker that died (chaos, OOM, ...)
    max_restarts: int = 50
    keep_archive: bool = True  # keep processed updates under archive/ (audits, tests)

    # ---- benchmarks (off by default; fault injection is DIPACO_FAULT, dipaco/runtime/faults.py)
    # worker indices slowed down: each inner step is followed by (slow_factor-1)× its time asleep
    slow_workers: List[int] = field(default_factory=list)
    slow_factor: float = 1.0
    slow_learners: List[int] = field(default_factory=list)  # deprecated name of `slow_workers`

    @property
    def num_workers(self) -> Optional[int]:
        """``workers`` (or its deprecated name ``learners``); None: the default."""
        return self.workers if self.workers is not None else self.learners

    @property
    def slow(self) -> list[int]:
        """``slow_workers`` (or its deprecated name ``slow_learners``)."""
        return list(self.slow_workers or self.slow_learners)

    def deprecated_keys(self) -> list[str]:
        """The deprecated names this config sets, to tell the user once."""
        return [f"diloco.decoupled.{old} (now {new})" for old, new in
                (("learners", "workers"), ("slow_learners", "slow_workers")) if getattr(self, old)]

def validate_decoupled(d: DecoupledConfig) -> list[tuple[str, str, str]]:
    """Problems as ``(key, problem, fix)`` triples (empty when the settings can work)."""
    out: list[tuple[str, str, str]] = []
    k = "diloco.decoupled."

    def need(ok: bool, key: str, problem: str, fix: str) -> None:
        if not ok:  # the fix spelt as an override: a bare `quorum=0.5` names no key of the config
            out.append((k + key, problem, re.sub(r"(?<![\w.])(\w+)=", lambda m: f"{k}{m.group(1)}=", fix)))

    need(d.workers is None or d.workers >= 1, "workers", "must be >= 1 or null", "e.g. workers=4")
    need(d.learners is None or d.learners >= 1, "learners", "must be >= 1 or null (deprecated: use workers)",
         "e.g. workers=4 (and drop learners)")
    need(d.learners is None or d.workers is None or d.learners == d.workers, "learners",
         f"is the deprecated name of workers and disagrees with it ({d.learners} vs {d.workers})",
         "drop diloco.decoupled.learners")
    need(not (d.slow_learners and d.slow_workers), "slow_learners",
         "is the deprecated name of slow_workers; both are set", "drop diloco.decoupled.slow_learners")
    need(d.sync_procs >= 1, "sync_procs", "must be >= 1", "e.g. sync_procs=1")
    need(0 < d.quorum <= 1, "quorum", f"must lie in (0, 1], got {d.quorum}", "e.g. quorum=0.5")
    need(all(v is None or v > 0 for v in (d.grace_min_s, d.grace_max_s)), "grace_min_s",
         "grace_min_s and grace_max_s must be > 0 or null (derived from the phase)",
         "e.g. grace_min_s=null grace_max_s=null")
    need(d.grace_min_s is None or d.grace_max_s is None or d.grace_min_s <= d.grace_max_s, "grace_min_s",
         f"exceeds grace_max_s ({d.grace_min_s} > {d.grace_max_s})", "e.g. grace_min_s=0.5 grace_max_s=30")
    need(d.grace_factor > 0 and d.grace_init_s > 0, "grace_factor", "must be > 0", "e.g. grace_factor=2")
    need(d.max_staleness >= 0, "max_staleness", "must be >= 0", "e.g. max_staleness=4")
    need(d.staleness_power >= 0 and math.isfinite(d.staleness_power), "staleness_power", "must be >= 0",
         "e.g. staleness_power=0.5")
    need(d.momentum_every >= 1, "momentum_every", "must be >= 1", "momentum_every=4 (or 1: plain Nesterov)")
    need(d.momentum_scale >= 0, "momentum_scale", "must be >= 0", "e.g. momentum_scale=0")
    need(d.lease_s > 2 * d.heartbeat_s > 0, "lease_s",
         f"the lease ({d.lease_s}s) must outlast two heartbeats ({d.heartbeat_s}s)",
         "e.g. lease_s=10 heartbeat_s=1")
    need(d.poll_s > 0 and d.pull_wait_s >= 0, "poll_s", "must be > 0 (pull_wait_s >= 0)", "e.g. poll_s=0.05")
    need(d.pull_wait_fraction is None or d.pull_wait_fraction >= 0, "pull_wait_fraction",
         "must be >= 0 or null", "e.g. pull_wait_fraction=0.1")
    need(d.min_phase_steps >= 1, "min_phase_steps", "must be >= 1", "e.g. min_phase_steps=4")
    need(d.slow_threshold > 1, "slow_threshold", "must be > 1", "e.g. slow_threshold=1.5")
    need(d.timeout_s is None or d.timeout_s > 0, "timeout_s", "must be > 0 or null (no wall-clock limit)",
         "e.g. timeout_s=86400")
    need(math.isfinite(d.stall_phases) and d.stall_phases >= 2, "stall_phases",
         "must be >= 2 (a run is stalled after that many of its slowest advances without progress)",
         "e.g. stall_phases=20")
    need(d.slow_factor >= 1, "slow_factor", "must be >= 1", "e.g. slow_factor=3")
    return out


def mode_problems(mode: str, lossy_exchange: str, outer_name: str,
                  d: DecoupledConfig) -> list[tuple[str, str, str]]:
    """``diloco.*`` options one mode cannot honour, as ``(key, problem, fix)`` triples.

    Every other ``diloco`` option works in both modes: the codec and its options, error
    feedback, the √P rescale, any outer optimiser.
    """
    if mode == "decoupled":
        out = validate_decoupled(d)
        if lossy_exchange == "reduce_scatter":
            out.append(("diloco.lossy_exchange", "decoupled mode has no collective exchange: each update is "
                        "encoded once, as with all_gather", "use diloco.lossy_exchange=auto (or all_gather)"))
        return out
    return []  # its options set in sync mode: dipaco/config/applies.py
