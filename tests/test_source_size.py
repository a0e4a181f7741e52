"""No source file over 400 lines, so that each can be read in one sitting.

Counted: every ``.py`` file of the packages (``dipaco/``, ``router/``, ``modules/``), of
``benchmarks/`` and the tests' helper modules (``tests/*.py`` that are not
``test_*.py``: ``conftest.py``, ``_dist.py``, ``golden_run.py``). Test files themselves
are not: a test file is a list of independent cases, read one case at a time.

One file is still over the limit; other work is splitting it (issue 33, item 4), so the
check on it is an expected failure until then, and any OTHER file over the limit fails
the suite now.
"""
from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LIMIT = 400
BEING_SPLIT = {"dipaco/data/multidomain.py"}


def source_files() -> list[Path]:
    files = [f for d in ("dipaco", "router", "modules", "benchmarks") for f in (REPO / d).rglob("*.py")]
    files += [f for f in (REPO / "tests").glob("*.py") if not f.name.startswith("test_")]
    return sorted(f for f in files if ".venv" not in f.parts)


def too_long(files: list[Path]) -> dict[str, int]:
    out = {}
    for f in files:
        n = len(f.read_text(encoding="utf-8").splitlines())
        if n > LIMIT:
            out[f.relative_to(REPO).as_posix()] = n
    return out


def test_the_count_covers_the_packages_and_test_helpers() -> None:
    names = {f.relative_to(REPO).as_posix() for f in source_files()}
    assert {"dipaco/rounds/loop.py", "router/router.py", "modules/grid.py", "benchmarks/common.py",
            "tests/golden_run.py", "tests/_dist.py"} <= names
    assert not any(n.startswith("tests/test_") for n in names)


def test_no_source_file_over_400_lines_but_those_being_split() -> None:
    over = too_long(source_files())
    assert set(over) <= BEING_SPLIT, {f: n for f, n in over.items() if f not in BEING_SPLIT}


@pytest.mark.xfail(reason="still over 400 lines, being split outside the round's work: "
                          + ", ".join(sorted(BEING_SPLIT)), strict=False)
def test_no_source_file_over_400_lines() -> None:
    over = too_long(source_files())
    assert not over, over
