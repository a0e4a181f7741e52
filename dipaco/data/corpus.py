"""Load raw documents into one HF ``datasets.Dataset`` (the first box of the data flow).

The only module that loads data with ``datasets`` / ``pyarrow``. Every source goes through
the same tolerant path: a reader yields raw records, :class:`_Cleaner` checks each one
and either keeps it or counts why not, and the kept rows become a ``Dataset`` built with
explicit ``features=`` (so a corpus of odd rows never trips type inference).

Skip reasons counted in :attr:`Corpus.skipped`:

==================== ===========================================================
``blank_line``       an empty line of a JSON-lines file (not a document; counted for
                     the record)
``malformed_json``   a JSON-lines line (or a ``.json`` file) that does not parse or is
                     not an object
``non_utf8``         bytes that are not UTF-8 (also strings holding lone surrogates)
``binary``           text holding NUL bytes
``missing_text_field`` a record without ``data.text_field``
``not_a_string``     ``data.text_field`` holds a number, list, ...
``empty``            text that is empty or only whitespace (or null)
``too_short``        stripped text shorter than ``data.min_doc_chars``
``unreadable_file``  a parquet file that pyarrow cannot open
``truncated``        *kept*, cut to ``data.max_doc_chars``
``capped_by_max_documents`` left out by ``data.max_documents``
==================== ===========================================================
"""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import datasets

from dipaco.data.errors import DataError
from dipaco.data.splits import SPLITS, id_unit_interval, split_of

# Columns of every corpus: label is None when the source has no label.
DOCUMENT_FEATURES = datasets.Features(
    {
        "id": datasets.Value("string"),
        "text": datasets.Value("string"),
        "label": datasets.Value("string"),
        "split": datasets.Value("string"),
    }
)

LOCAL_SOURCES = ("jsonl", "json", "parquet", "text")
SOURCES = ("python_sources",) + LOCAL_SOURCES + ("hub",)

# file name endings picked up when data.path is a directory
_SUFFIXES = {
    "jsonl": (".jsonl", ".ndjson", ".json"),
    "json": (".json", ".jsonl", ".ndjson"),
    "parquet": (".parquet",),
    "text": None,  # every (non-hidden) file
}

Record = Dict[str, Any]


@dataclass
class Corpus:
    """The loaded documents and the record of what was left out.

    ``dataset`` has the columns ``id``, ``text``, ``label`` (string or None) and
    ``split`` (``train`` / ``validation`` / ``test``, see :func:`split_of`).
    """

    dataset: datasets.Dataset
    skipped: Dict[str, int] = field(default_factory=dict)
    num_documents: int = 0
    source: str = ""
    _split_cache: Dict[str, datasets.Dataset] = field(default_factory=dict, repr=False)

    def split(self, name: str) -> datasets.Dataset:
        """The documents of one split (``train``, ``validation`` or ``test``), in corpus order."""
        if name not in SPLITS:
            raise ValueError(f"unknown split {name!r}: use one of {', '.join(SPLITS)}")
        if name not in self._split_cache:
            column = self.dataset["split"]
            indices = [i for i, s in enumerate(column) if s == name]
            self._split_cache[name] = self.dataset.select(indices)
        return self._split_cache[name]

    @property
    def labels(self) -> List[str]:
        """Distinct non-null labels, sorted."""
        return sorted({x for x in self.dataset["label"] if x is not None})

    def summary(self) -> Dict[str, Any]:
        """JSON-ready numbers for reports and logs."""
        splits = list(self.dataset["split"])
        return {
            "source": self.source,
            "num_documents": self.num_documents,
            "num_labels": len(self.labels),
            "num_chars": sum(len(t) for t in self.dataset["text"]),
            "split_sizes": {s: splits.count(s) for s in SPLITS},
            "skipped": dict(self.skipped),
        }


# --------------------------------------------------------------------------- files


def _resolve_files(path: Optional[str], source: str) -> Tuple[List[str], str]:
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


def _rel(path: str, root: str) -> str:
    return os.path.relpath(os.path.abspath(path), os.path.abspath(root)).replace(os.sep, "/")


def _read_text_head(path: str, max_chars: int) -> Tuple[bytes, bool]:
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
# Each reader yields (default_id, record) pairs; a record is a dict of raw fields.


def _count(skipped: Dict[str, int], reason: str, n: int = 1) -> None:
    skipped[reason] = skipped.get(reason, 0) + n


def _iter_json_lines(path: str, rel: str, skipped: Dict[str, int]) -> Iterator[Tuple[str, Any]]:
    """Decode a JSON-lines file line by line: one bad line costs that line only."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            raw = raw.strip()
            if not raw:
                _count(skipped, "blank_line")
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                _count(skipped, "non_utf8")
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                _count(skipped, "malformed_json")
                continue
            if not isinstance(rec, dict):
                _count(skipped, "malformed_json")
                continue
            yield f"{rel}#{lineno}", rec


def _iter_json_file(
    path: str, rel: str, text_field: str, skipped: Dict[str, int]
) -> Iterator[Tuple[str, Any]]:
    """A ``.json`` file: a JSON array of objects, one object, or (fallback) JSON lines."""
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    if not head.startswith((b"[", b"{")):
        yield from _iter_json_lines(path, rel, skipped)
        return
    try:
        with open(path, "rb") as f:
            whole = json.loads(f.read().decode("utf-8"))
    except UnicodeDecodeError:
        _count(skipped, "non_utf8")
        return
    except ValueError:
        if head.startswith(b"{"):  # most likely JSON lines with a .json name
            yield from _iter_json_lines(path, rel, skipped)
        else:
            _count(skipped, "malformed_json")
        return
    if isinstance(whole, dict) and text_field not in whole:
        # {"data": [{...}, ...]}: the one list of objects inside is the table
        lists = [v for v in whole.values() if isinstance(v, list)]
        whole = lists[0] if len(lists) == 1 else [whole]
    elif isinstance(whole, dict):
        whole = [whole]
    if not isinstance(whole, list):
        _count(skipped, "malformed_json")
        return
    for i, rec in enumerate(whole):
        if isinstance(rec, dict):
            yield f"{rel}#{i}", rec
        else:
            _count(skipped, "malformed_json")


def _iter_parquet(
    path: str, rel: str, columns: List[str], skipped: Dict[str, int]
) -> Iterator[Tuple[str, Any]]:
    """Stream a parquet file in record batches, reading only the columns we use."""
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception:  # pyarrow raises several types for a damaged file
        _count(skipped, "unreadable_file")
        return
    present = [c for c in columns if c in pf.schema_arrow.names]
    row = 0
    for batch in pf.iter_batches(batch_size=1024, columns=present or None):
        for rec in batch.to_pylist():
            yield f"{rel}#{row}", rec
            row += 1


def _iter_hub(path: str, hub_config: Optional[str], hub_split: str,
              streaming: bool = False) -> Iterator[Tuple[str, Any]]:
    """A dataset on the Hugging Face hub (needs network; tests replace ``load_dataset``)."""
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


# --------------------------------------------------------------------------- cleaning


class _Cleaner:
    """Check raw records one by one, keep the usable ones, count the rest."""

    def __init__(self, cfg: Any, text_field: str, label_field: Optional[str], id_field: Optional[str]):
        self.text_field = text_field
        self.label_field = label_field
        self.id_field = id_field
        self.min_chars = int(getattr(cfg, "min_doc_chars", 0) or 0)
        self.max_chars = int(getattr(cfg, "max_doc_chars", 0) or 0)
        self.skipped: Dict[str, int] = {}
        self.rows: Dict[str, List[Any]] = {"id": [], "text": [], "label": []}
        self.seen_ids: Dict[str, int] = {}
        self.records = 0
        self.with_text_field = 0
        self.with_label_field = 0
        self.with_id_field = 0
        self.first_keys: Optional[List[str]] = None

    def add(self, default_id: str, rec: Record, truncated: bool = False) -> None:
        """Keep ``rec`` as a row or count why not (``truncated``: the reader already cut it)."""
        self.records += 1
        if self.first_keys is None:
            self.first_keys = list(rec.keys())
        if self.text_field not in rec:
            _count(self.skipped, "missing_text_field")
            return
        self.with_text_field += 1
        text = rec[self.text_field]
        if isinstance(text, (bytes, bytearray)):
            if b"\x00" in text:
                _count(self.skipped, "binary")
                return
            try:
                text = bytes(text).decode("utf-8")
            except UnicodeDecodeError:
                _count(self.skipped, "non_utf8")
                return
        elif text is None:
            _count(self.skipped, "empty")
            return
        elif not isinstance(text, str):
            _count(self.skipped, "not_a_string")
            return
        if "\x00" in text:
            _count(self.skipped, "binary")
            return
        try:
            text.encode("utf-8")  # JSON "\ud800" escapes give lone surrogates arrow rejects
        except UnicodeEncodeError:
            _count(self.skipped, "non_utf8")
            return
        stripped = text.strip()
        if not stripped:
            _count(self.skipped, "empty")
            return
        if len(stripped) < self.min_chars:
            _count(self.skipped, "too_short")
            return
        if truncated or (self.max_chars and len(text) > self.max_chars):
            _count(self.skipped, "truncated")
            if self.max_chars:
                text = text[: self.max_chars]
        label = None
        if self.label_field is not None and self.label_field in rec:
            self.with_label_field += 1
            value = rec[self.label_field]
            if isinstance(value, (bytes, bytearray)):
                value = bytes(value).decode("utf-8", "replace")
            label = None if value is None else str(value)
        doc_id = default_id
        if self.id_field is not None and rec.get(self.id_field) is not None:
            self.with_id_field += 1
            doc_id = str(rec[self.id_field])
        # ids must be unique (splits and shards are keyed by id): number repeats
        n = self.seen_ids.get(doc_id, 0)
        self.seen_ids[doc_id] = n + 1
        if n:
            doc_id = f"{doc_id}~{n + 1}"
        self.rows["id"].append(doc_id)
        self.rows["text"].append(text)
        self.rows["label"].append(label)


def _check_fields(c: _Cleaner, where: str) -> None:
    """Fail loudly when a configured key is absent from every record (a typo, not bad rows)."""
    keys = ", ".join(c.first_keys or []) or "none"
    if c.records and not c.with_text_field:
        raise DataError(
            f"data.text_field={c.text_field!r} is not a key of any record in {where} "
            f"(keys of the first record: {keys}). Fix: pass data.text_field=<one of those keys>"
        )
    if c.label_field is not None and c.with_text_field and not c.with_label_field:
        raise DataError(
            f"data.label_field={c.label_field!r} is not a key of any record in {where} "
            f"(keys of the first record: {keys}). Fix: pass data.label_field=<key> or data.label_field=null"
        )
    if c.id_field is not None and c.with_text_field and not c.with_id_field:
        raise DataError(
            f"data.id_field={c.id_field!r} is not a key of any record in {where} "
            f"(keys of the first record: {keys}). Fix: pass data.id_field=<key> or data.id_field=null"
        )


def _cap(rows: Dict[str, List[Any]], max_documents: Optional[int]) -> int:
    """Keep the ``max_documents`` rows with the smallest id hash, in corpus order.

    A hash sample (not the first N) so a capped stdlib corpus still spans every package,
    and the same ids are kept on every run. Returns how many rows were dropped.
    """
    n = len(rows["id"])
    if max_documents is None or n <= max_documents:
        return 0
    order = sorted(range(n), key=lambda i: (id_unit_interval(rows["id"][i], "max_documents"), i))
    keep = sorted(order[: int(max_documents)])
    for key in rows:
        rows[key] = [rows[key][i] for i in keep]
    return n - len(keep)


# --------------------------------------------------------------------------- entry point


def load_corpus(cfg: Any, *, progress: bool = True) -> Corpus:
    """Load the documents described by a ``DataConfig`` into a :class:`Corpus`.

    ``cfg.source`` picks the reader: ``python_sources`` (the built-in offline corpus),
    ``jsonl`` / ``json`` / ``parquet`` / ``text`` (local file, glob or directory; ``text``
    is one document per file) or ``hub`` (``load_dataset(path, hub_config, split=hub_split)``).
    Bad records are skipped and counted, never crashed on; a missing file, a key absent
    from every record or a corpus with no usable document raises :class:`DataError`.
    """
    from tqdm.auto import tqdm

    source = str(getattr(cfg, "source", "python_sources"))
    if source not in SOURCES:
        raise DataError(f"data.source={source!r} is unknown. Fix: use one of {', '.join(SOURCES)}")
    path = getattr(cfg, "path", None)
    max_chars = int(getattr(cfg, "max_doc_chars", 0) or 0)

    if source == "python_sources":
        from dipaco.data.python_sources import iter_python_sources, stdlib_root

        cleaner = _Cleaner(cfg, "text", "label", None)
        docs = iter_python_sources(
            exclude_packages=list(getattr(cfg, "exclude_packages", None) or ()),
            target_doc_chars=int(getattr(cfg, "target_doc_chars", 3000)),
            max_doc_chars=max_chars or 20000,
            skipped=cleaner.skipped,
            progress=progress,
        )
        for doc in docs:
            cleaner.add(doc.id, {"text": doc.text, "label": doc.label})
        where = f"the standard library at {stdlib_root()}"
    else:
        text_field = str(getattr(cfg, "text_field", "text"))
        label_field = getattr(cfg, "label_field", None)
        id_field = getattr(cfg, "id_field", None)
        if source == "text":  # one document per file: there are no fields to pick
            text_field, id_field = "text", None
        cleaner = _Cleaner(cfg, text_field, label_field, id_field)
        if source == "hub":
            if not path:
                raise DataError("data.path is not set for data.source=hub. Fix: pass data.path=<hub dataset name>")
            where = f"hub dataset {path}"
            streaming = bool(getattr(cfg, "streaming", False))
            cap = getattr(cfg, "max_documents", None) if streaming else None
            for default_id, rec in tqdm(
                _iter_hub(str(path), getattr(cfg, "hub_config", None), str(getattr(cfg, "hub_split", "train")),
                          streaming),
                desc="hub", unit="doc", disable=not progress,
            ):
                cleaner.add(default_id, rec)
                if cap is not None and len(cleaner.rows["id"]) >= cap:
                    break  # a stream has no end to sample from: its first N documents
        else:
            files, root = _resolve_files(path, source)
            where = f"data.path={path}"
            columns = [c for c in (text_field, label_field, id_field) if c]
            for f in tqdm(files, desc=f"load {source}", unit="file", disable=not progress):
                rel = _rel(f, root)
                if source == "text":
                    raw, truncated = _read_text_head(f, max_chars or 10**9)
                    cleaner.add(rel, {"text": raw}, truncated=truncated)
                    continue
                if source == "parquet":
                    records: Iterable[Tuple[str, Any]] = _iter_parquet(f, rel, columns, cleaner.skipped)
                elif source == "json":
                    records = _iter_json_file(f, rel, text_field, cleaner.skipped)
                else:
                    records = _iter_json_lines(f, rel, cleaner.skipped)
                for default_id, rec in records:
                    cleaner.add(default_id, rec)
        _check_fields(cleaner, where)

    rows = cleaner.rows
    skipped = cleaner.skipped
    dropped = _cap(rows, getattr(cfg, "max_documents", None))
    if dropped:
        skipped["capped_by_max_documents"] = dropped
    if not rows["id"]:
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(skipped.items())) or "no records at all"
        raise DataError(
            f"{where}: no usable document (skipped: {reasons}). "
            f"Fix: check data.source, data.text_field and data.min_doc_chars"
        )
    val = float(getattr(cfg, "val_fraction", 0.0))
    test = float(getattr(cfg, "test_fraction", 0.0))
    try:
        rows["split"] = [split_of(i, val, test) for i in rows["id"]]
    except ValueError as e:
        raise DataError(f"{e}. Fix: use e.g. data.val_fraction=0.05 data.test_fraction=0.05") from None
    dataset = datasets.Dataset.from_dict(rows, features=DOCUMENT_FEATURES)
    return Corpus(dataset=dataset, skipped=dict(sorted(skipped.items())),
                  num_documents=len(dataset), source=source)
