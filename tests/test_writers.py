"""Rule 6 (docs/reliability.md): one writer for every file a command writes.

Enumerated from the code, never listed here:

* the source of every command (dipaco/, router/, modules/, benchmarks/) is scanned for the
  calls that write a file (``open(..., "w")``, ``write_text``, ``json.dump``, ``savefig``,
  ``np.save``, ...): each lies in the storage layer (``dipaco/storage/``, ``dipaco/run/owned.py``)
  or writes the temporary file or staging folder that layer hands it (a ``tmp`` or
  ``staging`` path, published by a rename); so every write is atomic and none is a second
  writer beside the one rule;
* every ``json.dump(s)`` that writes goes through ``dumps_strict`` (no ``NaN`` token);
* every writer into a place the user names is in the registry ``dipaco.run.owned.OUTPUTS``,
  and each registered writer is walked through the same hostile targets: a file of the
  user's, a symbolic link, its own earlier output with and without its flag.
"""
from __future__ import annotations

import ast
import json
import math
import os
from pathlib import Path

import pytest

from dipaco.run.owned import OUTPUTS, OwnershipError, check_out_file, write_owned_file
from dipaco.storage.strict_json import dumps_strict, loads_restored

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("dipaco", "router", "modules", "benchmarks")
# the storage layer: the only code that writes files by hand (atomic.py, jsonl.py, owned.py),
# and the decoupled store's own (an exclusive create on an object store, a rename locally)
STORAGE = ("dipaco/storage/", "dipaco/run/owned.py", "dipaco/decoupled/store.py", "dipaco/decoupled/fsspec_store.py")
# HTTP bodies are not files: the server's responses are the serve package's (Starlette's
# JSONResponse refuses NaN itself); the scan of raw file writes covers it all the same
NOT_FILES = ("dipaco/serve/",)
# the decoupled store's records (inboxes, revisions, event logs) are its own protocol, written
# and read back by the same code (dipaco/decoupled/store.py: leases and slots are its
# encode_json records); the run's decoupled_metrics.json is written by the storage layer.
# Adopting strict JSON inside the store needs its readers to restore the numbers
# (strict_json.loads_restored): left to the store's owners
STORE_RECORDS = ("dipaco/decoupled/metrics.py", "dipaco/decoupled/module_leases.py", "dipaco/decoupled/store.py",
                 "dipaco/decoupled/supervisor.py", "dipaco/decoupled/worker.py")
WRITE_CALLS = {"write_text", "write_bytes", "savefig", "save_file", "savez", "savez_compressed", "to_parquet",
               "save_to_disk", "truncate"}
MODULE_WRITES = {("np", "save"), ("numpy", "save"), ("torch", "save"), ("OmegaConf", "save"), ("shutil", "copy"),
                 ("shutil", "copyfile"), ("shutil", "copy2"), ("json", "dump")}
STAGED = ("tmp", "staging", "buf")  # a temporary file or folder the storage layer publishes by a rename


def _sources() -> list[Path]:
    return [f for root in ROOTS for f in sorted((REPO / root).rglob("*.py"))]


def _opens_for_writing(call: ast.Call) -> bool:
    mode = call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords if k.arg == "mode"), None)
    return isinstance(mode, ast.Constant) and isinstance(mode.value, str) and any(c in mode.value for c in "wax+")


def raw_writes(tree: ast.AST) -> list[ast.Call]:
    """The calls of ``tree`` that write a file by hand."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        fn = node.func
        if isinstance(fn, ast.Name) and fn.id == "open" and _opens_for_writing(node):
            out.append(node)
        elif isinstance(fn, ast.Attribute):
            owner = fn.value.id if isinstance(fn.value, ast.Name) else None
            if fn.attr in WRITE_CALLS or (owner, fn.attr) in MODULE_WRITES or (fn.attr == "open" and
                                                                               _opens_for_writing(node)):
                out.append(node)
    return out


def staged(call: ast.Call) -> bool:
    """The call writes a temporary file or staging folder (or an in-memory buffer): its
    receiver or first argument names one."""
    fn = call.func
    texts = [ast.unparse(x) for x in ((fn.value,) if isinstance(fn, ast.Attribute) else ()) + tuple(call.args[:1])]
    return any(word in t for t in texts for word in STAGED)


def test_every_file_write_goes_through_the_storage_layer() -> None:
    bad = []
    for f in _sources():
        rel = f.relative_to(REPO).as_posix()
        if rel.startswith(STORAGE):
            continue
        for call in raw_writes(ast.parse(f.read_text(encoding="utf-8"))):
            if not staged(call):
                bad.append(f"{rel}:{call.lineno}: {ast.unparse(call)[:90]}")
    assert not bad, ("write these through dipaco/storage (write_atomically, append_json_lines) or "
                     "dipaco/run/owned.py (a place the user names):\n" + "\n".join(bad))


def test_the_scan_sees_a_hand_written_file() -> None:
    tree = ast.parse("open(p, 'w').write(x)\nPath(p).write_text(x)\njson.dump(x, f)\nfig.savefig(out)\n"
                     "open(p).read()\nwrite_atomically(p, lambda tmp: fig.savefig(tmp))\n")
    assert sorted(c.lineno for c in raw_writes(tree) if not staged(c)) == [1, 2, 3, 4]


def test_every_json_written_is_strict() -> None:
    """Every json.dump/json.dumps in the code goes through dumps_strict (dipaco/storage/strict_json.py),
    or refuses NaN itself (``allow_nan=False``: router/, which imports no dipaco package)."""
    bad = []
    for f in _sources():
        rel = f.relative_to(REPO).as_posix()
        if rel == "dipaco/storage/strict_json.py" or rel.startswith(NOT_FILES) or rel in STORE_RECORDS:
            continue
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "json"
                    and node.func.attr in ("dump", "dumps")
                    and not any(k.arg == "allow_nan" and getattr(k.value, "value", True) is False
                                for k in node.keywords)):  # refuses NaN itself: a record without floats
                bad.append(f"{rel}:{node.lineno}")
    assert not bad, f"use dipaco.storage.strict_json.dumps_strict: {bad}"


def test_strict_json_writes_null_with_the_reason_and_reads_back_the_number() -> None:
    obj = {"ppl": math.inf, "loss": math.nan, "per_path": [1.0, -math.inf], "n": 3, "ok": 2.5}
    text = dumps_strict(obj, sort_keys=True)
    data = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    assert data["ppl"] is None and data["ppl_nonfinite"] == "inf" and data["loss_nonfinite"] == "nan"
    assert data["per_path"] == [1.0, None] and data["per_path_nonfinite"] == {"1": "-inf"}
    back = loads_restored(text)
    assert back["ppl"] == math.inf and math.isnan(back["loss"]) and back["per_path"][1] == -math.inf
    assert set(back) == set(obj)
    assert loads_restored(dumps_strict(math.nan)) != loads_restored(dumps_strict(math.nan))  # nan itself


# ------------------------------------------------------------------ every registered writer


@pytest.mark.parametrize("what", sorted(OUTPUTS))
def test_every_registered_writer_refuses_a_users_file_a_link_and_its_own_without_its_flag(tmp_path, what) -> None:
    flag = OUTPUTS[what]
    out = tmp_path / "out.json"
    write_owned_file(out, "1", what)
    if flag:
        with pytest.raises(OwnershipError, match=f"pass {flag}"):
            check_out_file(out, what, again=False)
        assert out.read_text() == "1"
    assert check_out_file(out, what, again=True) == out.resolve()
    mine = tmp_path / "mine.json"
    mine.write_text("mine")
    # with its flag, a continued file (--resume) is vouched for by its own job record instead
    for again in (False,) if flag == "--resume" else (False, True):
        with pytest.raises(OwnershipError, match="did not write it|never overwritten"):
            check_out_file(mine, what, again=again)
    with pytest.raises(OwnershipError, match="did not write it"):
        write_owned_file(mine, "x", what)
    link = tmp_path / "link.json"
    link.symlink_to(mine)
    with pytest.raises(OwnershipError, match="symbolic link"):
        check_out_file(link, what, again=True)
    with pytest.raises(OwnershipError, match="symbolic link"):
        write_owned_file(link, "x", what)
    assert mine.read_text() == "mine"
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p or p.startswith(".dipaco-partial")]


def test_an_unregistered_writer_is_refused() -> None:
    with pytest.raises(ValueError, match="not a registered writer"):
        write_owned_file("/nonexistent/x.json", "1", "some new --out")
