"""The transport of decoupled mode: a key → blob store (leases are in
:mod:`dipaco.decoupled.lease`, the fsspec backend and :func:`open_store` in
:mod:`dipaco.decoupled.fsspec_store`).

Everything decoupled workers and synchronisers exchange goes through a :class:`Store`: module
versions, pushed updates, path states (inner optimiser + data position), leases and
event logs. There are two implementations: :class:`FileStore`, a directory on a shared
filesystem (local disk for one host, NFS for several; the default and the tested one
across processes), and :class:`FsspecStore`, an fsspec URL (``s3://``, tested against a
local S3 server; ``gs://``; ``memory://`` in tests), usable only where the backend offers
exclusive create (:func:`open_store` checks it with a probe). See ``docs/decoupled.md`` for why a
directory and not a key-value server.

Hazards and how they are handled here:

* **Torn writes.** A reader must never see half a file. Every ``put`` writes a temporary
  file with a name unique to (host, pid, random) in the same directory, fsyncs it, then
  ``os.replace``-s it over the key: rename within a directory is atomic on POSIX and on
  NFS (the server performs it), so a reader sees the old blob or the new one.
  Temporary names start with ``.tmp-`` and are never listed as keys.
* **Two writers creating the same key.** ``put_new`` (create-if-absent) writes a
  temporary file and ``os.link``-s it to the key: ``link`` fails with ``EEXIST`` if the
  key exists, atomically, also over NFSv3+ (``O_EXCL`` is not reliable on old NFS
  clients; the link trick is the classic NFS-safe lock). Leases are built on it.
* **Object stores** (:class:`FsspecStore`) have neither rename nor append: a put is one
  whole-object write (readers see the old or the new object), create-if-absent is the
  backend's exclusive create (S3 ``If-None-Match``, GCS ``if_generation_match``), a move
  is copy + delete, and an event log is a folder of numbered chunk objects.
* **Corruption.** Every blob carries the sha256 of what was written (a module version,
  an update, a path state: in its safetensors header, over the tensors' names, dtypes,
  shapes and bytes and the JSON beside them; a JSON record: as its ``_sha256`` field),
  checked at every read (:func:`decode_state`, :meth:`Store.get_json`): a blob that does
  not match, or carries none, is refused with :class:`CorruptBlob` naming its key. A
  synchroniser drops a corrupt update as ``corrupt``; any other read fails its caller
  only. The cost is one sha256 pass over the bytes at each write and read
  (``benchmarks/bench_store_digest.py``).
* **Clocks.** Lease expiry times are wall-clock timestamps written by the holder and
  read by others: hosts must keep their clocks within a small fraction of
  ``lease_s`` (NTP does). One host: no issue.
"""
from __future__ import annotations

import json
import os
import socket
import uuid
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from dipaco.storage.hashing import sha256, sha256_json
from dipaco.storage.tensor_io import (CheckpointError, flatten_state, tensors_from_bytes, tensors_to_bytes,
                                      unflatten_state)

__all__ = ["Store", "FileStore", "CorruptBlob", "encode_state", "decode_state", "encode_json", "decode_json",
           "iter_jsonl"]

TMP_PREFIX = ".tmp-"
DIGEST = "sha256"  # a state blob's digest, in its safetensors header
JSON_DIGEST = "_sha256"  # a JSON record's digest, a field of the record


class CorruptBlob(CheckpointError):
    """A store blob whose content is not what was written (its sha256 differs, it has
    none, or it does not decode); the message names the key where one is known."""


# ------------------------------------------------------------------- blob format


def _state_digest(tensors: dict[str, torch.Tensor], header: dict[str, str]) -> str:
    """sha256 over a state blob's JSON (skeleton, meta) and each tensor's name, dtype,
    shape and bytes, in name order; length-prefixed, so no two contents share a stream."""
    h = sha256()

    def part(data: Any) -> None:
        view = memoryview(data).cast("B")
        h.update(len(view).to_bytes(8, "little"))
        h.update(view)

    for field in ("skeleton", "meta"):
        part(header.get(field, "").encode("utf-8"))
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        part(json.dumps([name, str(t.dtype), list(t.shape)]).encode("utf-8"))
        part(t.reshape(-1).view(torch.uint8).numpy())  # the tensor's own bytes, no copy
    return h.hexdigest()


def encode_state(state: Any, meta: Optional[dict] = None) -> bytes:
    """Nested state (tensors + JSON values) → safetensors bytes; no pickle anywhere.

    ``meta`` is extra JSON kept beside the state. The header also records the sha256 of
    the whole content, which :func:`decode_state` checks.
    """
    tensors, skeleton = flatten_state(state)
    header = {"skeleton": json.dumps(skeleton), "meta": json.dumps(meta or {}, sort_keys=True)}
    header[DIGEST] = _state_digest(tensors, header)
    return tensors_to_bytes(tensors, metadata=header)


def _header(blob: bytes) -> dict[str, str]:
    # safetensors layout: 8-byte little-endian header length, then the JSON header
    n = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8 : 8 + n].decode("utf-8")).get("__metadata__", {}) or {}


def peek_meta(blob: bytes) -> dict:
    """The ``meta`` of a blob written by :func:`encode_state`, NOT checked against its
    sha256: for display (``dipaco-decoupled status``) and existence checks only, where
    hashing every module's whole blob would cost a full read per line shown. Anything
    that acts on a blob's content reads it with :func:`decode_state`."""
    try:
        return json.loads(_header(blob).get("meta", "{}"))
    except Exception as e:  # torn or not safetensors: the library's errors vary
        raise CorruptBlob(f"not a store blob ({type(e).__name__})") from None


def decode_state(blob: bytes) -> tuple[Any, dict]:
    """Inverse of :func:`encode_state`: ``(state, meta)``, once the recorded sha256 matches
    (else :class:`CorruptBlob`)."""
    try:
        header = _header(blob)
        tensors = tensors_from_bytes(blob)
    except Exception as e:  # torn, truncated or not safetensors: the library's errors vary
        raise CorruptBlob(f"not a store blob ({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None
    want = header.get(DIGEST)
    if want is None:
        raise CorruptBlob("it records no sha256 (not written by this dipaco's store)")
    got = _state_digest(tensors, header)
    if got != want:
        raise CorruptBlob(f"its content does not match the sha256 recorded when it was written "
                          f"({got[:12]}… read, {want[:12]}… written)")
    return unflatten_state(tensors, json.loads(header["skeleton"])), json.loads(header.get("meta", "{}"))


def encode_json(obj: dict) -> bytes:
    """A JSON record as bytes, with its sha256 as the field ``_sha256`` (see :func:`decode_json`)."""
    # JSON's own form first (int keys become strings): the reader hashes what it parses
    body = json.loads(json.dumps(obj, sort_keys=True))
    if not isinstance(body, dict) or JSON_DIGEST in body:
        raise TypeError(f"a store JSON record is a dict without a {JSON_DIGEST!r} field, not {type(obj).__name__}")
    return (json.dumps({**body, JSON_DIGEST: sha256_json(body)}, sort_keys=True) + "\n").encode("utf-8")


def decode_json(blob: bytes) -> dict:
    """Inverse of :func:`encode_json`, once the recorded sha256 matches (else :class:`CorruptBlob`)."""
    try:
        obj = json.loads(blob.decode("utf-8"))
    except ValueError as e:  # UnicodeDecodeError is one too
        raise CorruptBlob(f"not JSON ({' '.join(str(e).split())[:200]})") from None
    want = obj.pop(JSON_DIGEST, None) if isinstance(obj, dict) else None
    if want is None:
        raise CorruptBlob(f"it records no sha256 (no {JSON_DIGEST!r} field: not written by this dipaco's store)")
    got = sha256_json(obj)
    if got != want:
        raise CorruptBlob(f"its content does not match the sha256 recorded when it was written "
                          f"({got[:12]}… read, {str(want)[:12]}… written)")
    return obj


# ------------------------------------------------------------------------ store


class Store(ABC):
    """Keys are ``/``-separated relative names (``updates/L0.1/abc.st``)."""

    @abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Atomically create or replace ``key``."""

    @abstractmethod
    def put_new(self, key: str, data: bytes) -> bool:
        """Atomically create ``key`` if absent; False (and no change) if it exists."""

    @abstractmethod
    def get(self, key: str) -> Optional[bytes]:
        """The blob, or None if the key does not exist."""

    @abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Keys directly under the folder ``prefix`` (names only, sorted)."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key`` if present."""

    @abstractmethod
    def move(self, key: str, new_key: str) -> None:
        """Atomically rename ``key`` (missing source: no-op)."""

    @abstractmethod
    def append_line(self, key: str, line: str) -> None:
        """Append one line to a log only this process writes (event logs)."""

    @abstractmethod
    def read_lines(self, key: str) -> list[str]:
        """Lines of a log (a torn last line of a killed writer is left out)."""

    def flush(self) -> None:
        """Make every line given to :meth:`append_line` readable (no-op if unbuffered)."""

    # conveniences on top of the primitives; every read is checked (CorruptBlob names the key)
    def put_json(self, key: str, obj: dict) -> None:
        self.put(key, encode_json(obj))

    def get_json(self, key: str) -> Optional[dict]:
        blob = self.get(key)
        return None if blob is None else self._checked(key, decode_json, blob)

    def put_state(self, key: str, state: Any, meta: Optional[dict] = None) -> int:
        """Store a nested state atomically; return its size in bytes."""
        blob = encode_state(state, meta)
        self.put(key, blob)
        return len(blob)

    def get_state(self, key: str) -> Optional[tuple[Any, dict]]:
        blob = self.get(key)
        return None if blob is None else self._checked(key, decode_state, blob)

    def _checked(self, key: str, decode: Any, blob: bytes) -> Any:
        try:
            return decode(blob)
        except CorruptBlob as e:
            raise CorruptBlob(f"{self!r}: key {key!r} is corrupt: {e}") from None


class FileStore(Store):
    """A :class:`Store` on a (shared) filesystem directory.

    Args:
        root: the directory (created if missing). On several hosts, an NFS mount seen
            under the same or different paths: only relative keys travel.
        fsync: fsync files before renaming them (durability across a host crash; cheap
            for the small blobs of tests, keep it on in production).
    """

    def __init__(self, root: str | Path, fsync: bool = True) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        self._tag = f"{socket.gethostname()}-{os.getpid()}"

    def __repr__(self) -> str:
        return f"FileStore({str(self.root)!r})"

    def path(self, key: str) -> Path:
        if key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"store keys are relative without '..': {key!r}")
        return self.root / key

    def _write_tmp(self, target: Path, data: bytes) -> Path:
        target.parent.mkdir(parents=True, exist_ok=True)
        # unique per host, process and call: two writers never share a temp file
        tmp = target.with_name(f"{TMP_PREFIX}{target.name}.{self._tag}.{uuid.uuid4().hex[:8]}")
        with open(tmp, "wb") as f:
            f.write(data)
            if self.fsync:
                f.flush()
                os.fsync(f.fileno())
        return tmp

    def put(self, key: str, data: bytes) -> None:
        target = self.path(key)
        tmp = self._write_tmp(target, data)
        os.replace(tmp, target)

    def put_new(self, key: str, data: bytes) -> bool:
        target = self.path(key)
        tmp = self._write_tmp(target, data)
        try:
            os.link(tmp, target)  # atomic create-if-absent, NFS-safe
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    def get(self, key: str) -> Optional[bytes]:
        try:
            return self.path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError):
            return None

    def list(self, prefix: str) -> list[str]:
        folder = self.path(prefix) if prefix else self.root
        try:
            names = [e.name for e in os.scandir(folder) if not e.name.startswith(TMP_PREFIX)]
        except FileNotFoundError:
            return []
        return sorted(names)

    def delete(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    def move(self, key: str, new_key: str) -> None:
        dst = self.path(new_key)
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(self.path(key), dst)
        except FileNotFoundError:
            pass

    def append_line(self, key: str, line: str) -> None:
        p = self.path(key)
        p.parent.mkdir(parents=True, exist_ok=True)
        # O_APPEND: each write lands at the end; one writer per log, so lines never interleave
        with open(p, "a", encoding="utf-8") as f:
            f.write(line.rstrip("\n") + "\n")

    def read_lines(self, key: str) -> list[str]:
        try:
            text = self.path(key).read_text(encoding="utf-8")
        except FileNotFoundError:
            return []
        lines = text.split("\n")
        # the last element is "" after a complete line; anything else is a torn write
        return [x for x in lines[:-1] if x]


def iter_jsonl(store: Store, key: str) -> Iterator[dict]:
    """Parsed lines of an event log."""
    for line in store.read_lines(key):
        try:
            yield json.loads(line)
        except ValueError:
            continue
