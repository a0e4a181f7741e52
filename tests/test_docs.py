"""Every citation in the repository points to something in the repository.

Scans the code, tests, benchmarks, configs, setup.cfg and the markdown docs for
repository paths (``docs/…md``, ``tests/…py``, ``dipaco/…py``, ``router/…py``,
``modules/…py``, ``benchmarks/…``) and for "contract N", and checks that the path exists
and that docs/design.md defines contract N. A newcomer who clones the repository can
follow every reference.
"""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCANNED = ("dipaco", "router", "modules", "tests", "benchmarks", "conf", "docs")
SUFFIXES = {".py", ".md", ".yaml", ".cfg", ".toml"}

# a repository path: one of the top folders, then path characters, ending in a file
# suffix or a slash; globs (tests/test_router*.py) are matched as globs
PATH_RE = re.compile(r"(?<![\w/.-])((?:docs|tests|dipaco|router|modules|benchmarks)/[\w./*-]*[\w*/])")
CONTRACT_RE = re.compile(r"\bcontracts? (\d+)(?:\s*(?:and|,)\s*(\d+))?", re.IGNORECASE)
DEFINED_RE = re.compile(r"^(\d+)\. \*\*", re.MULTILINE)


def scanned_files() -> list[Path]:
    files = [REPO / "README.md", REPO / "setup.cfg", REPO / "pyproject.toml"]
    for top in SCANNED:
        files += [p for p in (REPO / top).rglob("*") if p.suffix in SUFFIXES and "__pycache__" not in p.parts]
    return [f for f in files if f.is_file()]


# written by runs, never committed: benchmark outputs
GENERATED = ("benchmarks/results/",)
SOURCE_SUFFIXES = (".py", ".md", ".yaml", ".cfg", ".toml", ".txt")


def cited_paths(text: str) -> set[str]:
    """Source and doc files and folders cited in ``text`` (not run outputs such as a
    checkpoint's ``modules/L0.0.safetensors``, nor module paths in prose like ``dipaco/sync``)."""
    out = set()
    for m in PATH_RE.finditer(text):
        p = m.group(1).rstrip(".")
        if p.startswith(GENERATED):
            continue
        if p.endswith("/") or p.endswith(SOURCE_SUFFIXES) or "*" in p:
            out.add(p)
    return out


def exists(p: str) -> bool:
    if "*" in p:
        return any(REPO.glob(p))
    return (REPO / p).exists()


def test_every_cited_repository_path_exists() -> None:
    missing = []
    for f in scanned_files():
        if f == Path(__file__).resolve():
            continue  # its own examples of missing paths
        for p in cited_paths(f.read_text(encoding="utf-8", errors="replace")):
            if not exists(p):
                missing.append(f"{f.relative_to(REPO)} cites {p}")
    assert not missing, "\n".join(sorted(missing))


def test_every_cited_contract_is_defined() -> None:
    design = (REPO / "docs" / "design.md").read_text(encoding="utf-8")
    defined = {int(n) for n in DEFINED_RE.findall(design.split("## Contracts", 1)[1])}
    assert defined == set(range(1, 10)), defined  # the numbering the code cites
    bad = []
    for f in scanned_files():
        for m in CONTRACT_RE.finditer(f.read_text(encoding="utf-8", errors="replace")):
            for n in filter(None, m.groups()):
                if int(n) not in defined:
                    bad.append(f"{f.relative_to(REPO)} cites contract {n}")
    assert not bad, "\n".join(bad)


def test_no_citation_of_files_outside_the_repository() -> None:
    """DESIGN.md / NOTES.md were notes outside the repository: cite docs/design.md instead."""
    outside = re.compile(r"DESIGN\.md|NOTES\.md|(?<![\w/.])shared/")  # /shared/runs is a mount, fine
    bad = []
    for f in scanned_files():
        if f == Path(__file__).resolve():
            continue
        for m in outside.finditer(f.read_text(encoding="utf-8", errors="replace")):
            bad.append(f"{f.relative_to(REPO)} cites {m.group(0)}")
    assert not bad, "\n".join(bad)


def test_the_path_scanner_finds_what_it_should() -> None:
    """The scanner itself: a test that finds nothing would pass forever."""
    text = ("see docs/design.md, tests/test_x.py and benchmarks/README.md; dipaco/sync owns it; "
            "modules/L0.0.safetensors of a checkpoint; benchmarks/results/x.json")
    assert cited_paths(text) == {"docs/design.md", "tests/test_x.py", "benchmarks/README.md"}
    assert not exists("docs/no_such_file.md") and exists("tests/test_router*.py")
    assert [g for g in CONTRACT_RE.findall("contract 1 and 2; Contract 5")] == [("1", "2"), ("5", "")]


def test_the_readme_is_written_for_users() -> None:
    """Two set-up commands a newcomer pastes (CI runs the second), and no project history:
    issue numbers in no doc (README, docs/, benchmarks/README.md), commit hashes not in the README."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    setups = [line for line in text.splitlines() if line.startswith("python3 -m venv .venv && ")]
    assert len(setups) == 2, setups
    # the suite: in-process tests on both cores, then the multiprocess ones alone (the two
    # marker expressions together select every test)
    assert setups[0].endswith("&& dipaco-train"), setups
    assert setups[1].endswith('&& pytest -q -n 2 --dist loadfile -m "not multiprocess" && pytest -q -m multiprocess'), setups
    assert not re.findall(r"\bissues? #?\d+", text, re.IGNORECASE), "issue numbers in the README"
    for doc in sorted((REPO / "docs").glob("*.md")) + [REPO / "benchmarks" / "README.md"]:  # nor in the docs
        cited = re.findall(r"\bissues? #?\d+", doc.read_text(encoding="utf-8"), re.IGNORECASE)
        assert not cited, f"issue numbers in {doc.relative_to(REPO)}: {cited}"
    hashes = [h for h in re.findall(r"(?<![\w/.-])[0-9a-f]{7,40}(?![\w/.-])", text) if not h.isdigit()]
    assert not hashes, f"commit hashes in the README: {hashes}"
