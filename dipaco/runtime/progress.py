"""Progress output: tqdm bars on a terminal, nothing per step in a log, and the one logger.

A bar redraws itself with ``\\r`` on every update; written to a file that is thousands
of lines of noise (the default run left 3,480 updates, 283 kB). So bars are drawn only
when ``trainer.progress`` asks for them *and* stderr is a terminal. Logs get the one
``[dipaco] ...`` line per round and per phase (corpus, routing, warm-up, baseline) that
the job prints either way. tqdm is wrapped here and nowhere else in ``dipaco/``.

Those lines go through ONE logger, ``logging.getLogger("dipaco")`` (:data:`log`; its
children, ``logging.getLogger(__name__)`` in ``dipaco.*``, print through it too): each
record is one ``[dipaco] <message>`` line on the standard output of the moment, flushed.
It does not propagate to the root logger, whose console handler (Hydra's, under
``dipaco-train``) would print every line a second time in another format.
"""
from __future__ import annotations

import logging
import sys
from typing import Optional

from tqdm import tqdm

__all__ = ["bars_enabled", "log", "progress_bar", "say"]

log = logging.getLogger("dipaco")


class _Stdout(logging.StreamHandler):
    """Writes to whatever ``sys.stdout`` is when a line is logged (a redirect, a test's
    capture), not the one of the moment the handler was made."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    @property  # type: ignore[override]
    def stream(self):  # noqa: D102
        return sys.stdout

    @stream.setter
    def stream(self, _value) -> None:  # StreamHandler.__init__ assigns it
        pass


if not any(isinstance(h, _Stdout) for h in log.handlers):
    _handler = _Stdout()
    _handler.setFormatter(logging.Formatter("[dipaco] %(message)s"))
    log.addHandler(_handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def say(msg: str, rank: Optional[int] = None) -> None:
    """One ``[dipaco] ...`` line; in the torch backend (``rank`` given) from rank 0 only."""
    if rank is None or rank == 0:
        log.info(msg)


def bars_enabled(requested: bool) -> bool:
    """Draw progress bars: asked for (``trainer.progress``) and stderr is a terminal."""
    return bool(requested) and sys.stderr.isatty()


def progress_bar(requested: bool, total: int, desc: str, unit: str) -> Optional[tqdm]:
    """A transient tqdm bar on stderr, or None when :func:`bars_enabled` says no."""
    if not bars_enabled(requested):
        return None
    return tqdm(total=total, desc=desc, unit=unit, leave=False)
