"""The house's layout (docs/design.md, "Package boundaries"): packages by concern, in layers.

``dipaco/`` holds packages only; no package holds more than 15 modules; a package imports
only packages below it in ``LAYERS`` (its own included), with no exception; no modules
import each other, even round a cycle or from inside a function; ``dipaco.config`` loads
neither torch, faiss nor another dipaco package. The table in docs/design.md is this one.
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MAX_MODULES = 15

# lowest first: a package may import the packages before it (docs/design.md shows this list)
LAYERS = ["config", "storage", "run", "runtime", "data", "plan", "sync", "rounds", "decoupled", "sim", "job", "inference", "serve", "cli", "fleet"]


def _dipaco_imports(path: Path) -> set[str]:
    """The ``dipaco.<package>`` names a file imports (any nesting: lazy imports count too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for n in names:
            parts = n.split(".")
            if parts[0] == "dipaco" and len(parts) > 1:
                out.add(parts[1])
    return out


def test_the_top_level_holds_packages_only() -> None:
    modules = sorted(p.name for p in (REPO / "dipaco").glob("*.py") if p.name != "__init__.py")
    assert not modules, f"modules at dipaco/'s top level (put each in the package of its concern): {modules}"
    packages = sorted(p.name for p in (REPO / "dipaco").iterdir() if (p / "__init__.py").is_file())
    assert set(packages) - {"conf"} == set(LAYERS), "every package of dipaco/ has its place in LAYERS"


def test_no_package_holds_more_than_15_modules() -> None:
    big = {}
    for init in [*(REPO / "dipaco").rglob("__init__.py"), REPO / "router/__init__.py", REPO / "modules/__init__.py"]:
        mods = [p for p in init.parent.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
        if len(mods) > MAX_MODULES:
            big[str(init.parent.relative_to(REPO))] = len(mods)
    assert not big, f"packages over {MAX_MODULES} modules (split them by concern): {big}"


def test_packages_import_only_downwards() -> None:
    bad = []
    for i, pkg in enumerate(LAYERS):
        allowed = set(LAYERS[: i + 1])
        for f in sorted((REPO / "dipaco" / pkg).rglob("*.py")):
            rel = str(f.relative_to(REPO))
            up = _dipaco_imports(f) - allowed - {"conf"}
            if up:
                bad.append(f"{rel} imports {sorted(up)}")
    assert not bad, "imports against the layers (docs/design.md):\n" + "\n".join(bad)


def test_the_config_imports_no_other_package() -> None:
    """Every module of dipaco/config/ imports no other dipaco package (at any nesting):
    the implementations' names reach it as data (dipaco/config/names.py)."""
    bad = {str(f.relative_to(REPO)): sorted(_dipaco_imports(f) - {"config"})
           for f in sorted((REPO / "dipaco" / "config").glob("*.py")) if _dipaco_imports(f) - {"config"}}
    assert not bad, f"config modules importing other dipaco packages: {bad}"


@pytest.mark.multiprocess  # a fresh interpreter: the only way to see what an import loads
def test_importing_the_config_loads_no_torch_faiss_or_other_package() -> None:
    """In a fresh interpreter, the whole config (schema, domains, checks, composition)
    loads neither torch nor faiss nor any dipaco package but itself."""
    code = ("import sys, dipaco.config, dipaco.config.validate, dipaco.config.applies, dipaco.config.schedule; "
            "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'faiss') or "
            "(m.startswith('dipaco.') and m.split('.')[1] != 'config'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [], f"import dipaco.config loaded: {out.stdout.split()[:20]}"


def _module_name(path: Path) -> str:
    if not path.is_relative_to(REPO):
        return path.stem
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_imports(path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` a file imports, at any nesting (a function-level or
    TYPE_CHECKING import counts: one that hides a cycle is a cycle); ``from pkg import x``
    is the submodule ``pkg.x`` when there is one, else ``pkg``."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
    return {m for m in out if m in known and m != me}


def _import_graph() -> dict[str, set[str]]:
    files = [p for top in ("dipaco", "router", "modules") for p in sorted((REPO / top).rglob("*.py"))]
    known = {_module_name(p) for p in files}
    return {_module_name(p): _module_imports(p, known) for p in files}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of modules (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def test_no_file_imports_itself_through_others() -> None:
    """No cycle of module imports in dipaco/, router/ or modules/: each group below must
    be untangled (move what both need to a lower module)."""
    groups = _cycles(_import_graph())
    assert not groups, "modules that import each other (directly or round a cycle):\n" + "\n".join(
        " <-> ".join(g) for g in groups)


def test_the_cycle_check_sees_function_level_imports(tmp_path: Path) -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    f = tmp_path / "x.py"
    f.write_text("def f():\n    from dipaco.data.corpus import load_corpus\n", encoding="utf-8")
    assert _module_imports(f, {"dipaco.data.corpus"}) == {"dipaco.data.corpus"}


def test_design_doc_shows_these_layers() -> None:
    text = (REPO / "docs" / "design.md").read_text(encoding="utf-8")
    m = re.search(r"^layers, lowest first: (.+)$", text, re.M)
    assert m, "docs/design.md lists the layers on a line 'layers, lowest first: ...'"
    assert [x.strip(" `.") for x in m.group(1).split("<")] == LAYERS
