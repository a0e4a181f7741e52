"""Token events from the engine thread to the event loop: one wake-up per engine step.

A step hands out one event per row in flight (one per request, since a request's prompt
is a row). Waking the event loop for each (``loop.call_soon_threadsafe``: a lock, a write
to the loop's self-pipe, then a GIL hand-over to the loop thread) made the server spend
its second core on wake-ups while the engine thread waited for the GIL between its torch
calls: 32 closed-loop clients on the README's default run took 9 ms a step against the
in-process engine's 6 ms (``benchmarks/bench_serve.py``, 2 AMD EPYC cores). The mailbox
coalesces: the engine thread posts a step's events, then flushes once (its step listener,
:meth:`dipaco.serve.engine_thread.EngineThread.add_step_listener`), and the delivery (on the
loop) puts each event on its request's queue, in the order posted. A wake-up per event
that was merely coalesced while the loop was busy still woke the loop 5 times a step:
every ``send`` to the self-pipe released the GIL to the loop thread.
"""
from __future__ import annotations

import asyncio
import threading
from collections import deque
from typing import Any


class LoopMailbox:
    """Events for the asyncio queues of one event loop; :meth:`post` is thread-safe."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: deque[tuple[asyncio.Queue, Any]] = deque()
        self._lock = threading.Lock()
        self._scheduled = False
        self.deliveries = 0  # wake-ups of the loop so far (tests, /health)

    def post(self, queue: "asyncio.Queue[Any]", event: Any) -> None:
        """Queue ``event`` for ``queue`` (any thread); the loop gets it after the next :meth:`flush`."""
        with self._lock:
            self._items.append((queue, event))

    def flush(self) -> None:
        """Wake the loop once for everything posted and not yet delivered (any thread)."""
        with self._lock:
            if self._scheduled or not self._items:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop has closed (the server is shutting down): nobody waits
            with self._lock:
                self._items.clear()
                self._scheduled = False

    def _deliver(self) -> None:
        """On the loop: every event posted since the last delivery, to its queue, in order."""
        with self._lock:
            items, self._items = self._items, deque()
            self._scheduled = False
        self.deliveries += 1
        for queue, event in items:
            queue.put_nowait(event)
