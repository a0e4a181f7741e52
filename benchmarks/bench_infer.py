"""Inference benchmark: memory of routed generation vs one path, and KV-cache speed-up.

    python benchmarks/bench_infer.py            # [4, 4] grid, d_model 256, 2 blocks per level
    python benchmarks/bench_infer.py --quick    # same run, 64 tokens, one process per memory case

Trains a small [4, 4] run once (reused from benchmarks/results/infer_run/ afterwards), then:

* memory: each case runs in a fresh process and reports how far its RSS peaks above the
  RSS it had after opening the run (imports, tokenizer, router; the high-water mark is
  reset there through /proc/self/clear_refs, Linux only). Cases: one path alone (``PathLoader.get``), ``generate`` (route + load +
  decode with KV cache), the whole grid (what ``load_grid_from_checkpoint`` holds) for
  scale. Target: generate ≤ 1.5× one path. Exact parameter + KV-cache bytes are reported too.
* speed: greedy tokens/s with and without the KV cache (same path, same tokens).

Prints a table and writes benchmarks/results/infer.json (not committed).
Not a test: numbers depend on the host and on what else runs on it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from dipaco.storage.strict_json import dumps_strict
from benchmarks.common import write_output

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
RUN_DIR = RESULTS / "infer_run"
PROMPT = ("def parse_args(argv):\n    parser = argparse.ArgumentParser(description='tool')\n"
          "    parser.add_argument('--verbose', action='store_true')\n")
OVERRIDES = [
    "experiment=smoke", "launcher=local", "grid.levels=[4,4]", "model.d_model=256", "model.n_heads=4",
    "model.layers_per_level=2", "model.max_seq_len=256", "trainer.rounds=1", "diloco.inner_steps=2",
    "trainer.dense_baseline=false", "trainer.plots=false", "trainer.progress=false", "data.max_documents=200",
]


def ensure_run() -> Path:
    """Train the benchmark's run unless a finished one is already there."""
    if (RUN_DIR / "summary.json").exists():
        return RUN_DIR
    from hydra import compose, initialize_config_module

    from dipaco.config import register_configs, to_config
    from dipaco.job.train import train

    register_configs()
    with initialize_config_module(config_module="dipaco.conf", version_base="1.3"):
        cfg = to_config(compose("config", overrides=OVERRIDES))
    cfg.run_dir = str(RUN_DIR)
    if RUN_DIR.exists():  # an unfinished earlier attempt: start over
        import shutil

        shutil.rmtree(RUN_DIR)
    train(cfg)
    return RUN_DIR


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak_rss() -> int:
    """Reset the RSS high-water mark (Linux ``clear_refs`` 5) and return the current RSS in bytes.

    Imports alone peak far above a small model, so the peak must be measured from here on.
    """
    fd = os.open("/proc/self/clear_refs", os.O_WRONLY)  # a kernel control, not a file of ours
    try:
        os.write(fd, b"5")
    finally:
        os.close(fd)
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """RSS high-water mark since the last :func:`reset_peak_rss`."""
    return _status_kib("VmHWM") * 1024


def tensor_bytes(modules) -> int:
    return sum(p.numel() * p.element_size() for m in modules for p in m.parameters())


def child(case: str, tokens: int) -> dict:
    """One memory case, in this (fresh) process."""
    from dipaco.inference import InferenceRun

    run = InferenceRun.open(RUN_DIR)
    prompt = run.encode(PROMPT)
    path = run.route(prompt)
    out: dict = {"case": case, "rss_at_start": reset_peak_rss()}
    if case == "path":
        model = run.loader().get(path)
        out["model_bytes"] = tensor_bytes(model.grid.built_modules().values())
    elif case == "generate":
        loader = run.loader()
        gen = run.generate(prompt, max_new_tokens=tokens, temperature=0.0, stop_at_eos=False, loader=loader)
        model = loader.get(gen.switches[-1][1])
        c = model.cfg  # the cache generate allocated: keys + values, float32, max_seq_len positions
        out["model_bytes"] = tensor_bytes(model.grid.built_modules().values())
        out["kv_cache_bytes"] = 2 * model.num_layers * c.n_heads * c.max_seq_len * c.head_dim * 4
        out["built_modules"] = sorted(loader.built_module_ids())
    elif case == "full_grid":
        from dipaco.job.evaluation import load_grid_from_checkpoint

        grid = load_grid_from_checkpoint(run.cfg, run.checkpoint)
        out["model_bytes"] = tensor_bytes(grid.built_modules().values())
    elif case != "baseline":
        raise ValueError(case)
    out["peak_rss"] = peak_rss_bytes()
    out["rss_over_baseline"] = out["peak_rss"] - out["rss_at_start"]
    return out


def run_child(case: str, tokens: int) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", case, "--tokens", str(tokens)],
                          capture_output=True, text=True, check=True, env={**os.environ, "PYTHONHASHSEED": "0"})
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench_memory(tokens: int, repeats: int) -> dict:
    # Each case reports its peak RSS increase over the RSS it had once the run was opened
    # (imports, tokenizer, router); "baseline" loads nothing more and shows the noise.
    # The minimum over repeats: RSS only ever adds noise (allocator, page cache).
    cases = {}
    for case in ("baseline", "path", "generate", "full_grid"):
        runs = [run_child(case, tokens) for _ in range(repeats)]
        cases[case] = min(runs, key=lambda r: r["rss_over_baseline"])
    path_delta = max(cases["path"]["rss_over_baseline"], 1)
    return {
        "cases": cases,
        "generate_vs_path_rss": cases["generate"]["rss_over_baseline"] / path_delta,
        "full_grid_vs_path_rss": cases["full_grid"]["rss_over_baseline"] / path_delta,
        "generate_vs_path_tensor_bytes": (cases["generate"]["model_bytes"] + cases["generate"]["kv_cache_bytes"])
        / cases["path"]["model_bytes"],
    }


def bench_speed(tokens: int, repeats: int) -> dict:
    from dipaco.inference import InferenceRun

    run = InferenceRun.open(RUN_DIR)
    prompt = run.encode(PROMPT)
    loader = run.loader()
    run.generate(prompt, max_new_tokens=4, loader=loader)  # warm-up: load the path, first-call costs
    out = {}
    toks = {}
    for name, cache in (("kv_cache", True), ("no_kv_cache", False)):
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            gen = run.generate(prompt, max_new_tokens=tokens, temperature=0.0, stop_at_eos=False,
                               use_kv_cache=cache, loader=loader)
            best = min(best, time.perf_counter() - t)
        toks[name] = gen.tokens
        out[name] = {"seconds": best, "tokens_per_s": tokens / best}
    out["same_tokens"] = toks["kv_cache"] == toks["no_kv_cache"]
    out["speedup"] = out["kv_cache"]["tokens_per_s"] / out["no_kv_cache"]["tokens_per_s"]
    out["prompt_tokens"] = len(prompt)
    out["new_tokens"] = tokens
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="64 new tokens, memory cases once, speed best of 2 (fits the suite's 10-minute budget)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, default=None, help="new tokens per generation")
    args = ap.parse_args()
    if args.child:
        print(dumps_strict(child(args.child, args.tokens)))
        return
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    RESULTS.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    ensure_run()
    train_s = time.perf_counter() - t0
    tokens = args.tokens or (64 if args.quick else 224)
    repeats = 2 if args.quick else 3
    # each memory case is a fresh process (imports + opening the run): once in quick mode
    mem = bench_memory(tokens, 1 if args.quick else repeats)
    speed = bench_speed(tokens, repeats)
    import torch

    result = {"quick": args.quick, "run_dir": str(RUN_DIR), "overrides": OVERRIDES, "memory": mem,
              "speed": speed, "prepare_run_s": train_s, "torch_threads": torch.get_num_threads(),
              "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
                       "torch": torch.__version__, "load_avg": os.getloadavg()}}
    write_output(RESULTS / "infer.json", dumps_strict(result, indent=2) + "\n")

    mb = 1 / 2**20
    c = mem["cases"]
    rows = [
        ("one path: tensor MB", f"{c['path']['model_bytes'] * mb:.1f}"),
        ("generate: tensor MB (params + KV cache)",
         f"{c['generate']['model_bytes'] * mb:.1f} + {c['generate']['kv_cache_bytes'] * mb:.1f}"),
        ("whole grid: tensor MB", f"{c['full_grid']['model_bytes'] * mb:.1f}"),
        ("peak RSS over baseline: nothing loaded MB", f"{c['baseline']['rss_over_baseline'] * mb:.1f}"),
        ("peak RSS over baseline: one path MB", f"{c['path']['rss_over_baseline'] * mb:.1f}"),
        ("peak RSS over baseline: generate MB", f"{c['generate']['rss_over_baseline'] * mb:.1f}"),
        ("peak RSS over baseline: whole grid MB", f"{c['full_grid']['rss_over_baseline'] * mb:.1f}"),
        ("generate / one path (RSS)  [target <= 1.5]", f"{mem['generate_vs_path_rss']:.2f}"),
        ("generate / one path (tensor bytes)", f"{mem['generate_vs_path_tensor_bytes']:.2f}"),
        ("whole grid / one path (RSS)", f"{mem['full_grid_vs_path_rss']:.2f}"),
        (f"tokens/s with KV cache ({tokens} new)", f"{speed['kv_cache']['tokens_per_s']:.1f}"),
        (f"tokens/s without KV cache ({tokens} new)", f"{speed['no_kv_cache']['tokens_per_s']:.1f}"),
        ("KV-cache speed-up", f"{speed['speedup']:.2f}x"),
        ("same greedy tokens", str(speed["same_tokens"])),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"  {k:<{width}}  {v}" for k, v in rows))
    print(f"wrote {RESULTS / 'infer.json'}")


if __name__ == "__main__":
    main()
