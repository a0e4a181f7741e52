"""Readers of raw records: local files (JSON lines, JSON, parquet, text), a ``save_to_disk``
folder and a Hugging Face dataset by name, streamed or not.

Each reader yields ``(default_id, record)`` pairs, a record being a dict of raw fields,
and counts what it cannot decode in a ``skipped`` dict (the reasons are listed in
:mod:`dipaco.data.corpus`). One bad line, element or file costs that line, element or
file only; nothing is read whole: lines are read one by one (at most
:data:`MAX_LINE_BYTES` each), a JSON array element by element, parquet and Arrow files
batch by batch. With :mod:`dipaco.data.corpus`, the only module that reads raw data with
``datasets`` / ``pyarrow``; which files are read is :mod:`dipaco.data.files`'s rule.
"""
from __future__ import annotations

import codecs
import json
import os
from typing import Any, Dict, Iterator, List, Optional, Tuple

from dipaco.data.errors import DataError
from dipaco.data.files import open_regular

__all__ = ["MAX_LINE_BYTES", "count_skip", "iter_dataset", "iter_json_file", "iter_json_lines",
           "iter_parquet", "open_datasets", "read_text_head"]

# A JSON line longer than this is skipped (``line_too_long``) without being held whole:
# a binary file or a runaway line must not take the memory with it.
MAX_LINE_BYTES = 64 * 2**20
# A .json file whose top level is an object ({"data": [...]}) is parsed whole up to this
# size; a larger one is read as JSON lines. A top-level array is streamed at any size.
MAX_JSON_OBJECT_BYTES = 256 * 2**20
_CHUNK = 1 << 20
# the split names a dataset's own validation split goes by, in the order they are looked for
_VALIDATION_NAMES = ("validation", "valid", "dev", "val")


def count_skip(skipped: Dict[str, int], reason: str, n: int = 1) -> None:
    """Count one more record left out for ``reason`` (the table in :mod:`dipaco.data.corpus`)."""
    skipped[reason] = skipped.get(reason, 0) + n


def _bom(head: bytes) -> Tuple[int, bool]:
    """(bytes of a UTF-8 byte-order mark to skip, whether the file is UTF-16/32 instead)."""
    if head.startswith((codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE, codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        return 0, True
    return (len(codecs.BOM_UTF8), False) if head.startswith(codecs.BOM_UTF8) else (0, False)


def _decode_object(raw: bytes, skipped: Dict[str, int]) -> Optional[Dict[str, Any]]:
    """One JSON object from one line's bytes, or None with the reason counted."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        count_skip(skipped, "non_utf8")
        return None
    try:
        rec = json.loads(text)
    except RecursionError:  # [[[[...]]]] deeper than the parser's stack
        count_skip(skipped, "nested_too_deep")
        return None
    except ValueError:
        count_skip(skipped, "malformed_json")
        return None
    if not isinstance(rec, dict):
        count_skip(skipped, "malformed_json")
        return None
    return rec


def iter_json_lines(path: str, rel: str, skipped: Dict[str, int]) -> Iterator[Tuple[str, Any]]:
    """Decode a JSON-lines file line by line: one bad line costs that line only."""
    f = open_regular(path)
    if f is None:
        count_skip(skipped, "unreadable_file")
        return
    with f:
        skip, wide = _bom(f.read(4))
        if wide:  # UTF-16/32: every line would be garbage; the file is one count
            count_skip(skipped, "unsupported_encoding")
            return
        f.seek(skip)
        lineno = 0
        try:
            while True:
                raw = f.readline(MAX_LINE_BYTES + 1)
                if not raw:
                    break
                lineno += 1
                if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                    while raw and not raw.endswith(b"\n"):  # drop the rest of the line unread
                        raw = f.readline(_CHUNK)
                    count_skip(skipped, "line_too_long")
                    continue
                raw = raw.strip()
                if not raw:
                    count_skip(skipped, "blank_line")
                    continue
                rec = _decode_object(raw, skipped)
                if rec is not None:
                    yield f"{rel}#{lineno}", rec
        except OSError:  # an I/O error mid-file: what was read stays
            count_skip(skipped, "unreadable_file")


def iter_json_file(path: str, rel: str, text_field: str, skipped: Dict[str, int]) -> Iterator[Tuple[str, Any]]:
    """A ``.json`` file: a JSON array of objects (streamed), one object, an object holding
    one list of objects, or (fallback) JSON lines."""
    f = open_regular(path)
    if f is None:
        count_skip(skipped, "unreadable_file")
        return
    with f:
        head = f.read(4096)
        skip, wide = _bom(head)
        if wide:
            count_skip(skipped, "unsupported_encoding")
            return
        first = head[skip:].lstrip()[:1]
        size = os.fstat(f.fileno()).st_size
        if first == b"[":
            f.seek(skip)
            yield from _iter_array(f, rel, skipped)
            return
        if first != b"{" or size > MAX_JSON_OBJECT_BYTES:
            f.close()
            yield from iter_json_lines(path, rel, skipped)
            return
        f.seek(skip)
        try:
            whole = json.loads(f.read().decode("utf-8"))
        except UnicodeDecodeError:
            count_skip(skipped, "non_utf8")
            return
        except RecursionError:
            count_skip(skipped, "nested_too_deep")
            return
        except ValueError:  # most likely JSON lines with a .json name
            whole = None
    if whole is None:
        yield from iter_json_lines(path, rel, skipped)
        return
    if isinstance(whole, dict) and text_field not in whole:
        # {"data": [{...}, ...]}: the one list of objects inside is the table
        lists = [v for v in whole.values() if isinstance(v, list)]
        whole = lists[0] if len(lists) == 1 else [whole]
    elif isinstance(whole, dict):
        whole = [whole]
    for i, rec in enumerate(whole):
        if isinstance(rec, dict):
            yield f"{rel}#{i}", rec
        else:
            count_skip(skipped, "malformed_json")


def _iter_array(f: Any, rel: str, skipped: Dict[str, int]) -> Iterator[Tuple[str, Any]]:
    """The elements of a top-level JSON array, decoded one at a time from a sliding buffer.

    An element that does not parse ends the file (an array cannot be resynchronised):
    counted once as ``malformed_json`` (``nested_too_deep``, ``non_utf8``), the elements
    before it stay. An element longer than :data:`MAX_LINE_BYTES` counts as ``line_too_long``.
    """
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")()
    buf, pos, eof, i = "", 0, False, 0

    def more() -> bool:
        nonlocal buf, pos, eof
        chunk = f.read(_CHUNK)
        eof = not chunk
        buf = buf[pos:] + utf8.decode(chunk, final=eof)
        pos = 0
        return not eof

    try:
        more()
        pos = buf.index("[") + 1
        while True:
            while True:  # whitespace and one separating comma
                while pos < len(buf) and buf[pos] in " \t\r\n":
                    pos += 1
                if pos < len(buf) or not more():
                    break
            if pos >= len(buf):
                count_skip(skipped, "malformed_json")  # the array never closes
                return
            if buf[pos] == "]":
                return
            if buf[pos] == "," and i:
                pos += 1
                continue
            while True:
                try:
                    rec, end = decoder.raw_decode(buf, pos)
                    break
                except json.JSONDecodeError:
                    if len(buf) - pos > MAX_LINE_BYTES:
                        count_skip(skipped, "line_too_long")
                        return
                    if not more():
                        count_skip(skipped, "malformed_json")
                        return
            pos = end
            if isinstance(rec, dict):
                yield f"{rel}#{i}", rec
            else:
                count_skip(skipped, "malformed_json")
            i += 1
            if pos > _CHUNK:
                buf, pos = buf[pos:], 0
    except UnicodeDecodeError:
        count_skip(skipped, "non_utf8")
    except RecursionError:
        count_skip(skipped, "nested_too_deep")
    except OSError:
        count_skip(skipped, "unreadable_file")


def iter_parquet(path: str, rel: str, columns: List[str], skipped: Dict[str, int]) -> Iterator[Tuple[str, Any]]:
    """Stream a parquet file in record batches, reading only the columns we use."""
    import pyarrow.parquet as pq  # pyarrow loads only where parquet is read

    f = open_regular(path)
    if f is None:
        count_skip(skipped, "unreadable_file")
        return
    with f:
        row = 0
        try:
            pf = pq.ParquetFile(f)
            present = [c for c in columns if c in pf.schema_arrow.names]
            for batch in pf.iter_batches(batch_size=1024, columns=present or None):
                for rec in batch.to_pylist():
                    yield f"{rel}#{row}", rec
                    row += 1
        except Exception:  # pyarrow raises several types for a damaged file: the rest of it is lost
            count_skip(skipped, "unreadable_file")


def read_text_head(path: str, max_chars: int) -> Tuple[Optional[bytes], bool]:
    """Read at most enough bytes for ``max_chars`` characters (huge files stay off the heap);
    ``(None, False)`` when the file cannot be opened as a regular file."""
    limit = 4 * max_chars + 4  # a UTF-8 character is at most 4 bytes
    f = open_regular(path)
    if f is None:
        return None, False
    try:
        with f:
            raw = f.read(limit + 1)
    except OSError:
        return None, False
    if raw.startswith(codecs.BOM_UTF8):
        raw = raw[len(codecs.BOM_UTF8):]
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


# --------------------------------------------------------------------------- datasets


def is_saved_dataset(path: str) -> bool:
    """A folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``."""
    return os.path.isfile(os.path.join(path, "dataset_dict.json")) or (
        os.path.isfile(os.path.join(path, "state.json")) and os.path.isfile(os.path.join(path, "dataset_info.json")))


def open_datasets(path: str, hub_config: Optional[str], hub_split: str, streaming: bool,
                  own_splits: bool) -> Dict[str, Any]:
    """The dataset(s) ``data.path`` names, by corpus split: ``{"train": ds}`` and, with
    ``own_splits`` and a dataset that has them, ``"validation"`` / ``"test"``.

    A ``save_to_disk`` folder loads with ``datasets.load_from_disk`` (no network);
    anything else with ``datasets.load_dataset`` (a hub name, or a local folder of data
    files). Failures are one :class:`DataError`."""
    import datasets  # heavy (pyarrow, pandas): only where a dataset is opened

    if path.startswith(("/", "./", "../", "~")) and not os.path.exists(os.path.expanduser(path)):
        # a hub name never starts so: a mistyped local path must not read as a network fault
        raise DataError(f"data.path={path} does not exist. Fix: point data.path at the dataset folder "
                        f"(or give a hub dataset name)")
    saved = os.path.isdir(path) and is_saved_dataset(path)
    try:
        if saved:
            loaded = datasets.load_from_disk(path)
        else:
            loaded = datasets.load_dataset(path, hub_config, split=None if own_splits else hub_split,
                                           streaming=streaming)
    except Exception as e:  # network, auth, unknown name, offline mode, a damaged folder: all one message
        first = (str(e).strip().splitlines() or [""])[0]
        if saved:
            raise DataError(f"data.path={path}: the save_to_disk folder cannot be loaded ({type(e).__name__}: "
                            f"{first}). Fix: save it again with Dataset.save_to_disk") from None
        raise DataError(
            f"data.path={path}: could not load hub dataset (config={hub_config}, split={hub_split}): "
            f"{type(e).__name__}: {first}. Fix: check the name, data.hub_config and data.hub_split, and that the "
            f"hub is reachable (HF_DATASETS_OFFLINE unset), or use a local source such as data=jsonl") from None
    if not isinstance(loaded, (datasets.DatasetDict, datasets.IterableDatasetDict, dict)):
        return {"train": loaded}
    names = list(loaded)
    if hub_split not in loaded:
        raise DataError(f"data.path={path} has no split {hub_split!r} (it has {', '.join(names)}). "
                        f"Fix: pass data.hub_split=<one of those>")
    out = {"train": loaded[hub_split]}
    if own_splits:
        val = next((n for n in _VALIDATION_NAMES if n in loaded and n != hub_split), None)
        if val is not None:
            out["validation"] = loaded[val]
        if "test" in loaded and hub_split != "test":
            out["test"] = loaded["test"]
    return out


def iter_dataset(ds: Any, prefix: str, columns: List[str], skipped: Dict[str, int]) -> Iterator[Tuple[str, Any]]:
    """Records of one ``datasets`` split, ids ``<prefix>#<row>``.

    A map-style dataset whose rows are its Arrow files (no indices mapping) is read file
    by file with pyarrow's stream reader: batch by batch, with ordinary reads, so the
    pages read do not stay mapped (iterating the memory-mapped table would keep every page
    it touched in the process's RSS). Other datasets, streamed ones included, are
    iterated. A failure mid-way costs the rest of that split (``unreadable_shard``).
    """
    import datasets
    import pyarrow as pa

    row = 0
    try:
        files = [c["filename"] for c in getattr(ds, "cache_files", None) or []]
        if files and isinstance(ds, datasets.Dataset) and getattr(ds, "_indices", None) is None:
            for name in files:
                with pa.OSFile(name) as source:
                    reader = pa.ipc.open_stream(source)
                    keep = [c for c in columns if c in reader.schema.names] or None
                    for batch in reader:
                        for rec in (batch.select(keep) if keep else batch).to_pylist():
                            yield f"{prefix}#{row}", rec
                            row += 1
            return
        for rec in ds:
            yield f"{prefix}#{row}", rec
            row += 1
    except DataError:
        raise
    except Exception:  # a damaged shard, a dropped connection: what was read stays
        count_skip(skipped, "unreadable_shard")
