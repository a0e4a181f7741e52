"""Token documents on disk: one flat memory-mapped array of token ids + document offsets.

Layout of a token directory::

    tokens.bin    every document's token ids end to end, raw little-endian int32
    offsets.npy   int64 [N + 1]: document i is tokens[offsets[i]:offsets[i + 1]]
    tokens.sha256 the sha256 of tokens.bin, taken as it was written (no second read)

Checked where read (docs/reliability.md, rule 1): :func:`open_token_docs` hashes
``tokens.bin`` against ``tokens.sha256`` before mapping it (about 2 s a GB on this
project's 2-core CPU), so a token file rewritten in place, even to the same length, is
refused naming it; a directory written before the checksum is refused as uncheckable
(``require_checksum``; a cache rebuilds it), except where the caller vouches for it.

Written once (:class:`TokenDocsWriter`, in bounded memory, renamed into place when
complete) and read by offset through ``numpy.memmap``: opening a corpus of any size costs
only its offsets (8 bytes per document), and a document's tokens are paged in from the
file only when read. This is what lets routing, training and evaluation run on corpora
many times larger than RAM.

:class:`TokenDocs` is the read side: a sequence of documents (``len``, ``docs[i]`` → a 1-D
int32 view, ``docs[a:b]`` → a ``TokenDocs``) over any flat array (a memmap or an in-memory
array), plus the two views routing needs without copying: :meth:`TokenDocs.select` (a
shard's rows) and :meth:`TokenDocs.prefixes` (each document cut to its routing prefix).
"""
from __future__ import annotations

import hashlib
import mmap
import os
import shutil
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

TOKEN_DTYPE = np.dtype("<i4")
TOKENS_FILE, OFFSETS_FILE, CHECKSUM_FILE = "tokens.bin", "offsets.npy", "tokens.sha256"
_TMP_MARK = ".tmp-"  # .<name>.tmp-<pid>: a write in progress (or left by a killed writer)


class TokenFileError(ValueError):
    """A token directory is missing a file or holds an inconsistent one (message: file + fix)."""


class TokenDocs(Sequence[np.ndarray]):
    """Documents as ``[starts[i], ends[i])`` ranges of one flat token array.

    Args:
        tokens: the flat int array (``numpy.memmap`` for on-disk corpora).
        starts, ends: int64 ``[N]`` range of each document in ``tokens``.
    """

    def __init__(self, tokens: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> None:
        self.tokens = tokens
        self.starts = np.asarray(starts, dtype=np.int64)
        self.ends = np.asarray(ends, dtype=np.int64)
        if self.starts.shape != self.ends.shape or self.starts.ndim != 1:
            raise ValueError(f"starts {self.starts.shape} and ends {self.ends.shape} must be equal 1-D shapes")

    @classmethod
    def from_offsets(cls, tokens: np.ndarray, offsets: np.ndarray) -> "TokenDocs":
        """Documents laid end to end: document i is ``tokens[offsets[i]:offsets[i+1]]``."""
        offsets = np.asarray(offsets, dtype=np.int64)
        return cls(tokens, offsets[:-1], offsets[1:])

    @classmethod
    def from_arrays(cls, docs: Iterable[Sequence[int]]) -> "TokenDocs":
        """In-memory documents (lists or arrays of token ids), copied into one flat array."""
        arrays = [np.asarray(d, dtype=TOKEN_DTYPE).reshape(-1) for d in docs]
        lengths = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        flat = np.concatenate(arrays) if arrays else np.zeros(0, TOKEN_DTYPE)
        return cls.from_offsets(flat.astype(TOKEN_DTYPE, copy=False), offsets)

    # ------------------------------------------------------------------ sequence
    def __len__(self) -> int:
        return int(self.starts.size)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return TokenDocs(self.tokens, self.starts[i], self.ends[i])
        i = int(i)
        return self.tokens[self.starts[i] : self.ends[i]]

    def __iter__(self) -> Iterator[np.ndarray]:
        for s, e in zip(self.starts.tolist(), self.ends.tolist()):
            yield self.tokens[s:e]

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per document, int64 ``[N]``."""
        return self.ends - self.starts

    @property
    def num_tokens(self) -> int:
        """Tokens in all documents (no eos counted)."""
        return int(self.lengths.sum())

    # ------------------------------------------------------------------ views
    def select(self, rows: Sequence[int] | np.ndarray) -> "TokenDocs":
        """The documents ``rows`` (in that order, repeats allowed), sharing the flat array."""
        rows = np.asarray(rows, dtype=np.int64)
        return TokenDocs(self.tokens, self.starts[rows], self.ends[rows])

    def prefixes(self, n: int) -> "TokenDocs":
        """Each document cut to its first ``n`` tokens (a view: nothing is copied)."""
        return TokenDocs(self.tokens, self.starts, np.minimum(self.ends, self.starts + int(n)))

    def in_memory(self) -> "TokenDocs":
        """These documents copied into one in-memory array, read with ``pread`` (no page of
        the memmap gets mapped).

        For a bounded selection, e.g. the router's fit sample or one routing batch of
        prefixes: read through the memmap, every page touched would count in the RSS.
        """
        path = getattr(self.tokens, "filename", None)
        if path is None:  # already in memory
            return TokenDocs.from_arrays(list(self))
        # pread, not the mapping: a fault maps the page cache's whole folio (up to MiBs on
        # recent kernels), so sparse reads through the memmap would map most of the file
        size, base = self.tokens.dtype.itemsize, int(getattr(self.tokens, "offset", 0))
        with open(path, "rb") as f:
            fd = f.fileno()
            arrays = [np.frombuffer(os.pread(fd, (e - s) * size, base + s * size), dtype=self.tokens.dtype)
                      for s, e in zip(self.starts.tolist(), self.ends.tolist())]
        return TokenDocs.from_arrays(arrays)

    def release_pages(self) -> None:
        """Unmap the pages a pass over a memory-mapped corpus touched (no-op in memory).

        Pages read through a memmap count in the process's RSS until unmapped, so one
        pass (copying every shard row, a long run's training batches) would grow RSS to
        the corpus size although the kernel may drop them at any time. MADV_DONTNEED on a
        read-only file mapping only unmaps them: the page cache keeps them, reads stay
        correct and the RSS reflects what the process really holds.
        """
        mm = getattr(self.tokens, "_mmap", None)
        if mm is not None and hasattr(mmap, "MADV_DONTNEED"):
            mm.madvise(mmap.MADV_DONTNEED)


class TokenDocsWriter:
    """Append documents to a token directory, in bounded memory; :meth:`close` publishes it.

    Everything is written under ``.<name>.tmp-<pid>`` beside ``directory`` and renamed to
    ``directory`` only when complete, so a crash never leaves a directory a later reader
    would trust; :func:`sweep_stale_writes` deletes what a killed writer left.
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self._tmp = self.directory.with_name(f".{self.directory.name}{_TMP_MARK}{os.getpid()}")
        if self._tmp.exists():
            shutil.rmtree(self._tmp)
        self._tmp.mkdir(parents=True)
        self._file = open(self._tmp / TOKENS_FILE, "wb")
        self._lengths: list[np.ndarray] = []
        self._hash = hashlib.sha256()

    def append(self, docs: Iterable[Sequence[int]]) -> None:
        """Write a batch of documents (token id sequences)."""
        arrays = [np.asarray(d).reshape(-1) for d in docs]
        if arrays:
            self.append_flat(np.concatenate(arrays),
                             np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays)))

    def append_flat(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Write documents given end to end: ``tokens`` split by ``lengths`` (sum = size)."""
        tokens, lengths = np.asarray(tokens).reshape(-1), np.asarray(lengths, dtype=np.int64).reshape(-1)
        if int(lengths.sum()) != tokens.size:
            raise ValueError(f"lengths sum to {int(lengths.sum())}, but {tokens.size} tokens were given")
        if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(TOKEN_DTYPE).max):
            raise ValueError(f"token ids must lie in [0, 2**31), got [{tokens.min()}, {tokens.max()}]")
        data = tokens.astype(TOKEN_DTYPE, copy=False).tobytes()
        self._file.write(data)
        self._hash.update(data)
        self._lengths.append(lengths)

    def close(self) -> TokenDocs:
        """Finish the files, move them into place and return the documents, memory-mapped."""
        self._file.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        np.save(self._tmp / OFFSETS_FILE, offsets)
        (self._tmp / CHECKSUM_FILE).write_text(self._hash.hexdigest() + "\n", encoding="ascii")
        if self.directory.exists():
            shutil.rmtree(self.directory)
        os.replace(self._tmp, self.directory)
        st = (self.directory / TOKENS_FILE).stat()  # hashed as written: the reader below need not read it again
        _CHECKED[(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)] = self._hash.hexdigest()
        return open_token_docs(self.directory)

    def abort(self) -> None:
        """Drop what was written (the published directory, if any, is left untouched)."""
        self._file.close()
        shutil.rmtree(self._tmp, ignore_errors=True)


_CHECKED: dict[tuple[int, int, int, int], str] = {}  # (device, inode, size, mtime) -> sha256, this process


def _checked_sha256(path: Path) -> str:
    """sha256 of ``path``, taken once per process while the file is unchanged (its device,
    inode, size and modification time): a reader of many shards of one file hashes it once."""
    st = path.stat()
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _CHECKED:
        _CHECKED[key] = _sha256(path)
    return _CHECKED[key]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            chunk = f.read(16 << 20)
            if not chunk:
                return h.hexdigest()
            h.update(chunk)


def sweep_stale_writes(parent: str | os.PathLike) -> None:
    """Delete the temporary directories under ``parent`` whose writer process is gone."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        head, mark, pid = name.rpartition(_TMP_MARK)
        if not (name.startswith(".") and mark and pid.isdigit()) or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
        except PermissionError:  # another user's live process
            pass


def write_token_docs(directory: str | os.PathLike, docs: Iterable[Sequence[int]],
                     batch_size: int = 4096) -> TokenDocs:
    """Write ``docs`` (any iterable of token id sequences) as a token directory; return it mapped."""
    writer = TokenDocsWriter(directory)
    try:
        batch: list[Sequence[int]] = []
        for d in docs:
            batch.append(d)
            if len(batch) == batch_size:
                writer.append(batch)
                batch = []
        writer.append(batch)
    except BaseException:
        writer.abort()
        raise
    return writer.close()


def open_token_docs(directory: str | os.PathLike, *, fix: str = "delete the directory and rerun",
                    require_checksum: bool = True) -> TokenDocs:
    """Memory-map a token directory; :class:`TokenFileError` (one line: the file and ``fix``)
    when a file is missing, the offsets do not match the token file, or ``tokens.bin`` is
    not the file its ``tokens.sha256`` was taken of (a directory without one: refused with
    ``require_checksum``, else mapped as before)."""
    d = Path(directory)
    tokens_path, offsets_path = d / TOKENS_FILE, d / OFFSETS_FILE
    for p in (tokens_path, offsets_path):
        if not p.is_file():
            raise TokenFileError(f"missing {p}: the token files are incomplete. Fix: {fix}")
    try:
        offsets = np.load(offsets_path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise TokenFileError(f"corrupt {offsets_path} ({e}). Fix: {fix}") from None
    size = tokens_path.stat().st_size
    if (offsets.ndim != 1 or offsets.size < 1 or offsets.dtype.kind not in "iu" or offsets[0] != 0
            or np.any(np.diff(offsets) < 0)):
        raise TokenFileError(f"corrupt {offsets_path}: not a non-decreasing offsets array from 0. Fix: {fix}")
    if size != int(offsets[-1]) * TOKEN_DTYPE.itemsize:
        raise TokenFileError(
            f"corrupt {tokens_path}: {size} bytes, but {offsets_path.name} expects "
            f"{int(offsets[-1]) * TOKEN_DTYPE.itemsize} (truncated or overwritten). Fix: {fix}")
    checksum = d / CHECKSUM_FILE
    if checksum.is_file():
        want = checksum.read_text(encoding="ascii", errors="replace").strip()
        if _checked_sha256(tokens_path) != want:
            raise TokenFileError(f"corrupt {tokens_path}: its sha256 is not the one written with it ({checksum.name}):"
                                 f" rewritten or damaged since. Fix: {fix}")
    elif require_checksum:
        raise TokenFileError(f"{d} has no {CHECKSUM_FILE} (written by an older dipaco), so its tokens cannot be "
                             f"checked. Fix: {fix}")
    # np.memmap refuses an empty file: an empty corpus is a plain empty array
    tokens = (np.memmap(tokens_path, dtype=TOKEN_DTYPE, mode="r") if size
              else np.zeros(0, TOKEN_DTYPE))
    return TokenDocs.from_offsets(tokens, offsets)


__all__ = ["TokenDocs", "TokenDocsWriter", "TokenFileError", "open_token_docs", "sweep_stale_writes",
           "write_token_docs", "CHECKSUM_FILE", "TOKEN_DTYPE"]
