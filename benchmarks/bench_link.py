"""Streaming sync on a bandwidth-limited link: 4 gloo ranks in their own network namespace.

    python -m benchmarks.bench_link --quick                # rates 4 and 40 Mbit/s
    python -m benchmarks.bench_link --rates 10 100 --delay 3 --rounds 4

The benchmark re-runs itself under ``unshare --net`` (root only): a network namespace of
its own whose loopback is brought up with ``ip link set lo mtu 9000`` and shaped with
``tc qdisc replace dev lo root tbf rate R burst 128kb latency 100ms`` (``--burst``; the
burst must exceed the MTU or every packet is dropped; the ``netem`` qdisc is not in this kernel, so
no latency is added). All four ranks share that one loopback: R is the rate of a shared
bus, not of each rank's link. Without root, ``unshare``, ``ip`` or ``tc`` it says so and
skips.

Settings, each trained with ``launcher=spawn launcher.nproc=4`` on a seeded synthetic
token corpus (no tokenizer training, routing or evaluation), ``model=tiny``:

* ``ddp``: data parallel of one path model over the 4 ranks (``grid=dense
  launcher.group_size=4``, batch 4×, so every rank reads the tokens a DiPaCo rank reads);
  its gradients are all-reduced at every inner step, inside ``compute_s``;
* ``sync``: per-module DiLoCo of a [2, 2] grid, one worker group per path;
* ``streaming``: the same with ``diloco.streaming=true diloco.streaming_delay=τ``;
* ``streaming+int4``: and ``diloco.codec=int4 diloco.error_feedback=true``.

Each runs once unshaped (the loopback's full speed) and once per rate. Per setting and
rate, from ``metrics.jsonl`` (max over ranks), the median over rounds 2..R−1 (round 1
pays gloo's connection set-up; streaming's last round is synchronous by design): wall
time per round (inner steps + waiting + sync points), ``stood_s`` (the time the inner
steps stood still at sync points: exposed communication plus encoding and outer steps),
``wait_s`` (the round-end barrier: waiting for the slowest rank), ``blocked_s``
(streaming: the part of ``stood_s`` spent waiting for exchanges to complete, which on a
loaded host includes waiting for a slower rank to launch),
``exposed_s`` (what the link cost the inner loop: for DiLoCo ``stood_s`` − the same
setting's unshaped ``stood_s``; for DDP, whose all-reduce sits inside every inner step,
wall − unshaped wall; the inner steps' own time, ``compute_s``, moves by ±25% between runs
on a shared host, so it is kept out of the DiLoCo figure), the sync share (stood ÷ wall), bytes sent per round (all ranks) and the peak
bytes one path had in flight (per rank, streaming's schedule as run). ``hidden`` is the
share of synchronous DiLoCo's exposed time that streaming does not expose.

Bytes on the wire (:mod:`benchmarks.link_wire`): ``wire`` is the loopback's transmitted
bytes per round (all ranks, the same median over rounds), counted by the namespace's
interface while the setting trains: the payload plus TCP/IP headers, gloo's framing and
the round's control collectives; ``wire_ratio`` = wire ÷ payload. After the settings, the
control collectives a synchronous round issues besides its exchanges (the round-end
barrier, the all-gather of the round record) are measured alone.
``--rates`` with no value runs the unshaped link only (the byte figures do not depend on
the rate).
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from benchmarks.common import base_parser, load_average, print_table, work_dir, write_result
from benchmarks.link_wire import WireMeter, control_bytes, round_record_proxy, transfer_times
from dipaco.storage.atomic import write_json

INSIDE = "DIPACO_BENCH_LINK_NETNS"  # set in the re-run inside the namespace
SETTINGS = ("ddp", "sync", "streaming", "streaming+int4")


def shaping_problem() -> Optional[str]:
    """Why this host cannot shape a link (None: it can)."""
    if os.geteuid() != 0:
        return "not root: unshare --net and tc need root"
    missing = [t for t in ("unshare", "ip", "tc") if shutil.which(t) is None]
    return f"missing {', '.join(missing)}" if missing else None


def _sh(*cmd: str) -> None:
    subprocess.run(list(cmd), check=True, capture_output=True, text=True)


def shape(rate_mbit: Optional[float], burst: str = "128kb") -> None:
    """The namespace's loopback at ``rate_mbit`` Mbit/s with a token bucket of ``burst``
    (tc's units: ``128kb`` is 128 KiB; None: unshaped)."""
    if rate_mbit is None:
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)
        return
    _sh("tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate", f"{rate_mbit}mbit", "burst", burst,
        "latency", "100ms")


def build_run(root: Path, paths: int) -> Any:
    """A run directory with a byte-level tokenizer and ``paths`` shards of seeded random
    token documents (what the rounds read; nothing else is prepared)."""
    import numpy as np

    from dipaco.data import Tokenizer
    from dipaco.run.run_dir import RunDir
    from router.shards import write_shards
    from router.tokens import TokenDocs

    run = RunDir.at(root)
    run.root.mkdir(parents=True, exist_ok=True)
    Tokenizer.train(["bench link " * 8], vocab_size=257).save(str(run.tokenizer))
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 256, size=int(rng.integers(200, 400))).tolist() for _ in range(400)]
    write_shards(TokenDocs.from_arrays(docs), [[i % paths] for i in range(len(docs))], paths, run.shards)
    # an empty record, as a prepared run holds one: without it the rounds refuse a tokenizer and
    # shards whose origin is unknown (dipaco/run/fingerprint.py)
    write_json(run.root / "fingerprints.json", {})
    return run


def overrides(setting: str, args: Any) -> list[str]:
    """The config of one setting (module doc)."""
    base = ["experiment=smoke", "model.vocab_size=300", "trainer.dense_baseline=false", "trainer.warmup_fraction=0",
            "trainer.threads=1", "trainer.progress=false", f"trainer.seq_len={args.seq_len}",
            f"diloco.inner_steps={args.inner_steps}", "launcher=spawn", "launcher.nproc=4", "launcher.timeout_s=600"]
    rounds = args.ddp_rounds if setting == "ddp" else args.rounds
    base += [f"trainer.rounds={rounds}", f"trainer.checkpoint_every={rounds}"]
    if setting == "ddp":
        return base + ["grid=dense", "launcher.group_size=4", f"trainer.batch_size={4 * args.batch_size}"]
    base += ["grid=2x2", f"trainer.batch_size={args.batch_size}"]
    if setting.startswith("streaming"):
        base += ["diloco.streaming=true", f"diloco.streaming_delay={args.delay}"]
    if setting.endswith("int4"):
        base += ["diloco.codec=int4", "diloco.error_feedback=true"]
    return base


def run_setting(setting: str, args: Any, root: Path, templates: dict[int, Path]) -> tuple[list[dict[str, Any]], Any]:
    """Train one setting in a fresh copy of its run directory; its metrics lines and run."""
    from dipaco.config import compose_config
    from dipaco.rounds import run_rank
    from dipaco.run.run_dir import RunDir
    from dipaco.runtime.launch import launch

    src = templates[1 if setting == "ddp" else 4]
    dst = root / f"{setting}-{len(list(root.iterdir()))}"
    shutil.copytree(src, dst)
    run = RunDir.at(dst)
    with WireMeter(run.metrics) as meter:
        launch(run_rank, compose_config(overrides(setting, args), run.root), run)
    lines = [json.loads(x) for x in run.metrics.read_text().splitlines() if x.strip()]
    for line, wire in zip(lines, meter.per_round()):
        line["wire_bytes"] = wire
    return lines, run


def summarise(lines: list[dict[str, Any]]) -> dict[str, float]:
    """Medians over the steady rounds (module doc)."""
    steady = lines[1:-1] or lines
    med = lambda f: statistics.median(f(x) for x in steady)  # noqa: E731
    return {"wall_s": med(lambda x: x["compute_s"] + x["wait_s"] + x["sync_s"]),
            "stood_s": med(lambda x: x["sync_s"]), "wait_s": med(lambda x: x["wait_s"]),
            "blocked_s": med(lambda x: x.get("blocked_s", 0.0)), "bytes": med(lambda x: x["bytes_sent"]),
            "peak_inflight": med(lambda x: x.get("inflight_peak_bytes", 0)),
            "wire": med(lambda x: x.get("wire_bytes", 0))}


def ddp_bytes_per_round(args: Any, root: Path) -> int:
    """Bytes DDP of one path model sends per H steps over the 4 ranks, all ranks
    (:func:`dipaco.plan.build.build_comm_plan`: a ring all-reduce of the path's fp32
    gradients per step)."""
    from dipaco.config import compose_config
    from dipaco.plan.build import build_comm_plan

    return build_comm_plan(compose_config(overrides("sync", args), str(root / "plan")), 4).ddp_bytes_per_round


def exposed(setting: str, s: dict[str, float], free: dict[str, float]) -> float:
    """What the link cost the inner loop per round (module doc): DiLoCo, the time it stood
    at sync points beyond what it stands on the free link; DDP, whose all-reduce runs
    inside every inner step, its wall time beyond the free link's."""
    key = "wall_s" if setting == "ddp" else "stood_s"
    return max(0.0, s[key] - free[key])


def probe(args: Any) -> dict[str, Any]:
    """``--probe-bytes N``: the shaper alone (:func:`benchmarks.link_wire.transfer_times`):
    N bytes after the link idled and right behind another N, per rate; ``burst_passed``
    is what the idle transfer got through beyond the rate (N − rate × its seconds)."""
    rows = []
    try:
        for rate in args.rates:
            shape(rate, args.burst)
            t = transfer_times(args.probe_bytes)
            at_rate = args.probe_bytes / (rate * 1e6 / 8)
            rows.append({"rate_mbit": rate, "burst": args.burst, "bytes": args.probe_bytes, "at_rate_s": at_rate,
                         **t, "burst_passed": args.probe_bytes - t["idle_s"] * rate * 1e6 / 8})
            print(rows[-1], flush=True)
    finally:
        shape(None)
    return {"probe": rows}


def inside(args: Any) -> dict[str, Any]:
    """The measurements, in the namespace."""
    _sh("ip", "link", "set", "lo", "up")
    _sh("ip", "link", "set", "lo", "mtu", "9000")
    if args.probe_bytes:
        return probe(args)
    root = work_dir("link", args.work_dir)
    templates = {p: build_run(root / f"template{p}", p).root for p in (1, 4)}
    runs = root / "runs"
    runs.mkdir()
    rows, base, record = [], {}, None
    ddp_bytes = ddp_bytes_per_round(args, root)
    try:
        for rate in [None, *args.rates]:
            shape(rate, args.burst)
            for setting in args.settings:
                lines, run = run_setting(setting, args, runs, templates)
                s = summarise(lines)
                if setting == "sync" and record is None:
                    record = round_record_proxy(run)
                if setting == "ddp":  # its all-reduces are the learner's, uncounted by the sync: as planned
                    s["bytes"] = ddp_bytes
                s["compute_s"] = s["wall_s"] - s["stood_s"] - s["wait_s"]
                if rate is None:
                    base[setting] = s
                s["exposed_s"] = exposed(setting, s, base[setting])
                rows.append({"rate_mbit": rate or "unshaped", "setting": setting, **s,
                             "sync_share": s["stood_s"] / s["wall_s"] if s["wall_s"] else 0.0,
                             "wire_ratio": s["wire"] / s["bytes"] if s["bytes"] else None})
                print(rows[-1], flush=True)
        # the control collectives of a synchronous round, alone on the unshaped link
        control = control_bytes(record["record"], world=4) if record else {}
    finally:
        shape(None)
        if not args.keep_runs:
            shutil.rmtree(root, ignore_errors=True)
    for r in rows:  # streaming's exposed time against synchronous DiLoCo's at the same rate
        sync = next((x for x in rows if x["rate_mbit"] == r["rate_mbit"] and x["setting"] == "sync"), None)
        r["hidden"] = (1 - r["exposed_s"] / sync["exposed_s"]) if sync and r["setting"].startswith("streaming") \
            and sync["exposed_s"] > 0 else None
    return {"rows": rows, "control_bytes_per_round": control,
            "round_record_json_bytes": record["json_bytes"] if record else None}


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    ap = base_parser(__doc__ or "")
    ap.add_argument("--rates", type=float, nargs="*", default=[4.0, 40.0],
                    help="Mbit/s of the shaped loopback (none: the unshaped link only)")
    ap.add_argument("--inner-steps", type=int, default=16, help="H")
    ap.add_argument("--delay", type=int, default=4, help="diloco.streaming_delay (τ)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--ddp-rounds", type=int, default=3, help="DDP's rounds (of H steps; slow on a slow link)")
    ap.add_argument("--batch-size", type=int, default=16, help="sequences per rank and step")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--keep-runs", action="store_true", help="keep the run directories")
    ap.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS),
                    help="the settings to train (default: all; sync is needed for the hidden share)")
    ap.add_argument("--burst", default="128kb", help="the shaper's token bucket (tc units; above the 9000-byte MTU)")
    ap.add_argument("--probe-bytes", type=int, default=0,
                    help="time N bytes on the shaped link alone, idle and back to back, instead of training")
    args = ap.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    load0 = load_average()
    if os.environ.get(INSIDE) == "1":
        payload = inside(args)
        if args.probe_bytes:
            print_table(payload["probe"], ["rate_mbit", "burst", "bytes", "at_rate_s", "idle_s", "behind_s",
                                           "burst_passed"], title="one message on the shaped loopback")
            write_result("link", {**payload, "args": vars(args)}, mode=args.mode, load_before=load0, out=args.out,
                         argv=argv)
            return payload
        print_table(payload["rows"], ["rate_mbit", "setting", "wall_s", "compute_s", "stood_s", "wait_s", "blocked_s",
                                      "exposed_s",
                                      "sync_share",
                                      "hidden", "bytes", "wire", "wire_ratio", "peak_inflight"],
                    title=f"4 gloo ranks on a shaped loopback, model=tiny, H={args.inner_steps}, τ={args.delay}")
        print_table([{"collective": k, "bytes": v} for k, v in payload["control_bytes_per_round"].items()],
                    ["collective", "bytes"], title="per call, 4 gloo ranks, loopback tx bytes (all ranks)")
        write_result("link", {**payload, "args": vars(args)}, mode=args.mode, load_before=load0, out=args.out,
                     argv=argv)
        return payload
    problem = shaping_problem()
    if problem is None:
        proc = subprocess.run(["unshare", "--net", sys.executable, "-m", "benchmarks.bench_link", *argv],
                              env={**os.environ, INSIDE: "1"})
        if proc.returncode == 0:
            return {"rc": 0}
        problem = f"the run in the namespace exited with {proc.returncode}"
    print(f"bench_link: skipped: cannot shape a link here ({problem})")
    return {"skipped": problem}


if __name__ == "__main__":
    main()
