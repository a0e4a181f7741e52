"""The batched routed engine on one device against batch-1 generation and Hugging Face
``transformers`` on the same device (run by hand on a GPU host; docs/gpu.md quotes it).

    python -m benchmarks.engine_on_device RUN_DIR [--device cuda] [--prompts 256] [--new-tokens 64] [--out F]

Prompts: the first 32 tokens of the run's evaluated documents (``validation_ids``), cycled
to ``--prompts``; greedy, ``--new-tokens`` each (end-of-text ignored, so every side makes
the same number of tokens). Sides, each timed after a warm-up with the device synchronised:

* ``batch1``: :func:`dipaco.inference.generate_routed` on the first 16 prompts, one at a time;
* ``engine_b32`` / ``engine_b64``: :class:`RoutedEngine` (row-exact, every path loaded) on
  all prompts, and whether its first 16 answers equal ``batch1``'s token for token;
* ``engine_fast_b32``: the same with ``exact=False`` (one matrix product per layer);
* ``hf_b32``: ``LlamaForCausalLM.generate`` on each prompt's path of the routed export
  (``export_routed_hf``), batches of 32 per path with left padding (the loop only).

Not a test and not in ``python -m benchmarks``: it needs a trained run and is meant for a
lent accelerator. Writes JSON to ``--out`` (default: stdout only).
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from typing import Any, Optional, Sequence

import torch
from dipaco.storage.strict_json import dumps_strict
from benchmarks.common import write_output


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Measure every side; print and return the figures."""
    from dipaco.inference import InferenceRun, generate_routed
    from dipaco.inference.engine import Request, RoutedEngine
    from dipaco.inference.routed_hf import export_routed_hf, path_dir_name
    from dipaco.job.prepare import validation_ids

    ap = argparse.ArgumentParser(prog="python -m benchmarks.engine_on_device")
    ap.add_argument("run_dir")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    dev, n_new = a.device, a.new_tokens
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu"}
    run = InferenceRun.open(a.run_dir, device=dev)
    docs = [list(map(int, d[:32])) for d in validation_ids(run.cfg, run.run) if len(d) >= 8]
    step = max(1, len(docs) // a.prompts)
    prompts = [docs[(i * step) % len(docs)] for i in range(a.prompts)]

    loader = run.loader()
    t = time.perf_counter()
    ref = [generate_routed(run, p, max_new_tokens=n_new, loader=loader, stop_at_eos=False) for p in prompts[:16]]
    _sync(dev)
    res["batch1_tokens_s"] = sum(len(g.tokens) for g in ref) / (time.perf_counter() - t)
    for name, bs, exact in (("engine_b32", 32, True), ("engine_b64", 64, True), ("engine_fast_b32", 32, False)):
        eng = RoutedEngine(run, max_batch_size=bs, max_loaded_paths=run.num_paths, exact=exact)
        eng.generate([Request(p, max_new_tokens=4) for p in prompts[:bs]])  # warm-up
        _sync(dev)
        t = time.perf_counter()
        gens = eng.generate([Request(p, max_new_tokens=n_new, stop_at_eos=False) for p in prompts])
        _sync(dev)
        dt = time.perf_counter() - t
        res[f"{name}_tokens_s"] = sum(len(g.tokens) for g in gens) / dt
        res[f"{name}_prompts_s"] = len(prompts) / dt
        res[f"{name}_equal_batch1_first16"] = sum(g.tokens == r.tokens for g, r in zip(gens, ref))
    print(dumps_strict(res), flush=True)

    from transformers import LlamaForCausalLM

    paths = [int(p) for p in run.router.route_batch(prompts)]
    total, spent = 0, 0.0
    with tempfile.TemporaryDirectory() as tmp:
        exp = export_routed_hf(run, f"{tmp}/routed")
        for pid in sorted(set(paths)):
            model = LlamaForCausalLM.from_pretrained(str(exp / path_dir_name(pid))).to(dev).eval()
            rows = [p for p, q in zip(prompts, paths) if q == pid]
            model.generate(torch.tensor([rows[0]], device=dev), max_new_tokens=4, do_sample=False)  # warm-up
            for i in range(0, len(rows), 32):
                chunk = rows[i:i + 32]
                width = max(map(len, chunk))
                ids = torch.tensor([[0] * (width - len(r)) + r for r in chunk], device=dev)
                mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in chunk], device=dev)
                _sync(dev)
                t = time.perf_counter()
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n_new,
                                     min_new_tokens=n_new, do_sample=False, pad_token_id=0)
                _sync(dev)
                spent += time.perf_counter() - t
                total += (out.shape[1] - width) * len(chunk)
    res["hf_b32_tokens_s_loop_only"] = total / spent
    print(dumps_strict(res), flush=True)
    if a.out:
        write_output(a.out, dumps_strict(res, indent=1))
    return res


if __name__ == "__main__":
    main()
