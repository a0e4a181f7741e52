"""Engine processes pooled behind one engine API (dipaco/serve/engine_pool.py).

The affinity rule in one process, with stand-in engines; then the real pool over the
session's tiny trained run (one pool for the first three, to keep the suite's time): the
same tokens and finishes as the engine in this process, a path's open requests in one
engine, a dead engine failing every open request in one line, and an engine that cannot
start taking its siblings down with it, in bounded time.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field

import pytest

from dipaco.serve.engine_pool import EnginePool, engine_processes
from dipaco.serve.engine_process import EngineFailed, EngineSpec
from dipaco.serve.engine_thread import ENGINE_FAILED, EngineThread

TEXTS = ["def parse_args(argv):\n    parser = argparse.ArgumentParser()\n", "class Cache:\n    def __init__(self):",
         "import os\nimport sys\n\n\ndef main():\n", "The river rose after three days of rain"]


# --------------------------------------------------------------------------- the rule, in one process


@dataclass
class _Req:
    prompt_ids: list


@dataclass
class _StandIn:
    """What the pool asks of an engine process before stepping it."""

    vocab_size: int = 100
    info: dict = field(default_factory=lambda: {"threads": 1})
    loaded_paths: list = field(default_factory=list)
    got: list = field(default_factory=list)
    cancelled: list = field(default_factory=list)

    def check(self, request) -> None:
        if not request.prompt_ids:
            raise ValueError("the prompt is empty")

    def submit(self, request, request_id=None) -> int:
        self.got.append(request_id)
        return request_id

    def cancel(self, request_id) -> None:
        self.cancelled.append(request_id)


def _pool(n: int = 2, loaded=None) -> tuple[EnginePool, list[_StandIn]]:
    engines = [_StandIn(loaded_paths=list((loaded or {}).get(i, []))) for i in range(n)]
    return EnginePool(engines, route=lambda ids: ids[0]), engines  # the "path" is the first token


def test_a_path_stays_with_its_engine_while_it_has_requests_open() -> None:
    pool, engines = _pool()
    a = [pool.submit(_Req([0, 5])) for _ in range(3)]   # path 0 -> engine 0 (both empty: the first)
    b = pool.submit(_Req([1]))                           # path 1 -> engine 1 (fewer open)
    c = pool.submit(_Req([0, 9]))                        # path 0 again: its engine, though busier
    assert engines[0].got == a + [c] and engines[1].got == [b]
    assert pool.open_per_engine() == [4, 1] and pool.has_work()
    for rid in a + [c]:                                  # path 0's requests all finish
        pool._finished(rid)
    d = pool.submit(_Req([0]))                           # path 0 is free to go: the least busy engine
    assert engines[0].got[-1] == d and pool.open_per_engine() == [1, 1]
    pool.cancel(b)
    assert engines[1].cancelled == [b]


def test_a_free_path_prefers_the_least_busy_engine_then_one_that_holds_it() -> None:
    pool, engines = _pool(3, loaded={2: [7]})
    first = pool.submit(_Req([7]))     # all idle: the one that holds path 7
    assert engines[2].got == [first]
    pool.submit(_Req([8]))             # engines 0 and 1 idle: the first
    pool.submit(_Req([9]))
    assert [len(e.got) for e in engines] == [1, 1, 1]


def test_ids_are_the_pools_and_a_refused_request_takes_none() -> None:
    pool, engines = _pool()
    with pytest.raises(ValueError, match="empty"):
        pool.submit(_Req([]))
    ids = [pool.submit(_Req([p])) for p in (3, 4, 3)]
    assert ids == [0, 1, 2] and sorted(engines[0].got + engines[1].got) == ids
    with pytest.raises(ValueError, match="at least one engine"):
        EnginePool([], route=lambda ids: 0)


def test_a_request_its_engine_refuses_is_not_left_open() -> None:
    pool, engines = _pool()

    def refuse(request, request_id=None):
        raise ValueError("request id 0 is already open in this engine")

    engines[0].submit = refuse
    with pytest.raises(ValueError, match="already open"):
        pool.submit(_Req([5]))
    assert not pool.has_work() and pool.open_per_engine() == [0, 0] and not pool._owner


def test_the_default_count_is_one_per_core_and_path_and_one_on_a_gpu(monkeypatch) -> None:
    import dipaco.runtime.device as device

    assert engine_processes(3, "cpu", num_paths=1) == 3  # asked for: as asked
    assert [engine_processes(None, "cpu", num_paths=4, cores=c) for c in (1, 2, 3, 16)] == [1, 2, 3, 4]
    assert engine_processes(None, "cpu", num_paths=256, cores=16) == 16

    class _Cuda:
        type = "cuda"

    monkeypatch.setattr(device, "choose_device", lambda d: _Cuda())
    assert engine_processes(None, "cuda", num_paths=4, cores=16) == 1


# --------------------------------------------------------------------------- the real pool


@pytest.fixture(scope="module")
def run(finished):
    from dipaco.inference import InferenceRun

    return InferenceRun.open(finished[0])


def _spec(finished, **kw) -> EngineSpec:
    return EngineSpec(str(finished[0]), verify="read", engine={"max_batch_size": 4}, threads=1, **kw)


def _requests(run, n: int) -> list:
    from dipaco.inference.engine import Request

    return [Request(prompt_ids=run.encode(TEXTS[i % len(TEXTS)]), max_new_tokens=5 + i % 4,
                    temperature=0.9 if i % 2 else 0.0, seed=40 + i, reroute_every=3 if i % 3 == 0 else None)
            for i in range(n)]


@pytest.mark.multiprocess
def test_two_engines_answer_as_one_keep_a_path_together_and_fail_together(finished, run) -> None:
    from dipaco.inference.engine import Request, RoutedEngine

    requests = _requests(run, 12)
    want = RoutedEngine(run, max_batch_size=4).generate(requests)
    pool = EnginePool.start([_spec(finished)] * 2, int(run.cfg.model.vocab_size), route=run.route)
    thread = None
    try:
        # the same tokens and finishes as the engine in this process; a path in one engine
        ids = [pool.submit(r) for r in requests]
        where = dict(pool._where)
        events: dict[int, list] = {}
        deadline = time.monotonic() + 120
        while pool.has_work():
            assert time.monotonic() < deadline, "the pool did not finish its requests"
            for ev in pool.step():
                events.setdefault(ev.request_id, []).append(ev)
        for rid, gen in zip(ids, want):
            assert [e.token for e in events[rid] if e.token is not None] == gen.tokens
            assert events[rid][-1].finished and events[rid][-1].finish_reason == gen.finish_reason
        engine_of_path: dict[int, set] = {}
        for i, path in where.values():
            engine_of_path.setdefault(path, set()).add(i)
        assert all(len(s) == 1 for s in engine_of_path.values()), engine_of_path
        if len(engine_of_path) > 1:  # two paths or more: both engines had work
            assert {i for i, _ in where.values()} == {0, 1}
        assert pool.open_per_engine() == [0, 0] and pool.loaded_paths and pool.info["processes"] == 2

        # one engine killed: the engine thread fails every open request, in one line
        thread = EngineThread(pool).start()
        failed = threading.Event()
        os.kill(pool.engines[1]._proc.pid, signal.SIGKILL)
        for text in TEXTS:  # some land in the dead engine, some in the live one
            thread.submit(Request(prompt_ids=run.encode(text), max_new_tokens=400),
                          lambda ev: failed.set() if ev is ENGINE_FAILED else None)
        assert failed.wait(30)
        assert not thread.alive and "engine process exited" in (thread.error or ""), thread.error
        assert pool.open_per_engine() == [0, 0] and not pool.has_work()  # /health shows none left open
    finally:
        t0 = time.monotonic()
        if thread is not None:
            thread.stop()
        else:
            pool.close()
        assert time.monotonic() - t0 < 30
    assert not any(e._proc.is_alive() for e in pool.engines)
    assert pool.engines[0]._proc.exitcode == 0


@pytest.mark.multiprocess
def test_an_engine_that_cannot_start_stops_its_siblings(finished, run, tmp_path) -> None:
    import multiprocessing as mp

    before = set(mp.active_children())
    with pytest.raises(EngineFailed, match="round_999999"):
        EnginePool.start([_spec(finished), _spec(finished, checkpoint="round_999999")],
                         int(run.cfg.model.vocab_size), route=run.route)
    assert not [p for p in mp.active_children() if p not in before and p.is_alive()]
