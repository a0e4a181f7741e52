"""The text store: a corpus's cleaned documents on disk, read back in bounded batches.

Layout of a store directory (written once by :class:`TextStoreWriter`)::

    text.bin, id.bin, group.bin    each document's text / id / group, UTF-8, end to end
    index.npz                      int64 offsets [N + 1] of each .bin file, int32 label
                                   codes [N] (-1: none), uint8 split codes [N]
    labels.json                    the label of each code

The same shape as the token store (``router.tokens``): a flat file and offsets. Reading
a batch of rows is one ``pread`` per run of consecutive rows, so memory is the batch's
bytes whatever the corpus size, and no page stays mapped (a memory-mapped read would
leave every page it touched in the process's RSS). What stays in memory is 29 bytes per
document (three offsets, a label code, a split code).

:class:`Documents` is a view of some rows of a store (a split, a sample), in store order.
A store lives in a directory that is deleted when the last view of it is gone (or at
exit); a directory left by a killed process is swept by the next load (:func:`sweep_stale`).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence

import numpy as np

from dipaco.data.splits import SPLITS
from dipaco.storage.strict_json import dumps_strict

__all__ = ["COLUMNS", "Documents", "TextStore", "TextStoreWriter", "document_features", "new_store_dir", "sweep_stale"]

COLUMNS = ("id", "text", "label", "group", "split")
_BYTES_COLUMNS = ("text", "id", "group")
_TMP_PREFIX = ".tmp-corpus-"
# rows and bytes per batch a view reads at most (one document longer than the byte cap is
# read alone)
BATCH_DOCS = 4096
BATCH_BYTES = 16 * 2**20


def new_store_dir(work_dir: Optional[str]) -> Path:
    """A fresh directory for a store: under ``work_dir`` (a cache directory) or the system's temp."""
    if work_dir:
        os.makedirs(work_dir, exist_ok=True)
        sweep_stale(work_dir)
    return Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{os.getpid()}-", dir=work_dir or None))


def sweep_stale(work_dir: str) -> None:
    """Delete stores under ``work_dir`` whose process is gone (a run killed mid-load)."""
    try:
        names = os.listdir(work_dir)
    except OSError:
        return
    for name in names:
        if not name.startswith(_TMP_PREFIX):
            continue
        try:
            pid = int(name[len(_TMP_PREFIX):].split("-", 1)[0])
        except ValueError:
            continue
        if pid != os.getpid() and not _alive(pid):
            shutil.rmtree(os.path.join(work_dir, name), ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


class TextStoreWriter:
    """Append documents to a new store in ``directory``; :meth:`close` returns it."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        staging = self.directory  # a new store's temporary folder (new_store_dir), published by a rename
        self._files = {c: open(staging / f"{c}.bin", "wb") for c in _BYTES_COLUMNS}
        self._lengths: Dict[str, List[np.ndarray]] = {c: [] for c in _BYTES_COLUMNS}
        self._labels: List[np.ndarray] = []
        self._splits: List[np.ndarray] = []
        self.label_codes: Dict[str, int] = {}
        self.num_documents = 0

    def add(self, ids: Sequence[str], texts: Sequence[str], labels: Sequence[Optional[str]],
            groups: Sequence[str], splits: Sequence[int]) -> None:
        """Write a batch of documents (equal-length sequences; ``splits`` are codes of :data:`SPLITS`)."""
        for column, values in (("text", texts), ("id", ids), ("group", groups)):
            encoded = [v.encode("utf-8") for v in values]
            self._files[column].write(b"".join(encoded))
            self._lengths[column].append(np.fromiter(map(len, encoded), np.int64, len(encoded)))
        codes = [-1 if x is None else self.label_codes.setdefault(x, len(self.label_codes)) for x in labels]
        self._labels.append(np.asarray(codes, np.int32))
        self._splits.append(np.asarray(splits, np.uint8))
        self.num_documents += len(ids)

    def close(self) -> "TextStore":
        """Finish the files and open the store."""
        arrays: Dict[str, np.ndarray] = {}
        for column, f in self._files.items():
            f.close()
            lengths = np.concatenate(self._lengths[column]) if self._lengths[column] else np.zeros(0, np.int64)
            arrays[column] = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        arrays["label"] = np.concatenate(self._labels) if self._labels else np.zeros(0, np.int32)
        arrays["split"] = np.concatenate(self._splits) if self._splits else np.zeros(0, np.uint8)
        staging = self.directory  # (see __init__)
        np.savez(staging / "index.npz", **arrays)
        names = sorted(self.label_codes, key=self.label_codes.__getitem__)
        (staging / "labels.json").write_text(dumps_strict(names))
        return TextStore(self.directory)

    def abort(self) -> None:
        """Close the files (the caller deletes the directory)."""
        for f in self._files.values():
            f.close()


class TextStore:
    """A store opened for reading (see the module docstring); ``owned``: delete its
    directory when the store is garbage-collected or the process exits."""

    def __init__(self, directory: Path, *, owned: bool = True) -> None:
        self.directory = Path(directory)
        with np.load(self.directory / "index.npz") as index:
            self.offsets = {c: index[c] for c in _BYTES_COLUMNS}
            self.label_codes = index["label"]
            self.split_codes = index["split"]
        self.label_names: List[str] = json.loads((self.directory / "labels.json").read_text())
        self._files = {c: open(self.directory / f"{c}.bin", "rb") for c in _BYTES_COLUMNS}
        self._finalizer = weakref.finalize(self, _remove, list(self._files.values()),
                                           str(self.directory) if owned else None)

    def __len__(self) -> int:
        return int(self.split_codes.size)

    def close(self) -> None:
        """Close the files and delete the directory now (views of it stop working)."""
        self._finalizer()

    def lengths(self, column: str, rows: np.ndarray) -> np.ndarray:
        """Bytes of ``column`` of each of ``rows``."""
        off = self.offsets[column]
        return off[rows + 1] - off[rows]

    def read(self, column: str, rows: np.ndarray) -> List[str]:
        """``column`` (``text``, ``id`` or ``group``) of ``rows``: one ``pread`` per run of consecutive rows."""
        rows = np.asarray(rows, np.int64)
        if not rows.size:
            return []
        off = self.offsets[column]
        fd = self._files[column].fileno()
        starts, ends = off[rows], off[rows + 1]
        breaks = np.flatnonzero(np.diff(rows) != 1) + 1
        out: List[str] = []
        for run in np.split(np.arange(rows.size), breaks):
            lo, hi = int(starts[run[0]]), int(ends[run[-1]])
            buf = os.pread(fd, hi - lo, lo) if hi > lo else b""
            out.extend(buf[s - lo:e - lo].decode("utf-8") for s, e in zip(starts[run].tolist(), ends[run].tolist()))
        return out


def _remove(files: List[Any], directory: Optional[str]) -> None:
    for f in files:
        f.close()
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)


class Documents:
    """Some rows of a :class:`TextStore` (a split, a sample), in store order.

    Columns are ``id``, ``text``, ``label`` (None when the source has none), ``group``
    and ``split``; ``docs["text"]`` reads a whole column into a list (for small corpora
    and tests); the pipeline reads in batches (:meth:`iter_batches`).
    """

    column_names = list(COLUMNS)

    def __init__(self, store: TextStore, rows: np.ndarray) -> None:
        self.store = store
        self.rows = np.asarray(rows, np.int64)

    def __len__(self) -> int:
        return int(self.rows.size)

    def select(self, indices: Sequence[int] | np.ndarray) -> "Documents":
        """The documents at ``indices`` of this view (positions, not store rows)."""
        return Documents(self.store, self.rows[np.asarray(indices, np.int64)])

    def column(self, name: str, rows: Optional[np.ndarray] = None) -> List[Any]:
        """One column of ``rows`` (default: every row of the view) as a list."""
        rows = self.rows if rows is None else rows
        if name in _BYTES_COLUMNS:
            return self.store.read(name, rows)
        if name == "label":
            names = self.store.label_names
            return [None if c < 0 else names[c] for c in self.store.label_codes[rows].tolist()]
        if name == "split":
            return [SPLITS[c] for c in self.store.split_codes[rows].tolist()]
        raise KeyError(f"no column {name!r}: the columns are {', '.join(COLUMNS)}")

    def __getitem__(self, key: Any) -> Any:
        """``docs["text"]``: a whole column (a list); ``docs[i]``: one document as a dict."""
        if isinstance(key, str):
            return self.column(key)
        rows = self.rows[[int(key)]]
        return {c: self.column(c, rows)[0] for c in COLUMNS}

    def label_codes(self) -> np.ndarray:
        """int32 code of each document's label: its rank among the sorted label names (so
        codes sort as the labels do), -1 for none."""
        names = self.store.label_names
        rank = np.empty(len(names) + 1, np.int32)
        rank[:-1] = np.argsort(np.argsort(np.asarray(names, dtype=object), kind="stable"), kind="stable")
        rank[-1] = -1  # code -1 indexes the last slot
        return rank[self.store.label_codes[self.rows]]

    @property
    def label_names(self) -> List[str]:
        return self.store.label_names

    def text_bytes(self) -> np.ndarray:
        """UTF-8 bytes of each document's text, int64 ``[N]``."""
        return self.store.lengths("text", self.rows)

    def iter_batches(self, max_docs: int = BATCH_DOCS, max_bytes: int = BATCH_BYTES) -> Iterator[np.ndarray]:
        """Positions (into this view) of consecutive batches of at most ``max_docs``
        documents and ``max_bytes`` of text (or one longer document)."""
        if not len(self):
            return
        ends = np.cumsum(self.text_bytes())
        lo = 0
        while lo < len(self):
            base = int(ends[lo - 1]) if lo else 0
            hi = int(np.searchsorted(ends, base + max_bytes, side="right"))
            hi = min(max(lo + 1, hi), lo + max_docs)
            yield np.arange(lo, hi)
            lo = hi

    def iter_texts(self, max_docs: int = BATCH_DOCS, max_bytes: int = BATCH_BYTES) -> Iterator[List[str]]:
        """The texts, batch by batch (:meth:`iter_batches`)."""
        for batch in self.iter_batches(max_docs, max_bytes):
            yield self.store.read("text", self.rows[batch])

    def spread(self, max_bytes: Optional[int], max_documents: Optional[int]) -> "Documents":
        """A deterministic sample spread evenly over the view: all of it when it holds at most
        ``max_bytes`` of text and ``max_documents`` documents (None: no limit); else every
        document whose position ``i`` starts a new multiple of ``1 / rate``
        (``floor((i + 1) * rate) > floor(i * rate)``, ``rate`` the smaller of the two
        ratios), cut where the bytes reach ``max_bytes``."""
        n = len(self)
        lengths = self.text_bytes()
        total = int(lengths.sum())
        rate = 1.0
        if max_bytes is not None and total > max_bytes:
            rate = min(rate, max_bytes / total)
        if max_documents is not None and n > max_documents:
            rate = min(rate, max_documents / n)
        if rate >= 1.0:
            return self
        i = np.arange(n, dtype=np.float64)
        picked = np.flatnonzero(np.floor((i + 1) * rate) > np.floor(i * rate))
        if max_bytes is not None:  # the byte cap holds even where the picked documents run long
            within = np.cumsum(lengths[picked]) - lengths[picked] < max_bytes
            picked = picked[within]
        if max_documents is not None:
            picked = picked[:max_documents]
        return self.select(picked)

    def to_hf(self) -> Any:
        """An in-memory ``datasets.Dataset`` of these documents (small data and tests only)."""
        import datasets  # heavy (pyarrow): only where a Dataset is built

        return datasets.Dataset.from_dict({c: self.column(c) for c in COLUMNS}, features=document_features())


def document_features() -> Any:
    """The ``datasets.Features`` of the store's columns (every one a string, label may be null)."""
    import datasets  # slow to import: a store is read without it

    return datasets.Features({c: datasets.Value("string") for c in COLUMNS})
