"""Training and evaluation batches for one path's shard.

The shard's documents are laid end to end, each followed by ``<|endoftext|>``, into one
token stream. A training batch is ``batch_size`` random windows of ``seq_len + 1`` tokens
of that stream (``x`` = the first ``seq_len``, ``y`` = the same shifted by one).

Determinism and resume: batch ``k`` is a pure function of ``(seed, path_id, k)`` — its
window starts come from a numpy ``Generator`` seeded with exactly those three numbers —
so ``state_dict() == {"step": k}`` is the whole data position of a path, and resuming
from it gives bit-identical batches.

Data parallel inside a worker group: every rank draws the same *global* batch and keeps
rows ``rank·B/G … (rank+1)·B/G``, so G ranks together see exactly the batch one process
would (``batch_size`` is the global batch and must be a multiple of ``world``).

Short shards: a stream shorter than ``seq_len + 1`` tokens gives windows padded with eos
whose padded targets are ``IGNORE_INDEX`` (-100, what ``torch.nn.functional.cross_entropy``
ignores); :func:`tokens_in_batch` counts only real targets, so α weights stay honest.
An empty shard (no tokens at all) raises :class:`DataError`: there is nothing to train on
and pretending otherwise would hide a routing problem.

Memory-mapped shards: given a :class:`router.TokenDocs` (``load_shard``'s result), the
stream is never built. Each window's positions are mapped to (document, offset) by a
binary search over the documents' cumulative lengths and read from the memmap by offset,
so a shard larger than RAM trains with memory bounded by one batch — and every batch
equals, token for token, the one the in-memory stream of the same documents gives.
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, Optional, Sequence, Tuple

import numpy as np
import torch

from dipaco.data.errors import DataError
from router import load_shard
from router.tokens import TokenDocs

IGNORE_INDEX = -100
# bounded RSS without a page-fault storm per batch: 64 batches touch a few MiB at most
_RELEASE_EVERY = 64
_U64 = 2**64


def build_stream(docs: Sequence[Sequence[int]], eos_id: int) -> np.ndarray:
    """Concatenate token arrays, each followed by ``eos_id``, into one int64 array."""
    if not docs:
        return np.zeros(0, dtype=np.int64)
    lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
    out = np.empty(int(lengths.sum()) + len(docs), dtype=np.int64)
    pos = 0
    for d, n in zip(docs, lengths):
        out[pos:pos + n] = np.asarray(d, dtype=np.int64)
        out[pos + n] = eos_id
        pos += n + 1
    return out


def tokens_in_batch(y: torch.Tensor) -> int:
    """Number of targets that count in the loss (not ``IGNORE_INDEX``): a path's α share."""
    return int((y != IGNORE_INDEX).sum().item())


class TokenStream:
    """Random-window training batches over one shard, reproducible and resumable.

    Args:
        docs: token ids of the shard's documents (eos is appended to each here): a list
            of arrays (laid into one in-memory stream) or a :class:`router.TokenDocs`
            (read by offset, e.g. from a memory-mapped shard).
        seq_len: T, tokens per row of ``x``.
        batch_size: B, the *global* batch (rows over all ranks of the worker group).
        seed: run seed.
        path_id: the path this shard belongs to (any int; the dense baseline can use -1).
        eos_id: the tokenizer's ``<|endoftext|>`` id.
        rank, world: this rank's index in its worker group and the group size G.
        stream: a ready token stream (documents + eos, e.g. from :meth:`from_dataset`);
            when given, ``docs`` is ignored.
    """

    def __init__(
        self,
        docs: Sequence[Sequence[int]],
        seq_len: int,
        batch_size: int,
        seed: int,
        path_id: int,
        eos_id: int,
        *,
        rank: int = 0,
        world: int = 1,
        stream: Optional[np.ndarray] = None,
    ) -> None:
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len}, {batch_size}")
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in a worker group of size {world}")
        if batch_size % world:
            raise ValueError(
                f"trainer.batch_size={batch_size} cannot be split over {world} ranks of a worker group. "
                f"Fix: use a multiple of launcher.group_size"
            )
        self.docs: Optional[TokenDocs] = None
        if stream is None and isinstance(docs, TokenDocs):
            self.docs = docs
            self._lengths = docs.lengths
            # end of each document in the virtual stream (its tokens + one eos)
            self._doc_ends = np.cumsum(self._lengths + 1)
            n = int(self._doc_ends[-1]) if len(docs) else 0
            self.stream = np.zeros(0, dtype=np.int64)
        else:
            self.stream = (np.asarray(stream, dtype=np.int64).reshape(-1) if stream is not None
                           else build_stream(docs, eos_id))
            n = int(self.stream.size)
        self._n = n
        if n == 0:
            raise DataError(
                f"the shard of path {path_id} is empty (no documents). Fix: use fewer paths, "
                f"more data (data.max_documents) or router.top_k>1"
            )
        self.seq_len = int(seq_len)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.path_id = int(path_id)
        self.eos_id = int(eos_id)
        self.rank = int(rank)
        self.world = int(world)
        self.step = 0
        self._reads = 0  # batches read from a memmap since the stream was built

    @classmethod
    def from_dataset(cls, ds: Any, seq_len: int, batch_size: int, seed: int, path_id: int,
                     eos_id: int, *, rank: int = 0, world: int = 1) -> "TokenStream":
        """Build from a tokenized ``Dataset`` (``input_ids`` column) without a Python loop per row."""
        # imported here: dipaco.data.tokenize loads ``datasets`` (about 1 s), and a rank
        # reading its shard's memory-mapped tokens never needs it
        from dipaco.data.tokenize import dataset_token_stream

        return cls([], seq_len, batch_size, seed, path_id, eos_id, rank=rank, world=world,
                   stream=dataset_token_stream(ds, eos_id))

    @classmethod
    def from_shard(cls, shards_dir: Any, path_id: int, seq_len: int, batch_size: int, seed: int,
                   eos_id: int, *, rank: int = 0, world: int = 1) -> "TokenStream":
        """Batches of path ``path_id``'s shard under ``shards_dir``, read from its memmap by offset.

        A missing or corrupt shard file is the user's to fix (re-route): :class:`DataError`,
        one line naming the file and the fix.
        """
        try:
            docs = load_shard(shards_dir, path_id)
        except ValueError as e:
            raise DataError(str(e)) from None
        return cls(docs, seq_len, batch_size, seed, path_id, eos_id, rank=rank, world=world)

    @property
    def num_tokens(self) -> int:
        """Tokens in the shard's stream (documents plus one eos each)."""
        return self._n

    def _read(self, idx: np.ndarray) -> np.ndarray:
        """Stream tokens at positions ``idx`` (any shape), int64."""
        if self.docs is None:
            return self.stream[idx]
        d = np.searchsorted(self._doc_ends, idx, side="right")  # document of each position
        length = self._lengths[d]
        offset = idx - (self._doc_ends[d] - (length + 1))
        is_eos = offset == length
        # eos positions read a valid dummy address (the document's start) and are masked
        flat = self.docs.starts[d] + np.where(is_eos, 0, offset)
        tokens = np.asarray(self.docs.tokens[np.minimum(flat, max(self.docs.tokens.size - 1, 0))],
                            dtype=np.int64) if self.docs.tokens.size else np.zeros(idx.shape, np.int64)
        # Unmap what the batches touched, every _RELEASE_EVERY reads: over a long run the
        # whole shard would stay mapped, but doing it per batch re-faults every page a
        # batch reads, on the training hot path.
        self._reads += 1
        if self._reads % _RELEASE_EVERY == 0:
            self.docs.release_pages()
        return np.where(is_eos, self.eos_id, tokens)

    def _rng(self, k: int) -> np.random.Generator:
        # SeedSequence takes non-negative ints: fold negatives (path_id=-1) into uint64
        return np.random.default_rng([self.seed % _U64, self.path_id % _U64, int(k)])

    def batch_at(self, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Batch ``k`` (this rank's rows), without moving the position."""
        T, n = self.seq_len, self._n
        rows = self.batch_size // self.world
        lo = self.rank * rows
        if n >= T + 1:
            # draw the global batch's starts, then keep this rank's rows: every rank of
            # the worker group draws the same numbers
            starts = self._rng(k).integers(0, n - T, size=self.batch_size)[lo:lo + rows]
            idx = starts[:, None] + np.arange(T + 1)[None, :]
            window = self._read(idx)
            x = torch.from_numpy(window[:, :-1].copy())
            y = torch.from_numpy(window[:, 1:].copy())
            return x, y
        # shard shorter than one window: the whole stream, padded with eos, padding masked
        window = np.full(T + 1, self.eos_id, dtype=np.int64)
        window[:n] = self._read(np.arange(n))
        x = torch.from_numpy(np.tile(window[:-1], (rows, 1)))
        y = torch.from_numpy(np.tile(window[1:], (rows, 1)))
        y[:, max(n - 1, 0):] = IGNORE_INDEX
        return x, y

    def next_batch(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """The next batch ``(x, y)``, LongTensors of shape ``[B/G, T]``; advances the position."""
        batch = self.batch_at(self.step)
        self.step += 1
        return batch

    def state_dict(self) -> Dict[str, Any]:
        """The data position (JSON-ready): batch ``step`` is the next one served."""
        return {"step": self.step}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore the position from :meth:`state_dict`."""
        step = int(state["step"])
        if step < 0:
            raise ValueError(f"data position step must be >= 0, got {step}")
        self.step = step


# Alias: the name earlier callers used.
PathBatcher = TokenStream


def iter_eval_batches(
    docs: Sequence[Sequence[int]], seq_len: int, batch_size: int, eos_id: int
) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """Every token of ``docs`` once, as consecutive non-overlapping windows (for perplexity).

    The stream (documents + eos) is cut into rows of ``seq_len`` targets; the last row is
    padded with eos and its padded targets are ``IGNORE_INDEX``. Deterministic, no seed.
    """
    stream = build_stream(docs, eos_id)
    n_targets = stream.size - 1
    if n_targets <= 0:
        return
    n_rows = -(-n_targets // seq_len)
    padded = np.full(n_rows * seq_len + 1, eos_id, dtype=np.int64)
    padded[:stream.size] = stream
    x_all = padded[:-1].reshape(n_rows, seq_len)
    y_all = padded[1:].reshape(n_rows, seq_len).copy()
    y_flat = y_all.reshape(-1)
    y_flat[n_targets:] = IGNORE_INDEX
    for i in range(0, n_rows, batch_size):
        yield torch.from_numpy(x_all[i:i + batch_size].copy()), torch.from_numpy(y_all[i:i + batch_size].copy())
