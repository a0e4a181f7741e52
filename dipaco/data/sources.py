"""The readers the data-source registry names (``dipaco.config.names.DATA_SOURCES``).

A ``builtin`` source's reader takes ``(cfg, skipped, progress)`` (``cfg`` the ``data``
group) and returns its records and a phrase saying where they came from; a ``files``
source's reader takes one regular file ``(path, rel, ctx)`` and yields ``(default id,
record, truncated)``. :func:`dipaco.data.corpus.load_corpus` looks a source up in the
registry and calls its reader: a new source is a reader here (or in a module of its own)
and one registry line (docs/design.md, "Adding a data source").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, List, Tuple

from dipaco.data.multidomain import cache_dir, load_multidomain
from dipaco.data.python_sources import iter_python_sources, stdlib_root
from dipaco.data.readers import count_skip, iter_json_file, iter_json_lines, iter_parquet, read_text_head

__all__ = ["FileContext", "Record", "read_json", "read_json_lines", "read_multidomain", "read_parquet",
           "read_python_sources", "read_text"]

Record = Tuple[str, Dict[str, Any], bool]  # (default id, raw fields, truncated)


@dataclass
class FileContext:
    """What a file reader is told: the fields to keep, the text field, the skip counts and
    the longest document kept (0: no limit)."""

    columns: List[str]
    text_field: str
    skipped: Dict[str, int]
    max_chars: int = 0


def _builtin(docs: Iterable[Any]) -> Iterator[Record]:
    return ((d.id, {"text": d.text, "label": d.label, "group": d.group}, False) for d in docs)


def read_python_sources(cfg: Any, skipped: Dict[str, int], progress: bool) -> Tuple[Iterable[Record], str]:
    """The standard library's Python files, chunked (``data=python_sources``)."""
    docs = iter_python_sources(exclude_packages=list(cfg.exclude_packages or ()),
                               target_doc_chars=int(cfg.target_doc_chars),
                               max_doc_chars=int(cfg.max_doc_chars or 0) or 20000, skipped=skipped, progress=progress)
    return _builtin(docs), f"the standard library at {stdlib_root()}"


def read_multidomain(cfg: Any, skipped: Dict[str, int], progress: bool) -> Tuple[Iterable[Record], str]:
    """Five labelled domains of this install (``data=multidomain``, docs/data.md)."""
    docs, _ = load_multidomain(exclude_packages=list(cfg.exclude_packages or ()),
                               target_doc_chars=int(cfg.target_doc_chars),
                               max_doc_chars=int(cfg.max_doc_chars or 0) or 20000,
                               domain_max_chars=int(cfg.domain_max_chars), progress=progress,
                               packages=list(cfg.packages))
    return _builtin(docs), f"the multidomain corpus (cache in {cache_dir()})"


def read_text(path: str, rel: str, ctx: FileContext) -> Iterator[Record]:
    """One document per file, its text the file's head (``data.source=text``)."""
    raw, truncated = read_text_head(path, ctx.max_chars or 10**9)
    if raw is None:
        count_skip(ctx.skipped, "unreadable_file")
    else:
        yield rel, {"text": raw}, truncated


def read_json_lines(path: str, rel: str, ctx: FileContext) -> Iterator[Record]:
    """One record per JSON line (``data.source=jsonl``)."""
    return ((i, r, False) for i, r in iter_json_lines(path, rel, ctx.skipped))


def read_json(path: str, rel: str, ctx: FileContext) -> Iterator[Record]:
    """A JSON array (or object holding one), element by element (``data.source=json``)."""
    return ((i, r, False) for i, r in iter_json_file(path, rel, ctx.text_field, ctx.skipped))


def read_parquet(path: str, rel: str, ctx: FileContext) -> Iterator[Record]:
    """A parquet file batch by batch, the named columns only (``data.source=parquet``)."""
    return ((i, r, False) for i, r in iter_parquet(path, rel, ctx.columns, ctx.skipped))
