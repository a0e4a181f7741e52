"""Every citation in the repository points to something in the repository.

Scans the code, tests, benchmarks, configs, setup.cfg and the markdown docs for
repository paths (``docs/…md``, ``tests/…py``, ``dipaco/…py``, ``router/…py``,
``modules/…py``, ``benchmarks/…``) and for "contract N", and checks that the path exists
and that docs/design.md defines contract N. A newcomer who clones the repository can
follow every reference.
"""
from __future__ import annotations

import ast
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
    """At most 180 lines, two set-up commands a newcomer pastes (CI runs the second), and no project history:
    issue numbers in no doc (README, docs/, benchmarks/README.md), commit hashes not in the README."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    # read in five minutes: what it is, set-up, the default run, use, where to read more;
    # the chronicle of re-runs and suite timings lives in docs/results.md
    assert len(text.splitlines()) <= 180, len(text.splitlines())
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


# --------------------------------------------------------------------------- design.md's tables
DESIGN = REPO / "docs" / "design.md"
CODE = ("dipaco", "router", "modules", "hydra_plugins")


def _code_files() -> list[Path]:
    return sorted(p for top in CODE for p in (REPO / top).rglob("*.py") if "__pycache__" not in p.parts)


def _rel(p: Path) -> str:
    return str(p.relative_to(REPO))


def _table(after: str) -> list[list[str]]:
    """The rows of the first markdown table after the line starting with ``after``: cells."""
    lines = DESIGN.read_text(encoding="utf-8").split("\n")
    start = next(i for i, x in enumerate(lines) if x.strip().startswith(after))
    rows, seen = [], False
    for x in lines[start + 1:]:
        x = x.strip()
        if x.startswith("|"):
            seen = True
            cells = [c.strip() for c in x.strip("|").split("|")]
            if not set(cells[0]) <= set("-: "):
                rows.append(cells)
        elif seen:
            break
    return rows[1:]  # without the header


def _ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def _covered(rel: str, places: list[str]) -> bool:
    """``rel`` is one of ``places`` (a place ending in ``/`` is a folder)."""
    return any(rel == p or (p.endswith("/") and rel.startswith(p)) for p in places)


def _imports(tree: ast.AST) -> list[tuple[str, bool]]:
    """``(top-level module, inside a function)`` of every import of a module's tree;
    relative imports name the project (``.`` prefix)."""
    out = []

    def walk(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                out.extend((a.name.split(".")[0], in_function) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                out.append(("." if child.level else (child.module or "").split(".")[0], in_function))
            walk(child, inside)

    walk(tree, False)
    return out


def test_third_party_libraries_are_imported_only_where_design_md_says() -> None:
    allowed = {}
    for lib_cell, places in _table("* Third-party libraries are imported only"):
        for lib in _ticked(lib_cell):
            allowed[lib] = [p for p in _ticked(places) if p.startswith(tuple(c + "/" for c in CODE))]
    assert {"faiss", "datasets", "matplotlib", "safetensors", "uvicorn"} <= set(allowed), allowed
    bad, used = [], {lib: set() for lib in allowed}
    for f in _code_files():
        for mod, _ in _imports(ast.parse(f.read_text(encoding="utf-8"))):
            if mod in allowed:
                used[mod].add(_rel(f))
                if not _covered(_rel(f), allowed[mod]):
                    bad.append(f"{_rel(f)} imports {mod}")
    assert not bad, "\n".join(bad)
    # every place the table names still imports it (a stale row fails too)
    stale = [f"{lib}: {p}" for lib, places in allowed.items() for p in places
             if not any(_covered(u, [p]) for u in used[lib])]
    assert not stale, "design.md names places that no longer import the library:\n" + "\n".join(stale)


def test_function_level_imports_of_the_project_are_the_ones_design_md_lists() -> None:
    listed = {p for cells in _table("* Project modules are imported at module level") for p in _ticked(cells[0])
              if p.endswith(".py")}
    found = set()
    for f in _code_files():
        if any(inside and mod in ("dipaco", "router", "modules", ".")
               for mod, inside in _imports(ast.parse(f.read_text(encoding="utf-8")))):
            found.add(_rel(f))
    assert found - listed == set(), f"function-level project imports not in docs/design.md: {sorted(found - listed)}"
    assert listed - found <= {"dipaco/data/__init__.py"}, f"listed but gone: {sorted(listed - found)}"


def test_renames_and_hashes_happen_where_design_md_says() -> None:
    rows = _table("* One writer for files")
    places = {"os.replace": ["dipaco/storage/atomic.py"], "hashlib": ["dipaco/storage/hashing.py"]}
    for what, where, _ in rows:
        for w in _ticked(what):
            places[w] += _ticked(where)
    bad = []
    for f in _code_files():
        text = f.read_text(encoding="utf-8")
        tree = ast.parse(text)
        if "hashlib" in {m for m, _ in _imports(tree)} and _rel(f) not in places["hashlib"]:
            bad.append(f"{_rel(f)} imports hashlib")
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                 and n.func.attr in ("replace", "rename") and isinstance(n.func.value, ast.Name)
                 and n.func.value.id == "os"]
        if calls and _rel(f) not in places["os.replace"]:
            bad.append(f"{_rel(f)} calls os.{calls[0].func.attr}")
    assert not bad, "\n".join(bad)


def test_the_layers_line_is_the_layout_tests() -> None:
    from test_layout import LAYERS

    line = next(x for x in DESIGN.read_text(encoding="utf-8").splitlines() if x.startswith("layers, lowest first:"))
    assert _ticked(line) == LAYERS


# --------------------------------------------------------------------------- the docs' shape
MEASUREMENTS = "## Measurements"


def doc_shape_problems(text: str) -> list[str]:
    """What keeps a doc from the shape every page under docs/ has: a ``# title``, then an
    opening paragraph of prose (what a user does there) before the first ``##``, and the
    measurement history in at most one ``## Measurements`` section, the last ``##`` one; no
    other ``##`` heading names measuring. Headings inside code blocks are not headings."""
    lines, problems = text.splitlines(), []
    if not lines or not lines[0].startswith("# "):
        return ["the first line is not a '# ' title"]
    headings, fenced = [], False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("## "):
            headings.append((i, line.rstrip()))
    body = lines[1:headings[0][0] if headings else len(lines)]
    opening = next((x for x in body if x.strip()), "")
    if not opening or opening.lstrip().startswith(("```", "|", "#", "* ", "- ", ">", "!")):
        problems.append(f"no opening paragraph of prose under the title (first line: {opening[:60]!r})")
    named = [h for _, h in headings if re.search(r"measur", h, re.IGNORECASE)]
    if [h for h in named if h != MEASUREMENTS]:
        problems.append(f"measurements under another heading than {MEASUREMENTS!r}: {[h for h in named if h != MEASUREMENTS]}")
    if named.count(MEASUREMENTS) > 1:
        problems.append(f"{named.count(MEASUREMENTS)} '{MEASUREMENTS}' sections")
    if MEASUREMENTS in named and headings[-1][1] != MEASUREMENTS:
        problems.append(f"'{MEASUREMENTS}' is not the last '##' section ({headings[-1][1]!r} follows it)")
    return problems


def test_every_doc_opens_for_its_user_and_ends_with_its_measurements() -> None:
    docs = sorted((REPO / "docs").glob("*.md"))
    assert len(docs) >= 10, docs  # the folder itself, not a list kept here
    bad = [f"{d.relative_to(REPO)}: {p}" for d in docs for p in doc_shape_problems(d.read_text(encoding="utf-8"))]
    assert not bad, "\n".join(bad)


def test_the_doc_shape_check_catches_each_fault() -> None:
    """The checker itself: each rule on a doc that breaks only it."""
    good = "# T\n\nWhat a user does here.\n\n## Use\n\ntext\n\n```\n## not a heading\n```\n\n## Measurements\n\nx\n"
    assert doc_shape_problems(good) == []
    assert doc_shape_problems("# T\n\nWhat a user does here.\n\n## Use\n") == []  # no measurements: fine
    faults = {
        "no title": "T\n\nWhat.\n\n## Use\n",
        "no opening": "# T\n\n## Use\n\ntext\n",
        "a table first": "# T\n\n| a | b |\n\n## Use\n",
        "a code block first": "# T\n\n```\ndipaco-train\n```\n\n## Use\n",
        "two sections": "# T\n\nWhat.\n\n## Measurements\n\n## Use\n\n## Measurements\n",
        "not last": "# T\n\nWhat.\n\n## Measurements\n\nx\n\n## Limits\n",
        "another name": "# T\n\nWhat.\n\n## Measured (tiny configs)\n\n## Use\n",
    }
    for fault, text in faults.items():
        assert doc_shape_problems(text), fault
