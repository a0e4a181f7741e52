"""Load raw documents into one HF ``datasets.Dataset`` (the first box of the data flow).

With :mod:`dipaco.data.readers`, the only place that reads raw data with ``datasets`` /
``pyarrow``. Every source goes through the same tolerant path: a reader yields raw records, :class:`_Cleaner` checks each one
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

``data.max_train_documents`` (and ``data.documents_per_path``, which sets it) is not a skip:
every document stays in the corpus and :meth:`Corpus.split` hands out a hash sample of the
training split, so validation, test and the tokenizer's text do not depend on it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Tuple

import datasets
from tqdm.auto import tqdm

from dipaco.data.errors import DataError
from dipaco.data.multidomain import cache_dir, load_multidomain
from dipaco.data.python_sources import iter_python_sources, stdlib_root
from dipaco.data.readers import (LOCAL_SOURCES, count_skip, iter_hub, iter_json_file, iter_json_lines,
                                 iter_parquet, read_text_head, relative_id, resolve_files)
from dipaco.data.splits import SPLITS, id_unit_interval, split_of

if TYPE_CHECKING:  # the type only: dipaco.config pulls in modules (torch), which loading text never needs
    from dipaco.config import DataConfig

# Columns of every corpus: label is None when the source has no label; group is the
# document family the split is keyed by (the source file of a chunk; the id by default).
DOCUMENT_FEATURES = datasets.Features(
    {
        "id": datasets.Value("string"),
        "text": datasets.Value("string"),
        "label": datasets.Value("string"),
        "group": datasets.Value("string"),
        "split": datasets.Value("string"),
    }
)

SOURCES = ("python_sources", "multidomain") + LOCAL_SOURCES + ("hub",)

Record = Dict[str, Any]


@dataclass
class Corpus:
    """The loaded documents and the record of what was left out.

    ``dataset`` has the columns ``id``, ``text``, ``label`` (string or None), ``group``
    and ``split`` (``train`` / ``validation`` / ``test``: :func:`split_of` of the group, so
    no group has documents in two splits).

    ``max_train_documents``: :meth:`split` returns that many training documents, the ones
    with the smallest id hash (``data.max_train_documents``); None: all of them.
    """

    dataset: datasets.Dataset
    skipped: Dict[str, int] = field(default_factory=dict)
    num_documents: int = 0
    source: str = ""
    max_train_documents: Optional[int] = None
    _split_cache: Dict[str, datasets.Dataset] = field(default_factory=dict, repr=False)

    def split(self, name: str, *, whole: bool = False) -> datasets.Dataset:
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
            column = self.dataset["split"]
            indices = [i for i, s in enumerate(column) if s == name]
            if sampled and len(indices) > int(self.max_train_documents):  # type: ignore[arg-type]
                ids = self.dataset["id"]
                order = sorted(indices, key=lambda i: (id_unit_interval(ids[i], "max_train_documents"), i))
                indices = sorted(order[: int(self.max_train_documents)])  # type: ignore[arg-type]
            self._split_cache[key] = self.dataset.select(indices)
        return self._split_cache[key]

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
            "num_groups": len(set(self.dataset["group"])),
            "num_chars": sum(len(t) for t in self.dataset["text"]),
            "split_sizes": {s: splits.count(s) for s in SPLITS},
            "train_sample": len(self.split("train")) if self.max_train_documents is not None else None,
            "skipped": dict(self.skipped),
        }


# --------------------------------------------------------------------------- cleaning


class _Cleaner:
    """Check raw records one by one, keep the usable ones, count the rest."""

    def __init__(self, cfg: DataConfig, text_field: str, label_field: Optional[str], id_field: Optional[str],
                 group_field: Optional[str] = None):
        self.text_field = text_field
        self.label_field = label_field
        self.id_field = id_field
        self.group_field = group_field
        self.min_chars = int(cfg.min_doc_chars or 0)
        self.max_chars = int(cfg.max_doc_chars or 0)
        self.skipped: Dict[str, int] = {}
        self.rows: Dict[str, List[Any]] = {"id": [], "text": [], "label": [], "group": []}
        self.seen_ids: Dict[str, int] = {}
        self.records = 0
        self.with_text_field = 0
        self.with_label_field = 0
        self.with_id_field = 0
        self.with_group_field = 0
        self.first_keys: Optional[List[str]] = None

    def add(self, default_id: str, rec: Record, truncated: bool = False) -> None:
        """Keep ``rec`` as a row or count why not (``truncated``: the reader already cut it)."""
        self.records += 1
        if self.first_keys is None:
            self.first_keys = list(rec.keys())
        if self.text_field not in rec:
            count_skip(self.skipped, "missing_text_field")
            return
        self.with_text_field += 1
        text = rec[self.text_field]
        if isinstance(text, (bytes, bytearray)):
            if b"\x00" in text:
                count_skip(self.skipped, "binary")
                return
            try:
                text = bytes(text).decode("utf-8")
            except UnicodeDecodeError:
                count_skip(self.skipped, "non_utf8")
                return
        elif text is None:
            count_skip(self.skipped, "empty")
            return
        elif not isinstance(text, str):
            count_skip(self.skipped, "not_a_string")
            return
        if "\x00" in text:
            count_skip(self.skipped, "binary")
            return
        try:
            text.encode("utf-8")  # JSON "\ud800" escapes give lone surrogates arrow rejects
        except UnicodeEncodeError:
            count_skip(self.skipped, "non_utf8")
            return
        stripped = text.strip()
        if not stripped:
            count_skip(self.skipped, "empty")
            return
        if len(stripped) < self.min_chars:
            count_skip(self.skipped, "too_short")
            return
        if truncated or (self.max_chars and len(text) > self.max_chars):
            count_skip(self.skipped, "truncated")
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
        group = doc_id  # no group field, or a record without one: the document is its own group
        if self.group_field is not None and rec.get(self.group_field) is not None:
            self.with_group_field += 1
            group = str(rec[self.group_field])
        self.rows["id"].append(doc_id)
        self.rows["text"].append(text)
        self.rows["label"].append(label)
        self.rows["group"].append(group)


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
    for key, name, found in (("id_field", c.id_field, c.with_id_field),
                             ("group_field", c.group_field, c.with_group_field)):
        if name is not None and c.with_text_field and not found:
            raise DataError(
                f"data.{key}={name!r} is not a key of any record in {where} "
                f"(keys of the first record: {keys}). Fix: pass data.{key}=<key> or data.{key}=null"
            )


def _cap(rows: Dict[str, List[Any]], max_documents: Optional[int]) -> int:
    """Keep the ``max_documents`` rows with the smallest id hash, in corpus order.

    A hash sample (not the first N) so a capped stdlib corpus still spans every package,
    and the same ids are kept on every run. It samples documents, not groups: splits are
    keyed by group whatever is sampled, so no group reaches two splits, and a sample by
    document spreads over more source files (whole files would make a small sample a few
    packages). Returns how many rows were dropped.
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


def load_corpus(cfg: DataConfig, *, progress: bool = True) -> Corpus:
    """Load the documents described by ``cfg`` (the ``data`` group of the config) into a :class:`Corpus`.

    ``cfg.source`` picks the reader: ``python_sources`` (the built-in offline corpus),
    ``jsonl`` / ``json`` / ``parquet`` / ``text`` (local file, glob or directory; ``text``
    is one document per file) or ``hub`` (``load_dataset(path, hub_config, split=hub_split)``).
    Bad records are skipped and counted, never crashed on; a missing file, a key absent
    from every record or a corpus with no usable document raises :class:`DataError`.
    """
    source = str(cfg.source)
    if source not in SOURCES:
        raise DataError(f"data.source={source!r} is unknown. Fix: use one of {', '.join(SOURCES)}")
    path = cfg.path
    max_chars = int(cfg.max_doc_chars or 0)

    if source == "python_sources":
        cleaner = _Cleaner(cfg, "text", "label", None, "group")
        docs = iter_python_sources(
            exclude_packages=list(cfg.exclude_packages or ()),
            target_doc_chars=int(cfg.target_doc_chars),
            max_doc_chars=max_chars or 20000,
            skipped=cleaner.skipped,
            progress=progress,
        )
        for doc in docs:
            cleaner.add(doc.id, {"text": doc.text, "label": doc.label, "group": doc.group})
        where = f"the standard library at {stdlib_root()}"
    elif source == "multidomain":
        cleaner = _Cleaner(cfg, "text", "label", None, "group")
        domain_docs, _ = load_multidomain(
            exclude_packages=list(cfg.exclude_packages or ()), target_doc_chars=int(cfg.target_doc_chars),
            max_doc_chars=max_chars or 20000, domain_max_chars=int(cfg.domain_max_chars), progress=progress)
        for d in domain_docs:
            cleaner.add(d.id, {"text": d.text, "label": d.label, "group": d.group})
        where = f"the multidomain corpus (cache in {cache_dir()})"
    else:
        text_field = str(cfg.text_field)
        label_field = cfg.label_field
        id_field = cfg.id_field
        group_field = getattr(cfg, "group_field", None)
        if source == "text":  # one document per file (its own group): there are no fields to pick
            text_field, id_field, group_field = "text", None, None
        cleaner = _Cleaner(cfg, text_field, label_field, id_field, group_field)
        if source == "hub":
            if not path:
                raise DataError("data.path is not set for data.source=hub. Fix: pass data.path=<hub dataset name>")
            where = f"hub dataset {path}"
            streaming = bool(getattr(cfg, "streaming", False))
            cap = getattr(cfg, "max_documents", None) if streaming else None
            for default_id, rec in tqdm(
                iter_hub(str(path), cfg.hub_config, str(cfg.hub_split), cfg.streaming),
                desc="hub", unit="doc", disable=not progress,
            ):
                cleaner.add(default_id, rec)
                if cap is not None and len(cleaner.rows["id"]) >= cap:
                    break  # a stream has no end to sample from: its first N documents
        else:
            files, root = resolve_files(path, source)
            where = f"data.path={path}"
            columns = [c for c in (text_field, label_field, id_field, group_field) if c]
            for f in tqdm(files, desc=f"load {source}", unit="file", disable=not progress):
                rel = relative_id(f, root)
                if source == "text":
                    raw, truncated = read_text_head(f, max_chars or 10**9)
                    cleaner.add(rel, {"text": raw}, truncated=truncated)
                    continue
                if source == "parquet":
                    records: Iterable[Tuple[str, Any]] = iter_parquet(f, rel, columns, cleaner.skipped)
                elif source == "json":
                    records = iter_json_file(f, rel, text_field, cleaner.skipped)
                else:
                    records = iter_json_lines(f, rel, cleaner.skipped)
                for default_id, rec in records:
                    cleaner.add(default_id, rec)
        _check_fields(cleaner, where)

    rows = cleaner.rows
    skipped = cleaner.skipped
    dropped = _cap(rows, cfg.max_documents)
    if dropped:
        skipped["capped_by_max_documents"] = dropped
    if not rows["id"]:
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(skipped.items())) or "no records at all"
        raise DataError(
            f"{where}: no usable document (skipped: {reasons}). "
            f"Fix: check data.source, data.text_field and data.min_doc_chars"
        )
    val = float(cfg.val_fraction)
    test = float(cfg.test_fraction)
    try:
        rows["split"] = [split_of(g, val, test) for g in rows["group"]]
    except ValueError as e:
        raise DataError(f"{e}. Fix: use e.g. data.val_fraction=0.05 data.test_fraction=0.05") from None
    dataset = datasets.Dataset.from_dict(rows, features=DOCUMENT_FEATURES)
    return Corpus(dataset=dataset, skipped=dict(sorted(skipped.items())),
                  num_documents=len(dataset), source=source,
                  max_train_documents=getattr(cfg, "max_train_documents", None))
