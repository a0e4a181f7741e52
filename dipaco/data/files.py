"""Which local files a source reads, by rule: regular files only, opened without blocking.

``data.path`` names a file, a glob or a directory. Whatever it names, only **regular
files** are read. A FIFO, a device, a socket, a broken or looping symlink, or a
directory matched by a glob is not data: inside a directory or a glob it is counted
(``not_a_regular_file``) and skipped; as the whole input it is refused in one line. A
FIFO is never opened for reading by name (that blocks until a writer appears): files are
classified with ``stat`` and opened with ``O_NONBLOCK``, then checked again with
``fstat``, so a file swapped for a FIFO in between is caught too.

With ``data.splits=auto`` a file's **own split** is read off its path under
``data.path``: the outermost path component (a directory, or a file's name) named ``train``
/ ``training``, ``validation`` / ``valid`` / ``val`` / ``dev`` or ``test`` / ``testing``,
alone or followed by ``-``, ``_``, ``.``, a space or a digit (``train-00000-of-00004``),
as Hugging Face names split files.

Folders dipaco wrote (a run directory, an export, a report, a sweep folder:
:func:`dipaco.run.outputs.is_dipaco_output`) are never read: inside a directory or under
a glob they are skipped whole and counted (``dipaco_output``); as ``data.path`` itself,
or as the folder of the file it names, they are refused in one line.
"""
from __future__ import annotations

import glob
import os
import re
import stat
from typing import BinaryIO, Dict, List, Optional, Tuple

from dipaco.config.names import source_suffixes
from dipaco.data.errors import DataError
from dipaco.run.outputs import SKIPPED_OUTPUT, is_dipaco_output

__all__ = ["NOT_REGULAR", "SPLIT_NAMES", "file_split", "open_regular", "relative_id", "resolve_files"]

NOT_REGULAR = "not_a_regular_file"
# the split a path component names (docs/data.md, "A dataset's own splits")
SPLIT_NAMES = {"train": "train", "training": "train", "validation": "validation", "valid": "validation",
               "val": "validation", "dev": "validation", "test": "test", "testing": "test"}
_SPLIT_RE = re.compile(r"^(" + "|".join(sorted(SPLIT_NAMES, key=len, reverse=True)) + r")(?:[-_. 0-9]|$)",
                       re.IGNORECASE)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


def _count(skipped: Dict[str, int]) -> None:
    skipped[NOT_REGULAR] = skipped.get(NOT_REGULAR, 0) + 1


def _is_regular(path: str) -> bool:
    """``stat`` (following symlinks) says a regular file; a broken or looping link says no."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def resolve_files(path: Optional[str], source: str, skipped: Optional[Dict[str, int]] = None
                  ) -> Tuple[List[str], str]:
    """Expand ``data.path`` (file, glob or directory) to its sorted regular files and the
    root their ids are relative to. Entries that are not regular files are counted in
    ``skipped`` (``not_a_regular_file``); an input with none is one :class:`DataError`."""
    skipped = {} if skipped is None else skipped
    if not path:
        raise DataError(f"data.path is not set but data.source={source} reads local files. "
                        f"Fix: pass data.path=FILE, a glob or a directory")
    path = os.path.expanduser(str(path))
    suffixes = source_suffixes(source)  # its registry line (dipaco.config.names.DATA_SOURCES)
    try:
        mode: Optional[int] = os.stat(path).st_mode
    except FileNotFoundError:
        mode = None
        if os.path.islink(path):
            raise DataError(f"data.path={path} is a broken symlink. Fix: point data.path at the data itself") from None
    except OSError as e:  # ELOOP (a symlink loop), EACCES, ...
        raise DataError(f"data.path={path} cannot be read ({e.strerror or e}). "
                        f"Fix: point data.path at a readable regular file, glob or directory") from None
    if mode is not None:
        _refuse_output(path, path if stat.S_ISDIR(mode) else os.path.dirname(os.path.abspath(path)))
    if mode is not None and stat.S_ISDIR(mode):
        return _walk(path, source, suffixes, skipped), path
    if mode is not None and stat.S_ISREG(mode):
        return [path], os.path.dirname(path)
    if mode is not None:
        raise DataError(f"data.path={path} is {_kind(mode)}, not a regular file: dipaco reads regular files only "
                        f"(a FIFO or device could block or never end). Fix: write the data to a file")
    if glob.has_magic(path):
        files = []
        outputs = _OutputFolders(_glob_base(path), skipped)
        for f in sorted(glob.glob(path, recursive=True)):
            if outputs.holds(f):
                continue
            if _is_regular(f):
                files.append(f)
            else:
                _count(skipped)
        if not files:
            extra = f" that is a regular file ({skipped[NOT_REGULAR]} others)" if skipped.get(NOT_REGULAR) else ""
            raise DataError(f"data.path={path}: no file matches this pattern{extra}. Fix: check the pattern")
        root = os.path.commonpath([os.path.dirname(os.path.abspath(f)) for f in files])
        return files, root
    raise DataError(f"data.path={path}: no such file or directory. Fix: pass an existing file, glob or directory")


def _walk(path: str, source: str, suffixes: Optional[Tuple[str, ...]], skipped: Dict[str, int]) -> List[str]:
    files: List[str] = []
    for dirpath, dirnames, filenames in os.walk(path):  # symlinked directories are not followed (no loops)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and not _skip_output(dirpath, d, skipped))
        for name in sorted(filenames):
            if name.startswith(".") or (suffixes is not None and not name.lower().endswith(suffixes)):
                continue
            full = os.path.join(dirpath, name)
            if _is_regular(full):
                files.append(full)
            else:
                _count(skipped)
    if not files:
        wanted = "regular files" if suffixes is None else "/".join(f"*{s}" for s in suffixes) + " regular files"
        extra = f" ({skipped[NOT_REGULAR]} entries are not regular files)" if skipped.get(NOT_REGULAR) else ""
        raise DataError(f"data.path={path}: the directory holds no {wanted} for data.source={source}{extra}. "
                        f"Fix: point data.path at the data files or change data.source")
    return sorted(files)


def _refuse_output(path: str, folder: str) -> None:
    """``data.path`` naming a folder dipaco wrote (or a file in one): one line, never read."""
    if is_dipaco_output(folder):
        raise DataError(f"data.path={path} is {'in ' if folder != path else ''}a folder dipaco wrote (a run "
                        f"directory, export, report or sweep folder): its files are outputs, not training data. "
                        f"Fix: point data.path at the data itself")


def _skip_output(dirpath: str, name: str, skipped: Dict[str, int]) -> bool:
    """Whether the walk skips ``dirpath/name`` as a folder dipaco wrote (counted)."""
    if is_dipaco_output(os.path.join(dirpath, name)):
        skipped[SKIPPED_OUTPUT] = skipped.get(SKIPPED_OUTPUT, 0) + 1
        return True
    return False


def _glob_base(pattern: str) -> str:
    """The folder a glob's matches all lie in: its path up to the first magic component."""
    parts = os.path.abspath(pattern).split(os.sep)
    fixed = [p for p in parts[: next(i for i, p in enumerate(parts) if glob.has_magic(p))]]
    return os.sep.join(fixed) or os.sep


class _OutputFolders:
    """Which matches of a glob lie in a folder dipaco wrote, below the glob's fixed base
    (each folder asked once; a skipped folder counted once)."""

    def __init__(self, base: str, skipped: Dict[str, int]) -> None:
        self.base, self.skipped, self.seen = os.path.abspath(base), skipped, {}

    def _output(self, d: str) -> bool:
        if d not in self.seen:
            up = os.path.dirname(d)
            above = up != d and d != self.base and up.startswith(self.base) and self._output(up)
            self.seen[d] = above or is_dipaco_output(d)
            if self.seen[d] and not above:
                self.skipped[SKIPPED_OUTPUT] = self.skipped.get(SKIPPED_OUTPUT, 0) + 1
        return self.seen[d]

    def holds(self, match: str) -> bool:
        full = os.path.abspath(match)
        return self._output(full if os.path.isdir(full) else os.path.dirname(full))


def open_regular(path: str) -> Optional[BinaryIO]:
    """Open ``path`` for binary reading if it is (still) a regular file, else None.

    ``O_NONBLOCK`` makes opening a FIFO return at once instead of waiting for a writer;
    ``fstat`` on the open descriptor then decides. None also for a file that vanished or
    cannot be read: the caller counts it.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return None
        return os.fdopen(fd, "rb")
    except OSError:
        os.close(fd)
        return None


def relative_id(path: str, root: str) -> str:
    """``path`` relative to ``root`` with ``/`` separators: the id prefix of its documents."""
    return os.path.relpath(os.path.abspath(path), os.path.abspath(root)).replace(os.sep, "/")


def file_split(rel: str) -> Optional[str]:
    """The split a file's path under ``data.path`` names (see the module docstring), or None."""
    for part in rel.split("/"):  # the outermost component that names one decides
        m = _SPLIT_RE.match(part)
        if m:
            return SPLIT_NAMES[m.group(1).lower()]
    return None
