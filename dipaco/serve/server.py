"""The HTTP server around the app: uvicorn, with dipaco-serve's stop rule and its bounds on
what a client can hold. The one module that uses uvicorn.

* **Stopping** (:func:`build_server`): SIGTERM or SIGINT stops accepting connections and
  gives open requests ``GRACE_S`` seconds to finish; those still open then get a 503
  saying the server is stopping (a stream: an error event, then ``[DONE]``) rather than a
  cut connection. A second SIGINT ends the grace at once (the same 503s), a third stops
  without answering.
* **Bounds** (:class:`BoundedH11`): at most ``max_connections`` connections are open at
  once (one more is answered 503 and closed); a connection whose request headers have not
  arrived whole ``header_timeout`` seconds after it opened (or after its last response) is
  closed; a body that has not arrived whole in ``body_timeout`` seconds gets 408 and the
  connection is closed (:class:`dipaco.serve.app.BodyLimit`).
* **Logs** (:func:`server_logging`): the server's lines on stderr, ``dipaco-serve: ...``;
  warnings and errors, its own and uvicorn's and asyncio's, once per kind per interval
  (:class:`dipaco.serve.metrics.FloodFilter`).
"""
from __future__ import annotations

import json
import logging
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

from dipaco.serve.errors import error_body
from dipaco.serve.metrics import FloodFilter, install_flood_filter

log = logging.getLogger("dipaco.serve")
GRACE_S = 5.0               # seconds a stop signal leaves open requests to finish before they are answered 503
HEADER_TIMEOUT_S = 30.0     # seconds a connection may take to send a request's headers
MAX_CONNECTIONS = 1024
# the loggers whose warnings and errors a client can cause in numbers
FLOODED = ("dipaco.serve", "dipaco.serve.access", "uvicorn.error", "asyncio")


def _refusal(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps(error_body(status, message, code=code)).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


def bounded_protocol(max_connections: int = MAX_CONNECTIONS, header_timeout: float = HEADER_TIMEOUT_S) -> type:
    """uvicorn's h11 protocol with the connection cap and the header deadline (module docstring).

    Why a protocol: a connection that never completes its headers never reaches the app,
    and uvicorn has no deadline for it (its keep-alive timer is reset by every byte), so
    a client could hold connections forever; its own ``limit_concurrency`` answers in
    plain text, where every refusal here is OpenAI's error object.
    """
    from uvicorn.protocols.http.h11_impl import H11Protocol

    busy = _refusal(503, "Service Unavailable", f"the server has {max_connections} connections open, its most "
                    "(--max-connections); try again shortly", "too_many_connections")
    late = _refusal(408, "Request Timeout", f"the request's headers did not arrive within {header_timeout:g} s",
                    "header_timeout")

    class BoundedH11(H11Protocol):
        _deadline: Any = None  # the header deadline's asyncio.TimerHandle while it runs
        _waiting_cycle: Any = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                log.warning("refused a connection: %d open (--max-connections %d)", len(self.connections) - 1,
                            max_connections, extra={"flood_key": "too_many_connections"})
                transport.write(busy)
                transport.close()
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._deadline is not None and self.cycle is not self._waiting_cycle:  # headers complete
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request's headers get the same time

        def connection_lost(self, exc: Optional[Exception]) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._waiting_cycle = self.cycle
            self._deadline = self.loop.call_later(header_timeout, self._headers_late)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _headers_late(self) -> None:
            self._deadline = None
            if not self.transport.is_closing() and self.cycle is self._waiting_cycle:
                log.warning("closed a connection whose request headers did not arrive within %g s", header_timeout,
                            extra={"flood_key": "header_timeout"})
                self.transport.write(late)
                self.transport.close()

    return BoundedH11


def build_server(service: Any, *, grace: float = GRACE_S, body_timeout: float = 30.0,
                 header_timeout: float = HEADER_TIMEOUT_S, max_connections: int = MAX_CONNECTIONS,
                 access_log: bool = True, max_batch_size: Optional[int] = None,
                 on_ready: Optional[Callable[[], None]] = None) -> Any:
    """uvicorn's server for ``service`` with dipaco-serve's stop rule and bounds (module docstring).

    ``stopped_by`` is the name of the signal that stopped it (``None`` until one came).
    Why not uvicorn's own stop rule: past its grace it cancels the requests' tasks, so a
    client got a bare ``500 Internal Server Error`` in plain text or a stream cut without
    ``[DONE]`` (and the log a traceback per request); and it re-raises the signal once
    stopped, so a clean stop by SIGTERM exited -15 and SIGINT as a Ctrl-C of training.
    """
    import uvicorn

    from dipaco.serve.app import create_app

    class Server(uvicorn.Server):
        stopped_by: Optional[str] = None

        def handle_exit(self, sig: int, frame: Any) -> None:  # uvicorn's, without re-raising the signal
            if self.should_exit:  # a second Ctrl-C ends the grace now, a third stops waiting at all
                if sig == signal.SIGINT:
                    self.force_exit = self.hurried
                    self.hurried = True
                    service.engine.refuse_open(self.reason)
                return
            self.should_exit, self.hurried = True, False
            self.stopped_by = signal.Signals(sig).name
            self.reason = f"the server is shutting down ({self.stopped_by}); send the request again once it is back"
            timer = threading.Timer(grace, service.engine.refuse_open, args=(self.reason,))
            timer.daemon = True  # the process may end first: nothing was left open
            timer.start()

    app = create_app(service, body_timeout=body_timeout, access_log=access_log, max_batch_size=max_batch_size,
                     on_ready=on_ready)
    # uvicorn's own limit comes after ours, so the 503s are written before it cancels anything
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=grace + 5,
                            http=bounded_protocol(max_connections, header_timeout))
    return Server(config)


@contextmanager
def server_logging(access_log: bool = True, stream: Any = None) -> Iterator[FloodFilter]:
    """The server's log lines on ``stream`` (stderr) while the body runs: its own at INFO (the
    access log among them, unless ``access_log`` is false), each kind of warning or error once
    per interval; what was held back is said at the end. Undone on the way out."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(logging.Formatter("dipaco-serve: %(message)s"))
    serve_log = logging.getLogger("dipaco.serve")
    access = logging.getLogger("dipaco.serve.access")
    saved = (serve_log.level, serve_log.propagate, access.disabled)
    serve_log.addHandler(handler)
    serve_log.setLevel(logging.INFO)
    serve_log.propagate = False
    access.disabled = not access_log
    flood = install_flood_filter(FLOODED)
    try:
        yield flood
    finally:
        for name in FLOODED:
            logging.getLogger(name).removeFilter(flood)
        for line in flood.held_back():
            serve_log.warning("%s", line)
        serve_log.removeHandler(handler)
        serve_log.level, serve_log.propagate, access.disabled = saved
