"""Communication: bytes on the wire per round and per token, DiPaCo vs DDP, per codec.

    python -m benchmarks.bench_comm --quick   # plans for [2,2] and [4,4], measured tiny runs
    python -m benchmarks.bench_comm --full    # also [8,8]; measured runs of more rounds

Two sources, which must agree:

* planned: ``dipaco.plan.comm_plan.plan_round`` for one worker group per path (world size
  = P, G = 1), model=small, H = 50; the DDP equivalent is the same path model trained
  data parallel over the same P ranks, all-reducing every gradient every inner step.
* measured: short real runs (local backend, model=tiny) per codec; the local backend
  counts the bytes exactly as a deployment with one worker group per path would send
  them (``summary.json`` ``bytes_sent``; per module in ``metrics.jsonl``).

Per token: bytes per round ÷ training tokens per round (P paths × H × batch × seq_len),
the same tokens for DiPaCo and DDP. Target: int8 at H=50 ≤ 1/200 of DDP. The per-module
table shows each module's traffic stays inside its sharers: a module's group is exactly
the worker groups of the paths that contain it, and a module no other path shares sends
nothing. Byte counts are load-independent: no interleaving is needed here.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from benchmarks.common import (base_parser, load_average, print_table, reuse_preparation, verdict, work_dir,
                               write_result)

CODECS = ("none", "fp16", "int8", "topk")
TARGET_INT8 = 1 / 200
H = 50

SIZES: dict[str, dict[str, Any]] = {
    "quick": {"plan_grids": [[2, 2], [4, 4]], "measured_grid": [2, 2], "rounds": 2, "inner_steps": 4},
    "full": {"plan_grids": [[2, 2], [4, 4], [8, 8]], "measured_grid": [4, 4], "rounds": 3, "inner_steps": 10},
}


def plan_for(grid: Sequence[int], codec: str, inner_steps: int, model: str = "small") -> tuple[Any, Any, Any]:
    """(plan, topology, config) for one worker group per path, as the job builds them."""
    from dipaco.plan.build import build_grid
    from dipaco.plan.comm_plan import plan_round
    from dipaco.config import codec_kwargs, compose_config
    from dipaco.plan.codecs import make_codec
    from dipaco.plan.topology import Topology

    cfg = compose_config([f"model={model}", f"grid.levels=[{','.join(map(str, grid))}]",
                          f"diloco.codec={codec}", f"diloco.inner_steps={inner_steps}"])
    mgrid = build_grid(cfg)
    topo = Topology.from_grid(mgrid, mgrid.num_paths, 1)
    counts = {m: mgrid.param_count(m) for m in mgrid.module_ids}
    plan = plan_round(topo, counts, make_codec(codec, **codec_kwargs(cfg.diloco)), inner_steps,
                      cfg.diloco.lossy_exchange)
    return plan, topo, cfg


def planned_rows(grids: Sequence[Sequence[int]]) -> list[dict[str, Any]]:
    rows = []
    for grid in grids:
        for codec in CODECS:
            plan, topo, cfg = plan_for(grid, codec, H)
            tokens = topo.num_paths * H * cfg.trainer.batch_size * cfg.trainer.seq_len
            ratio = plan.bytes_per_round / plan.ddp_bytes_per_round
            rows.append({
                "grid": list(grid), "paths": topo.num_paths, "codec": codec, "H": H,
                "path_params": int(plan.path_params),
                "bytes_per_round": plan.bytes_per_round,
                "ddp_bytes_per_round": plan.ddp_bytes_per_round,
                "bytes_per_token": plan.bytes_per_round / tokens,
                "ddp_bytes_per_token": plan.ddp_bytes_per_round / tokens,
                "ratio_vs_ddp": ratio, "one_over_ratio": 1 / ratio if ratio else None,
                "target": TARGET_INT8 if codec == "int8" else None,
                "verdict": verdict(ratio, TARGET_INT8) if codec == "int8" else "",
            })
    return rows


def sharer_rows(grid: Sequence[int]) -> tuple[list[dict[str, Any]], bool]:
    """Per module: its sharers, its module group, and whether the two coincide."""
    plan, topo, _ = plan_for(grid, "int8", H)
    rows, all_ok = [], True
    for m in plan.modules:
        expected = sorted({topo.group_of_path(p) for p in m.sharers})
        # a module's traffic is confined to its sharers iff its module group is exactly the
        # groups of the paths containing it, and a module held by one group sends nothing
        ok = list(m.groups) == expected and (len(m.groups) > 1 or m.bytes_total == 0)
        all_ok &= ok
        rows.append({"module": m.module_id, "sharing_paths": len(m.sharers),
                     "module_group": ",".join(map(str, m.groups)) if len(m.groups) <= 8
                     else f"{len(m.groups)} groups",
                     "of_world": topo.world_size, "bytes_total": m.bytes_total,
                     "only_sharers": ok})
    return rows, all_ok


def measured_rows(grid: Sequence[int], rounds: int, inner_steps: int, root: Path) -> list[dict[str, Any]]:
    """Real short runs per codec: measured bytes vs the plan of the same config."""
    from dipaco.plan.build import build_comm_plan
    from dipaco.config import compose_config
    from dipaco.job.train import train

    rows = []
    first: Optional[Path] = None
    for codec in CODECS:
        overrides = ["data=python_sources", "model=tiny", f"grid.levels=[{','.join(map(str, grid))}]", "data.max_documents=1500",
                     f"data.cache_dir={root / 'cache'}",
                     f"diloco.codec={codec}", f"diloco.inner_steps={inner_steps}", f"trainer.rounds={rounds}",
                     "trainer.batch_size=8", "trainer.seq_len=64", "router.prefix_tokens=16",
                     "trainer.dense_baseline=false", "trainer.eval_max_documents=16",
                     "trainer.progress=false", "trainer.plots=false"]
        run_dir = root / f"comm_{codec}"
        if first is not None:  # same corpus, grid and seed: only the codec differs
            reuse_preparation(first, run_dir)
        first = first or run_dir
        cfg = compose_config(overrides, str(run_dir))
        s = train(cfg)
        plan = build_comm_plan(cfg, 1)
        lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        per_module_ok = all(
            line["modules"][m.module_id]["bytes_sent"] == m.bytes_total
            and line["modules"][m.module_id]["contributions"] in (len(m.sharers), 0)
            for line in lines for m in plan.modules)
        planned = plan.bytes_per_round * rounds
        rows.append({
            "grid": list(grid), "codec": codec, "H": inner_steps, "rounds": rounds,
            "measured_bytes": s["bytes_sent"], "planned_bytes": planned,
            "measured_equals_plan": s["bytes_sent"] == planned,
            "per_module_equals_plan": per_module_ok,
            "ddp_bytes": s["ddp_bytes_equivalent"],
            "measured_bytes_per_token": s["bytes_sent"] / max(1, s["train_tokens"]),
            "ratio_vs_ddp": s["bytes_ratio_vs_ddp"],
            "command": "dipaco-train " + " ".join(overrides) + " hydra.run.dir=RUN",
        })
    return rows


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    ap = base_parser(__doc__ or "")
    ap.add_argument("--keep-runs", action="store_true", help="keep the run directories")
    args = ap.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    load0 = load_average()
    size = SIZES[args.mode]

    planned = planned_rows(size["plan_grids"])
    print_table(planned, ["grid", "codec", "H", "path_params", "bytes_per_round", "ddp_bytes_per_round",
                          "bytes_per_token", "ddp_bytes_per_token", "ratio_vs_ddp", "one_over_ratio", "verdict"],
                title=f"planned (model=small, one worker group per path, H={H}); "
                      f"target int8 <= 1/{int(1 / TARGET_INT8)} of DDP")
    sharers, sharers_ok = sharer_rows(size["plan_grids"][-1])
    print()
    print_table(sharers, ["module", "sharing_paths", "module_group", "of_world", "bytes_total", "only_sharers"],
                title=f"per-module groups, grid {size['plan_grids'][-1]}, int8 (each module talks only to its sharers)")

    root = work_dir("comm", args.work_dir)
    try:
        measured = measured_rows(size["measured_grid"], size["rounds"], size["inner_steps"], root)
    finally:
        if not args.keep_runs and not args.work_dir:
            shutil.rmtree(root, ignore_errors=True)
    print()
    print_table(measured, ["grid", "codec", "H", "rounds", "measured_bytes", "planned_bytes",
                           "measured_equals_plan", "per_module_equals_plan", "measured_bytes_per_token",
                           "ratio_vs_ddp"],
                title="measured (real local-backend runs, model=tiny; DDP ratio at this run's small H)")
    payload = {"H": H, "target_int8_ratio": TARGET_INT8, "planned": planned, "sharers": sharers,
               "sharers_ok": sharers_ok, "measured": measured}
    write_result("comm", payload, mode=args.mode, load_before=load0, out=args.out, argv=argv)
    return payload


if __name__ == "__main__":
    main()
