"""PNG plots: of a run (loss per path and round with the dense baseline, shard sizes) and
the bar chart of ``dipaco-report``.

The only file that imports matplotlib (Agg backend: no display needed).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional, Sequence

from dipaco.run.run_dir import RunDir
from dipaco.storage.atomic import write_atomically


def _pyplot() -> Any:
    # lazy: matplotlib takes a second to import and only these PNGs need it
    import matplotlib

    # its INFO records ("generated new fontManager" on a fresh machine) reach Hydra's root
    # logger and so the console and train.log: they say nothing about the run
    logging.getLogger("matplotlib").setLevel(logging.WARNING)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, out: Path) -> Path:
    fig.tight_layout()
    write_atomically(out, lambda tmp: fig.savefig(tmp, dpi=100, format=out.suffix.lstrip(".") or "png"))
    plt.close(fig)
    return out


def bar_chart(out: Path, labels: Sequence[str], values: Sequence[float], ylabel: str,
              hline: Optional[float] = None) -> Path:
    """One bar per label (``dipaco-report``: one per setting), an optional dashed line."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5, 0.6 * len(values) + 2), 4))
    ax.bar(range(len(values)), list(values))
    ax.set_xticks(range(len(values)), list(labels), rotation=30, ha="right", fontsize=7)
    if hline is not None:
        ax.axhline(hline, color="k", linestyle="--", linewidth=1)
    ax.set_ylabel(ylabel)
    return _save(plt, fig, out)


def scaling_chart(out: Path, panels: Sequence[tuple[str, dict[str, tuple[Sequence[float], Sequence[float]]]]],
                  xlabel: str) -> Path:
    """Side-by-side panels of lines against one x (log-log): ``panels`` is
    ``[(ylabel, {series label: (xs, ys)})]`` (``benchmarks/bench_prepare.py``: time and
    memory against corpus size, before and after)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for ax, (ylabel, series) in zip(list(axes) if len(panels) > 1 else [axes], panels):
        for label, (xs, ys) in series.items():
            ax.plot(list(xs), list(ys), marker="o", label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", linewidth=0.3)
        ax.legend(fontsize=7)
    return _save(plt, fig, out)


def write_plots(run: RunDir) -> list[Path]:
    """Write ``plots/loss.png`` and ``plots/shards.png``; return the files written."""
    plt = _pyplot()
    run.plots.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    if run.metrics.exists():
        rows = [json.loads(line) for line in run.metrics.read_text().splitlines() if line.strip()]
        fig, ax = plt.subplots(figsize=(6, 4))
        paths = sorted({p for r in rows for p in r["paths"]}, key=int)
        for p in paths:
            pts = [(r["round"], r["paths"][p]["loss"]) for r in rows if p in r["paths"]]
            ax.plot(*zip(*pts), marker=".", label=f"path {p}")
        if run.summary.exists():
            s = json.loads(run.summary.read_text())
            base = (s.get("dense_baseline") or {}).get("train_loss")
            if base is not None:
                ax.axhline(base, color="k", linestyle="--", label="dense (final train loss)")
        ax.set_xlabel("round")
        ax.set_ylabel("mean inner training loss")
        ax.set_title("DiPaCo paths")
        if len(paths) <= 16:
            ax.legend(fontsize=7)
        written.append(_save(plt, fig, run.plots / "loss.png"))
    if run.routing_report.exists():
        rep = json.loads(run.routing_report.read_text())
        fig, ax = plt.subplots(figsize=(6, 3))
        sizes = rep["shard_sizes"]
        ax.bar(range(len(sizes)), sizes)
        ax.set_xlabel("path")
        ax.set_ylabel("documents")
        ax.set_title(f"shard sizes (imbalance {rep['imbalance']:.2f})")
        written.append(_save(plt, fig, run.plots / "shards.png"))
    return written
