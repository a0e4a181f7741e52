"""One place that turns errors a user can cause into one line on stderr and exit 2.

A raw traceback from a bad flag, a missing file or a corrupt run directory is a bug
(docs/design.md, "Errors a user can cause"). Anything not listed here is a real bug and keeps its
traceback.
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable, TypeVar

from dipaco.checkpoint import CheckpointError
from dipaco.config import ConfigError
from dipaco.data import DataError
from dipaco.launch import LaunchError
from dipaco.run_dir import RunDirError

F = TypeVar("F", bound=Callable[..., Any])


def user_errors() -> tuple[type[BaseException], ...]:
    """Exception types that mean "the user can fix this"."""
    return (ConfigError, CheckpointError, LaunchError, DataError, RunDirError, FileNotFoundError)


def fail(message: str, code: int = 2) -> None:
    """Print ``dipaco: error: <message>`` (one line) and exit."""
    first = " ".join(str(message).split())
    print(f"dipaco: error: {first}", file=sys.stderr)
    raise SystemExit(code)


def report_user_errors(fn: F) -> F:
    """Decorator for CLI bodies: user errors become one line and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except user_errors() as e:
            fail(str(e))
        except KeyboardInterrupt:
            fail("interrupted", code=130)

    return wrapper  # type: ignore[return-value]
