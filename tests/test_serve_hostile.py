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
