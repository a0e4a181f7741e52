"""One path of a run as a standalone model directory, and loading it back."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

import torch

from dipaco.storage.atomic import write_json
from dipaco.run.checkpoint import MANIFEST, CheckpointError, CheckpointManager
from dipaco.storage.hashing import sha256_file
from dipaco.storage.tensor_io import load_tensors, save_tensors
from dipaco.data import Tokenizer
from dipaco.rounds.early_stopping import load_best_path
from dipaco.inference.model_card import write_provenance
from dipaco.inference.run import InferenceRun
from dipaco.run.owned import RECORD, OwnedWrite, check_owned, read_record, sweep_stale_staging
from dipaco.run.path_guard import check_target
from modules import ModelConfig, ModuleGrid, PathModel

EXPORT_FORMAT = "dipaco-path"
EXPORT_VERSION = 1
# Every export directory holds this file: ``--force`` replaces only a directory that has
# it, so it can never empty a run directory or anything else it did not write.
EXPORT_MARKER = ".dipaco-export"
# What a dipaco-format export writes (and so may replace with --force).
DIPACO_EXPORT_FILES = ("model.safetensors", "config.json", "tokenizer.json", "manifest.json", "provenance.json",
                       EXPORT_MARKER)
# Names that mark a dipaco run directory (never replaced, whatever else it holds).
_RUN_FILES = ("config.yaml", "checkpoints", "metrics.jsonl", "fingerprints.json")


def check_export_target(out: Path, overwrite: bool, names: Sequence[str] = ()) -> None:
    """Refuse, before any work, an ``--out`` that is a file, a run directory, a folder inside
    another export, a non-empty folder that holds no earlier export, an earlier export
    without ``overwrite``, or (``overwrite``) one where a file of the user's or a link
    stands in the way of ``names`` (dipaco/run/owned.py: ``--force`` replaces only the
    files an earlier export wrote; the user's own files beside them stay)."""
    # the rule every writing command follows: nothing inside a run directory, no special file
    check_target(out, "--out", fix="choose a new --out outside every run directory")
    for parent in out.parents:  # an export's path folder is part of that export
        if (parent / EXPORT_MARKER).is_file():
            raise FileExistsError(f"--out {out} lies inside the dipaco export {parent}; replacing part of it "
                                  "would break it: choose a new --out (or replace the whole export)")
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir():
        raise FileExistsError(f"--out {out} is a file, not a directory; choose a new --out")
    mine = (out / EXPORT_MARKER).is_file() and bool(read_record(out))
    if any((out / name).exists() for name in _RUN_FILES) and not mine:
        raise FileExistsError(f"--out {out} is a dipaco run directory; it is never replaced: choose a new --out")
    sweep_stale_staging(out)  # what an interrupted export left: ours, and nobody else's
    if not any(out.iterdir()):
        return
    if not mine and (out / EXPORT_MARKER).is_file():
        raise FileExistsError(f"--out {out} holds an export by an older dipaco (no {RECORD}: which of its files "
                              "are dipaco's is not recorded), so --force cannot tell them from yours: remove it or "
                              "choose a new --out")
    if not mine:
        raise FileExistsError(f"--out {out} is not empty and is not a dipaco export (no {EXPORT_MARKER}); "
                              "--force replaces only an earlier export: choose a new --out")
    if not overwrite:
        raise FileExistsError(f"{out} is not empty: it holds an earlier export (pass --force to replace it)")
    check_owned(out, names, "export --out", replace=True)


def staged_export(out: Path, overwrite: bool) -> OwnedWrite:
    """The staging of an export into ``out`` (``with staged_export(out, force) as tmp:``):
    written in full inside ``out``, then moved in by the ownership rule."""
    return OwnedWrite(out, "export --out", replace=overwrite)


# --------------------------------------------------------------------------- export


def export_path(run: InferenceRun, path_id: int, out_dir: str | os.PathLike, *,
                overwrite: bool = False) -> Path:
    """Write path ``path_id`` as a standalone model directory; return it.

    Layout: ``model.safetensors`` (keys ``<module_id>/<param>``), ``config.json``
    (ModelConfig, the path, module ids, grid shape, source run and checkpoint),
    ``tokenizer.json`` and ``manifest.json`` (sha256 + size of each, the checkpoint
    format, so :meth:`CheckpointManager.verify` checks it) and :data:`EXPORT_MARKER`.
    Staged inside ``out`` and moved in when complete (:mod:`dipaco.run.owned`): never
    half-written, nothing left behind on failure; ``overwrite`` replaces only the files an
    earlier export wrote.
    """
    out = Path(out_dir).expanduser().resolve()
    check_export_target(out, overwrite, DIPACO_EXPORT_FILES)
    with staged_export(out, overwrite) as tmp:
        _write_export(run, int(path_id), tmp)
    return out


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
    write_provenance(run, tmp)  # what trained the run, and this export
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
    CheckpointManager.verify(d, allow_extra=True)  # the user's notes beside it are never read
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
