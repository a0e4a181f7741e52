"""Sync share: the fraction of wall time a rank spends in the outer sync, 4 gloo ranks.

    python -m benchmarks.bench_sync_share --quick   # model=tiny, H=100, 2 rounds
    python -m benchmarks.bench_sync_share --full    # model=small, H=100, 3 rounds

One real run with the torch backend (``launcher=spawn launcher.nproc=4``, gloo on CPU,
one worker group per path of a [2,2] grid). The trainer times each round's inner steps
(``compute_s``) and its ``end_round`` (``sync_s``: encode, the per-module collectives,
the outer step), per round in ``metrics.jsonl`` (max over ranks) and in total in
``summary.json``. Share = sync ÷ (compute + sync), reported for the whole run and as the
median over rounds (the first round also pays the gloo connection set-up).

The sync time includes waiting for the slowest rank of each module group: on a shared
host a descheduled rank shows up here, which is also what a deployment would see.
Target: ≤ 2% at H=100.
"""
from __future__ import annotations

import json
import shutil
import statistics
import sys
from typing import Any, Optional, Sequence

from benchmarks.common import base_parser, load_average, print_table, verdict, work_dir, write_result

TARGET = 0.02
SIZES: dict[str, dict[str, Any]] = {
    "quick": {"model": "tiny", "rounds": 2, "batch_size": 8, "seq_len": 64, "max_documents": 1500},
    "full": {"model": "small", "rounds": 3, "batch_size": 16, "seq_len": 128, "max_documents": 4000},
}


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    ap = base_parser(__doc__ or "")
    ap.add_argument("--inner-steps", type=int, default=100, help="H")
    ap.add_argument("--codec", default="none", help="diloco.codec")
    ap.add_argument("--keep-runs", action="store_true", help="keep the run directory")
    args = ap.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    load0 = load_average()
    size = SIZES[args.mode]

    from dipaco.config import compose_config
    from dipaco.job.train import train

    overrides = ["data=python_sources", f"model={size['model']}", "grid.levels=[2,2]", "launcher=spawn", "launcher.nproc=4",
                 f"diloco.inner_steps={args.inner_steps}", f"diloco.codec={args.codec}",
                 f"trainer.rounds={size['rounds']}", f"trainer.batch_size={size['batch_size']}",
                 f"trainer.seq_len={size['seq_len']}", f"data.max_documents={size['max_documents']}",
                 "router.prefix_tokens=16", "trainer.dense_baseline=false", "trainer.eval_max_documents=16",
                 "trainer.progress=false", "trainer.plots=false"]
    root = work_dir("sync_share", args.work_dir)
    try:
        s = train(compose_config(overrides, str(root / "run")))
        lines = [json.loads(x) for x in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    finally:
        if not args.keep_runs and not args.work_dir:
            shutil.rmtree(root, ignore_errors=True)

    rows = [{"round": ln["round"], "compute_s": ln["compute_s"], "sync_s": ln["sync_s"],
             "sync_share": ln["sync_s"] / (ln["compute_s"] + ln["sync_s"]), "bytes_sent": ln["bytes_sent"]}
            for ln in lines]
    total_share = s["sync_s"] / (s["compute_s"] + s["sync_s"])
    median_share = statistics.median(r["sync_share"] for r in rows)
    steady = [r["sync_share"] for r in rows[1:]]
    steady_share = statistics.median(steady) if steady else None
    rows.append({"round": "all", "compute_s": s["compute_s"], "sync_s": s["sync_s"], "sync_share": total_share,
                 "bytes_sent": s["bytes_sent"]})
    print_table(rows, ["round", "compute_s", "sync_s", "sync_share", "bytes_sent"],
                title=f"sync share ({args.mode}): 4 gloo ranks, [2,2] grid, model={size['model']}, "
                      f"H={args.inner_steps}, codec={args.codec}; target <= {TARGET:.0%}")
    print(f"whole run {total_share:.2%} ({verdict(total_share, TARGET)}); median over rounds {median_share:.2%}; "
          f"rounds after the first {steady_share if steady_share is None else f'{steady_share:.2%}'}")
    payload = {"overrides": overrides, "command_train": "dipaco-train " + " ".join(overrides),
               "inner_steps": args.inner_steps, "codec": args.codec, "rounds": rows,
               "sync_share": total_share, "median_round_share": median_share,
               "share_after_first_round": steady_share, "target": TARGET,
               "verdict": verdict(total_share, TARGET), "tokens_per_s": s["tokens_per_s"],
               "path_parameters": s["path_parameters"]}
    write_result("sync_share", payload, mode=args.mode, load_before=load0, out=args.out, argv=argv)
    return payload


if __name__ == "__main__":
    main()
