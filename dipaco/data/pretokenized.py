"""Pre-tokenized input (``data=tokens``): token shards on disk, or records holding token ids.

``data.path`` is one of:

* a **token directory** (the layout of the project's own token store, ``router.tokens``)::

      tokens.bin    every document's token ids end to end, little-endian uint16,
                    uint32 or int32
      offsets.npy   int64 [N + 1]: document i is tokens[offsets[i]:offsets[i + 1]]
      tokens.json   the header: the id width and the sha256 of the tokenizer the ids
                    were made with, {"dtype": "uint16", "tokenizer": "<sha256>"}
                    (:func:`write_token_header` writes it)

  or a directory of them (each subdirectory holding ``tokens.bin`` is a shard, read in
  sorted order; with ``data.splits=auto`` one named ``train*`` / ``validation*`` /
  ``test*`` is that split). Ids are ``<shard>#<i>``.
* JSON lines, JSON or parquet files, a ``save_to_disk`` folder or a hub dataset whose
  records hold the ids in ``data.text_field`` (``input_ids`` in ``conf/data/tokens.yaml``):
  a list of non-negative integers. A record whose ids are not that is skipped and counted
  (``bad_token_ids``), like any bad record.

There is no tokenizer pass: the ids are used as they are. The tokenizer they were made
with gives the end-of-sequence id that separates documents and decodes for inference and
export: ``data.tokenizer``, or a ``tokenizer.json`` beside the data (in ``data.path``, or
beside the file it names). Each split is copied into the token cache, checked against
the tokenizer's vocabulary on the way (an id outside it is one :class:`DataError`).
A token directory's header names the tokenizer its ids were made with (another BPE's ids
fit this vocabulary and would train silently on the wrong text): another tokenizer, or
none named (an older store), is refused in one line. Records of ids have no header.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Tuple

import numpy as np

from dipaco.data.cleaning import Cleaner, check_fields
from dipaco.data.corpus import Corpus
from dipaco.data.errors import DataError
from dipaco.data.files import file_split, relative_id, resolve_files
from dipaco.data.readers import (count_skip, is_saved_dataset, iter_dataset, iter_json_file, iter_json_lines,
                                 iter_parquet, open_datasets)
from dipaco.data.splits import SPLITS, id_unit_interval, split_of
from dipaco.run.outputs import output_between
from dipaco.data.textstore import Documents, TextStoreWriter, new_store_dir
from dipaco.data.tokenizer import Tokenizer, tokenizer_beside
from dipaco.runtime.progress import progress_bar
from router.tokens import OFFSETS_FILE, TOKENS_FILE, TokenDocs, TokenDocsWriter, TokenFileError, open_token_docs
from dipaco.storage.atomic import write_json
from dipaco.storage.hashing import sha256, short_key

if TYPE_CHECKING:
    from dipaco.config import DataConfig

__all__ = ["TokenCorpus", "TokenView", "load_token_corpus", "open_token_shard", "write_token_header"]

# the id types a token directory's header (tokens.json) may name
_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4"), "int32": np.dtype("<i4")}
HEADER_FILE = "tokens.json"
_COPY_TOKENS = 4 * 2**20  # tokens copied per batch


def _id_dtype(directory: Path, fix: str) -> np.dtype:
    """The id type of ``directory``'s ``tokens.bin``, from its header ``tokens.json``.

    Never from the file's size: a uint32 file cut to half its size reads as uint16 ids of
    the right count, so size ÷ count cannot tell a damaged file from a narrower one."""
    header = directory / HEADER_FILE
    example = '{"dtype": "uint16"}'
    try:
        dtype = json.loads(header.read_text(encoding="utf-8")).get("dtype")
    except FileNotFoundError:
        raise DataError(f"data.path: {directory} has no {HEADER_FILE} naming the id type of {TOKENS_FILE} (its "
                        f"size cannot tell it). Fix: write {HEADER_FILE} beside it, e.g. {example} "
                        f"(uint16, uint32 or int32)") from None
    except (OSError, ValueError, AttributeError):
        dtype = None
    if dtype not in _DTYPES:
        raise DataError(f"data.path: {header} does not name an id type (uint16, uint32 or int32). Fix: {fix}")
    return _DTYPES[dtype]


def write_token_header(directory: str | os.PathLike, dtype: Any, tokenizer: Tokenizer) -> None:
    """Write ``directory``'s header: the id type of its ``tokens.bin`` and the sha256 of
    the tokenizer its ids were made with (what :func:`open_token_shard` checks)."""
    header = {"dtype": np.dtype(dtype).name, "tokenizer": tokenizer.sha256}
    write_json(Path(directory, HEADER_FILE), header)


def _check_tokenizer(directory: Path, tokenizer_sha256: str) -> None:
    """Refuse ids made with another tokenizer, or whose header does not say which."""
    header = directory / HEADER_FILE
    try:
        made_with = json.loads(header.read_text(encoding="utf-8")).get("tokenizer")
    except (OSError, ValueError, AttributeError):
        made_with = None
    line = f'"tokenizer": "{tokenizer_sha256}"'
    if made_with is None:
        raise DataError(f"data.path: {header} does not name the tokenizer its ids were made with, so they cannot "
                        f"be checked against this run's tokenizer (sha256 {tokenizer_sha256[:12]}...). Fix: if "
                        f"they were made with it, add {line} to {HEADER_FILE}; otherwise pass the tokenizer they "
                        f"were made with (data.tokenizer=PATH)")
    if made_with != tokenizer_sha256:
        raise DataError(f"data.path: the ids in {directory} were made with another tokenizer (sha256 "
                        f"{str(made_with)[:12]}..., {HEADER_FILE}) than this run's ({tokenizer_sha256[:12]}...). "
                        f"Fix: pass the tokenizer they were made with (data.tokenizer=PATH or tokenizer.json "
                        f"beside them)")


def open_token_shard(directory: Path, tokenizer_sha256: Optional[str] = None) -> TokenDocs:
    """A token directory of uint16 / uint32 / int32 ids (its header says which),
    memory-mapped; one :class:`DataError` line naming the file when it is incomplete or
    inconsistent, or (``tokenizer_sha256`` given) made with another tokenizer."""
    fix = "write tokens.bin, offsets.npy and tokens.json as docs/data.md describes"
    if tokenizer_sha256 is not None:
        _check_tokenizer(directory, tokenizer_sha256)
    tokens_path, offsets_path = directory / TOKENS_FILE, directory / OFFSETS_FILE
    try:
        offsets = np.load(offsets_path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise DataError(f"data.path: cannot read {offsets_path} ({type(e).__name__}). Fix: {fix}") from None
    if (offsets.ndim != 1 or offsets.size < 1 or offsets.dtype.kind not in "iu" or offsets[0] != 0
            or np.any(np.diff(offsets) < 0)):
        raise DataError(f"data.path: {offsets_path} is not a non-decreasing int array from 0. Fix: {fix}")
    dtype = _id_dtype(directory, fix)
    size = tokens_path.stat().st_size if tokens_path.is_file() else -1
    n = int(offsets[-1])
    if size != n * dtype.itemsize:
        raise DataError(f"data.path: {tokens_path} holds {size} bytes for the {n} token ids {offsets_path.name} "
                        f"counts as {dtype.name} ({HEADER_FILE}: {n * dtype.itemsize} bytes): it is truncated or "
                        f"not the file they describe. Fix: {fix}")
    tokens = np.memmap(tokens_path, dtype=dtype, mode="r") if n else np.zeros(0, dtype)
    return TokenDocs.from_offsets(tokens, offsets.astype(np.int64))


def _token_shards(path: str) -> Optional[List[Tuple[str, Path]]]:
    """(name, directory) of the token shards under ``path``, or None when it holds none."""
    root = Path(path).expanduser()
    if not root.is_dir():
        return None
    if (root / OFFSETS_FILE).is_file():
        return [("", root)]
    found = sorted(p.parent for p in root.rglob(OFFSETS_FILE) if not any(q.startswith(".") for q in p.parts)
                   and not output_between(p, root))  # a run's token cache is not data (dipaco/run/outputs.py)
    return [(p.relative_to(root).as_posix(), p) for p in found] or None


class _IdsCleaner(Cleaner):
    """Cleaner whose documents are token ids: a list of non-negative integers."""

    def text_of(self, rec: Dict[str, Any], truncated: bool) -> Any:  # type: ignore[override]
        if self.text_field not in rec:
            count_skip(self.skipped, "missing_text_field")
            return None
        self.with_text_field += 1
        value = rec[self.text_field]
        if not isinstance(value, (list, tuple, np.ndarray)) or any(
                isinstance(x, bool) or not isinstance(x, (int, np.integer)) for x in value):
            count_skip(self.skipped, "bad_token_ids")
            return None
        ids = np.asarray(value, np.int64)
        if not ids.size:
            count_skip(self.skipped, "empty")
            return None
        if ids.min() < 0 or ids.max() >= 2**31:
            count_skip(self.skipped, "bad_token_ids")
            return None
        return ids


class TokenView(Documents):
    """Rows of a pre-tokenized corpus: the metadata store's rows plus their token ids."""

    def __init__(self, docs: Documents, tokens: TokenDocs) -> None:
        super().__init__(docs.store, docs.rows)
        self.all_tokens = tokens

    def select(self, indices: Any) -> "TokenView":
        return TokenView(super().select(indices), self.all_tokens)

    def token_docs(self) -> TokenDocs:
        return self.all_tokens.select(self.rows)

    def spread(self, max_bytes: Optional[int], max_documents: Optional[int]) -> "TokenView":
        return self  # no tokenizer is trained on pre-tokenized data

    def content_hash(self) -> str:
        """sha256 over the ids and token ids of these documents (order-sensitive)."""
        h = sha256(b"pretokenized-v1")
        h.update(len(self).to_bytes(8, "little"))
        docs = self.token_docs()
        for lo in range(0, len(self), 4096):
            rows = np.arange(lo, min(lo + 4096, len(self)))
            for i, doc_id in zip(rows.tolist(), self.store.read("id", self.rows[rows])):
                b = doc_id.encode("utf-8")
                h.update(len(b).to_bytes(8, "little") + b)
                ids = np.ascontiguousarray(docs[i], dtype="<i4")
                h.update(ids.size.to_bytes(8, "little") + ids.tobytes())
        return h.hexdigest()


@dataclass(eq=False)
class TokenCorpus(Corpus):
    """A pre-tokenized corpus: the metadata of each document (id, label, split) in a text
    store with empty texts, and the token ids of every store row."""

    tokens: TokenDocs = field(default=None)  # type: ignore[assignment]
    temp_dirs: List[Path] = field(default_factory=list)
    pretokenized = True

    def split(self, name: str, *, whole: bool = False) -> TokenView:  # type: ignore[override]
        return TokenView(super().split(name, whole=whole), self.tokens)

    def split_tokens(self, name: str, cache_dir: str, tokenizer: Tokenizer, progress: bool = False) -> TokenDocs:
        """One split's token ids, copied (once, then cached) into ``cache_dir`` as int32 and
        checked against ``tokenizer``'s vocabulary."""
        view = self.split(name)
        key = short_key(f"{view.content_hash()}:{tokenizer.sha256}")
        path = os.path.join(cache_dir, f"tokens-{key}")
        if os.path.isdir(path):
            try:
                return open_token_docs(path)
            except TokenFileError:  # a damaged entry: rebuild it
                shutil.rmtree(path, ignore_errors=True)
        docs = view.token_docs()
        os.makedirs(cache_dir, exist_ok=True)
        writer = TokenDocsWriter(path)
        bar = progress_bar(progress, total=len(docs), desc=f"copy {name} tokens", unit="doc")
        try:
            for lo, hi in _token_batches(docs):
                part = docs[lo:hi]
                flat = np.concatenate([part[i] for i in range(len(part))]) if hi > lo else np.zeros(0, np.int32)
                if flat.size and int(flat.max()) >= tokenizer.vocab_size:
                    raise DataError(f"data.path={self.source_path}: token id {int(flat.max())} is outside the "
                                    f"{tokenizer.vocab_size} ids of the tokenizer. Fix: pass the tokenizer the ids "
                                    f"were made with (data.tokenizer=PATH or tokenizer.json beside the data)")
                writer.append_flat(flat.astype(np.int32), part.lengths)
                part.release_pages()
                if bar is not None:
                    bar.update(hi - lo)
        except BaseException:
            writer.abort()
            raise
        return writer.close()

    source_path: str = ""

    def close(self) -> None:
        super().close()
        for d in self.temp_dirs:
            shutil.rmtree(d, ignore_errors=True)


def _token_batches(docs: TokenDocs) -> Iterator[Tuple[int, int]]:
    ends = np.cumsum(docs.lengths)
    lo = 0
    while lo < len(docs):
        base = int(ends[lo - 1]) if lo else 0
        hi = max(lo + 1, int(np.searchsorted(ends, base + _COPY_TOKENS, side="right")))
        yield lo, min(hi, len(docs))
        lo = hi


def load_token_corpus(cfg: "DataConfig", *, progress: bool = True, work_dir: Optional[str] = None) -> TokenCorpus:
    """Read pre-tokenized input (see the module docstring) into a :class:`TokenCorpus`.
    Token directories are checked against the tokenizer of ``data.tokenizer`` or beside
    the data (none found: the run is refused later, naming where to put one)."""
    if not cfg.path:
        raise DataError("data.path is not set for data.source=tokens. Fix: pass data.path=<a directory of token "
                        "shards, or files / a dataset with an input_ids column>")
    tokenizer_path = getattr(cfg, "tokenizer", None) or tokenizer_beside(cfg)
    tokenizer_sha256 = Tokenizer.load(tokenizer_path).sha256 if tokenizer_path else None
    own = str(getattr(cfg, "splits", "auto")) == "auto"
    fractions = (float(cfg.val_fraction), float(cfg.test_fraction))
    directory = new_store_dir(work_dir)
    meta = TextStoreWriter(directory / "meta")
    skipped: Dict[str, int] = {}
    try:
        shards = _token_shards(str(cfg.path))
        if shards is not None:
            tokens, own_splits = _from_shards(shards, own, directory, meta, fractions, tokenizer_sha256)
        else:
            tokens, own_splits = _from_records(cfg, own, directory, meta, fractions, skipped)
        store = meta.close()
    except BaseException:
        meta.abort()
        shutil.rmtree(directory, ignore_errors=True)
        raise
    rows = np.flatnonzero(tokens.lengths > 0).astype(np.int64)
    if rows.size < len(tokens):
        skipped["empty"] = skipped.get("empty", 0) + int(len(tokens) - rows.size)
    if cfg.max_documents is not None and rows.size > int(cfg.max_documents):
        ids = store.read("id", rows)
        keys = np.fromiter((id_unit_interval(i, "max_documents") for i in ids), np.float64, len(ids))
        keep = np.sort(np.lexsort((np.arange(rows.size), keys))[: int(cfg.max_documents)])
        skipped["capped_by_max_documents"] = int(rows.size - keep.size)
        rows = rows[keep]
    if not rows.size:
        store.close()
        shutil.rmtree(directory, ignore_errors=True)
        raise DataError(f"data.path={cfg.path}: no usable document (skipped: {skipped or 'nothing'}). "
                        f"Fix: check data.path and data.text_field")
    return TokenCorpus(store=store, rows=rows, skipped=dict(sorted(skipped.items())), source="tokens",
                       max_train_documents=getattr(cfg, "max_train_documents", None), own_splits=own_splits,
                       tokens=tokens, temp_dirs=[directory], source_path=str(cfg.path))


class _Meta:
    """Writes each document's id, label, group and split to the metadata store, in batches;
    ``own``: the splits the source has (the training part gives up no share to them)."""

    def __init__(self, writer: TextStoreWriter, fractions: Tuple[float, float], own: Tuple[str, ...]) -> None:
        self.writer, self.own = writer, own
        self.fractions = (0.0 if "validation" in own else fractions[0], 0.0 if "test" in own else fractions[1])

    def add(self, split: Optional[str], ids: List[str], labels: List[Optional[str]], groups: List[str]) -> None:
        codes = [SPLITS.index(split if split in ("validation", "test") else split_of(g, *self.fractions))
                 for g in groups]
        self.writer.add(ids, [""] * len(ids), labels, groups, codes)


def _own(splits: List[Optional[str]]) -> Tuple[str, ...]:
    return tuple(s for s in ("validation", "test") if s in splits)


def _from_shards(shards: List[Tuple[str, Path]], own: bool, directory: Path, meta_writer: TextStoreWriter,
                 fractions: Tuple[float, float], tokenizer_sha256: Optional[str]) -> Tuple[TokenDocs, Tuple[str, ...]]:
    opened = [(name, open_token_shard(d, tokenizer_sha256), file_split(name) if own and name else None)
              for name, d in shards]
    meta = _Meta(meta_writer, fractions, _own([s for _, _, s in opened]))
    for name, docs, split in opened:
        for lo in range(0, len(docs), 65536):
            ids = [f"{name}#{i}" if name else f"#{i}" for i in range(lo, min(lo + 65536, len(docs)))]
            meta.add(split, ids, [None] * len(ids), ids)
    if len(opened) == 1:
        return opened[0][1], meta.own  # used in place, memory-mapped
    writer = TokenDocsWriter(directory / "tokens")  # several shards: one flat file for the run
    try:
        for _, docs, _ in opened:
            for lo, hi in _token_batches(docs):
                part = docs[lo:hi]
                flat = np.concatenate([part[i] for i in range(len(part))]) if hi > lo else np.zeros(0, np.int32)
                writer.append_flat(flat.astype(np.int32), part.lengths)
                part.release_pages()
    except BaseException:
        writer.abort()
        raise
    return writer.close(), meta.own


def _from_records(cfg: "DataConfig", own: bool, directory: Path, meta_writer: TextStoreWriter,
                  fractions: Tuple[float, float], skipped: Dict[str, int]) -> Tuple[TokenDocs, Tuple[str, ...]]:
    cleaner = _IdsCleaner(cfg, str(cfg.text_field), cfg.label_field, cfg.id_field, getattr(cfg, "group_field", None))
    cleaner.skipped = skipped
    path = str(cfg.path)
    local = os.path.expanduser(path)
    columns = [c for c in (cleaner.text_field, cleaner.label_field, cleaner.id_field, cleaner.group_field) if c]
    sources: List[Tuple[Optional[str], Iterator[Tuple[str, Any]]]] = []
    if (os.path.isdir(local) and is_saved_dataset(local)) or not (os.path.exists(local) or "*" in local):
        for name, ds in open_datasets(path, cfg.hub_config, str(cfg.hub_split), bool(cfg.streaming), own).items():
            prefix = str(cfg.hub_split) if name == "train" else name
            sources.append((name if own else None, iter_dataset(ds, prefix, columns, skipped)))
    else:
        files, root = resolve_files(path, "parquet" if local.endswith(".parquet") else "jsonl", skipped)
        single = os.path.isfile(local)
        for f in files:
            rel = relative_id(f, root)
            reader = (iter_parquet(f, rel, columns, skipped) if f.endswith(".parquet") else
                      iter_json_file(f, rel, cleaner.text_field, skipped) if f.endswith(".json") else
                      iter_json_lines(f, rel, skipped))
            sources.append((file_split(rel) if own and not single else None, reader))
    meta = _Meta(meta_writer, fractions, _own([s for s, _ in sources]))
    writer = TokenDocsWriter(directory / "tokens")
    try:
        for split, records in sources:
            batch: list = []
            for default_id, rec in records:
                doc = cleaner.add(default_id, rec)
                if doc is not None:
                    batch.append(doc)
                if len(batch) >= 1024:
                    _flush(writer, meta, split, batch)
            _flush(writer, meta, split, batch)
        check_fields(cleaner, f"data.path={path}")
    except BaseException:
        writer.abort()
        raise
    return writer.close(), meta.own


def _flush(writer: TokenDocsWriter, meta: _Meta, split: Optional[str], batch: list) -> None:
    if batch:
        writer.append([d.text for d in batch])
        meta.add(split, [d.id for d in batch], [d.label for d in batch], [d.group for d in batch])
        batch.clear()
