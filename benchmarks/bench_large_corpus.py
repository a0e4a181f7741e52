"""Large corpus: route and train from memory-mapped token shards; peak RSS vs corpus size.

    python -m benchmarks.bench_large_corpus --full          # a 2 GB synthetic corpus
    python -m benchmarks.bench_large_corpus --quick         # 0.1 GB (the suite's budget)
    python -m benchmarks.bench_large_corpus --gb 4 --tmp /scratch

One process does what ``dipaco-train`` does with a corpus, on synthetic tokens:

1. **generate**: documents of topic-dependent token bands (so routing has structure),
   written in chunks as a token directory (``router.tokens``: int32 memmap + offsets)
   under ``--tmp``; the corpus never exists in memory;
2. **fit**: the router ([4,4] grid, product k-means) on an evenly spaced sample of
   ``--fit-docs`` document prefixes, copied into memory (``dipaco.job.prepare`` caps its
   fit the same way);
3. **route**: every document, in batches (``router.assign_in_batches``);
4. **shard**: ``router.write_shards`` copies the routed rows, batch by batch;
5. **train**: ``load_shard`` (memory-mapped) → ``TokenStream`` → a few AdamW steps of a
   tiny path model.

After each phase it records ``ru_maxrss`` (the process's peak RSS so far). The claim
tested: peak RSS stays flat as the corpus grows — well under the corpus size — because
documents are read by offset and the pages a pass touched are unmapped after each batch.
Everything under ``--tmp`` is deleted at the end (also on failure).
"""
from __future__ import annotations

import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from benchmarks.common import base_parser, load_average, print_table, write_result

SIZES: dict[str, dict[str, Any]] = {
    # the same fit sample in both modes: the fit is a fixed cost, only the corpus grows
    "quick": {"gb": 0.1, "fit_docs": 10_000, "steps": 3},
    "full": {"gb": 2.0, "fit_docs": 10_000, "steps": 3},
}
VOCAB, TOPICS, BAND = 8_192, 16, 1_024
MEAN_DOC_TOKENS = 1_024
CHUNK_TOKENS = 4 * 2**20  # tokens generated per chunk: 16 MiB of int32


def peak_rss_mib() -> float:
    """The process's peak resident set size so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def generate(directory: Path, target_bytes: int, seed: int) -> Any:
    """Synthetic documents, written chunk by chunk: each draws its tokens mostly from its
    topic's band of the vocabulary (and some from the whole vocabulary)."""
    from router import TokenDocsWriter

    rng = np.random.default_rng(seed)
    writer = TokenDocsWriter(directory)
    written = 0
    while written < target_bytes:
        n_tokens = min(CHUNK_TOKENS, (target_bytes - written) // 4 + 1)
        lengths = rng.integers(MEAN_DOC_TOKENS // 2, 3 * MEAN_DOC_TOKENS // 2, size=n_tokens // MEAN_DOC_TOKENS + 1)
        total = int(lengths.sum())
        topic = np.repeat(rng.integers(0, TOPICS, size=lengths.size), lengths)
        in_band = rng.random(total) < 0.8
        tokens = np.where(in_band, topic * (VOCAB - BAND) // TOPICS + rng.integers(0, BAND, size=total),
                          rng.integers(0, VOCAB, size=total))
        writer.append_flat(tokens.astype(np.int32), lengths)
        written += 4 * total
    return writer.close()


def run(gb: float, fit_docs: int, steps: int, tmp: Optional[str], seed: int = 0) -> dict[str, Any]:
    import torch

    from dipaco.data import TokenStream
    from dipaco.rounds.learner import lm_loss
    from modules import ModelConfig, ModuleGrid, PathModel
    from router import Router, TokenTfidfFeaturizer, assign_in_batches, load_shard, write_shards

    torch.manual_seed(seed)
    phases: list[dict[str, Any]] = [{"phase": "imports", "seconds": 0.0, "peak_rss_mib": peak_rss_mib()}]

    def done(name: str, t0: float, **extra: Any) -> None:
        phases.append({"phase": name, "seconds": time.perf_counter() - t0, "peak_rss_mib": peak_rss_mib(), **extra})
        print(f"  {name}: {phases[-1]['seconds']:.1f} s, peak RSS {phases[-1]['peak_rss_mib']:.0f} MiB", flush=True)

    root = Path(tempfile.mkdtemp(prefix="dipaco-large-corpus-", dir=tmp))
    try:
        t0 = time.perf_counter()
        corpus = generate(root / "corpus", int(gb * 2**30), seed)
        corpus_bytes = (root / "corpus" / "tokens.bin").stat().st_size
        done("generate", t0, documents=len(corpus), tokens=corpus.num_tokens)

        t0 = time.perf_counter()
        prefixes = corpus.prefixes(32)
        sample = prefixes.select(np.linspace(0, len(corpus) - 1, min(fit_docs, len(corpus))).astype(np.int64))
        sample = sample.in_memory()  # as dipaco.job.prepare does: fit_docs x 32 tokens
        router = Router.fit(sample, [4, 4], prefix_tokens=32, method="product", seed=seed,
                            featurizer=TokenTfidfFeaturizer(dim=64, seed=seed, progress=False))
        done("fit router", t0, documents=len(sample))

        t0 = time.perf_counter()
        assignments = assign_in_batches(router, corpus)
        done("route", t0, documents=len(assignments))

        t0 = time.perf_counter()
        manifest = write_shards(corpus, assignments, router.num_paths, root / "shards")
        del assignments
        done("write shards", t0, documents=manifest["num_rows"])

        t0 = time.perf_counter()
        shard = load_shard(root / "shards", 0)
        cfg = ModelConfig(vocab_size=VOCAB, d_model=32, n_heads=2, layers_per_level=1, max_seq_len=128)
        model = PathModel(ModuleGrid(cfg, [1, 1], seed=seed), 0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        stream = TokenStream(shard, seq_len=128, batch_size=8, seed=seed, path_id=0, eos_id=VOCAB - 1)
        losses = []
        for _ in range(steps):
            x, y = stream.next_batch()
            loss = lm_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        done("train path 0", t0, documents=len(shard), losses=losses)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    peak = max(p["peak_rss_mib"] for p in phases)
    return {"corpus_bytes": corpus_bytes, "corpus_mib": corpus_bytes / 2**20, "documents": len(corpus),
            "tokens": corpus.num_tokens, "shard_sizes": manifest["documents_per_path"], "phases": phases,
            "peak_rss_mib": peak, "peak_rss_vs_corpus": peak / (corpus_bytes / 2**20)}


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    ap = base_parser(__doc__ or "")
    ap.add_argument("--gb", type=float, default=None, help="corpus size in GiB (quick 0.1, full 2)")
    ap.add_argument("--fit-docs", type=int, default=None, help="documents the router is fitted on")
    ap.add_argument("--steps", type=int, default=None, help="training steps of path 0")
    ap.add_argument("--tmp", default=None, help="where the corpus and shards go (deleted after; default: $TMPDIR)")
    args = ap.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    size = SIZES[args.mode]
    load0 = load_average()
    gb = size["gb"] if args.gb is None else args.gb
    print(f"large corpus ({args.mode}): {gb} GiB synthetic tokens, grid [4,4]", flush=True)
    result = run(gb, args.fit_docs or size["fit_docs"], args.steps or size["steps"], args.tmp)
    print_table(result["phases"], ["phase", "seconds", "peak_rss_mib", "documents"],
                title=f"corpus {result['corpus_mib']:.0f} MiB, {result['documents']:,} documents, "
                      f"{result['tokens']:,} tokens")
    print(f"peak RSS {result['peak_rss_mib']:.0f} MiB = {result['peak_rss_vs_corpus']:.2f} x the corpus size")
    write_result("large_corpus", {"gb": gb, **result}, mode=args.mode, load_before=load0, out=args.out, argv=argv)
    return result


if __name__ == "__main__":
    main()
