"""The engine thread: one thread runs ``engine.step()`` while there is work.

Requests are submitted from the server's event loop (:meth:`EngineThread.submit`: the
engine queues them per path) and join a running batch at its next step, not after it
drains. Each step's token events go to the sink registered with their request (the app's
sink hands them to an asyncio queue with ``loop.call_soon_threadsafe``).

Failure rules: a bad request is refused by ``engine.submit`` (``ValueError``) and never
reaches the thread; a sink that raises loses its own events only. If ``engine.step()``
itself raises, the engine's state is unknown: the thread stops, every open request gets
:data:`ENGINE_FAILED` and later submits raise :class:`EngineDown` (``/health`` says so,
requests get 503).
"""
from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

from dipaco.serve.engine_process import EngineFailed
from dipaco.serve.errors import one_line

log = logging.getLogger("dipaco.serve")

# handed to every open request's sink when the engine fails
ENGINE_FAILED = object()

Sink = Callable[[Any], None]


class Engine(Protocol):
    """:class:`dipaco.inference.engine.RoutedEngine`'s API as the thread uses it."""

    def submit(self, request: Any) -> int: ...

    def cancel(self, request_id: int) -> None: ...

    def step(self) -> list: ...

    def has_work(self) -> bool: ...

    def close(self) -> None:
        """Release what the engine holds; a :meth:`step` blocked in another thread returns."""


class EngineDown(RuntimeError):
    """The engine thread has stopped (failed or shut down): no request can be served."""


@dataclass
class BatchStats:
    """What the thread has seen (``/health`` shows it; tests read it).

    Attributes:
        steps: ``engine.step()`` calls that produced events.
        tokens: token events handed out.
        max_rows: the most requests that got a token from one step (one path's batch; with
            several engine processes, the batches of those whose steps were read together).
        joined_running: requests whose first token came from a step that also served a
            request which had had tokens before (they joined a running batch).
        submitted, finished: requests in and out.
        prompt_tokens: the submitted requests' prompt tokens.
        rows_total, last_rows: rows summed over the steps, and the last step's.
        path_tokens, path_rows: tokens by the path that made them; requests by the path of
            their first token (``/metrics``).
    """

    steps: int = 0
    tokens: int = 0
    max_rows: int = 0
    joined_running: int = 0
    submitted: int = 0
    finished: int = 0
    prompt_tokens: int = 0
    rows_total: int = 0
    last_rows: int = 0
    path_tokens: Counter = field(default_factory=Counter)
    path_rows: Counter = field(default_factory=Counter)

    def health(self) -> dict:
        """The counters ``/health`` shows (the per-path ones are ``/metrics``')."""
        return {k: v for k, v in vars(self).items() if not isinstance(v, Counter)}


class EngineThread:
    """Drives one engine from one daemon thread; thread-safe :meth:`submit` / :meth:`cancel`."""

    def __init__(self, engine: Engine, *, name: str = "dipaco-engine") -> None:
        self.engine = engine
        self.stats = BatchStats()
        self.error: Optional[str] = None
        # the error code of the 503s once it is not running: ``engine_down`` (a failure: look
        # at the server) or ``shutting_down`` (:meth:`refuse_open`: try again once it is back)
        self.down_code = "engine_down"
        self._sinks: dict[int, Sink] = {}
        self._started: set[int] = set()  # requests that have had a token
        self._lock = threading.Lock()  # sinks, stats; held around submit so no event outruns its sink
        self._wake = threading.Condition(threading.Lock())
        self._stopping = False
        self._step_listeners: list[Callable[[], None]] = []
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    # ---------------------------------------------------------------- control

    def start(self) -> "EngineThread":
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the thread to stop after its current step and wait for it."""
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        self.engine.close()  # an engine in another process: ends a step blocked in its read
        if self._thread.is_alive():
            self._thread.join(timeout)

    def refuse_open(self, reason: str) -> None:
        """Answer every open request ``reason`` (503, as for a failure: a stream gets an error
        event before ``[DONE]``) and refuse later ones: the server is stopping and will not
        finish them. Any thread; the engine process is stopped by :meth:`stop`."""
        if self.error is None:
            self.down_code = "shutting_down"
            self._fail(reason)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def active(self) -> int:
        """Requests submitted and not yet finished."""
        with self._lock:
            return len(self._sinks)

    @property
    def waiting(self) -> int:
        """Requests submitted that have had no token yet (queued for their path's batch)."""
        with self._lock:
            return len(self._sinks) - len(self._started)

    def add_step_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` on the engine thread after each step's events went to their
        sinks (and after a failure's): a sink may hold events back until then and hand the
        whole step over at once (dipaco/serve/mailbox.py)."""
        self._step_listeners.append(listener)

    def _steps_ended(self) -> None:
        for listener in self._step_listeners:
            try:
                listener()
            except Exception:  # a listener costs its own requests only
                log.exception("a step listener failed")

    # ---------------------------------------------------------------- requests

    def submit(self, request: Any, sink: Sink) -> int:
        """Queue ``request``; its events go to ``sink`` (called on the engine thread).

        Raises ``ValueError`` (the engine refused the request, one line) or
        :class:`EngineDown`.
        """
        with self._lock:
            if self.error is not None or self._stopping:
                raise EngineDown(self.error or "the server is shutting down")
            rid = int(self.engine.submit(request))
            self._sinks[rid] = sink
            self.stats.submitted += 1
            self.stats.prompt_tokens += len(getattr(request, "prompt_ids", ()))
        with self._wake:
            self._wake.notify_all()
        return rid

    def cancel(self, request_id: int) -> None:
        """Free the request's row at the engine's next step; its later events are dropped."""
        with self._lock:
            known = self._sinks.pop(request_id, None) is not None
            self._started.discard(request_id)
            if known:
                self.stats.finished += 1
        if known and self.error is None:
            try:
                self.engine.cancel(request_id)
            except Exception as e:  # a row the engine has already finished: nothing to free
                log.debug("cancel(%s): %s", request_id, e)
            with self._wake:
                self._wake.notify_all()

    # ---------------------------------------------------------------- the loop

    def _loop(self) -> None:
        while True:
            try:
                if not self._wait_for_work():
                    return
                events = self.engine.step()
            except EngineFailed as e:  # an engine in another process, which says why itself
                log.error("%s", e)
                self._fail(one_line(str(e)))
                return
            except Exception as e:  # the engine's state is unknown now: stop serving, say why
                log.exception("the engine failed")
                self._fail(f"the engine failed: {type(e).__name__}: {one_line(str(e))}")
                return
            self._dispatch(events)

    def _wait_for_work(self) -> bool:
        """Block until the engine has work (True) or the thread is asked to stop (False)."""
        with self._wake:
            while not self._stopping:
                if self.engine.has_work():
                    return True
                self._wake.wait(0.5)  # a timeout too: work may appear without a notify
            return False

    def _dispatch(self, events: list) -> None:
        with self._lock:
            if events:
                self.stats.steps += 1
            rows = {ev.request_id for ev in events}
            stats = self.stats
            stats.max_rows = max(stats.max_rows, len(rows))
            if events:
                stats.rows_total += len(rows)
                stats.last_rows = len(rows)
            running = bool(rows & self._started)
            for ev in events:
                rid = ev.request_id
                sink = self._sinks.get(rid)
                if sink is None:  # cancelled, or finished already
                    continue
                if ev.token is not None:
                    stats.tokens += 1
                    stats.path_tokens[ev.path] += 1
                    if rid not in self._started:
                        self._started.add(rid)
                        stats.joined_running += running
                        stats.path_rows[ev.path] += 1
                if ev.finished:
                    self._sinks.pop(rid, None)
                    self._started.discard(rid)
                    self.stats.finished += 1
                try:
                    sink(ev)
                except Exception:  # one request's sink costs that request only
                    log.exception("dropping an event of request %s", rid)
        self._steps_ended()

    def _fail(self, message: str) -> None:
        with self._lock:
            self.error = message
            sinks, self._sinks = list(self._sinks.values()), {}
            self._started.clear()
        for sink in sinks:
            try:
                sink(ENGINE_FAILED)
            except Exception:
                log.exception("telling a request the engine failed")
        self._steps_ended()
