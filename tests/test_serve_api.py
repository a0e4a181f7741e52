"""dipaco-serve's API as the ecosystem's clients use it, over the stand-in engine
(tests/_serve_fakes.py): ``n``/``best_of``, ``logprobs`` and ``echo`` (OpenAI's object),
vLLM's sampling extras, the length rule, the tokenizer endpoints, ``/metrics``, the model
cards and names, the access log. The real engine's numbers: tests/test_serve_cli.py and
tests/test_serve_engine_rules.py.
"""
from __future__ import annotations

import logging

import httpx
import pytest

from _serve_fakes import TOKENIZER, FakeEngine, fake_logprob, script_text, serving
from dipaco.serve import ServeLimits
from test_serve import MODEL, OK, check_error, complete, sse_events


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine(step_delay=0.001)
    with serving(engine, aliases=("alias-name",)) as (url, service):
        yield url, engine, service


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server[0], timeout=30) as c:
        yield c


# --------------------------------------------------------------------------- n, best_of


def test_n_gives_rows_of_each_prompt_seeded_apart_in_prompt_order(client) -> None:
    out = complete(client, prompt=["ab", "b"], n=2, max_tokens=5, seed=11)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    texts = [c["text"] for c in out["choices"]]
    alone = complete(client, prompt="ab", max_tokens=5, seed=11)["choices"][0]["text"]
    assert texts[0] == alone == script_text(5)  # the first row keeps the request's seed
    assert texts[1] != texts[0] and texts[3] != texts[2]  # the others are seeded apart
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 20, "total_tokens": 23}
    streamed = [c["index"] for e in sse_events(client.post("/v1/completions", json={
        **OK, "n": 2, "max_tokens": 3, "stream": True}).iter_lines()) for c in e["choices"]]
    assert set(streamed) == {0, 1}


def test_best_of_answers_the_n_likeliest_rows(client) -> None:
    rows = complete(client, prompt="ab", n=3, max_tokens=4, seed=5, logprobs=0)["choices"]
    sums = [sum(r["logprobs"]["token_logprobs"]) for r in rows]
    assert len(set(sums)) == 3  # the rows differ (seeded apart), and so do their log-probabilities
    out = complete(client, prompt="ab", n=2, best_of=3, max_tokens=4, seed=5)
    assert out["usage"]["completion_tokens"] == 12  # three rows generated, two answered
    best = sorted(range(3), key=lambda i: -sums[i])[:2]
    assert [c["text"] for c in out["choices"]] == [rows[i]["text"] for i in best]
    assert [c["index"] for c in out["choices"]] == [0, 1] and out["choices"][0]["logprobs"] is None


# --------------------------------------------------------------------------- logprobs, echo


def test_logprobs_is_openais_object_for_each_generated_token(client) -> None:
    out = complete(client, prompt="ab", max_tokens=4, logprobs=2, temperature=0)
    (choice,) = out["choices"]
    lp = choice["logprobs"]
    tokens = TOKENIZER.encode(script_text(4))
    assert lp["tokens"] == list(script_text(4)) and choice["text"] == script_text(4)
    assert lp["token_logprobs"] == [fake_logprob(t, 2)[0] for t in tokens]
    assert lp["text_offset"] == [0, 1, 2, 3]  # each token's text, from the start of the choice's text
    for t, top in zip(tokens, lp["top_logprobs"]):
        assert top[TOKENIZER.decode([t])] == fake_logprob(t, 2)[0] and len(top) == 2
    assert complete(client, prompt="ab", max_tokens=2)["choices"][0]["logprobs"] is None


def test_echo_with_max_tokens_0_returns_the_prompt_and_its_logprobs(client) -> None:
    out = complete(client, prompt="abc", max_tokens=0, echo=True, logprobs=1)
    (choice,) = out["choices"]
    lp = choice["logprobs"]
    assert choice["text"] == "abc" and choice["finish_reason"] == "length"
    assert lp["tokens"] == ["a", "b", "c"] and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == [fake_logprob(t, 1)[0] for t in TOKENIZER.encode("bc")]
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3}
    # lm-eval's request: token ids, echo, one new token; the prompt's entries come first
    out = complete(client, prompt=[TOKENIZER.encode("abc")], max_tokens=1, echo=True, logprobs=1, temperature=0)
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 4 and lp["text_offset"] == [0, 1, 2, 3]
    assert out["choices"][0]["text"] == "abc" + script_text(1)
    # echo without logprobs: the text only; a stream sends the prompt first
    assert complete(client, prompt="ab", max_tokens=2, echo=True)["choices"][0]["text"] == "ab" + script_text(2)
    events = sse_events(client.post("/v1/completions", json={**OK, "max_tokens": 2, "echo": True, "logprobs": 0,
                                                             "stream": True}).iter_lines())
    assert events[0]["choices"][0]["text"].startswith("ab")
    assert "".join(c["text"] for e in events for c in e["choices"]) == "ab" + script_text(2)
    assert sum(len(c["logprobs"]["tokens"]) for e in events for c in e["choices"]) == 4


# --------------------------------------------------------------------------- vLLM's extras


def test_stop_token_ids_end_a_row_with_its_token_and_reason(client) -> None:
    stop = TOKENIZER.encode("w")[0]
    out = complete(client, prompt="ab", max_tokens=40, stop_token_ids=[stop], temperature=0)
    (choice,) = out["choices"]
    assert choice["text"] == "hello w" and choice["finish_reason"] == "stop" and choice["stop_reason"] == stop


def test_include_stop_str_in_output_and_min_tokens(client) -> None:
    out = complete(client, prompt="ab", max_tokens=40, stop=["o"], include_stop_str_in_output=True)
    assert out["choices"][0]["text"] == "hello" and out["choices"][0]["stop_reason"] == "o"
    # min_tokens: a stop string inside the first min_tokens tokens does not count (vLLM's rule)
    out = complete(client, prompt="ab", max_tokens=40, stop=["o"], min_tokens=6)
    assert out["choices"][0]["text"] == "hello w"


def test_ignore_eos_and_skip_special_tokens(client) -> None:
    out = complete(client, prompt="EOS here", max_tokens=6)
    assert out["choices"][0]["finish_reason"] == "stop" and out["choices"][0]["text"] == script_text(3)
    out = complete(client, prompt="EOS here", max_tokens=6, ignore_eos=True)
    assert out["choices"][0]["finish_reason"] == "length" and out["choices"][0]["text"] == script_text(6)
    # the end-of-text that stops a row is text only when asked for, and special tokens are
    # text only with skip_special_tokens false
    out = complete(client, prompt="EOS here", max_tokens=6, skip_special_tokens=False)
    assert out["choices"][0]["text"] == script_text(3)
    out = complete(client, prompt="EOS here", max_tokens=6, skip_special_tokens=False, include_stop_str_in_output=True)
    assert out["choices"][0]["text"] == script_text(3) + "<eos>"


def test_sampling_extras_reach_the_engine_as_the_engine_reads_them(server, client) -> None:
    _, engine, _ = server
    complete(client, prompt="zq", max_tokens=3, top_k=-1, min_p=0.1, repetition_penalty=1.3, presence_penalty=0.5,
             frequency_penalty=-0.5, logit_bias={"7": -100, "8": 2.5}, min_tokens=1)
    req = next(r.request for r in engine.seen if r.request.prompt_ids == TOKENIZER.encode("zq"))
    assert (req.top_k, req.min_p, req.repetition_penalty, req.presence_penalty, req.frequency_penalty) == \
        (None, 0.1, 1.3, 0.5, -0.5)
    assert req.logit_bias == {7: -100.0, 8: 2.5} and req.min_tokens == 1 and req.stop_at_eos


# --------------------------------------------------------------------------- the length rule


def test_the_default_max_tokens_fits_the_context() -> None:
    with serving(FakeEngine(), ServeLimits(), max_seq_len=64) as (url, _), httpx.Client(base_url=url, timeout=30) as c:
        out = complete(c, prompt="x" * 60)  # 16 would not fit: 4 do
        assert out["usage"]["completion_tokens"] == 4 and out["choices"][0]["finish_reason"] == "length"
        assert complete(c, prompt="x" * 10)["usage"]["completion_tokens"] == 16  # OpenAI's default
        check_error(c.post("/v1/completions", json={**OK, "prompt": "x" * 10, "max_tokens": 60}), 400, "max_tokens",
                    "10 + 60 = 70")


def test_sliding_past_the_context_only_when_the_server_allows_it() -> None:
    with serving(FakeEngine(), ServeLimits(slide_past_context=True, max_tokens_cap=256), max_seq_len=64) as (url, _), \
            httpx.Client(base_url=url, timeout=30) as c:
        assert complete(c, prompt="x" * 60, max_tokens=100)["usage"]["completion_tokens"] == 100
        assert complete(c, prompt="x" * 90, max_tokens=2)["usage"]["prompt_tokens"] == 90
        check_error(c.post("/v1/completions", json={**OK, "max_tokens": 257}), 400, "max_tokens", "--max-tokens-cap")
        check_error(c.post("/v1/completions", json={**OK, "prompt": "x" * 90, "max_tokens": 0, "echo": True,
                                                    "logprobs": 1}), 400, "prompt", "one pass")


# --------------------------------------------------------------------------- endpoints


def test_tokenize_and_detokenize_in_vllms_shapes(client) -> None:
    out = client.post("/tokenize", json={"model": MODEL, "prompt": "hé", "return_token_strs": True}).json()
    assert out == {"count": 3, "max_model_len": 64, "tokens": TOKENIZER.encode("hé"),
                   "token_strs": [TOKENIZER.decode([t]) for t in TOKENIZER.encode("hé")]}
    assert client.post("/tokenize", json={"prompt": "ab"}).json()["token_strs"] is None  # model is optional
    assert client.post("/detokenize", json={"tokens": TOKENIZER.encode("hé")}).json() == {"prompt": "hé"}
    check_error(client.post("/detokenize", json={"tokens": [999]}), 400, "tokens", "outside the vocabulary")
    check_error(client.post("/tokenize", json={"prompt": "ab", "model": "x"}), 404, "model", "does not exist")
    check_error(client.post("/tokenize", json={"prompt": 5}), 400, "prompt", "valid string")
    check_error(client.post("/tokenize", json={"text": "a", "prompt": "b"}), 400, "text", "unknown field")
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] == "<eos>" and info["model_max_length"] == 64


def test_models_list_every_served_name_with_max_model_len(client) -> None:
    cards = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in cards] == [MODEL, "alias-name"] and {m["max_model_len"] for m in cards} == {64}
    out = complete(client, model="alias-name", prompt="ab", max_tokens=1)
    assert out["model"] == "alias-name"
    assert client.get("/v1/models/alias-name").json()["root"] == MODEL


def test_metrics_are_prometheus_text_with_requests_tokens_queue_and_paths(client) -> None:
    complete(client, prompt=["ab", "b"], max_tokens=3)
    client.post("/v1/completions", json={**OK, "max_tokens": -1})
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    assert samples['dipaco_requests_total{endpoint="/v1/completions",status="200"}'] >= 1
    assert samples['dipaco_requests_total{endpoint="/v1/completions",status="400"}'] >= 1
    m = f'{{model="{MODEL}"}}'
    assert samples[f"dipaco_generation_tokens_total{m}"] >= 6 and samples[f"dipaco_prompt_tokens_total{m}"] >= 3
    assert samples[f"dipaco_requests_waiting{m}"] == 0 and f"dipaco_batch_occupancy{m}" in samples
    paths = {k: v for k, v in samples.items() if k.startswith("dipaco_path_generation_tokens_total")}
    assert {'dipaco_path_generation_tokens_total{model="tiny-run",path="0"}',
            'dipaco_path_generation_tokens_total{model="tiny-run",path="1"}'} <= set(paths)
    assert "# TYPE dipaco_requests_total counter" in r.text


def test_an_access_line_per_request(caplog) -> None:
    with serving(FakeEngine(), access_log=True) as (url, _), httpx.Client(base_url=url, timeout=30) as c:
        with caplog.at_level(logging.INFO, logger="dipaco.serve.access"):
            complete(c, prompt="ab", max_tokens=2)
            with c.stream("POST", "/v1/completions", json={**OK, "max_tokens": 2, "stream": True}) as r:
                list(r.iter_lines())
            c.get("/health")
    lines = [r.getMessage() for r in caplog.records if r.name == "dipaco.serve.access"]
    assert len(lines) == 3, lines
    assert '"POST /v1/completions HTTP/1.1" 200' in lines[0] and "prompt_tokens=2 completion_tokens=2" in lines[0]
    assert "completion_tokens=2" in lines[1] and '"GET /health HTTP/1.1" 200' in lines[2]
