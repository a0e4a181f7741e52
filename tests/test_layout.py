"""The house's layout (docs/design.md, "Package boundaries"): packages by concern, in layers.

``dipaco/`` holds packages only; no package holds more than 15 modules; a package imports
only packages below it in ``LAYERS`` (its own included), save the few modules listed in
``EXCEPTIONS`` with the reason; the table in docs/design.md is this one.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_MODULES = 15

# lowest first: a package may import the packages before it (docs/design.md shows this list)
LAYERS = ["config", "run", "runtime", "data", "plan", "sync", "rounds", "decoupled", "sim", "job", "inference", "serve", "cli"]
# module → the packages above it that it may import, and why (the design doc says the same)
EXCEPTIONS = {
    # Hydra composition sets model.vocab_size from a given tokenizer file
    "dipaco/config/compose.py": {"data"},
    # the checks ask the runtime what it supports: devices, codecs, outer optimisers, FSDP2
    "dipaco/config/domains.py": {"plan", "runtime", "sync"},
    "dipaco/config/validate.py": {"plan", "runtime", "sync"},
}


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
            up = _dipaco_imports(f) - allowed - EXCEPTIONS.get(rel, set()) - {"conf"}
            if up:
                bad.append(f"{rel} imports {sorted(up)}")
    assert not bad, "imports against the layers (docs/design.md):\n" + "\n".join(bad)


def test_the_config_core_reads_and_imports_nothing_else() -> None:
    """The schema, its errors, decoupled mode's settings and the step schedule import no
    other dipaco package: anything may import them without a cycle."""
    for name in ("schema", "errors", "decoupled", "schedule"):
        f = REPO / "dipaco" / "config" / f"{name}.py"
        assert _dipaco_imports(f) <= {"config"}, f"{f.relative_to(REPO)} imports {_dipaco_imports(f)}"


def test_exceptions_are_still_needed() -> None:
    """An exception nobody uses any more is deleted, not kept as a licence."""
    for rel, extra in EXCEPTIONS.items():
        assert _dipaco_imports(REPO / rel) & extra, f"{rel} no longer imports {sorted(extra)}: drop the exception"


def test_design_doc_shows_these_layers() -> None:
    text = (REPO / "docs" / "design.md").read_text(encoding="utf-8")
    m = re.search(r"^layers, lowest first: (.+)$", text, re.M)
    assert m, "docs/design.md lists the layers on a line 'layers, lowest first: ...'"
    assert [x.strip(" `.") for x in m.group(1).split("<")] == LAYERS
    for rel in EXCEPTIONS:
        assert rel in text, f"docs/design.md names the exception {rel}"
