"""Serving benchmark: many prompts answered by their paths, three ways, on the same host.

    python -m benchmarks.bench_serving --run RUN_DIR     # 256 prompts, 64 new tokens, batch 32, greedy
    python -m benchmarks.bench_serving --tiny            # smoke: 8 prompts, 4 tokens (tests run it)
    python -m benchmarks.bench_serving                   # no --run: on a smoke run trained first

Prompts are held-out documents of the run's corpus (its test split, else validation, in a
fixed shuffle, so domains mix), each cut to its first ``--prompt-tokens`` tokens (when the
split has fewer documents than prompts, the next piece of each document follows). Sides:

* ``per_process``: one ``dipaco-infer generate --prompt`` process per prompt (start-up,
  checkpoint check and all). A sample of ``--sample`` whole processes is timed and the
  rate extrapolated to every prompt (the result says so).
* ``engine_process``: one ``dipaco-infer generate --file`` process for every prompt
  (start-up included): the batched engine.
* ``engine_fast_process``: the same with ``--fast`` (``RoutedEngine(exact=False)``: one
  matrix product per layer over the batch, padded batched prefill).
* ``engine_loop`` / ``engine_fast_loop``: the engine's ``generate`` in this process (loop
  only), exact / fast.
* ``hf``: Hugging Face ``transformers`` ``generate`` on the same prompts, each sent to its
  path of ``dipaco-infer export --format hf --all`` (routed by the same router), batched
  the same way (``--batch-size`` rows per path, left padding); timed as a whole process
  and its loop alone.

Each side reports prompts/s, generated tokens/s (tokens up to and including end-of-text)
and peak RSS (``wait4`` of its process; the loops share this process). Targets:
engine_process ≥ 100× per_process in prompts/s, ≥ 1.0× hf in generated tokens/s.
``--sides a,b`` runs only those (the verdicts need per_process, engine_process, engine_loop
and hf); ``--profile`` adds a cProfile of the exact loop (top functions by own time).

* ``server``: ``dipaco-serve`` on the same prompts, 32 closed-loop HTTP clients
  (``benchmarks.bench_serve.serving_side``), its steady rate once started; with its p50/p99
  latency. ``benchmarks/bench_serve.py`` compares it with the engine at the same
  concurrency, repeatedly.

Writes benchmarks/results/serving.json. Not a test: numbers depend on the host and its load.
"""
from __future__ import annotations

import importlib
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from benchmarks.common import base_parser, fmt, load_average, print_table, work_dir, write_result
from dipaco.storage.strict_json import dumps_strict
from dipaco.storage.atomic import atomic_write_lines

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Setup:
    """What every side gets: the run, the prompts (as a jsonl file too) and the settings."""

    run_dir: Path
    texts: list[str]
    prompt_file: Path
    new_tokens: int
    batch_size: int
    sample: int
    work: Path
    profile: bool = False


def _run_child(cmd: Sequence[str]) -> tuple[float, float, str]:
    """Run ``cmd``: (wall seconds, the process's own peak RSS in MiB by ``wait4``, its stdout)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    out = proc.stdout.read() if proc.stdout else b""
    err = proc.stderr.read() if proc.stderr else b""
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    code = os.waitstatus_to_exitcode(status)
    if code:
        raise RuntimeError(f"{' '.join(map(str, cmd[:5]))} ... failed (exit {code}): {err.decode()[-800:]}")
    return wall, usage.ru_maxrss / 1024, out.decode()


def _infer(*args: Any) -> list[str]:
    return [sys.executable, "-m", "dipaco.cli.infer", *map(str, args)]


def side_per_process(s: Setup) -> dict:
    walls, tokens, rss = [], 0, 0.0
    for text in s.texts[: s.sample]:
        wall, peak, out = _run_child(_infer("generate", s.run_dir, "--prompt", text, "--max-new-tokens", s.new_tokens,
                                            "--temperature", "0", "--json"))
        walls.append(wall)
        tokens += json.loads(out.strip().splitlines()[-1])["new_tokens"]
        rss = max(rss, peak)
    per_prompt = sum(walls) / len(walls)
    return {"prompts_s": 1 / per_prompt, "tokens_s": tokens / sum(walls), "peak_rss_mib": rss,
            "seconds_per_prompt": per_prompt, "note": f"{len(walls)} whole processes timed, extrapolated"}


def _engine_process(s: Setup, *flags: str) -> dict:
    out = s.work / ("engine_fast.jsonl" if flags else "engine.jsonl")
    out.unlink(missing_ok=True)
    wall, rss, _ = _run_child(_infer("generate", s.run_dir, "--file", s.prompt_file, "--max-new-tokens", s.new_tokens,
                                     "--temperature", "0", "--batch-size", s.batch_size, "--out", out, *flags))
    lines = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]
    tokens = sum(x["new_tokens"] for x in lines)
    res = {"prompts_s": len(lines) / wall, "tokens_s": tokens / wall, "peak_rss_mib": rss, "seconds": wall,
           "tokens": tokens}
    exact = s.work / "engine.jsonl"
    if flags and exact.exists():
        mine = [json.loads(x)["tokens"] for x in exact.read_text(encoding="utf-8").splitlines()]
        res["same_tokens_as_engine"] = sum(a == x["tokens"] for a, x in zip(mine, lines)) / max(1, len(lines))
    return res


def side_engine_process(s: Setup) -> dict:
    return _engine_process(s)


def side_engine_fast_process(s: Setup) -> dict:
    return _engine_process(s, "--fast")


def _engine_loop(s: Setup, exact: bool, profile: bool = False) -> dict:
    from dipaco.inference import InferenceRun, Request, RoutedEngine

    run = InferenceRun.open(s.run_dir)
    reqs = [Request(run.encode(t), max_new_tokens=s.new_tokens) for t in s.texts]
    engine = RoutedEngine(run, max_batch_size=s.batch_size, exact=exact)
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t0 = time.perf_counter()
    gens = engine.generate(reqs)
    wall = time.perf_counter() - t0
    tokens = sum(len(g.tokens) for g in gens)
    res = {"prompts_s": len(gens) / wall, "tokens_s": tokens / wall, "peak_rss_mib": float("nan"), "seconds": wall,
           "tokens": tokens, "path_loads": engine.loader.loads}
    if prof is not None:
        import pstats

        prof.disable()
        st = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)
        top = sorted(st.items(), key=lambda kv: -kv[1][2])[:15]
        res["profile_top_own_seconds"] = {f"{k[2]} ({Path(k[0]).name}:{k[1]})": round(v[2], 3) for k, v in top}
    return res


def side_engine_loop(s: Setup) -> dict:
    return _engine_loop(s, True, s.profile)


def side_engine_fast_loop(s: Setup) -> dict:
    return _engine_loop(s, False)


def side_hf(s: Setup) -> dict:
    export = s.work / "hf_export"
    if not (export / "routed.json").exists():
        subprocess.run(_infer("export", s.run_dir, "--all", "--format", "hf", "--out", export, "--force"), check=True,
                       cwd=ROOT, stdout=subprocess.DEVNULL)
    wall, rss, out = _run_child([sys.executable, "-m", "benchmarks.bench_serving", "--hf-worker", str(export),
                                 str(s.prompt_file), str(s.new_tokens), str(s.batch_size)])
    res = json.loads(out.strip().splitlines()[-1])
    engine = s.work / "engine.jsonl"
    same = None
    if engine.exists():
        mine = [json.loads(x)["tokens"] for x in engine.read_text(encoding="utf-8").splitlines()]
        same = sum(a == b for a, b in zip(mine, res["tokens"])) / max(1, len(mine))
    n, tokens = len(res["tokens"]), sum(len(t) for t in res["tokens"])
    return {"prompts_s": n / wall, "tokens_s": tokens / wall, "peak_rss_mib": rss, "seconds": wall,
            "loop_tokens_s": tokens / res["loop_s"], "loop_seconds": res["loop_s"], "tokens": tokens,
            "same_tokens_as_engine": same}


def hf_worker(export: str, prompt_file: str, new_tokens: int, batch_size: int) -> None:
    """The ``hf`` side in its own process: route, group by path, left-pad, ``generate``."""
    import numpy as np
    import torch

    from dipaco.inference import load_routed

    routed = load_routed(export)
    texts = [json.loads(x)["text"] for x in Path(prompt_file).read_text(encoding="utf-8").splitlines()]
    ids = [routed.encode(t) for t in texts]
    eos = routed.tokenizer.eos_id
    with torch.no_grad():  # one token first: transformers' first generate pays lazy imports (2 s
        # measured, torch._dynamo among them) that belong to its start-up, not to its loop
        routed.model(0).generate(torch.tensor([ids[0][:1]]), max_new_tokens=1, do_sample=False, pad_token_id=eos)
    t0 = time.perf_counter()
    paths = routed.router.route_batch([np.asarray(x, dtype=np.int64) for x in ids])
    out: list[list[int]] = [[] for _ in ids]
    for p in sorted(set(int(x) for x in paths)):
        model = routed.model(p)
        rows = [i for i in range(len(ids)) if int(paths[i]) == p]
        for k in range(0, len(rows), batch_size):
            chunk = rows[k:k + batch_size]
            width = max(len(ids[i]) for i in chunk)
            inp = torch.tensor([[eos] * (width - len(ids[i])) + ids[i] for i in chunk])
            mask = torch.tensor([[0] * (width - len(ids[i])) + [1] * len(ids[i]) for i in chunk])
            with torch.no_grad():
                gen = model.generate(inp, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                     eos_token_id=eos, pad_token_id=eos)
            for i, row in zip(chunk, gen[:, width:].tolist()):
                out[i] = row[: row.index(eos) + 1] if eos in row else row
    print(dumps_strict({"loop_s": time.perf_counter() - t0, "tokens": out}))


def _verdicts(results: dict[str, dict]) -> dict[str, float]:
    """The ratios the targets are stated in, for the sides that ran."""
    r = results
    pairs = {"engine_vs_per_process_prompts": ("engine_process", "prompts_s", "per_process", "prompts_s"),
             "engine_vs_hf_tokens_whole_process": ("engine_process", "tokens_s", "hf", "tokens_s"),
             "engine_fast_vs_hf_tokens_whole_process": ("engine_fast_process", "tokens_s", "hf", "tokens_s"),
             "engine_fast_vs_per_process_prompts": ("engine_fast_process", "prompts_s", "per_process", "prompts_s"),
             "engine_loop_vs_hf_loop_tokens": ("engine_loop", "tokens_s", "hf", "loop_tokens_s"),
             "engine_fast_loop_vs_hf_loop_tokens": ("engine_fast_loop", "tokens_s", "hf", "loop_tokens_s"),
             # the server is started once and runs: its steady rate against the engine's
             # whole --file process, and against the engine's loop with every prompt at once
             "server_vs_engine_process_tokens": ("server", "tokens_s", "engine_process", "tokens_s"),
             "server_vs_engine_loop_tokens": ("server", "tokens_s", "engine_loop", "tokens_s")}
    return {k: r[a][x] / r[b][y] for k, (a, x, b, y) in pairs.items() if a in r and b in r}


def make_prompts(run_dir: Path, n: int, prompt_tokens: int, path: Path) -> list[str]:
    """``n`` held-out documents of the run's corpus cut to ``prompt_tokens`` tokens, as jsonl."""
    from dipaco.data import load_corpus
    from dipaco.inference import InferenceRun

    run = InferenceRun.open(run_dir, need_weights=False)
    corpus = load_corpus(run.cfg.data, progress=False)
    split = "test" if "test" in getattr(corpus, "splits", {"test": 1}) else "validation"
    try:
        docs = list(corpus.split(split)["text"])
    except (KeyError, ValueError):
        docs = list(corpus.split("validation")["text"])
    random.Random(0).shuffle(docs)
    encoded = [run.encode(d) for d in docs]
    texts: list[str] = []
    # each document's start first; if the split has fewer documents than n, then the next
    # prompt_tokens-token piece of each, and so on (still held out, still mixed)
    for piece in range(max(len(x) for x in encoded) // prompt_tokens):
        for ids in encoded:
            cut = ids[piece * prompt_tokens:(piece + 1) * prompt_tokens]
            if len(cut) == prompt_tokens and len(texts) < n:
                texts.append(run.tokenizer.decode(cut))
        if len(texts) == n:
            break
    atomic_write_lines(path, (dumps_strict({"text": t}) + "\n" for t in texts))
    return texts


def _tiny_run(work: Path) -> Path:
    from dipaco.config import compose_config
    from dipaco.job.train import train

    run_dir = work / "tiny_run"
    train(compose_config(["experiment=smoke", "data.max_documents=200", "trainer.progress=false"], run_dir))
    return run_dir


def main(argv: Optional[Sequence[str]] = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--hf-worker"]:
        hf_worker(argv[1], argv[2], int(argv[3]), int(argv[4]))
        return {}
    ap = base_parser(__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a smoke run of seconds (the test suite runs it)")
    ap.add_argument("--run", default=None, help="a finished run directory (default: train a smoke run first)")
    ap.add_argument("--prompts", type=int, default=None, help="prompts (default 256; 8 with --tiny)")
    ap.add_argument("--new-tokens", type=int, default=None, help="new tokens per prompt (default 64; 4 with --tiny)")
    ap.add_argument("--prompt-tokens", type=int, default=32, help="tokens each held-out document is cut to")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--sample", type=int, default=None, help="per-prompt processes timed (default 8; 1 with --tiny)")
    ap.add_argument("--sides", default=None, help="comma-separated sides to run (default: all)")
    ap.add_argument("--profile", action="store_true", help="cProfile the exact engine loop (engine_loop)")
    args = ap.parse_args(argv)
    load_before = load_average()
    work = work_dir("serving", args.work_dir)
    # without --run: a smoke run trained here (docs/serving.md's figures used a default run)
    run_dir = Path(args.run) if args.run else _tiny_run(work)
    n = args.prompts or (8 if args.tiny else 256)
    setup = Setup(run_dir=run_dir, texts=[], prompt_file=work / "prompts.jsonl",
                  new_tokens=args.new_tokens or (4 if args.tiny else 64), batch_size=args.batch_size,
                  sample=args.sample or (1 if args.tiny else 8), work=work, profile=args.profile)
    setup.texts = make_prompts(run_dir, n, args.prompt_tokens, setup.prompt_file)
    sides = {"per_process": side_per_process, "engine_process": side_engine_process,
             "engine_fast_process": side_engine_fast_process, "engine_loop": side_engine_loop,
             "engine_fast_loop": side_engine_fast_loop, "hf": side_hf}
    try:
        sides["server"] = importlib.import_module("benchmarks.bench_serve").serving_side
    except (ImportError, AttributeError):
        pass
    if args.sides:
        wanted = args.sides.split(",")
        unknown = sorted(set(wanted) - set(sides))
        if unknown:
            ap.error(f"unknown side(s) {unknown}; known: {sorted(sides)}")
        sides = {k: v for k, v in sides.items() if k in wanted}
    results = {}
    for name, fn in sides.items():
        print(f"-- {name} (load {load_average():.2f})", flush=True)
        results[name] = fn(setup)
    verdicts = _verdicts(results)
    rows = [{"side": k, **{c: v.get(c) for c in ("prompts_s", "tokens_s", "peak_rss_mib")}} for k, v in results.items()]
    print_table(rows, ["side", "prompts_s", "tokens_s", "peak_rss_mib"],
                title=f"{len(setup.texts)} prompts, {setup.new_tokens} new tokens, batch {setup.batch_size}, greedy")
    for k, v in verdicts.items():
        print(f"{k}: {fmt(v)}")
    payload = {"run_dir": str(run_dir), "prompts": len(setup.texts), "new_tokens": setup.new_tokens,
               "batch_size": setup.batch_size, "sides": results, "verdicts": verdicts}
    write_result("serving", payload, mode="tiny" if args.tiny else args.mode, load_before=load_before,
                 out=args.out or (str(work / "serving.json") if args.tiny else None), argv=argv)
    return payload


if __name__ == "__main__":
    main()
