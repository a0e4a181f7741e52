"""Tokenize a document dataset once and keep the result on disk.

The cache key is (content hash of the dataset, tokenizer sha256). The content hash is
computed here from the ``id`` and ``text`` columns rather than taken from
``Dataset._fingerprint``: an in-memory dataset built with ``from_dict`` gets a
fingerprint that is not guaranteed to be the same in the next process, and the point of
the cache is that ``dipaco-route`` and ``dipaco-train`` (different processes) share it.
Hashing ~12 MB of text costs well under a second; tokenizing it costs several.

Entries are written to a temporary directory and renamed into place, so a crash
mid-write leaves no half entry that a later run would trust.

Two forms of entry: :func:`tokenize_dataset` keeps an HF dataset (``input_ids`` column);
:func:`tokenize_to_docs`, what training uses, writes a flat token memmap + offsets
(``router.tokens``) in batches, so a corpus larger than RAM is tokenized and then read
by offset without ever being held in memory.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from typing import Dict, Iterator, Optional

import datasets
import numpy as np

from dipaco.data.tokenizer import Tokenizer
from dipaco.run.file_mode import follow_umask
from dipaco.runtime.progress import bars_enabled, progress_bar
from router.tokens import TokenDocs, TokenDocsWriter, TokenFileError, open_token_docs

# Hits and misses of this process, for tests and logs ("tokenized: cache hit").
CACHE_STATS: Dict[str, int] = {"hits": 0, "misses": 0}

# datasets >= 4 names a variable-length list List; older versions call it Sequence
_ListFeature = getattr(datasets, "List", None) or datasets.Sequence
_TOKEN_FEATURES = {
    "input_ids": _ListFeature(datasets.Value("int32")),
    "num_tokens": datasets.Value("int32"),
}
_CACHE_VERSION = "tok-v1"  # bump when the stored layout changes


def dataset_content_hash(ds: datasets.Dataset) -> str:
    """Hex sha256 over the ``id`` and ``text`` columns (order-sensitive), same in every process."""
    h = hashlib.sha256(_CACHE_VERSION.encode())
    h.update(len(ds).to_bytes(8, "little"))
    columns = [c for c in ("id", "text") if c in ds.column_names]
    for batch in ds.select_columns(columns).iter(batch_size=4096):
        for col in columns:
            for value in batch[col]:
                b = ("" if value is None else str(value)).encode("utf-8", "surrogatepass")
                h.update(len(b).to_bytes(8, "little"))  # length prefix: no ambiguous joins
                h.update(b)
    return h.hexdigest()


def cache_path(ds: datasets.Dataset, tokenizer: Tokenizer, cache_dir: str) -> str:
    """Directory where the tokenized version of ``ds`` under ``tokenizer`` is stored."""
    key = hashlib.sha256(f"{dataset_content_hash(ds)}:{tokenizer.sha256}".encode()).hexdigest()[:24]
    return os.path.join(cache_dir, f"tokenized-{key}")


def tokenize_dataset(
    ds: datasets.Dataset,
    tokenizer: Tokenizer,
    *,
    cache_dir: Optional[str] = None,
    progress: bool = True,
) -> datasets.Dataset:
    """Return ``ds`` with ``input_ids`` (list of int32, no eos) and ``num_tokens`` added.

    With ``cache_dir`` the result is stored there and a later call with the same
    documents and tokenizer loads it (memory-mapped) instead of tokenizing again.
    """
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
    # (and warn when it cannot)
    fingerprint = hashlib.sha256(
        f"{getattr(ds, '_fingerprint', '')}:{tokenizer.sha256}".encode()
    ).hexdigest()[:16]
    with progress_bars(progress):
        out = ds.map(encode, batched=True, batch_size=256, num_proc=1, features=features,
                     new_fingerprint=fingerprint, keep_in_memory=True, desc="tokenize")
    if path:
        os.makedirs(cache_dir, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=cache_dir, prefix=".tmp-tokenized-")
        try:
            follow_umask(tmp)  # mkdtemp: 0700 whatever the umask
            with progress_bars(progress):
                out.save_to_disk(tmp)
            try:
                os.replace(tmp, path)
            except OSError:  # another process finished first: use its entry
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        out = datasets.load_from_disk(path)
    return out


def tokenize_to_docs(
    ds: datasets.Dataset,
    tokenizer: Tokenizer,
    *,
    cache_dir: Optional[str] = None,
    progress: bool = True,
    batch_size: int = 1024,
) -> TokenDocs:
    """Token ids of every document of ``ds`` (no eos) as :class:`router.TokenDocs`.

    With ``cache_dir`` they are written once to ``tokens-<key>/`` (same key as
    :func:`cache_path`) and memory-mapped; a later call with the same documents and
    tokenizer maps that entry. A damaged entry is rebuilt (it is a cache: nothing is lost).
    Without ``cache_dir`` the ids are kept in memory. Memory while tokenizing is bounded
    by ``batch_size`` documents.
    """
    if "text" not in ds.column_names:
        raise ValueError(f"tokenize_to_docs needs a 'text' column, got {ds.column_names}")
    if not cache_dir:
        return TokenDocs.from_arrays(_encode_batches(ds, tokenizer, batch_size, progress, flat=True))
    path = cache_path(ds, tokenizer, cache_dir).replace("tokenized-", "tokens-")
    if os.path.isdir(path):
        try:
            out = open_token_docs(path)
            CACHE_STATS["hits"] += 1
            return out
        except TokenFileError:  # a damaged entry: rebuild it rather than fail
            shutil.rmtree(path, ignore_errors=True)
    CACHE_STATS["misses"] += 1
    os.makedirs(cache_dir, exist_ok=True)
    writer = TokenDocsWriter(path)
    try:
        for ids in _encode_batches(ds, tokenizer, batch_size, progress):
            writer.append(ids)
    except BaseException:
        writer.abort()
        raise
    return writer.close()


def _encode_batches(ds: datasets.Dataset, tokenizer: Tokenizer, batch_size: int, progress: bool,
                    *, flat: bool = False) -> Iterator:
    """Token ids of ``ds``'s texts, one list per ``batch_size`` documents (or one by one if ``flat``)."""
    bar = progress_bar(progress, total=len(ds), desc="tokenize", unit="doc")
    for batch in ds.select_columns(["text"]).iter(batch_size=batch_size):
        ids = tokenizer.encode_batch(["" if t is None else t for t in batch["text"]])
        if bar is not None:
            bar.update(len(ids))
        if flat:
            yield from ids
        else:
            yield ids
    if bar is not None:
        bar.close()


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
