"""A run's JSON-lines records (``provenance.jsonl``, ``metrics.jsonl``, ``steps.jsonl``,
``resumes.jsonl``, ``membership.jsonl``): the one writer and the one reader.

One writer, :func:`append_json_lines`: strict JSON (dipaco/storage/strict_json.py: a NaN
loss is ``null`` with its reason beside it), whole lines in one ``write`` on a descriptor
opened for appending and never through a symbolic link, so a kill leaves whole lines (at
most a torn last one) and two appenders never interleave inside a line.

One reader for every such file, so that what counts as a record is decided once: an
unreadable file is no records, a line that is not a JSON object is skipped (a crash can
leave half a line), a reader following a file that is still being appended to can leave
the unfinished last line for later, and non-finite numbers come back as the floats they were.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

from dipaco.storage.strict_json import dumps_strict, restore


def append_json_lines(path: str | os.PathLike, records: Iterable[dict[str, Any]], **kw: Any) -> None:
    """Append ``records`` to ``path``, one strict JSON object a line (``kw``: ``sort_keys``, ...)."""
    data = "".join(dumps_strict(r, **kw) + "\n" for r in records).encode("utf-8")
    if not data:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    try:
        while data:
            data = data[os.write(fd, data):]
    finally:
        os.close(fd)


def read_json_lines(path: str | os.PathLike, *, complete_only: bool = False) -> list[dict[str, Any]]:
    """The JSON objects of ``path``, one a line, oldest first (none, or an unreadable
    file: ``[]``). ``complete_only``: ignore text after the last newline (a line another
    process is still writing)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return []
    if complete_only:
        text = text[: text.rfind("\n") + 1]
    out = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(restore(rec))
    return out


__all__ = ["append_json_lines", "read_json_lines"]
