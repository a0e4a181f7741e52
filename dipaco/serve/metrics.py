"""What the server tells its operator: ``/metrics`` in Prometheus' text format, an access
log line per request, and errors logged once per kind per interval.

* **Metrics** (:func:`render`): requests answered by endpoint and status, prompt and
  generated tokens, requests running and waiting for their first token (the queue), the
  rows of the engine's steps (batch occupancy), and tokens and requests per path; written
  by hand (the format is a few lines of text, not worth a dependency).
* **Access log** (:class:`HttpObserver`): one line per request on the
  ``dipaco.serve.access`` logger, once its response has ended (a stream: when it closed),
  with its status, seconds and, for completions, its token counts.
* **Floods** (:class:`FloodFilter`): a warning or error, or an access line of a refused
  request, is logged the first time its kind comes in an interval; the rest of that
  interval's are counted, and the count is said with the next one logged (or when the
  server stops). A client can make the server refuse thousands of requests a second; it
  cannot make it write a line for each.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Any, Callable, Iterable, Optional

from starlette.types import ASGIApp, Message, Receive, Scope, Send

access_log = logging.getLogger("dipaco.serve.access")
# endpoints counted by name; any other path is counted as "other" (a client cannot grow the series)
ENDPOINTS = ("/v1/completions", "/v1/models", "/health", "/tokenize", "/detokenize", "/tokenizer_info", "/metrics")
FLOOD_INTERVAL_S = 10.0
_MAX_KINDS = 1024  # kinds remembered by a FloodFilter (the oldest forgotten past it)


class HttpMetrics:
    """Requests answered, by endpoint and status (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.answered: Counter = Counter()

    def record(self, path: str, status: int) -> None:
        endpoint = path if path in ENDPOINTS else ("/v1/models" if path.startswith("/v1/models/") else "other")
        with self._lock:
            self.answered[(endpoint, int(status))] += 1

    def snapshot(self) -> dict[tuple[str, int], int]:
        with self._lock:
            return dict(self.answered)


class HttpObserver:
    """ASGI middleware: counts every response by endpoint and status (:class:`HttpMetrics`) and
    writes its access line. A request whose client left before any response counts as 499."""

    def __init__(self, app: ASGIApp, metrics: HttpMetrics, enabled: bool = True) -> None:
        self.app, self.metrics, self.enabled = app, metrics, enabled

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = 499

        async def tracked(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        finally:
            path = scope.get("path", "")
            self.metrics.record(path, status)
            if self.enabled:
                self._log(scope, path, status, time.perf_counter() - start)

    @staticmethod
    def _log(scope: Scope, path: str, status: int, seconds: float) -> None:
        client = scope.get("client") or ("-", 0)
        completion = (scope.get("state") or {}).get("completion")
        tokens = ""
        if completion is not None:
            usage = completion.usage()
            tokens = f" prompt_tokens={usage['prompt_tokens']} completion_tokens={usage['completion_tokens']}"
        extra = {"flood_key": ("http", status)} if status >= 400 else {}
        access_log.info('%s:%s "%s %s HTTP/%s" %d %.3fs%s', client[0], client[1], scope.get("method", ""), path,
                        scope.get("http_version", "1.1"), status, seconds, tokens, extra=extra)


class FloodFilter(logging.Filter):
    """Lets a record of each kind through once per ``interval`` seconds (module docstring).

    A record's kind is its ``flood_key`` attribute when it has one (an access line of a
    refused request: its status), else, for warnings and errors, its logger, message
    template and exception type; other records always pass.
    """

    def __init__(self, interval: float = FLOOD_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.interval, self.clock = float(interval), clock
        self._lock = threading.Lock()
        self._kinds: dict[Any, list] = {}  # kind -> [start of its interval, records held back, a message]

    def filter(self, record: logging.LogRecord) -> bool:
        kind = getattr(record, "flood_key", None)
        if kind is None:
            if record.levelno < logging.WARNING:
                return True
            exc = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else None
            kind = (record.name, str(record.msg), exc)
        now = self.clock()
        with self._lock:
            seen = self._kinds.get(kind)
            if seen is not None and now - seen[0] < self.interval:
                seen[1] += 1
                return False
            message = record.getMessage()
            if seen is not None and seen[1]:
                record.msg, record.args = f"{message} [{seen[1]} more like this in the last {now - seen[0]:.0f} s " \
                                          "not logged]", None
            if seen is None and len(self._kinds) >= _MAX_KINDS:
                self._kinds.pop(next(iter(self._kinds)))
            self._kinds.pop(kind, None)
            self._kinds[kind] = [now, 0, message]
        return True

    def held_back(self) -> list[str]:
        """One line per kind with records held back and not yet said (the server says them as it stops)."""
        with self._lock:
            out = [f"{n} more like this not logged: {msg}" for _, n, msg in self._kinds.values() if n]
            for entry in self._kinds.values():
                entry[1] = 0
        return out


def install_flood_filter(names: Iterable[str], interval: float = FLOOD_INTERVAL_S) -> FloodFilter:
    """One :class:`FloodFilter` on each named logger (records logged on it; a child logger's
    own records need the child named too)."""
    flood = FloodFilter(interval)
    for name in names:
        logging.getLogger(name).addFilter(flood)
    return flood


# --------------------------------------------------------------------------- Prometheus' text format


def _labels(labels: dict[str, Any]) -> str:
    if not labels:
        return ""
    def esc(v: Any) -> str:
        return str(v).replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n")
    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in labels.items()) + "}"


class _Text:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def metric(self, name: str, kind: str, help_text: str,
               samples: Iterable[tuple[dict[str, Any], float]]) -> None:
        self.lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        self.lines += [f"{name}{_labels(labels)} {value:g}" if isinstance(value, float) else
                       f"{name}{_labels(labels)} {value}" for labels, value in samples]


def render(http: HttpMetrics, engine: Any, max_batch_size: Optional[int], model_name: str) -> str:
    """The ``/metrics`` page: Prometheus' text exposition format (version 0.0.4).

    ``engine`` is the :class:`~dipaco.serve.engine_thread.EngineThread` (its ``stats``,
    ``active``, ``waiting`` and ``alive``)."""
    s = engine.stats
    out = _Text()
    m = {"model": model_name}
    out.metric("dipaco_requests_total", "counter", "HTTP requests answered, by endpoint and status code.",
               [({"endpoint": e, "status": st}, n) for (e, st), n in sorted(http.snapshot().items())])
    out.metric("dipaco_prompt_tokens_total", "counter", "Prompt tokens of the rows submitted to the engine.",
               [(m, s.prompt_tokens)])
    out.metric("dipaco_generation_tokens_total", "counter", "Tokens generated.", [(m, s.tokens)])
    out.metric("dipaco_rows_submitted_total", "counter", "Engine rows submitted (one per choice).", [(m, s.submitted)])
    out.metric("dipaco_rows_finished_total", "counter", "Engine rows ended (done, stopped or cancelled).",
               [(m, s.finished)])
    out.metric("dipaco_requests_running", "gauge", "Engine rows open (submitted, not yet ended).", [(m, engine.active)])
    out.metric("dipaco_requests_waiting", "gauge", "Engine rows open that have no token yet (the queue).",
               [(m, engine.waiting)])
    out.metric("dipaco_engine_steps_total", "counter", "Engine steps that made tokens.", [(m, s.steps)])
    out.metric("dipaco_batch_rows_total", "counter", "Rows summed over the engine's steps (÷ steps: mean batch).",
               [(m, s.rows_total)])
    out.metric("dipaco_batch_rows", "gauge", "Rows that got a token in the last step read.", [(m, s.last_rows)])
    if max_batch_size:
        out.metric("dipaco_batch_occupancy", "gauge", "The last step's rows ÷ --max-batch-size.",
                   [(m, float(s.last_rows) / max_batch_size)])
    out.metric("dipaco_path_generation_tokens_total", "counter", "Tokens generated, by the path that made them.",
               [({**m, "path": p}, n) for p, n in sorted(s.path_tokens.items())])
    out.metric("dipaco_path_requests_total", "counter", "Engine rows, by the path of their first token.",
               [({**m, "path": p}, n) for p, n in sorted(s.path_rows.items())])
    out.metric("dipaco_engine_up", "gauge", "1 while the engine runs, 0 once it has failed or stopped.",
               [(m, int(engine.alive))])
    return "\n".join(out.lines) + "\n"
