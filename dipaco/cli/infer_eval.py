"""``dipaco-infer eval``: the routed model (and its dense baseline) on lm-evaluation-harness
tasks defined by local files; one table, one JSON report (docs/serving.md).

lm-eval is imported only when the verb runs (the optional ``eval`` extra), so every
other verb and ``--help`` work without it.
"""
from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path
from typing import Any, Optional

from dipaco.cli.errors import fail
from dipaco.cli.infer_args import COMMON_EPILOG, add_run_args, emit, int_in, open_run, out_file, positive
from dipaco.run.owned import write_owned_file
from dipaco.storage.strict_json import dumps_strict

MISSING_EXTRA = 'dipaco-infer eval needs lm-evaluation-harness, which is not installed. Fix: pip install -e ".[eval]"'


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register the ``eval`` verb on ``sub`` (an argparse subparsers action)."""
    e = sub.add_parser("eval", help="lm-evaluation-harness tasks, routed (and dense with --dense)", epilog=(
        "Runs lm_eval.simple_evaluate offline on tasks defined by YAML files under --include-path "
        "(dataset_path: json with local data_files; a task that needs the Hugging Face hub is "
        "refused, naming it). Each request is routed on its own context's first prefix tokens: "
        "every choice of a multiple-choice question is scored by the question's path. Context "
        "+ continuation longer than model.max_seq_len is left-truncated. --dense scores the same "
        "tasks with the run's same-size dense baseline and adds routed/dense per metric. Prints "
        "one table; the JSON report goes to --out (else as the last stdout line). "
        "docs/serving.md, 'lm-evaluation-harness'. " + COMMON_EPILOG))
    add_run_args(e)
    e.add_argument("--tasks", required=True, metavar="T[,T...]", help="task, group or tag names, comma separated")
    e.add_argument("--include-path", default=None, metavar="DIR", help="folder of task YAML files (searched recursively)")
    e.add_argument("--limit", type=positive("--limit"), default=None, metavar="N",
                   help="score only the first N documents of each task")
    e.add_argument("--batch-size", type=positive("--batch-size", 4096), default=16, metavar="B",
                   help="requests per forward pass (default 16)")
    e.add_argument("--num-fewshot", type=int_in("--num-fewshot", 0, 1024), default=None, metavar="K",
                   help="few-shot examples per prompt (default: the task's own)")
    e.add_argument("--max-loaded-paths", type=positive("--max-loaded-paths", 4096), default=1, metavar="P",
                   help="paths kept in memory at once (default 1: requests are grouped by path)")
    e.add_argument("--dense", action="store_true", help="also evaluate the run's same-size dense baseline")
    e.add_argument("--out", default=None, metavar="F", help="write the JSON report here")
    e.add_argument("--force", action="store_true", help="with --out: replace an earlier eval --out report there "
                   "(never a file dipaco did not write)")
    return e


def comparison(report: dict) -> list[dict]:
    """One row per (task, metric, filter): routed, dense and routed/dense (stderr rows left out)."""
    rows = []
    dense = (report.get("dense") or {}).get("results", {})
    for task, metrics in report["routed"]["results"].items():
        for key, value in metrics.items():
            if "," not in key or "_stderr" in key or not isinstance(value, (int, float)):
                continue
            metric, filt = key.split(",", 1)
            d = dense.get(task, {}).get(key)
            ratio = value / d if isinstance(d, (int, float)) and d != 0 else None
            rows.append({"task": task, "metric": metric, "filter": filt, "routed": value, "dense": d,
                         "ratio": ratio, "higher_is_better": report.get("higher_is_better", {}).get(task, {}).get(metric)})
    return rows


def not_in_table(report: dict, rows: list[dict]) -> list[dict]:
    """Every task asked for that has no row, and every metric left out of one (a value
    that is not a number), with the reason (rule 7: a table accounts for every input)."""
    out = []
    results = report["routed"]["results"]
    shown = {r["task"] for r in rows}
    for task in report.get("tasks", []):
        if task not in results:
            out.append({"task": task, "why": "lm-eval returned no results for it"})
        elif task not in shown:
            out.append({"task": task, "why": "lm-eval returned no numeric metric for it"})
    for task, metrics in results.items():
        for key, value in metrics.items():
            if "," in key and "_stderr" not in key and not isinstance(value, (int, float)):
                out.append({"task": task, "metric": key.split(",", 1)[0], "why": f"its value {value!r} is not a number"})
    return out


def _fmt(v: Optional[float]) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}" if math.isfinite(v) and abs(v) < 1e6 else f"{v:.3e}"


def table(rows: list[dict], dense: bool) -> str:
    """The summary: task, metric, routed (and dense, routed/dense)."""
    head = ["task", "metric", "routed"] + (["dense", "routed/dense"] if dense else [])
    body = [[r["task"], r["metric"] + ("" if r["filter"] == "none" else f" ({r['filter']})"), _fmt(r["routed"])]
            + ([_fmt(r["dense"]), _fmt(r["ratio"])] if dense else []) for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    return "\n".join("  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip() for line in [head, *body])


def run(args: argparse.Namespace) -> None:
    """The ``eval`` verb."""
    out = out_file(args, "eval --out")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        fail("--tasks is empty: name at least one task")
    if args.include_path is not None and not Path(args.include_path).is_dir():
        fail(f"--include-path {args.include_path} is not a directory (a folder of task YAML files)")
    try:
        from dipaco.inference.lm_eval_adapter import LmEvalError, evaluate_tasks, resolve_tasks
    except ImportError as e:
        if (e.name or "").split(".")[0] != "lm_eval":
            raise
        fail(MISSING_EXTRA)
    for name in ("lm_eval", "lm-eval"):  # its per-task notes would bury the table
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        resolved = resolve_tasks(tasks, args.include_path)  # a bad task is refused before the run is read
        inf = open_run(args)
        report = evaluate_tasks(inf, tasks, limit=args.limit, num_fewshot=args.num_fewshot,
                                batch_size=args.batch_size, max_loaded_paths=args.max_loaded_paths,
                                dense=args.dense, resolved=resolved)
    except LmEvalError as e:
        fail(str(e))
    report["comparison"] = comparison(report)
    report["not_in_table"] = not_in_table(report, report["comparison"])
    for x in report["not_in_table"]:
        print(f"dipaco: not in the table: task {x['task']}" + (f" metric {x['metric']}" if "metric" in x else "")
              + f": {x['why']}", file=sys.stderr)
    report.update({"run_dir": str(inf.run.root), "checkpoint": str(inf.checkpoint), "best_paths": inf.best_paths})
    emit(table(report["comparison"], args.dense))
    if out is not None:
        write_owned_file(out, dumps_strict(report, indent=2, sort_keys=True, default=str) + "\n", "eval --out")
        print(f"dipaco: wrote {args.out}", file=sys.stderr)
    else:
        emit(dumps_strict(report, sort_keys=True, default=str))
