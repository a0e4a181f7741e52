"""Memory: peak RSS of one rank vs the size of its path, for growing grids.

    python -m benchmarks.bench_memory --quick   # model=base; grids [1,1] [2,2] [4,4] [8,8]
    python -m benchmarks.bench_memory --full    # also [16,16], 2 repeats per case

Each case runs in a fresh process (peak RSS is a high-water mark, so processes must not
be reused) that does what a rank of a worker group does for its path: build the
``ModuleGrid`` (modules are built lazily), a ``PathModel`` for path 0, an AdamW, and a
few training steps. It reports ``ru_maxrss`` after the imports and at the end. The path
state is parameters + gradients + the two AdamW moments = 16 bytes per parameter.

For contrast, one case builds every module of the largest grid (what a process that
materialised the whole grid would hold). Target: a rank's peak RSS does not grow with
the number of modules in the grid. Cases run one after another (RSS is not a timing,
so load matters little; repeats in full mode show the spread).
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
from typing import Any, Optional, Sequence

from benchmarks.common import base_parser, load_average, print_table, write_result
from dipaco.storage.strict_json import dumps_strict

SIZES: dict[str, dict[str, Any]] = {
    "quick": {"model": "base", "grids": [[1, 1], [2, 2], [4, 4], [8, 8]], "repeats": 1},
    "full": {"model": "base", "grids": [[1, 1], [2, 2], [4, 4], [8, 8], [16, 16]], "repeats": 2},
}
# grows by less than this from the smallest to the largest grid: "does not grow"
FLAT_TOLERANCE = 0.05


def child(model_name: str, grid: list[int], whole_grid: bool, steps: int = 3) -> dict[str, Any]:
    """Body of one measuring process; returns its RSS facts (KiB on Linux)."""
    import resource

    import torch
    import torch.nn.functional as F

    from dipaco.config import compose_config
    from modules import ModuleGrid, PathModel

    torch.set_num_threads(1)  # a rank of 4 on this host; threads do not change RSS much
    cfg = compose_config([f"model={model_name}"])
    after_imports = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    mgrid = ModuleGrid(cfg.model, grid, seed=0)
    if whole_grid:
        for m in mgrid.module_ids:
            mgrid.module(m)  # materialise every module, as a naive implementation would
    model = PathModel(mgrid, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, cfg.model.vocab_size, (cfg.trainer.batch_size, cfg.trainer.seq_len))
    for _ in range(steps):
        loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    path_params = sum(p.numel() for p in model.parameters())
    built = sum(p.numel() for m in mgrid.built_modules().values() for p in m.parameters())
    return {"after_imports_kib": after_imports, "peak_kib": peak, "path_params": path_params,
            "built_params": built, "grid_params": mgrid.total_param_count(), "modules": len(mgrid.module_ids)}


def run_case(model_name: str, grid: list[int], whole_grid: bool) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.bench_memory", "--child",
           dumps_strict({"model": model_name, "grid": grid, "whole_grid": whole_grid})]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    ap = base_parser(__doc__ or "")
    ap.add_argument("--child", default=None, help=argparse_suppress())
    args = ap.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        print(dumps_strict(child(spec["model"], spec["grid"], spec["whole_grid"])))
        return {}
    argv = list(sys.argv[1:] if argv is None else argv)
    load0 = load_average()
    size = SIZES[args.mode]
    cases = [(g, False) for g in size["grids"]] + [(size["grids"][-1], True)]
    rows = []
    for grid, whole in cases:
        samples = [run_case(size["model"], grid, whole) for _ in range(size["repeats"])]
        s0 = samples[0]
        peak_mib = statistics.median(s["peak_kib"] for s in samples) / 1024
        base_mib = statistics.median(s["after_imports_kib"] for s in samples) / 1024
        rows.append({
            "case": f"{'whole grid' if whole else 'one path'} {grid}", "grid": grid, "whole_grid": whole,
            "modules": s0["modules"], "grid_params": s0["grid_params"], "path_params": s0["path_params"],
            "built_params": s0["built_params"],
            "path_state_mib": 16 * s0["path_params"] / 2**20,
            "peak_rss_mib": peak_mib, "after_imports_mib": base_mib, "above_imports_mib": peak_mib - base_mib,
            "samples": samples,
        })
    paths = [r for r in rows if not r["whole_grid"]]
    growth = paths[-1]["peak_rss_mib"] / paths[0]["peak_rss_mib"]
    for r in rows:
        r["peak_vs_smallest_grid"] = r["peak_rss_mib"] / paths[0]["peak_rss_mib"]
    print_table(rows, ["case", "modules", "grid_params", "path_params", "built_params", "path_state_mib",
                       "after_imports_mib", "peak_rss_mib", "above_imports_mib", "peak_vs_smallest_grid"],
                title=f"memory ({args.mode}): model={size['model']}, one process per case, peak RSS (ru_maxrss)")
    flat = growth <= 1 + FLAT_TOLERANCE
    print(f"one path's peak RSS, largest ÷ smallest grid: {growth:.3f} "
          f"({'flat' if flat else 'GROWS'}; tolerance {FLAT_TOLERANCE:.0%})")
    payload = {"model": size["model"], "rows": rows, "growth_largest_vs_smallest": growth,
               "flat": flat, "tolerance": FLAT_TOLERANCE}
    write_result("memory", payload, mode=args.mode, load_before=load0, out=args.out, argv=argv)
    return payload


def argparse_suppress() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
