"""``summary.json`` is what :class:`dipaco.job.summary.RunSummary` says: a real run's file
has exactly its keys, each value of its declared type, and ``train()`` returns the same."""
from __future__ import annotations

import json
import math
import typing

from dipaco.job.summary import RunSummary, summary_rows


def _is(value, hint) -> bool:
    """``value`` (as JSON gives it back) is of the declared ``hint``."""
    origin = typing.get_origin(hint)
    if hint is typing.Any:
        return True
    if origin is typing.Union:
        return any(_is(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin in (list, dict):
        return isinstance(value, origin)
    return isinstance(value, hint) and not (hint is int and isinstance(value, bool))


def test_a_finished_runs_summary_json_is_a_run_summary_key_for_key(finished) -> None:
    run_dir, returned = finished
    on_disk = json.loads((run_dir / "summary.json").read_text())
    hints = typing.get_type_hints(RunSummary)
    assert set(on_disk) == set(hints), (sorted(set(on_disk) - set(hints)), sorted(set(hints) - set(on_disk)))
    wrong = {k: (on_disk[k], hints[k]) for k in hints if not _is(on_disk[k], hints[k])}
    assert not wrong, wrong
    assert json.loads(json.dumps(returned)) == on_disk
    assert math.isfinite(on_disk["routed_ppl"])


def test_the_type_check_can_fail() -> None:
    hints = typing.get_type_hints(RunSummary)
    assert not _is("4", hints["rounds"]) and not _is(True, hints["rounds"]) and not _is(None, hints["routed_ppl"])
    assert _is(None, hints["ratio_vs_dense"]) and _is(3, hints["routed_ppl"])


def test_the_printed_rows_read_only_keys_of_the_summary() -> None:
    keys = set(typing.get_type_hints(RunSummary))
    read: set = set()

    class Watched(dict):
        def get(self, key, default=None):
            read.add(key)
            return super().get(key, default)

        def __getitem__(self, key):
            read.add(key)
            return super().__getitem__(key)

    rows = summary_rows(Watched({k: 1 for k in keys}))
    assert rows and read and read <= keys, sorted(read - keys)
