"""Which paths a command may write or delete: one rule for every writing command.

A run directory holds a week of compute, so a path a command writes (``dipaco-infer
score --out``, ``export --out``, ``diloco.decoupled.store_url``, ``data.cache_dir``, the
checkpoint staging folder, a new run directory) passes :func:`check_target` first
(docs/design.md contract 8):

* symlinks are resolved first, so a link cannot smuggle a write elsewhere;
* a special file (FIFO, socket, device) is never a target; nor a path under a file, a
  file where a folder is wanted (``folder=True``), or a place in a read-only folder
  (:func:`writable_problem`: refused before work, not an ``OSError`` mid-run);
* a path inside a run directory is refused unless it lies in one of the locations that
  command owns in *its own* run (``cache/`` for the token cache, ``decoupled/`` for the
  store, ``checkpoints/`` for staging); so a run file, another run's folder or a
  directory nested in a run are never written by a command that does not own them;
* a directory the command would replace or empty must carry its maker's mark (an
  export's ``.dipaco-export``, a store's ``owner.json``): never a directory it did not
  create.

A refusal is one :class:`~dipaco.run.run_dir.RunDirError` line naming the path, why, and the
fix; nothing has been written when it is raised.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Optional, Sequence

from dipaco.run.run_dir import RunDirError

# A folder holding config.yaml and one of these is a dipaco run directory.
_RUN_EVIDENCE = ("fingerprints.json", "checkpoints", "tokenizer.json", "summary.json", "router", ".dipaco.lock",
                 "shards", "metrics.jsonl")


def resolved(path: str | os.PathLike) -> Path:
    """``path`` absolute, ``~`` expanded, every symlink along it resolved."""
    return Path(path).expanduser().resolve()


def is_run_directory(d: Path) -> bool:
    """Whether ``d`` holds a dipaco run (``config.yaml`` and a run artefact beside it)."""
    try:
        return (d / "config.yaml").is_file() and any((d / name).exists() for name in _RUN_EVIDENCE)
    except OSError:  # unreadable: not ours to judge, and not ours to write
        return False


def enclosing_run(path: Path) -> Optional[Path]:
    """The run directory ``path`` is (or lies in), innermost first; ``None`` if none."""
    for d in (path, *path.parents):
        if is_run_directory(d):
            return d
    return None


def _kind(p: Path) -> Optional[str]:
    """``"special file"`` for a FIFO, socket or device, else ``None`` (or missing)."""
    try:
        mode = os.stat(p).st_mode
    except OSError:
        return None
    if stat.S_ISDIR(mode) or stat.S_ISREG(mode):
        return None
    return "a special file (a FIFO, socket or device)"


def writable_problem(target: Path, folder: bool = False) -> Optional[str]:
    """Why ``target`` (resolved) cannot be written, as a folder with ``folder``; ``None``
    when it can: an existing file where a folder is wanted, a file among its parents, or a
    read-only place (the nearest existing folder, or ``target`` itself)."""
    if target.exists():
        if folder and not target.is_dir():
            return "a file, not a folder"
        if not os.access(target, os.W_OK | (os.X_OK if target.is_dir() else 0)):
            return "read-only"
        return None
    parent = target.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"under {parent}, which is a file, not a folder"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"in the read-only folder {parent}"
    return None


def check_target(path: str | os.PathLike, what: str, *, own_run: Optional[Path] = None,
                 owned: Sequence[str] = (), replaces: bool = False, marker: Optional[str] = None,
                 fix: str = "choose a path outside every run directory", folder: bool = False) -> Path:
    """The resolved ``path`` if the command ``what`` may write it; else :class:`RunDirError`.

    Args:
        what: the setting or argument that names the path (``score --out``), for the message.
        own_run: the run directory the command writes (None: it writes none).
        owned: the locations inside ``own_run`` that the command owns (``"cache"``).
        replaces: the command empties or replaces ``path`` when it exists.
        marker: the file that marks a directory as made by this command (required inside
            an existing non-empty directory that ``replaces`` would remove).
        fix: the way out, for the message.
        folder: the command makes ``path`` a folder (a file there is refused).
    """
    target = resolved(path)
    special = _kind(target) or writable_problem(target, folder)
    if special:
        raise RunDirError(f"{what} {path} is {special}; {fix}")
    mine = resolved(own_run) if own_run is not None else None
    if mine is not None and (target == mine or mine in target.parents):
        # its own run (a run directory even before config.yaml is written): owned places only
        if not any(target == mine / o or mine / o in target.parents for o in owned):
            places = ", ".join(f"{o}/" for o in owned) or "nothing"
            raise RunDirError(f"{what} {path} is a file or folder of the run {mine} ({what} may write only "
                              f"{places} there); {fix}")
    else:
        run = enclosing_run(target)
        if run is not None:
            raise RunDirError(f"{what} {path} lies in the run directory {run}: no command writes into a run "
                              f"directory it does not own; {fix}")
    if replaces and target.is_dir() and marker is not None and any(target.iterdir()) \
            and not (target / marker).is_file():
        raise RunDirError(f"{what} {path} is a folder this command did not make (no {marker}); "
                          f"it never replaces it: {fix}")
    return target


def check_run_root(path: str | os.PathLike) -> Path:
    """A run directory to create or continue: not a file or special file, not inside
    another run directory (``hydra.run.dir=RUN/checkpoints``)."""
    target = resolved(path)
    if target.exists() and not target.is_dir():
        raise RunDirError(f"run directory {path} is {_kind(target) or 'a file'}, not a directory: "
                          "choose another hydra.run.dir")
    unusable = writable_problem(target, folder=True)
    if unusable:
        raise RunDirError(f"run directory {path} is {unusable}: choose another hydra.run.dir")
    outer = enclosing_run(target.parent)
    if outer is not None:
        raise RunDirError(f"run directory {path} lies in the run directory {outer}: a run never writes into "
                          "another; choose a hydra.run.dir outside it")
    return target


__all__ = ["check_run_root", "check_target", "enclosing_run", "is_run_directory", "resolved", "writable_problem"]
