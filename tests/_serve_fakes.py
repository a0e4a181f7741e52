"""A stand-in engine and tokenizer for the server's tests, and a real uvicorn server on a free
loopback port in a thread (tests/test_serve.py; tests/test_serve_cli.py uses the real engine).

:class:`FakeEngine` keeps :class:`dipaco.inference.engine.RoutedEngine`'s API and its
scheduling shape (requests queued per path; each step decodes one path's batch, which new
requests join) but its "model" writes a fixed script, so texts are known in advance. It
records every step's batch, so a test can see which requests shared one.
"""
from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass
from typing import Iterator, Optional

import pytest

# until the engine branch is merged its module is absent: the server's tests skip, saying why
engine_api = pytest.importorskip("dipaco.inference.engine", reason="the engine (dipaco.inference.engine) is not merged yet")
Request, TokenEvent = engine_api.Request, engine_api.TokenEvent

from dipaco.serve import CompletionService, EngineThread, ServedModel, ServeLimits

SCRIPT = "hello world. "
EOS = 0


class ByteTokenizer:
    """Token id = byte + 1; 0 is eos."""

    eos_id = EOS

    def encode(self, text: str) -> list[int]:
        return [b + 1 for b in text.encode("utf-8")]

    def decode(self, ids) -> str:
        return bytes(i - 1 for i in ids if i > 0).decode("utf-8", errors="replace")


TOKENIZER = ByteTokenizer()


def script_text(n: int, script: str = SCRIPT) -> str:
    """The text of the first ``n`` tokens the fake writes."""
    data = script.encode("utf-8")
    return bytes(data[i % len(data)] for i in range(n)).decode("utf-8", errors="replace")


@dataclass
class _Row:
    rid: int
    path: int
    request: Request
    made: int = 0
    cancelled: bool = False


class FakeEngine:
    """Queues requests per path (path = first prompt token mod ``num_paths``); each step
    serves the next path with waiting rows (paths take turns), up to ``max_batch_size`` rows.

    A prompt containing ``EOS`` ends with eos after 3 tokens; one containing ``BOOM`` makes
    the step that serves it raise (the engine fails).
    """

    def __init__(self, num_paths: int = 2, max_batch_size: int = 32, step_delay: float = 0.0,
                 script: str = SCRIPT) -> None:
        self.num_paths, self.max_batch_size, self.step_delay = num_paths, max_batch_size, step_delay
        self.script = [b + 1 for b in script.encode("utf-8")]
        self.rows: dict[int, _Row] = {}
        self.batches: list[tuple[int, list[int]]] = []  # (path, request ids) of each step
        self.cancelled: list[int] = []
        self._next = 0
        self._lock = threading.Lock()

    def submit(self, request: Request) -> int:
        if not request.prompt_ids:
            raise ValueError("the prompt is empty")
        if request.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
        if len(request.prompt_ids) > 100:
            raise ValueError("the engine refuses this prompt\nsecond line")
        with self._lock:
            rid, self._next = self._next, self._next + 1
            self.rows[rid] = _Row(rid, request.prompt_ids[0] % self.num_paths, request)
        return rid

    def cancel(self, request_id: int) -> None:
        with self._lock:
            if request_id in self.rows:
                self.rows[request_id].cancelled = True
                self.cancelled.append(request_id)

    def has_work(self) -> bool:
        with self._lock:
            return bool(self.rows)

    def close(self) -> None:
        self.closed = True

    @property
    def loaded_paths(self) -> list[int]:
        return [self.batches[-1][0]] if self.batches else []

    def step(self) -> list[TokenEvent]:
        with self._lock:
            if not self.rows:
                return []
            waiting = sorted({r.path for r in self.rows.values()})
            last = self.batches[-1][0] if self.batches else -1
            path = next((p for p in waiting if p > last), waiting[0])  # paths take turns
            batch = [r for r in self.rows.values() if r.path == path][: self.max_batch_size]
            self.batches.append((path, [r.rid for r in batch]))
            if any("BOOM" in TOKENIZER.decode(r.request.prompt_ids) for r in batch):
                raise RuntimeError("a fake kernel fault\nwith a second line")
            events = [self._advance(r) for r in batch]
        time.sleep(self.step_delay)
        return events

    def _advance(self, r: _Row) -> TokenEvent:
        if r.cancelled:
            del self.rows[r.rid]
            return TokenEvent(r.rid, None, r.path, True, "cancelled")
        eos_at = 3 if "EOS" in TOKENIZER.decode(r.request.prompt_ids) else None
        tok = EOS if r.made == eos_at else self.script[r.made % len(self.script)]
        r.made += 1
        reason = "eos" if tok == EOS else "length" if r.made >= r.request.max_new_tokens else None
        if reason:
            del self.rows[r.rid]
        return TokenEvent(r.rid, tok, r.path, reason is not None, reason)


@contextlib.contextmanager
def serving(engine: FakeEngine, limits: Optional[ServeLimits] = None, *, max_seq_len: int = 64,
            name: str = "tiny-run") -> Iterator[tuple[str, CompletionService]]:
    """A real uvicorn server over ``engine`` on a free loopback port: ``(base url, service)``."""
    import uvicorn

    from dipaco.serve.app import create_app

    model = ServedModel(name=name, tokenizer=TOKENIZER, max_seq_len=max_seq_len, num_paths=engine.num_paths,
                        vocab_size=257)
    service = CompletionService(model, EngineThread(engine), limits or ServeLimits(max_tokens_cap=48,
                                                                                  max_body_bytes=4096))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(service), log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:  # bounded start-up wait
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", service
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()
