"""One JSON-lines reader (dipaco/storage/jsonl.py) for the records a run appends."""
from __future__ import annotations

from pathlib import Path

from dipaco.run import provenance
from dipaco.storage.jsonl import read_json_lines
from dipaco.runtime import record_tail


def test_records_skip_bad_lines_and_a_follower_leaves_the_unfinished_one(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_text('{"a": 1}\nnot json\n[1, 2]\n\n{"b": 2}\n{"c": 3}')
    assert read_json_lines(path) == [{"a": 1}, {"b": 2}, {"c": 3}]
    assert read_json_lines(path, complete_only=True) == [{"a": 1}, {"b": 2}]
    assert read_json_lines(tmp_path / "missing.jsonl") == []
    (tmp_path / "bad.jsonl").write_bytes(b'{"a": "\xff"}\n')
    assert read_json_lines(tmp_path / "bad.jsonl") == []


def test_provenance_and_the_wandb_tail_read_through_the_one_reader(tmp_path: Path) -> None:
    (tmp_path / provenance.PROVENANCE).write_text('{"event": "start"}\n{"event": "resume"}')
    assert provenance.read(tmp_path) == [{"event": "start"}, {"event": "resume"}]
    assert record_tail._lines(tmp_path / provenance.PROVENANCE) == [{"event": "start"}]
    assert record_tail.read_json_lines is read_json_lines and provenance.read_json_lines is read_json_lines
