"""What a simulation costs before it runs: :func:`check_cost` refuses one that would not
finish in seconds.

The simulator's work is events: rounds drawn (one Python call each, about 40,000 a
second), failures drawn and decoupled phases. Every key's domain bounds its own value, but
their product does not: a horizon of 10^6 hours over 0.3 ms rounds is 10^13 rounds, and a
chip MTBF far below a checkpoint interval plus a restart never finishes at all (each
rolled-back attempt fails again, while failures keep arriving). So the expected work is
estimated from the config's numbers and a simulation over :data:`MAX_EVENTS` is refused
in one line naming the key that makes it large, instead of hanging.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

from dipaco.config import ConfigError
from dipaco.sim.job import SimJob
from dipaco.sim.modes import make_mode

__all__ = ["MAX_EVENTS", "expected_wall_s", "expected_events", "check_cost"]

#: the most events (rounds drawn, failures, phases) one ``dipaco-plan --simulate`` may take: under a minute (the
#: paper cluster of docs/planning.md takes 1.2e6, in 17 s)
MAX_EVENTS = 3e6


def _round_s(job: SimJob) -> float:
    """A round's nominal seconds (no stragglers: the shortest, so the most rounds)."""
    return max(job.inner_steps * job.step_s * job.path_load(job.groups) + job.transfer_s(job.rank_bytes()), 1e-300)


def _failure_rate(job: SimJob) -> float:
    """Failures per second of the whole cluster (:class:`dipaco.sim.faults.Faults`)."""
    c = job.cluster
    return 0.0 if c.mtbf_hours is None else job.groups * job.chips_per_group / (c.mtbf_hours * 3600.0)


def _expected_s(job: SimJob, horizon_s: Optional[float]) -> tuple[float, float]:
    """``(simulated seconds, seconds of them spent computing rounds)`` of the sync mode: the
    horizon, else the expected time to apply the config's rounds when a failure rolls back
    to the last checkpoint (an interval of ``checkpoint_every`` rounds, ``s`` seconds, is
    retried until it runs clean: ``(e^(λs) - 1)/λ`` computing and as many failures, each
    costing ``R`` to restart); ``inf`` when that never ends in practice."""
    if horizon_s is not None:
        return horizon_s, horizon_s
    lam, rs = _failure_rate(job), _round_s(job)
    if lam == 0:
        return job.rounds * rs, job.rounds * rs
    c = job.cluster
    seg = job.checkpoint_every * rs
    if lam * seg > 700:  # e^700 overflows: no interval ever runs clean
        return math.inf, math.inf
    fails = math.ceil(job.rounds / job.checkpoint_every) * math.expm1(lam * seg)
    return fails / lam + fails * (c.detect_s + c.restart_s), fails / lam


def expected_wall_s(job: SimJob, horizon_s: Optional[float]) -> float:
    """Simulated seconds of the sync mode (:func:`_expected_s`)."""
    return _expected_s(job, horizon_s)[0]


def expected_events(job: SimJob, modes: Sequence[str]) -> float:
    """Events of simulating ``modes``: rounds drawn while computing (decoupled: a phase per
    worker) and failures drawn, restarts included; an upper estimate (rounds at their
    nominal length, every mode as long as sync), each mode over its own horizon."""
    rs, lam = _round_s(job), _failure_rate(job)
    total = 0.0
    for mode in (make_mode(m, job) for m in modes):
        t, busy = _expected_s(job, mode.horizon_s())
        total += busy / rs * mode.phases + lam * t
    return total


def check_cost(job: SimJob, modes: Sequence[str]) -> None:
    """:class:`ConfigError` naming the key to change when simulating ``modes`` of ``job``
    would take more than :data:`MAX_EVENTS` events (module doc)."""
    events = expected_events(job, modes)
    if events <= MAX_EVENTS:
        return
    horizon_s = make_mode("sync", job).horizon_s()  # the round modes' (decoupled caps its own)
    t = expected_wall_s(job, horizon_s)
    lam = _failure_rate(job)
    size = "never ends" if math.isinf(events) else f"takes about {events:.2g} events (rounds, failures)"
    problem = (f"the simulation {size}, more than the {MAX_EVENTS:.2g} that finish within a minute "
               f"(round {_round_s(job):.3g} s, {t:.3g} simulated s")
    if horizon_s is None and lam > 0 and (math.isinf(t) or lam * t > MAX_EVENTS / 2):
        # failures dominate: each checkpoint interval fails before it ends
        raise ConfigError("cluster.mtbf_hours", problem + f", a failure every {1 / lam:.3g} s of the cluster)",
                          "a longer chip MTBF (cluster.mtbf_hours=null: no failures), fewer chips, or "
                          "set cluster.horizon_hours to simulate a window")
    if horizon_s is not None:
        fit = max(horizon_s / 3600.0 * MAX_EVENTS / events * 0.9, 1e-6)
        raise ConfigError("cluster.horizon_hours", problem + ")", f"cluster.horizon_hours={fit:.2g} (or a "
                          "larger cluster.step_s: goodput and wall per round do not need a long window)")
    raise ConfigError("trainer.rounds", problem + ")", "set cluster.horizon_hours to simulate a window "
                      "of the run, or fewer trainer.rounds")
