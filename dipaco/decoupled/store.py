"""The transport of decoupled mode: a key → blob store, and path leases on top of it.

Everything learners and synchronisers exchange goes through a :class:`Store`: module
versions, pushed updates, path states (inner optimiser + data position), leases and
event logs. There are two implementations: :class:`FileStore`, a directory on a shared
filesystem (local disk for one host, NFS for several; the default and the tested one
across processes), and :class:`FsspecStore`, an fsspec URL (``s3://``, ``gs://``,
``memory://`` in tests), usable only where the backend offers exclusive create
(:func:`open_store` checks it with a probe). See ``docs/decoupled.md`` for why a
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
* **Clocks.** Lease expiry times are wall-clock timestamps written by the holder and
  read by others: hosts must keep their clocks within a small fraction of
  ``lease_s`` (NTP does). One host: no issue.
"""
from __future__ import annotations

import atexit
import io
import json
import os
import posixpath
import socket
import threading
import time
import uuid
import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from dipaco.checkpoint import flatten_state, unflatten_state

__all__ = ["Store", "FileStore", "FsspecStore", "open_store", "Lease", "LeaseLost", "encode_state",
           "decode_state"]

TMP_PREFIX = ".tmp-"
PROBE_FOLDER = ".probe"  # open_store's exclusive-create check on fsspec URLs
LOG_SUFFIX = ".d"  # FsspecStore: the event log ``<key>`` is the chunk folder ``<key>.d/``


# ------------------------------------------------------------------- blob format


def encode_state(state: Any, meta: Optional[dict] = None) -> bytes:
    """Nested state (tensors + JSON values) → safetensors bytes; no pickle anywhere.

    ``meta`` is extra JSON kept beside the state; :func:`decode_meta` reads it without
    touching the tensors (the synchroniser reads an update's header first).
    """
    tensors, skeleton = flatten_state(state)
    flat = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    header = {"skeleton": json.dumps(skeleton), "meta": json.dumps(meta or {}, sort_keys=True)}
    return st_save(flat, metadata=header)


def _header(blob: bytes) -> dict[str, str]:
    # safetensors layout: 8-byte little-endian header length, then the JSON header
    n = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8 : 8 + n].decode("utf-8")).get("__metadata__", {}) or {}


def decode_meta(blob: bytes) -> dict:
    """The ``meta`` JSON of a blob written by :func:`encode_state`."""
    return json.loads(_header(blob).get("meta", "{}"))


def decode_state(blob: bytes) -> tuple[Any, dict]:
    """Inverse of :func:`encode_state`: ``(state, meta)``."""
    header = _header(blob)
    tensors = st_load(blob)
    return unflatten_state(tensors, json.loads(header["skeleton"])), json.loads(header.get("meta", "{}"))


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

    # conveniences on top of the primitives
    def put_json(self, key: str, obj: Any) -> None:
        self.put(key, (json.dumps(obj, sort_keys=True) + "\n").encode("utf-8"))

    def get_json(self, key: str) -> Optional[Any]:
        blob = self.get(key)
        return None if blob is None else json.loads(blob.decode("utf-8"))

    def put_state(self, key: str, state: Any, meta: Optional[dict] = None) -> int:
        """Store a nested state atomically; return its size in bytes."""
        blob = encode_state(state, meta)
        self.put(key, blob)
        return len(blob)

    def get_state(self, key: str) -> Optional[tuple[Any, dict]]:
        blob = self.get(key)
        return None if blob is None else decode_state(blob)


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


class FsspecStore(Store):
    """A :class:`Store` on an fsspec filesystem (object stores: ``s3://``, ``gs://``…).

    Open it through :func:`open_store`, which first checks that the backend really has
    exclusive create; constructing it directly skips that check.

    Args:
        url: an fsspec URL; keys live under its path (``<root>/<key>``).
        storage_options: passed to the backend (credentials, endpoint…).

    Hazards, beyond the module docstring:

    * **No directories.** Object stores only have keys with ``/`` in them: a folder exists
      while a key is under it, so nothing creates or removes folders (a backend with real
      directories gets the parent created when a write fails for lack of it).
    * **Listing caches.** Some backends (s3fs, gcsfs) cache listings; every :meth:`list`
      drops the cache of its folder first, or a synchroniser would never see new pushes.
    * **Event logs** are folders of chunk objects ``<key>.d/<writer-tag>-<seq:08d>``
      (objects cannot be appended to). Lines are buffered per process and written as one
      chunk when 64 are pending, when 1 s has passed since the key's last chunk (checked
      on the next append), on :meth:`flush`, at interpreter exit (best effort), and at
      once for the learner's lifecycle events (``begin``, ``end``, ``abort``, ``hello``,
      ``bye``), so a SIGKILLed learner loses at most its last few other lines
      (``progress``, ``takeover``…). The writer tag starts with the writer's start time,
      so chunks sort by writer start, then by sequence. :meth:`list` shows a chunk folder
      ``<key>.d`` as ``<key>``, like the FileStore's log file (so no other folder name
      may end in ``.d``); :meth:`get` and :meth:`delete` do not see logs.
    """

    FLUSH_LINES = 64
    FLUSH_S = 1.0
    # learner events that must survive a kill right after them (they delimit phases)
    FLUSH_EVENTS = frozenset({"begin", "end", "abort", "hello", "bye"})

    def __init__(self, url: str, **storage_options: Any) -> None:
        from fsspec.core import url_to_fs  # lazy: only fsspec URLs need fsspec

        self.url = url
        self.fs, root = url_to_fs(url, **storage_options)
        self.root = root.rstrip("/")
        # start time (µs) first: chunks of writers of one log sort by writer start
        self._tag = (f"{time.time_ns() // 1000:016d}-{socket.gethostname()}-{os.getpid()}-"
                     f"{uuid.uuid4().hex[:4]}")
        self._lock = threading.Lock()
        self._pending: dict[str, list[str]] = {}  # log key -> buffered lines
        self._last_flush: dict[str, float] = {}  # log key -> time of its last chunk (or first line)
        self._seq = 0
        # Buffered lines of a process that exits normally (a spawned child included) are
        # written at exit; a weak reference so the hook does not keep the store alive.
        atexit.register(_flush_at_exit, weakref.ref(self))

    def __repr__(self) -> str:
        return f"FsspecStore({self.url!r})"

    def path(self, key: str) -> str:
        if key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"store keys are relative without '..': {key!r}")
        return f"{self.root}/{key}" if key else self.root

    def _write(self, path: str, write: Callable[[], None]) -> None:
        """Run ``write()``; on a backend with real directories, create the parent once."""
        try:
            write()
        except FileNotFoundError:
            self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
            write()

    def put(self, key: str, data: bytes) -> None:
        p = self.path(key)
        # one whole-object write: object stores make it atomic (old or new object)
        self._write(p, lambda: self.fs.pipe_file(p, data))

    def put_new(self, key: str, data: bytes) -> bool:
        p = self.path(key)

        def create() -> None:
            # Exclusive create: backends that support it on object stores send a
            # conditional write (S3 If-None-Match, GCS if_generation_match), so exactly
            # one of two racers succeeds.
            # Unsupported backends raise or silently overwrite: open_store's probe
            # refuses those. (memory:// registers the object before writing its bytes:
            # fine for single-threaded tests, not for racing threads.)
            with self.fs.open(p, "xb") as f:
                f.write(data)

        try:
            self._write(p, create)
            return True
        except FileExistsError:
            return False

    def get(self, key: str) -> Optional[bytes]:
        try:
            return bytes(self.fs.cat_file(self.path(key)))
        except (FileNotFoundError, IsADirectoryError):
            return None

    def list(self, prefix: str) -> list[str]:
        folder = self.path(prefix) if prefix else self.root
        self.fs.invalidate_cache(folder)
        try:
            entries = self.fs.ls(folder, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        names = set()
        for e in entries:
            full = str(e["name"]).rstrip("/")
            name = posixpath.basename(full)
            if full == folder.rstrip("/") or not name or name.startswith(TMP_PREFIX):
                continue  # a backend listing a file as itself, or a temp name
            if not prefix and name == PROBE_FOLDER:
                continue  # a probe left by a process killed inside open_store
            if e.get("type") == "directory" and name.endswith(LOG_SUFFIX):
                name = name[: -len(LOG_SUFFIX)]  # an event log's chunks: show the log key
            names.add(name)
        return sorted(names)

    def delete(self, key: str) -> None:
        try:
            self.fs.rm_file(self.path(key))
        except FileNotFoundError:
            pass

    def move(self, key: str, new_key: str) -> None:
        # Object stores have no rename: copy (server side), then delete the source. Not
        # atomic: a crash in between leaves the object under both keys. Safe for the one
        # user, the synchroniser archiving processed updates: it moves a file only after
        # the module version listing the update's id as applied/dropped is written, so a
        # file left in the inbox is recognised as processed and archived again (the copy
        # rewrites an identical archive object); pushed_ids unions inbox and archive.
        src, dst = self.path(key), self.path(new_key)
        try:
            self.fs.cp_file(src, dst)
        except FileNotFoundError:
            if self.get(key) is None:
                return  # missing source: no-op, like FileStore.move
            self.fs.makedirs(posixpath.dirname(dst), exist_ok=True)
            self.fs.cp_file(src, dst)
        self.delete(key)

    # ----------------------------------------------------------- event logs
    def _urgent(self, line: str) -> bool:
        try:
            obj = json.loads(line)
        except ValueError:
            return False
        return isinstance(obj, dict) and obj.get("e") in self.FLUSH_EVENTS

    def append_line(self, key: str, line: str) -> None:
        self.path(key)  # validate now, not at flush time
        line = line.rstrip("\n")
        now = time.time()
        with self._lock:
            buf = self._pending.setdefault(key, [])
            buf.append(line)
            last = self._last_flush.setdefault(key, now)
            if len(buf) >= self.FLUSH_LINES or now - last >= self.FLUSH_S or self._urgent(line):
                self._flush_key(key)

    def _flush_key(self, key: str) -> None:
        """Write the buffered lines of ``key`` as its next chunk (caller holds the lock)."""
        buf = self._pending.get(key)
        if not buf:
            return
        self._seq += 1
        data = "".join(x + "\n" for x in buf).encode("utf-8")
        # a new name per chunk (this writer's tag + sequence): never overwrites another
        self.put(f"{key}{LOG_SUFFIX}/{self._tag}-{self._seq:08d}", data)
        buf.clear()  # only once written: a failed put keeps the lines for the next try
        self._last_flush[key] = time.time()

    def flush(self) -> None:
        with self._lock:
            for key in list(self._pending):
                self._flush_key(key)

    def _flush_quietly(self) -> None:
        try:
            self.flush()
        except Exception:  # at exit: the backend may be half torn down; lines are best effort
            pass

    def read_lines(self, key: str) -> list[str]:
        # Only flushed chunks; a chunk is one whole object, so no line is ever torn.
        folder = f"{key}{LOG_SUFFIX}"
        out: list[str] = []
        for name in self.list(folder):
            blob = self.get(f"{folder}/{name}")
            if blob is not None:
                out.extend(x for x in blob.decode("utf-8").split("\n") if x)
        return out


def _flush_at_exit(ref: "weakref.ref[FsspecStore]") -> None:
    store = ref()
    if store is not None:
        store._flush_quietly()


def open_store(url: str) -> Store:
    """A store for ``url``: a directory path or ``file://`` URL → :class:`FileStore`;
    another fsspec URL (``s3://bucket/run``, ``gs://…``, ``memory://…``) → :class:`FsspecStore`.

    For fsspec URLs, leases need an atomic create-if-absent: a probe key is created twice
    with ``put_new`` and the second call must report that it exists. A backend that
    raises on exclusive create or silently overwrites is refused with a ValueError.
    The probe checks the semantics, not atomicity under a race: a backend whose
    exclusive create is check-then-write passes it (none of fsspec's object-store
    backends that accept mode ``"xb"`` are known to do that).
    """
    if url.startswith("file://"):
        url = url[len("file://"):]
    if "://" not in url:
        return FileStore(url)
    where = f"diloco.decoupled.store_url={url!r}"
    fix = ("use a shared directory (a path, e.g. an NFS mount) or an fsspec backend with "
           "conditional writes (S3 If-None-Match, GCS if_generation_match)")
    try:
        store = FsspecStore(url)
    except (ImportError, ValueError) as e:  # unknown protocol or backend not installed
        raise ValueError(f"{where}: cannot open it with fsspec ({e}); {fix}") from e
    probe = f"{PROBE_FOLDER}/{uuid.uuid4().hex}"
    try:
        first = store.put_new(probe, b"1")
        second = store.put_new(probe, b"2")
        ok = first and not second and store.get(probe) == b"1"
        err: Optional[BaseException] = None
    except (NotImplementedError, ValueError, TypeError) as e:  # mode "xb" unsupported
        ok, err = False, e
    finally:
        try:
            store.delete(probe)
        except Exception:  # the probe's own error says more
            pass
    if not ok:
        how = f"exclusive create raised {err!r}" if err is not None else "a second create overwrote the first"
        raise ValueError(
            f"{where}: this fsspec backend lacks atomic create-if-absent ({how}), which "
            f"leases need (exactly one of two learners may take a path); {fix}"
        ) from err
    return store


# ----------------------------------------------------------------------- leases


class LeaseLost(RuntimeError):
    """This holder's lease was taken over (it expired): stop working on the resource."""


@dataclass
class Lease:
    """An exclusive, expiring claim on a named resource (a path), built on ``put_new``.

    Layout: ``leases/<name>/<epoch:010d>.json`` holding ``{owner, expires_at, released}``.
    The live lease is the highest epoch. To take a resource whose lease expired or was
    released, a learner creates epoch+1 with ``put_new``: of two learners racing, exactly
    one create succeeds. The holder renews by rewriting its own epoch file, then checks
    that no higher epoch exists; if one does, somebody took over while it was late and
    it must abandon the work (its pushes would be duplicates; see the synchroniser's
    ``duplicate_phase`` rule for the window where it cannot know yet).
    """

    store: Store
    name: str
    owner: str
    lease_s: float
    epoch: int = 0
    took_over_from: Optional[str] = None

    @staticmethod
    def holder(store: Store, name: str, now: Optional[float] = None) -> Optional[str]:
        """The owner of a live (unreleased, unexpired) lease on ``name``, else None."""
        probe = Lease(store, name, "", 0.0)
        epochs = probe._epochs()
        info = store.get_json(probe._key(epochs[-1])) if epochs else None
        if not info or info.get("released") or float(info["expires_at"]) < (now or time.time()):
            return None
        return str(info["owner"])

    @property
    def _folder(self) -> str:
        return f"leases/{self.name}"

    def _key(self, epoch: int) -> str:
        return f"{self._folder}/{epoch:010d}.json"

    def _epochs(self) -> list[int]:
        out = []
        for n in self.store.list(self._folder):
            if n.endswith(".json"):
                try:
                    out.append(int(n[:-5]))
                except ValueError:
                    pass
        return sorted(out)

    @staticmethod
    def is_free(store: Store, name: str, now: Optional[float] = None) -> bool:
        """Whether nobody holds ``name`` right now (never leased, released or expired)."""
        probe = Lease(store, name, "", 0.0)
        epochs = probe._epochs()
        if not epochs:
            return True
        info = store.get_json(probe._key(epochs[-1]))
        if info is None:  # pruned between list and read: treat as contended
            return False
        return bool(info.get("released")) or float(info["expires_at"]) < (now or time.time())

    def acquire(self) -> bool:
        """Try to take the lease; True on success (then :meth:`renew` and :meth:`release`)."""
        epochs = self._epochs()
        top = epochs[-1] if epochs else 0
        if epochs:
            info = self.store.get_json(self._key(top))
            if info is None:
                return False
            if not info.get("released") and float(info["expires_at"]) >= time.time():
                return False
        body = {"owner": self.owner, "expires_at": time.time() + self.lease_s, "released": False}
        if not self.store.put_new(self._key(top + 1), json.dumps(body).encode()):
            return False  # another learner won the race for this epoch
        self.epoch = top + 1
        # taken from a holder that never released it (died or stalled past its expiry)
        self.took_over_from = info.get("owner") if epochs and not info.get("released") else None
        for e in epochs[:-1]:  # keep the previous epoch for post-mortems, drop older ones
            self.store.delete(self._key(e))
        return True

    def renew(self) -> None:
        """Extend the expiry (heartbeat); raise :class:`LeaseLost` if taken over."""
        if self._epochs()[-1:] != [self.epoch]:
            raise LeaseLost(f"lease {self.name} epoch {self.epoch} was taken over")
        body = {"owner": self.owner, "expires_at": time.time() + self.lease_s, "released": False}
        self.store.put(self._key(self.epoch), json.dumps(body).encode())
        # A taker may have read our *old* expiry before the rewrite landed: check again.
        if self._epochs()[-1:] != [self.epoch]:
            raise LeaseLost(f"lease {self.name} epoch {self.epoch} was taken over")

    def check(self) -> None:
        """Raise :class:`LeaseLost` if a higher epoch exists (cheap: one listing)."""
        if self._epochs()[-1:] != [self.epoch]:
            raise LeaseLost(f"lease {self.name} epoch {self.epoch} was taken over")

    def release(self) -> None:
        """Give the resource up (others may take it at once)."""
        if self._epochs()[-1:] == [self.epoch]:
            body = {"owner": self.owner, "expires_at": 0.0, "released": True}
            self.store.put(self._key(self.epoch), json.dumps(body).encode())


def iter_jsonl(store: Store, key: str) -> Iterator[dict]:
    """Parsed lines of an event log."""
    for line in store.read_lines(key):
        try:
            yield json.loads(line)
        except ValueError:
            continue
