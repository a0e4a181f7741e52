"""Tokenize documents once, on every core, straight into the token store; keep it on disk.

The cache key is (content hash of the documents, tokenizer sha256). The content hash is
computed here from the ``id`` and ``text`` columns (the same number for a corpus's
:class:`~dipaco.data.textstore.Documents` and for an HF dataset of the same rows), not
taken from ``Dataset._fingerprint``: that one is not guaranteed to be the same in the
next process, and the point of the cache is that ``dipaco-route`` and ``dipaco-train``
(different processes) share it.

:func:`tokenize_to_docs`, what training uses, reads the texts in batches, encodes them
on a pool of threads (``tokenizers`` releases the GIL while it encodes, and its batch
encoder is itself parallel unless ``TOKENIZERS_PARALLELISM=false``) and appends each
batch's ids, in order, to a flat token file + offsets (``router.tokens``) under a
temporary name that is renamed into place when complete: a crash mid-write leaves no
entry a later run would trust, and the next write sweeps what it left. Memory is a few
batches whatever the corpus size. :func:`tokenize_dataset` keeps an HF dataset with an
``input_ids`` column (small data).
"""
from __future__ import annotations

import contextlib
import os
import shutil
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import datasets
import numpy as np

from dipaco.data.textstore import Documents
from dipaco.data.tokenizer import Tokenizer
from dipaco.storage.atomic import private_temp_dir, publish
from dipaco.storage.hashing import sha256, short_key
from dipaco.runtime.progress import bars_enabled, progress_bar
from router.tokens import TokenDocs, TokenDocsWriter, TokenFileError, open_token_docs, sweep_stale_writes

# Hits and misses of this process, for tests and logs ("tokenized: cache hit").
CACHE_STATS: Dict[str, int] = {"hits": 0, "misses": 0}

# datasets >= 4 names a variable-length list List; older versions call it Sequence
_ListFeature = getattr(datasets, "List", None) or datasets.Sequence
_TOKEN_FEATURES = {
    "input_ids": _ListFeature(datasets.Value("int32")),
    "num_tokens": datasets.Value("int32"),
}
_CACHE_VERSION = "tok-v1"  # bump when the stored layout changes
_HASH_BATCH = 4096  # rows per hashed group: part of the hash's definition, do not change
# text per encoded batch: large enough to amortise a call, small enough that every thread
# gets work and the batches in flight stay small. tokenizers holds ~80 bytes per token
# while it encodes (strings, offsets, masks): 2 MiB batches took 200 MB more than 128
# KiB ones, at the same speed
_ENCODE_BYTES = 128 * 2**10


def _threads() -> int:
    """Encoding threads: the CPUs this process may use (at most 8)."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not on Linux
        n = os.cpu_count() or 1
    return max(1, min(8, n))


def _hash_values(h: Any, values: Iterable[Any]) -> None:
    for value in values:
        b = ("" if value is None else str(value)).encode("utf-8", "surrogatepass")
        h.update(len(b).to_bytes(8, "little"))  # length prefix: no ambiguous joins
        h.update(b)


def dataset_content_hash(ds: Any) -> str:
    """Hex sha256 over the ``id`` and ``text`` columns (order-sensitive), same in every process.

    ``ds``: corpus :class:`Documents` or an HF dataset; the same rows give the same hash.
    """
    if callable(getattr(ds, "content_hash", None)):  # pre-tokenized documents hash their token ids
        return ds.content_hash()
    h = sha256(_CACHE_VERSION)
    h.update(len(ds).to_bytes(8, "little"))
    if isinstance(ds, Documents):
        for lo in range(0, len(ds), _HASH_BATCH):  # per group of rows: its ids, then its texts
            part = ds.select(np.arange(lo, min(lo + _HASH_BATCH, len(ds))))
            _hash_values(h, part.column("id"))
            for texts in part.iter_texts():
                _hash_values(h, texts)
        return h.hexdigest()
    columns = [c for c in ("id", "text") if c in ds.column_names]
    for batch in ds.select_columns(columns).iter(batch_size=_HASH_BATCH):
        for col in columns:
            _hash_values(h, batch[col])
    return h.hexdigest()


def cache_path(ds: Any, tokenizer: Tokenizer, cache_dir: str, content: Optional[str] = None) -> str:
    """Directory where the tokenized version of ``ds`` under ``tokenizer`` is stored
    (``content``: :func:`dataset_content_hash` of ``ds`` when already known)."""
    content = content or dataset_content_hash(ds)
    key = short_key(f"{content}:{tokenizer.sha256}")
    return os.path.join(cache_dir, f"tokenized-{key}")


def tokenize_dataset(
    ds: Any,
    tokenizer: Tokenizer,
    *,
    cache_dir: Optional[str] = None,
    progress: bool = True,
) -> datasets.Dataset:
    """Return ``ds`` as an HF dataset with ``input_ids`` (list of int32, no eos) and
    ``num_tokens`` added (small data: the table is built in memory; training uses
    :func:`tokenize_to_docs`). With ``cache_dir`` the result is stored there and a later
    call with the same documents and tokenizer loads it (memory-mapped) instead.
    """
    if isinstance(ds, Documents):
        ds = ds.to_hf()
    if "text" not in ds.column_names:
        raise ValueError(f"tokenize_dataset needs a 'text' column, got {ds.column_names}")
    path = cache_path(ds, tokenizer, cache_dir) if cache_dir else None
    if path and os.path.isdir(path):
        try:
            out = datasets.load_from_disk(path)
            CACHE_STATS["hits"] += 1
            return out
        except Exception:  # a damaged entry: rebuild it rather than fail
            shutil.rmtree(path, ignore_errors=True)
    CACHE_STATS["misses"] += 1

    features = ds.features.copy()
    for name in _TOKEN_FEATURES:
        features.pop(name, None)
    features.update(_TOKEN_FEATURES)

    def encode(batch: Dict[str, list]) -> Dict[str, list]:
        ids = tokenizer.encode_batch(["" if t is None else t for t in batch["text"]])
        return {"input_ids": ids, "num_tokens": [len(x) for x in ids]}

    # new_fingerprint: datasets would otherwise try to hash the Rust tokenizer via dill
    fingerprint = short_key(f"{getattr(ds, '_fingerprint', '')}:{tokenizer.sha256}", 16)
    with progress_bars(progress):
        out = ds.map(encode, batched=True, batch_size=256, num_proc=1, features=features,
                     new_fingerprint=fingerprint, keep_in_memory=True, desc="tokenize")
    if path:
        tmp = private_temp_dir(cache_dir, ".tmp-tokenized-")  # type: ignore[arg-type]
        try:
            with progress_bars(progress):
                out.save_to_disk(tmp)
            try:
                publish(tmp, path, durable=False)  # a cache: rebuilt if a crash loses it
            except OSError:  # another process finished first: use its entry
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        out = datasets.load_from_disk(path)
    return out


def tokenize_to_docs(
    ds: Any,
    tokenizer: Tokenizer,
    *,
    cache_dir: Optional[str] = None,
    progress: bool = True,
    batch_size: int = 1024,
    content: Optional[str] = None,
) -> TokenDocs:
    """Token ids of every document of ``ds`` (corpus :class:`Documents` or an HF dataset;
    no eos) as :class:`router.TokenDocs`.

    With ``cache_dir`` they are written once to ``tokens-<key>/`` (same key as
    :func:`cache_path`; ``content``: the documents' content hash when already known) and
    memory-mapped; a later call with the same documents and tokenizer maps that entry. A
    damaged entry is rebuilt (it is a cache: nothing is lost). Without ``cache_dir`` the
    ids are kept in memory. Memory while tokenizing is bounded by a few batches of at most
    ``batch_size`` documents.
    """
    if "text" not in ds.column_names:
        raise ValueError(f"tokenize_to_docs needs a 'text' column, got {ds.column_names}")
    if not cache_dir:
        parts = list(encode_batches(ds, tokenizer, batch_size, progress))
        flat = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.int32)
        lengths = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, np.int64)
        return TokenDocs.from_offsets(flat, np.concatenate([[0], np.cumsum(lengths)]))
    path = cache_path(ds, tokenizer, cache_dir, content).replace("tokenized-", "tokens-")
    if os.path.isdir(path):
        try:
            out = open_token_docs(path)
            CACHE_STATS["hits"] += 1
            return out
        except TokenFileError:  # a damaged entry: rebuild it rather than fail
            shutil.rmtree(path, ignore_errors=True)
    CACHE_STATS["misses"] += 1
    os.makedirs(cache_dir, exist_ok=True)
    sweep_stale_writes(cache_dir)
    writer = TokenDocsWriter(path)
    try:
        for flat, lengths in encode_batches(ds, tokenizer, batch_size, progress):
            writer.append_flat(flat, lengths)
    except BaseException:
        writer.abort()
        raise
    return writer.close()


def _text_batches(ds: Any, batch_size: int) -> Iterator[List[str]]:
    if isinstance(ds, Documents):
        yield from ds.iter_texts(max_docs=batch_size, max_bytes=_ENCODE_BYTES)
        return
    for batch in ds.select_columns(["text"]).iter(batch_size=batch_size):
        yield ["" if t is None else t for t in batch["text"]]


def encode_batches(ds: Any, tokenizer: Tokenizer, batch_size: int = 1024, progress: bool = False,
                   threads: Optional[int] = None) -> Iterator[Tuple[np.ndarray, np.ndarray]]:
    """``(flat int32 ids, int64 lengths)`` of consecutive batches of ``ds``'s texts, in
    order, encoded on ``threads`` threads (default: every CPU this process may use)."""
    threads = threads or _threads()
    bar = progress_bar(progress, total=len(ds), desc="tokenize", unit="doc")
    pending: deque = deque()
    with ThreadPoolExecutor(threads) as pool:
        for texts in _text_batches(ds, batch_size):
            pending.append(pool.submit(tokenizer.encode_flat, texts))
            while len(pending) > threads:  # keep every thread busy, and no more in flight
                yield _done(pending.popleft().result(), bar)
        while pending:
            yield _done(pending.popleft().result(), bar)
    if bar is not None:
        bar.close()


def _done(result: Tuple[np.ndarray, np.ndarray], bar: Any) -> Tuple[np.ndarray, np.ndarray]:
    if bar is not None:
        bar.update(len(result[1]))
    return result


def dataset_token_stream(ds: datasets.Dataset, eos_id: int, column: str = "input_ids") -> np.ndarray:
    """All documents' token ids laid end to end, each followed by ``eos_id`` (int64).

    Reads the arrow column directly (honours ``select``/``filter`` indices), so a shard of
    millions of tokens is built in milliseconds rather than row by row in Python.
    """
    import pyarrow as pa

    if len(ds) == 0:
        return np.zeros(0, dtype=np.int64)
    col = ds.with_format("arrow")[column]
    if isinstance(col, pa.Table):
        col = col.column(0)
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    offsets = col.offsets.to_numpy()
    lengths = np.diff(offsets).astype(np.int64)
    values = col.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
    # one eos after each document (np.insert keeps the order of equal positions, so an
    # empty document still gets its eos)
    return np.insert(values, np.cumsum(lengths), eos_id)


@contextlib.contextmanager
def progress_bars(enabled: bool) -> Iterator[None]:
    """datasets' progress bars are a global switch: off for one call unless asked for and
    stderr is a terminal (:func:`dipaco.runtime.progress.bars_enabled`)."""
    from datasets.utils import logging as ds_logging

    enabled = bars_enabled(enabled)
    was_enabled = ds_logging.is_progress_bar_enabled()
    if not enabled and was_enabled:
        ds_logging.disable_progress_bar()
    try:
        yield
    finally:
        if not enabled and was_enabled:
            ds_logging.enable_progress_bar()
