"""The engine in a process of its own (dipaco/serve/engine_process.py) over the session's
tiny trained run: the same tokens as the engine in this process, checks that stay
synchronous, and every way the child can end (a kill, close, the parent gone) ends in one
line or a clean stop, in bounded time. A child that cannot open the run fails the start in
one line: tests/test_serve_cli.py (the CLI's refusal, both engine placements)."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from dipaco.serve.engine_process import EngineProcess, EngineSpec, engine_threads
from dipaco.serve.engine_thread import ENGINE_FAILED, EngineDown, EngineThread

pytestmark = pytest.mark.multiprocess

TEXTS = ["def parse_args(argv):\n    parser = argparse.ArgumentParser()\n", "class Cache:\n    def __init__(self):",
         "import os\nimport sys\n\n\ndef main():\n", "The river rose after three days of rain"]


@pytest.fixture(scope="module")
def run(finished):
    from dipaco.inference import InferenceRun

    return InferenceRun.open(finished[0])


@pytest.fixture(scope="module")
def child(finished, run):
    engine = EngineProcess.start(EngineSpec(str(finished[0]), verify="read", engine={"max_batch_size": 4}),
                                 int(run.cfg.model.vocab_size), timeout=180)
    yield engine
    engine.close()


def _requests(run, n: int) -> list:
    from dipaco.inference.engine import Request

    out = []
    for i in range(n):
        sampled = i % 2 == 1  # every other one sampled, seeded: batching must not change it
        out.append(Request(prompt_ids=run.encode(TEXTS[i % len(TEXTS)]), max_new_tokens=6 + i % 5,
                           temperature=0.9 if sampled else 0.0, top_k=20 if sampled else None, seed=100 + i,
                           reroute_every=4 if i % 3 == 0 else None))
    return out


def _drain(engine, deadline_s: float = 120) -> dict[int, list]:
    events: dict[int, list] = {}
    deadline = time.monotonic() + deadline_s
    while engine.has_work():
        assert time.monotonic() < deadline, "the engine process did not finish its requests"
        for ev in engine.step():
            events.setdefault(ev.request_id, []).append(ev)
    return events


def _switches(events: list) -> list[int]:
    """The paths a row's tokens came from, each run of one path once."""
    paths = [e.path for e in events if e.token is not None]
    return [p for i, p in enumerate(paths) if i == 0 or p != paths[i - 1]]


def test_the_child_gives_the_tokens_and_paths_of_the_engine_in_this_process(child, run) -> None:
    from dipaco.inference.engine import RoutedEngine

    requests = _requests(run, 10)
    want = RoutedEngine(run, max_batch_size=4).generate(requests)
    ids = [child.submit(r) for r in requests]
    events = _drain(child)
    for rid, gen in zip(ids, want):
        evs = events[rid]
        assert [e.token for e in evs if e.token is not None] == gen.tokens
        assert evs[-1].finished and evs[-1].finish_reason == gen.finish_reason
        assert not any(e.finished for e in evs[:-1])
        assert _switches(evs) == [p for _, p in gen.switches]
    assert child.loaded_paths and not child.has_work()


def test_a_bad_request_is_refused_here_and_a_cancel_ends_its_row(child, run) -> None:
    from dipaco.inference.engine import Request

    with pytest.raises(ValueError, match="outside the vocabulary"):
        child.submit(Request(prompt_ids=[10**9], max_new_tokens=4))
    with pytest.raises(ValueError, match="empty"):
        child.submit(Request(prompt_ids=[], max_new_tokens=4))
    rid = child.submit(Request(prompt_ids=run.encode(TEXTS[0]), max_new_tokens=60, temperature=0.0))
    first = child.step()
    child.cancel(rid)
    rest = _drain(child).get(rid, [])
    last = (first + rest)[-1]
    assert last.request_id == rid and last.finished and last.finish_reason in ("cancelled", "length", "eos")
    assert len([e for e in first + rest if e.token is not None]) < 60


def test_the_child_stays_at_most_ahead_steps_past_what_it_was_read(child, run) -> None:
    """A parent too busy to read (its event loop serving many streams) holds the child back:
    a row cancelled meanwhile has made at most AHEAD + 1 more tokens, not as many as the pipe
    holds (before: all 60 here, so a vanished client's row ran on under load)."""
    from dipaco.inference.engine import Request
    from dipaco.serve.engine_process import AHEAD

    rid = child.submit(Request(prompt_ids=run.encode(TEXTS[3]), max_new_tokens=60, temperature=0.0))
    first = child.step()
    time.sleep(3)  # the parent reads nothing: the child may make AHEAD steps, no more
    child.cancel(rid)
    rest = _drain(child).get(rid, [])
    made = [e for e in first + rest if e.request_id == rid and e.token is not None]
    assert rest[-1].finish_reason == "cancelled" and len(made) <= 1 + AHEAD + 1, len(made)


def test_a_killed_child_fails_every_open_request_and_later_submits(finished, run) -> None:
    from dipaco.inference.engine import Request

    engine = EngineProcess.start(EngineSpec(str(finished[0]), verify="read"), int(run.cfg.model.vocab_size),
                                 timeout=180)
    thread = EngineThread(engine).start()
    got: list = []
    failed = threading.Event()

    def sink(ev) -> None:
        got.append(ev)
        if ev is ENGINE_FAILED:
            failed.set()

    try:
        os.kill(engine._proc.pid, signal.SIGKILL)
        thread.submit(Request(prompt_ids=run.encode(TEXTS[1]), max_new_tokens=50), sink)
        assert failed.wait(30), got
        assert not thread.alive and "engine process exited" in (thread.error or ""), thread.error
        with pytest.raises(EngineDown):
            thread.submit(Request(prompt_ids=run.encode(TEXTS[1]), max_new_tokens=5), sink)
    finally:
        thread.stop()


def test_stopping_the_thread_ends_the_child_even_mid_request(finished, run) -> None:
    from dipaco.inference.engine import Request

    engine = EngineProcess.start(EngineSpec(str(finished[0]), verify="read"), int(run.cfg.model.vocab_size),
                                 timeout=180)
    thread = EngineThread(engine).start()
    thread.submit(Request(prompt_ids=run.encode(TEXTS[2]), max_new_tokens=5000), lambda ev: None)
    time.sleep(0.5)
    t0 = time.monotonic()
    thread.stop()
    assert time.monotonic() - t0 < 15
    assert not thread._thread.is_alive() and thread.error is None
    assert engine._proc.exitcode == 0


def test_a_child_whose_parent_is_gone_exits(finished, run) -> None:
    engine = EngineProcess.start(EngineSpec(str(finished[0]), verify="read"), int(run.cfg.model.vocab_size),
                                 timeout=180)
    engine._conn.close()  # what the parent's death does to the child's pipe
    engine._proc.join(20)
    assert engine._proc.exitcode == 0


def test_the_default_threads_leave_one_core_to_the_server_on_a_cpu() -> None:
    import torch

    before = torch.get_num_threads()
    try:
        assert engine_threads(None, "cpu") == max(1, before - 1) == torch.get_num_threads()
        torch.set_num_threads(before)
        assert engine_threads(3, "cpu") == 3 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def test_the_child_is_born_ignoring_sigint_and_sigterm(finished) -> None:
    """A terminal's Ctrl-C and a service manager's stop reach the whole process group: a child
    still importing (long before its own ``signal.signal`` calls) must ignore them already,
    or it prints a KeyboardInterrupt traceback over the server's one line, or dies at once
    and the server's open requests lose their grace."""
    if not os.path.exists("/proc/self/status"):
        pytest.skip("reads the child's signal mask from /proc")
    before = signal.getsignal(signal.SIGINT)
    spawned = EngineProcess.spawn(EngineSpec(str(finished[0]), verify="read"))
    try:
        with open(f"/proc/{spawned._proc.pid}/status", encoding="ascii") as f:
            ignored = int(next(line for line in f if line.startswith("SigIgn:")).split()[1], 16)
    finally:
        spawned.kill()
    for sig in (signal.SIGINT, signal.SIGTERM):
        assert ignored & (1 << (sig - 1)), f"{sig.name}: SigIgn {ignored:#x}"
    assert signal.getsignal(signal.SIGINT) is before  # this process's own handler is back
