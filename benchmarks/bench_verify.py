"""What verifying every read costs (docs/reliability.md, rule 1).

    python -m benchmarks.bench_verify [--gb 1.0] [--levels 16 16] [--d-model 256] [--out F]

Two measurements, each against the same work without the check:

* **A 1 GB token cache**: writing it (the sha256 is taken as the bytes are written) and
  opening it, which hashes ``tokens.bin`` against ``tokens.sha256`` once per process.
* **A 256-path grid** ([16, 16] by default, the paper's): a checkpoint of its module
  files; hashing them all when a run is opened (``dipaco-infer``'s default), and loading
  every path through :class:`dipaco.storage.held.HeldFiles` (what a server or a
  ``generate --file`` job does: each file held, hashed at its first read and when it
  changed), against loading every path without any check.

The model is the default's width with one block per level, so a path's files are those of
a small model; the cost scales with bytes, which the output gives.
"""
from __future__ import annotations

import argparse
import io
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import load_average, write_result
from dipaco.run.checkpoint import CheckpointManager, load_state, save_state
from dipaco.storage.held import HeldFiles
from modules import ModuleGrid
from modules.config import ModelConfig
from router.tokens import TokenDocsWriter, open_token_docs


def token_cache(folder: Path, gb: float) -> dict:
    """Write and open a token cache of ``gb`` GiB, with and without its check."""
    import router.tokens as rt

    n, doc = int(gb * 2**30) // 4, 2048
    block = np.random.default_rng(0).integers(0, 32000, size=doc * 256, dtype=np.int32)
    hashless, hashed = [], []
    for i in range(4):  # in turn, each first twice, the least of each: the disk varies more than the hash
        for which in ((0, 1) if i % 2 else (1, 0)):
            if which == 0:
                hashless.append(_time_write(folder, n, block, doc))
                continue
            shutil.rmtree(folder / "tokens", ignore_errors=True)
            t0 = time.perf_counter()
            w = TokenDocsWriter(folder / "tokens")
            _fill(w, n, block, doc)
            w._file.close()
            hashed.append(time.perf_counter() - t0)
            w._file = io.BytesIO()  # closed by close(), which publishes the directory
            w.close()
    t_write, t_write_hashless = min(hashed), min(hashless)
    rt._CHECKED.clear()  # as a new process: nothing hashed yet
    t0 = time.perf_counter()
    open_token_docs(folder / "tokens")
    t_open = time.perf_counter() - t0
    (folder / "tokens" / rt.CHECKSUM_FILE).unlink()
    rt._CHECKED.clear()
    t0 = time.perf_counter()
    open_token_docs(folder / "tokens", require_checksum=False)
    t_open_plain = time.perf_counter() - t0
    return {"bytes": n * 4, "write_s": t_write, "write_without_hash_s": t_write_hashless,
            "open_checked_s": t_open, "open_unchecked_s": t_open_plain}


class _NoHash:
    def update(self, _b: bytes) -> None:
        pass

    def hexdigest(self) -> str:
        return "0" * 64


def _fill(w: TokenDocsWriter, n: int, block: np.ndarray, doc: int) -> None:
    written = 0
    while written < n:
        take = min(block.size, n - written)
        w.append_flat(block[:take], np.full(take // doc, doc, np.int64) if take % doc == 0 else
                      np.array([take], np.int64))
        written += take


def _time_write(folder: Path, n: int, block: np.ndarray, doc: int) -> float:
    w = TokenDocsWriter(folder / "plain")
    w._hash = _NoHash()
    t0 = time.perf_counter()
    _fill(w, n, block, doc)
    w._file.close()
    took = time.perf_counter() - t0
    w.abort()
    return took


def grid_checkpoint(folder: Path, levels: list[int], d_model: int) -> dict:
    """A checkpoint of every module of the grid; its verification at open and per path read."""
    cfg = ModelConfig(vocab_size=4096, d_model=d_model, n_heads=max(1, d_model // 64), layers_per_level=1,
                      max_seq_len=128)
    grid = ModuleGrid(cfg, levels, seed=0)
    mgr = CheckpointManager(folder / "checkpoints")
    part = mgr.begin(1)
    for mid in grid.module_ids:
        save_state(part / "modules" / f"{mid}.safetensors", grid.module(mid).state_dict())
    ckpt = mgr.commit(1, {"round": 1})
    manifest = mgr.verify(ckpt)
    size = sum(int(v["bytes"]) for v in manifest["files"].values())
    t0 = time.perf_counter()
    mgr.verify(ckpt)
    t_open = time.perf_counter() - t0
    paths = grid.num_paths
    t0 = time.perf_counter()
    for p in range(paths):
        for mid in grid.module_ids_of_path(p):
            load_state(ckpt / "modules" / f"{mid}.safetensors")
    t_plain = time.perf_counter() - t0
    held = HeldFiles(ckpt, manifest["files"], "modules/")
    t0 = time.perf_counter()
    for p in range(paths):
        for mid in grid.module_ids_of_path(p):
            held.load_state(f"modules/{mid}.safetensors")
    t_checked = time.perf_counter() - t0
    held.close()
    return {"levels": levels, "paths": paths, "modules": len(grid.module_ids), "checkpoint_bytes": size,
            "verify_at_open_s": t_open, "load_every_path_unchecked_s": t_plain,
            "load_every_path_checked_s": t_checked}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0, help="token cache size in GiB")
    ap.add_argument("--levels", type=int, nargs="+", default=[16, 16])
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--out", default=None, help="result JSON (default benchmarks/results/verify.json)")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    load_before = load_average()
    folder = Path(tempfile.mkdtemp(prefix="bench-verify-"))
    try:
        tokens = token_cache(folder, args.gb)
        print("token cache:", tokens)
        grid = grid_checkpoint(folder, args.levels, args.d_model)
        print("grid:", grid)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    result = {"token_cache": tokens, "grid": grid}
    write_result("verify", result, mode="default", load_before=load_before, out=args.out)
    return result


if __name__ == "__main__":
    main()
