"""Preparing a run from raw text: time per stage and peak memory of ``dipaco-route`` vs corpus size.

    python -m benchmarks.bench_prepare                      # 50, 250 and 1000 MB, and 1M documents on [4,4]
    python -m benchmarks.bench_prepare --quick              # 5 and 20 MB (a minute)
    python -m benchmarks.bench_prepare --sizes 50,250 --before /path/to/a/checkout/of/57deba0

What a new user does with a corpus of their own, at three sizes:

1. **corpus**: JSON lines of about 4 KB documents (``text`` and a ``label``), cut at line
   boundaries from the text files of this install (the standard library and every
   installed package: Python, C headers, reST, JSON, ...), in a seeded order, cycled
   when a size needs more text than the install holds. Written to a temporary directory
   (``--tmp``), deleted at the end; nothing is committed.
2. **route**: ``dipaco-route data=jsonl data.path=... data.label_field=label`` in a child
   process, the default config otherwise (BPE of 2,048, [2,2] grid, top-2). Stage times
   are read off the job's own log lines as they arrive (``[dipaco] corpus:`` ends loading,
   ``[dipaco] tokens:`` ends the tokenizer and tokenization, ``[dipaco] routing:`` ends the
   router fit, assignment and shards); peak RSS is the child's ``ru_maxrss`` (``os.wait4``).
3. **1M documents**: the same command on a corpus of one million ~1 KB documents, routed
   onto ``grid=4x4`` with top-2, against the same memory bound.

``--before DIR`` runs the same commands with ``PYTHONPATH=DIR`` (a checkout of an older
commit, e.g. 57deba0, using this environment's packages), side by side. The result goes
to ``benchmarks/results/prepare.json`` and the plot to ``--plot`` (default
``docs/figures/prepare_scaling.png``).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import site
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from benchmarks.common import base_parser, load_average, print_table, write_result
from dipaco.storage.strict_json import dumps_strict
from dipaco.storage.atomic import write_atomically

ROOT = Path(__file__).resolve().parents[1]
SIZES = {"quick": [5, 20], "full": [50, 250, 1000]}
MILLION = 1_000_000
# file kinds read for the corpus, and the label each gets (labels only evaluate routing)
KINDS = {".py": "python", ".pyi": "python", ".h": "c_cpp", ".hpp": "c_cpp", ".c": "c_cpp", ".cpp": "c_cpp",
         ".cuh": "c_cpp", ".rst": "docs", ".md": "docs", ".txt": "docs", ".json": "data", ".yaml": "data",
         ".toml": "data", ".csv": "data"}
POOL_BYTES = 256 * 10**6  # distinct text read from the install at most; larger corpora cycle it
STAGES = (("load", "[dipaco] corpus:"), ("tokenize", "[dipaco] tokens:"), ("route", "[dipaco] routing:"))


# --------------------------------------------------------------------------- corpus


def _files() -> list[tuple[str, str]]:
    """(path, label) of every text file of this install, in a fixed order."""
    roots = sorted({sysconfig.get_paths()["stdlib"], *site.getsitepackages()})
    out = []
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(filenames):
                label = KINDS.get(os.path.splitext(name)[1])
                if label:
                    out.append((os.path.join(dirpath, name), label))
    random.Random(0).shuffle(out)  # a mix of kinds at every size
    return out


def _documents(doc_chars: int) -> Iterator[tuple[str, str, str]]:
    """(id, label, text) of ~``doc_chars`` documents cut at line boundaries, endlessly
    (the install's text is cycled, each pass in another seeded order of files)."""
    files = _files()
    read, rep = 0, 0
    while True:
        order = files if rep == 0 else random.Random(rep).sample(files, len(files))
        for path, label in order:
            if rep == 0 and read >= POOL_BYTES:
                break
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError):
                continue
            read += len(text)
            doc, start = [], 0
            for i, line in enumerate(text.splitlines(keepends=True)):
                doc.append(line)
                if sum(map(len, doc)) >= doc_chars:
                    yield f"{rep}:{path}#{start}", label, "".join(doc)
                    doc, start = [], i + 1
            if doc and len("".join(doc).strip()) >= 64:
                yield f"{rep}:{path}#{start}", label, "".join(doc)
        rep += 1
        if rep > 1000:  # pragma: no cover - an install without text files
            raise RuntimeError("no text files found in this install")


def write_corpus(path: Path, target_bytes: int, doc_chars: int, max_docs: Optional[int] = None) -> dict[str, Any]:
    """Write JSON lines of about ``target_bytes`` of text (or ``max_docs`` documents)."""
    count = {"written": 0, "docs": 0}

    def fill(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            for doc_id, label, text in _documents(doc_chars):
                if count["written"] >= target_bytes or (max_docs is not None and count["docs"] >= max_docs):
                    break
                f.write(dumps_strict({"id": doc_id, "text": text, "label": label}, ensure_ascii=False) + "\n")
                count["written"] += len(text.encode("utf-8"))
                count["docs"] += 1

    write_atomically(path, fill)
    return {"text_bytes": count["written"], "documents": count["docs"], "file_bytes": path.stat().st_size}


# --------------------------------------------------------------------------- one run

_STARTUP: dict[Optional[str], float] = {}


def startup_seconds(pythonpath: Optional[str]) -> float:
    """Seconds from launch to the job's first line: starting Python and importing the CLI
    (measured once per code base; subtracted from the first stage read off a log)."""
    if pythonpath not in _STARTUP:
        env = dict(os.environ, **({"PYTHONPATH": pythonpath} if pythonpath else {}))
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import dipaco.cli.route"], env=env, check=True, cwd=tempfile.gettempdir())
        _STARTUP[pythonpath] = time.perf_counter() - t0
    return _STARTUP[pythonpath]



def run_route(corpus: Path, run_dir: Path, overrides: Sequence[str], pythonpath: Optional[str]) -> dict[str, Any]:
    """``dipaco-route`` on ``corpus`` in a child: stage times from its log, its peak RSS."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM=os.environ.get("TOKENIZERS_PARALLELISM", "true"))
    env["DIPACO_CACHE"] = str(run_dir.parent / "dipaco-cache")
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    cmd = [sys.executable, "-c", "from dipaco.cli.route import main; main()", "data=jsonl",
           f"data.path={corpus}", "data.label_field=label", "data.id_field=id", "trainer.progress=false",
           f"hydra.run.dir={run_dir}", *overrides]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=run_dir.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    marks: dict[str, float] = {}
    log: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        log.append(line.rstrip())
        for stage, prefix in STAGES:
            if line.startswith(prefix) and stage not in marks:
                marks[stage] = time.perf_counter() - t0
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"dipaco-route failed ({proc.returncode}):\n" + "\n".join(log[-30:]))
    report = json.loads(log[-1])
    timings = report.get("timings") or {}
    times, last = {}, startup_seconds(pythonpath)
    for stage, _ in STAGES:  # from the log: what an older dipaco, which prints no timings, allows
        times[f"{stage}_s"] = marks[stage] - last
        last = marks[stage]
    if timings:  # measured inside the job (the warm-up, if any, is not routing)
        times = {f"{stage}_s": timings[f"{stage}_s"] for stage, _ in STAGES}
    return {"wall_s": wall, **times, "peak_rss_mib": usage.ru_maxrss / 1024,
            "cpu_s": usage.ru_utime + usage.ru_stime, "num_documents_routed": report.get("num_documents"),
            "timings": report.get("timings")}


# --------------------------------------------------------------------------- the benchmark


def _row(label: str, corpus: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    mb = corpus["text_bytes"] / 1e6
    stages = run["load_s"] + run["tokenize_s"] + run["route_s"]
    timings = run.get("timings") or {}
    encode_s = (timings.get("tokenize_s", 0.0) - timings.get("tokenizer_s", 0.0)) or None
    return {"code": label, "text_mb": round(mb, 1), "documents": corpus["documents"],
            "load_s": run["load_s"], "tokenize_s": run["tokenize_s"], "route_s": run["route_s"],
            "tokenizer_s": timings.get("tokenizer_s"),
            "prepare_s": stages, "wall_s": run["wall_s"], "cpu_s": run["cpu_s"],
            "tokenize_mb_s": mb / run["tokenize_s"],
            "encode_mb_s": mb / encode_s if encode_s else None,
            "docs_s": corpus["documents"] / stages, "mb_s": mb / stages, "peak_rss_mib": run["peak_rss_mib"],
            "stage_peaks_mib": timings.get("peak_rss_mib")}


def _verdicts(rows: list[dict[str, Any]], million: Optional[dict[str, Any]]) -> dict[str, Any]:
    """The acceptance lines of issue 31 that these numbers decide."""
    after = {r["text_mb"]: r for r in rows if r["code"] == "after"}
    sizes = sorted(after)
    out: dict[str, Any] = {}
    if len(sizes) >= 2:
        small, large = after[sizes[0]], after[sizes[-1]]
        out["peak_rss_largest_over_smallest"] = large["peak_rss_mib"] / small["peak_rss_mib"]
        out["peak_rss_largest_mib"] = large["peak_rss_mib"]
        out["prepare_s_largest_over_previous"] = large["prepare_s"] / after[sizes[-2]]["prepare_s"]
        out["size_ratio_largest_over_previous"] = sizes[-1] / sizes[-2]
    out["encode_mb_s_min"] = min((r["encode_mb_s"] for r in after.values() if r["encode_mb_s"]), default=None)
    if million is not None:
        out["million_peak_rss_mib"] = million["peak_rss_mib"]
    return out


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    ap = base_parser(__doc__ or "")
    ap.add_argument("--sizes", default=None, help="corpus sizes in MB of text, comma-separated (full: 50,250,1000)")
    ap.add_argument("--million", action=argparse.BooleanOptionalAction, default=None,
                    help="also route 1M documents onto grid=4x4 (default: with --full)")
    ap.add_argument("--before", default=None, help="a checkout of an older commit, run side by side (PYTHONPATH)")
    ap.add_argument("--before-max-mb", type=float, default=300,
                    help="skip the older code above this size (it held the corpus in memory)")
    ap.add_argument("--tmp", default=None, help="where corpora and run directories go (deleted after)")
    ap.add_argument("--plot", default=str(ROOT / "docs" / "figures" / "prepare_scaling.png"))
    ap.add_argument("--resume", default=None,
                    help="an earlier result JSON: its rows are kept and those runs are not repeated")
    args = ap.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    sizes = [float(x) for x in args.sizes.split(",")] if args.sizes else SIZES[args.mode]
    million = args.mode == "full" if args.million is None else args.million
    load0 = load_average()
    overrides = ["trainer.warmup_fraction=0"]  # the dense warm-up is a fixed cost, not data preparation
    earlier = json.loads(Path(args.resume).read_text()) if args.resume else {}
    rows: list[dict[str, Any]] = list(earlier.get("rows", []))
    big: Optional[dict[str, Any]] = earlier.get("million")
    done = {(r["code"], r["target_mb"]) for r in rows}

    def save() -> None:  # after every run: a long benchmark that dies keeps what it measured
        write_result("prepare", {"rows": rows, "million": big, "overrides": overrides}, mode=args.mode,
                     load_before=load0, out=args.out, argv=argv)

    if args.tmp:
        Path(args.tmp).mkdir(parents=True, exist_ok=True)  # a fresh scratch folder is fine
    root = Path(tempfile.mkdtemp(prefix="dipaco-prepare-", dir=args.tmp))
    try:
        for mb in sizes:
            sides = [("after", None)] + ([("before", args.before)] if args.before and mb <= args.before_max_mb else [])
            sides = [(label, path) for label, path in sides if (label, mb) not in done]
            if not sides:
                continue
            corpus_path = root / f"corpus-{mb:g}mb.jsonl"
            corpus = write_corpus(corpus_path, int(mb * 1e6), doc_chars=4000)
            print(f"{mb:g} MB: {corpus['documents']:,} documents, {corpus['text_bytes'] / 1e6:.1f} MB of text",
                  flush=True)
            for label, pythonpath in sides:
                run = run_route(corpus_path, root / f"run-{label}-{mb:g}", overrides, pythonpath)
                rows.append({**_row(label, corpus, run), "target_mb": mb, "load_average": load_average()})
                print(f"  {label}: prepare {rows[-1]['prepare_s']:.1f} s, peak RSS {run['peak_rss_mib']:.0f} MiB",
                      flush=True)
                shutil.rmtree(root / f"run-{label}-{mb:g}", ignore_errors=True)
                save()
            corpus_path.unlink()
        if million and big is None:
            corpus_path = root / "corpus-1m.jsonl"
            corpus = write_corpus(corpus_path, 10**12, doc_chars=900, max_docs=MILLION)
            print(f"1M documents: {corpus['text_bytes'] / 1e6:.0f} MB of text, grid [4, 4], top-2", flush=True)
            run = run_route(corpus_path, root / "run-million", overrides + ["grid=4x4"], None)
            big = {**_row("after", corpus, run), "grid": "4x4", "top_k": 2,
                   "documents_routed": run["num_documents_routed"], "load_average": load_average()}
            print(f"  after: prepare {big['prepare_s']:.1f} s, peak RSS {run['peak_rss_mib']:.0f} MiB", flush=True)
            save()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows.sort(key=lambda r: (r["code"] != "before", r["text_mb"]))
    columns = ["code", "text_mb", "documents", "load_s", "tokenize_s", "route_s", "prepare_s", "tokenize_mb_s",
               "encode_mb_s", "docs_s", "peak_rss_mib"]
    print_table(rows + ([{**big, "code": "after 1M [4,4]"}] if big else []), columns,
                title="dipaco-route on JSON lines of ~4 KB documents (stage times from its log; peak RSS of the process)")
    verdicts = _verdicts(rows, big)
    for key, value in verdicts.items():
        print(f"{key}: {value:.3f}" if isinstance(value, float) else f"{key}: {value}")
    if args.plot and rows:
        from dipaco.job.plots import scaling_chart

        series: dict[str, dict[str, tuple[list, list]]] = {"time": {}, "memory": {}}
        for code in ("before", "after"):
            mine = sorted((r for r in rows if r["code"] == code), key=lambda r: r["text_mb"])
            if mine:
                xs = [r["text_mb"] for r in mine]
                series["time"][f"{code}: prepare (load + tokenize + route)"] = (xs, [r["prepare_s"] for r in mine])
                series["memory"][f"{code}: peak RSS of dipaco-route"] = (xs, [r["peak_rss_mib"] for r in mine])
        if big:
            series["memory"]["after: 1M documents, [4,4] top-2"] = ([big["text_mb"]], [big["peak_rss_mib"]])
        scaling_chart(Path(args.plot), [("seconds", series["time"]), ("MiB", series["memory"])], "MB of text")
        print(f"wrote {args.plot}")
    write_result("prepare", {"rows": rows, "million": big, "verdicts": verdicts, "overrides": overrides},
                 mode=args.mode, load_before=load0, out=args.out, argv=argv)
    return {"rows": rows, "million": big, "verdicts": verdicts}


if __name__ == "__main__":
    main()
