"""Quality: validation perplexity of routed DiPaCo vs dense baselines on ``python_sources``.

    python -m benchmarks.bench_quality --quick   # tiny model, [2,2] grid, no (b) (~2-3 minutes)
    python -m benchmarks.bench_quality --full    # tiny model, [2,2] and [4,4], longer

For each grid, one ``dipaco.job.train.train`` run (with ``router.reroute_every``) gives:

* routed perplexity, and re-routed every W tokens (``summary.json`` ``rerouted_ppl``);
* (a) dense of one path's size at the same inner steps as a path (the trainer's
  ``dense_ppl``; ratio ``ratio_vs_dense``): the DiPaCo claim (equal inference cost);
* (b) dense of one path's size with the same total compute (P times the steps), trained
  here with ``dipaco.rounds.dense.train_dense`` on the run's own tokenizer, data and split
  (full mode only, or ``--equal-compute``: its P× steps were ~40% of the quick mode's time);
* (c) flat DiLoCo with P worker groups: not expressible by the trainer (a grid of ones has
  one path, and paths are the unit a worker group trains), recorded as not done.

Target: routed ÷ dense-equal-steps ≤ 0.85. Perplexity ratios are load-independent, so
this benchmark needs no interleaving; seed noise is the uncertainty (~15% in an earlier prototype).
"""
from __future__ import annotations

import copy
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from benchmarks.common import base_parser, load_average, print_table, verdict, work_dir, write_result

TARGET_VS_DENSE = 0.85

# Small enough that one model runs out of capacity within the run: that is where routing
# to specialists pays. Quick mode must stay within ~3 minutes on 2 idle cores
# (the suite's budget is 10): it leaves out the equal-compute dense model (b).
SIZES: dict[str, dict[str, Any]] = {
    "quick": {"grids": [[2, 2]], "rounds": 4, "inner_steps": 25, "max_documents": 2000, "equal_compute": False},
    "full": {"grids": [[2, 2], [4, 4]], "rounds": 8, "inner_steps": 50, "max_documents": 6000,
             "equal_compute": True},
}

FLAT_DILOCO_NOTE = ("not done: the trainer cannot express flat DiLoCo (P worker groups training one "
                    "shared model on random shards). A grid of ones has one path, a worker group "
                    "trains paths, and validate_config caps worker groups at the number of paths. "
                    "Needs e.g. a `router.method=random` + `grid.replicas=P` option in the trainer.")


def overrides_for(grid: Sequence[int], size: dict[str, Any], seed: int, reroute_every: int) -> list[str]:
    """Hydra overrides of one routed run (the printed command reproduces it)."""
    return [
        "data=python_sources",
        "model=tiny",
        f"grid.levels=[{','.join(str(k) for k in grid)}]",
        f"data.max_documents={size['max_documents']}",
        f"diloco.inner_steps={size['inner_steps']}",
        f"trainer.rounds={size['rounds']}",
        "trainer.warmup_steps=20",
        "trainer.eval_max_documents=200",
        f"router.reroute_every={reroute_every}",
        f"seed={seed}",
        "trainer.progress=false",
        "trainer.plots=false",
        "trainer.checkpoint_every=1000",
    ]


def dense_equal_compute(cfg: Any, run_dir: Path, num_paths: int) -> dict[str, Any]:
    """Dense of one path's size trained for P× a path's steps, evaluated like the baseline.

    Reuses the run's prepared data (tokenizer, split, router are reloaded from disk, so the
    validation documents are exactly those the routed model was scored on). The config is
    copied with P× the rounds so the cosine schedule spans the longer run.
    """
    from dipaco.rounds.dense import BASELINE_STREAM_ID, train_dense
    from dipaco.rounds.evaluate import evaluate_single
    from dipaco.job.prepare import prepare
    from dipaco.run.run_dir import RunDir
    from modules import PathModel

    long_cfg = copy.deepcopy(cfg)
    long_cfg.trainer.rounds = cfg.trainer.rounds * num_paths
    long_cfg.trainer.warmup_fraction = 0.0
    prep = prepare(long_cfg, RunDir.at(str(run_dir)))
    steps = long_cfg.trainer.rounds * long_cfg.diloco.inner_steps
    t0 = time.perf_counter()
    # a stream id of its own: it must not replay the equal-steps baseline's batches
    grid, stats = train_dense(long_cfg, prep.train_ids, prep.tokenizer.eos_id, steps=steps,
                              stream_id=BASELINE_STREAM_ID + 1, progress_desc="dense x P")
    seconds = time.perf_counter() - t0
    t = long_cfg.trainer
    ev = evaluate_single(prep.val_ids, PathModel(grid, 0), seq_len=t.seq_len,
                         prefix_tokens=long_cfg.router.prefix_tokens, batch_size=t.eval_batch_size)
    return {"steps": steps, "ppl": ev["ppl"], "train_loss": stats.loss, "seconds": seconds,
            "eval_tokens": ev["num_tokens"]}


def run_grid(grid: Sequence[int], size: dict[str, Any], seed: int, reroute_every: int,
             root: Path) -> dict[str, Any]:
    """One routed run plus the equal-compute dense model; the row of the table."""
    from dipaco.config import compose_config
    from dipaco.job.train import train

    overrides = overrides_for(grid, size, seed, reroute_every)
    run_dir = root / f"grid{'x'.join(map(str, grid))}_seed{seed}"
    cfg = compose_config(overrides, str(run_dir))
    s = train(cfg)
    num_paths = int(s["num_paths"])
    dense_p = (dense_equal_compute(cfg, run_dir, num_paths) if size["equal_compute"]
               else {"ppl": None, "steps": None, "seconds": 0.0})
    routed, dense = s["routed_ppl"], s["dense_ppl"]
    return {
        "grid": list(grid),
        "paths": num_paths,
        "seed": seed,
        "command": "dipaco-train " + " ".join(overrides) + " hydra.run.dir=RUN",
        "path_parameters": s["path_parameters"],
        "steps_per_path": s["rounds"] * s["inner_steps"],
        "routed_ppl": routed,
        "rerouted_ppl": s["rerouted_ppl"],
        "dense_equal_steps_ppl": dense,
        "dense_equal_compute_ppl": dense_p["ppl"],
        "dense_equal_compute_steps": dense_p["steps"],
        "routed_vs_dense_equal_steps": s["ratio_vs_dense"],
        "routed_vs_dense_equal_compute": routed / dense_p["ppl"] if dense_p["ppl"] else None,
        "rerouted_vs_routed_once": (s["rerouted_ppl"] / routed) if s["rerouted_ppl"] else None,
        "flat_diloco_ppl": None,
        "target_routed_vs_dense": TARGET_VS_DENSE,
        "verdict": verdict(s["ratio_vs_dense"], TARGET_VS_DENSE),
        "routing": s["routing"],
        "wall_s": s["wall_s"] + dense_p["seconds"],
    }


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    ap = base_parser(__doc__ or "")
    ap.add_argument("--seeds", type=int, nargs="+", default=None,
                    help="seeds (default: 0 in quick mode, 0 1 in full mode)")
    ap.add_argument("--grids", nargs="+", default=None, metavar="K,K",
                    help="grids to run, e.g. 2,2 4,4 (default: the mode's grids)")
    ap.add_argument("--reroute-every", type=int, default=64, help="W, tokens between re-routings")
    ap.add_argument("--keep-runs", action="store_true", help="keep the run directories")
    ap.add_argument("--equal-compute", action="store_true",
                    help="also train the equal-compute dense model (b) in quick mode")
    args = ap.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    load0 = load_average()
    size = dict(SIZES[args.mode])
    size["equal_compute"] = size["equal_compute"] or args.equal_compute
    if args.grids:
        size["grids"] = [[int(k) for k in g.split(",")] for g in args.grids]
    seeds = args.seeds or ([0] if args.mode == "quick" else [0, 1])
    root = work_dir("quality", args.work_dir)
    rows = []
    try:
        for grid in size["grids"]:
            for seed in seeds:
                rows.append(run_grid(grid, size, seed, args.reroute_every, root))
    finally:
        if not args.keep_runs and not args.work_dir:
            shutil.rmtree(root, ignore_errors=True)
    print()
    print_table(rows, ["grid", "seed", "steps_per_path", "routed_ppl", "dense_equal_steps_ppl",
                       "routed_vs_dense_equal_steps", "verdict", "dense_equal_compute_ppl",
                       "routed_vs_dense_equal_compute", "rerouted_vs_routed_once"],
                title=f"quality ({args.mode}): validation perplexity, python_sources, model=tiny; "
                      f"target routed / dense-equal-steps <= {TARGET_VS_DENSE}")
    print(f"flat DiLoCo baseline: {FLAT_DILOCO_NOTE}")
    payload = {"sizes": size, "seeds": seeds, "reroute_every": args.reroute_every, "rows": rows,
               "flat_diloco": FLAT_DILOCO_NOTE}
    write_result("quality", payload, mode=args.mode, load_before=load0, out=args.out, argv=argv)
    return payload


if __name__ == "__main__":
    main()
