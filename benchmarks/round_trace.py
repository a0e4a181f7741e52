"""Which of the project's files one training round enters (docs/design.md, "The round").

``python -m benchmarks.round_trace [overrides ...]``: trains ``experiment=smoke`` for two
rounds with a checkpoint after each (local backend), and records every function of the
project (``dipaco/``, ``router/``, ``modules/``) that is called from the start of round 2
(:func:`dipaco.rounds.loop.run_round`) to the end of its checkpoint
(:meth:`dipaco.rounds.record.RoundRecorder.checkpoint`), with ``sys.setprofile``. It
prints the files in the order first entered, each with the functions called in it. Round
2 rather than round 1: the first round also builds what later rounds reuse (data
streams, buffers), which is set-up, not the round. Overrides go to the run's config
(``diloco.streaming=true``: a streaming round). Nothing is timed; a minute on 2 cores.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any, Optional

import dipaco.rounds.loop as loop
from dipaco.config import compose_config
from dipaco.job.train import train
from dipaco.rounds.record import RoundRecorder

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dipaco", "router", "modules")


class RoundTrace:
    """The project's files and functions entered while it is on (:meth:`profile`)."""

    def __init__(self) -> None:
        self.files: dict[str, set[str]] = {}  # insertion order: first entered first
        self.on = False

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        """A ``sys.setprofile`` hook: note each Python call into the project's packages."""
        if event != "call" or not self.on:
            return
        try:
            rel = Path(frame.f_code.co_filename).resolve().relative_to(ROOT)
        except ValueError:
            return
        if rel.parts[0] in PACKAGES:
            self.files.setdefault(str(rel), set()).add(frame.f_code.co_name)


def trace_round(overrides: list[str], traced: int = 2) -> RoundTrace:
    """Train two rounds and trace round ``traced`` (1-based) up to its checkpoint."""
    trace = RoundTrace()
    run_round, checkpoint = loop.run_round, RoundRecorder.checkpoint

    def traced_round(rs: Any, r: int, on_step: Optional[Any] = None) -> Any:
        if r + 1 == traced:
            trace.on = True
            sys.setprofile(trace.profile)
        return run_round(rs, r, on_step=on_step)

    def traced_checkpoint(self: RoundRecorder, n: int) -> Any:
        out = checkpoint(self, n)
        if trace.on:
            sys.setprofile(None)
            trace.on = False
        return out

    loop.run_round, RoundRecorder.checkpoint = traced_round, traced_checkpoint  # type: ignore[assignment]
    try:
        with tempfile.TemporaryDirectory() as d:
            cfg = compose_config(["experiment=smoke", "trainer.rounds=2", "trainer.checkpoint_every=1",
                                  "trainer.dense_baseline=false", "trainer.plots=false", *overrides],
                                 str(Path(d) / "run"))
            train(cfg)
    finally:
        loop.run_round, RoundRecorder.checkpoint = run_round, checkpoint  # type: ignore[assignment]
        sys.setprofile(None)
    return trace


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="config overrides of the traced run")
    args = ap.parse_args(argv)
    trace = trace_round(args.overrides)
    print(f"one round, from run_round to its checkpoint: {len(trace.files)} files")
    for f, names in trace.files.items():
        shown = sorted(n for n in names if not n.startswith("<"))
        print(f"  {f}: {', '.join(shown) or '(comprehensions only)'}")


if __name__ == "__main__":
    main()
