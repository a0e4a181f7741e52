"""The built-in corpus walked once per test session (tests/conftest.py installs it).

Every in-process ``train()`` on ``experiment=smoke`` reads the python_sources corpus, and
reading it means parsing the whole standard library (a few CPU seconds each time, some
seventy times a session). The walk is a pure function of its arguments and of files that
do not change during a session, so the corpus loader is given a memo of it: the first call
walks for real and keeps the documents and the skip counts; later calls with the same
arguments replay both. Only the name the loader calls (``dipaco.data.sources``) is
replaced: the tests of ``iter_python_sources`` itself still run the walk.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from dipaco.data.python_sources import SourceDocument, stdlib_root

Walk = Callable[..., Iterator[SourceDocument]]


def memo_walk(walk: Walk) -> Walk:
    """``walk`` (the signature of :func:`iter_python_sources`) with its results kept by arguments."""
    kept: Dict[Tuple[Any, ...], Tuple[List[SourceDocument], Dict[str, int]]] = {}

    def walked(exclude_packages: Sequence[str] = (), target_doc_chars: int = 3000,
               max_doc_chars: int = 20000, root: Optional[str] = None,
               skipped: Optional[dict] = None, progress: bool = False) -> Iterator[SourceDocument]:
        key = (tuple(exclude_packages), int(target_doc_chars), int(max_doc_chars), root or stdlib_root())
        if key not in kept:
            counts: Dict[str, int] = {}
            # a list, not a generator: a consumer that stops early must not leave half a memo
            docs = list(walk(list(exclude_packages), target_doc_chars, max_doc_chars, key[3], counts))
            kept[key] = (docs, counts)
        docs, counts = kept[key]
        if skipped is not None:
            for reason, n in counts.items():
                skipped[reason] = skipped.get(reason, 0) + n
        return iter(docs)

    return walked
