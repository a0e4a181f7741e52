"""Run the benchmarks: ``python -m benchmarks [--quick|--full] [--only NAME ...]``.

Each benchmark runs in its own process (fresh memory high-water marks, fresh torch
thread pools, no Hydra global state carried over), prints its table and writes
``benchmarks/results/<name>.json``. Each benchmark's wall and CPU time are printed as it
ends, and at the end a summary lists each benchmark's headline figure, its target, its
wall and CPU seconds, and the totals. Quick mode is sized for at most 10 minutes in all
on 2 idle cores (``QUICK_BUDGET_S``). On a loaded host the wall time grows with the load
but the CPU time does not: the summary says which budget the CPU time alone would
already miss. The reported figures are ratios measured side by side and stay comparable.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from benchmarks.common import RESULTS_DIR, fmt, load_average, print_table

HERE = Path(__file__).resolve().parent
# `--quick` must finish within this on 2 idle cores (issue 19, item 7).
QUICK_BUDGET_S = 600


def _module(name: str) -> Callable[[str], list[str]]:
    return lambda mode: [sys.executable, "-m", f"benchmarks.bench_{name}", f"--{mode}"]


def _script(name: str) -> Callable[[str], list[str]]:
    # bench_routing / bench_infer are standalone scripts with their own flags: --quick or nothing
    return lambda mode: [sys.executable, str(HERE / f"bench_{name}.py"), *(["--quick"] if mode == "quick" else [])]


def _get(path: Sequence[Any]) -> Callable[[dict], Any]:
    def read(d: dict) -> Any:
        for key in path:
            d = d[key]
        return d
    return read


def _quality(d: dict) -> str:
    return ", ".join(f"{r['grid']}: {fmt(r['routed_vs_dense_equal_steps'])}" for r in d["rows"])


def _comm(d: dict) -> str:
    rows = [r for r in d["planned"] if r["codec"] == "int8"]
    return ", ".join(f"{r['grid']}: 1/{r['one_over_ratio']:.0f}" for r in rows)


def _routing(d: dict) -> str:
    ratio = d.get("sklearn_over_dipaco")
    return f"sklearn KMeans / dipaco k-means time {ratio:.1f}x" if ratio else "see routing.json"


# name → (command for a mode, headline figure from the JSON, what the figure is, target)
BENCHMARKS: dict[str, tuple[Callable[[str], list[str]], Callable[[dict], Any], str, str]] = {
    "quality": (_module("quality"), _quality, "routed ppl / dense ppl (equal steps)", "<= 0.85"),
    "comm": (_module("comm"), _comm, "DiPaCo int8 bytes / DDP bytes, H=50", "<= 1/200"),
    "overhead": (_module("overhead"), _get(["ratio"]), "dipaco tokens/s / bare PyTorch", ">= 0.95"),
    "sync_share": (_module("sync_share"), _get(["sync_share"]), "sync / wall, 4 gloo ranks, H=100", "<= 0.02"),
    "memory": (_module("memory"), _get(["growth_largest_vs_smallest"]),
               "one path's peak RSS, [8,8] / [1,1] grid", "~1 (flat)"),
    "gpu": (_module("gpu"), lambda d: ", ".join(f"{r['model']}: {fmt(r['vs_bare'])}" for r in d["rows"] if "vs_bare" in r),
            "DiPaCo [2,2] loop tokens/s / bare loop, this device", ">= 0.95"),
    "groups": (_module("groups"),
               lambda d: ", ".join(f"{r['model']}: {fmt(r['memory_vs_replicate'])}" for r in d.get("rows", [])
                                   if "memory_vs_replicate" in r) or "needs 2 GPUs",
               "fsdp / replicate peak memory per rank, worker group of 2", "~0.5 at scale"),
    "routing": (_script("routing"), _routing, "k-means time, sklearn KMeans / dipaco", ">= 3"),
    "infer": (_script("infer"), lambda d: "see infer.json", "generate memory, KV-cache speed-up", "see bench_infer"),
    "decoupled": (_module("decoupled"), _get(["headline", "decoupled_goodput"]),
                  "decoupled goodput, one decoupled worker 3x slower", ">= 0.8"),
    "large_corpus": (_module("large_corpus"), lambda d: f"{d['peak_rss_mib']:.0f} MiB for {d['corpus_mib']:.0f} MiB",
                     "peak RSS routing + training from memmapped shards", "flat, << corpus"),
    "prepare": (_module("prepare"),
                lambda d: f"{fmt(d['verdicts'].get('peak_rss_largest_over_smallest'))}x, "
                          f"{fmt(d['verdicts'].get('encode_mb_s_min'))} MB/s",
                "dipaco-route peak RSS largest / smallest corpus, tokenization MB/s", "<= 1.25, >= 4"),
    "route_sharing": (_module("route_sharing"),
                      lambda d: ", ".join(f"{r['method']} {r['level0_nmi']}" for r in d["hierarchy"] if r["grid"] == [4, 4]),
                      "level-0 NMI vs super-topic, synthetic hierarchy [4,4]", "tree ~1"),
    "link": (_module("link"),
             lambda d: ", ".join(f"{r['rate_mbit']} Mbit/s {r['setting']}: {fmt(r['hidden'])}" for r in d.get("rows", [])
                                 if r.get("hidden") is not None) or d.get("skipped", "see link.json"),
             "share of sync DiLoCo's exposed comm streaming hides, 4 gloo ranks, shaped loopback", ">= 0.8"),
    "launch": (_module("launch"), _get(["verdicts", "second_launch_speedup"]),
               "4-rank launch time, fresh interpreters / forked from the preloaded server", ">= 3"),
    "store_digest": (_module("store_digest"),
                     lambda d: ", ".join(f"{r['blob']}: {fmt(r['digest_share_of_put_get'])}" for r in d["rows"]),
                     "sha256 at write + read / FileStore put + get, a paper-grid module's blobs", "small (on by default)"),
    "serving": (_module("serving"),
                lambda d: f"{fmt(d['verdicts']['engine_vs_per_process_prompts'])}x prompts/s, "
                          f"{fmt(d['verdicts']['engine_vs_hf_tokens_whole_process'])}x HF tokens/s",
                "batched engine vs one process per prompt; vs transformers generate", ">= 100, >= 1.0"),
}

# Scripts added later by others run too (as standalone scripts taking --quick), so the
# entry point never silently leaves a benchmark out; give them a headline above.
for _path in sorted(HERE.glob("bench_*.py")):
    _name = _path.stem.removeprefix("bench_")
    BENCHMARKS.setdefault(_name, (_script(_name), lambda d, _n=_name: f"see {_n}.json", "(its own table)", "-"))


def _children_cpu_s() -> float:
    """CPU seconds (user + system) of every finished child process so far."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="mode", action="store_const", const="quick",
                      help="small sizes, about 10 minutes in all (default)")
    mode.add_argument("--full", dest="mode", action="store_const", const="full",
                      help="full sizes (each benchmark up to about 15 minutes)")
    ap.set_defaults(mode="quick")
    ap.add_argument("--only", nargs="+", choices=sorted(BENCHMARKS), metavar="NAME", default=None,
                    help=f"run only these: {', '.join(BENCHMARKS)}")
    args = ap.parse_args(argv)
    names = args.only or list(BENCHMARKS)
    rows: list[dict[str, Any]] = []
    failed = []
    t_all = time.perf_counter()
    for name in names:
        cmd_of, headline, what, target = BENCHMARKS[name]
        script = HERE / f"bench_{name}.py"
        if not script.exists():
            print(f"== {name}: {script.name} not found, skipped", flush=True)
            rows.append({"benchmark": name, "figure": what, "value": "missing", "target": target})
            continue
        cmd = cmd_of(args.mode)
        print(f"\n== {name}: {' '.join(cmd[1:])} (load {load_average():.2f})", flush=True)
        t0, cpu0 = time.perf_counter(), _children_cpu_s()
        code = subprocess.call(cmd, cwd=HERE.parent)
        seconds, cpu_s = time.perf_counter() - t0, _children_cpu_s() - cpu0
        print(f"== {name}: {seconds:.0f} s wall, {cpu_s:.0f} s CPU", flush=True)
        value: Any = f"FAILED (exit {code})"
        if code == 0:
            try:
                value = headline(json.loads((RESULTS_DIR / f"{name}.json").read_text()))
            except (OSError, KeyError, TypeError, ValueError) as e:  # a script changed its JSON
                value = f"unreadable result ({type(e).__name__}: {e})"
        else:
            failed.append(name)
        rows.append({"benchmark": name, "figure": what, "value": fmt(value), "target": target,
                     "seconds": round(seconds), "cpu_s": round(cpu_s)})
    wall = time.perf_counter() - t_all
    cpu = sum(r.get("cpu_s", 0) for r in rows)
    print()
    print_table(rows, ["benchmark", "figure", "value", "target", "seconds", "cpu_s"],
                title=f"benchmarks ({args.mode}), {wall:.0f} s wall, {cpu:.0f} s CPU in all; "
                      f"results in {RESULTS_DIR}")
    if args.mode == "quick" and not args.only:
        # On 2 idle cores the wall time lies between CPU/2 (both cores busy throughout) and
        # CPU (one thread): over budget even at CPU/2 means the quick sizes must shrink;
        # a long wall time with a CPU time that fits is the host's load.
        verdict = ("within" if wall <= QUICK_BUDGET_S else
                   "OVER: shrink the quick sizes" if cpu / 2 > QUICK_BUDGET_S else
                   f"over in wall time; idle estimate {cpu / 2:.0f}-{cpu:.0f} s from the CPU time")
        print(f"quick budget {QUICK_BUDGET_S} s on 2 idle cores: {verdict} "
              f"(load average now {load_average():.2f})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
