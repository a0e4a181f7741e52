"""Files and directories the project writes get the permissions the umask asks for.

A file opened with ``open(path, "w")`` is created ``0o666 & ~umask`` (``0644`` under the
usual umask 022), a directory made with ``mkdir`` ``0o777 & ~umask``. Three ways of
writing atomically bypass that: ``tempfile.mkstemp`` (always ``0600``),
``tempfile.mkdtemp`` (always ``0700``) and safetensors' ``save_file`` (``0600``), so a
checkpoint, an export or a tokenizer written through a temporary file and a rename
would be unreadable to the group and to others whatever the umask. Every such writer
calls :func:`follow_umask` on the temporary file or directory before renaming it.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

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


def follow_umask(path: str | os.PathLike) -> Path:
    """Give ``path`` the mode a plain ``open``/``mkdir`` would have given it (``0o666`` /
    ``0o777`` less the umask); returns ``path``."""
    path = Path(path)
    base = 0o777 if path.is_dir() else 0o666
    os.chmod(path, base & ~current_umask())
    return path
