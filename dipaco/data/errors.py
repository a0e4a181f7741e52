"""The one exception of the data package (docs/design.md contract 7: bad input never crashes deep inside)."""
from __future__ import annotations


class DataError(ValueError):
    """Input data that cannot be used; the one-line message names the file or key and the fix.

    A ``ValueError`` so callers that already catch bad values (the CLIs) print it as one
    line; it never carries a multi-line traceback of some library's internals.
    """
