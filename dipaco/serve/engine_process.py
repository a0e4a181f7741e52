"""The engine in a process of its own, behind the engine thread's :class:`Engine` API.

Why a process: the engine's step is Python driving small torch calls, and in the server's
process it shares one GIL with the event loop (HTTP parsing, JSON, the SSE writes). Each
request the loop handles makes the engine thread wait for the GIL between its torch
calls; on the README's default run with 32 closed-loop clients that cost the server a
quarter to a third of the in-process engine's tokens/s on 2 cores (docs/serving.md).
In its own process the engine steps without waiting for the loop, and the loop answers
without waiting for the engine; what crosses the pipe per step is one small message (a
tuple per row).

    engine = EngineProcess.start(EngineSpec(run_dir, max_batch_size=32))   # waits for "ready"
    thread = EngineThread(engine)        # the same API: submit / cancel / step / has_work / close

Rules:

* **Checks stay synchronous.** :meth:`EngineProcess.submit` runs the engine's own request
  check (:func:`dipaco.inference.engine.check_request`) in this process, so a bad
  request is a ``ValueError`` at once, as in-process; the child never refuses one.
* **The child opens the run** (and verifies the checkpoint: the process that reads the
  weights is the one that checks them); the server's process opens only the tokenizer,
  router and config (``need_weights=False``). A run the child cannot open fails
  :meth:`EngineProcess.start` with the child's one-line reason.
* **Failure.** A step that raises in the child ends the child with its reason; a child
  that dies (killed, out of memory) is seen as the pipe's end. Either way :meth:`step`
  raises, and the engine thread fails every open request (503).
* **Signals.** The child ignores SIGINT and SIGTERM: a terminal's Ctrl-C reaches the whole
  process group, and so does a service manager's stop (systemd signals every process of
  the unit, ``timeout`` and ``kill -- -PGID`` the group); the server gives its open
  requests their grace and then shuts the child down itself (:meth:`close`). It is born
  ignoring them (:func:`_stop_signals_ignored`): an ignored signal stays ignored across
  ``exec``, and Python then installs no ``KeyboardInterrupt`` handler, so a signal while
  the child still imports prints no traceback and ends nothing.
* **No orphans.** Since the child ignores those signals, the parent ends it on every way
  out: :meth:`close` (asked to stop, killed if it has not within its timeout), a start
  that fails or is interrupted (killed), an interpreter exit with a child still alive
  (killed, before ``multiprocessing``'s own exit handler, which would send the ignored
  SIGTERM and wait for ever); a parent killed outright closes the pipe, and the child
  exits at its end.
"""
from __future__ import annotations

import atexit
import multiprocessing as mp
import multiprocessing.util  # noqa: F401 - its exit handler is registered first, so ours runs before it
import signal
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Iterator, Optional

from dipaco.serve.errors import one_line

# seconds to wait for the child to open the run and say it is ready
_START_TIMEOUT_S = 600.0
# every child spawned here and not yet reaped: killed at exit if still alive (module docstring)
_LIVE: "weakref.WeakSet[Any]" = weakref.WeakSet()


@atexit.register
def _kill_live() -> None:
    for proc in list(_LIVE):
        if proc.is_alive():
            proc.kill()
            proc.join(5)

# steps the child may make that this process has not read yet. Unbounded, a child whose
# parent was slow to read (its process starved of CPU, its GIL held by the event loop) ran
# ahead by as many steps as the pipe held, making tokens for streams that may have gone
# meanwhile (a vanished client's row made them all); bounded, at most AHEAD. Measured under
# 32 clients on 2 loaded cores, the children waited for the parent 10-18% of their time at
# 2, about 3% at 8, 2% at 16: 8 bounds the waste with little waiting
AHEAD = 8
ACK_EVERY = AHEAD // 2  # steps the parent acknowledges in one message (a message per step cost ~1%)


@dataclass(frozen=True)
class EngineSpec:
    """What the child needs to build the engine (picklable: it crosses to a spawned process).

    Attributes:
        run_dir: the finished run.
        checkpoint: as :meth:`InferenceRun.open`'s (``None``: newest).
        verify: ``"all"`` or ``"read"``.
        device: ``auto`` | ``cuda`` | ``cpu`` | ``None`` (the run's).
        engine: keyword arguments of :class:`~dipaco.inference.engine.RoutedEngine`.
        threads: torch's intra-op threads in the child (``None``: torch's default).
    """

    run_dir: str
    checkpoint: Optional[str] = None
    verify: str = "all"
    device: Optional[str] = None
    engine: dict[str, Any] = field(default_factory=dict)
    threads: Optional[int] = None


class EngineFailed(RuntimeError):
    """The child could not start, or stopped while requests were open."""


class EngineProcess:
    """A :class:`~dipaco.inference.engine.RoutedEngine` run by a spawned child process.

    Use :meth:`start`. ``submit``, ``cancel`` and ``has_work`` are thread-safe; ``step``
    belongs to one thread (the engine thread): it blocks until the child's next step.
    """

    def __init__(self, proc: Any, conn: Connection, vocab_size: int, info: dict[str, Any]) -> None:
        self._proc = proc
        self._conn = conn
        self.vocab_size = int(vocab_size)
        self.info = info  # what the child reported when ready (checkpoint name, ...)
        self.loaded_paths: list[int] = []
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._open: set[int] = set()
        self._next_id = 0
        self._closing = False
        self._unacked = 0  # steps read and not yet acknowledged to the child (acknowledged ACK_EVERY at a time)
        # the engine's own check and event type (imported here: the engine module is heavy,
        # and dipaco.serve stays light to import)
        from dipaco.inference.engine import TokenEvent, check_request

        self._check, self._event = check_request, TokenEvent

    @classmethod
    def start(cls, spec: EngineSpec, vocab_size: int, *, timeout: float = _START_TIMEOUT_S) -> "EngineProcess":
        """Spawn the child and wait until it has opened the run (``EngineFailed`` if it cannot)."""
        return cls.spawn(spec).ready(vocab_size, timeout=timeout)

    @classmethod
    def spawn(cls, spec: EngineSpec) -> "Spawned":
        """Spawn the child and return at once; :meth:`Spawned.ready` waits for it. Several
        engines open their runs side by side this way (:mod:`dipaco.serve.engine_pool`)."""
        ctx = mp.get_context("spawn")  # never fork a process holding torch's threads
        parent, child = ctx.Pipe(duplex=True)
        proc = ctx.Process(target=_child_main, args=(child, spec), name="dipaco-engine", daemon=True)
        with _stop_signals_ignored():
            proc.start()
        _LIVE.add(proc)
        child.close()
        return Spawned(proc, parent)

    # ---------------------------------------------------------------- any thread

    def submit(self, request: Any, request_id: Optional[int] = None) -> int:
        """Check ``request`` here (``ValueError``, one line), then hand it to the child.

        ``request_id``: the id its events will carry (an :class:`EnginePool` numbers the
        requests of all its engines); by default this engine's next one. An id still open
        is a ``ValueError``.
        """
        self.check(request)
        with self._lock:
            if request_id is None:
                rid = self._next_id
                self._next_id += 1
            else:
                rid = int(request_id)
                if rid in self._open:
                    raise ValueError(f"request id {rid} is already open in this engine")
            self._open.add(rid)
        self._send(("submit", rid, request))
        return rid

    def check(self, request: Any) -> None:
        """The engine's own request check, here: ``ValueError`` (one line) for a request the
        child would refuse."""
        self._check(request, self.vocab_size)

    def cancel(self, request_id: int) -> None:
        """Free the request's row at the child's next step (it reports it ``cancelled``)."""
        with self._lock:
            known = int(request_id) in self._open
        if known:
            self._send(("cancel", int(request_id)))

    def has_work(self) -> bool:
        """Requests submitted whose last event has not come back yet."""
        with self._lock:
            return bool(self._open)

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            try:
                self._conn.send(message)
            except (OSError, ValueError):  # the child is gone: step() says why
                pass

    # ---------------------------------------------------------------- the engine thread

    def step(self) -> list[Any]:
        """The :class:`~dipaco.inference.engine.TokenEvent` objects of the child's next step
        (without ``generation``; blocks until they come)."""
        try:
            kind, payload = self._conn.recv()
        except (EOFError, OSError):
            if self._closing:
                return []
            self._proc.join(5)
            raise EngineFailed(f"the engine process exited (exit code {self._proc.exitcode})") from None
        if kind == "failed":
            raise EngineFailed(f"the engine failed in its process: {payload}")
        self._unacked += 1
        if self._unacked >= ACK_EVERY:  # the child may step on (it stays at most AHEAD steps ahead of us)
            self._send(("read", self._unacked))
            self._unacked = 0
        rows, loaded = payload
        if loaded is not None:
            self.loaded_paths = loaded
        events = [self._event(*row[:5], logprob=row[5], prompt_logprobs=row[6]) if len(row) > 5
                  else self._event(*row) for row in rows]
        with self._lock:
            for ev in events:
                if ev.finished:
                    self._open.discard(ev.request_id)
        return events

    @property
    def connection(self) -> Connection:
        """The pipe :meth:`step` reads (an :class:`EnginePool` waits on all of its engines' at once)."""
        return self._conn

    def close(self, timeout: float = 10.0) -> None:
        """Stop the child (idempotent); a ``step`` blocked in its read returns ``[]``."""
        self._closing = True
        self._send(("stop",))
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._conn.close()


class Spawned:
    """A child spawned by :meth:`EngineProcess.spawn` that has not said it is ready yet."""

    def __init__(self, proc: Any, conn: Connection) -> None:
        self._proc, self._conn = proc, conn

    def ready(self, vocab_size: int, *, timeout: float = _START_TIMEOUT_S) -> EngineProcess:
        """Wait until the child has opened the run; ``EngineFailed`` (the child's one-line
        reason) if it cannot, or says nothing within ``timeout`` seconds."""
        proc, parent = self._proc, self._conn
        try:
            if not parent.poll(timeout):
                raise EngineFailed(f"the engine process did not open the run within {timeout:.0f} s")
            try:
                kind, payload = parent.recv()
            except EOFError:
                proc.join(5)
                raise EngineFailed(f"the engine process exited while opening the run (exit code "
                                   f"{proc.exitcode})") from None
            if kind != "ready":
                raise EngineFailed(str(payload))
        except BaseException:  # a failure, or a signal while waiting: it ignores signals, so it is killed
            self.kill()  # its pipe closed too: a server that retries does not collect them
            raise
        return EngineProcess(proc, parent, vocab_size, payload)

    def kill(self) -> None:
        """Stop a child that failed to start, or is no longer wanted (another engine of its pool failed)."""
        self._proc.kill()
        self._proc.join(5)
        self._conn.close()


def engine_threads(requested: Optional[int], device: str) -> int:
    """Set and return torch's intra-op threads for the engine process.

    ``requested`` when given. Otherwise, on a CPU, torch's default (the cores) less one:
    the server's own process (HTTP, JSON) and, on a test host, its clients run beside the
    engine, and an OpenMP team that spans every core stalls at each barrier whenever one
    of its threads is descheduled for them. Measured on 2 cores with 32 clients
    (docs/serving.md): 1,381 tokens/s with the engine on 1 thread, 1,277 on 2. On a GPU
    torch's default stays.
    """
    import torch

    from dipaco.runtime.device import choose_device

    if requested is None:
        if choose_device(device).type != "cpu":
            return torch.get_num_threads()
        requested = max(1, torch.get_num_threads() - 1)
    torch.set_num_threads(int(requested))
    return int(requested)


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def _stop_signals_ignored() -> Iterator[None]:
    """SIGINT and SIGTERM ignored in this process while the body spawns a child, which
    inherits that (main thread only: elsewhere Python cannot set handlers, and the child's
    own ``signal.signal`` calls in :func:`_child_main` cover it from then on). The window is
    the spawn's fork and exec, milliseconds; the child's own, until it can set them itself,
    would be its imports, seconds."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in _STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _child_main(conn: Connection, spec: EngineSpec) -> None:
    """The child: open the run, then step while there is work, reading commands between steps."""
    for sig in _STOP_SIGNALS:  # the parent stops us (see the module docstring)
        signal.signal(sig, signal.SIG_IGN)
    try:
        from dipaco.inference import InferenceRun
        from dipaco.inference.engine import RoutedEngine

        run = InferenceRun.open(spec.run_dir, checkpoint=spec.checkpoint, verify=spec.verify, device=spec.device)
        threads = engine_threads(spec.threads, str(run.cfg.trainer.device))
        engine = RoutedEngine(run, **spec.engine)
    except Exception as e:  # the parent says it in one line
        conn.send(("failed", _reason(e)))
        return
    try:
        conn.send(("ready", {"checkpoint": str(run.checkpoint), "threads": threads}))
    except OSError:  # the parent is gone (it stopped while we opened the run)
        return
    ours: dict[int, int] = {}    # the engine's request id -> the parent's
    theirs: dict[int, int] = {}  # the parent's -> the engine's
    loaded: list[int] = []
    unread = 0  # steps sent that the parent has not acknowledged yet (it does, ACK_EVERY at a time)
    try:
        while True:
            while unread >= AHEAD or not engine.has_work() or conn.poll():
                message = conn.recv()
                if message[0] == "read":
                    unread -= message[1]
                elif message[0] == "submit":
                    rid = engine.submit(message[2])
                    ours[rid], theirs[message[1]] = message[1], rid
                elif message[0] == "cancel":
                    if message[1] in theirs:
                        engine.cancel(theirs[message[1]])
                else:  # "stop"
                    return
            events = engine.step()
            now = engine.loader.loaded_paths
            rows = []
            for ev in events:
                parent_id = ours[ev.request_id]
                if ev.finished:
                    del ours[ev.request_id], theirs[parent_id]
                row = (parent_id, ev.token, ev.path, ev.finished, ev.finish_reason)
                if ev.logprob is not None or ev.prompt_logprobs is not None:  # only when asked: most rows are 5 fields
                    row += (ev.logprob, ev.prompt_logprobs)
                rows.append(row)
            if rows or now != loaded:
                conn.send(("events", (rows, now if now != loaded else None)))
                unread += 1
                loaded = now
    except (EOFError, BrokenPipeError):  # the parent is gone
        return
    except Exception as e:
        try:
            conn.send(("failed", f"{type(e).__name__}: {one_line(str(e))}"))
        except OSError:
            pass


def _reason(e: BaseException) -> str:
    """One line for why the run could not be opened: a bad run directory, checkpoint or
    setting as its own message (as the CLI says it), anything else with its type."""
    from dipaco.config import ConfigError
    from dipaco.run.checkpoint import CheckpointError
    from dipaco.run.run_dir import RunDirError

    if isinstance(e, (ConfigError, CheckpointError, RunDirError, FileNotFoundError)):
        return one_line(str(e))
    return f"{type(e).__name__}: {one_line(str(e))}"
