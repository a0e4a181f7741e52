"""``dipaco-report DIR``: a multirun directory → markdown table and plot."""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    from dipaco.cli.errors import fail

    fail("dipaco-report is not implemented yet")


if __name__ == "__main__":
    main(sys.argv[1:])
