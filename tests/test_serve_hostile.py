"""dipaco-serve against hostile input and operations, over the stand-in engine
(tests/_serve_fakes.py): bodies the parser must refuse in one line, an unexpected exception
that must not cost the client its connection, a shutdown with requests still open.

The real engine's operations (signals, a killed engine process) are in tests/test_serve_cli.py.
"""
from __future__ import annotations

import httpx
import pytest

from _serve_fakes import FakeEngine, serving
from test_serve import OK, check_error, complete


class TypeErrorEngine(FakeEngine):
    """An engine whose submit raises what no handler expects, for a prompt holding ``TYPE``."""

    def submit(self, request):
        if b"TYPE" in bytes(t - 1 for t in request.prompt_ids):
            raise TypeError("an unexpected bug\nwith a second line")
        return super().submit(request)


@pytest.fixture(scope="module")
def client():
    with serving(TypeErrorEngine(step_delay=0.002)) as (url, _), httpx.Client(base_url=url, timeout=30) as c:
        yield c


RAW = [  # (body, Content-Type, status, words): each is refused by the one parser, in one line
    (b'{"model": "tiny-run", "prompt": "\\ud800 a"}', "application/json", 400, "not valid JSON"),
    (b'{"model": "tiny-run", "prompt": ["a", "\\udfff"]}', "application/json", 400, "not valid JSON"),
    (b'{"model": "tiny-run", "prompt": "\xff\xfe a"}', "application/json", 400, "not valid JSON"),
    (b'{"model": "tiny-run", "prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}", "application/json", 400,
     "not valid JSON"),
    (b'{"model": "tiny-run", "prompt": "a", "\\ud800": 1}', "application/json", 400, "not valid JSON"),
    (b"   ", "application/json", 400, "body is empty"),
    (b'{"model": "tiny-run", "prompt": "ab"}', "text/plain", 415, "Content-Type: application/json"),
    (b'{"model": "tiny-run", "prompt": "ab"}', "application/x-www-form-urlencoded", 415, "curl"),
]


@pytest.mark.parametrize("raw,ctype,status,words", RAW, ids=[f"{i}" for i in range(len(RAW))])
def test_a_body_the_parser_refuses_is_one_line_and_the_connection_stays(client, raw, ctype, status, words) -> None:
    check_error(client.post("/v1/completions", content=raw, headers={"content-type": ctype}), status, None, words)
    assert complete(client, prompt="ab", max_tokens=2)["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("ctype", [None, "application/json; charset=utf-8", "application/vnd.api+json"])
def test_json_bodies_are_read_whatever_their_json_content_type(client, ctype) -> None:
    import json

    headers = {} if ctype is None else {"content-type": ctype}
    body = b"\xef\xbb\xbf" + json.dumps({**OK, "max_tokens": 2}).encode()  # a byte order mark too
    r = client.post("/v1/completions", content=body, headers=headers)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


def test_an_unexpected_exception_is_a_500_object_and_the_connection_survives(client) -> None:
    # before: Starlette re-raised after the 500 and uvicorn dropped the connection, so the
    # same client's next request on it failed with "connection reset". One raw connection
    # here (httpx would quietly open another).
    import http.client
    import json

    url = httpx.URL(str(client.base_url))
    conn = http.client.HTTPConnection(url.host, url.port, timeout=30)
    try:
        for prompt, status in [("TYPE", 500), ("ab", 200), ("TYPE", 500), ("ab", 200)]:
            conn.request("POST", "/v1/completions", json.dumps({**OK, "prompt": prompt, "max_tokens": 2}),
                         {"content-type": "application/json"})
            sock = conn.sock
            r = conn.getresponse()
            body = json.loads(r.read())
            assert r.status == status and conn.sock is sock, (r.status, body)  # the same connection
            if status == 500:
                assert body["error"]["message"] == ("internal error: TypeError: an unexpected bug with a "
                                                    "second line"), body
    finally:
        conn.close()


# --------------------------------------------------------------------------- stopping


@pytest.mark.parametrize("signals,grace", [(["SIGTERM"], 0.3), (["SIGINT", "SIGINT"], 60.0)])
def test_a_stop_signal_answers_requests_still_open_after_the_grace_503_and_ends(signals, grace) -> None:
    """Before: past uvicorn's grace its tasks were cancelled (a plain-text 500, a stream cut
    without [DONE], a traceback per request in the log), as they were at once on a second
    Ctrl-C, which now ends the grace (60 s here) with the same answers."""
    import signal
    import socket
    import threading
    import time

    from _serve_fakes import TOKENIZER
    from dipaco.serve.server import build_server
    from dipaco.serve import CompletionService, EngineThread, ServedModel, ServeLimits

    engine = FakeEngine(step_delay=0.05)  # 48 tokens: 2.4 s, well past the grace
    model = ServedModel(name="tiny-run", tokenizer=TOKENIZER, max_seq_len=64, num_paths=2, vocab_size=257)
    service = CompletionService(model, EngineThread(engine), ServeLimits(max_tokens_cap=48))
    server = build_server(service, grace=grace)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.02)
    got: dict = {}

    def whole() -> None:
        with httpx.Client(base_url=url, timeout=30) as c:
            got["whole"] = c.post("/v1/completions", json={**OK, "max_tokens": 48})

    with httpx.Client(base_url=url, timeout=30) as c, \
            c.stream("POST", "/v1/completions", json={**OK, "max_tokens": 48, "stream": True}) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        waiter = threading.Thread(target=whole)
        waiter.start()
        time.sleep(0.2)
        for name in signals:
            server.handle_exit(getattr(signal, name), None)
        data = [line for line in lines if line.startswith("data: ")]
    waiter.join(10)
    thread.join(15)
    assert not thread.is_alive() and server.stopped_by == signals[0]
    assert data[-1] == "data: [DONE]" and f"shutting down ({signals[0]})" in data[-2], data[-2:]
    check_error(got["whole"], 503, None, f"the server is shutting down ({signals[0]})", "send the request again")
    assert got["whole"].json()["error"]["code"] == "shutting_down"  # not a failure: a client retries
    assert getattr(engine, "closed", False)  # the lifespan stopped the engine


def test_a_host_that_is_not_this_machines_names_host_as_the_fix(monkeypatch, capsys, tmp_path) -> None:
    from _hostile import one_line, run_cli
    from dipaco.cli.serve import main

    code, err = run_cli(main, [tmp_path, "--host", "192.0.2.1", "--port", "0"], capsys, monkeypatch)
    assert code == 2
    line = one_line(err, "cannot listen on 192.0.2.1", "--host is not an address of this machine")
    assert "--port" not in line and "authentication" not in err  # no warning for a server that never listened


def test_a_run_that_cannot_open_leaves_the_callers_sigterm_handler(monkeypatch, capsys, tmp_path) -> None:
    import signal

    from _hostile import one_line, run_cli
    from dipaco.cli.serve import main

    before = signal.getsignal(signal.SIGTERM)
    code, err = run_cli(main, [tmp_path / "nowhere", "--port", "0"], capsys, monkeypatch)
    assert code == 2 and one_line(err, "does not exist")
    assert signal.getsignal(signal.SIGTERM) is before  # serve() took it over while starting, and gave it back
