"""Serving benchmark: dipaco-serve over HTTP against the same engine in-process.

    python benchmarks/bench_serve.py                 # 256 prompts, 32 concurrent clients, greedy, 64 new tokens
    python benchmarks/bench_serve.py --tiny --run-dir RUN   # 8 prompts, 4 clients, 8 tokens (tests/test_benchmarks.py)

Every side decodes the same prompts with the same settings:

* **server**: ``dipaco-serve RUN`` in a subprocess (its engine in a process of its own;
  ``--server-args`` adds flags, e.g. ``--engine-in-process``), driven by ``--clients``
  concurrent httpx async clients over loopback, each sending its next prompt as soon as
  its last answer arrived (closed loop). Per-request latency is measured at the client;
  the server's CPU seconds are its process's and its engine process's.
* **engine, same concurrency**: ``RoutedEngine(run)`` in this process, stepped by a loop
  that keeps ``--clients`` requests in flight the same way: what the server adds (HTTP,
  JSON, the engine thread, per-token hand-over) is the difference. Target: the server's
  tokens/s >= 0.8 of it. The two are measured ``--repeats`` times, interleaved (A B, B A),
  and the figure is the median of each repeat's server ÷ engine (the two ran back to back,
  under one host load); the ratio of the two sides' medians is printed beside it.
* **engine, all at once**: ``generate`` with every request submitted at once (fuller
  batches than 32 clients can make), for reference.

Reports prompts/s, generated tokens/s and p50/p99 latency of each and writes
benchmarks/results/serve.json (not committed). The run is ``--run-dir`` or the inference
benchmark's run (trained once); prompts are the first 32 tokens of its validation documents, in a
fixed shuffle that mixes the domains (`--order corpus`: a domain at a time).
Not a test: numbers depend on the host and on what else runs on it.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
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

PROMPT_TOKENS = 32  # each prompt: the first tokens of a validation document
# --tiny's prompts: a wiring check needs no corpus pass (reading the validation split costs seconds)
TINY_TEXTS = ["def parse_args(argv):\n    parser = argparse.ArgumentParser()\n",
              "The river rose after three days of rain, and the village", "class Cache:\n    def __init__(self):",
              "SELECT name, count(*) FROM users GROUP BY", "import os\nimport sys\n\n\ndef main():\n"]


def prompts_of(run: Any, n: int, order: str = "mixed") -> list[list[int]]:
    """``n`` prompts: the first :data:`PROMPT_TOKENS` tokens of the run's validation documents,
    cycled when there are fewer documents. ``order``: ``"mixed"`` (a fixed shuffle, so the
    domains mix in every stretch of requests, as ``benchmarks.bench_serving``'s do) or
    ``"corpus"`` (the corpus' order: a domain at a time)."""
    import random

    from dipaco.job.prepare import validation_ids

    docs = [list(map(int, d[:PROMPT_TOKENS])) for d in validation_ids(run.cfg, run.run) if len(d) >= 2]
    limit = int(run.cfg.model.max_seq_len) - 1
    docs = [d[:limit] for d in docs]
    if order == "mixed":
        random.Random(0).shuffle(docs)
    elif order != "corpus":
        raise ValueError(f"order must be 'mixed' or 'corpus', got {order!r}")
    return [docs[i % len(docs)] for i in range(n)]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank) of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q / 100 * len(ordered) + 0.5)) - 1))]


def run_engine(run: Any, prompts: list[list[int]], max_tokens: int, batch: int, loaded: int) -> dict[str, Any]:
    """The engine in-process: every request at once, wall time of ``generate``."""
    from dipaco.inference.engine import Request, RoutedEngine

    engine = RoutedEngine(run, max_batch_size=batch, max_loaded_paths=loaded)
    requests = [Request(prompt_ids=p, max_new_tokens=max_tokens, temperature=0.0) for p in prompts]
    t0 = time.perf_counter()
    out = engine.generate(requests)
    wall = time.perf_counter() - t0
    tokens = sum(len(g.tokens) for g in out)
    return {"wall_s": wall, "prompts_per_s": len(prompts) / wall, "tokens_per_s": tokens / wall, "tokens": tokens}


def run_engine_closed_loop(run: Any, prompts: list[list[int]], max_tokens: int, batch: int, loaded: int,
                           clients: int) -> dict[str, Any]:
    """The engine in-process with the server's concurrency: at most ``clients`` requests in
    flight, the next submitted as soon as one finishes (what ``clients`` HTTP clients do)."""
    from dipaco.inference.engine import Request, RoutedEngine

    engine = RoutedEngine(run, max_batch_size=batch, max_loaded_paths=loaded)
    todo = list(reversed(prompts))
    started: dict[int, float] = {}
    latencies: list[float] = []
    tokens = 0

    def submit_next() -> None:
        rid = engine.submit(Request(prompt_ids=todo.pop(), max_new_tokens=max_tokens, temperature=0.0))
        started[rid] = time.perf_counter()

    t0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(min(clients, len(todo))):
        submit_next()
    while engine.has_work():
        for ev in engine.step():
            tokens += ev.token is not None
            if ev.finished:
                latencies.append(time.perf_counter() - started.pop(ev.request_id))
                if todo:
                    submit_next()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {"wall_s": wall, "prompts_per_s": len(prompts) / wall, "tokens_per_s": tokens / wall, "tokens": tokens,
            "latency_p50_s": percentile(latencies, 50), "latency_p99_s": percentile(latencies, 99),
            "engine_cpu_s": cpu}


class Server:
    """``dipaco-serve RUN --port 0`` in a subprocess; its URL once it listens."""

    def __init__(self, run_dir: Path, batch: int, loaded: int, max_tokens: int, extra: Sequence[str] = ()) -> None:
        cmd = [sys.executable, "-c", "from dipaco.cli.serve import main; main()", str(run_dir), "--port", "0",
               "--max-batch-size", str(batch), "--max-loaded-paths", str(loaded),
               "--max-tokens-cap", str(max_tokens), "--fast-verify", *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self.lines: list[str] = []
        self.url: Optional[str] = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            m = re.search(r"on (http://[^ ]+)/v1 ", line)
            if m:
                self.url = m.group(1)

    def wait(self, timeout: float = 300) -> str:
        deadline = time.monotonic() + timeout
        while self.url is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("dipaco-serve did not start:\n" + "".join(self.lines)[-3000:])
            time.sleep(0.05)
        return self.url

    def cpu_s(self) -> float:
        """CPU seconds the server has used so far: its process and its engine process, all
        their threads (Linux' /proc)."""
        try:
            return sum(_cpu_s(pid) for pid in _process_tree(self.proc.pid))
        except OSError:
            return float("nan")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (Linux' /proc/PID/task/TID/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").iterdir():
            todo += [int(c) for c in (task / "children").read_text().split()]
    return out


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


async def drive(url: str, model: str, prompts: Sequence[Any], clients: int, max_tokens: int,
                server_cpu: Any = None) -> dict[str, Any]:
    """``clients`` closed-loop clients over ``prompts``: throughput, per-request latency, and the
    CPU seconds of the clients (this process) and of the server (``server_cpu()``), which share
    the host's cores."""
    import httpx

    queue: "asyncio.Queue[list[int]]" = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    latencies: list[float] = []
    tokens = 0

    async def client(c: "httpx.AsyncClient") -> None:
        nonlocal tokens
        while not queue.empty():
            prompt = queue.get_nowait()
            t0 = time.perf_counter()
            r = await c.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                      "temperature": 0})
            r.raise_for_status()
            latencies.append(time.perf_counter() - t0)
            tokens += r.json()["usage"]["completion_tokens"]

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    server_cpu = server_cpu or (lambda: float("nan"))
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as c:
        t0, cpu0, srv0 = time.perf_counter(), time.process_time(), server_cpu()
        await asyncio.gather(*(client(c) for _ in range(clients)))
        wall, cpu, srv = time.perf_counter() - t0, time.process_time() - cpu0, server_cpu() - srv0
    return {"wall_s": wall, "prompts_per_s": len(prompts) / wall, "tokens_per_s": tokens / wall, "tokens": tokens,
            "latency_p50_s": percentile(latencies, 50), "latency_p99_s": percentile(latencies, 99),
            "latency_mean_s": statistics.fmean(latencies), "client_cpu_s": cpu, "server_cpu_s": srv}


def _peak_rss_mib(pids: Sequence[int]) -> float:
    """The processes' peak RSS (``VmHWM``) summed, in MiB: a bound on what they held at once."""
    total = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                total += int(line.split()[1])
    return total / 1024


def serving_side(setup: Any, clients: int = 32, passes: int = 3) -> dict[str, Any]:
    """``benchmarks.bench_serving``'s ``server`` side: ``dipaco-serve`` on the same prompts
    (the text, as a client sends it), greedy, ``clients`` closed-loop clients, batches as the
    engine's ``--file`` side, one path loaded per engine process. The server starts and
    answers ``clients`` prompts before the clock starts (a server is started once and runs);
    it then serves every prompt ``passes`` times, and the pass with the median tokens/s is
    reported (one pass of a few seconds is at the mercy of the host's load). Peak RSS is its
    process's and its engine processes', summed."""
    import httpx

    server = Server(Path(setup.run_dir), setup.batch_size, 1, setup.new_tokens)
    try:
        url = server.wait()
        model = Path(setup.run_dir).resolve().name
        asyncio.run(drive(url, model, setup.texts[:clients], clients, setup.new_tokens))
        samples = [asyncio.run(drive(url, model, setup.texts, clients, setup.new_tokens, server.cpu_s))
                   for _ in range(passes)]
        rss = _peak_rss_mib(_process_tree(server.proc.pid))
        health = httpx.get(url + "/health", timeout=30).json()
        engines = len(health.get("engines", [])) or 1  # a single engine process lists none
    finally:
        server.stop()
    r = _median_sample(samples)
    return {"prompts_s": r["prompts_per_s"], "tokens_s": r["tokens_per_s"], "peak_rss_mib": rss,
            "seconds": r["wall_s"], "tokens": r["tokens"], "latency_p50_s": r["latency_p50_s"],
            "latency_p99_s": r["latency_p99_s"], "passes_tokens_s": [d["tokens_per_s"] for d in samples],
            "engine_processes": engines,
            "note": f"{clients} closed-loop clients, server already started, median of {passes} passes"}


def _median_sample(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The sample with the median tokens/s (the lower middle one of an even count)."""
    ordered = sorted(samples, key=lambda d: d["tokens_per_s"])
    return ordered[(len(ordered) - 1) // 2]


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="8 prompts, 4 clients, 8 new tokens (a wiring check)")
    ap.add_argument("--quick", action="store_true", help="the default sizes (python -m benchmarks passes it)")
    ap.add_argument("--run-dir", default=None, help="a finished run (default: the inference benchmark's run)")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-batch-size", type=int, default=32)
    ap.add_argument("--max-loaded-paths", type=int, default=1)
    ap.add_argument("--order", choices=["mixed", "corpus"], default="mixed",
                    help="prompts' order: domains shuffled together (default) or the corpus' (a domain at a time)")
    ap.add_argument("--repeats", type=int, default=3, help="measurements of each side, interleaved (median)")
    ap.add_argument("--out", default=None, help="result JSON (default: benchmarks/results/serve.json)")
    ap.add_argument("--server-args", default="", help="more dipaco-serve flags, one string (e.g. "
                    "'--engine-in-process' or '--engine-threads 2')")
    args = ap.parse_args(argv)
    if args.tiny:
        args.prompts, args.clients, args.max_tokens, args.repeats = 8, 4, 8, 1
    load_before = load_average()
    if args.run_dir:
        run_dir = Path(args.run_dir)
    else:
        from benchmarks.bench_infer import ensure_run

        run_dir = ensure_run()
    from dipaco.inference import InferenceRun

    run = InferenceRun.open(run_dir, verify="read")
    if args.tiny:
        prompts = [run.encode(TINY_TEXTS[i % len(TINY_TEXTS)])[:PROMPT_TOKENS] for i in range(args.prompts)]
    else:
        prompts = prompts_of(run, args.prompts, args.order)
    model = run_dir.resolve().name
    shape = (args.max_tokens, args.max_batch_size, args.max_loaded_paths)
    server = Server(run_dir, args.max_batch_size, args.max_loaded_paths, args.max_tokens, args.server_args.split())
    try:
        url = server.wait()
        warm = prompts[: max(1, args.clients)]
        sides = {  # each returns one measurement; interleaved (A B, B A, ...) on a shared host
            "server": lambda p=prompts: asyncio.run(drive(url, model, p, args.clients, args.max_tokens,
                                                          server.cpu_s)),
            "engine_same_concurrency": lambda p=prompts: run_engine_closed_loop(run, p, *shape, args.clients),
        }
        for side in sides.values():
            side(warm)
        samples: dict[str, list[dict]] = {k: [] for k in sides}
        for i in range(args.repeats):
            for name in (list(sides) if i % 2 == 0 else list(sides)[::-1]):
                samples[name].append(sides[name]())
    finally:
        server.stop()
    samples["engine_all_at_once"] = [run_engine(run, prompts, *shape)]
    best = {k: _median_sample(v) for k, v in samples.items()}
    served, engine = best["server"], best["engine_same_concurrency"]
    # each repeat's server and engine ran back to back: their ratio compares them under one
    # host load, which drifts by a third between repeats on a shared host (docs/serving.md)
    paired = [s["tokens_per_s"] / e["tokens_per_s"]
              for s, e in zip(samples["server"], samples["engine_same_concurrency"])]
    ratio = statistics.median(paired)
    ratio_of_medians = served["tokens_per_s"] / engine["tokens_per_s"]
    ratio_all = served["tokens_per_s"] / best["engine_all_at_once"]["tokens_per_s"]
    rows = [{"side": f"engine in-process, {args.clients} in flight", **engine},
            {"side": f"server, {args.clients} clients", **served},
            {"side": "engine in-process, all at once", **best["engine_all_at_once"]}]
    print_table(rows, ["side", "prompts_per_s", "tokens_per_s", "wall_s", "latency_p50_s", "latency_p99_s",
                       "engine_cpu_s", "server_cpu_s", "client_cpu_s"],
                title=f"{len(prompts)} prompts, greedy, {args.max_tokens} new tokens, run {model}, "
                      f"median of {args.repeats}")
    print(f"server / engine tokens/s at the same concurrency: {ratio:.3f} (target >= 0.8; median of the "
          f"{len(paired)} back-to-back pairs: {', '.join(f'{r:.3f}' for r in paired)}); ratio of the medians "
          f"{ratio_of_medians:.3f}; / engine with every request at once: {ratio_all:.3f}")
    payload = {"prompts": len(prompts), "clients": args.clients, "max_tokens": args.max_tokens,
               "max_batch_size": args.max_batch_size, "max_loaded_paths": args.max_loaded_paths,
               "repeats": args.repeats, "run_dir": str(run_dir), "engine": engine, "server": served,
               "engine_all_at_once": best["engine_all_at_once"], "samples": samples,
               "server_over_engine": ratio, "server_over_engine_pairs": paired,
               "server_over_engine_of_medians": ratio_of_medians, "server_over_engine_all_at_once": ratio_all}
    write_result("serve", payload, mode="tiny" if args.tiny else "quick", load_before=load_before, out=args.out,
                 argv=argv)
    return payload


if __name__ == "__main__":
    main()
