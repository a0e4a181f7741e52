"""Progress output: tqdm bars on a terminal, nothing per step in a log.

A bar redraws itself with ``\\r`` on every update; written to a file that is thousands
of lines of noise (the default run left 3,480 updates, 283 kB). So bars are drawn only
when ``trainer.progress`` asks for them *and* stderr is a terminal. Logs get the one
``[dipaco] ...`` line per round and per phase (corpus, routing, warm-up, baseline) that
the job prints either way. tqdm is wrapped here and nowhere else in ``dipaco/``.
"""
from __future__ import annotations

import sys
from typing import Optional

from tqdm import tqdm


def bars_enabled(requested: bool) -> bool:
    """Draw progress bars: asked for (``trainer.progress``) and stderr is a terminal."""
    return bool(requested) and sys.stderr.isatty()


def progress_bar(requested: bool, total: int, desc: str, unit: str) -> Optional[tqdm]:
    """A transient tqdm bar on stderr, or None when :func:`bars_enabled` says no."""
    if not bars_enabled(requested):
        return None
    return tqdm(total=total, desc=desc, unit=unit, leave=False)
