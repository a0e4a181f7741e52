"""Shards on disk: one HF dataset of the training rows + per-path row indices.

Layout of ``out_dir``::

    data/              datasets.Dataset.save_to_disk of every row assigned to >= 1 path
    shard_index.npz    CSR over paths: rows[offsets[p]:offsets[p+1]] are path p's rows
                       (indices into data/; overlapping when top_k > 1)
    shards.json        manifest: documents and tokens per path, imbalance, warnings,
                       router format version, sha256 of shard_index.npz

Storing the rows once (not once per path) keeps disk use at 1x even with top-k overlap.
"""
from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from .router import ROUTER_FORMAT_VERSION
from .storage import atomic_write_json, atomic_write_npz, load_npz_checked

if TYPE_CHECKING:  # datasets is imported lazily: `import router` stays fast
    import datasets

SHARDS_FORMAT_VERSION = 1
_DATA, _INDEX, _MANIFEST = "data", "shard_index.npz", "shards.json"


def write_shards(
    dataset: "datasets.Dataset",
    assignments: Sequence[Sequence[int]],
    num_paths: int,
    out_dir: str | os.PathLike,
    *,
    token_column: str = "input_ids",
) -> dict[str, Any]:
    """Write the shards of ``dataset`` given each row's paths (``Router.assign`` output).

    Rows assigned to no path are left out. Empty shards do not fail: they are listed in
    the manifest's ``empty_shards`` with a message in ``warnings`` (and a Python warning).
    Returns the manifest (also written to ``out_dir/shards.json``).
    """
    num_paths = int(num_paths)
    if num_paths < 1:
        raise ValueError(f"num_paths must be >= 1, got {num_paths}")
    if len(assignments) != len(dataset):
        raise ValueError(
            f"assignments has {len(assignments)} entries but the dataset has {len(dataset)} rows; "
            "pass one list of paths per row"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kept_rows = [i for i, a in enumerate(assignments) if len(a)]
    position = {row: pos for pos, row in enumerate(kept_rows)}
    per_path: list[list[int]] = [[] for _ in range(num_paths)]
    for row, paths in enumerate(assignments):
        if len(set(paths)) != len(paths):
            raise ValueError(f"assignments[{row}] repeats a path: {list(paths)}")
        for p in paths:
            if not 0 <= int(p) < num_paths:
                raise ValueError(f"assignments[{row}] has path {p} outside [0, {num_paths})")
            per_path[int(p)].append(position[row])
    sizes = np.array([len(r) for r in per_path], np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    rows = np.array([r for rs in per_path for r in rs], np.int64)

    subset = dataset.select(kept_rows)
    tokens = None
    if token_column in subset.column_names:
        lengths = np.array([len(x) for x in subset[token_column]], np.int64)
        tokens = [int(lengths[np.asarray(r, np.int64)].sum()) if r else 0 for r in per_path]

    # Save next to the target, then swap in: a reader never sees a half-written data/.
    tmp = out / f".{_DATA}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    # num_proc=None: in datasets 5.x even num_proc=1 starts a spawn pool that re-imports
    # __main__ (a script without a main guard would run again); None writes in-process.
    subset.save_to_disk(str(tmp), num_proc=None)
    final = out / _DATA
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)

    index_sha = atomic_write_npz(out / _INDEX, {"offsets": offsets, "rows": rows})
    empty = np.flatnonzero(sizes == 0).tolist()
    messages = [
        f"shard {p} is empty: no document was routed to path {p}; that path has no training data"
        for p in empty
    ]
    for msg in messages:
        warnings.warn(msg, stacklevel=2)
    mean = sizes.mean()
    manifest: dict[str, Any] = {
        "version": SHARDS_FORMAT_VERSION,
        "router_version": ROUTER_FORMAT_VERSION,
        "num_paths": num_paths,
        "num_rows": len(kept_rows),
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
    """The ``shards.json`` of ``out_dir`` (ValueError naming the file when missing)."""
    import json

    path = Path(out_dir) / _MANIFEST
    if not path.is_file():
        raise ValueError(f"missing {path}: not a shards directory (write_shards creates it)")
    return json.loads(path.read_text())


def load_shard(out_dir: str | os.PathLike, path_id: int) -> "datasets.Dataset":
    """The rows of shard ``path_id`` (may be an empty dataset for an empty shard)."""
    import datasets  # lazy: `import router` stays fast (see the TYPE_CHECKING import)

    out = Path(out_dir)
    manifest = read_shards_manifest(out)
    p = int(path_id)
    if not 0 <= p < manifest["num_paths"]:
        raise ValueError(f"path_id must be in [0, {manifest['num_paths']}), got {path_id}")
    index = load_npz_checked(out / _INDEX, manifest["files"][_INDEX])
    data = datasets.load_from_disk(str(out / _DATA))
    offsets, rows = index["offsets"], index["rows"]
    return data.select(rows[offsets[p] : offsets[p + 1]].tolist())


__all__ = ["write_shards", "load_shard", "read_shards_manifest", "SHARDS_FORMAT_VERSION"]


def expand_replicas(assignments: list[list[int]], replicas: int, seed: int) -> list[list[int]]:
    """Grid-path assignments → training-path assignments (``t = p·R + r``).

    Each document goes to one replica of each of its paths, drawn from a seeded hash of
    its row, so the replicas of a path split its shard into R disjoint random parts.
    """
    if replicas == 1:
        return assignments
    rng = np.random.default_rng(seed + 7919)
    draws = rng.integers(0, replicas, size=len(assignments))
    return [[p * replicas + int(r) for p in paths] for paths, r in zip(assignments, draws)]
