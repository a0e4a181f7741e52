"""``dipaco-plan --simulate`` against this machine's measurements, then at scale.

``--validate``: the simulator (dipaco/sim/) predicts the settings the repository measured
(docs/results.md §21: benchmarks/bench_link.py on a shaped loopback; docs/decoupled.md:
benchmarks/bench_decoupled.py with one worker 3x slower; docs/launch.md: an elastic
departure and rejoin) from the recorded step time and link rate only, and prints
prediction and measurement side by side. No parameter is fitted per row.

``--scale``: experiment=paper (256 paths) on 10^3..10^6 chips and a 1.2M-chip case, goodput
vs chip count and vs MTBF for sync, elastic, streaming and decoupled, the link rate at
which each mode's exposed communication falls under 5%, and the wall time of a simulated
week on 10^6 chips (the 60 s budget). ``--plot DIR`` draws the scale figures.

    python -m benchmarks.bench_simulate --validate
    nice -n 10 python -m benchmarks.bench_simulate --scale --plot /tmp/sim_plots
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any

from dipaco.config import compose_config
from dipaco.sim.job import SimJob, sim_job
from dipaco.sim.decoupled import simulate_decoupled
from dipaco.sim.modes import simulate_mode
from dipaco.sim.report import simulate_job
from dipaco.storage.strict_json import dumps_strict
from benchmarks.common import write_figure, write_output

DECOUPLED_S = 600.0  # simulated seconds of decoupled mode at scale (256 workers: ~300 phases each)

# benchmarks/bench_link.py's settings (its overrides(), H=16, 16 x 128 tokens per rank and step)
LINK = ["experiment=smoke", "model.vocab_size=300", "trainer.dense_baseline=false", "trainer.warmup_fraction=0",
        "trainer.seq_len=128", "diloco.inner_steps=16", "grid=2x2", "trainer.batch_size=16", "trainer.rounds=6",
        "trainer.checkpoint_every=6", "cluster.chips=4", "cluster.link_scope=shared"]
# benchmarks/bench_decoupled.py --quick: [2,2], 4 paths x 6 phases x H=256, worker 0 3x slower
DECOUPLED = ["experiment=smoke", "trainer.rounds=6", "diloco.inner_steps=256", "trainer.checkpoint_every=1000",
             "cluster.chips=4", "cluster.slow_groups=1", "cluster.slow_factor=3", "diloco.decoupled.workers=4"]


def _job(overrides: list[str], **cluster: Any) -> SimJob:
    """The job of ``overrides`` with ``cluster.<key>=<value>`` for each of ``cluster``."""
    return sim_job(compose_config(overrides + [f"cluster.{k}={v!r}" for k, v in cluster.items()]))


def _modes(job: SimJob, modes: tuple[str, ...]) -> dict[str, Any]:
    return {r.mode: r for r in simulate_job(job, modes).results}


def validate() -> list[dict[str, Any]]:
    """Prediction vs measurement rows (measured figures as docs/ record them)."""
    rows: list[dict[str, Any]] = []

    def row(setting: str, what: str, predicted: float, measured: float) -> None:
        err = (predicted - measured) / measured if measured else float("nan")
        rows.append({"setting": setting, "quantity": what, "predicted": round(predicted, 3),
                     "measured": measured, "error": round(err, 3)})

    # docs/results.md §21, idle host: 16 inner steps ~0.85 s; 12 Mbit/s, tau = 6
    for mode, wall, exposed in (("sync", 1.46, 0.53), ("streaming", 0.94, 0.0), ("ddp", 12.06, 11.11)):
        extra = ["diloco.streaming_delay=6"]
        r = _modes(_job(LINK + extra, step_s=0.85 / 16, link_gbps=0.012), (mode,))[mode]
        row(f"bench_link 12 Mbit/s idle, {mode}", "wall s/round", r.wall_per_round_s, wall)
        row(f"bench_link 12 Mbit/s idle, {mode}", "exposed s/round", r.exposed_per_round_s, exposed)
    # the shared-host table: the free link's sync round took 1.97 s of inner steps (16 steps)
    for rate, mode, wall, exposed in ((4, "sync", 3.72, 1.62), (4, "streaming", 3.28, 0.07), (4, "ddp", 36.38, 34.03),
                                      (40, "sync", 2.32, 0.13), (40, "streaming", 2.00, 0.14), (40, "ddp", 4.56, 2.20)):
        r = _modes(_job(LINK + ["diloco.streaming_delay=4"], step_s=1.97 / 16, link_gbps=rate / 1000), (mode,))[mode]
        row(f"bench_link {rate} Mbit/s shared, {mode}", "wall s/round", r.wall_per_round_s, wall)
        row(f"bench_link {rate} Mbit/s shared, {mode}", "exposed s/round", r.exposed_per_round_s, exposed)
    # docs/decoupled.md: sync 40.5 s for 6 rounds at the slow rank's pace (3 x 256 steps a round)
    step = 40.5 / (6 * 256 * 3)
    res = _modes(_job(DECOUPLED, step_s=step), ("sync", "decoupled"))
    row("bench_decoupled, 1 of 4 workers 3x slower", "sync goodput", res["sync"].goodput, 0.52)
    row("bench_decoupled, 1 of 4 workers 3x slower", "decoupled goodput", res["decoupled"].goodput, 0.833)
    fixed = _modes(_job(DECOUPLED + ["diloco.decoupled.dynamic_steps=false", "diloco.decoupled.pull_wait_fraction=null"],
                        step_s=step), ("decoupled",))["decoupled"]
    row("bench_decoupled, fixed H", "decoupled goodput", fixed.goodput, 0.717)
    row("bench_decoupled", "decoupled train window s", res["decoupled"].wall_s, 20.2)
    # docs/launch.md: 16 rounds of H=50 on 4 groups, group 2 lost in round 2, back for round 8
    # (rounds 2-7 on 3 groups); bytes 17.9 MB against 19.5 MB uninterrupted
    el = _job(["experiment=smoke", "trainer.rounds=16", "diloco.inner_steps=50", "cluster.chips=4"], step_s=0.04)
    full = _modes(el, ("sync",))["sync"].bytes_per_round
    three = _modes(dataclasses.replace(el, groups=3, chips_per_group=1), ("sync",))["sync"].bytes_per_round
    row("elastic departure and rejoin", "bytes sent MB", (10 * full + 6 * three) / 1e6, 17.9)
    return rows


def scale(plot_dir: str | None) -> dict[str, Any]:
    """Goodput vs chips and vs MTBF; the 5% bandwidth; the 10^6-chip week and its CPU time.
    Each result is printed as it lands (a shared host may be slow to finish them all)."""
    base = sim_job(compose_config(["experiment=paper", "cluster=paper_1m"]))
    modes = ("sync", "elastic", "streaming", "decoupled")
    out: dict[str, Any] = {"step_s": base.step_s, "paths": base.paths}

    def note(key: str, value: Any) -> None:
        out[key] = value
        print(dumps_strict({key: value}, default=str), flush=True)

    def at(chips: int, **kw: Any) -> dict[str, float]:
        """Goodput per mode on ``chips`` chips: the round modes over the preset's week;
        decoupled over DECOUPLED_S (its failures are folded into each phase when a worker
        stands for many groups, so its goodput is a stationary rate: docs/planning.md)."""
        j = dataclasses.replace(base, groups=chips // base.chips_per_group,
                                cluster=dataclasses.replace(base.cluster, chips=chips, **kw))
        j = dataclasses.replace(j, workers=min(j.groups, base.paths))
        horizon = j.cluster.horizon_hours * 3600.0
        res = {m: round(simulate_mode(j, m, horizon).goodput, 4) for m in modes if m != "decoupled"}
        res["decoupled"] = round(simulate_decoupled(j, DECOUPLED_S).goodput, 4)
        return res

    t0 = time.process_time()  # the 60 s budget: every round mode over a simulated week on 10^6 chips
    j6 = dataclasses.replace(base, groups=1_000_000 // base.chips_per_group)
    week = {m: simulate_mode(j6, m, 168 * 3600.0).to_dict() for m in ("sync", "elastic", "streaming", "ddp")}
    note("cpu_s_for_1m_week_round_modes", round(time.process_time() - t0, 1))
    note("week_1m", {m: {k: r[k] for k in ("goodput", "failures", "rounds", "wall_per_round_s", "exposed_share")}
                     for m, r in week.items()})
    t0 = time.process_time()
    dec = simulate_decoupled(dataclasses.replace(j6, workers=base.paths), DECOUPLED_S).to_dict()
    note("cpu_s_for_decoupled_1m_600s", round(time.process_time() - t0, 1))
    note("decoupled_1m", {k: dec[k] for k in ("goodput", "wall_per_round_s", "exposed_share")})
    note("paper_1_2m", at(1_200_000))
    chips_curve: dict[int, Any] = {}
    for n in (1_000, 10_000, 100_000, 1_000_000):
        chips_curve[n] = at(n)
    note("goodput_vs_chips", chips_curve)
    mtbf_curve: dict[float, Any] = {}
    for h in (1e4, 1e5, 1e6):
        mtbf_curve[h] = at(1_000_000, mtbf_hours=h)
    note("goodput_vs_mtbf_1m", mtbf_curve)
    note("gbps_for_exposed_under_5pct", bandwidth(base))
    if plot_dir:
        _plot(out, plot_dir)
    return out


def bandwidth(base: SimJob | None = None) -> dict[str, float]:
    """The lowest of 1, 10, 100, 1000, 10000 Gbit/s per group at which a mode's exposed
    communication is under 5% of its wall (no failures; an hour, decoupled 5 minutes)."""
    base = base or sim_job(compose_config(["experiment=paper", "cluster=paper_1m"]))
    rates: dict[str, float] = {}
    for mode in ("sync", "streaming", "ddp", "decoupled"):
        for gbps in (1, 10, 100, 1000, 10000):
            j = dataclasses.replace(base, workers=base.paths,
                                    cluster=dataclasses.replace(base.cluster, link_gbps=gbps, mtbf_hours=None))
            r = simulate_mode(j, mode, 300.0 if mode == "decoupled" else 3600.0)
            if r.exposed_share < 0.05:
                rates[mode] = gbps
                break
    return rates


def grace_floor() -> dict[str, Any]:
    """Decoupled mode on experiment=paper cluster=paper_1m over DECOUPLED_S: the default grace
    bounds (derived from the phase: dipaco/decoupled/quorum.py grace_bounds) against the old
    fixed ones (0.1 s to 30 s) and a fixed 1 s floor: goodput, the share of the steps run
    that were applied, and the outer steps by trigger."""
    from collections import Counter

    from dipaco.sim.decoupled import _DecoupledSim

    out = {}
    for name, overrides in (("derived (default)", []),
                            ("grace_min_s=0.1 grace_max_s=30", ["diloco.decoupled.grace_min_s=0.1",
                                                                "diloco.decoupled.grace_max_s=30"]),
                            ("grace_min_s=1.0 grace_max_s=30", ["diloco.decoupled.grace_min_s=1.0",
                                                                "diloco.decoupled.grace_max_s=30"])):
        job = sim_job(compose_config(["experiment=paper", "cluster=paper_1m", *overrides]))
        sim = _DecoupledSim(dataclasses.replace(job, workers=job.paths), DECOUPLED_S)
        r = sim.run()
        out[name] = {"goodput": round(r.goodput, 3),
                     "applied_share": round(sim.tally.applied_steps / sim.tally.executed_steps, 3),
                     "steps_by_trigger": dict(Counter(s[1] for m in sim.modules.values() for s in m.steps))}
        print(dumps_strict({name: out[name]}), flush=True)
    return out


def _plot(out: dict[str, Any], folder: str) -> None:
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(folder, exist_ok=True)
    for key, xlabel in (("goodput_vs_chips", "chips"), ("goodput_vs_mtbf_1m", "chip MTBF (hours), 10^6 chips")):
        fig, ax = plt.subplots(figsize=(5, 3.2))
        xs = sorted(out[key])
        for mode in out[key][xs[0]]:
            ax.plot(xs, [out[key][x][mode] for x in xs], marker="o", label=mode)
        ax.set_xscale("log")
        ax.set_ylim(0, 1)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("goodput")
        ax.legend(fontsize=7)
        fig.tight_layout()
        write_figure(fig, os.path.join(folder, f"{key}.png"), dpi=90)
        plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--validate", action="store_true")
    ap.add_argument("--scale", action="store_true")
    ap.add_argument("--bandwidth", action="store_true", help="the 5%% exposed-communication link rate per mode")
    ap.add_argument("--grace", action="store_true",
                    help="decoupled at scale: the derived grace bounds against fixed 0.1 s and 1 s floors")
    ap.add_argument("--plot", default=None, help="folder for the scale plots")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    res: dict[str, Any] = {}
    if args.bandwidth:
        res["bandwidth"] = bandwidth()
        print(dumps_strict({"gbps_for_exposed_under_5pct": res["bandwidth"]}))
    if args.grace:
        res["grace"] = grace_floor()
    if args.validate or not (args.scale or args.grace or args.bandwidth):
        res["validation"] = validate()
        print(f"{'setting':<44}{'quantity':<28}{'predicted':>10}{'measured':>10}{'error':>8}")
        for r in res["validation"]:
            print(f"{r['setting']:<44}{r['quantity']:<28}{r['predicted']:>10}{r['measured']:>10}{r['error']:>8.0%}")
    if args.scale:
        res["scale"] = scale(args.plot)
    if args.json:
        write_output(args.json, dumps_strict(res, indent=1, default=str))


if __name__ == "__main__":
    main()
