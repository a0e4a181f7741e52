"""One place that turns errors into one line on stderr: exit 2 for what the user can
fix (a bad flag, a missing file, a corrupt run directory), exit 1 for what the
environment did (a signal, a full disk).

No traceback reaches a user: every console script's ``main`` is an :func:`entry_point`
(``tests/test_cli_boundary.py`` checks each one of setup.cfg's), which turns the known
error classes (the user errors below, an ``OSError`` naming a path, text that is not
UTF-8) into one line, and any other exception into one line saying where its full
traceback was written (:func:`crash_report`): a bug to report, not a screen of frames.
``HYDRA_FULL_ERROR=1`` or ``--debug`` (``DIPACO_DEBUG=1``) keep the traceback for every error.
"""
from __future__ import annotations

import errno
import functools
import os
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Optional, TypeVar

from dipaco.run.checkpoint import CheckpointError
from dipaco.config import ConfigError
from dipaco.data import DataError
from dipaco.runtime.launch import LaunchError
from dipaco.run.run_dir import RunDirError, RunStopped
from dipaco.storage.atomic import atomic_write_text

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


def known_error(e: BaseException, kept: str = "the last complete checkpoint is kept") -> Optional[tuple[str, int]]:
    """``(one line, exit code)`` for an error class a user can meet, else ``None``. ``kept``:
    what a full disk leaves behind, as the command that met it says (a training run: its
    last complete checkpoint)."""
    if isinstance(e, user_errors()):
        return str(e), 2
    if isinstance(e, RunStopped):
        return str(e), 1
    if isinstance(e, UnicodeError):
        return f"text that is not valid UTF-8 ({e}); pass UTF-8 text or files", 2
    if isinstance(e, OSError) and (e.filename is not None or e.errno is not None):
        where = "" if e.filename is None else f": {e.filename}" + ("" if e.filename2 is None else f" -> {e.filename2}")
        if e.errno == errno.ENOSPC:
            return f"no space left on the device{where}; free some space ({kept})", 1
        reason = e.strerror or type(e).__name__
        hint = {errno.EACCES: "a folder you may write", errno.EPERM: "a folder you may write",
                errno.EROFS: "a writable file system", errno.ENOTDIR: "a path whose parents are folders",
                errno.EISDIR: "a file, not a folder", errno.EEXIST: "a path that does not exist yet"}.get(e.errno or 0)
        return f"{reason}{where}" + (f"; use {hint}" if hint else ""), 2
    return None


def _check_utf8(argv: list[str]) -> None:
    """Undecodable bytes on the command line (the shell passes them as surrogates) are
    refused in one line, whichever argument (``--text``, ``--prompt``, an override) holds them."""
    for i, a in enumerate(argv):
        try:
            a.encode("utf-8")
        except UnicodeEncodeError:
            shown = a.encode("utf-8", "backslashreplace").decode("ascii", "backslashreplace")[:80]
            fail(f"command-line argument {i + 1} ({shown}) is not valid UTF-8 text; pass UTF-8 (documents in "
                 "other encodings: convert them, or put them in a --file as JSON lines)")


def crash_report(e: BaseException) -> str:
    """Write ``e``'s full traceback to a file (``$DIPACO_CRASH_DIR``, else the system's
    temporary folder) and return its path (or why it could not be written)."""
    folder = os.environ.get("DIPACO_CRASH_DIR") or tempfile.gettempdir()
    path = os.path.join(folder, f"dipaco-crash-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.txt")
    try:
        atomic_write_text(path, f"argv: {sys.argv!r}\n" + "".join(traceback.format_exception(type(e), e, e.__traceback__)),
                          durable=False)
    except OSError as err:
        return f"(not written: {err.strerror})"
    return path


def _boundary(e: BaseException) -> None:
    """The one line for ``e`` (and its exit): a known class, or a bug with its traceback file."""
    known = known_error(e)
    if known is not None:
        fail(*known)
    first = " ".join(str(e).split())[:300]
    fail(f"internal error ({type(e).__name__}: {first}); the full traceback is in {crash_report(e)} "
         "(please report it with the command you ran; --debug prints it)", code=1)


def report_user_errors(fn: F) -> F:
    """Decorator for CLI bodies and every console script's ``main`` (the error boundary):
    user errors become one line and exit code 2, a run stopped by its environment one
    line and exit code 1, any other exception one line naming the file that holds its
    traceback (exit code 1)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            _check_utf8([*sys.argv[1:], *(a for a in args if isinstance(a, str)),
                         *(x for a in args if isinstance(a, (list, tuple)) for x in a if isinstance(x, str))])
            return fn(*args, **kwargs)
        except KeyboardInterrupt:
            fail("interrupted (the last complete checkpoint is kept; resume=true continues from it)", code=1)
        except Exception as e:  # noqa: BLE001 - the boundary: nothing passes it as a traceback
            if debugging():
                raise
            _boundary(e)

    wrapper.error_boundary = True  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


entry_point = report_user_errors  # the name for a console script's main
