"""Starting ranks: a ``launcher=spawn`` launch of 4 gloo ranks, each rank forked from the
preloaded process server (``forkserver``, the default) against a fresh interpreter per rank
(``DIPACO_START_METHOD=spawn``), in both cases from a fresh launcher process.

    python -m benchmarks.bench_launch --quick      # 2 repeats of each side, interleaved
    python -m benchmarks.bench_launch --full       # 5 repeats

Each side runs in its own fresh launcher process (so the server's own start is counted),
which times two launches in a row: the first (a cold start: the server, if any, is started
by it) and the second (the server is warm, as for every launch after the first in a
process: an elastic restart, the next test of a suite). Every rank does what a training
rank does before its first round: joins the gloo group, builds a small model, takes one
AdamW step (torch.optim's step imports Dynamo) and all-reduces once. Reported per side:
median seconds of the first and of the second launch, and the CPU seconds of the side's
whole process tree (the launcher, its process server, every rank: this process adopts the
orphans on Linux so that it can count them). Target: the warm launch ≥ 3× faster with the server. Writes
benchmarks/results/launch.json.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence
from dipaco.storage.strict_json import dumps_strict

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # run as a script: the repository root holds `benchmarks`
    sys.path.insert(0, str(HERE.parent))

from benchmarks.common import base_parser, load_average, print_table, write_result  # noqa: E402

NPROC = 4


def rank_work(cfg: Any, run: Any, rank: int, world: int) -> float:
    """What a rank does before its first round (see the module doc); returns its time."""
    import torch
    import torch.distributed as dist

    model = torch.nn.Sequential(torch.nn.Embedding(512, 64), torch.nn.Linear(64, 512))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 512, (4, 16))).float().mean().backward()
    opt.step()
    t = torch.ones(1)
    dist.all_reduce(t)
    return time.time()


def child(tmp: str) -> None:
    """One side in a fresh launcher process: two launches in a row; prints JSON."""
    import resource

    from dipaco.config import compose_config
    from dipaco.run.run_dir import RunDir
    from dipaco.runtime.launch import launch

    cfg = compose_config(["experiment=smoke", "launcher=spawn", f"launcher.nproc={NPROC}",
                          "launcher.timeout_s=120"], tmp)
    run = RunDir(Path(tmp))
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        launch(rank_work, cfg, run)
        times.append(time.perf_counter() - t0)
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
    print(dumps_strict({"first_s": times[0], "second_s": times[1], "cpu_s": cpu}), flush=True)


def _become_subreaper() -> bool:
    """Adopt this process's orphaned descendants (Linux ``PR_SET_CHILD_SUBREAPER``), so the
    CPU of a side's process server and of the ranks forked from it (children of the server,
    which outlives its launcher by a moment) is counted when they are reaped here."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _reap_all(deadline_s: float = 60.0) -> None:
    """Wait for every descendant adopted by :func:`_become_subreaper` to end."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.05)


def _children_cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def side(method: str, tmp: Path, whole_tree: bool) -> dict[str, float]:
    """One fresh launcher process with ``DIPACO_START_METHOD=method``: its two launch times
    and the CPU seconds of its whole process tree (``whole_tree``: this process adopts
    orphans; else the launcher's own figure)."""
    env = dict(os.environ, DIPACO_START_METHOD=method, OMP_NUM_THREADS="1")
    tmp.mkdir(parents=True, exist_ok=True)
    cpu0 = _children_cpu()
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_launch", "--child", str(tmp)], cwd=HERE.parent,
                         env=env, capture_output=True, text=True, timeout=600)
    _reap_all()
    if out.returncode != 0:
        raise RuntimeError(f"{method} side failed:\n{out.stderr[-2000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if whole_tree:
        got["cpu_s"] = _children_cpu() - cpu0
    return got


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        child(argv[1])
        return {}
    ap = base_parser(__doc__ or "")
    ap.add_argument("--repeats", type=int, default=None, help="launcher processes per side (2 quick, 5 full)")
    a = ap.parse_args(argv)
    mode = a.mode or "quick"
    repeats = a.repeats or (2 if mode == "quick" else 5)
    import tempfile

    whole_tree = _become_subreaper()
    load0 = load_average()
    got: dict[str, list[dict[str, float]]] = {"forkserver": [], "spawn": []}
    with tempfile.TemporaryDirectory(prefix="bench_launch_") as d:
        for i in range(repeats):  # interleaved: A B, B A, ...
            for method in (("forkserver", "spawn") if i % 2 == 0 else ("spawn", "forkserver")):
                got[method].append(side(method, Path(d) / f"{method}{i}", whole_tree))
                print(f"  {method}: {got[method][-1]}", flush=True)
    rows = [{"start_method": m, "first_launch_s": statistics.median(r["first_s"] for r in rs),
             "second_launch_s": statistics.median(r["second_s"] for r in rs),
             "tree_cpu_s": statistics.median(r["cpu_s"] for r in rs)} for m, rs in got.items()]
    by = {r["start_method"]: r for r in rows}
    verdicts = {"second_launch_speedup": by["spawn"]["second_launch_s"] / by["forkserver"]["second_launch_s"],
                "first_launch_speedup": by["spawn"]["first_launch_s"] / by["forkserver"]["first_launch_s"],
                "cpu_ratio": by["spawn"]["tree_cpu_s"] / by["forkserver"]["tree_cpu_s"]}
    print_table(rows, ["start_method", "first_launch_s", "second_launch_s", "tree_cpu_s"],
                title=f"{NPROC} gloo ranks per launch, two launches per fresh launcher process, median of {repeats}")
    for k, v in verdicts.items():
        print(f"{k}: {v:.2f}")
    payload = {"nproc": NPROC, "repeats": repeats, "rows": rows, "verdicts": verdicts, "raw": got,
               "cpu_counts": "every process of a side" if whole_tree else "the launcher and its own children only"}
    write_result("launch", payload, mode=mode, load_before=load0, out=a.out, argv=argv)
    return payload


if __name__ == "__main__":
    main()
