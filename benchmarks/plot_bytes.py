"""Routed perplexity against bytes sent, one point per run directory (``docs/results.md`` §21).

    python -m benchmarks.plot_bytes OUT.png "sync (fp32)=RUN_A,RUN_B" "streaming (fp32)=RUN_C,RUN_D" ...

Each argument after the output is ``label=dir[,dir...]``; each directory's
``summary.json`` gives ``bytes_sent`` and ``routed_ppl``. Prints one row per run.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from benchmarks.common import write_figure


def main(argv: list[str]) -> None:
    """Draw the plot named by ``argv[0]`` from the labelled run directories that follow."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for spec in argv[1:]:
        label, dirs = spec.split("=", 1)
        points = [json.loads((Path(d) / "summary.json").read_text()) for d in dirs.split(",")]
        for d, s in zip(dirs.split(","), points):
            print(f"{label:32s} {d:40s} routed_ppl {s['routed_ppl']:.3f}  bytes_sent {s['bytes_sent']:,}")
        ax.scatter([s["bytes_sent"] / 1e6 for s in points], [s["routed_ppl"] for s in points], label=label)
    ax.set_xscale("log")
    ax.set_xlabel("bytes sent (MB, log)")
    ax.set_ylabel("routed perplexity (validation)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    write_figure(fig, argv[0], dpi=100)


if __name__ == "__main__":
    main(sys.argv[1:])
