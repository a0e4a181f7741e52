"""Shards on disk: the training rows' tokens once, memory-mapped, + per-path row indices.

Layout of ``out_dir``::

    tokens/            every row assigned to >= 1 path, as a token directory
                       (router.tokens: tokens.bin int32 memmap + offsets.npy)
    shard_index.npz    CSR over paths: rows[offsets[p]:offsets[p+1]] are path p's rows
                       (indices into tokens/; overlapping when top_k > 1)
    shards.json        manifest: documents and tokens per path, imbalance, warnings,
                       router format version, sha256 of shard_index.npz

Storing the rows once (not once per path) keeps disk use at 1x even with top-k overlap,
and :func:`load_shard` returns a :class:`~router.tokens.TokenDocs` view over the memmap:
loading a shard costs 16 bytes per document, whatever the corpus size.
"""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from .assign import balanced_assign_array
from .features import progress_bar
from .router import ROUTER_FORMAT_VERSION
from .storage import atomic_write_json, atomic_write_npz, load_npz_checked
from .tokens import TokenDocs, TokenDocsWriter, open_token_docs

if TYPE_CHECKING:  # datasets is imported lazily: `import router` stays fast
    import datasets

    from .router import Router

# 2: tokens/ memmap (1 stored an HF dataset under data/)
SHARDS_FORMAT_VERSION = 2
_TOKENS, _INDEX, _MANIFEST = "tokens", "shard_index.npz", "shards.json"
# Rows routed (prefixes featurized) per batch, and tokens copied per batch when writing
# shards: both bound memory on corpora larger than RAM.
BATCH_ROWS = 16_384
BATCH_TOKENS = 4 * 2**20
_REWRITE = "route again (dipaco-route, or dipaco-train resume=false into a new run dir)"


def _batches_of_rows(docs: Any, rows: np.ndarray, token_column: str):
    """Token ids of ``rows`` of ``docs`` (TokenDocs, HF dataset or list), in bounded batches."""
    if isinstance(docs, TokenDocs):
        # batches of at most BATCH_TOKENS tokens (or one longer document)
        ends = np.cumsum(docs.lengths[rows])
        lo = 0
        while lo < rows.size:
            base = ends[lo - 1] if lo else 0
            hi = max(lo + 1, int(np.searchsorted(ends, base + BATCH_TOKENS, side="right")))
            yield [docs[int(i)] for i in rows[lo:hi]]  # memmap views, copied once by the writer
            docs.release_pages()
            lo = hi
        return
    for lo in range(0, rows.size, BATCH_ROWS):
        chunk = rows[lo : lo + BATCH_ROWS]
        if hasattr(docs, "column_names"):  # an HF dataset: read only this batch's column
            yield docs.select(chunk.tolist())[token_column]
        else:
            yield [docs[int(i)] for i in chunk]


def as_path_array(assignments: "Sequence[Sequence[int]] | np.ndarray") -> np.ndarray:
    """Per-document path lists as one int array ``[N, k]``, ``-1`` where a row has fewer
    than ``k`` paths (a 2-D array is returned as is)."""
    if isinstance(assignments, np.ndarray) and assignments.ndim == 2:
        return assignments
    lists = [list(a) for a in assignments]
    k = max((len(a) for a in lists), default=0)
    out = np.full((len(lists), k), -1, np.int64)
    for row, a in enumerate(lists):
        out[row, : len(a)] = a
    return out


def write_shards(
    docs: "TokenDocs | datasets.Dataset | Sequence[Sequence[int]]",
    assignments: "Sequence[Sequence[int]] | np.ndarray",
    num_paths: int,
    out_dir: str | os.PathLike,
    *,
    token_column: str = "input_ids",
    warn_empty: bool = True,
) -> dict[str, Any]:
    """Write the shards of ``docs`` given each row's paths (``Router.assign`` output, or an
    int array ``[N, k]`` with ``-1`` for no path, as :func:`assign_in_batches` returns).

    ``warn_empty=False``: an empty shard is expected (a path's validation shard on a small
    corpus) and is only recorded in the manifest, without a warning.

    ``docs`` is a :class:`TokenDocs` (e.g. a memory-mapped corpus), an HF dataset with a
    ``token_column`` or a list of token id sequences; rows are copied in batches, so
    memory stays bounded whatever the corpus size. Rows assigned to no path are left out.
    Empty shards do not fail: they are listed in the manifest's ``empty_shards`` with a
    message in ``warnings`` (and a Python warning). Returns the manifest (also written
    to ``out_dir/shards.json``).
    """
    num_paths = int(num_paths)
    if num_paths < 1:
        raise ValueError(f"num_paths must be >= 1, got {num_paths}")
    if len(assignments) != len(docs):
        raise ValueError(
            f"assignments has {len(assignments)} entries but the dataset has {len(docs)} rows; "
            "pass one list of paths per row"
        )
    paths = as_path_array(assignments)
    valid = paths >= 0
    bad = np.flatnonzero((paths >= num_paths).any(axis=1) | (paths < -1).any(axis=1))
    if bad.size:
        row = int(bad[0])
        raise ValueError(f"assignments[{row}] has path {[int(q) for q in paths[row] if q != -1]} outside "
                         f"[0, {num_paths})")
    if paths.shape[1] > 1:  # a repeated path in one row
        ordered = np.sort(paths, axis=1)
        dup = np.flatnonzero(((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any(axis=1))
        if dup.size:
            row = int(dup[0])
            raise ValueError(f"assignments[{row}] repeats a path: {[int(q) for q in paths[row] if q >= 0]}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kept_rows = np.flatnonzero(valid.any(axis=1)).astype(np.int64)
    position = np.full(len(paths), -1, np.int64)
    position[kept_rows] = np.arange(kept_rows.size)
    # per path, its rows in ascending order: one pass over the [N, k] array per path
    # (a million documents: no int64 arrays of every membership and their argsort)
    per_path = [position[np.flatnonzero((paths == p).any(axis=1))] for p in range(num_paths)]
    sizes = np.array([r.size for r in per_path], np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    rows = np.concatenate(per_path).astype(np.int64) if per_path else np.zeros(0, np.int64)
    del per_path

    # The writer fills a temporary directory and renames it into place: a reader never
    # sees a half-written tokens/.
    writer = TokenDocsWriter(out / _TOKENS)
    try:
        for batch in _batches_of_rows(docs, kept_rows, token_column):
            writer.append(batch)
    except BaseException:
        writer.abort()
        raise
    lengths = writer.close().lengths
    tokens = [int(lengths[rows[offsets[p]:offsets[p + 1]]].sum()) for p in range(num_paths)]

    index_sha = atomic_write_npz(out / _INDEX, {"offsets": offsets, "rows": rows})
    empty = np.flatnonzero(sizes == 0).tolist()
    messages = [
        f"shard {p} is empty: no document was routed to path {p}; that path has no training data"
        for p in empty
    ]
    for msg in messages if warn_empty else []:
        warnings.warn(msg, stacklevel=2)
    mean = sizes.mean()
    manifest: dict[str, Any] = {
        "version": SHARDS_FORMAT_VERSION,
        "router_version": ROUTER_FORMAT_VERSION,
        "num_paths": num_paths,
        "num_rows": int(kept_rows.size),
        "documents_per_path": sizes.tolist(),
        "tokens_per_path": tokens,
        "imbalance": float(sizes.max() / mean) if mean > 0 else None,
        "empty_shards": empty,
        "warnings": messages,
        "files": {_INDEX: index_sha},
    }
    atomic_write_json(out / _MANIFEST, manifest)
    return manifest


def read_shards_manifest(out_dir: str | os.PathLike) -> dict[str, Any]:
    """The ``shards.json`` of ``out_dir`` (ValueError naming the file when missing or old)."""
    path = Path(out_dir) / _MANIFEST
    if not path.is_file():
        raise ValueError(f"missing {path}: not a shards directory (write_shards creates it)")
    manifest = json.loads(path.read_text())
    if manifest.get("version") != SHARDS_FORMAT_VERSION:
        raise ValueError(
            f"{path} has shards format {manifest.get('version')}, this version reads "
            f"{SHARDS_FORMAT_VERSION}. Fix: {_REWRITE}")
    return manifest


def load_shard(out_dir: str | os.PathLike, path_id: int) -> TokenDocs:
    """The documents of shard ``path_id``, memory-mapped (may be empty for an empty shard).

    A missing or corrupt token file raises a ValueError naming the file and the fix.
    """
    out = Path(out_dir)
    manifest = read_shards_manifest(out)
    p = int(path_id)
    if not 0 <= p < manifest["num_paths"]:
        raise ValueError(f"path_id must be in [0, {manifest['num_paths']}), got {path_id}")
    index = load_npz_checked(out / _INDEX, manifest["files"][_INDEX])
    # shards written before tokens.sha256 are vouched for by the run's record of shards.json
    data = open_token_docs(out / _TOKENS, fix=_REWRITE, require_checksum=False)
    if len(data) != manifest["num_rows"]:
        raise ValueError(
            f"corrupt {out / _TOKENS}: {len(data)} documents, {out / _MANIFEST} lists "
            f"{manifest['num_rows']}. Fix: {_REWRITE}")
    offsets, rows = index["offsets"], index["rows"]
    return data.select(rows[offsets[p] : offsets[p + 1]])


def read_assignments(out_dir: str | os.PathLike, replicas: int = 1) -> list[list[int]]:
    """The paths of each stored row, as written (the inverse of :func:`write_shards`).

    Rows are the documents that had at least one path, in order; with ``replicas`` R the
    training path ``t = p·R + r`` counts as grid path ``p`` (:func:`expand_replicas`).
    """
    out = Path(out_dir)
    manifest = read_shards_manifest(out)
    index = load_npz_checked(out / _INDEX, manifest["files"][_INDEX])
    offsets, rows = index["offsets"], index["rows"]
    paths: list[list[int]] = [[] for _ in range(manifest["num_rows"])]
    for t in range(manifest["num_paths"]):
        for row in rows[offsets[t] : offsets[t + 1]].tolist():
            paths[row].append(t // int(replicas))
    return [sorted(set(p)) for p in paths]


def assign_in_batches(router: "Router", docs: "TokenDocs | Sequence[Sequence[int]]", *,
                      batch_size: int = BATCH_ROWS, as_array: bool = False,
                      progress: bool | None = None) -> "list[list[int]] | np.ndarray":
    """``router.assign(docs)`` with costs computed ``batch_size`` documents at a time.

    Featurization memory is bounded by the batch; what is kept for all documents is the
    cost matrix ``[N, P]`` (the balanced assignment needs every document's costs at once
    to order them by confidence) and O(P) bytes each for the assignment itself
    (:func:`router.assign.balanced_assign_array`). Token documents are cut to the router's
    ``cluster_tokens`` as a view first and each batch of prefixes is read into memory, so
    no document is copied whole and no page of the memmap stays mapped.

    ``as_array``: return the int array ``[N, top_k]`` instead of per-document lists (a
    million lists of Python ints cost ~100 MB). ``progress``: a bar over the documents
    (None: on large inputs; drawn only when stderr is a terminal).
    """
    n = len(docs)
    if isinstance(docs, TokenDocs):
        docs = docs.prefixes(router.cluster_tokens)
    if n == 0:
        return np.zeros((0, router.top_k), np.int16) if as_array else []
    costs = None
    bar = progress_bar(n, progress, "route")
    for lo in range(0, n, batch_size):
        chunk = docs[lo : lo + batch_size]
        batch = router.shard_costs(chunk.in_memory() if isinstance(chunk, TokenDocs) else chunk)
        if costs is None:  # the router's dtype: a cast could reorder near-ties
            costs = np.empty((n, batch.shape[1]), batch.dtype)
        costs[lo : lo + batch_size] = batch
        if bar is not None:
            bar.update(len(batch))
    if bar is not None:
        bar.close()
    out = balanced_assign_array(costs, top_k=router.top_k, capacity_factor=router.capacity_factor,
                                balance=router.balance, soft_capacity_factor=router.soft_capacity_factor)
    return out if as_array else out.tolist()


__all__ = ["write_shards", "load_shard", "read_shards_manifest", "read_assignments", "assign_in_batches",
           "as_path_array", "SHARDS_FORMAT_VERSION"]


def expand_replicas(assignments: "list[list[int]] | np.ndarray", replicas: int,
                    seed: int) -> "list[list[int]] | np.ndarray":
    """Grid-path assignments → training-path assignments (``t = p·R + r``).

    Each document goes to one replica of each of its paths, drawn from a seeded hash of
    its row, so the replicas of a path split its shard into R disjoint random parts. An
    int array ``[N, k]`` (``-1``: no path) gives an array, lists give lists.
    """
    if replicas == 1:
        return assignments
    rng = np.random.default_rng(seed + 7919)
    draws = rng.integers(0, replicas, size=len(assignments))
    if isinstance(assignments, np.ndarray):
        a = assignments.astype(np.int64)
        return np.where(a >= 0, a * replicas + draws[:, None], -1)
    return [[p * replicas + int(r) for p in paths] for paths, r in zip(assignments, draws)]
