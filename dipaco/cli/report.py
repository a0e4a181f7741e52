"""``dipaco-report DIR [DIR ...] [--metric M] [--ignore KEY ...]``: multirun directories → markdown table and plot.

Writes ``report.md``, ``report.json`` and ``report.png`` into the first DIR and prints
the table. Runs that differ only in ``seed`` are averaged (mean ± spread); further
DIRs add their runs (e.g. the default run beside a sweep that skipped it).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from dipaco.cli.errors import report_user_errors
from dipaco.run.path_guard import check_target, is_run_directory
from dipaco.job.report import IGNORED, REPORT_FILES, write_report


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``dipaco-report``."""
    parser = argparse.ArgumentParser(prog="dipaco-report", description=__doc__.splitlines()[0])
    parser.add_argument("directories", type=Path, nargs="+", metavar="DIR",
                        help="multirun (sweep) or single run directories; the report goes into the first")
    parser.add_argument("--metric", default=None,
                        help="summary.json key to plot (default: ratio_vs_dense, or routed_ppl without a dense baseline)")
    parser.add_argument("--ignore", nargs="*", default=[], metavar="KEY",
                        help="more override keys that do not define a setting (e.g. trainer.dense_baseline)")
    return parser


@report_user_errors
def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    args = build_parser().parse_args(argv)
    for d in args.directories:
        if not d.is_dir():
            raise FileNotFoundError(f"no such directory: {d}")
    # the report goes into the first DIR: a sweep folder, or a run directory's top (its own
    # report files), never inside a run (a checkpoint holding report.md would fail its manifest)
    first = args.directories[0]
    own = first if is_run_directory(first.expanduser().resolve()) else None
    for name in REPORT_FILES:
        check_target(first / name, "dipaco-report DIR", own_run=own, owned=REPORT_FILES,
                     fix="pass the sweep folder or the run directory itself first")
    print(write_report(args.directories[0], args.metric, more=tuple(args.directories[1:]),
                       ignore=IGNORED | frozenset(args.ignore)))


if __name__ == "__main__":
    main()
