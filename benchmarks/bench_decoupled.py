"""Synchronous rounds vs decoupled mode: routed loss at equal inner steps, and goodput,
over several seeds, with no slow worker and with one worker 3× slower.

    python -m benchmarks.bench_decoupled --quick   # model=tiny, [2,2], 6 phases of H=256, seeds 0 1 2
    python -m benchmarks.bench_decoupled --full    # 12 phases of H=384, and a fixed-H row
    python -m benchmarks.bench_decoupled --seeds 0 --settings slow --set staleness_power=0 \\
        --sync-from benchmarks/results/decoupled.json      # an ablation: decoupled side only

Per seed, both sides train the same 4 paths for the same number of inner steps
(``trainer.rounds`` phases of H steps each) on one prepared run directory (same
tokenizer, router, shards), with 4 single-threaded worker processes, and are scored on
the same held-out documents routed by the same router: every validation document of the
stdlib corpus (~300; ``data.max_train_documents`` keeps the training set at 300
documents, so the held-out set is not a slice of it):

* **sync**: the real job (``launcher=spawn``, 4 gloo ranks, one path each); in the
  ``slow`` setting rank 0 sleeps after each inner step for twice the step's duration
  (3× slower). The slow rank only waits, so sync's weights (and loss) are those of the
  ``none`` setting: sync runs once per seed, in the slowest setting asked for, and its
  loss serves both;
* **decoupled**: ``run_decoupled`` with 4 decoupled workers and 1 synchroniser; in the
  ``slow`` setting worker 0 is 3× slower in the same way. Workers are not bound to
  paths, so the fast ones take over the phases the slow one does not get to.

Reported per setting: decoupled − sync routed loss per seed, its mean and spread
(sample standard deviation, min, max), and each side's goodput. Targets: mean
difference ≤ 0.05 nats, decoupled goodput ≥ 0.8.

Goodput (both sides, same formula) = Σ seconds spent in inner phases whose update was
used ÷ (4 worker slots × the training window, first phase start → last phase end). In
sync mode the three fast ranks wait for the slow one every round, so goodput falls to
about (3·⅓ + 1)/4 = 0.5 and the wall time follows the slow rank.

``--set KEY=VALUE`` (repeatable) changes a ``diloco.decoupled`` setting of the decoupled
side, ``--override KEY=VALUE`` a config key of both sides; ``--sync-from FILE`` takes the
sync rows of an earlier result with the same sizes, seeds and overrides instead of
running sync again (the controlled experiments of docs/decoupled.md).
"""
from __future__ import annotations

import ast
import json
import math
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

from benchmarks.common import base_parser, load_average, print_table, verdict, work_dir, write_result
from dipaco.storage.strict_json import dumps_strict
from dipaco.storage.jsonl import append_json_lines

NAME = "decoupled"
TARGET_GOODPUT = 0.8
TARGET_LOSS_GAP = 0.05  # nats, the mean over seeds of decoupled − sync
SLOW_FACTOR = 3.0
SETTINGS = {"none": [], "slow": [0]}  # slow decoupled workers (sync: slow ranks) per setting
SIZES: dict[str, dict[str, Any]] = {
    "quick": {"rounds": 6, "inner_steps": 256, "fixed_h": False},
    "full": {"rounds": 12, "inner_steps": 384, "fixed_h": True},
}


def overrides(size: dict[str, Any], seed: int, extra: list[str]) -> list[str]:
    return ["experiment=smoke", "data.max_documents=null", "data.max_train_documents=300",
            "trainer.eval_max_documents=null", f"seed={seed}", f"trainer.rounds={size['rounds']}",
            f"diloco.inner_steps={size['inner_steps']}", "trainer.dense_baseline=false", "trainer.progress=false",
            "trainer.threads=1", "trainer.checkpoint_every=1000", *extra]


def slow_run_rank(cfg: Any, run: Any, rank: Optional[int], world: int, slow_ranks: list[int], factor: float,
                  times_dir: str) -> Any:
    """The rounds loop's rank body (``run_rank``), with ``slow_ranks`` made ``factor``× slower.

    Every rank logs (start, end) of each path turn, so goodput is computed from the
    same kind of timestamps as decoupled mode's phase events.
    """
    from dipaco.rounds import learner as learner_mod
    from dipaco.rounds import run_rank

    original = learner_mod.PathLearner.train_steps
    log = Path(times_dir) / f"rank{rank}.jsonl"

    def train_steps(self: Any, n: int, on_step: Any = None, **kw: Any) -> Any:
        last = [time.time()]

        def hook() -> None:
            if rank in slow_ranks:
                time.sleep((factor - 1.0) * (time.time() - last[0]))
            last[0] = time.time()
            if on_step is not None:
                on_step()

        t0 = time.time()
        stats = original(self, n, on_step=hook, **kw)
        stats.seconds = time.time() - t0
        append_json_lines(log, [{"start": t0, "end": time.time(), "path": self.path_id}])
        return stats

    learner_mod.PathLearner.train_steps = train_steps
    try:
        return run_rank(cfg, run, rank, world)
    finally:
        learner_mod.PathLearner.train_steps = original


def _reset(run_dir: Path) -> None:
    for name in ("checkpoints", "decoupled", "metrics.jsonl", "decoupled_metrics.json", "sync_times"):
        p = run_dir / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()


def _routed_loss(cfg: Any, run_dir: Path, ckpt: Path) -> tuple[float, int]:
    """Routed loss (nats per token) on every held-out document, and how many were scored."""
    from dipaco.job.prepare import prepare
    from dipaco.job.train import _evaluate
    from dipaco.run.run_dir import RunDir

    run = RunDir.at(run_dir)
    prep = prepare(cfg, run)
    return math.log(_evaluate(cfg, run, prep, ckpt)["once"]["ppl"]), len(prep.eval_ids)


def run_sync(run_dir: Path, size: dict[str, Any], seed: int, setting: str, extra: list[str]) -> dict[str, Any]:
    from benchmarks.bench_decoupled import slow_run_rank as fn  # importable by spawned ranks
    from dipaco.config import compose_config
    from dipaco.run.run_dir import RunDir
    from dipaco.runtime.launch import launch

    _reset(run_dir)
    times = run_dir / "sync_times"
    times.mkdir()
    cfg = compose_config(overrides(size, seed, extra) + ["launcher=spawn", "launcher.nproc=4"], run_dir)
    load, t0 = load_average(), time.time()
    result = launch(fn, cfg, RunDir.at(run_dir), SETTINGS[setting], SLOW_FACTOR, str(times))
    wall = time.time() - t0
    turns = [json.loads(line) for f in times.glob("rank*.jsonl") for line in f.read_text().splitlines()]
    window = max(t["end"] for t in turns) - min(t["start"] for t in turns)
    useful = sum(t["end"] - t["start"] for t in turns)
    loss, docs = _routed_loss(cfg, run_dir, Path(result.checkpoint))
    return {"side": "sync", "seed": seed, "setting": setting, "wall_s": wall, "train_window_s": window,
            "goodput": useful / (4 * window), "inner_steps": len(turns) * size["inner_steps"],
            "routed_loss": loss, "eval_documents": docs, "load": load}


def run_dec(run_dir: Path, size: dict[str, Any], seed: int, setting: str, extra: list[str],
            side: str = "decoupled", **settings: Any) -> dict[str, Any]:
    from dipaco.config import compose_config
    from dipaco.decoupled.run import decoupled_config, run_decoupled
    from dipaco.run.run_dir import RunDir

    _reset(run_dir)
    cfg = compose_config(overrides(size, seed, extra) + ["diloco.mode=decoupled"], run_dir)
    dcfg = decoupled_config(cfg)
    for key, value in {"workers": 4, "slow_workers": SETTINGS[setting], "slow_factor": SLOW_FACTOR,
                       **settings}.items():
        setattr(dcfg, key, value)
    load, t0 = load_average(), time.time()
    res = run_decoupled(cfg, RunDir.at(run_dir), dcfg)
    wall = time.time() - t0
    m = res.decoupled
    loss, docs = _routed_loss(cfg, run_dir, Path(res.checkpoint))
    return {"side": side, "seed": seed, "setting": setting, "wall_s": wall, "train_window_s": m["wall_s"],
            "goodput": m["goodput"], "step_goodput": m["step_goodput"], "inner_steps": m["useful_inner_steps"],
            "staleness_histogram": m["staleness_histogram"], "module_versions": m["module_versions"],
            "dropped": m["dropped"], "ledger_ok": m["ledger_ok"], "routed_loss": loss, "eval_documents": docs,
            "load": load}


def summarise(rows: list[dict[str, Any]], setting: str, side: str = "decoupled") -> dict[str, Any]:
    """Decoupled − sync routed loss per seed (sync's loss of the seed, whatever setting it
    ran in: see the module doc), its mean and spread, and each side's mean goodput."""
    sync = {r["seed"]: r for r in rows if r["side"] == "sync"}
    dec = [r for r in rows if r["side"] == side and r["setting"] == setting and r["seed"] in sync]
    diffs = [r["routed_loss"] - sync[r["seed"]]["routed_loss"] for r in dec]
    sync_goodput = [r["goodput"] for r in sync.values() if r["setting"] == setting]
    out = {"setting": setting, "side": side, "seeds": [r["seed"] for r in dec], "loss_difference_nats": diffs,
           "mean": statistics.mean(diffs) if diffs else None,
           "stdev": statistics.stdev(diffs) if len(diffs) > 1 else None,
           "min": min(diffs, default=None), "max": max(diffs, default=None),
           "decoupled_goodput": statistics.mean(r["goodput"] for r in dec) if dec else None,
           "sync_goodput": statistics.mean(sync_goodput) if sync_goodput else None,
           "window_speedup": (statistics.mean(s["train_window_s"] / r["train_window_s"] for r in dec
                                              for s in [sync[r["seed"]]]) if dec and sync_goodput else None)}
    out["verdict_loss"] = verdict(out["mean"], TARGET_LOSS_GAP)
    out["verdict_goodput"] = verdict(out["decoupled_goodput"], TARGET_GOODPUT, at_most=False)
    return out


def _value(text: str) -> Any:
    """A ``--set`` value: a Python literal (numbers, lists, None, True/False), else the string."""
    try:
        return ast.literal_eval({"null": "None", "true": "True", "false": "False"}.get(text, text))
    except (ValueError, SyntaxError):
        return text


def _sync_rows(path: Optional[str], size: dict[str, Any], extra: list[str]) -> list[dict[str, Any]]:
    if path is None:
        return []
    got = json.loads(Path(path).read_text())
    if got["sizes"]["rounds"] != size["rounds"] or got["sizes"]["inner_steps"] != size["inner_steps"] \
            or got.get("overrides", []) != extra:
        raise SystemExit(f"--sync-from {path}: its sizes or overrides differ from this run's")
    return [r for r in got["rows"] if r["side"] == "sync"]


def main(argv: Optional[list[str]] = None) -> int:
    ap = base_parser(__doc__)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="training seeds (default 0 1 2)")
    ap.add_argument("--settings", default="none,slow", help="comma-separated: none (no slow worker), slow (one 3x)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a diloco.decoupled setting")
    ap.add_argument("--override", action="append", default=[], metavar="KEY=VALUE", help="a config key, both sides")
    ap.add_argument("--sync-from", default=None, help="reuse the sync rows of this result JSON")
    ap.add_argument("--fixed-h", action="store_true", help="also run decoupled with fixed H")
    args = ap.parse_args(argv)
    size = dict(SIZES[args.mode])
    size["fixed_h"] = size["fixed_h"] or args.fixed_h
    settings = [s for s in args.settings.split(",") if s]
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        raise SystemExit(f"--settings: unknown {unknown}; valid: {sorted(SETTINGS)}")
    dset = {k: _value(v) for k, v in (kv.split("=", 1) for kv in args.set)}
    load0 = load_average()
    from dipaco.config import compose_config
    from dipaco.job.prepare import prepare
    from dipaco.run.run_dir import RunDir

    root = work_dir(NAME, args.work_dir)
    rows = [r for r in _sync_rows(args.sync_from, size, args.override) if r["seed"] in args.seeds]
    sync_setting = "slow" if "slow" in settings else "none"
    for seed in args.seeds:
        run_dir = root / f"seed{seed}"
        run_dir.mkdir(parents=True, exist_ok=True)
        # tokenizer, router, shards once per seed: both sides train and score on the same ones
        prepare(compose_config(overrides(size, seed, args.override), run_dir), RunDir.at(run_dir))
        if not any(r["seed"] == seed for r in rows):
            rows.append(run_sync(run_dir, size, seed, sync_setting, args.override))
        for setting in settings:
            rows.append(run_dec(run_dir, size, seed, setting, args.override, **dset))
            if size["fixed_h"]:
                rows.append(run_dec(run_dir, size, seed, setting, args.override, "decoupled, fixed H",
                                    **{**dset, "dynamic_steps": False, "pull_wait_fraction": None}))
        print_table([r for r in rows if r["seed"] == seed],
                    ["side", "setting", "wall_s", "train_window_s", "goodput", "inner_steps", "routed_loss", "load"],
                    title=f"\nseed {seed}: 4 paths x {size['rounds']} phases x H={size['inner_steps']}")
    sides = ["decoupled"] + (["decoupled, fixed H"] if size["fixed_h"] else [])
    summary = [summarise(rows, s, side) for s in settings for side in sides]
    print_table(summary, ["setting", "side", "mean", "stdev", "min", "max", "decoupled_goodput", "sync_goodput"],
                title=f"\ndecoupled - sync routed loss (nats), seeds {args.seeds}")
    print(dumps_strict({"summary": summary, "set": dset}, indent=2))
    write_result(NAME, {"sizes": size, "slow_factor": SLOW_FACTOR, "seeds": args.seeds, "settings": settings,
                        "set": dset, "overrides": args.override, "rows": rows, "summary": summary},
                 mode=args.mode, load_before=load0, out=args.out, argv=argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
