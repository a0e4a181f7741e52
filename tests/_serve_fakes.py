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
from dataclasses import dataclass, field
from typing import Iterator, Optional

import pytest

# until the engine branch is merged its module is absent: the server's tests skip, saying why
engine_api = pytest.importorskip("dipaco.inference.engine", reason="the engine (dipaco.inference.engine) is not merged yet")
Request, TokenEvent = engine_api.Request, engine_api.TokenEvent

from dipaco.serve import CompletionService, EngineThread, ServedModel, ServeLimits

SCRIPT = "hello world. "
EOS = 0


class ByteTokenizer:
    """Token id = byte + 1; 0 is eos (``<eos>`` as text)."""

    eos_id = EOS

    def encode(self, text: str) -> list[int]:
        return [b + 1 for b in text.encode("utf-8")]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        parts, run = [], []
        for i in ids:
            if i > 0:
                run.append(i - 1)
                continue
            parts.append(bytes(run).decode("utf-8", errors="replace"))
            run = []
            if not skip_special_tokens:
                parts.append("<eos>")
        return "".join(parts) + bytes(run).decode("utf-8", errors="replace")


def fake_logprob(token: int, top: int) -> tuple:
    """The stand-in engine's log-probabilities of ``token``: -0.5 each, its top list the token first."""
    return (-0.5 - token / 1000, [(token, -0.5 - token / 1000)] + [(t, -9.0) for t in range(1, top)])


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
    times: list = field(default_factory=list)  # when each token was made (time.monotonic)


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
        self.seen: list[_Row] = []  # every row submitted, in order
        self._next = 0
        self._lock = threading.Lock()

    def submit(self, request: Request) -> int:
        if not request.prompt_ids:
            raise ValueError("the prompt is empty")
        if request.max_new_tokens < (0 if request.prompt_logprobs is not None else 1):
            raise ValueError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
        if len(request.prompt_ids) > 100:
            raise ValueError("the engine refuses this prompt\nsecond line")
        with self._lock:
            rid, self._next = self._next, self._next + 1
            self.rows[rid] = _Row(rid, request.prompt_ids[0] % self.num_paths, request)
            self.seen.append(self.rows[rid])
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
        req = r.request
        prompt_lp = None
        if r.made == 0 and req.prompt_logprobs is not None:
            prompt_lp = [None] + [fake_logprob(t, req.prompt_logprobs) for t in req.prompt_ids[1:]]
        if r.cancelled or req.max_new_tokens == 0:
            del self.rows[r.rid]
            return TokenEvent(r.rid, None, r.path, True, "cancelled" if r.cancelled else "length",
                              prompt_logprobs=prompt_lp)
        eos_at = 3 if "EOS" in TOKENIZER.decode(req.prompt_ids) and req.stop_at_eos else None
        # a row seeded apart by the server (n > 1: a mixed, 63-bit seed) starts elsewhere in the script
        start = req.seed % 7 + 1 if req.seed >= 2**32 else 0
        tok = EOS if r.made == eos_at else self.script[(r.made + start) % len(self.script)]
        r.made += 1
        r.times.append(time.monotonic())
        reason = "eos" if tok == EOS else "stop" if tok in req.stop_ids and r.made > req.min_tokens else \
            "length" if r.made >= req.max_new_tokens else None
        if reason:
            del self.rows[r.rid]
        lp = fake_logprob(tok, req.logprobs) if req.logprobs is not None else None
        return TokenEvent(r.rid, tok, r.path, reason is not None, reason, logprob=lp, prompt_logprobs=prompt_lp)


@contextlib.contextmanager
def serving(engine: FakeEngine, limits: Optional[ServeLimits] = None, *, max_seq_len: int = 64,
            name: str = "tiny-run", aliases: tuple = (), **server_args) -> Iterator[tuple[str, CompletionService]]:
    """A real uvicorn server over ``engine`` on a free loopback port: ``(base url, service)``;
    ``server_args``: :func:`dipaco.serve.server.build_server`'s bounds."""
    from dipaco.serve.server import build_server

    model = ServedModel(name=name, tokenizer=TOKENIZER, max_seq_len=max_seq_len, num_paths=engine.num_paths,
                        vocab_size=257, aliases=aliases)
    service = CompletionService(model, EngineThread(engine), limits or ServeLimits(max_tokens_cap=48,
                                                                                  max_body_bytes=4096))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = build_server(service, grace=2, **{"access_log": False, "max_batch_size": engine.max_batch_size, **server_args})
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
