"""dipaco-serve end to end: the real CLI in a subprocess over the session's tiny trained run
(tests/_hostile.py ``finished``) and the real batched engine, driven over loopback by httpx
and the openai client; and the CLI's one-line refusals.
"""
from __future__ import annotations

import builtins
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from _hostile import one_line, run_cli
from dipaco.cli.serve import main

PROMPTS = ["def parse_args(argv):\n    parser = argparse.ArgumentParser()\n",
           "class Cache:\n    def __init__(self, size):\n        self.size = size\n",
           "import os\nimport sys\n\n\ndef main():\n    print(sys.argv)\n",
           "    return x + 1\n"]


# --------------------------------------------------------------------------- the CLI's refusals


def test_a_missing_extra_is_one_line_naming_the_install(monkeypatch, capsys, tmp_path) -> None:
    real = builtins.__import__

    def no_fastapi(name, *a, **kw):
        if name == "fastapi":
            raise ModuleNotFoundError("No module named 'fastapi'", name="fastapi")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_fastapi)
    code, err = run_cli(main, [tmp_path, "--port", "0"], capsys, monkeypatch)
    assert code == 2
    one_line(err, "serve extra", "fastapi", 'pip install -e ".[serve]"')


def test_a_bad_run_directory_or_flag_is_one_line(monkeypatch, capsys, tmp_path) -> None:
    code, err = run_cli(main, [tmp_path / "nope", "--port", "0"], capsys, monkeypatch)
    assert code == 2
    one_line(err, "does not exist")
    code, err = run_cli(main, [tmp_path, "--max-loaded-paths", "0"], capsys, monkeypatch)
    assert code == 2
    one_line(err, "--max-loaded-paths must lie in")
    code, err = run_cli(main, [tmp_path, "--engine-threads", "2", "--engine-in-process"], capsys, monkeypatch)
    assert code == 2
    one_line(err, "--engine-in-process", "not allowed with")
    code, err = run_cli(main, [tmp_path, "--engine-processes", "2", "--engine-in-process"], capsys, monkeypatch)
    assert code == 2
    one_line(err, "--engine-processes", "not allowed with")
    code, err = run_cli(main, [tmp_path, "--engine-processes", "0"], capsys, monkeypatch)
    assert code == 2
    one_line(err, "--engine-processes must lie in")
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft != resource.RLIM_INFINITY and soft < 1 << 20:  # more connections than files this process may open
        code, err = run_cli(main, [tmp_path, "--max-connections", str(soft)], capsys, monkeypatch)
        assert code == 2
        one_line(err, f"--max-connections {soft} is more than this process can open", "ulimit -n")
    code, err = run_cli(main, [tmp_path, "--body-timeout", "0"], capsys, monkeypatch)
    assert code == 2
    one_line(err, "--body-timeout must lie in")


def test_a_busy_port_is_one_line(monkeypatch, capsys, tmp_path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        code, err = run_cli(main, [tmp_path, "--port", str(port)], capsys, monkeypatch)
    assert code == 2
    one_line(err, f"cannot listen on 127.0.0.1:{port}", "--port")


def test_binding_beyond_loopback_warns_that_there_is_no_authentication(monkeypatch, capsys, tmp_path) -> None:
    code, err = run_cli(main, [tmp_path / "nope", "--host", "0.0.0.0", "--port", "0"], capsys, monkeypatch)
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and "no authentication" in lines[0] and "0.0.0.0" in lines[0], err
    code, err = run_cli(main, [tmp_path / "nope", "--port", "0"], capsys, monkeypatch)
    assert "authentication" not in err  # the default bind is loopback: no warning


@pytest.mark.multiprocess
@pytest.mark.parametrize("where", [[], ["--engine-in-process"]])
def test_a_checkpoint_that_cannot_be_opened_is_one_line_wherever_the_engine_runs(finished, where, monkeypatch,
                                                                                   capsys) -> None:
    code, err = run_cli(main, [finished[0], "--port", "0", "--checkpoint", "round_999999", *where], capsys,
                        monkeypatch)
    assert code == 2
    one_line(err, "round_999999")


@pytest.mark.multiprocess
def test_more_engine_processes_than_paths_is_one_line(finished, monkeypatch, capsys) -> None:
    # before: accepted (up to 256 processes of ~320 MiB each), all but one per path idle. One
    # too many here, not 256: a regression would spawn every one of them
    from dipaco.inference import InferenceRun

    n = InferenceRun.open(finished[0], need_weights=False).num_paths + 1
    code, err = run_cli(main, [finished[0], "--port", "0", "--engine-processes", str(n)], capsys, monkeypatch)
    assert code == 2
    one_line(err, f"--engine-processes {n} is more than the run's {n - 1} paths; give at most {n - 1}")


# --------------------------------------------------------------------------- the real engine


def start_server(run_dir: Path, cwd: Path, *flags: str, new_session: bool = False) -> tuple:
    """``dipaco-serve RUN --port 0 FLAGS`` in a subprocess: (the process, its base url once it
    serves, its stderr lines so far, read on a thread)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-c", "from dipaco.cli.serve import main; main()", str(run_dir),
                             "--port", "0", "--max-loaded-paths", "1", "--max-tokens-cap", "64", *flags],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            cwd=cwd, start_new_session=new_session)
    lines: list[str] = []
    found: dict = {}

    def read() -> None:
        for line in proc.stderr:
            lines.append(line)
            m = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line)
            if m:
                found["url"] = m.group(1)

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + 180  # opening the run hashes its checkpoint
    while "url" not in found:
        assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
        time.sleep(0.05)
    return proc, found["url"], lines


def _serve(run_dir: Path, cwd: Path, *flags: str):
    """:func:`start_server`: yields its base url; stopped at the end (no traceback in its log)."""
    proc, url, lines = start_server(run_dir, cwd, *flags)
    children = _children(proc.pid)  # the engine processes (and multiprocessing's resource tracker)
    try:
        yield url
    finally:
        proc.terminate()
        code = proc.wait(30)
        log = "".join(lines)
        assert "Traceback" not in log, log[-3000:]
        # a stop by SIGTERM is the server's normal end: exit 0, one line, every engine process reaped
        assert code == 0 and "dipaco-serve: stopped (SIGTERM)" in log, (code, log[-3000:])
        deadline = time.monotonic() + 10
        while [c for c in children if _running(c)]:
            assert time.monotonic() < deadline, [c for c in children if _running(c)]
            time.sleep(0.1)


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (from /proc; none where there is no /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue  # a process that ended meanwhile
    return found


def _running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited (a zombie has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def served(finished, tmp_path_factory):
    """The server as shipped on a host of 2 cores or more (two engine processes, the paths
    kept apart; the other placements: the last test): (base url, run dir)."""
    run_dir, _ = finished
    for url in _serve(run_dir, tmp_path_factory.mktemp("serve"), "--engine-processes", "2"):
        yield url, run_dir


@pytest.fixture(scope="module")
def run(served):
    from dipaco.inference import InferenceRun

    return InferenceRun.open(served[1])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_greedy_completions_are_the_runs_own_generation(served, run) -> None:
    url, run_dir = served
    name = Path(run_dir).resolve().name
    with httpx.Client(base_url=url, timeout=60) as c:
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == [name]
        out = c.post("/v1/completions", json={"model": name, "prompt": PROMPTS[:2], "max_tokens": 12,
                                              "temperature": 0}).json()
        for prompt, choice in zip(PROMPTS, out["choices"]):
            gen = run.generate(run.encode(prompt), max_new_tokens=12, temperature=0)
            want = run.tokenizer.decode([t for t in gen.tokens if t != run.tokenizer.eos_id])
            assert choice["text"] == want, (prompt, choice)
            assert choice["dipaco"]["paths"] == [p for _, p in gen.switches]
        assert out["usage"]["prompt_tokens"] == sum(len(run.encode(p)) for p in PROMPTS[:2])
        with c.stream("POST", "/v1/completions", json={"model": name, "prompt": PROMPTS[0], "max_tokens": 12,
                                                       "temperature": 0, "stream": True}) as r:
            data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert data[-1] == "[DONE]"
        assert "".join(json.loads(d)["choices"][0]["text"] for d in data[:-1]) == out["choices"][0]["text"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_concurrent_clients_share_batches_and_a_leaving_one_is_freed(served) -> None:
    url, run_dir = served
    name = Path(run_dir).resolve().name
    results: list = []

    def one(i: int) -> None:
        with httpx.Client(base_url=url, timeout=120) as c:
            r = c.post("/v1/completions", json={"model": name, "prompt": PROMPTS[i % 4], "max_tokens": 24,
                                                "temperature": 0.7, "seed": i})
            results.append(r)

    with httpx.Client(base_url=url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json={"model": name, "prompt": PROMPTS[0], "max_tokens": 64,
                                                       "stream": True, "temperature": 0}) as r:
            next(line for line in r.iter_lines() if line.startswith("data: "))
        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert [r.status_code for r in results] == [200] * 8, [r.text for r in results]
        deadline = time.monotonic() + 30
        while (h := c.get("/health").json())["active_requests"]:
            assert time.monotonic() < deadline, h
            time.sleep(0.1)
        assert h["status"] == "ok" and h["engine"]["max_rows"] >= 2, h  # rows shared a step
        # the two engine processes: none holds a request now, and each keeps its own bound of
        # --max-loaded-paths 1 (the pool may hold two paths, one engine never more than one)
        assert [e["open_requests"] for e in h["engines"]] == [0, 0], h
        assert all(len(e["loaded_paths"]) <= 1 for e in h["engines"]) and h["loaded_paths"], h
        bad = c.post("/v1/completions", json={"model": name, "prompt": "x " * 200, "max_tokens": 4})
        assert bad.status_code == 400 and "context" in bad.json()["error"]["message"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_openai_client_against_the_real_engine(served) -> None:
    openai = pytest.importorskip("openai")
    url, run_dir = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    name = client.models.list().data[0].id
    out = client.completions.create(model=name, prompt=PROMPTS[2], max_tokens=8, temperature=0, stop=["\n\n\n"])
    assert out.choices[0].finish_reason in ("stop", "length") and out.usage.completion_tokens <= 8


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_openai_clients_echo_logprobs_are_dipaco_infer_scores(served, run, tmp_path, capsys) -> None:
    """n=2, logprobs=3, echo=True, max_tokens=0 (how lm-eval scores a text): each choice is the
    text with its tokens' log-probabilities, the first null; past the routing prefix they sum
    to what ``dipaco-infer score`` gives the same text, on the same path."""
    openai = pytest.importorskip("openai")
    from dipaco.cli.infer import main as infer

    url, run_dir = served
    text = PROMPTS[0] + PROMPTS[1]
    ids = run.encode(text)
    assert run.prefix_tokens < len(ids) <= run.cfg.model.max_seq_len
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    out = client.completions.create(model=Path(run_dir).resolve().name, prompt=text, n=2, logprobs=3, echo=True,
                                    max_tokens=0)
    doc = tmp_path / "doc.jsonl"
    doc.write_text(json.dumps({"text": text}) + "\n")
    capsys.readouterr()
    infer(["score", str(run_dir), "--file", str(doc), "--seq-len", str(run.cfg.model.max_seq_len)])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(out.choices) == 2 and out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 0
    for choice in out.choices:
        lp = choice.logprobs
        assert choice.text == text and choice.finish_reason == "length"
        assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert "".join(lp.tokens) == run.tokenizer.decode(ids) and lp.text_offset[-1] + len(lp.tokens[-1]) == len(text)
        assert all(1 <= len(top) <= 4 for top in lp.top_logprobs[1:])  # the 3 likeliest, and the token
        assert -sum(lp.token_logprobs[run.prefix_tokens:]) == pytest.approx(report["loss"] * report["num_tokens"],
                                                                           rel=1e-5)
        assert choice.dipaco["paths"] == [int(p) for p in report["per_path"]]
    assert out.choices[0].logprobs.token_logprobs == out.choices[1].logprobs.token_logprobs


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("where", [["--engine-in-process"], ["--engine-processes", "1"]])
def test_every_engine_placement_answers_as_the_engine_processes_do(served, where, tmp_path) -> None:
    url, run_dir = served
    name = Path(run_dir).resolve().name
    body = {"model": name, "prompt": PROMPTS, "max_tokens": 10, "temperature": 0.8, "seed": 3}
    with httpx.Client(base_url=url, timeout=60) as c:
        want = c.post("/v1/completions", json=body).json()["choices"]
    for other in _serve(run_dir, tmp_path, *where):
        with httpx.Client(base_url=other, timeout=60) as c:
            got = c.post("/v1/completions", json=body).json()["choices"]
            health = c.get("/health").json()
            assert health["status"] == "ok" and health["active_requests"] == 0, health
    assert [(g["text"], g["dipaco"]) for g in got] == [(w["text"], w["dipaco"]) for w in want]
