"""The suite's own helpers keep what the tests check: the memoised walk of the built-in
corpus (tests/_corpus_memo.py) gives what the walk gives, skip counts included."""
from __future__ import annotations

import ast
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


# ------------------------------------------------------------------ the multiprocess marker

TESTS = Path(__file__).resolve().parent
# calls that start another process: a CLI in a subprocess, gloo ranks, elastic agents
STARTS = {"run", "Popen", "check_output", "check_call", "call", "subprocess_cli", "run_ranks", "run_agents",
          "spawn", "start_processes"}
# tests that start a process and do not carry the marker yet (none now; a listed test that
# gains the marker fails the check below, so the list cannot go stale)
NOT_YET_MARKED: set[str] = set()


def _starts_a_process(node: ast.AST, helpers: dict[str, ast.FunctionDef], seen: set[str]) -> bool:
    """Whether ``node`` calls one of STARTS (``subprocess.run``, not any ``.run``), directly or
    through a function or fixture of the same file."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            f = sub.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else None
            if name in STARTS and (owner in (None, "subprocess", "mp", "multiprocessing") or name == "Popen"):
                if name != "run" or owner == "subprocess":
                    return True
        names = [sub.id] if isinstance(sub, ast.Name) else [a.arg for a in sub.args.args] \
            if isinstance(sub, ast.FunctionDef) else []
        for n in names:
            if n in helpers and n not in seen:
                seen.add(n)
                if _starts_a_process(helpers[n], helpers, seen):
                    return True
    return False


def _marked(fn: ast.FunctionDef, module: ast.Module) -> bool:
    marks = [ast.unparse(d) for d in fn.decorator_list]
    marks += [ast.unparse(n.value) for n in module.body if isinstance(n, ast.Assign)
              and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in n.targets)]
    return any("mark.multiprocess" in m for m in marks)


def test_every_test_that_starts_a_process_is_marked_multiprocess() -> None:
    """``pytest -m "not slow and not multiprocess"`` (the fast lane) starts no process: a
    test that runs a CLI in a subprocess or spawns ranks carries ``multiprocess``."""
    unmarked = set()
    for path in sorted(TESTS.glob("test_*.py")):
        module = ast.parse(path.read_text(encoding="utf-8"))
        helpers = {n.name: n for n in module.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("test_")}
        for fn in module.body:
            if isinstance(fn, ast.FunctionDef) and fn.name.startswith("test_") and not _marked(fn, module) \
                    and _starts_a_process(fn, helpers, {fn.name}):
                unmarked.add(f"{path.name}::{fn.name}")
    assert unmarked == NOT_YET_MARKED, sorted(unmarked ^ NOT_YET_MARKED)
