"""dipaco-serve's HTTP contract over a stand-in engine (tests/_serve_fakes.py): a real uvicorn
server on a free loopback port, driven by httpx and the openai client.

Completions (string and list prompts), streaming, stop strings, continuous batching (a
request joins a running batch), every refusal (status + one line in OpenAI's error object),
a client that leaves mid-stream, /v1/models, /health and an engine that fails. The real
engine's end-to-end tests are in tests/test_serve_cli.py.
"""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from _serve_fakes import TOKENIZER, FakeEngine, script_text, serving
from dipaco.serve import ServeLimits
from dipaco.serve.text import TextAssembler

MODEL = "tiny-run"


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine(step_delay=0.002)
    with serving(engine) as (url, service):
        yield url, engine, service


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server[0], timeout=30) as c:
        yield c


def complete(client: httpx.Client, **body) -> dict:
    r = client.post("/v1/completions", json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


def sse_events(lines) -> list:
    """The JSON objects of an SSE stream; asserts it ends with [DONE]."""
    data = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]", data[-3:]
    return [json.loads(d) for d in data[:-1]]


def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# --------------------------------------------------------------------------- completions


def test_a_string_prompt_gets_one_choice_with_its_path_and_usage(client) -> None:
    out = complete(client, prompt="ab", max_tokens=8, temperature=0)
    assert out["object"] == "text_completion" and out["model"] == MODEL and out["id"].startswith("cmpl-")
    (choice,) = out["choices"]
    assert choice["text"] == script_text(8) and choice["finish_reason"] == "length"
    path = ord("a") + 1 & 1  # the fake routes by the first token's parity
    assert choice["dipaco"] == {"paths": [path], "switches": [{"position": 2, "path": path}]}
    assert out["usage"] == {"prompt_tokens": 2, "completion_tokens": 8, "total_tokens": 10}


def test_a_list_of_prompts_gets_one_choice_each_in_order(client) -> None:
    out = complete(client, prompt=["ab", "b", "EOS here"], max_tokens=6)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert [c["dipaco"]["paths"] for c in out["choices"]] == [[0], [1], [0]]
    texts = [c["text"] for c in out["choices"]]
    assert texts == [script_text(6), script_text(6), script_text(3)]  # the eos token is not text
    assert [c["finish_reason"] for c in out["choices"]] == ["length", "length", "stop"]
    assert out["usage"]["completion_tokens"] == 6 + 6 + 4


def test_token_id_prompts_are_accepted(client) -> None:
    out = complete(client, prompt=[[98, 99], [99]], max_tokens=2)
    assert [c["text"] for c in out["choices"]] == [script_text(2)] * 2
    assert out["usage"]["prompt_tokens"] == 3


def test_a_stop_string_cuts_the_text_and_frees_the_row(server, client) -> None:
    _, engine, _ = server
    out = complete(client, prompt="ab", max_tokens=40, stop=["zzz", "world"])
    (choice,) = out["choices"]
    assert choice["text"] == "hello " and choice["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == len("hello world")  # nothing generated past the stop
    wait_for(lambda: not engine.rows)  # the engine freed the row at its next step
    assert engine.cancelled, "the row was cancelled in the engine"


def test_streaming_sends_the_same_text_as_events_ending_with_done(client) -> None:
    with client.stream("POST", "/v1/completions", json={
            "model": MODEL, "prompt": "ab", "max_tokens": 30, "stream": True, "stop": "world",
            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert text == "hello "  # the held-back "wor" of the stop string was never sent
    last = events[-2]["choices"][0]
    assert last["finish_reason"] == "stop" and last["dipaco"]["paths"] == [0]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 11


def test_a_character_split_over_tokens_is_sent_whole() -> None:
    text = TextAssembler(TOKENIZER, stops=["!!"], eos_id=0)
    parts = [text.add(t) for t in TOKENIZER.encode("aé!!b")]
    assert parts == ["a", "", "é", "", "", ""] and text.stopped and text.text == "aé"
    text = TextAssembler(TOKENIZER, stops=["é!"], eos_id=0)  # a stop that begins with a split character
    parts = [text.add(t) for t in TOKENIZER.encode("aé é!")]
    assert parts == ["a", "", "", "é ", "", "", ""] and text.stopped and text.text == "aé "


def test_text_held_back_for_a_stop_string_is_released_at_the_end() -> None:
    text = TextAssembler(TOKENIZER, stops=["ab"], eos_id=0)
    assert [text.add(t) for t in TOKENIZER.encode("xa")] == ["x", ""]
    assert text.finish() == "a" and not text.stopped


def test_add_all_gives_the_text_of_adding_each_token() -> None:
    """The whole-row hand-over decodes once (dipaco/serve/completions.py); same text as one by one."""
    ids = TOKENIZER.encode("aé b") + [0] + TOKENIZER.encode("c")  # a split character and an eos inside
    for cut in range(len(ids) + 1):
        one, whole = TextAssembler(TOKENIZER, eos_id=0), TextAssembler(TOKENIZER, eos_id=0)
        sent = "".join(one.add(t) for t in ids[:cut]) + one.finish()
        assert whole.add_all(ids[:cut]) + whole.finish() == sent and whole.text == one.text


def test_a_whole_completion_wakes_the_event_loop_once_per_row(server, client) -> None:
    """No stream and no stop string: the engine thread hands each row over once, at its end
    (the event loop shares the GIL with the engine; dipaco/serve/mailbox.py), with the text,
    paths and usage a streamed or per-token hand-over gives."""
    service = server[2]
    boxes = list(service._mailboxes.values())  # the server's one loop, once a request has come
    before = boxes[0].deliveries if boxes else 0
    out = complete(client, prompt=["ab", "cd"], max_tokens=24, temperature=0)
    (box,) = service._mailboxes.values()
    assert [c["text"] for c in out["choices"]] == [script_text(24)] * 2
    assert out["usage"]["completion_tokens"] == 48
    assert box.deliveries - before <= 2  # 48 tokens, 2 rows: at most one wake-up each


# --------------------------------------------------------------------------- batching


def test_requests_on_one_path_share_a_batch_and_join_a_running_one() -> None:
    """B, sent while A is generating on the same path, is decoded in A's batch from its next
    step on: it does not wait for A to finish."""
    engine = FakeEngine(step_delay=0.02)
    with serving(engine) as (url, service), httpx.Client(base_url=url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "ab", "max_tokens": 40,
                                                       "stream": True}) as a:
            lines = a.iter_lines()
            next(line for line in lines if line.startswith("data: "))  # A is running
            b = complete(c, prompt="a", max_tokens=3)  # same path (first token "a")
            assert sse_events(["data: {}", *lines])[-1]["choices"][0]["finish_reason"] == "length"
        assert b["choices"][0]["finish_reason"] == "length"
        a_id, b_id = 0, 1
        shared = [rids for _, rids in engine.batches if {a_id, b_id} <= set(rids)]
        assert len(shared) >= 3, engine.batches  # B's three tokens came from A's batch
        assert service.engine.stats.joined_running >= 1 and service.engine.stats.max_rows >= 2
        assert c.get("/health").json()["engine"]["joined_running"] >= 1


def test_concurrent_clients_across_paths_all_finish() -> None:
    engine = FakeEngine(step_delay=0.005)
    with serving(engine) as (url, service):
        results: list = []

        def one(i: int) -> None:
            with httpx.Client(base_url=url, timeout=30) as c:
                results.append(complete(c, prompt="ab"[i % 2] + "x", max_tokens=5 + i % 3))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(results) == 8
        assert {tuple(r["choices"][0]["dipaco"]["paths"]) for r in results} == {(0,), (1,)}
        assert service.engine.stats.max_rows >= 2  # some requests shared a step
        assert all(len(set(rids)) == len(rids) for _, rids in engine.batches)


# --------------------------------------------------------------------------- refusals

OK = {"model": MODEL, "prompt": "ab"}
BAD = [  # (body, status, param, words in the message)
    ({**OK, "prompt": ""}, 400, "prompt", "empty"),
    ({**OK, "prompt": "   "}, 400, "prompt", "empty"),
    ({**OK, "prompt": []}, 400, "prompt", "empty list"),
    ({**OK, "prompt": ["ok", ""]}, 400, "prompt", "prompt[1] is empty"),
    ({**OK, "prompt": "x" * 64}, 400, "prompt", "whole context (64)"),
    ({**OK, "prompt": "x" * 60, "max_tokens": 10}, 400, "max_tokens", "60 + 10 = 70 is more than the model's context of 64"),
    ({**OK, "prompt": ["ab", "x" * 60], "max_tokens": 5}, 400, "max_tokens", "prompt[1] is 60 tokens"),
    ({**OK, "prompt": [[1, 2], [999]]}, 400, "prompt", "outside the vocabulary"),
    ({**OK, "prompt": 5}, 400, "prompt", "must be a string"),
    ({**OK, "max_tokens": 0}, 400, "max_tokens", "only echo"),
    ({**OK, "max_tokens": -3}, 400, "max_tokens", "must be >= 0"),
    ({**OK, "max_tokens": 49}, 400, "max_tokens", "--max-tokens-cap"),
    ({**OK, "model": "other"}, 404, "model", "does not exist"),
    ({"prompt": "ab"}, 400, "model", "model is required"),
    ({**OK, "max_tokens": "5"}, 400, "max_tokens", "valid integer"),
    ({**OK, "max_tokens": 5.0}, 400, "max_tokens", "valid integer"),
    ({**OK, "temperature": "hot"}, 400, "temperature", "temperature"),
    ({**OK, "stream": "yes"}, 400, "stream", "valid boolean"),
    ({**OK, "temperature": 2.5}, 400, "temperature", "[0, 2]"),
    ({**OK, "temperature": -0.1}, 400, "temperature", "[0, 2]"),
    ({**OK, "top_p": 0}, 400, "top_p", "(0, 1]"),
    ({**OK, "top_p": 1.5}, 400, "top_p", "(0, 1]"),
    ({**OK, "top_k": 0}, 400, "top_k", ">= 1 or -1"),
    ({**OK, "min_p": 1.5}, 400, "min_p", "[0, 1]"),
    ({**OK, "n": 0}, 400, "n", "[1, 128]"),
    ({**OK, "n": 2, "best_of": 1}, 400, "best_of", "best_of (1) must be >= n (2)"),
    ({**OK, "best_of": 2, "stream": True}, 400, "best_of", "cannot be streamed"),
    ({**OK, "prompt": ["a", "b", "c"], "n": 30}, 400, "prompt", "--max-choices"),
    ({**OK, "logprobs": 21}, 400, "logprobs", "[0, 20]"),
    ({**OK, "suffix": "x"}, 400, "suffix", "not supported"),
    ({**OK, "presence_penalty": 3}, 400, "presence_penalty", "[-2, 2]"),
    ({**OK, "repetition_penalty": 0}, 400, "repetition_penalty", "[0.01, 100]"),
    ({**OK, "repetition_penalty": 1e-300}, 400, "repetition_penalty", "[0.01, 100]"),
    ({**OK, "logit_bias": {"abc": 1}}, 400, "logit_bias", "token ids"),
    ({**OK, "logit_bias": {"5": 200}}, 400, "logit_bias", "[-100, 100]"),
    ({**OK, "logit_bias": {"999": 1}}, 400, "logit_bias", "outside the vocabulary"),
    ({**OK, "stop_token_ids": [999]}, 400, "stop_token_ids", "outside the vocabulary"),
    ({**OK, "min_tokens": 10, "max_tokens": 5}, 400, "min_tokens", "min_tokens (10) must be <= max_tokens (5)"),
    ({**OK, "stop": ["s"] * 33}, 400, "stop", "at most 32"),
    ({**OK, "stop": [""]}, 400, "stop", "empty string"),
    ({**OK, "max_token": 5}, 400, "max_token", "unknown field"),
    ({**OK, "stream_options": {"include_usage": True}}, 400, "stream_options", "only allowed with stream"),
    ({**OK, "prompt": "a" * 101 + "b"}, 400, "prompt", "context"),
]


def check_error(r: httpx.Response, status: int, param, *words: str) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    msg = err["message"]
    assert "\n" not in msg and "Traceback" not in r.text and len(msg) < 400, msg
    for w in words:
        assert w in msg, (w, msg)
    return msg


@pytest.mark.parametrize("body,status,param,words", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_a_bad_request_is_a_4xx_with_one_line(client, body, status, param, words) -> None:
    check_error(client.post("/v1/completions", json=body), status, param, words)


@pytest.mark.parametrize("raw,words", [(b'{"model": "tiny-run", "prompt": ', "not valid JSON"),
                                       (b"[1, 2]", "JSON object"), (b"", "JSON object"),
                                       (b'{"model": "tiny-run", "prompt": "a", "temperature": NaN}', "[0, 2]")])
def test_a_malformed_body_is_a_400_with_one_line(client, raw, words) -> None:
    r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    check_error(r, 400, "temperature" if b"NaN" in raw else None, words)


def test_an_oversized_body_is_refused_before_parsing(client) -> None:
    body = json.dumps({**OK, "prompt": "a" * 5000}).encode()
    check_error(client.post("/v1/completions", content=body, headers={"content-type": "application/json"}),
                413, None, "at most 4096", "--max-body-bytes")

    def chunks():  # no Content-Length: the limit counts what arrives
        for _ in range(10):
            yield b" " * 1000
    r = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    check_error(r, 413, None, "at most 4096")


def test_the_engine_refusing_a_request_is_a_400_with_one_line(server) -> None:
    url, engine, _ = server
    with serving(FakeEngine(), ServeLimits(max_tokens_cap=8), max_seq_len=4096) as (url, _), \
            httpx.Client(base_url=url, timeout=30) as c:
        check_error(c.post("/v1/completions", json={**OK, "prompt": "a" * 150}), 400, None,
                    "the engine refuses this prompt second line")
        assert c.get("/health").json()["status"] == "ok"


def test_unknown_endpoints_and_methods_get_the_error_object(client) -> None:
    check_error(client.get("/v1/chat"), 404, None, "GET /v1/chat", "POST /v1/completions")
    check_error(client.get("/v1/completions"), 405, None, "method not allowed")
    check_error(client.get("/v1/models/other"), 404, "model", "does not exist")


# --------------------------------------------------------------------------- clients that leave


def test_a_client_leaving_mid_stream_frees_its_row_and_the_server_goes_on() -> None:
    engine = FakeEngine(step_delay=0.02)
    with serving(engine) as (url, service), httpx.Client(base_url=url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={**OK, "max_tokens": 48, "stream": True}) as r:
            next(line for line in r.iter_lines() if line.startswith("data: "))
        # the connection is closed with 40+ tokens to go
        wait_for(lambda: 0 in engine.cancelled and not engine.rows and service.engine.active == 0)
        assert complete(c, prompt="ab", max_tokens=3)["choices"][0]["text"] == script_text(3)


def test_a_client_leaving_before_a_whole_completion_frees_its_rows() -> None:
    engine = FakeEngine(step_delay=0.02)
    with serving(engine) as (url, service):
        with httpx.Client(base_url=url, timeout=0.3) as c, pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json={**OK, "prompt": ["ab", "b"], "max_tokens": 48})
        wait_for(lambda: set(engine.cancelled) == {0, 1} and not engine.rows and service.engine.active == 0)


# --------------------------------------------------------------------------- models, health, failure


def test_models_lists_the_run_as_one_model(client) -> None:
    out = client.get("/v1/models").json()
    assert out["object"] == "list" and [m["id"] for m in out["data"]] == [MODEL]
    assert out["data"][0]["owned_by"] == "dipaco" and out["data"][0]["dipaco"]["num_paths"] == 2
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL


def test_health_is_ok_while_the_engine_runs(client) -> None:
    out = client.get("/health")
    assert out.status_code == 200 and out.json()["status"] == "ok" and out.json()["model"] == MODEL


def test_an_engine_failure_is_a_503_and_health_says_why() -> None:
    engine = FakeEngine(step_delay=0.01)
    with serving(engine) as (url, service), httpx.Client(base_url=url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={**OK, "max_tokens": 40, "stream": True}) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            check_error(c.post("/v1/completions", json={**OK, "prompt": "BOOM"}), 503, None, "fake kernel fault")
            events = sse_events(lines)  # the stream still ends, with the error before [DONE]
        assert "fake kernel fault" in events[-1]["error"]["message"] and events[-1]["error"]["code"] == "engine_down"
        h = c.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "failed"
        assert "RuntimeError: a fake kernel fault with a second line" in h.json()["error"]
        check_error(c.post("/v1/completions", json=OK), 503, None, "not running")


# --------------------------------------------------------------------------- the openai client


def test_the_openai_client_speaks_to_it(server) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=30)
    assert [m.id for m in client.models.list()] == [MODEL]
    out = client.completions.create(model=MODEL, prompt="ab", max_tokens=5, temperature=0)
    assert out.choices[0].text == script_text(5) and out.usage.completion_tokens == 5
    stream = client.completions.create(model=MODEL, prompt="ab", max_tokens=5, stream=True)
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == script_text(5)
    with pytest.raises(openai.BadRequestError, match="more than the model's context of 64"):
        client.completions.create(model=MODEL, prompt="ab", max_tokens=63)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="ab")
