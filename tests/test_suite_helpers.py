"""The suite's own helpers keep what the tests check: the memoised walk of the built-in
corpus (tests/_corpus_memo.py) gives what the walk gives, skip counts included."""
from __future__ import annotations

from pathlib import Path

from _corpus_memo import memo_walk
from dipaco.data.python_sources import iter_python_sources


def _tiny_stdlib(root: Path) -> None:
    (root / "pkg").mkdir()
    (root / "pkg" / "__init__.py").write_text("def a():\n    return 1\n\n\ndef b():\n    return 2\n")
    (root / "mod.py").write_text("X = 1\n" * 40)
    (root / "latin.py").write_bytes(b"# caf\xe9\n")  # not UTF-8: skipped and counted


def test_the_memoised_walk_replays_documents_and_skip_counts(tmp_path: Path) -> None:
    _tiny_stdlib(tmp_path)
    calls: list[int] = []

    def counted(*args, **kwargs):
        calls.append(1)
        return iter_python_sources(*args, **kwargs)

    walk = memo_walk(counted)
    want_skipped: dict = {}
    want = list(iter_python_sources([], 30, 200, str(tmp_path), want_skipped))
    for _ in range(2):
        skipped = {"other": 1}
        got = list(walk([], 30, 200, root=str(tmp_path), skipped=skipped))
        assert got == want and len(got) > 2
        assert skipped == {"other": 1, **want_skipped} and want_skipped == {"non_utf8": 1}
    assert len(calls) == 1  # the second call replayed
    # other arguments are another walk
    assert list(walk(["pkg"], 30, 200, root=str(tmp_path))) != want and len(calls) == 2
