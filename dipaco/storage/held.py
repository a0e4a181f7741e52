"""Files a long-lived reader holds, and checks as it reads them (docs/reliability.md,
rules 1 and 2).

A server or a ``generate --file`` job opens a checkpoint once and reads its module files
lazily, for hours. :class:`HeldFiles` opens every file of the checkpoint's manifest at
once (read-only, never through a link) and reads through those descriptors: a checkpoint
that a run going on training prunes or replaces meanwhile is still read as it was (the
held inode outlives its name; its space is freed when the reader exits). Each read is
checked against the manifest's size and sha256: the first read of a file hashes the very
bytes it loads; a later read of the same unchanged file (its device, inode, size and
modification time as when it was hashed) loads it memory-mapped without hashing again,
and a file changed in place since is hashed again. A mismatch is a
:class:`~dipaco.storage.tensor_io.CheckpointError` naming the file: the caller fails what
depends on that file only.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dipaco.storage.hashing import sha256_file, sha256_hex
from dipaco.storage.tensor_io import CheckpointError, load_state, state_from_bytes

__all__ = ["HeldFiles", "check_unchanged", "identity", "read_held"]


def read_held(fd: int) -> bytes:
    """The whole file behind the open descriptor ``fd``, from its start (``pread``: the
    descriptor's own offset is left alone, so threads may share it)."""
    size = os.fstat(fd).st_size
    chunks, offset = [], 0
    while offset < size:
        chunk = os.pread(fd, min(size - offset, 64 << 20), offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def _identity(fd: int) -> tuple[int, int, int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def identity(path: Path) -> tuple[int, int, int, int]:
    """A file's device, inode, size and modification time: changed, it is hashed again."""
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def check_unchanged(path: Path, info: dict, checked: dict) -> None:
    """Refuse (:class:`CheckpointError` naming it) a file read by another library (a
    Hugging Face folder) unless it matches ``info`` (``{"sha256", "bytes"}``): hashed again
    only when its identity changed since ``checked`` (``{path: identity}``) recorded it."""
    try:
        now = identity(path)
    except OSError:
        raise CheckpointError(f"checkpoint file {path} is listed in the manifest but missing") from None
    if checked.get(path) == now:
        return
    if now[2] != info.get("bytes") or sha256_file(path, chunk=16 << 20) != info.get("sha256"):
        raise CheckpointError(f"checkpoint file {path} does not match its manifest hash")
    checked[path] = now


class HeldFiles:
    """The files ``manifest`` (``{relative name: {"sha256", "bytes"}}``) lists under
    ``folder`` whose names start with ``prefix``, held open and checked as read."""

    def __init__(self, folder: Path, manifest: dict[str, dict], prefix: str = "") -> None:
        self.folder, self.manifest = Path(folder), manifest
        self.fds: dict[str, int] = {}
        self._checked: dict[str, tuple[int, int, int, int]] = {}
        for rel in manifest:
            if rel.startswith(prefix):
                try:
                    self.fds[rel] = os.open(self.folder / rel, os.O_RDONLY | os.O_NOFOLLOW)
                except OSError:
                    continue  # reading it fails what depends on it, naming it

    def load_state(self, rel: str) -> Any:
        """The state saved in ``rel``, checked against the manifest (see the module docstring)."""
        path = self.folder / rel
        info = self.manifest.get(rel)
        if not isinstance(info, dict):
            raise CheckpointError(f"checkpoint {self.folder} has no {rel} in its manifest")
        fd = self.fds.get(rel)
        if fd is None:
            raise CheckpointError(f"checkpoint file {path} is listed in the manifest but missing")
        try:
            now = _identity(fd)
            if self._checked.get(rel) == now:
                fast = Path(f"/proc/self/fd/{fd}")
                if fast.exists():
                    try:
                        return load_state(fast)
                    except CheckpointError as e:
                        raise CheckpointError(str(e).replace(str(fast), str(path))) from None
            data = read_held(fd)
        except OSError as e:
            raise CheckpointError(f"cannot read checkpoint file {path}: {e.strerror or e}") from None
        if len(data) != info.get("bytes") or sha256_hex(data) != info.get("sha256"):
            raise CheckpointError(f"checkpoint file {path} does not match its manifest hash")
        state = state_from_bytes(data, path)
        self._checked[rel] = now
        return state

    def close(self) -> None:
        """Let go of the files (a process's exit does it too)."""
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
