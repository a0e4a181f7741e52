"""W&B while a spawned rank trains: the job's writer follows the files rank 0 appends.

Under ``launcher=spawn`` rank 0 is a child process: it writes ``metrics.jsonl``,
``steps.jsonl`` and TensorBoard, but the W&B run belongs to the job's process (one W&B run
per job, :class:`~dipaco.runtime.tracking.MetricsWriter`). :class:`RecordTail` is a thread
of the job's process that reads what rank 0 has appended every ``every_s`` seconds and
sends it through the job's writer, so W&B shows each step while training, not at the end.

Order: W&B needs rising steps. ``steps.jsonl`` is read before ``metrics.jsonl``, so a
round record is never read later than the next round's step records (rank 0 writes it
first); each poll sends its new records sorted by step (steps before the round record of
the same step), and holds back the newest step until a later record shows it complete
(its paths' records may arrive in more than one append). Records already in the files
when the tail starts (a resumed run's) are not sent again.
"""
from __future__ import annotations

import threading
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional

from dipaco.storage.jsonl import read_json_lines
from dipaco.runtime.tracking import MetricsWriter, round_scalars, step_scalars


def _lines(path: Path) -> list[dict[str, Any]]:
    """The complete JSON lines of ``path`` (a line still being written is left for later)."""
    return read_json_lines(path, complete_only=True)


class RecordTail:
    """Send rank 0's new records to the job writer's W&B run while training.

    ``with RecordTail(writer):`` around the launch; on leaving, everything left is sent.
    """

    def __init__(self, writer: MetricsWriter, every_s: float = 5.0) -> None:
        self.writer, self.every_s = writer, every_s
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        events = self._events()
        self.sent: tuple[int, int] = events[-1][0] if events else (-1, -1)

    def _events(self) -> list[tuple[tuple[int, int], dict[str, float]]]:
        steps = _lines(self.writer.run.steps)  # first: see the module docstring
        rounds = _lines(self.writer.run.metrics)
        by_step: dict[int, list[dict]] = defaultdict(list)
        for r in steps:
            if "step" in r and "path" in r:
                by_step[int(r["step"])].append(r)
        events = [((step, 0), step_scalars(recs)) for step, recs in by_step.items()]
        events += [((self.writer.round_step(r), 1), round_scalars(r)) for r in rounds if "round" in r]
        return sorted(events, key=lambda e: e[0])

    def poll(self, final: bool = False) -> int:
        """Send the records not sent yet (all of them with ``final``); return how many."""
        events = [e for e in self._events() if e[0] > self.sent]
        if not final and events and events[-1][0][1] == 0:
            events = events[:-1]  # the newest step may still miss a path's record
        for key, scalars in events:
            self.writer.send_to_wandb(scalars, key[0])
            self.sent = key
        return len(events)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.poll()

    def __enter__(self) -> "RecordTail":
        if self.writer.wandb_run is not None:
            self._thread = threading.Thread(target=self._loop, name="dipaco-wandb-tail", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self.poll(final=True)


__all__ = ["RecordTail"]
