"""Synchronous rounds vs decoupled mode with one artificially slow decoupled worker (3× slower).

    python -m benchmarks.bench_decoupled --quick   # model=tiny, [2,2], 6 phases of H=256
    python -m benchmarks.bench_decoupled --full    # 12 phases of H=384

Both sides train the same 4 paths for the same number of inner steps (``trainer.rounds``
phases of H steps each) on one prepared run directory (same tokenizer, router, shards),
with 4 single-threaded worker processes:

* **sync**: the real job (``launcher=spawn``, 4 gloo ranks, one path each); rank 0
  sleeps after each inner step for twice the step's duration (3× slower);
* **decoupled**: ``run_decoupled`` with 4 decoupled workers and 1 synchroniser; worker 0 is 3×
  slower in the same way. Learners are not bound to paths, so the fast ones take over
  the phases the slow one does not get to. Two rows: the defaults (dynamic local
  updates: the slow worker runs ~H/3 steps per phase), and fixed H for every phase
  (``dynamic_steps=false``, the waiting cap off), to show what dynamic steps buy (full
  mode or ``--fixed-h`` only: a third run is a third of the time, and the suite's quick
  budget is 10 minutes).

Phases are ~2–3 s here (H=256 steps of the tiny model on a shared core): shorter ones
would measure store and process-scheduling overheads that real phases (minutes) hide.

Goodput (both sides, same formula) = Σ seconds spent in inner phases whose update was
used ÷ (4 worker slots × the training window, first phase start → last phase end). In
sync mode the three fast ranks wait for the slow one every round, so goodput falls to
about (3·⅓ + 1)/4 = 0.5 and the wall time follows the slow rank. Target: decoupled
goodput ≥ 0.8. The routed validation loss of both is reported (same inner steps).
"""
from __future__ import annotations

import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Optional

from benchmarks.common import base_parser, load_average, print_table, verdict, work_dir, write_result
from dipaco.storage.strict_json import dumps_strict
from dipaco.storage.jsonl import append_json_lines

NAME = "decoupled"
TARGET_GOODPUT = 0.8
SLOW_FACTOR = 3.0
SIZES: dict[str, dict[str, Any]] = {
    "quick": {"rounds": 6, "inner_steps": 256, "fixed_h": False},
    "full": {"rounds": 12, "inner_steps": 384, "fixed_h": True},
}


def overrides(size: dict[str, Any]) -> list[str]:
    return ["experiment=smoke", "data.max_documents=300", f"trainer.rounds={size['rounds']}",
            f"diloco.inner_steps={size['inner_steps']}", "trainer.dense_baseline=false", "trainer.progress=false",
            "trainer.threads=1", "trainer.checkpoint_every=1000"]


def slow_run_rank(cfg: Any, run: Any, rank: Optional[int], world: int, slow_rank: int, factor: float,
                  times_dir: str) -> Any:
    """The rounds loop's rank body (``run_rank``), with rank ``slow_rank`` made ``factor``× slower.

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
            if rank == slow_rank:
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
    for name in ("checkpoints", "decoupled", "metrics.jsonl", "decoupled_metrics.json"):
        p = run_dir / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()


def _routed_loss(cfg: Any, run_dir: Path, ckpt: Path) -> float:
    from dipaco.job.prepare import prepare
    from dipaco.run.run_dir import RunDir
    from dipaco.job.train import _evaluate

    run = RunDir.at(run_dir)
    return math.log(_evaluate(cfg, run, prepare(cfg, run), ckpt)["once"]["ppl"])


def run_sync(run_dir: Path, size: dict[str, Any]) -> dict[str, Any]:
    from benchmarks.bench_decoupled import slow_run_rank as fn  # importable by spawned ranks
    from dipaco.config import compose_config
    from dipaco.runtime.launch import launch
    from dipaco.run.run_dir import RunDir

    _reset(run_dir)
    times = run_dir / "sync_times"
    shutil.rmtree(times, ignore_errors=True)
    times.mkdir()
    cfg = compose_config(overrides(size) + ["launcher=spawn", "launcher.nproc=4"], run_dir)
    t0 = time.time()
    result = launch(fn, cfg, RunDir.at(run_dir), 0, SLOW_FACTOR, str(times))
    wall = time.time() - t0
    turns = [json.loads(line) for f in times.glob("rank*.jsonl") for line in f.read_text().splitlines()]
    window = max(t["end"] for t in turns) - min(t["start"] for t in turns)
    useful = sum(t["end"] - t["start"] for t in turns)
    return {"side": "sync", "wall_s": wall, "train_window_s": window, "goodput": useful / (4 * window),
            "inner_steps": len(turns) * size["inner_steps"],
            "routed_loss": _routed_loss(cfg, run_dir, Path(result.checkpoint))}


def run_dec(run_dir: Path, size: dict[str, Any], side: str = "decoupled", **settings: Any) -> dict[str, Any]:
    from dipaco.config import compose_config
    from dipaco.config.decoupled import DecoupledConfig
    from dipaco.decoupled.run import run_decoupled
    from dipaco.run.run_dir import RunDir

    _reset(run_dir)
    cfg = compose_config(overrides(size) + ["diloco.mode=decoupled"], run_dir)
    t0 = time.time()
    res = run_decoupled(cfg, RunDir.at(run_dir),
                        DecoupledConfig(workers=4, slow_workers=[0], slow_factor=SLOW_FACTOR, **settings))
    wall = time.time() - t0
    m = res.decoupled
    return {"side": side, "wall_s": wall, "train_window_s": m["wall_s"], "goodput": m["goodput"],
            "step_goodput": m["step_goodput"], "inner_steps": m["useful_inner_steps"],
            "staleness_histogram": m["staleness_histogram"], "module_versions": m["module_versions"],
            "dropped": m["dropped"], "ledger_ok": m["ledger_ok"],
            "routed_loss": _routed_loss(cfg, run_dir, Path(res.checkpoint))}


def main(argv: Optional[list[str]] = None) -> int:
    ap = base_parser(__doc__)
    ap.add_argument("--fixed-h", action="store_true", help="also run decoupled with fixed H in quick mode")
    args = ap.parse_args(argv)
    size = dict(SIZES[args.mode])
    size["fixed_h"] = size["fixed_h"] or args.fixed_h
    load0 = load_average()
    from dipaco.config import compose_config
    from dipaco.job.prepare import prepare
    from dipaco.run.run_dir import RunDir

    run_dir = work_dir(NAME, args.work_dir) / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    prepare(compose_config(overrides(size), run_dir), RunDir.at(run_dir))  # tokenizer, router, shards once
    rows = [run_sync(run_dir, size), run_dec(run_dir, size)]
    if size["fixed_h"]:
        rows.append(run_dec(run_dir, size, "decoupled, fixed H", dynamic_steps=False, pull_wait_fraction=None))
    sync, dec = rows[:2]
    print_table(rows, ["side", "wall_s", "train_window_s", "goodput", "inner_steps", "routed_loss"],
                title=f"\none decoupled worker {SLOW_FACTOR:g}x slower, 4 paths x {size['rounds']} phases x H={size['inner_steps']}")
    headline = {
        "decoupled_goodput": dec["goodput"],
        "sync_goodput": sync["goodput"],
        "window_speedup": sync["train_window_s"] / dec["train_window_s"],
        "wall_speedup": sync["wall_s"] / dec["wall_s"],
        "loss_difference_nats": dec["routed_loss"] - sync["routed_loss"],
        "fixed_h_goodput": rows[2]["goodput"] if size["fixed_h"] else None,
        "target_goodput": TARGET_GOODPUT,
        "verdict": verdict(dec["goodput"], TARGET_GOODPUT, at_most=False),
    }
    print(dumps_strict(headline, indent=2))
    write_result(NAME, {"sizes": size, "slow_factor": SLOW_FACTOR, "rows": rows, "headline": headline},
                 mode=args.mode, load_before=load0, out=args.out, argv=argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
