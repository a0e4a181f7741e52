"""Atomic, pickle-free file helpers shared by Router.save/load and the shard writer."""
from __future__ import annotations

import hashlib
import io
import json
import os
import uuid
from pathlib import Path
from typing import Any

import numpy as np


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to a temporary file next to ``path``, fsync, then ``os.replace``.

    A crash leaves either the old file or the new one, never a torn file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # an exclusive open of a unique name, not mkstemp: mkstemp creates 0600 whatever the
    # umask, and the router and shards must be readable by whoever may read the run
    tmp = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp"
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True, allow_nan=False) + "\n").encode())


def atomic_write_npz(path: str | os.PathLike, arrays: dict[str, np.ndarray]) -> str:
    """Save ``arrays`` as an uncompressed .npz (no object arrays); returns its sha256."""
    for name, a in arrays.items():
        if np.asarray(a).dtype == object:
            raise ValueError(f"array {name!r} has dtype object, which would need pickle")
    buf = io.BytesIO()
    np.savez(buf, **{k: np.asarray(v) for k, v in arrays.items()})
    data = buf.getvalue()
    atomic_write_bytes(path, data)
    return hashlib.sha256(data).hexdigest()


def load_npz_checked(path: str | os.PathLike, expected_sha256: str | None) -> dict[str, np.ndarray]:
    """Load an .npz without pickle after checking it exists and matches its recorded hash."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"missing array file {path}: the directory is incomplete; save it again")
    if expected_sha256 is not None and sha256_file(path) != expected_sha256:
        raise ValueError(
            f"array file {path} does not match the sha256 in its manifest (corrupt or modified); "
            "save it again"
        )
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except Exception as e:  # zip/format errors: name the file, not a deep traceback
        raise ValueError(f"array file {path} cannot be read: {e}") from e


__all__ = ["sha256_file", "atomic_write_bytes", "atomic_write_json", "atomic_write_npz", "load_npz_checked"]
