"""One place that turns errors into one line on stderr: exit 2 for what the user can
fix (a bad flag, a missing file, a corrupt run directory), exit 1 for what the
environment did (a signal, a full disk).

A raw traceback from a bad flag, a missing file or a corrupt run directory is a bug
(docs/design.md, "Errors a user can cause"). Anything not listed here is a real bug and keeps its
traceback; ``HYDRA_FULL_ERROR=1`` or ``--debug`` (``DIPACO_DEBUG=1``) keep it for every error.
"""
from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable, TypeVar

from dipaco.run.checkpoint import CheckpointError
from dipaco.config import ConfigError
from dipaco.data import DataError
from dipaco.runtime.launch import LaunchError
from dipaco.run.run_dir import RunDirError, RunStopped

F = TypeVar("F", bound=Callable[..., Any])


def user_errors() -> tuple[type[BaseException], ...]:
    """Exception types that mean "the user can fix this"."""
    return (ConfigError, CheckpointError, LaunchError, FileNotFoundError, DataError, RunDirError)


def debugging() -> bool:
    """Tracebacks wanted: ``HYDRA_FULL_ERROR=1`` or ``--debug`` / ``DIPACO_DEBUG=1``."""
    return os.environ.get("HYDRA_FULL_ERROR") == "1" or os.environ.get("DIPACO_DEBUG") == "1"


def fail(message: str, code: int = 2) -> None:
    """Print ``dipaco: error: <message>`` (one line) and exit."""
    first = " ".join(str(message).split())
    print(f"dipaco: error: {first}", file=sys.stderr)
    raise SystemExit(code)


def report_user_errors(fn: F) -> F:
    """Decorator for CLI bodies: user errors become one line and exit code 2, a run
    stopped by its environment one line and exit code 1."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except user_errors() as e:
            if debugging():
                raise
            fail(str(e))
        except RunStopped as e:
            if debugging():
                raise
            fail(str(e), code=1)
        except KeyboardInterrupt:
            fail("interrupted (the last complete checkpoint is kept; resume=true continues from it)", code=1)

    return wrapper  # type: ignore[return-value]
