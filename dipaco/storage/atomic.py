"""The one way dipaco writes a file: a temporary file beside it, then a rename.

The rules every writer follows (checkpoints, exports, run records, the corpus and
tokenizer caches, ownership records):

* **Beside the target.** The temporary file lives in the target's own directory, so the
  final ``os.replace`` is a rename within one filesystem: atomic on POSIX, a reader sees
  the old file or the new one, never half of one.
* **A name no one else picks.** ``tempfile.mkstemp`` with a prefix naming the target and
  the process (``<name>.tmp<pid>-XXXXXXXX``): two processes (ranks) or two threads writing
  the same target never share a temporary file. A writer that sweeps its own leftovers
  (:mod:`dipaco.run.owned`) passes its own prefix.
* **Flushed before renamed.** The file is ``fsync``-ed before the rename (``durable``), so
  a crash after the rename cannot leave the new name pointing at unwritten blocks; a
  rename that must itself survive a crash is made durable with :func:`fsync_dir`.
* **The mode a plain ``open`` gives.** ``mkstemp`` (``0600``), ``mkdtemp`` (``0700``) and
  safetensors' ``save_file`` (``0600``) ignore the umask, so a file written through them
  and renamed would be unreadable to the group and to others whatever the umask. Every
  temporary file or directory goes through :func:`follow_umask` before its rename.
* **Nothing left behind on failure.** An exception while writing removes the temporary
  file and leaves the target as it was.
"""
from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Optional, Union

from dipaco.storage.strict_json import dumps_strict

PathLike = Union[str, os.PathLike]
_LOCK = threading.Lock()


def current_umask() -> int:
    """The process's umask, read without changing it where the kernel says it
    (``/proc/self/status``, Linux >= 4.7); else set and restored under a lock."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    with _LOCK:  # os.umask can only be read by setting it
        old = os.umask(0o022)
        os.umask(old)
    return old


def follow_umask(path: PathLike) -> Path:
    """Give ``path`` the mode a plain ``open``/``mkdir`` would have given it (``0o666`` /
    ``0o777`` less the umask); returns ``path``."""
    path = Path(path)
    base = 0o777 if path.is_dir() else 0o666
    os.chmod(path, base & ~current_umask())
    return path


def temp_file_beside(path: PathLike, prefix: Optional[str] = None) -> Path:
    """Create an empty temporary file in ``path``'s directory (made if missing) and return
    it; the caller fills it and hands it to :func:`publish`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=prefix or f"{path.name}.tmp{os.getpid()}-", dir=path.parent)
    os.close(fd)
    return Path(tmp)


def fsync_file(path: PathLike) -> None:
    """Flush a written file's blocks to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: PathLike) -> None:
    """Make a rename inside ``path`` durable (best effort: not every filesystem allows it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def publish(tmp: PathLike, path: PathLike, *, durable: bool = True) -> Path:
    """Move a finished temporary file (or directory) over ``path``: the umask's mode,
    ``fsync`` (files, ``durable``), then ``os.replace``."""
    tmp = Path(tmp)
    follow_umask(tmp)
    if durable and tmp.is_file():
        fsync_file(tmp)
    os.replace(tmp, path)
    return Path(path)


def write_atomically(path: PathLike, fill: Callable[[Path], None], *, prefix: Optional[str] = None,
                     durable: bool = True) -> Path:
    """Write ``path`` by the rules above: ``fill(tmp)`` writes the temporary file (by any
    means: ``open``, ``save_file``), which then replaces ``path``. On any exception the
    temporary file is removed and ``path`` is untouched."""
    tmp = temp_file_beside(path, prefix)
    try:
        fill(tmp)
        return publish(tmp, path, durable=durable)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _with_open(mode: str, body: Callable[[IO], None]) -> Callable[[Path], None]:
    def fill(tmp: Path) -> None:
        with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            body(f)

    return fill


def atomic_write_text(path: PathLike, text: str, *, durable: bool = True) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    return write_atomically(path, _with_open("w", lambda f: f.write(text)), durable=durable)


def atomic_write_bytes(path: PathLike, data: bytes, *, prefix: Optional[str] = None, durable: bool = True) -> Path:
    """Write ``data`` to ``path`` atomically (``prefix``: the temporary file's name start)."""
    return write_atomically(path, _with_open("wb", lambda f: f.write(data)), prefix=prefix, durable=durable)


def atomic_write_lines(path: PathLike, lines: Iterable[str], *, durable: bool = True) -> Path:
    """Write ``lines`` (each ending in its own newline) to ``path`` atomically, streamed:
    a large cache is never held as one string."""
    return write_atomically(path, _with_open("w", lambda f: f.writelines(lines)), durable=durable)


def write_json(path: PathLike, obj: Any) -> Path:
    """Atomically write ``obj`` as indented strict JSON with sorted keys (the checkpoint
    format; a non-finite number is ``null`` with its reason: dipaco/storage/strict_json.py)."""
    return atomic_write_text(Path(path), dumps_strict(obj, indent=2, sort_keys=True) + "\n")


def private_temp_dir(parent: PathLike, prefix: str) -> Path:
    """A fresh directory under ``parent`` to fill and then :func:`publish` (``mkdtemp``,
    given the umask's mode at once so its files are readable once renamed)."""
    os.makedirs(parent, exist_ok=True)
    return follow_umask(tempfile.mkdtemp(dir=parent, prefix=prefix))


__all__ = ["atomic_write_bytes", "atomic_write_lines", "atomic_write_text", "current_umask", "follow_umask",
           "fsync_dir", "fsync_file", "private_temp_dir", "publish", "temp_file_beside", "write_atomically",
           "write_json"]
