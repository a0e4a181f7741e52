"""Progress output: tqdm bars on a terminal, nothing per step in a log, and the one logger.

A bar redraws itself with ``\\r`` on every update; written to a file that is thousands
of lines of noise (the default run left 3,480 updates, 283 kB). So bars are drawn only
when ``trainer.progress`` asks for them *and* stderr is a terminal. Logs get the one
``[dipaco] ...`` line per round and per phase (corpus, routing, warm-up, baseline) that
the job prints either way; while a bar is drawn, each line goes through tqdm's own
``write``, which clears the bars, prints the line and draws them again, so no line prints
over a bar. tqdm is wrapped here and nowhere else in ``dipaco/``.

Those lines go through ONE logger, ``logging.getLogger("dipaco")`` (:data:`log`; its
children, ``logging.getLogger(__name__)`` in ``dipaco.*``, print through it too): each
INFO record is one ``[dipaco] <message>`` line on the standard output of the moment,
flushed. It does not propagate to the root logger, whose console handler (Hydra's, under
``dipaco-train``) would print every line a second time in another format.

The run's log file, ``train.log`` in the run directory (the name Hydra gives its job
log, which the CLIs switch off so that a refused command writes nothing), is written
by the same logger: :func:`run_log` holds the records while the job checks the run, and
:func:`open_run_log` writes them, and every later one, once the run is accepted. The
file also gets the DEBUG records (one line per logged step, written by
:mod:`dipaco.runtime.tracking`), which the console leaves out, and a time stamp per line.
"""
from __future__ import annotations

import contextlib
import logging
import sys
from pathlib import Path
from typing import Iterator, Optional

from tqdm import tqdm

from dipaco.storage.atomic import atomic_write_text

__all__ = ["bars_enabled", "log", "open_run_log", "progress_bar", "run_log", "say", "say_plain",
           "share_run_log"]

log = logging.getLogger("dipaco")
# Hydra's job-log format, so train.log reads like the log Hydra would have written
FILE_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"


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

    def emit(self, record: logging.LogRecord) -> None:
        if not _bars_on_screen():
            super().emit(record)
            return
        try:  # tqdm's own write: clears the bars, prints the line, draws them again below it
            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001 - logging's contract: report, never raise
            self.handleError(record)


def _bars_on_screen() -> bool:
    """Whether a progress bar is being drawn now (a log line must not print over it)."""
    return bool(getattr(tqdm, "_instances", None))


class _Format(logging.Formatter):
    """``fmt`` for messages; a record logged with ``extra={"plain": True}`` (the summary
    table: several lines that are read as a block) as it is."""

    def format(self, record: logging.LogRecord) -> str:
        return record.getMessage() if getattr(record, "plain", False) else super().format(record)


if not any(isinstance(h, _Stdout) for h in log.handlers):
    _handler = _Stdout()
    _handler.setFormatter(_Format("[dipaco] %(message)s"))
    _handler.setLevel(logging.INFO)  # the DEBUG lines (per-step health) go to train.log only
    log.addHandler(_handler)
    log.setLevel(logging.DEBUG)
    log.propagate = False


class _RunLog(logging.Handler):
    """``train.log``: records are held until the run is accepted, then written there."""

    HOLD = 10_000  # records held at most before the run is accepted (a few in practice)

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.held: list[logging.LogRecord] = []
        self.file: Optional[logging.FileHandler] = None

    def open(self, path: Path, fresh: bool) -> None:
        if self.file is not None:
            if Path(self.file.baseFilename) == path.resolve():
                return
            self.file.close()
        if fresh:  # a fresh run's log starts empty (emptied, then appended to, like every writer)
            atomic_write_text(path, "", durable=False)
        # always "a" (O_APPEND): a spawned rank 0 appends to the same file, and a writer at
        # its own offset would overwrite that rank's lines
        self.file = logging.FileHandler(path, mode="a", encoding="utf-8")
        self.file.setFormatter(_Format(FILE_FORMAT))
        for record in self.held:
            self.file.emit(record)
        self.held.clear()

    def emit(self, record: logging.LogRecord) -> None:
        if self.file is not None:
            self.file.emit(record)
        elif len(self.held) < self.HOLD:
            self.held.append(record)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        self.held.clear()
        super().close()


@contextlib.contextmanager
def run_log() -> Iterator[None]:
    """While the block runs, the ``dipaco`` logger's records are kept for the run's
    ``train.log``: held until :func:`open_run_log` names the file, dropped if it never
    does (a refused run writes nothing)."""
    handler = _RunLog()
    log.addHandler(handler)
    try:
        yield
    finally:
        log.removeHandler(handler)
        handler.close()


def open_run_log(path: Path, fresh: bool) -> None:
    """The run is accepted: write the held records to ``path`` (emptied first when
    ``fresh``) and every later record after them. A no-op outside :func:`run_log`."""
    for h in log.handlers:
        if isinstance(h, _RunLog):
            h.open(path, fresh)


def share_run_log(path: Path) -> None:
    """A spawned rank 0 adds its messages to the job's ``train.log`` (when the job
    made one: a direct ``launch()`` writes no log file)."""
    if path.is_file() and not any(isinstance(h, _RunLog) for h in log.handlers):
        handler = _RunLog()
        handler.open(path, fresh=False)
        log.addHandler(handler)


def say(msg: str, rank: Optional[int] = None) -> None:
    """One ``[dipaco] ...`` line; in the torch backend (``rank`` given) from rank 0 only."""
    if rank is None or rank == 0:
        log.info(msg)


def say_plain(text: str) -> None:
    """Lines printed as they are (the summary table), and kept in ``train.log``."""
    log.info(text, extra={"plain": True})


def bars_enabled(requested: bool) -> bool:
    """Draw progress bars: asked for (``trainer.progress``) and stderr is a terminal."""
    return bool(requested) and sys.stderr.isatty()


def progress_bar(requested: bool, total: int, desc: str, unit: str) -> Optional[tqdm]:
    """A transient tqdm bar on stderr, or None when :func:`bars_enabled` says no."""
    if not bars_enabled(requested):
        return None
    return tqdm(total=total, desc=desc, unit=unit, leave=False)
