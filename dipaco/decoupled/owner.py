"""Whose store is it: a decoupled store records the run that owns it, and no other run
replaces or continues it.

A store (``diloco.decoupled.store_url``, default ``<run_dir>/decoupled``) holds a run's
module versions, updates, leases and ledgers. ``owner.json`` in it names the run
directory that made it. :func:`claim_store` opens the store for a run and refuses, in
one line and before anything is written or deleted:

* a path the run may not write (:func:`dipaco.run.path_guard.check_target`: inside another
  run directory, a run file, a special file);
* a store whose ``owner.json`` names another run, or a store without one that lies
  outside this run's directory (a store from before owners: whose it is is unknown);
* a non-empty location that is not a dipaco store.

A fresh run empties only its own store (an earlier attempt in the same run directory);
a resume continues only its own. A store inside the run's own directory is the run's
by place, so a run directory that is copied or moved keeps its store.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Optional

from dipaco.decoupled.fsspec_store import open_store
from dipaco.decoupled.store import JSON_DIGEST, CorruptBlob, Store, decode_json
from dipaco.run.path_guard import check_target
from dipaco.run.run_dir import RunDir, RunDirError

OWNER_KEY = "owner.json"
PLAN_KEY = "plan.json"
_KEY = "diloco.decoupled.store_url"
# fsspec protocols whose files live in the memory of one process
_ONE_PROCESS = ("memory",)


def _local_path(url: str) -> Optional[Path]:
    """The directory of a local store URL (a path or ``file://``); ``None`` for fsspec URLs."""
    url = url[len("file://"):] if url.startswith("file://") else url
    return None if "://" in url else Path(url).expanduser().resolve()


def _owner_record(url: str, blob: Optional[bytes]) -> Optional[Any]:
    """The run named by ``owner.json``, checked against its sha256. A record without one
    (a store made before records had one) is read as it is: it is only ever compared
    with this run's, and anything else in it is refused as another run's store."""
    if blob is None:
        return None
    try:
        record = json.loads(blob.decode("utf-8"))
    except ValueError:
        return None  # unreadable: the store is judged by what else it holds
    if not isinstance(record, dict) or JSON_DIGEST not in record:
        return record
    try:
        return decode_json(blob)
    except CorruptBlob as e:
        raise RunDirError(f"{_KEY}={url}: its {OWNER_KEY} is corrupt ({e}); whose store it is cannot be told, so "
                          "it is left alone: point store_url at a new location") from None


def _read_local(url: str, path: Path) -> tuple[Optional[Any], bool, bool]:
    """``(owner record, holds a plan, holds anything)`` of a local store directory."""
    if not path.is_dir():
        return None, False, False
    try:
        blob: Optional[bytes] = (path / OWNER_KEY).read_bytes()
    except OSError:
        blob = None
    return _owner_record(url, blob), (path / PLAN_KEY).is_file(), any(path.iterdir())


def check_store(url: str, run: RunDir, resume: bool) -> None:
    """Refuse (:class:`RunDirError`) a store ``run`` may not use, writing nothing: the
    checks of :func:`claim_store`, made before the run starts."""
    _inspect(url, run, resume)


def claim_store(url: str, run: RunDir, resume: bool) -> Store:
    """Open the store at ``url`` for ``run``, emptied for a fresh run (see the module
    docstring); raise :class:`RunDirError` when it is not this run's to use."""
    local, nonempty = _inspect(url, run, resume)
    if nonempty and not resume:  # a fresh run never inherits updates, leases or ledgers of an earlier one
        assert local is not None  # _inspect refuses a non-empty remote store for a fresh run
        shutil.rmtree(local)
    store = open_store(url)
    if store.get(OWNER_KEY) is None:
        store.put_json(OWNER_KEY, {"run_dir": str(run.root)})
    return store


def _inspect(url: str, run: RunDir, resume: bool) -> tuple[Optional[Path], bool]:
    """``(local directory or None, holds anything)`` of the store, after every refusal."""
    local = _local_path(url)
    if local is not None:
        check_target(url[len("file://"):] if url.startswith("file://") else url, _KEY, own_run=run.root,
                     owned=("decoupled",), folder=True, fix="point it at a new directory, or leave it null (RUN/decoupled)")
        owner, has_plan, nonempty = _read_local(url, local)
        here = local == run.root / "decoupled" or run.root in local.parents
    else:
        store = _open_remote(url)
        owner, has_plan = _owner_record(url, store.get(OWNER_KEY)), store.get(PLAN_KEY) is not None
        nonempty, here = owner is not None or has_plan or bool(store.list("")), False
    _refuse_foreign(url, owner, has_plan, nonempty, here, {"run_dir": str(run.root)})
    if nonempty and not resume and local is None:
        raise RunDirError(f"{_KEY}={url} holds this run's store from an earlier attempt; a fresh run starts "
                          "from an empty store: empty it, or point store_url at a new location")
    return local, nonempty


def _open_remote(url: str) -> Store:
    """An fsspec store every process of the run can reach, or one :class:`RunDirError`: a
    store kept in one process's memory (``memory://``: each worker and synchroniser
    process would see its own, empty one, and restart forever) or one whose backend is
    missing (``s3://`` without ``s3fs``) is refused before work."""
    protocol = url.split("://", 1)[0].lower()
    if protocol in _ONE_PROCESS:
        raise RunDirError(f"{_KEY}={url}: a {protocol}:// store lives inside one process, but decoupled workers "
                          "and synchronisers are separate processes that must share it; point it at a shared "
                          "directory (a path), or leave it null (RUN/decoupled)")
    try:
        return open_store(url)
    except (ImportError, ValueError, OSError) as e:  # a backend not installed, an unknown protocol, unreachable
        raise RunDirError(" ".join(str(e).split())) from None


def _refuse_foreign(url: str, owner: Optional[Any], has_plan: bool, nonempty: bool, here: bool,
                    me: dict) -> None:
    fix = "point diloco.decoupled.store_url at a new directory, or leave it null (RUN/decoupled)"
    if owner is not None and owner != me and not here:
        who = owner.get("run_dir") if isinstance(owner, dict) else owner
        raise RunDirError(f"{_KEY}={url} is the store of another run ({who}, {OWNER_KEY}); a run never "
                          f"replaces or continues another run's store: {fix}")
    if owner is None and nonempty and not has_plan:
        raise RunDirError(f"{_KEY}={url} is not empty and not a dipaco store: {fix}")
    if owner is None and has_plan and not here:
        raise RunDirError(f"{_KEY}={url} holds a dipaco store without {OWNER_KEY} (made before stores had "
                          f"owners): which run it belongs to is unknown, so it is left alone: {fix}")


__all__ = ["OWNER_KEY", "PLAN_KEY", "check_store", "claim_store"]
