"""What a vanished stream costs a loaded dipaco-serve, and how far streams lag their tokens.

    python -m benchmarks.bench_serve_vanish --run-dir RUN_DIR     # 32 streaming clients, 6 streams that vanish

``--clients`` closed-loop clients stream completions (90 new tokens each, fewer on a short
context) while, one after another, ``--vanish`` streams read their first chunk and close
their connection. The server runs in a child of this script (``--serve-child``) that counts,
inside the server, each token the engine thread hands out (per request, with its time) and
when each streamed chunk is made. Reported: the delay from an engine step to its chunk
(median, p90, p99: how far the streams lag the engine) and, for each vanished stream, the
tokens its row made in all and after its client closed (counted at the server, when the
engine thread read them: an upper bound). docs/serving.md quotes it. Not a test: the
figures depend on the host and on what else runs on it.
"""
from __future__ import annotations

import argparse
import asyncio
import atexit
import collections
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional, Sequence

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # run as a script: the repository root holds `benchmarks`
    sys.path.insert(0, str(HERE.parent))

from benchmarks.common import load_average, print_table, write_result  # noqa: E402
from dipaco.storage.atomic import write_json  # noqa: E402

PROMPT_TOKENS = 16
TEXTS = ["def parse_args(argv):\n    parser = argparse.ArgumentParser()\n", "class Cache:\n    def __init__(self):",
         "import os\nimport sys\n\n\ndef main():\n", "The river rose after three days of rain, and the village"]


def serve_child(out: str, vanish_tokens: int, argv: list[str]) -> None:
    """dipaco-serve in this process, with its engine thread and chunks counted (module docstring)."""
    from dipaco.serve import completions, engine_thread

    times: dict = collections.defaultdict(list)
    vanish: dict = {}
    cancelled: dict = {}
    chunks: list = []
    thread = engine_thread.EngineThread
    submit, dispatch, cancel = thread.submit, thread._dispatch, thread.cancel
    chunk = completions.Completion.chunk

    def counted_submit(self: Any, request: Any, sink: Any) -> int:
        rid = submit(self, request, sink)
        if request.max_new_tokens == vanish_tokens:
            vanish[rid] = time.monotonic()
        return rid

    def counted_dispatch(self: Any, events: list) -> None:
        now = time.monotonic()
        for ev in events:
            if ev.token is not None:
                times[ev.request_id].append(now)
        dispatch(self, events)

    def counted_cancel(self: Any, rid: int) -> None:
        cancelled.setdefault(rid, time.monotonic())
        cancel(self, rid)

    def counted_chunk(self: Any, choice: Any, text: str, finished: bool) -> Any:
        chunks.append((choice.request_id, choice.tokens, time.monotonic()))
        return chunk(self, choice, text, finished)

    thread.submit, thread._dispatch, thread.cancel = counted_submit, counted_dispatch, counted_cancel
    completions.Completion.chunk = counted_chunk

    def dump() -> None:
        lags = sorted(t - times[rid][n - 1] for rid, n, t in chunks if 0 < n <= len(times[rid]))
        rows = [{"submitted": vanish[r], "times": times[r], "cancelled": cancelled.get(r)} for r in vanish]
        write_json(out, {"lags_s": lags, "vanished": rows})  # the bench's own scratch file, read back below

    atexit.register(dump)
    from dipaco.cli.serve import main as serve

    serve(argv)


async def _load(url: str, model: str, prompts: list, clients: int, tokens: int, vanish: int, vanish_tokens: int,
                warm_s: float) -> tuple[int, list[float]]:
    import httpx

    stop = asyncio.Event()
    closed: list[float] = []

    async def client(c: Any, i: int) -> int:
        n = 0
        while not stop.is_set():
            body = {"model": model, "prompt": prompts[(i + n) % len(prompts)], "max_tokens": tokens,
                    "temperature": 0.7, "seed": i + n, "stream": True}
            async with c.stream("POST", "/v1/completions", json=body) as r:
                async for _ in r.aiter_lines():
                    pass
            n += 1
        return n

    limits = httpx.Limits(max_connections=clients + 8)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as c:
        tasks = [asyncio.create_task(client(c, i)) for i in range(clients)]
        await asyncio.sleep(warm_s)
        for k in range(vanish):
            async with httpx.AsyncClient(base_url=url, timeout=120) as v:
                body = {"model": model, "prompt": prompts[k % len(prompts)], "max_tokens": vanish_tokens,
                        "temperature": 0, "stream": True}
                async with v.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            break
            closed.append(time.monotonic())  # leaving the block closed the connection
            await asyncio.sleep(1.5)
        stop.set()
        served = sum(await asyncio.gather(*tasks))
    return served, closed


def main(argv: Optional[Sequence[str]] = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--serve-child"]:
        serve_child(argv[1], int(argv[2]), argv[3:])
        return {}
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the default sizes (python -m benchmarks passes it)")
    ap.add_argument("--run-dir", default=None, help="a finished run (default: the inference benchmark's run)")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--vanish", type=int, default=6, help="streams that leave after their first chunk, in turn")
    ap.add_argument("--server-args", default="", help="more dipaco-serve flags, one string")
    ap.add_argument("--out", default=None, help="result JSON (default: benchmarks/results/serve_vanish.json)")
    args = ap.parse_args(argv)
    load_before = load_average()
    if args.run_dir:
        run_dir = Path(args.run_dir)
    else:
        from benchmarks.bench_infer import ensure_run

        run_dir = ensure_run()
    from dipaco.inference import InferenceRun

    run = InferenceRun.open(run_dir, need_weights=False)
    prompts = [run.encode(t)[:PROMPT_TOKENS] for t in TEXTS]
    room = int(run.cfg.model.max_seq_len) - PROMPT_TOKENS
    tokens = max(1, min(90, room - 20))
    vanish_tokens = tokens + min(20, room - tokens)  # told apart from the load's by their length
    counts = str(HERE.parent / "benchmarks" / "results" / f"serve_vanish.{os.getpid()}.counts.json")
    Path(counts).parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "benchmarks.bench_serve_vanish", "--serve-child", counts, str(vanish_tokens),
           str(run_dir), "--port", "0", "--no-access-log", "--fast-verify", *args.server_args.split()]
    proc = subprocess.Popen(cmd, cwd=HERE.parent, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    found: dict = {}

    def read() -> None:
        for line in proc.stderr:
            m = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line)
            if m:
                found["url"] = m.group(1)

    threading.Thread(target=read, daemon=True).start()
    try:
        deadline = time.monotonic() + 300
        while "url" not in found:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("dipaco-serve did not start")
            time.sleep(0.1)
        served, closed = asyncio.run(_load(found["url"], run_dir.resolve().name, prompts, args.clients, tokens,
                                           args.vanish, vanish_tokens, warm_s=3.0))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    data = json.loads(Path(counts).read_text())
    Path(counts).unlink()
    lags = data["lags_s"]

    def q(p: float) -> float:
        return 1000 * lags[min(len(lags) - 1, int(p * (len(lags) - 1)))] if lags else float("nan")

    rows = []
    for row, t in zip(sorted(data["vanished"], key=lambda r: r["submitted"]), closed):
        rows.append({"tokens": len(row["times"]), "after_close": sum(x > t for x in row["times"]),
                     "cancel_ms_after_close": None if row["cancelled"] is None else
                     round(1000 * (row["cancelled"] - t), 1)})
    print_table(rows, ["tokens", "after_close", "cancel_ms_after_close"],
                title=f"{args.vanish} vanished streams ({vanish_tokens} tokens asked) among {args.clients} streaming "
                      f"clients ({tokens} tokens each); {served} streams served")
    print(f"step-to-chunk delay: median {q(0.5):.1f} ms, p90 {q(0.9):.1f} ms, p99 {q(0.99):.1f} ms ({len(lags)} chunks)")
    payload = {"run_dir": str(run_dir), "clients": args.clients, "tokens": tokens, "vanish_tokens": vanish_tokens,
               "served": served, "vanished": rows, "lag_ms": {"p50": q(0.5), "p90": q(0.9), "p99": q(0.99)}}
    write_result("serve_vanish", payload, mode="quick", load_before=load_before, out=args.out, argv=argv)
    return payload


if __name__ == "__main__":
    main()
