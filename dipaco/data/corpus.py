"""Load raw documents into a corpus on disk, in bounded memory (the first box of the data flow).

Every source goes through the same streaming path: a reader (:mod:`dipaco.data.readers`)
yields raw records, :class:`~dipaco.data.cleaning.Cleaner` keeps each usable one or
counts why not, each document gets its split, and batches of documents are appended to
a text store on disk (:mod:`dipaco.data.textstore`). The text of the corpus is never
held in memory as a whole: what stays is a few dozen bytes per document (offsets, label
and split codes). With :mod:`dipaco.data.readers`, the only place that touches
``datasets`` / ``pyarrow``.

Splits (``data.splits``): ``hash`` gives each document the split of a hash of its group
(:func:`split_of`); ``auto`` (the default) keeps a source's **own** validation and test
splits where it has them (a hub dataset's or ``save_to_disk`` folder's splits, local
files under ``validation/`` or named ``test.jsonl``: :func:`dipaco.data.files.file_split`)
and draws by hash only the splits it lacks, from its training part.

Skip reasons counted in :attr:`Corpus.skipped`:

====================== ===========================================================
``blank_line``         an empty line of a JSON-lines file (not a document)
``malformed_json``     a line (or a ``.json`` element or file) that does not parse or is
                       not an object
``nested_too_deep``    JSON nested deeper than the parser's stack
``line_too_long``      a JSON line (or array element) over 64 MiB, skipped unread
``non_utf8``           bytes that are not UTF-8, or a string field holding lone surrogates
``unsupported_encoding`` a file starting with a UTF-16/32 byte-order mark (one per file)
``binary``             text holding NUL bytes
``missing_text_field`` a record without ``data.text_field``
``not_a_string``       ``data.text_field`` holds a number, list, ...
``bad_label``          ``data.label_field`` (``bad_id``, ``bad_group``: the id or group
                       field) holds a list or an object
``empty``              text that is empty or only whitespace (or null)
``too_short``          stripped text shorter than ``data.min_doc_chars``
``unreadable_file``    a file that cannot be opened or read (a damaged parquet file)
``unreadable_shard``   a ``datasets`` split that failed mid-way (the rest of it)
``not_a_regular_file`` a FIFO, device, socket, directory matched by a glob, or broken or
                       looping symlink under ``data.path``
``missing_label``      *kept*, without a label: ``data.label_field`` absent or null
``truncated``          *kept*, cut to ``data.max_doc_chars``
``capped_by_max_documents`` left out by ``data.max_documents``
====================== ===========================================================

``data.max_train_documents`` (and ``data.documents_per_path``, which sets it) is not a skip:
every document stays in the corpus and :meth:`Corpus.split` hands out a hash sample of the
training split, so validation, test and the tokenizer's text do not depend on it.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Tuple

import numpy as np

from dipaco.data.cleaning import Cleaner, Document, check_fields
from dipaco.data.errors import DataError
from dipaco.data.files import file_split, relative_id, resolve_files
from dipaco.config.names import DATA_SOURCES, load
from dipaco.data.readers import iter_dataset, open_datasets
from dipaco.data.sources import FileContext
from dipaco.data.splits import SPLITS, id_unit_interval, split_of
from dipaco.data.textstore import Documents, TextStore, TextStoreWriter, document_features, new_store_dir
from dipaco.runtime.progress import progress_bar

if TYPE_CHECKING:  # the type only: dipaco.config pulls in modules (torch), which loading text never needs
    from dipaco.config import DataConfig

# Columns of every corpus: label is None when the source has no label; group is the
# document family the split is keyed by (the source file of a chunk; the id by default).
DOCUMENT_FEATURES = document_features()

# what load_corpus reads: every registered source but pre-tokenized files (the job reads those)
SOURCES = tuple(n for n, s in DATA_SOURCES.items() if s.kind != "tokens")
SPLIT_MODES = ("auto", "hash")
_WRITE_BATCH = 1024  # documents buffered before they go to the store

# one part of a source: (its own split or None, records as (default id, record, truncated))
Part = Tuple[Optional[str], Iterable[Tuple[str, Dict[str, Any], bool]]]


@dataclass(eq=False)
class Corpus:
    """The loaded documents (on disk, :class:`Documents` views) and the record of what was left out.

    ``rows``: the store rows of the corpus (all, or the ``data.max_documents`` sample).
    ``own_splits``: the splits the source itself provided (``data.splits=auto``).
    ``max_train_documents``: :meth:`split` returns that many training documents, the ones
    with the smallest id hash (``data.max_train_documents``); None: all of them.
    """

    store: TextStore
    rows: np.ndarray
    skipped: Dict[str, int] = field(default_factory=dict)
    source: str = ""
    max_train_documents: Optional[int] = None
    own_splits: Tuple[str, ...] = ()
    _split_cache: Dict[str, Documents] = field(default_factory=dict, repr=False)

    @property
    def num_documents(self) -> int:
        return int(self.rows.size)

    @property
    def dataset(self) -> Documents:
        """Every document of the corpus, in corpus order."""
        return Documents(self.store, self.rows)

    def split(self, name: str, *, whole: bool = False) -> Documents:
        """The documents of one split (``train``, ``validation`` or ``test``), in corpus order.

        ``train`` is the ``max_train_documents`` sample unless ``whole=True`` (what the
        tokenizer is trained on: runs that train on samples of different sizes, as a paths
        sweep does, then share one tokenizer, so their perplexities are per the same tokens).
        """
        if name not in SPLITS:
            raise ValueError(f"unknown split {name!r}: use one of {', '.join(SPLITS)}")
        sampled = name == "train" and not whole and self.max_train_documents is not None
        key = "train_sample" if sampled else name
        if key not in self._split_cache:
            rows = self.rows[self.store.split_codes[self.rows] == SPLITS.index(name)]
            if sampled and rows.size > int(self.max_train_documents):  # type: ignore[arg-type]
                ids = self.store.read("id", rows)
                keys = np.fromiter((id_unit_interval(i, "max_train_documents") for i in ids), np.float64, len(ids))
                order = np.lexsort((np.arange(rows.size), keys))
                rows = np.sort(rows[order[: int(self.max_train_documents)]])  # type: ignore[misc]
            self._split_cache[key] = Documents(self.store, rows)
        return self._split_cache[key]

    @property
    def labels(self) -> List[str]:
        """Distinct non-null labels, sorted."""
        codes = np.unique(self.store.label_codes[self.rows])
        return sorted(self.store.label_names[c] for c in codes.tolist() if c >= 0)

    def summary(self) -> Dict[str, Any]:
        """JSON-ready numbers for reports and logs (reads the corpus once)."""
        docs = self.dataset
        groups, chars = set(), 0
        for batch in docs.iter_batches():
            groups.update(self.store.read("group", docs.rows[batch]))
            chars += sum(map(len, self.store.read("text", docs.rows[batch])))
        codes = self.store.split_codes[self.rows]
        return {
            "source": self.source,
            "num_documents": self.num_documents,
            "num_labels": len(self.labels),
            "num_groups": len(groups),
            "num_chars": chars,
            "split_sizes": {s: int((codes == i).sum()) for i, s in enumerate(SPLITS)},
            "train_sample": len(self.split("train")) if self.max_train_documents is not None else None,
            "own_splits": list(self.own_splits),
            "skipped": dict(self.skipped),
        }

    def close(self) -> None:
        """Delete the store now (it is deleted anyway when the last view of it is gone)."""
        self.store.close()

    def __enter__(self) -> "Corpus":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# --------------------------------------------------------------------------- sources


def _builtin_parts(cfg: "DataConfig", source: str, cleaner: Cleaner, progress: bool) -> Tuple[List[Part], str]:
    records, where = load(DATA_SOURCES[source].reader)(cfg, cleaner.skipped, progress)
    return [(None, records)], where


def _file_parts(cfg: "DataConfig", source: str, cleaner: Cleaner, own: bool) -> List[Part]:
    files, root = resolve_files(cfg.path, source, cleaner.skipped)
    single = os.path.isfile(os.path.expanduser(str(cfg.path)))
    columns = [c for c in (cleaner.text_field, cleaner.label_field, cleaner.id_field, cleaner.group_field) if c]
    read = load(DATA_SOURCES[source].reader)
    ctx = FileContext(columns, cleaner.text_field, cleaner.skipped, int(cfg.max_doc_chars or 0))
    parts: List[Part] = []
    for f in files:
        rel = relative_id(f, root)
        # a file named test.jsonl given alone is the corpus, not its test split
        split = file_split(rel) if own and not single else None
        parts.append((split, read(f, rel, ctx)))
    return parts


def _dataset_parts(cfg: "DataConfig", cleaner: Cleaner, own: bool) -> List[Part]:
    if not cfg.path:
        raise DataError("data.path is not set for data.source=hub. Fix: pass data.path=<hub dataset name or "
                        "a save_to_disk folder>")
    splits = open_datasets(str(cfg.path), cfg.hub_config, str(cfg.hub_split), bool(cfg.streaming), own)
    columns = [c for c in (cleaner.text_field, cleaner.label_field, cleaner.id_field, cleaner.group_field) if c]
    parts: List[Part] = []
    for name, ds in splits.items():
        prefix = str(cfg.hub_split) if name == "train" else name
        records = ((i, r, False) for i, r in iter_dataset(ds, prefix, columns, cleaner.skipped))
        parts.append((name if own else None, records))
    return parts


# --------------------------------------------------------------------------- entry point


def load_corpus(cfg: "DataConfig", *, progress: bool = True, work_dir: Optional[str] = None) -> Corpus:
    """Load the documents described by ``cfg`` (the ``data`` group of the config) into a :class:`Corpus`.

    ``cfg.source`` picks the reader: ``python_sources`` / ``multidomain`` (the built-in
    offline corpora), ``jsonl`` / ``json`` / ``parquet`` / ``text`` (local file, glob or
    directory; ``text`` is one document per file) or ``hub`` (a hub dataset by name,
    streamed with ``data.streaming``, or a ``save_to_disk`` folder). The documents go to a
    text store under ``work_dir`` (default: the system's temporary directory), deleted
    when the corpus is closed. Bad records are skipped and counted, never crashed on; a
    missing file, a key absent from every record or a corpus with no usable document
    raises :class:`DataError`.
    """
    source = str(cfg.source)
    if source not in DATA_SOURCES or DATA_SOURCES[source].kind == "tokens":  # the registry as it is now
        names = [n for n, s in DATA_SOURCES.items() if s.kind != "tokens"]
        raise DataError(f"data.source={source!r} is unknown. Fix: use one of {', '.join(names)}")
    mode = str(getattr(cfg, "splits", "auto") or "auto")
    if mode not in SPLIT_MODES:
        raise DataError(f"data.splits={mode!r} is unknown. Fix: use one of {', '.join(SPLIT_MODES)}")
    val, test = float(cfg.val_fraction), float(cfg.test_fraction)
    try:
        split_of("", val, test)
    except ValueError as e:
        raise DataError(f"{e}. Fix: use e.g. data.val_fraction=0.05 data.test_fraction=0.05") from None
    kind = DATA_SOURCES[source].kind
    builtin = kind == "builtin"
    if builtin:
        cleaner = Cleaner(cfg, "text", "label", None, "group", unique_ids=True)
        parts, where = _builtin_parts(cfg, source, cleaner, progress)
    else:
        text_field, id_field, group_field = str(cfg.text_field), cfg.id_field, getattr(cfg, "group_field", None)
        if DATA_SOURCES[source].whole_file:  # one document per file (its own group): no fields to pick
            text_field, id_field, group_field = "text", None, None
        cleaner = Cleaner(cfg, text_field, cfg.label_field, id_field, group_field)
        if kind == "hub":
            parts, where = _dataset_parts(cfg, cleaner, mode == "auto"), f"hub dataset {cfg.path}"
        else:
            parts, where = _file_parts(cfg, source, cleaner, mode == "auto"), f"data.path={cfg.path}"
    own = tuple(s for s in SPLITS if any(p[0] == s for p in parts) and s != "train")
    # the training part gives up a share to each split the source does not have
    fractions = (0.0 if "validation" in own else val, 0.0 if "test" in own else test)
    streamed_cap = cfg.max_documents if kind == "hub" and bool(cfg.streaming) else None
    directory = new_store_dir(work_dir)
    writer = TextStoreWriter(directory)
    try:
        _ingest(parts, cleaner, writer, fractions, streamed_cap,
                progress_bar(progress, total=None, desc=f"load {source}", unit="doc"))
        if not builtin:
            check_fields(cleaner, where)
        store = writer.close()
    except BaseException:
        writer.abort()
        shutil.rmtree(directory, ignore_errors=True)
        raise
    skipped = cleaner.skipped
    rows = np.arange(len(store), dtype=np.int64)
    if streamed_cap is None and cfg.max_documents is not None and rows.size > int(cfg.max_documents):
        # a hash sample (not the first N) so a capped stdlib corpus still spans every
        # package, and the same ids are kept on every run; of documents, not groups:
        # splits are keyed by group whatever is sampled
        ids = store.read("id", rows)
        keys = np.fromiter((id_unit_interval(i, "max_documents") for i in ids), np.float64, len(ids))
        keep = np.sort(np.lexsort((rows, keys))[: int(cfg.max_documents)])
        skipped["capped_by_max_documents"] = int(rows.size - keep.size)
        rows = rows[keep]
    if not rows.size:
        store.close()
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(skipped.items())) or "no records at all"
        raise DataError(f"{where}: no usable document (skipped: {reasons}). "
                        f"Fix: check data.source, data.text_field and data.min_doc_chars")
    return Corpus(store=store, rows=rows, skipped=dict(sorted(skipped.items())), source=source,
                  max_train_documents=getattr(cfg, "max_train_documents", None), own_splits=own)


def _ingest(parts: List[Part], cleaner: Cleaner, writer: TextStoreWriter, fractions: Tuple[float, float],
            streamed_cap: Optional[int], bar: Any) -> None:
    """Clean every record of ``parts`` and append the documents to ``writer`` in batches."""
    batch: List[Document] = []
    splits: List[int] = []

    def flush() -> None:
        if bar is not None:
            bar.update(len(batch))
        if batch:
            writer.add([d.id for d in batch], [d.text for d in batch], [d.label for d in batch],
                       [d.group for d in batch], splits)
            batch.clear()
            splits.clear()

    for own_split, records in parts:
        kept = 0
        for default_id, rec, truncated in records:
            doc = cleaner.add(default_id, rec, truncated)
            if doc is None:
                continue
            split = own_split if own_split in ("validation", "test") else split_of(doc.group, *fractions)
            batch.append(doc)
            splits.append(SPLITS.index(split))
            if len(batch) >= _WRITE_BATCH:
                flush()
            kept += 1
            if streamed_cap is not None and kept >= int(streamed_cap):
                break  # a stream has no end to sample from: its first N documents
    flush()
    if bar is not None:
        bar.close()
