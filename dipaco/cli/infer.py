"""``dipaco-infer``: routed inference over a finished run (route | generate | score | export)."""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    from dipaco.cli.errors import fail

    fail("dipaco-infer is not implemented yet (issue 6)")


if __name__ == "__main__":
    main(sys.argv[1:])
