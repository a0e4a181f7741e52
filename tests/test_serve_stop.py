"""SIGTERM to dipaco-serve's whole process group (what systemd, ``timeout`` and
``kill -- -PGID`` send) gives open streams the same grace as SIGTERM to the server alone:
the engine processes ignore it, finish what they can in the grace, and are stopped by the
server, which exits 0. Before, the engine processes died at once and every open stream
ended with ``engine_down``.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from test_serve_cli import PROMPTS, _children, _running, start_server

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]
GRACE_S = 5.0  # dipaco.serve.server.GRACE_S


def test_sigterm_to_the_process_group_during_32_streams_keeps_the_grace(finished, tmp_path) -> None:
    run_dir = finished[0]
    proc, url, log = start_server(run_dir, tmp_path, "--engine-processes", "2", "--slide-past-context",
                                  "--max-tokens-cap", "2048", "--no-access-log", new_session=True)
    try:
        children = _children(proc.pid)
        started = threading.Barrier(33)
        ends: list = [None] * 32

        def stream(i: int) -> None:
            # half finish within the grace, half (sliding past the context, a full forward per
            # token) cannot and are answered 503 once it is over
            body = {"model": run_dir.resolve().name, "prompt": PROMPTS[i % 4], "max_tokens": 8 if i % 2 else 1500,
                    "temperature": 0, "stream": True}
            with httpx.Client(base_url=url, timeout=120) as c, c.stream("POST", "/v1/completions", json=body) as r:
                data = []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        if not data:
                            started.wait(120)
                        data.append(line[6:])
                ends[i] = (data, time.monotonic())

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(32)]
        for t in threads:
            t.start()
        started.wait(120)  # every stream has its first chunk: all 32 are open
        os.killpg(proc.pid, signal.SIGTERM)
        sent = time.monotonic()
        for t in threads:
            t.join(120)
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = "".join(log)  # stderr, read on a thread until the server exited
    assert code == 0 and "dipaco-serve: stopped (SIGTERM)" in text and "Traceback" not in text, (code, text[-3000:])
    finished_ok = refused = 0
    for data, at in ends:
        assert data[-1] == "[DONE]", data[-3:]
        last = json.loads(data[-2])
        if "error" in last:  # the documented 503 of a stop, after the grace; never engine_down
            assert last["error"]["code"] == "shutting_down", last
            assert at - sent >= GRACE_S - 0.5
            refused += 1
        else:
            assert last["choices"][0]["finish_reason"] in ("length", "stop"), last
            finished_ok += 1
    assert finished_ok >= 16 and refused, (finished_ok, refused)  # the short ones finished in the grace
    deadline = time.monotonic() + 10
    while [c for c in children if _running(c)]:  # every engine process stopped: no orphans
        assert time.monotonic() < deadline, [c for c in children if _running(c)]
        time.sleep(0.1)
