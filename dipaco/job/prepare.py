"""Everything before ranks exist: corpus → tokenizer → tokens → warm-up → router → shards.

Runs once, in the launching process (faiss must fit before any rank is forked, and
every rank must read the same shards). Each step's output lands in the run directory
and is reused on ``resume=true``, so a resumed run routes exactly as the first did.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch

from dipaco.run.checkpoint import sha256_file, write_json
from dipaco.config import Config, ConfigError, require
from dipaco.data import DataError, Tokenizer, dataset_content_hash, load_corpus, progress_bars, tokenize_to_docs
from dipaco.rounds.dense import WARMUP_STREAM_ID, load_dense_grid, save_dense, train_dense
from dipaco.runtime.device import model_device, to_device
from dipaco.rounds.early_stopping import write_validation_shards
from dipaco.run.fingerprint import Fingerprints
from dipaco.runtime.progress import bars_enabled
from dipaco.run.run_dir import RunDir, RunDirError
from dipaco.config.schedule import warmup_steps
from modules import PathModel
from router import (
    CallableFeaturizer,
    Router,
    TokenDocs,
    TokenTfidfFeaturizer,
    assign_in_batches,
    expand_replicas,
    routing_report,
    write_shards,
)

# The tokenizer is trained on at most this many characters of training text: enough
# for a few-thousand-token BPE, and seconds on 2 cores (a byte-level BPE trains on 10 MB in ~3 s).
TOKENIZER_TRAIN_CHARS = 20_000_000
# The router's featurizer and k-means are fitted on at most this many training documents
# (evenly spaced over the corpus); every document is then routed, in batches. The TF-IDF
# fit holds its documents' prefixes in memory, so an uncapped fit would grow with the
# corpus; faiss already samples at most 256 points per centroid for k-means.
ROUTER_FIT_MAX_DOCUMENTS = 262_144


@dataclass
class Prepared:
    """What the preparation phase produced (all also on disk in the run directory)."""

    tokenizer: Any
    train_ids: TokenDocs  # memory-mapped token ids of the training documents
    val_ids: TokenDocs  # validation documents (routing report, path early stopping)
    val_labels: list[Optional[str]]
    eval_ids: TokenDocs  # what the final evaluation scores: trainer.eval_split
    router: Any
    report: dict
    warmup_steps: int = 0
    train_dataset: Any = None  # the rows write_shards copies when re-sharding (== train_ids)
    train_labels: Optional[list] = None  # known domain of each training document (None: unlabelled data)
    timings: dict[str, float] = field(default_factory=dict)


def _log(msg: str) -> None:
    print(f"[dipaco] {msg}", flush=True)


def lm_featurizer(grid: Any, batch_size: int = 64) -> Callable[[list[np.ndarray]], np.ndarray]:
    """Mean final hidden state of each prefix under the dense model (the paper's features)."""
    model = PathModel(grid, 0).eval()
    device = model_device(model)
    max_len = int(grid.cfg.max_seq_len)
    captured: list[torch.Tensor] = []
    # The head's input is the last hidden state; a hook reads it without a second API.
    model.head.register_forward_hook(lambda _m, inp, _out: captured.append(inp[0].detach()))

    @torch.no_grad()
    def featurize(prefixes: list[np.ndarray]) -> np.ndarray:
        out = []
        for start in range(0, len(prefixes), batch_size):
            # a re-route's context can be longer than the model's positions: its last ones
            chunk = [np.asarray(p)[-max_len:] for p in prefixes[start : start + batch_size]]
            T = max(1, max(len(p) for p in chunk))
            x = torch.zeros(len(chunk), T, dtype=torch.long)
            mask = torch.zeros(len(chunk), T)
            for i, p in enumerate(chunk):
                x[i, : len(p)] = torch.as_tensor(np.asarray(p, dtype=np.int64))
                mask[i, : len(p)] = 1.0
            captured.clear()
            model(to_device(x, device))
            h = captured[0].float().cpu()  # [B, T, C]
            mean = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
            out.append(mean.numpy().astype(np.float32))
        return np.concatenate(out, axis=0)

    return featurize


def evaluated_rows(n: int, max_documents: Optional[int]) -> np.ndarray:
    """Rows of a split's ``n`` documents that the evaluation scores: all of them, or
    ``max_documents`` spread evenly over the split (row ``floor(i * n / max_documents)``).

    Spread, not the first rows: a split is in corpus order, i.e. sorted by domain (or by
    package for python_sources), so its first 400 documents of the multidomain corpus were
    python and C/C++ only. An even spread keeps every domain in proportion and is a
    function of ``n`` alone, so every run and ``dipaco-infer score`` pick the same rows.
    """
    if max_documents is None or n <= int(max_documents):
        return np.arange(n, dtype=np.int64)
    k = int(max_documents)
    return (np.arange(k, dtype=np.int64) * n) // k


def _evaluated(cfg: Config, val_ids: TokenDocs) -> TokenDocs:
    """The documents of the split that the run's evaluation scores (:func:`evaluated_rows`)."""
    return val_ids.select(evaluated_rows(len(val_ids), cfg.trainer.eval_max_documents))


def validation_ids(cfg: Config, run: RunDir, split: Optional[str] = None) -> TokenDocs:
    """A finished run's evaluated documents (``trainer.eval_split``) as token ids, exactly
    as its evaluation saw them (same corpus split, the run's tokenizer and token cache).
    ``split``: the documents its evaluation would have scored on that split instead."""
    run.require(run.tokenizer, "tokenizer")
    corpus = load_corpus(cfg.data, progress=False)
    val_tok = tokenize_to_docs(corpus.split(split or cfg.trainer.eval_split), Tokenizer.load(run.tokenizer),
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
    num_train_whole = len(corpus.split("train", whole=True))
    _require_documents_per_path(cfg, num_train_whole)
    train_ds = corpus.split("train")
    val_ds = corpus.split("validation")
    _require_splits(cfg, corpus.num_documents, len(train_ds), len(val_ds))
    timings["load_s"] = time.perf_counter() - t0
    sample = "" if corpus.max_train_documents is None else \
        f" of {num_train_whole} (data.max_train_documents={corpus.max_train_documents})"
    _log(f"corpus: {corpus.num_documents} documents ({len(train_ds)} train{sample}, {len(val_ds)} validation)")

    t0 = time.perf_counter()
    fps = Fingerprints(run, cfg, _log)
    data_fp = dataset_content_hash(train_ds) + ":" + dataset_content_hash(val_ds)
    tokenizer = _tokenizer(cfg, run, corpus, fps, data_fp)
    cache_dir = cfg.data.cache_dir or str(run.cache)
    # memory-mapped: from here on documents are read by offset, never held in memory
    train_ids = tokenize_to_docs(train_ds, tokenizer, cache_dir=cache_dir, progress=t.progress)
    val_all = tokenize_to_docs(val_ds, tokenizer, cache_dir=cache_dir, progress=t.progress)
    rows = evaluated_rows(len(val_all), t.eval_max_documents)
    val_ids = val_all.select(rows)
    all_labels = val_ds["label"]
    val_labels = [all_labels[i] for i in rows]
    eval_ids = val_ids
    if t.eval_split != "validation":
        eval_ds = corpus.split(t.eval_split)
        require(len(eval_ds) > 0, "trainer.eval_split", f"the {t.eval_split} split is empty",
                "raise data.test_fraction or data.max_documents")
        eval_ids = _evaluated(cfg, tokenize_to_docs(eval_ds, tokenizer, cache_dir=cache_dir, progress=t.progress))
    timings["tokenize_s"] = time.perf_counter() - t0
    _log(f"tokens: {train_ids.num_tokens:,} train, vocabulary {tokenizer.vocab_size}")

    # Dense warm-up: the paper initialises every path from a dense model.
    n_warm = warmup_steps(cfg)
    warm_grid = None
    want_warm = fps.want("warmup", data=data_fp, tokenizer=tokenizer.sha256, steps=n_warm)
    if n_warm > 0:
        t0 = time.perf_counter()
        if fps.reusable("warmup", want_warm, (run.warmup / "modules.safetensors").exists(), "warmup/"):
            warm_grid = load_dense_grid(cfg, run.warmup)
        else:
            _log(f"dense warm-up: {n_warm} steps")
            warm_grid, stats = train_dense(cfg, train_ids, tokenizer.eos_id, steps=n_warm,
                                           stream_id=WARMUP_STREAM_ID, progress_desc="warm-up")
            save_dense(run.warmup, warm_grid, {"steps": n_warm, "loss": stats.loss,
                                                "tokens": stats.tokens, "seconds": stats.seconds})
            fps.record("warmup", want_warm)
        timings["warmup_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    r = cfg.router
    featurizer_fn = lm_featurizer(warm_grid) if r.featurizer == "lm" else None
    want = fps.want("router", data=data_fp, tokenizer=tokenizer.sha256,
                    features=want_warm if r.featurizer == "lm" else r.featurizer)
    if fps.reusable("router", want, (run.router / "manifest.json").exists(), "router/"):
        try:
            router = Router.load(run.router, expected_grid=list(cfg.grid.levels), featurizer_fn=featurizer_fn)
        except ValueError as e:  # another grid, a corrupt array, a missing file: the user's to fix
            raise RunDirError(f"cannot reuse {run.router}: {e}") from None
    else:
        router = _fit_router(cfg, train_ids, featurizer_fn)
        router.save(run.router)
        fps.record("router", want)
    assignments = assign_in_batches(router, train_ids)
    want_shards = shards_fingerprint(fps, run)
    reuse_shards = fps.reusable("shards", want_shards, run.shards.is_dir() and run.routing_report.is_file(),
                                "shards/")
    if not reuse_shards:
        with progress_bars(t.progress):
            write_shards(train_ids, expand_replicas(assignments, cfg.grid.replicas, cfg.seed),
                         router.num_paths * cfg.grid.replicas, run.shards)
    best = router.route_batch(val_ids.prefixes(r.prefix_tokens)) if len(val_ids) else np.zeros(0, dtype=np.int64)
    if t.path_early_stopping:  # each path's own validation shard (cheap and deterministic: rewritten)
        write_validation_shards(run, best, val_ids, router.num_paths)
    labels = val_labels if any(lab is not None for lab in val_labels) else None
    # per-document path lists: shard sizes and imbalance are the training shards' (every
    # membership counts, as the balanced assignment caps them); NMI uses the best path
    train_labels = list(train_ds["label"]) if labels is not None else None
    report = routing_report(assignments, num_paths=router.num_paths, grid=router.grid, labels=train_labels)
    report["validation"] = routing_report(best, num_paths=router.num_paths, labels=labels, grid=router.grid)
    if reuse_shards:  # as written with the shards (a re-shard adds to it)
        report = run.read_json(run.routing_report)
    else:
        write_json(run.routing_report, report)
        fps.record("shards", want_shards)
    want = fps.want("checkpoints", data=data_fp, tokenizer=tokenizer.sha256)
    if not fps.reusable("checkpoints", want, run.checkpoints.is_dir() and any(run.checkpoints.iterdir()),
                        "checkpoints/"):
        fps.record("checkpoints", want)
    timings["route_s"] = time.perf_counter() - t0
    nmi = ""
    if report.get("nmi") is not None:
        levels = " ".join(f"L{lv['level']} {lv['nmi']:.3f}" for lv in report.get("levels", []) if lv["modules"] > 1)
        nmi = f", NMI vs labels {report['nmi']:.3f}" + (f" (per level: {levels})" if levels else "")
    _log(f"routing: shard sizes {report['shard_sizes']}, imbalance {report['imbalance']:.2f}{nmi}")
    return Prepared(tokenizer=tokenizer, train_ids=train_ids, val_ids=val_ids, val_labels=val_labels,
                    eval_ids=eval_ids, router=router, report=report, warmup_steps=n_warm, train_dataset=train_ids,
                    train_labels=train_labels, timings=timings)


def _tokenizer(cfg: Config, run: RunDir, corpus: Any, fps: Fingerprints, data_fp: str) -> Tokenizer:
    """The run's tokenizer: reused when its fingerprint matches (resume), else
    ``data.tokenizer``, else a byte-level BPE trained on the whole training split (not the
    ``data.max_train_documents`` sample: the runs of a paths sweep share their tokenizer)."""
    given = Tokenizer.load(cfg.data.tokenizer) if cfg.data.tokenizer else None
    whole = corpus.split("train", whole=True)
    # A given tokenizer, and the text the BPE is trained on, are part of what the run's
    # tokenizer is made from. Without a sample that text is the training split data_fp
    # already covers; the key is then left out so older runs' fingerprints still match.
    extra = {"bpe_text": dataset_content_hash(whole)} if corpus.max_train_documents is not None else {}
    want = fps.want("tokenizer", data=data_fp, given=given.sha256 if given is not None else None, **extra)
    if fps.reusable("tokenizer", want, run.tokenizer.exists(), "tokenizer.json"):
        tokenizer = Tokenizer.load(run.tokenizer)
        if given is not None and given.sha256 != tokenizer.sha256:
            raise RunDirError(f"{run.tokenizer} differs from data.tokenizer={cfg.data.tokenizer}; a run keeps "
                              "its tokenizer. Fix: drop data.tokenizer or use a new run directory")
    else:
        tokenizer = given if given is not None else Tokenizer.train(
            _capped_texts(whole, TOKENIZER_TRAIN_CHARS), vocab_size=cfg.model.vocab_size)
        tokenizer.save(run.tokenizer)
        fps.record("tokenizer", want)
    if tokenizer.vocab_size > cfg.model.vocab_size:  # data.tokenizer is checked earlier, in validate_config
        raise ConfigError("model.vocab_size", f"{cfg.model.vocab_size} cannot hold the {tokenizer.vocab_size} "
                          f"token ids of {run.tokenizer}", f"set model.vocab_size={tokenizer.vocab_size}")
    return tokenizer


def shards_fingerprint(fps: Fingerprints, run: RunDir) -> dict:
    """What the shards on disk must have been made from: the router as saved (a
    discriminative re-shard rewrites both) and the data the router assigned."""
    return fps.want("shards", router=sha256_file(run.router / "manifest.json"),
                    data=fps.saved.get("router", {}).get("data"))


def _require_documents_per_path(cfg: Config, num_documents: int) -> None:
    """Data scaled with paths is the point of ``data.documents_per_path``: a corpus too
    small for it would silently give every path fewer documents than asked (and skew a
    paths sweep), so it is one line naming the most the corpus allows. ``num_documents``:
    the whole training split, which the sample is drawn from."""
    per_path = cfg.data.documents_per_path
    if per_path is None:
        return
    paths = math.prod(cfg.grid.levels)
    require(num_documents >= per_path * paths, "data.documents_per_path",
            f"{per_path} x {paths} paths asks for {per_path * paths:,} training documents; "
            f"the corpus's training split has {num_documents:,}",
            f"use data.documents_per_path<={num_documents // paths} or a larger corpus (e.g. data=multidomain)")


def _require_splits(cfg: Config, num_documents: int, num_train: int, num_val: int) -> None:
    """Too few documents for the splits is one line naming the minimum, not an IndexError."""
    d = cfg.data
    # splits are by a hash of each document id: about val_fraction of them land in
    # validation, so ~2/val_fraction documents leave at least one there in practice
    minimum = max(3, int(np.ceil(2 / max(d.val_fraction, 1e-9))))
    if num_train == 0 or num_val == 0:
        which = "training" if num_train == 0 else "validation"
        raise DataError(f"{num_documents} usable documents left no {which} document "
                        f"(data.val_fraction={d.val_fraction}, data.test_fraction={d.test_fraction}); "
                        f"use at least {minimum} documents (check data.path / data.max_documents)")


def _fit_router(cfg: Config, train_ids: TokenDocs, featurizer_fn: Optional[Callable]) -> Any:
    r = cfg.router
    n_tokens = r.cluster_tokens or r.prefix_tokens
    docs = train_ids.prefixes(n_tokens)  # views: no document is copied whole
    if len(docs) > ROUTER_FIT_MAX_DOCUMENTS:
        docs = docs.select(np.linspace(0, len(docs) - 1, ROUTER_FIT_MAX_DOCUMENTS).astype(np.int64))
    docs = docs.in_memory()  # at most ROUTER_FIT_MAX_DOCUMENTS x cluster_tokens tokens
    featurizer = None
    if featurizer_fn is not None:
        featurizer = CallableFeaturizer(featurizer_fn, dim=cfg.model.d_model)
    else:
        featurizer = TokenTfidfFeaturizer(dim=r.feature_dim, seed=cfg.seed)
    return Router.fit(docs, list(cfg.grid.levels), prefix_tokens=r.prefix_tokens, cluster_tokens=n_tokens,
                      method=r.method,
                      top_k=r.top_k, capacity_factor=r.capacity_factor, seed=cfg.seed,
                      balance=r.balance, soft_capacity_factor=r.soft_capacity_factor,
                      featurizer=featurizer, niter=r.niter, reroute_context=r.reroute_context,
                      fine_clusters=r.fine_clusters,
                      prompt_classifier=r.prompt_classifier)


def _capped_texts(ds: Any, max_chars: int) -> list[str]:
    """The first documents' texts, up to ``max_chars`` characters, read in batches (the
    text column of a large corpus is never loaded whole)."""
    out, n = [], 0
    for batch in ds.select_columns(["text"]).iter(batch_size=1024):
        for text in batch["text"]:
            if n >= max_chars:
                return out
            out.append(text)
            n += len(text)
    return out
