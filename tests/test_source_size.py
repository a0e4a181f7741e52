"""No source file over 400 lines, so that each can be read in one sitting.

Counted: every ``.py`` file of the packages (``dipaco/``, ``router/``, ``modules/``), of
``benchmarks/`` and the tests' helper modules (``tests/*.py`` that are not
``test_*.py``: ``conftest.py``, ``_dist.py``, ``golden_run.py``). Test files themselves
are not: a test file is a list of independent cases, read one case at a time.

A file over the limit fails the suite: split it by concern.
"""
from __future__ import annotations

from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
LIMIT = 400


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


def test_no_source_file_over_400_lines() -> None:
    over = too_long(source_files())
    assert not over, f"source files over {LIMIT} lines (split them by concern): {over}"
