"""``dipaco-report DIR [--metric M]``: a multirun directory → markdown table and plot.

Writes ``DIR/report.md``, ``DIR/report.json`` and ``DIR/report.png`` and prints the
table. Runs that differ only in ``seed`` are averaged (mean ± spread).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from dipaco.cli.errors import report_user_errors


@report_user_errors
def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    parser = argparse.ArgumentParser(prog="dipaco-report", description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path, help="a multirun (sweep) directory or a single run directory")
    parser.add_argument("--metric", default="ratio_vs_dense", help="summary.json key to plot")
    args = parser.parse_args(argv)
    if not args.directory.is_dir():
        raise FileNotFoundError(f"no such directory: {args.directory}")
    from dipaco.report import write_report

    print(write_report(args.directory, args.metric))


if __name__ == "__main__":
    main()
