"""A :class:`~dipaco.decoupled.store.Store` on fsspec URLs (object stores), and
:func:`open_store`, which picks the backend for a store URL.
"""
from __future__ import annotations

import atexit
import errno
import json
import os
import posixpath
import socket
import threading
import time
import uuid
import weakref
from typing import Any, Callable, Optional

from dipaco.decoupled.store import TMP_PREFIX, FileStore, Store, decode_json

__all__ = ["FsspecStore", "open_store"]

PROBE_FOLDER = ".probe"  # open_store's exclusive-create check on fsspec URLs
LOG_SUFFIX = ".d"  # the event log ``<key>`` is the chunk folder ``<key>.d/``
# fsspec protocols of object stores: keys in buckets, no folders to create (and a bucket
# is never created here: a missing one is the user's typo or permission to fix)
OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "oss"})


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
      directories gets the parent created when a write fails for lack of it; on an object
      store that failure means the bucket is missing, and it is raised, never created).
    * **Exclusive create** is ``open(key, "xb")``, which s3fs sends as ``PutObject`` with
      ``If-None-Match: *`` (the condition checked by the server, atomically) and turns
      the 412 answer into ``FileExistsError``. s3fs writes an *empty* object through an
      unconditional call instead, so :meth:`put_new` refuses empty blobs (none of
      decoupled mode's is empty).
    * **Listing caches.** Some backends (s3fs, gcsfs) cache listings; every :meth:`list`
      drops the cache of its folder first, or a synchroniser would never see new pushes.
    * **Event logs** are folders of chunk objects ``<key>.d/<writer-tag>-<seq:08d>``
      (objects cannot be appended to). Lines are buffered per process and written as one
      chunk when 64 are pending, when 1 s has passed since the key's last chunk (checked
      on the next append), on :meth:`flush`, at interpreter exit (best effort), and at
      once for the decoupled worker's lifecycle events (``begin``, ``push``, ``end``, ``abort``,
      ``hello``, ``bye``), so a SIGKILLed worker loses at most its last few other lines
      (``progress``, ``takeover``…). The writer tag starts with the writer's start time,
      so chunks sort by writer start, then by sequence. :meth:`list` shows a chunk folder
      ``<key>.d`` as ``<key>``, like the FileStore's log file (so no other folder name
      may end in ``.d``); :meth:`get` and :meth:`delete` do not see logs.
    """

    FLUSH_LINES = 64
    FLUSH_S = 1.0
    # worker events that must survive a kill right after them (they delimit phases)
    FLUSH_EVENTS = frozenset({"begin", "push", "end", "abort", "hello", "bye"})

    def __init__(self, url: str, **storage_options: Any) -> None:
        from fsspec.core import url_to_fs  # lazy: only fsspec URLs need fsspec

        self.url = url
        # No listings cache: a long-lived process (a supervisor, a synchroniser) would
        # otherwise answer "not found" for a key another process created after this one
        # listed its folder (s3fs checks the cached listing before a GET): the store is
        # shared, so every read must go to the backend.
        self.fs, root = url_to_fs(url, **{"use_listings_cache": False, **storage_options})
        self.root = root.rstrip("/")
        protocols = self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) else (self.fs.protocol,)
        self.object_store = bool(OBJECT_STORES.intersection(protocols))
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
            if self.object_store:
                raise  # no folders to make: the bucket is missing (s3fs would create one)
            self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
            write()

    def put(self, key: str, data: bytes) -> None:
        p = self.path(key)
        # one whole-object write: object stores make it atomic (old or new object)
        self._write(p, lambda: self.fs.pipe_file(p, data))

    def put_new(self, key: str, data: bytes) -> bool:
        p = self.path(key)
        if not data:  # s3fs commits an empty "xb" file with an unconditional write
            raise ValueError(f"{self!r}: put_new({key!r}) needs a non-empty blob (an empty exclusive create "
                             "is not conditional on every backend)")

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

    def get_json(self, key: str) -> Optional[dict]:
        # JSON records (leases, progress, speeds, heartbeats) are small: one ranged GET
        # from byte 0. A plain cat_file asks s3fs for the size first (a HEAD, to split a
        # large object into concurrent ranges): two requests for every lease or progress
        # read, half of all the requests a run made to the local S3 server.
        try:
            blob = bytes(self.fs.cat_file(self.path(key), start=0))
        except (FileNotFoundError, IsADirectoryError):
            return None
        return self._checked(key, decode_json, blob)

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
            if self.object_store:
                raise
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
    raises on exclusive create or silently overwrites is refused with a ValueError, and
    so is one that cannot be written at all (no bucket, no credentials, an endpoint that
    refuses), in one line naming ``store_url``.
    The probe checks the semantics, not atomicity under a race: a backend whose
    exclusive create is check-then-write passes it (none of fsspec's object-store
    backends that accept mode ``"xb"`` are known to do that; s3fs's is S3's conditional
    write, tested against a local S3 server in tests/test_decoupled_store_s3.py).
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
    _probe(store, where, fix)
    return store


def _probe(store: FsspecStore, where: str, fix: str) -> None:
    """Create a probe key twice: the first create must succeed, the second must not."""
    probe = f"{PROBE_FOLDER}/{uuid.uuid4().hex}"
    created, ok, err = False, False, None
    try:
        created = store.put_new(probe, b"1")
        second = store.put_new(probe, b"2")
        ok = created and not second and store.get(probe) == b"1"
    except Exception as e:
        # mode "xb" unsupported by the fsspec backend, or a server that does not implement
        # conditional writes (S3's 501 NotImplemented, which s3fs raises as ENOSYS)
        if isinstance(e, (NotImplementedError, ValueError, TypeError)) or getattr(e, "errno", None) == errno.ENOSYS:
            err = e
        else:  # the backend's own: a missing bucket, credentials, an endpoint that refuses
            raise ValueError(f"{where}: cannot write to it ({type(e).__name__}: {' '.join(str(e).split())}); "
                             "check the bucket, the credentials and the endpoint (an S3-compatible server: "
                             "AWS_ENDPOINT_URL_S3, see docs/decoupled.md)") from e
    finally:
        if created:
            try:
                store.delete(probe)
            except Exception:  # the probe's own error says more
                pass
    if not ok:
        how = f"exclusive create raised {err!r}" if err is not None else "a second create overwrote the first"
        raise ValueError(
            f"{where}: this fsspec backend lacks atomic create-if-absent ({how}), which "
            f"leases need (exactly one of two decoupled workers may take a path); {fix}"
        ) from err
