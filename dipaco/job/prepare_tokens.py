"""The data half of preparing a run: corpus → tokenizer → token ids of each split, on disk.

Text sources are loaded into a text store (:func:`dipaco.data.load_corpus`, streamed, in
bounded memory), the tokenizer is trained on a bounded sample spread over the training
split (``data.tokenizer_sample_bytes`` / ``_documents``) or given (``data.tokenizer``),
and each split is tokenized on every core into the token cache. Pre-tokenized input
(``data=tokens``) skips the tokenizer pass: its ids are copied into the same cache.
Either way what comes out is memory-mapped token ids (:class:`router.TokenDocs`).
"""
from __future__ import annotations

import math
import resource
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from dipaco.config import Config, ConfigError, require
from dipaco.data import DataError, Tokenizer, dataset_content_hash, load_corpus, tokenize_to_docs
from dipaco.data.pretokenized import load_token_corpus
from dipaco.data.tokenizer import tokenizer_beside
from dipaco.job.token_record import describe_split, evaluated_rows, reuse_splits
from dipaco.run.fingerprint import Fingerprints
from dipaco.runtime.hardware import release_free_memory
from dipaco.runtime.progress import bars_enabled
from dipaco.run.run_dir import RunDir, RunDirError
from router import TokenDocs

__all__ = ["TokenSplits", "evaluated_rows", "peak_rss_mib", "prepare_tokens", "split_tokens"]


@dataclass
class TokenSplits:
    """What the data half produced: the tokenizer and each split's token ids (memory-mapped)."""

    tokenizer: Tokenizer
    train_ids: TokenDocs
    val_ids: TokenDocs  # the evaluated validation documents (trainer.eval_max_documents)
    val_labels: list  # their labels (None: unlabelled)
    eval_ids: TokenDocs  # what the final evaluation scores: trainer.eval_split
    train_labels: Optional[np.ndarray]  # int label code of each training document; None: unlabelled data
    data_fp: str
    timings: dict = field(default_factory=dict)
    # what fingerprints.json's token record should say (dipaco/job/token_record.py); the
    # caller saves it once preparation has accepted everything
    record: dict = field(default_factory=dict)


def peak_rss_mib() -> float:
    """This process's peak resident set size so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _stage(timings: dict, name: str, t0: float) -> None:
    """Record a stage's seconds and the peak RSS so far (``timings``, ``summary.json``),
    and release what the stage freed."""
    timings[f"{name}_s"] = time.perf_counter() - t0
    timings.setdefault("peak_rss_mib", {})[name] = round(peak_rss_mib(), 1)
    release_free_memory()


def prepare_tokens(cfg: Config, run: RunDir, fps: Fingerprints, log: Callable[[str], None]) -> TokenSplits:
    """Load, tokenize (or, pre-tokenized, copy) every split the run needs; see the module docstring."""
    t, d = cfg.trainer, cfg.data
    cache_dir = d.cache_dir or str(run.cache)
    timings: dict = {}
    t0 = time.perf_counter()
    reused = reuse_splits(cfg, run, fps, cache_dir, log)  # a resume: what the run recorded, no corpus
    if reused is not None:
        seconds = reused.pop("seconds")
        _stage(timings, "load", t0)
        timings.update(tokenizer_s=0.0, tokenize_s=seconds)
        return TokenSplits(**reused, timings=timings)  # the record stands as it is
    if d.source == "tokens":
        corpus: Any = load_token_corpus(d, progress=bars_enabled(t.progress), work_dir=cache_dir)
    else:
        corpus = load_corpus(d, progress=bars_enabled(t.progress), work_dir=cache_dir)
    try:
        if corpus.skipped:
            log(f"skipped documents: {dict(corpus.skipped)}")
        num_train_whole = len(corpus.split("train", whole=True))
        _require_documents_per_path(cfg, num_train_whole)
        train_docs, val_docs = corpus.split("train"), corpus.split("validation")
        _require_splits(cfg, corpus.num_documents, len(train_docs), len(val_docs))
        own = f"; own splits: {', '.join(corpus.own_splits)}" if corpus.own_splits else ""
        sample = "" if corpus.max_train_documents is None else \
            f" of {num_train_whole} (data.max_train_documents={corpus.max_train_documents})"
        _stage(timings, "load", t0)
        log(f"corpus: {corpus.num_documents} documents ({len(train_docs)} train{sample}, "
            f"{len(val_docs)} validation{own})")

        t0 = time.perf_counter()
        hashes = {"train": dataset_content_hash(train_docs), "validation": dataset_content_hash(val_docs)}
        data_fp = hashes["train"] + ":" + hashes["validation"]
        tokenizer = _tokenizer(cfg, run, corpus, fps, data_fp)
        _stage(timings, "tokenizer", t0)
        t1 = time.perf_counter()
        ids = {s: split_tokens(corpus, s, tokenizer, cache_dir, t.progress, hashes.get(s))
               for s in ("train", "validation")}
        rows = evaluated_rows(len(ids["validation"]), t.eval_max_documents)
        val_labels = val_docs.select(rows).column("label")
        eval_ids = ids["validation"].select(rows)
        if t.eval_split != "validation":
            require(len(corpus.split(t.eval_split)) > 0, "trainer.eval_split", f"the {t.eval_split} split is empty",
                    "raise data.test_fraction or data.max_documents")
            hashes[t.eval_split] = dataset_content_hash(corpus.split(t.eval_split))
            ids[t.eval_split] = split_tokens(corpus, t.eval_split, tokenizer, cache_dir, t.progress,
                                             hashes[t.eval_split])
            eval_ids = ids[t.eval_split].select(evaluated_rows(len(ids[t.eval_split]), t.eval_max_documents))
        labelled = any(lab is not None for lab in val_labels)
        train_labels = train_docs.label_codes() if labelled else None
        _stage(timings, "tokenize", t1)
        timings["tokenize_s"] += timings["tokenizer_s"]  # as before: the tokenizer is part of tokenizing
    finally:
        corpus.close()
    log(f"tokens: {ids['train'].num_tokens:,} train, vocabulary {tokenizer.vocab_size}")
    record = {"data": data_fp, "tokenizer": tokenizer.sha256, "label_field": d.label_field,
              "splits": {s: describe_split(cache_dir, hashes[s], tokenizer, docs) for s, docs in ids.items()}}
    return TokenSplits(tokenizer=tokenizer, train_ids=ids["train"], val_ids=ids["validation"].select(rows),
                       val_labels=val_labels, eval_ids=eval_ids, train_labels=train_labels, data_fp=data_fp,
                       timings=timings, record=record)


def split_tokens(corpus: Any, split: str, tokenizer: Tokenizer, cache_dir: str, progress: bool,
                 content: Optional[str] = None) -> TokenDocs:
    """The token ids of one split of ``corpus`` (text: tokenized; pre-tokenized: copied),
    in the token cache under ``cache_dir``."""
    if getattr(corpus, "pretokenized", False):
        return corpus.split_tokens(split, cache_dir, tokenizer, progress=progress)
    return tokenize_to_docs(corpus.split(split), tokenizer, cache_dir=cache_dir, progress=progress, content=content)


def _tokenizer(cfg: Config, run: RunDir, corpus: Any, fps: Fingerprints, data_fp: str) -> Tokenizer:
    """The run's tokenizer: reused when its fingerprint matches (resume), else
    ``data.tokenizer`` (for pre-tokenized input also the ``tokenizer.json`` beside the
    token files), else a byte-level BPE trained on a sample spread over the whole training
    split (not the ``data.max_train_documents`` sample: the runs of a paths sweep share
    their tokenizer)."""
    d = cfg.data
    path = d.tokenizer or (tokenizer_beside(d) if d.source == "tokens" else None)
    given = Tokenizer.load(path) if path else None
    if given is None and getattr(corpus, "pretokenized", False):
        raise DataError(f"data.source=tokens: no tokenizer for the token ids in {d.path}. Fix: put the "
                        f"tokenizer.json they were made with beside them, or pass data.tokenizer=PATH")
    for key in ("tokenizer_sample_bytes", "tokenizer_sample_documents"):
        value = getattr(d, key)
        require(value is None or int(value) > 0, f"data.{key}", f"must be positive or null, got {value}",
                f"e.g. data.{key}=null (no limit)")
    whole = corpus.split("train", whole=True)
    sample = whole if given is not None else whole.spread(d.tokenizer_sample_bytes, d.tokenizer_sample_documents)
    # A given tokenizer, and the text the BPE is trained on, are part of what the run's
    # tokenizer is made from. When that text is the training split data_fp already covers
    # it and the key is left out, so older runs' fingerprints still match.
    if sample is not whole:
        extra = {"bpe_text": "sample:" + dataset_content_hash(sample)}
    elif corpus.max_train_documents is not None:
        extra = {"bpe_text": dataset_content_hash(whole)}
    else:
        extra = {}
    want = fps.want("tokenizer", data=data_fp, given=given.sha256 if given is not None else None, **extra)
    if fps.reusable("tokenizer", want, run.tokenizer.exists(), "tokenizer.json"):
        tokenizer = Tokenizer.load(run.tokenizer)
        if given is not None and given.sha256 != tokenizer.sha256:
            raise RunDirError(f"{run.tokenizer} differs from data.tokenizer={path}; a run keeps "
                              "its tokenizer. Fix: drop data.tokenizer or use a new run directory")
    else:
        tokenizer = given if given is not None else Tokenizer.train(
            (text for batch in sample.iter_texts() for text in batch), vocab_size=cfg.model.vocab_size)
        tokenizer.save(run.tokenizer)
        fps.record("tokenizer", want)
    if tokenizer.vocab_size > cfg.model.vocab_size:  # data.tokenizer is checked earlier, in validate_config
        raise ConfigError("model.vocab_size", f"{cfg.model.vocab_size} cannot hold the {tokenizer.vocab_size} "
                          f"token ids of {run.tokenizer}", f"set model.vocab_size={tokenizer.vocab_size}")
    return tokenizer


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
