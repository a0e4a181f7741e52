"""Several engine processes behind the engine thread's one :class:`Engine` API, paths kept apart.

Why: the engine's step is Python driving small torch calls at a batch of at most
``--max-batch-size`` rows. On a CPU it gains little from a second intra-op thread (the
in-process engine made 2,434 tokens/s on 1 thread and 2,464 on 2, docs/serving.md), so
one engine process leaves cores idle. Several processes of one thread each use them; it
is data parallelism over requests, with the run's own routing deciding which process a
request goes to, so that each process still decodes full batches of one path.

    pool = EnginePool.start([spec] * 2, vocab_size, route=run.route)   # processes open side by side
    thread = EngineThread(pool)       # the same API: submit / cancel / step / has_work / close

Rules:

* **Path affinity.** A request is routed here, by its prompt (the router the server has
  loaded anyway; the engine routes it again itself, to the same path). While a path has
  requests open in one engine, its new requests go to that engine, to join the same
  batch. A path with none open goes to the engine with the fewest open requests (ties:
  one that holds the path loaded, then the first). With re-routing a row may move to
  another path inside its engine; affinity follows the path it was submitted for.
* **Memory.** Each engine keeps up to ``max_loaded_paths`` paths of its own: N engines
  may hold N times as many (the loaded paths ``/health`` reports are their union).
* **Ids.** The pool numbers requests; each engine's events carry the pool's ids.
* **Failure.** One engine that fails or dies fails the pool's :meth:`step` with its
  reason: the engine thread then fails every open request (503), as with one engine.
  Engines that cannot start stop the others and fail :meth:`start` with the first reason.
"""
from __future__ import annotations

import os
import threading
from multiprocessing.connection import wait as wait_for
from typing import Any, Callable, Optional, Sequence

from dipaco.serve.engine_process import EngineFailed, EngineProcess, EngineSpec

Route = Callable[[Sequence[int]], int]


class EnginePool:
    """Engines in processes of their own, each request sent to one by its path (module docstring).

    ``submit``, ``cancel`` and ``has_work`` are thread-safe; ``step`` belongs to the engine
    thread: it blocks until at least one engine has stepped, and returns the events of
    every engine that has.
    """

    def __init__(self, engines: Sequence[EngineProcess], route: Route) -> None:
        if not engines:
            raise ValueError("an engine pool needs at least one engine")
        self.engines = list(engines)
        self.vocab_size = self.engines[0].vocab_size
        self.info: dict[str, Any] = {**self.engines[0].info, "processes": len(self.engines)}
        self._route = route
        self._lock = threading.Lock()
        self._next_id = 0
        self._where: dict[int, tuple[int, int]] = {}  # request id -> (engine index, path)
        self._open_in = [0] * len(self.engines)       # open requests per engine
        self._owner: dict[int, list[int]] = {}        # path -> [its engine, its open requests], while some are
        self._closing = False

    @classmethod
    def start(cls, specs: Sequence[EngineSpec], vocab_size: int, route: Route) -> "EnginePool":
        """Spawn one engine per spec, wait until all have opened the run, and pool them."""
        spawned = [EngineProcess.spawn(spec) for spec in specs]
        ready: list[EngineProcess] = []
        try:
            for child in spawned:
                ready.append(child.ready(vocab_size))
        except BaseException:  # a failure, or a signal while waiting: none of them may outlive us
            for engine in ready:
                engine.close()
            for child in spawned[len(ready) + 1:]:  # the one that failed has killed itself
                child.kill()
            raise
        return cls(ready, route)

    # ---------------------------------------------------------------- any thread

    def submit(self, request: Any) -> int:
        """Route ``request``, choose its engine (module docstring), hand it over; its id.

        ``ValueError`` (one line) for a request the engine would refuse, as in-process.
        """
        engines = self.engines
        engines[0].check(request)  # before routing: the router wants valid ids
        path = int(self._route(list(request.prompt_ids)))
        with self._lock:
            owner = self._owner.get(path)
            if owner is None:
                i = min(range(len(engines)),
                        key=lambda k: (self._open_in[k], path not in engines[k].loaded_paths, k))
                owner = self._owner[path] = [i, 0]
            i = owner[0]
            owner[1] += 1
            rid = self._next_id
            self._next_id += 1
            self._where[rid] = (i, path)
            self._open_in[i] += 1
        try:
            engines[i].submit(request, request_id=rid)
        except BaseException:  # not handed over: it must not count as open
            with self._lock:
                self._finished(rid)
            raise
        return rid

    def cancel(self, request_id: int) -> None:
        """Free the request's row in its engine (it reports it ``cancelled``)."""
        with self._lock:
            where = self._where.get(int(request_id))
        if where is not None:
            self.engines[where[0]].cancel(int(request_id))

    def has_work(self) -> bool:
        """Requests submitted whose last event has not come back yet."""
        with self._lock:
            return bool(self._where)

    @property
    def loaded_paths(self) -> list[int]:
        """Paths some engine holds in memory."""
        return sorted({p for e in self.engines for p in e.loaded_paths})

    def open_per_engine(self) -> list[int]:
        """Open requests in each engine (tests, /health)."""
        with self._lock:
            return list(self._open_in)

    def _finished(self, request_id: int) -> None:
        where = self._where.pop(request_id, None)
        if where is None:
            return
        i, path = where
        self._open_in[i] -= 1
        self._owner[path][1] -= 1
        if not self._owner[path][1]:  # the path may go to another engine next time
            del self._owner[path]

    # ---------------------------------------------------------------- the engine thread

    def step(self) -> list[Any]:
        """The events of every engine that has stepped (blocks until one has)."""
        if self._closing:
            return []
        by_conn = {e.connection: e for e in self.engines}
        try:
            ready = wait_for(list(by_conn))
        except (OSError, ValueError):  # a pipe closed under us: only while closing
            if self._closing:
                return []
            raise
        events: list[Any] = []
        try:
            for conn in ready:
                events.extend(by_conn[conn].step())
        except BaseException:  # the engine thread fails every open request on any error of a step:
            with self._lock:   # none is open any longer (/health's per-engine counts say so)
                self._where.clear()
                self._owner.clear()
                self._open_in = [0] * len(self.engines)
            raise
        with self._lock:
            for ev in events:
                if ev.finished:
                    self._finished(ev.request_id)
        return events

    def close(self, timeout: float = 10.0) -> None:
        """Stop every engine (idempotent); a ``step`` blocked in its wait returns ``[]``."""
        self._closing = True
        for engine in self.engines:
            engine.close(timeout)


def engine_processes(requested: Optional[int], device: str, num_paths: int, cores: Optional[int] = None) -> int:
    """How many engine processes to run: ``requested`` when given; otherwise one on a GPU
    (the processes would share one device), and on a CPU one per core, of one thread each,
    but no more than the run has paths (a path's requests go to one engine at a time, so a
    further engine would have nothing to do).

    Why one per core, not one less for the HTTP loop: on 2 cores, with 32 closed-loop
    clients on mixed-domain prompts, 2 engines made 1.31x the tokens/s of 1 (medians of 3),
    3 engines about as much as 2 (within the host's noise, for 320 MiB more) and 4 less
    (docs/serving.md): an engine waits for the pipe and the loop waits for the network, so
    the cores are shared without an OpenMP team to stall.
    """
    if requested is not None:
        return int(requested)
    from dipaco.runtime.device import choose_device

    if choose_device(device).type != "cpu":
        return 1
    n = cores if cores is not None else (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                         else os.cpu_count() or 1)
    return max(1, min(int(n), int(num_paths)))
