"""Check raw records one by one: keep a usable document, or count why not.

:class:`Cleaner` is the one place a record becomes a document ``(id, text, label,
group)``. Whatever a record holds, it costs that record only: a wrong type, a null, a
lone surrogate or undecodable bytes in any field used is counted under its reason (the
table in :mod:`dipaco.data.corpus`) and the record is left out; nothing raises. Only a
configured key that *no* record has is an error (a typo, not bad rows: :func:`check_fields`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, NamedTuple, Optional

import numpy as np

from dipaco.data.errors import DataError
from dipaco.data.readers import count_skip
from dipaco.storage.hashing import stable_u64

if TYPE_CHECKING:  # the type only: dipaco.config pulls in modules (torch)
    from dipaco.config import DataConfig

__all__ = ["Cleaner", "DigestSet", "Document", "check_fields"]

# values a label, id or group may hold (anything else is a malformed record)
_SCALARS = (str, int, float, bool)


class Document(NamedTuple):
    """One kept document (``label`` None when the source has none)."""

    id: str
    text: str
    label: Optional[str]
    group: str


class _Bad(Exception):
    """A field of one record is unusable; carries the skip reason."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _field(value: Any, what: str) -> Optional[str]:
    """A label / id / group value as text (None stays None), or :class:`_Bad`."""
    if value is None:
        return None
    if isinstance(value, (bytes, bytearray)):
        value = bytes(value).decode("utf-8", "replace")
    elif not isinstance(value, _SCALARS):
        raise _Bad(f"bad_{what}")
    value = str(value)
    try:
        value.encode("utf-8")  # JSON "\ud800" escapes give lone surrogates no file can hold
    except UnicodeEncodeError:
        raise _Bad("non_utf8") from None
    return value


class DigestSet:
    """A set of 64-bit digests in ~8 bytes each: recent ones in a Python set, merged into a
    sorted numpy array every :attr:`MERGE` (a Python set of a million ints costs ~90 MB)."""

    MERGE = 1 << 16

    def __init__(self) -> None:
        self._recent: set = set()
        self._sorted = np.zeros(0, np.uint64)

    def add(self, key: int) -> bool:
        """Add ``key``; True when it was not there yet."""
        if key in self._recent:
            return False
        i = int(np.searchsorted(self._sorted, np.uint64(key)))
        if i < self._sorted.size and int(self._sorted[i]) == key:
            return False
        self._recent.add(key)
        if len(self._recent) >= self.MERGE:
            self._sorted = np.union1d(self._sorted, np.fromiter(self._recent, np.uint64, len(self._recent)))
            self._recent = set()
        return True


class Cleaner:
    """Check raw records one by one, keep the usable ones, count the rest.

    ``unique_ids``: ids can repeat (they come from ``data.id_field``), so repeats are
    numbered ``<id>~2``, ``<id>~3``, ... (splits and shards are keyed by id). Seen ids are
    kept as 8-byte digests (:class:`DigestSet`), not strings. Generated ids (``file#line``)
    are unique as made.
    """

    def __init__(self, cfg: "DataConfig", text_field: str, label_field: Optional[str], id_field: Optional[str],
                 group_field: Optional[str] = None, *, unique_ids: Optional[bool] = None) -> None:
        self.text_field = text_field
        self.label_field = label_field
        self.id_field = id_field
        self.group_field = group_field
        self.min_chars = int(cfg.min_doc_chars or 0)
        self.max_chars = int(cfg.max_doc_chars or 0)
        self.skipped: Dict[str, int] = {}
        self.unique_ids = id_field is not None if unique_ids is None else unique_ids
        self._seen = DigestSet()
        self._repeats: Dict[int, int] = {}
        self.records = 0
        self.kept = 0
        self.with_text_field = 0
        self.with_label_field = 0
        self.with_id_field = 0
        self.with_group_field = 0
        self.first_keys: Optional[List[str]] = None

    def text_of(self, rec: Dict[str, Any], truncated: bool) -> Optional[str]:
        """The record's text, cleaned and cut to ``data.max_doc_chars``, or None (reason counted)."""
        if self.text_field not in rec:
            count_skip(self.skipped, "missing_text_field")
            return None
        self.with_text_field += 1
        text = rec[self.text_field]
        if isinstance(text, (bytes, bytearray)):
            if b"\x00" in text:
                count_skip(self.skipped, "binary")
                return None
            try:
                text = bytes(text).decode("utf-8")
            except UnicodeDecodeError:
                count_skip(self.skipped, "non_utf8")
                return None
        elif text is None:
            count_skip(self.skipped, "empty")
            return None
        elif not isinstance(text, str):
            count_skip(self.skipped, "not_a_string")
            return None
        if "\x00" in text:
            count_skip(self.skipped, "binary")
            return None
        try:
            text.encode("utf-8")  # JSON "\ud800" escapes give lone surrogates no file can hold
        except UnicodeEncodeError:
            count_skip(self.skipped, "non_utf8")
            return None
        stripped = text.strip()
        if not stripped:
            count_skip(self.skipped, "empty")
            return None
        if len(stripped) < self.min_chars:
            count_skip(self.skipped, "too_short")
            return None
        if truncated or (self.max_chars and len(text) > self.max_chars):
            count_skip(self.skipped, "truncated")
            if self.max_chars:
                text = text[: self.max_chars]
        return text

    def add(self, default_id: str, rec: Dict[str, Any], truncated: bool = False) -> Optional[Document]:
        """The document ``rec`` makes, or None with the reason counted (``truncated``: the
        reader already cut it)."""
        self.records += 1
        if self.first_keys is None:
            self.first_keys = [str(k) for k in rec.keys()]
        text = self.text_of(rec, truncated)
        if text is None:
            return None
        try:
            label = None
            if self.label_field is not None:
                if self.label_field in rec:
                    self.with_label_field += 1
                label = _field(rec.get(self.label_field), "label")
            doc_id = default_id
            if self.id_field is not None and self.id_field in rec:
                self.with_id_field += 1
                doc_id = _field(rec[self.id_field], "id") or default_id
            group = None
            if self.group_field is not None and self.group_field in rec:
                self.with_group_field += 1
                group = _field(rec[self.group_field], "group")
        except _Bad as bad:
            count_skip(self.skipped, bad.reason)
            return None
        if self.label_field is not None and label is None:
            count_skip(self.skipped, "missing_label")  # kept: labels only evaluate routing
        if self.unique_ids:
            doc_id = self._unique(doc_id)
        self.kept += 1
        # no group field, or a record without one: the document is its own group
        return Document(doc_id, text, label, doc_id if group is None else group)

    def _unique(self, doc_id: str) -> str:
        key = stable_u64(doc_id)
        if self._seen.add(key):
            return doc_id
        n = self._repeats.get(key, 1) + 1
        self._repeats[key] = n
        return f"{doc_id}~{n}"


def check_fields(c: Cleaner, where: str) -> None:
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
