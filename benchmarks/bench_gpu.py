"""Throughput, MFU and peak memory of one path and of the DiPaCo loop, on this machine's device.

    python -m benchmarks.bench_gpu --quick   # CUDA: model=medium and paper; CPU: tiny and base
    python -m benchmarks.bench_gpu --full    # CUDA: model=paper, more steps; CPU: base and small
    python -m benchmarks.bench_gpu --tiny    # a few seconds: wiring check (CI, busy machines)

Per model size, two sides, each in a fresh process (peak memory is a high-water mark):

* **bare**: a plain loop on ``modules.PathModel`` with batches already on the device:
  autocast forward, cross entropy, backward, (fused on CUDA) AdamW. Nothing else.
* **dipaco**: the trainer's loop body in the local backend for a ``[2, 2]`` grid on the
  one device, through the round driver over the synchronous schedule: for each of the 4
  paths, ``activate`` → ``PathLearner.train_steps(H)`` (its own AdamW, schedule, clipping,
  ``TokenStream`` batches copied to the device) → ``contribute``; then ``sync_point(H)``
  (per-module DiLoCo outer step) and ``end_round`` every H steps. The
  outer state is where ``diloco.outer_device`` (default ``auto``) puts it;
  ``--compare-outer`` adds the side ``dipaco_cpu_outer`` with ``diloco.outer_device=cpu``.

Reported: tokens/s, MFU and the peak memory next to :mod:`dipaco.plan.memory`'s model of it.
MFU counts ``6·N + 12·L·d·T`` FLOPs per token (N parameters, L blocks, d width, T
sequence length; the PaLM appendix formula) against the device's dense peak: a table of
datasheet figures for known GPUs (bf16/fp16, or TF32 for fp32), otherwise a measured
large-GEMM rate in the compute dtype (so CPU "MFU" is relative to this CPU's own GEMM
speed). Peak memory is the CUDA allocator's peak, or on the CPU the process's peak RSS
minus its RSS before the model was built (after one step of a throwaway model, so that
the runtime's own start-up memory is not counted). Results name the device.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from benchmarks.common import base_parser, load_average, print_table, write_result
from dipaco.storage.strict_json import dumps_strict

# per mode and device type: model presets (conf/model/), steps per sample (= H), rounds
SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "tiny": {"cpu": {"models": ["tiny"], "batch": 4, "seq": 64, "H": 2, "rounds": 1},
             "cuda": {"models": ["tiny"], "batch": 4, "seq": 64, "H": 2, "rounds": 1}},
    "quick": {"cpu": {"models": ["tiny", "base"], "batch": 8, "seq": 128, "H": 4, "rounds": 2},
              "cuda": {"models": ["medium", "paper"], "batch": 16, "seq": 1024, "H": 10, "rounds": 3}},
    "full": {"cpu": {"models": ["base", "small"], "batch": 16, "seq": 128, "H": 10, "rounds": 3},
             "cuda": {"models": ["paper"], "batch": 16, "seq": 1024, "H": 30, "rounds": 5}},
}


def _gemm_peak(device: Any, dtype: Any) -> float:
    """Achieved FLOP/s of a large square matmul: the denominator where no datasheet applies."""
    import torch

    n = 2048 if device.type == "cpu" else 8192
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    reps = 3 if device.type == "cpu" else 20
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 2.0 * n ** 3 * reps / (time.perf_counter() - t0)


def peak_flops(device: Any, precision: str) -> tuple[float, str]:
    """(peak FLOP/s, where it comes from) for MFU."""
    import torch

    from dipaco.runtime.device import PRECISIONS
    from dipaco.runtime.hardware import PEAK_FLOPS

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, (low, tf32) in PEAK_FLOPS.items():
            if key in name:
                return (tf32 if precision == "fp32" else low), f"{key} datasheet"
    dtype = PRECISIONS[precision] or torch.float32
    return _gemm_peak(device, dtype), f"measured {dtype} GEMM"


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def warm_runtime(device: Any) -> None:
    """One step of a throwaway model first: thread pools, kernels and autograd's own
    buffers are then outside the measured peak, which is left to the model itself."""
    import torch

    from modules import ModelConfig, ModuleGrid, PathModel

    model = PathModel(ModuleGrid(ModelConfig(vocab_size=64, d_model=32, n_heads=2), [1, 1], device=device), 0)
    x = torch.randint(0, 64, (2, 16), device=device)
    torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    torch.optim.AdamW(model.parameters()).step()


def child(model_name: str, side: str, mode: str, precision: str, compile_: bool) -> dict[str, Any]:
    """One measurement in this (fresh) process: tokens/s and peak memory of ``side``."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from dipaco.config import compose_config
    from dipaco.data import TokenStream
    from dipaco.runtime.device import autocast, peak_memory_bytes, rank_device, reset_peak_memory
    from dipaco.runtime.hardware import flops_per_token
    from dipaco.rounds.learner import PathLearner, make_inner_optimizer
    from dipaco.plan.memory import rank_memory
    from dipaco.plan.schedule import RoundSchedule
    from dipaco.sync.diloco import DiLoCoSync
    from dipaco.sync.round_driver import RoundDriver
    from dipaco.plan.topology import Topology
    from modules import ModuleGrid, PathModel

    device = rank_device("auto").device
    size = SIZES[mode][device.type]
    B, T, H, R = size["batch"], size["seq"], size["H"], size["rounds"]
    cfg = compose_config([f"model={model_name}", f"trainer.batch_size={B}", f"trainer.seq_len={T}",
                          f"trainer.precision={precision}", f"trainer.compile={str(compile_).lower()}", "trainer.warmup_steps=0"])
    t, m = cfg.trainer, cfg.model
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, m.vocab_size, size=int(n)) for n in rng.integers(T, 4 * T, size=200)]
    levels = [1, 1] if side == "bare" else [2, 2]
    outer_device = "cpu" if side == "dipaco_cpu_outer" else cfg.diloco.outer_device
    warm_runtime(device)
    rss0 = rss_now()
    reset_peak_memory(device)
    grid = ModuleGrid(m, levels, seed=0, device=device)
    paths = list(range(grid.num_paths))
    path_params = PathModel(grid, 0).num_parameters()
    steps = H * R
    if side == "bare":
        model = PathModel(grid, 0)
        opt = make_inner_optimizer(model, t)
        fwd = torch.compile(model) if compile_ else model
        stream = TokenStream(docs, seq_len=T, batch_size=B, seed=0, path_id=0, eos_id=0)
        batches = [tuple(v.to(device) for v in stream.next_batch()) for _ in range(4)]

        def run(n: int) -> int:
            for i in range(n):
                x, y = batches[i % len(batches)]
                with autocast(device, precision):
                    logits = fwd(x)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            return n * B * T
    else:
        topo = Topology.from_grid(grid, len(paths), 1)
        driver = RoundDriver(DiLoCoSync(topo, {mid: grid.module(mid) for mid in grid.module_ids},
                                        outer_device=outer_device), RoundSchedule.synchronous(grid.module_ids, H))
        learners = {p: PathLearner(p, PathModel(grid, p), TokenStream(docs, seq_len=T, batch_size=B, seed=0,
                                                                      path_id=p, eos_id=0), t, 10**9)
                    for p in paths}

        def run(n: int) -> int:
            tokens = 0
            for r in range(max(1, n // H)):
                driver.begin_round(r)
                for p in paths:
                    driver.activate(p)
                    stats = learners[p].train_steps(H)
                    driver.contribute(p, H, stats.tokens, lambda p, tokens: float(tokens))
                    tokens += stats.steps * B * T
                driver.sync_point(H)
                driver.end_round()
            return tokens

    run(2 if side == "bare" else H)  # warm-up: allocator, kernels, compilation
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    tokens = run(steps)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = peak_memory_bytes(device) - (rss0 if device.type == "cpu" else 0)
    held = sum(grid.param_count(mid) for mid in grid.module_ids)
    on_device = side != "bare" and device.type == "cuda" and outer_device == "auto"
    plan = rank_memory(m, len(levels), held, [path_params] * len(paths), sequences=B, seq_len=T,
                       low_precision=precision != "fp32", outer_on_device=on_device)
    planned = plan.total if device.type == "cpu" else plan.device  # CPU: outer state in the same RSS
    flops = flops_per_token(path_params, len(levels) * m.layers_per_level, m.d_model, T)
    peak_fl, peak_src = peak_flops(device, precision)
    tps = tokens / seconds
    return {"model": model_name, "side": side, "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "precision": precision, "compile": compile_, "path_parameters": path_params,
            "batch": B, "seq_len": T, "tokens": tokens, "seconds": seconds, "tokens_per_s": tps,
            "mfu": tps * flops / peak_fl, "peak_flops": peak_fl, "peak_flops_source": peak_src,
            "peak_memory_bytes": peak, "planned_memory_bytes": planned,
            "measured_over_planned": peak / planned if planned else None}


def _in_child(model: str, side: str, mode: str, precision: str, compile_: bool) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.bench_gpu", "--child", model, side, precision,
           "1" if compile_ else "0", f"--{mode}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=Path(__file__).resolve().parents[1])
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    ap = base_parser(__doc__ or "")
    ap.add_argument("--tiny", dest="mode", action="store_const", const="tiny", help="seconds: wiring check only")
    ap.add_argument("--precision", default=None, help="fp32 | bf16 | fp16 (default: bf16 on CUDA, fp32 on CPU)")
    ap.add_argument("--compile", default=None, choices=["on", "off"], help="default: on for CUDA, off for CPU")
    ap.add_argument("--models", default=None,
                    help="comma-separated model presets instead of the mode's (e.g. paper)")
    ap.add_argument("--compare-outer", action="store_true",
                    help="also time the DiPaCo loop with the outer state on the CPU (diloco.outer_device=cpu)")
    ap.add_argument("--child", nargs=4, default=None, help=argparse.SUPPRESS)  # one measuring process
    args = ap.parse_args(argv)
    if args.child:
        model, side, precision, comp = args.child
        print(dumps_strict(child(model, side, args.mode, precision, comp == "1")))
        return {}
    import torch

    argv = list(sys.argv[1:] if argv is None else argv)
    cuda = torch.cuda.is_available()
    precision = args.precision or ("bf16" if cuda else "fp32")
    compile_ = (args.compile or ("on" if cuda else "off")) == "on"
    load0 = load_average()
    rows = []
    models = args.models.split(",") if args.models else SIZES[args.mode]["cuda" if cuda else "cpu"]["models"]
    for model in models:
        for side in ("bare", "dipaco") + (("dipaco_cpu_outer",) if args.compare_outer else ()):
            rows.append(_in_child(model, side, args.mode, precision, compile_))
    for model in {r["model"] for r in rows}:
        bare = next(r for r in rows if r["model"] == model and r["side"] == "bare")
        for r in rows:
            if r["model"] == model and r["side"] != "bare":
                r["vs_bare"] = r["tokens_per_s"] / bare["tokens_per_s"]
    device = rows[0]["device_name"]
    table = [{**r, "peak_MiB": r["peak_memory_bytes"] / 2**20, "planned_MiB": r["planned_memory_bytes"] / 2**20}
             for r in rows]
    print_table(table, ["model", "side", "path_parameters", "tokens_per_s", "mfu", "vs_bare", "peak_MiB",
                        "planned_MiB", "measured_over_planned"],
                title=f"bench_gpu ({args.mode}) on {device}: precision={precision} compile={compile_}, "
                      f"MFU vs {rows[0]['peak_flops_source']} ({rows[0]['peak_flops'] / 1e12:.1f} TFLOP/s)")
    payload = {"device": device, "precision": precision, "compile": compile_, "rows": rows}
    write_result("gpu", payload, mode=args.mode, load_before=load0, out=args.out, argv=argv)
    return payload


if __name__ == "__main__":
    main()
