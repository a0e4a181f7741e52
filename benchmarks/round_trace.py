"""What a reader must read for one training round (docs/design.md, "One DiLoCo round, end
to end"), and which of the project's files the round enters.

``python -m benchmarks.round_trace [overrides ...]``: trains ``experiment=smoke`` for two
rounds with a checkpoint after each (local backend) and traces round 2 with
``sys.setprofile`` (round 1 also builds what later rounds reuse: set-up, not the round).
Overrides go to the run's config (``diloco.streaming=true``: a streaming round). Nothing
is timed; a minute on 2 cores. It prints three measures:

* **the reading set**: the files of the round's own logic and inner step, and their
  lines: every file a function is called in from :func:`dipaco.rounds.loop.run_round`'s
  entry to its return, less the black boxes of :data:`BLACK_BOXES` (each a one-line
  contract: communicators, codecs, the model, the data stream, the records...). A file's
  lines are those of the functions called in it (the union of their source lines,
  docstrings included: what a reader of the round reads). Target: ≤ 6 files, ≤ 650 lines.
* **the depth to the outer step**: the project's files on the call stack when the first
  outer step (:meth:`dipaco.sync.module_core.ModuleCore.step`) runs, from ``run_round``
  down, and the *bounces* (a return to a file already left on the way down). Target:
  ≤ 4 files, no bounce.
* **the plumbing count**: every file of ``dipaco/``, ``router/`` and ``modules/`` a
  function is called in from the start of the round to the end of its checkpoint
  (:meth:`dipaco.rounds.record.RoundRecorder.checkpoint`): recorded, not a target (each is
  a file of one owner; merging them to meet a count would undo that).
"""
from __future__ import annotations

import argparse
import inspect
import sys
import tempfile
from pathlib import Path
from types import CodeType, FrameType
from typing import Any, Optional

import dipaco.rounds.loop as loop
from dipaco.config import compose_config
from dipaco.job.train import train
from dipaco.rounds.record import RoundRecorder
from dipaco.sync.module_core import ModuleCore

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dipaco", "router", "modules")

#: what a round calls beyond its own logic, each behind a one-line contract (docs/design.md)
BLACK_BOXES = {
    "dipaco/sync/comm.py": "the local communicator: sums a module over its module group, bytes as planned",
    "dipaco/sync/torch_comm.py": "the torch communicator: the same over process groups",
    "dipaco/plan/comm_plan.py": "the bytes each exchange sends (planner and communicators)",
    "dipaco/plan/codecs.py": "encode / decode a contribution",
    "dipaco/plan/stagger.py": "streaming's bytes in flight by the schedule (a record)",
    "dipaco/sync/outer.py": "the outer optimisers (torch.optim)",
    "dipaco/sync/groups.py": "the process groups (contract 2)",
    "dipaco/sync/alpha.py": "α of a path's tokens",
    "dipaco/sync/fsdp.py": "whether a module is FSDP-sharded",
    "dipaco/plan/topology.py": "who trains which path, who holds which module",
    "dipaco/rounds/rank.py": "what the rank holds, built once before round 0",
    "dipaco/rounds/record.py": "what the rounds leave behind (records, checkpoints)",
    "dipaco/config/schedule.py": "the learning rate of a step",
    "dipaco/data/batches.py": "a path's token stream",
    "dipaco/runtime/device.py": "devices and precision",
    "dipaco/runtime/faults.py": "the fault hook (a no-op unless DIPACO_FAULT is set)",
    "dipaco/runtime/progress.py": "the logger and progress bars",
    "dipaco/runtime/hardware.py": "memory and MFU of a turn's record",
    "dipaco/rounds/health.py": "per-step health metrics",
    "dipaco/rounds/turn_log.py": "a turn's step records",
    "modules/": "the model",
}


def black_box(rel: str) -> bool:
    """Whether a file is one of :data:`BLACK_BOXES` (a folder covers its files)."""
    return any(rel == b or (b.endswith("/") and rel.startswith(b)) for b in BLACK_BOXES)


def _function_lines(code: CodeType) -> set[int]:
    """The source lines a function spans (its definition to its last line)."""
    last = max((line for _, _, line in code.co_lines() if line is not None), default=code.co_firstlineno)
    return set(range(code.co_firstlineno, last + 1))


class RoundTrace:
    """The project's files and functions entered while it is on (:meth:`profile`)."""

    def __init__(self) -> None:
        self.files: dict[str, set[str]] = {}  # insertion order: first entered first
        self.reading: dict[str, set[int]] = {}  # run_round's own files: the lines read
        self.in_round = False  # between run_round's entry and its return
        self.outer_path: Optional[list[str]] = None  # files from run_round down to the first outer step
        self.on = False

    @staticmethod
    def _rel(frame: FrameType) -> Optional[str]:
        try:
            rel = Path(frame.f_code.co_filename).resolve().relative_to(ROOT)
        except ValueError:
            return None
        return str(rel) if rel.parts[0] in PACKAGES else None

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        """A ``sys.setprofile`` hook: note each Python call into the project's packages."""
        if event != "call" or not self.on:
            return
        rel = self._rel(frame)
        if rel is None:
            return
        self.files.setdefault(rel, set()).add(frame.f_code.co_name)
        if self.in_round and not black_box(rel):
            self.reading.setdefault(rel, set()).update(_function_lines(frame.f_code))
        if self.in_round and self.outer_path is None and frame.f_code is OUTER_STEP:
            self.outer_path = self._stack_files(frame)

    def _stack_files(self, frame: Optional[FrameType]) -> list[str]:
        """The project's files on the stack, from ``run_round`` down to ``frame``."""
        files = []
        while frame is not None:
            rel = self._rel(frame)
            if rel is not None and (not files or files[-1] != rel):
                files.append(rel)
            if frame.f_code is ORIGINAL_RUN_ROUND.__code__:
                break
            frame = frame.f_back
        return files[::-1]


ORIGINAL_RUN_ROUND = loop.run_round
OUTER_STEP = inspect.unwrap(ModuleCore.step).__code__  # under its torch.no_grad wrapper


def trace_round(overrides: list[str], traced: int = 2) -> RoundTrace:
    """Train two rounds and trace round ``traced`` (1-based) up to its checkpoint."""
    trace = RoundTrace()
    run_round, checkpoint = loop.run_round, RoundRecorder.checkpoint

    def traced_round(rs: Any, r: int, on_step: Optional[Any] = None) -> Any:
        if r + 1 != traced:
            return run_round(rs, r, on_step=on_step)
        trace.on = trace.in_round = True
        sys.setprofile(trace.profile)
        try:
            return run_round(rs, r, on_step=on_step)
        finally:
            trace.in_round = False

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


def depth(path: list[str]) -> tuple[int, int]:
    """``(files, bounces)`` of a call path of files (consecutive repeats already merged)."""
    return len(set(path)), len(path) - len(set(path))


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="config overrides of the traced run")
    args = ap.parse_args(argv)
    trace = trace_round(args.overrides)
    lines = {f: len(ls) for f, ls in trace.reading.items()}
    print(f"reading set of one round (run_round and what it calls, less the black boxes): "
          f"{len(lines)} files, {sum(lines.values())} lines")
    for f, n in lines.items():
        print(f"  {f}: {n} lines")
    path = trace.outer_path or []
    files, bounces = depth(path)
    print(f"run_round to the outer step: {files} files, {bounces} bounces: {' -> '.join(path)}")
    print(f"plumbing: one round, from run_round to its checkpoint: {len(trace.files)} files")
    for f, names in trace.files.items():
        shown = sorted(n for n in names if not n.startswith("<"))
        print(f"  {f}: {', '.join(shown) or '(comprehensions only)'}")
    return {"reading_files": len(lines), "reading_lines": sum(lines.values()), "outer_files": files,
            "outer_bounces": bounces, "plumbing_files": len(trace.files)}


if __name__ == "__main__":
    main()
