"""Shared helpers of the benchmarks: modes, host facts, interleaved timing, JSON, tables.

The hosts these run on are shared (2 cores, other jobs come and go), so a single timing
means little. The rule every benchmark follows: measure the two sides of a ratio in the
same process, interleaved (A, B, A, B, ...), several times, and report the median of each
side and the ratio of the medians. Each result JSON records the host's load average
before and after, so a reader can tell a quiet run from a noisy one.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

from dipaco.run.owned import read_record, record_written, write_owned_file
from dipaco.storage.atomic import atomic_write_bytes
from dipaco.storage.strict_json import dumps_strict

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def load_average() -> float:
    """The host's 1-minute load average (NaN where the OS has none)."""
    try:
        return float(os.getloadavg()[0])
    except OSError:  # pragma: no cover - not on Linux
        return float("nan")


def base_parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark shares (--quick/--full, --out)."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="mode", action="store_const", const="quick",
                      help="small sizes: the whole suite in about 10 minutes on 2 cores (default)")
    mode.add_argument("--full", dest="mode", action="store_const", const="full",
                      help="the full sizes (each benchmark up to about 15 minutes)")
    ap.set_defaults(mode="quick")
    ap.add_argument("--out", default=None, help="result JSON (default: benchmarks/results/<name>.json)")
    ap.add_argument("--work-dir", default=None,
                    help="where run directories go (default: a fresh directory under benchmarks/results/runs)")
    return ap


def work_dir(name: str, given: Optional[str]) -> Path:
    """A fresh directory for this benchmark's training runs (the job refuses reuse)."""
    if given:
        path = Path(given)
    else:
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        path = RESULTS_DIR / "runs" / f"{name}-{stamp}-{os.getpid()}"
    path.mkdir(parents=True, exist_ok=True)
    return path


class Timer:
    """Wall time of a ``with`` block, in seconds (``perf_counter``)."""

    def __enter__(self) -> "Timer":
        self.start = time.perf_counter()
        self.seconds = 0.0
        return self

    def __exit__(self, *exc: Any) -> None:
        self.seconds = time.perf_counter() - self.start


def interleaved(sides: Mapping[str, Callable[[], float]], repeats: int,
                warmup: int = 1) -> dict[str, dict[str, Any]]:
    """Run each side's callable in turn, ``repeats`` times, and take medians.

    Each callable returns one measurement (e.g. tokens/s). The order alternates every
    repeat (A B, B A, ...) so that a load spike or a warming cache does not always hit
    the same side. ``warmup`` untimed rounds go first (allocator, thread pools).

    Returns ``{side: {"samples": [...], "median": m}}``.
    """
    names = list(sides)
    for _ in range(warmup):
        for n in names:
            sides[n]()
    samples: dict[str, list[float]] = {n: [] for n in names}
    for i in range(repeats):
        order = names if i % 2 == 0 else names[::-1]
        for n in order:
            samples[n].append(float(sides[n]()))
    return {n: {"samples": s, "median": statistics.median(s)} for n, s in samples.items()}


def torch_threads() -> Optional[int]:
    """Torch's intra-op thread count, or None when torch is not importable."""
    try:
        import torch

        return int(torch.get_num_threads())
    except ImportError:  # pragma: no cover
        return None


def write_result(name: str, payload: dict[str, Any], *, mode: str, load_before: float,
                 out: Optional[str] = None, argv: Optional[Sequence[str]] = None) -> Path:
    """Write ``benchmarks/results/<name>.json`` atomically with the run's context.

    The context (command, date, host, load average before/after, torch threads) goes
    first so that every figure can be traced to how and where it was measured.
    """
    path = Path(out) if out else RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    args = list(sys.argv[1:] if argv is None else argv)
    record = {
        "benchmark": name,
        "mode": mode,
        "command": shlex.join(["python", "-m", f"benchmarks.bench_{name}", *args]),
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch_threads": torch_threads(),
        "load_average_before_after": [load_before, load_average()],
        **payload,
    }
    write_output(path, dumps_strict(record, indent=2, default=_json_default) + "\n")
    print(f"\nwrote {path}")
    return path


def _a_benchmarks_own(path: Path) -> bool:
    """A file a benchmark wrote before its folder had a record (the results committed to this
    repository): a JSON object naming its benchmark, or a figure in the repository's own
    results and figures folders."""
    if path.suffix == ".json":
        try:
            return "benchmark" in json.loads(path.read_text(encoding="utf-8")) or path.parent == RESULTS_DIR
        except (OSError, ValueError, TypeError):
            return False
    return path.resolve().parent in (RESULTS_DIR, RESULTS_DIR.parent.parent / "docs" / "figures")


def write_output(path: Union[str, Path], data: Union[str, bytes]) -> Path:
    """A benchmark's output file by the rule of every command's (dipaco/run/owned.py):
    atomic, never through a link, never over a file dipaco did not write; a result this
    repository holds from before the records is adopted as the benchmark's own."""
    path = Path(path)
    if path.is_file() and not path.is_symlink() and path.name not in read_record(path.parent.resolve()) \
            and _a_benchmarks_own(path):
        record_written(path.parent, [path.name], "benchmark results")
    return write_owned_file(path, data, "benchmark results")


def write_figure(fig: Any, path: Union[str, Path], **kw: Any) -> Path:
    """A matplotlib figure as :func:`write_output` writes a file (the format from the suffix)."""
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format=Path(path).suffix.lstrip(".") or "png", **kw)
    return write_output(path, buf.getvalue())


def _json_default(obj: Any) -> Any:
    # numpy scalars and paths appear in payloads; everything else is a bug worth seeing
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON-serialisable: {type(obj).__name__}")


def fmt(value: Any) -> str:
    """A compact cell: 4 significant digits for floats, thousands separators for ints."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value != value:  # NaN
            return "nan"
        if value != 0 and (abs(value) >= 1e6 or abs(value) < 1e-3):
            return f"{value:.3e}"
        return f"{value:.4g}"
    return str(value)


def print_table(rows: Iterable[Mapping[str, Any]], columns: Sequence[str], title: str = "") -> str:
    """Print (and return) a plain-text table of ``rows`` restricted to ``columns``."""
    rows = list(rows)
    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = []
    if title:
        lines.append(title)
    lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(columns, widths))))
    lines.append("  ".join("-" * w for w in widths))
    for row in cells:
        lines.append("  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths))))
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def verdict(value: Optional[float], target: float, *, at_most: bool = True) -> str:
    """``met`` / ``MISSED`` for a ratio against its target (``at_most``: lower is better)."""
    if value is None or value != value:
        return "n/a"
    ok = value <= target if at_most else value >= target
    return "met" if ok else "MISSED"


def reuse_preparation(src_run: Path, dst_run: Path) -> None:
    """Seed ``dst_run`` with ``src_run``'s tokenizer and router, so ``prepare`` reloads them.

    Several benchmark runs share one corpus, grid and seed; training a BPE and fitting
    k-means again for each would dominate a quick run. ``dipaco.job.prepare`` reuses a run
    directory's tokenizer and router when present (that is how ``resume=true`` routes
    exactly as the first run did), so copying them gives the same shards at no cost.
    Pair with a shared ``data.cache_dir`` so the tokenized corpus is reused too.
    """
    import shutil

    dst_run.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(dst_run / "tokenizer.json", (src_run / "tokenizer.json").read_bytes())
    # what they were made from: prepare refuses a tokenizer or router it cannot check
    if (src_run / "fingerprints.json").is_file():
        atomic_write_bytes(dst_run / "fingerprints.json", (src_run / "fingerprints.json").read_bytes())
    if (src_run / "router").is_dir():
        shutil.copytree(src_run / "router", dst_run / "router", dirs_exist_ok=True)
