"""Checkpoints: complete, atomic, hash-checked, no pickle (docs/design.md contract 5).

Layout of one checkpoint (one per outer-step boundary)::

    checkpoints/round_000004/
        modules/<module_id>.safetensors   global weights of each module after the outer step
        outer/<module_id>.safetensors     outer optimiser state, error-feedback residuals
        paths/path_<p>.safetensors        inner AdamW state of each path (+ JSON: step, data position)
        state.json                        round, sync statistics, anything JSON
        manifest.json                     sha256 + size of every file above; written last

Ranks write their own files into ``round_000004.partial/``; rank 0 then hashes every
file, writes the manifest and renames the directory. A crash at any point leaves either
a ``.partial`` directory (ignored and removed on the next save) or a complete checkpoint,
never a half-written one under the final name. ``latest_valid`` walks back to the newest
checkpoint whose manifest checks out, so a corrupt last checkpoint costs one round.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Iterable, Optional

# The writers and readers a checkpoint is made of. Also reachable by this module's name:
# the sync and rounds packages (and other branches) import them from here.
from dipaco.storage.atomic import atomic_write_text, fsync_dir, write_json
from dipaco.storage.hashing import sha256_file
from dipaco.storage.tensor_io import (CheckpointError, flatten_state, load_state, load_tensors, save_state,
                                  save_tensors, unflatten_state)

MANIFEST = "manifest.json"
_ROUND_DIR = re.compile(r"^round_(\d{6})$")


def round_dir_name(round_idx: int) -> str:
    """Directory name of the checkpoint taken after ``round_idx`` rounds."""
    return f"round_{round_idx:06d}"


class CheckpointManager:
    """Creates, verifies, finds and prunes the run's checkpoints.

    Only rank 0 calls :meth:`begin`, :meth:`commit` and :meth:`prune`; every rank may
    write files into the directory returned by :meth:`partial_dir` between a barrier
    after ``begin`` and a barrier before ``commit``.
    """

    def __init__(self, root: Path | str, keep_last: int = 2, stamp: Optional[str] = None) -> None:
        self.root = Path(root)
        self.keep_last = keep_last
        # what the run's checkpoints are made from (dipaco.run.fingerprint.checkpoint_stamp),
        # written into state.json so that a read can tell a checkpoint of another run
        self.stamp = stamp

    def partial_dir(self, round_idx: int) -> Path:
        return self.root / (round_dir_name(round_idx) + ".partial")

    def final_dir(self, round_idx: int) -> Path:
        return self.root / round_dir_name(round_idx)

    def begin(self, round_idx: int) -> Path:
        """Create an empty ``.partial`` directory for this round (a stale one is removed)."""
        part = self.partial_dir(round_idx)
        if part.is_symlink() or part.is_file():  # never follow a link out of the run directory
            part.unlink()
        elif part.exists():
            shutil.rmtree(part)
        part.mkdir(parents=True)
        return part

    def commit(self, round_idx: int, state: dict) -> Path:
        """Write ``state.json`` and the manifest, then rename ``.partial`` to final."""
        part = self.partial_dir(round_idx)
        write_json(part / "state.json", {**state, "made_from": self.stamp} if self.stamp else state)
        files = sorted(p for p in part.rglob("*") if p.is_file() and p.name != MANIFEST)
        manifest = {
            "round": round_idx,
            "files": {
                str(p.relative_to(part)): {"sha256": sha256_file(p), "bytes": p.stat().st_size}
                for p in files
            },
        }
        write_json(part / MANIFEST, manifest)
        final = self.final_dir(round_idx)
        if final.exists():  # a resumed run re-taking the same round
            shutil.rmtree(final)
        os.replace(part, final)
        fsync_dir(self.root)
        return final

    def list_rounds(self) -> list[int]:
        """Rounds that have a (not necessarily valid) final checkpoint, oldest first."""
        if not self.root.is_dir():
            return []
        found = (_ROUND_DIR.match(p.name) for p in self.root.iterdir() if p.is_dir())
        return sorted(int(m.group(1)) for m in found if m)

    @staticmethod
    def verify(path: Path | str, allow_extra: bool = False) -> dict:
        """Check a checkpoint against its manifest; return the manifest or raise.

        ``allow_extra``: files the manifest does not name are tolerated (an export, where
        the user may keep notes beside dipaco's files); they are never read either way."""
        path = Path(path)
        mpath = path / MANIFEST
        if not mpath.is_file():
            raise CheckpointError(f"checkpoint {path} has no {MANIFEST}")
        try:
            manifest = json.loads(mpath.read_text(encoding="utf-8"))
            files = manifest["files"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"unreadable manifest {mpath}: {e}") from None
        for rel, info in files.items():
            f = path / rel
            if not f.is_file():
                raise CheckpointError(f"checkpoint file {f} is listed in the manifest but missing")
            if f.stat().st_size != info["bytes"] or sha256_file(f) != info["sha256"]:
                raise CheckpointError(f"checkpoint file {f} does not match its manifest hash")
        # Only files the manifest names are ever read; a planted extra file (say a
        # pickle) is reported, not loaded.
        extra = [str(p.relative_to(path)) for p in path.rglob("*")
                 if p.is_file() and p.name != MANIFEST and str(p.relative_to(path)) not in files]
        if extra and not allow_extra:
            raise CheckpointError(f"checkpoint {path} holds files not in its manifest: {extra[:3]}")
        return manifest

    def latest_valid(self, log: Optional[callable] = None) -> Optional[Path]:
        """Newest checkpoint that verifies; corrupt ones are skipped with a message."""
        for r in reversed(self.list_rounds()):
            path = self.final_dir(r)
            try:
                self.verify(path)
                return path
            except CheckpointError as e:
                if log:
                    log(f"skipping checkpoint: {e}")
        return None

    def prune(self, protect: Iterable[int] = ()) -> None:
        """Delete all but the newest ``keep_last`` checkpoints (and stale partials)."""
        rounds = self.list_rounds()
        keep = set(rounds[-self.keep_last:]) | set(protect)
        for r in rounds:
            if r not in keep:
                shutil.rmtree(self.final_dir(r), ignore_errors=True)
        for p in self.root.glob("*.partial"):
            m = re.match(r"^round_(\d{6})\.partial$", p.name)
            if m and int(m.group(1)) < (rounds[-1] if rounds else 0):
                shutil.rmtree(p, ignore_errors=True)


__all__ = ["MANIFEST", "CheckpointError", "CheckpointManager", "atomic_write_text", "flatten_state",
           "load_state", "load_tensors", "round_dir_name", "save_state", "save_tensors", "sha256_file",
           "unflatten_state", "write_json"]
