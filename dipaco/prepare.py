"""Everything before ranks exist: corpus → tokenizer → tokens → warm-up → router → shards.

Runs once, in the launching process (faiss must fit before any rank is forked, and
every rank must read the same shards). Each step's output lands in the run directory
and is reused on ``resume=true``, so a resumed run routes exactly as the first did.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch

from dipaco.checkpoint import write_json
from dipaco.config import Config
from dipaco.data import DataError, Tokenizer, load_corpus, progress_bars, tokenize_dataset
from dipaco.dense import WARMUP_STREAM_ID, dense_grid, load_dense_state, save_dense, train_dense
from dipaco.progress import bars_enabled
from dipaco.run_dir import RunDir, RunDirError
from dipaco.schedule import warmup_steps
from modules import PathModel
from router import (CallableFeaturizer, Router, TokenTfidfFeaturizer, expand_replicas, routing_report,
                    write_shards)

# The tokenizer is trained on at most this many characters of training text: enough
# for a few-thousand-token BPE, and seconds on 2 cores (a byte-level BPE trains on 10 MB in ~3 s).
TOKENIZER_TRAIN_CHARS = 20_000_000


@dataclass
class Prepared:
    """What the preparation phase produced (all also on disk in the run directory)."""

    tokenizer: Any
    train_ids: list[np.ndarray]
    val_ids: list[np.ndarray]
    val_labels: list[Optional[str]]
    router: Any
    report: dict
    warmup_steps: int = 0
    train_dataset: Any = None  # tokenized training rows (HF Dataset), for re-sharding
    timings: dict[str, float] = field(default_factory=dict)


def _log(msg: str) -> None:
    print(f"[dipaco] {msg}", flush=True)


def lm_featurizer(grid: Any, batch_size: int = 64) -> Callable[[list[np.ndarray]], np.ndarray]:
    """Mean final hidden state of each prefix under the dense model (the paper's features)."""
    model = PathModel(grid, 0).eval()
    captured: list[torch.Tensor] = []
    # The head's input is the last hidden state; a hook reads it without a second API.
    model.head.register_forward_hook(lambda _m, inp, _out: captured.append(inp[0].detach()))

    @torch.no_grad()
    def featurize(prefixes: list[np.ndarray]) -> np.ndarray:
        out = []
        for start in range(0, len(prefixes), batch_size):
            chunk = prefixes[start : start + batch_size]
            T = max(1, max(len(p) for p in chunk))
            x = torch.zeros(len(chunk), T, dtype=torch.long)
            mask = torch.zeros(len(chunk), T)
            for i, p in enumerate(chunk):
                x[i, : len(p)] = torch.as_tensor(np.asarray(p, dtype=np.int64))
                mask[i, : len(p)] = 1.0
            captured.clear()
            model(x)
            h = captured[0]  # [B, T, C]
            mean = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
            out.append(mean.numpy().astype(np.float32))
        return np.concatenate(out, axis=0)

    return featurize


def _evaluated(cfg: Config, val_tok: Any) -> list[np.ndarray]:
    """The validation documents the run's evaluation scores (the first eval_max_documents)."""
    ids = [np.asarray(x, dtype=np.int64) for x in val_tok["input_ids"]]
    return ids if cfg.trainer.eval_max_documents is None else ids[: cfg.trainer.eval_max_documents]


def validation_ids(cfg: Config, run: RunDir) -> list[np.ndarray]:
    """A finished run's validation documents as token ids, exactly as its evaluation saw
    them (same corpus split, the run's tokenizer and token cache)."""
    run.require(run.tokenizer, "tokenizer")
    corpus = load_corpus(cfg.data, progress=False)
    val_tok = tokenize_dataset(corpus.split("validation"), Tokenizer.load(run.tokenizer),
                               cache_dir=cfg.data.cache_dir or str(run.cache), progress=False)
    return _evaluated(cfg, val_tok)


def prepare(cfg: Config, run: RunDir) -> Prepared:
    """Run (or, on resume, reload) every step before training."""
    t = cfg.trainer
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    corpus = load_corpus(cfg.data, progress=bars_enabled(t.progress))
    if corpus.skipped:
        _log(f"skipped documents: {dict(corpus.skipped)}")
    train_ds = corpus.split("train")
    val_ds = corpus.split("validation")
    if len(train_ds) == 0:
        raise DataError("no training documents after filtering; check data.path / data.max_documents")
    timings["load_s"] = time.perf_counter() - t0
    _log(f"corpus: {corpus.num_documents} documents ({len(train_ds)} train, {len(val_ds)} validation)")

    t0 = time.perf_counter()
    if run.tokenizer.exists():
        tokenizer = Tokenizer.load(run.tokenizer)
    else:
        tokenizer = Tokenizer.train(_capped_texts(train_ds["text"], TOKENIZER_TRAIN_CHARS),
                                    vocab_size=cfg.model.vocab_size)
        tokenizer.save(run.tokenizer)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} tokens > model.vocab_size {cfg.model.vocab_size}")
    cache_dir = cfg.data.cache_dir or str(run.cache)
    train_tok = tokenize_dataset(train_ds, tokenizer, cache_dir=cache_dir, progress=t.progress)
    val_tok = tokenize_dataset(val_ds, tokenizer, cache_dir=cache_dir, progress=t.progress)
    train_ids = [np.asarray(x, dtype=np.int64) for x in train_tok["input_ids"]]
    val_ids = _evaluated(cfg, val_tok)
    val_labels = list(val_ds["label"])[: len(val_ids)]
    timings["tokenize_s"] = time.perf_counter() - t0
    _log(f"tokens: {sum(len(x) for x in train_ids):,} train, vocabulary {tokenizer.vocab_size}")

    # Dense warm-up: the paper initialises every path from a dense model.
    n_warm = warmup_steps(cfg)
    warm_grid = None
    if n_warm > 0:
        t0 = time.perf_counter()
        if (run.warmup / "modules.safetensors").exists():
            warm_grid = dense_grid(cfg)
            for mid, sd in load_dense_state(run.warmup).items():
                warm_grid.load_module_state_dict(mid, sd)
        else:
            _log(f"dense warm-up: {n_warm} steps")
            warm_grid, stats = train_dense(cfg, train_ids, tokenizer.eos_id, steps=n_warm,
                                           stream_id=WARMUP_STREAM_ID, progress_desc="warm-up")
            save_dense(run.warmup, warm_grid, {"steps": n_warm, "loss": stats.loss,
                                                "tokens": stats.tokens, "seconds": stats.seconds})
        timings["warmup_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    r = cfg.router
    featurizer_fn = lm_featurizer(warm_grid) if r.featurizer == "lm" else None
    if (run.router / "manifest.json").exists():
        try:
            router = Router.load(run.router, expected_grid=list(cfg.grid.levels), featurizer_fn=featurizer_fn)
        except ValueError as e:  # another grid, a corrupt array, a missing file: the user's to fix
            raise RunDirError(f"cannot reuse {run.router}: {e}") from None
    else:
        router = _fit_router(cfg, train_ids, featurizer_fn)
        router.save(run.router)
    assignments = router.assign(train_ids)
    with progress_bars(t.progress):
        write_shards(train_tok, expand_replicas(assignments, cfg.grid.replicas, cfg.seed),
                     router.num_paths * cfg.grid.replicas, run.shards)
    best = router.route_batch(val_ids) if val_ids else np.zeros(0, dtype=np.int64)
    labels = val_labels if any(lab is not None for lab in val_labels) else None
    # per-document path lists: shard sizes and imbalance are the training shards' (every
    # membership counts, as the balanced assignment caps them); NMI uses the best path
    report = routing_report(assignments, num_paths=router.num_paths,
                            labels=list(train_ds["label"]) if labels is not None else None)
    report["validation"] = routing_report(best, num_paths=router.num_paths, labels=labels)
    write_json(run.routing_report, report)
    timings["route_s"] = time.perf_counter() - t0
    nmi = f", NMI vs labels {report['nmi']:.3f}" if report.get("nmi") is not None else ""
    _log(f"routing: shard sizes {report['shard_sizes']}, imbalance {report['imbalance']:.2f}{nmi}")
    return Prepared(tokenizer=tokenizer, train_ids=train_ids, val_ids=val_ids, val_labels=val_labels,
                    router=router, report=report, warmup_steps=n_warm, train_dataset=train_tok,
                    timings=timings)


def _fit_router(cfg: Config, train_ids: list[np.ndarray], featurizer_fn: Optional[Callable]) -> Any:
    r = cfg.router
    featurizer = None
    if featurizer_fn is not None:
        featurizer = CallableFeaturizer(featurizer_fn, dim=cfg.model.d_model)
    else:
        featurizer = TokenTfidfFeaturizer(dim=r.feature_dim, seed=cfg.seed)
    return Router.fit(train_ids, list(cfg.grid.levels), prefix_tokens=r.prefix_tokens, method=r.method,
                      top_k=r.top_k, capacity_factor=r.capacity_factor, seed=cfg.seed,
                      featurizer=featurizer, niter=r.niter)


def _capped_texts(texts: list[str], max_chars: int) -> list[str]:
    out, n = [], 0
    for text in texts:
        if n >= max_chars:
            break
        out.append(text)
        n += len(text)
    return out
