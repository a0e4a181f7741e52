"""Readers of raw records: local files (JSON lines, JSON, parquet, text) and the hub.

Each reader yields ``(default_id, record)`` pairs, a record being a dict of raw fields,
and counts what it cannot decode in a ``skipped`` dict (reasons listed in
:mod:`dipaco.data.corpus`, which checks the records and builds the corpus). One bad line
or file costs that line or file only.
"""
from __future__ import annotations

import glob
import json
import os
from typing import Any, Dict, Iterator, List, Optional, Tuple

import datasets
import pyarrow.parquet as pq

from dipaco.data.errors import DataError

__all__ = ["LOCAL_SOURCES", "count_skip", "iter_hub", "iter_json_file", "iter_json_lines", "iter_parquet",
           "read_text_head", "relative_id", "resolve_files"]

LOCAL_SOURCES = ("jsonl", "json", "parquet", "text")

# file name endings picked up when data.path is a directory
_SUFFIXES = {
    "jsonl": (".jsonl", ".ndjson", ".json"),
    "json": (".json", ".jsonl", ".ndjson"),
    "parquet": (".parquet",),
    "text": None,  # every (non-hidden) file
}


# --------------------------------------------------------------------------- files


def resolve_files(path: Optional[str], source: str) -> Tuple[List[str], str]:
    """Expand ``data.path`` (file, glob or directory) to sorted files and the root for ids."""
    if not path:
        raise DataError(
            f"data.path is not set but data.source={source} reads local files. "
            f"Fix: pass data.path=FILE, a glob or a directory"
        )
    path = os.path.expanduser(str(path))
    suffixes = _SUFFIXES[source]
    if os.path.isdir(path):
        files = []
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in sorted(filenames):
                if name.startswith("."):
                    continue
                if suffixes is None or name.lower().endswith(suffixes):
                    files.append(os.path.join(dirpath, name))
        if not files:
            wanted = "files" if suffixes is None else "/".join(f"*{s}" for s in suffixes)
            raise DataError(
                f"data.path={path}: the directory holds no {wanted} for data.source={source}. "
                f"Fix: point data.path at the data files or change data.source"
            )
        return sorted(files), path
    if os.path.isfile(path):
        return [path], os.path.dirname(path)
    if glob.has_magic(path):
        files = sorted(f for f in glob.glob(path, recursive=True) if os.path.isfile(f))
        if not files:
            raise DataError(f"data.path={path}: no file matches this pattern. Fix: check the pattern")
        root = os.path.commonpath([os.path.dirname(os.path.abspath(f)) for f in files])
        return files, root
    raise DataError(
        f"data.path={path}: no such file or directory. Fix: pass an existing file, glob or directory"
    )


def relative_id(path: str, root: str) -> str:
    """``path`` relative to ``root`` with ``/`` separators: the id prefix of its documents."""
    return os.path.relpath(os.path.abspath(path), os.path.abspath(root)).replace(os.sep, "/")


def read_text_head(path: str, max_chars: int) -> Tuple[bytes, bool]:
    """Read at most enough bytes for ``max_chars`` characters (huge files stay off the heap)."""
    limit = 4 * max_chars + 4  # a UTF-8 character is at most 4 bytes
    with open(path, "rb") as f:
        raw = f.read(limit + 1)
    if len(raw) <= limit:
        return raw, False
    raw = raw[:limit]
    # the cut may fall inside a multi-byte character: drop its partial bytes
    for k in range(4):
        try:
            (raw[: len(raw) - k] if k else raw).decode("utf-8")
            return (raw[: len(raw) - k] if k else raw), True
        except UnicodeDecodeError:
            continue
    return raw, True  # not UTF-8 anyway: the cleaner counts it


# --------------------------------------------------------------------------- readers


def count_skip(skipped: Dict[str, int], reason: str, n: int = 1) -> None:
    """Count one more record left out for ``reason`` (the table in :mod:`dipaco.data.corpus`)."""
    skipped[reason] = skipped.get(reason, 0) + n


def iter_json_lines(path: str, rel: str, skipped: Dict[str, int]) -> Iterator[Tuple[str, Any]]:
    """Decode a JSON-lines file line by line: one bad line costs that line only."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            raw = raw.strip()
            if not raw:
                count_skip(skipped, "blank_line")
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                count_skip(skipped, "non_utf8")
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                count_skip(skipped, "malformed_json")
                continue
            if not isinstance(rec, dict):
                count_skip(skipped, "malformed_json")
                continue
            yield f"{rel}#{lineno}", rec


def iter_json_file(
    path: str, rel: str, text_field: str, skipped: Dict[str, int]
) -> Iterator[Tuple[str, Any]]:
    """A ``.json`` file: a JSON array of objects, one object, or (fallback) JSON lines."""
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    if not head.startswith((b"[", b"{")):
        yield from iter_json_lines(path, rel, skipped)
        return
    try:
        with open(path, "rb") as f:
            whole = json.loads(f.read().decode("utf-8"))
    except UnicodeDecodeError:
        count_skip(skipped, "non_utf8")
        return
    except ValueError:
        if head.startswith(b"{"):  # most likely JSON lines with a .json name
            yield from iter_json_lines(path, rel, skipped)
        else:
            count_skip(skipped, "malformed_json")
        return
    if isinstance(whole, dict) and text_field not in whole:
        # {"data": [{...}, ...]}: the one list of objects inside is the table
        lists = [v for v in whole.values() if isinstance(v, list)]
        whole = lists[0] if len(lists) == 1 else [whole]
    elif isinstance(whole, dict):
        whole = [whole]
    if not isinstance(whole, list):
        count_skip(skipped, "malformed_json")
        return
    for i, rec in enumerate(whole):
        if isinstance(rec, dict):
            yield f"{rel}#{i}", rec
        else:
            count_skip(skipped, "malformed_json")


def iter_parquet(
    path: str, rel: str, columns: List[str], skipped: Dict[str, int]
) -> Iterator[Tuple[str, Any]]:
    """Stream a parquet file in record batches, reading only the columns we use."""
    try:
        pf = pq.ParquetFile(path)
    except Exception:  # pyarrow raises several types for a damaged file
        count_skip(skipped, "unreadable_file")
        return
    present = [c for c in columns if c in pf.schema_arrow.names]
    row = 0
    for batch in pf.iter_batches(batch_size=1024, columns=present or None):
        for rec in batch.to_pylist():
            yield f"{rel}#{row}", rec
            row += 1


def iter_hub(path: str, hub_config: Optional[str], hub_split: str,
             streaming: bool = False) -> Iterator[Tuple[str, Any]]:
    """A dataset on the Hugging Face hub (needs network; tests replace ``load_dataset``).
    ``streaming``: records arrive as read, so ``data.max_documents`` stops the download."""
    try:
        ds = datasets.load_dataset(path, hub_config, split=hub_split, streaming=streaming)
    except Exception as e:  # network, auth, unknown name, offline mode: all one message
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise DataError(
            f"data.path={path}: could not load hub dataset (config={hub_config}, "
            f"split={hub_split}): {type(e).__name__}: {first}. Fix: check the name, "
            f"data.hub_config and data.hub_split, and that the hub is reachable "
            f"(HF_DATASETS_OFFLINE unset), or use a local source such as data=jsonl"
        ) from None
    for i, rec in enumerate(ds):
        yield f"{hub_split}#{i}", rec
