"""Reading a run's JSON-lines records (``provenance.jsonl``, ``metrics.jsonl``, ``steps.jsonl``).

One reader for every file a run appends one JSON object a line to, so that what counts as
a record is decided once: an unreadable file is no records, a line that is not a JSON
object is skipped (a crash can leave half a line), and a reader following a file that
is still being appended to can leave the unfinished last line for later.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


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
            out.append(rec)
    return out


__all__ = ["read_json_lines"]
