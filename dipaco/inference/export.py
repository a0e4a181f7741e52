"""One path of a run as a standalone model directory, and loading it back."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from dipaco.run.checkpoint import MANIFEST, CheckpointError, CheckpointManager, load_tensors, save_tensors, sha256_file, write_json
from dipaco.data import Tokenizer
from dipaco.rounds.early_stopping import load_best_path
from dipaco.run.file_mode import follow_umask
from dipaco.inference.run import InferenceRun
from dipaco.run.path_guard import check_target
from modules import ModelConfig, ModuleGrid, PathModel

EXPORT_FORMAT = "dipaco-path"
EXPORT_VERSION = 1
# Every export directory holds this file: ``--force`` replaces only a directory that has
# it, so it can never empty a run directory or anything else it did not write.
EXPORT_MARKER = ".dipaco-export"
# Names that mark a dipaco run directory (never replaced, whatever else it holds).
_RUN_FILES = ("config.yaml", "checkpoints", "router", "metrics.jsonl")


def check_export_target(out: Path, overwrite: bool) -> None:
    """Refuse an ``--out`` that is a file, a run directory, or a non-empty directory
    without :data:`EXPORT_MARKER` (``overwrite`` only replaces an earlier export)."""
    # the rule every writing command follows: nothing inside a run directory, no special file
    check_target(out, "--out", replaces=overwrite, marker=EXPORT_MARKER,
                 fix="choose a new --out outside every run directory")
    if not out.exists():
        return
    if not out.is_dir():
        raise FileExistsError(f"--out {out} is a file, not a directory; choose a new --out")
    if any((out / name).exists() for name in _RUN_FILES):
        raise FileExistsError(f"--out {out} is a dipaco run directory; it is never replaced: choose a new --out")
    if not any(out.iterdir()):
        return
    if not (out / EXPORT_MARKER).is_file():
        raise FileExistsError(f"--out {out} is not empty and is not a dipaco export (no {EXPORT_MARKER}); "
                              "--force replaces only an earlier export: choose a new --out")
    if not overwrite:
        raise FileExistsError(f"{out} is not empty: it holds an earlier export (pass --force to replace it)")


def publish_directory(tmp: Path, out: Path) -> Path:
    """Move the finished export ``tmp`` to ``out``, replacing an earlier export there
    (set aside first, restored if the move fails); ``tmp`` never stays behind."""
    if not (tmp / EXPORT_MARKER).exists():
        (tmp / EXPORT_MARKER).write_text(f"{EXPORT_FORMAT} v{EXPORT_VERSION}\n", encoding="utf-8")
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, old / "export")
    try:
        os.replace(tmp, out)
    except BaseException:
        if old is not None:
            os.replace(old / "export", out)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return out


# --------------------------------------------------------------------------- export


def export_path(run: InferenceRun, path_id: int, out_dir: str | os.PathLike, *,
                overwrite: bool = False) -> Path:
    """Write path ``path_id`` as a standalone model directory; return it.

    Layout: ``model.safetensors`` (keys ``<module_id>/<param>``), ``config.json``
    (ModelConfig, the path, module ids, grid shape, source run and checkpoint),
    ``tokenizer.json`` and ``manifest.json`` (sha256 + size of each, the checkpoint
    format, so :meth:`CheckpointManager.verify` checks it) and :data:`EXPORT_MARKER`.
    Written into a temporary sibling directory, then renamed: never half-written, and
    nothing is left behind on failure. ``overwrite`` replaces only an earlier export.
    """
    out = Path(out_dir).expanduser().resolve()
    check_export_target(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = follow_umask(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))  # mkdtemp: 0700
    try:
        _write_export(run, int(path_id), tmp)
        return publish_directory(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_export(run: InferenceRun, path_id: int, tmp: Path) -> None:
    grid = run.new_grid()
    module_ids = grid.module_ids_of_path(int(path_id))
    tensors: dict[str, torch.Tensor] = {}
    # the path's kept best weights when the run kept them (trainer.path_early_stopping)
    best = load_best_path(run.run, grid, int(path_id)) if run.best_paths else None
    for mid in module_ids:
        if best is None:
            run.load_module_into(grid, mid)
        for name, t in grid.module_state_dict(mid).items():
            tensors[f"{mid}/{name}"] = t
    save_tensors(tmp / "model.safetensors", tensors, meta={"format": EXPORT_FORMAT, "module_ids": module_ids})
    run.tokenizer.save(tmp / "tokenizer.json")  # keeps a non-default eos (a plain copy would not)
    g = run.cfg.grid
    write_json(tmp / "config.json", {
        "format": EXPORT_FORMAT,
        "version": EXPORT_VERSION,
        "model": run.cfg.model.to_dict() if hasattr(run.cfg.model, "to_dict") else dict(vars(run.cfg.model)),
        "path_id": int(path_id),
        "path": list(grid.path_of(int(path_id))),
        "module_ids": module_ids,
        "grid": {"levels": list(g.levels), "private_embed": bool(g.private_embed),
                 "private_head": bool(g.private_head)},
        "seed": int(run.cfg.seed),
        "prefix_tokens": run.prefix_tokens,
        "source": {"run_dir": str(run.run.root), "checkpoint": run.checkpoint.name,
                   "module_sha256": {mid: run.manifest["files"][f"modules/{mid}.safetensors"]["sha256"]
                                     for mid in module_ids},
                   "best_weights": best},
    })
    (tmp / EXPORT_MARKER).write_text(f"{EXPORT_FORMAT} v{EXPORT_VERSION}\n", encoding="utf-8")
    files = sorted(p for p in tmp.iterdir() if p.is_file())
    write_json(tmp / MANIFEST, {"files": {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size}
                                          for p in files}})


def load_exported_path(directory: str | os.PathLike) -> tuple[PathModel, Any]:
    """Load a directory written by :func:`export_path` (or ``dipaco-infer export``).

    Checks every file against ``manifest.json`` first, then builds a lazy grid of the
    source run's shape in which only the exported path's modules are built and loaded.
    No router is needed. Returns ``(PathModel in eval mode, Tokenizer)``; raises
    :class:`CheckpointError` naming the file when anything is missing or corrupt.
    """
    d = Path(directory).expanduser().resolve()
    if not d.is_dir():
        raise CheckpointError(f"exported path directory {d} does not exist")
    CheckpointManager.verify(d)
    try:
        info = json.loads((d / "config.json").read_text(encoding="utf-8"))
        if info.get("format") != EXPORT_FORMAT or info.get("version") != EXPORT_VERSION:
            raise ValueError(f"format {info.get('format')!r} v{info.get('version')!r} is not "
                             f"{EXPORT_FORMAT!r} v{EXPORT_VERSION}")
        cfg = ModelConfig(**info["model"])
        g = info["grid"]
        grid = ModuleGrid(cfg, g["levels"], private_embed=g["private_embed"],
                          private_head=g["private_head"], seed=int(info.get("seed", 0)))
        path_id = int(info["path_id"])
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"unreadable {d / 'config.json'}: {e}") from None
    tensors, _ = load_tensors(d / "model.safetensors")
    for mid in grid.module_ids_of_path(path_id):
        state = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.split("/", 1)[0] == mid}
        try:
            grid.load_module_state_dict(mid, state)
        except ValueError as e:
            raise CheckpointError(f"{d / 'model.safetensors'}: {e}") from None
    model = PathModel(grid, path_id).eval()
    model.grid = grid
    return model, Tokenizer.load(str(d / "tokenizer.json"))
