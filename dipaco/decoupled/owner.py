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

A run lives in its store: ``run.json`` (:func:`write_run_record`) holds its config, the
dipaco version that made it and its run directory; ``finished.json`` marks it finished.
Roles that join from anywhere (``dipaco-decoupled worker|sync|status|finish``) open it
with :func:`open_run`, which refuses in one line, before writing anything, a location
that cannot be reached or is not a run's store, a run made by another dipaco, a config
that is not the run's, and (to train) a finished run.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, Optional

import dipaco
from dipaco.storage.hashing import sha256_hex
from dipaco.storage.strict_json import dumps_strict
from dipaco.decoupled.fsspec_store import open_store
from dipaco.decoupled.store import JSON_DIGEST, CorruptBlob, Store, decode_json
from dipaco.run.path_guard import check_target
from dipaco.run.provenance import git_commit
from dipaco.run.run_dir import RunDir, RunDirError

OWNER_KEY = "owner.json"
PLAN_KEY = "plan.json"
RUN_KEY = "run.json"  # the run: config, code version, run directory (write_run_record)
FINISHED_KEY = "finished.json"  # written once its final checkpoint is
# config keys that say where this copy of the run is, not what it trains
_WHERE_KEYS = ("run_dir", "resume")
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


def code_version() -> str:
    """This dipaco's version, with its git commit when it runs from a checkout."""
    commit = git_commit()
    return dipaco.__version__ + (f"+{commit['commit'][:12]}" if commit else "")


def config_digest(cfg_dict: dict) -> str:
    """sha256 of a config (a plain dict), the keys of :data:`_WHERE_KEYS` left out."""
    what = {k: v for k, v in cfg_dict.items() if k not in _WHERE_KEYS}
    return sha256_hex(dumps_strict(what, sort_keys=True, default=str))  # a NaN key: null, not a token


def write_run_record(store: Store, cfg_dict: dict, run_dir: Path, slurm: Optional[dict] = None) -> dict:
    """Record the run in its store (at every start of its creator: a resume may change
    keys a resume may change, and the code): what every joining role is checked against.
    ``slurm``: the job and attempt of a ``launcher=slurm`` creator (its other tasks join
    the run of their own attempt only)."""
    old = store.get_json(RUN_KEY) or {}
    record = {"format": 1, "code": code_version(), "config": cfg_dict, "config_digest": config_digest(cfg_dict),
              "run_dir": str(run_dir), "created": old.get("created", time.time()), "updated": time.time(),
              "slurm": slurm}
    store.put_json(RUN_KEY, record)
    return record


class JoinRefused(RunDirError):
    """A role may not join the run in a store (one line: what and what to do)."""


class NoRunYet(JoinRefused):
    """The store holds no run (yet: its creator makes it once the data is prepared)."""


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def check_role(record: dict, url: str, cfg_dict: Optional[dict] = None) -> None:
    """Refuse (:class:`JoinRefused`) a role of another dipaco, or whose config is not the run's."""
    if record.get("code") != code_version():
        raise JoinRefused(f"{url} holds a run made by dipaco {record.get('code')}; this is dipaco {code_version()}: "
                          "run the same dipaco (version and commit) on every host of a run")
    if cfg_dict is not None and config_digest(cfg_dict) != record.get("config_digest"):
        mine, theirs = _flat(cfg_dict), _flat(record.get("config", {}))
        keys = sorted(k for k in set(mine) | set(theirs)
                      if mine.get(k) != theirs.get(k) and k.split(".")[0] not in _WHERE_KEYS)
        shown = ", ".join(f"{k}: run has {theirs.get(k)!r}, yours {mine.get(k)!r}" for k in keys[:3])
        raise JoinRefused(f"{url}: this config is not the run's ({shown}{', ...' if len(keys) > 3 else ''}); "
                          "join without a config (the run's is in the store) or with the run's")


def open_run(url: str, *, cfg_dict: Optional[dict] = None, to_train: bool = True) -> tuple[Store, dict]:
    """The store at ``url`` and its run record, for a role joining the run; refused
    (:class:`JoinRefused`, one line, nothing written) when the store cannot be reached or
    holds no run, the run was made by another dipaco, ``cfg_dict`` is not its config, or
    (``to_train``) the run is finished."""
    if not url.strip():  # '' would be read as this folder
        raise JoinRefused("the store URL is empty: pass the store of a run (diloco.decoupled.store_url, "
                          "default RUN_DIR/decoupled)")
    local = _local_path(url)
    if local is not None and not local.is_dir():
        kind = JoinRefused if local.exists() else NoRunYet
        raise kind(f"no store at {url} ({'not a folder' if local.exists() else 'no such folder'}): "
                   "pass the store of a run (diloco.decoupled.store_url, default RUN_DIR/decoupled)")
    if local is not None:
        store = open_store(str(local))
    else:
        protocol = url.split("://", 1)[0].lower()
        if protocol in _ONE_PROCESS:
            raise JoinRefused(f"{url}: a {protocol}:// store lives inside one process; another process cannot join it")
        try:
            store = open_store(url)
            store.list("")
        except Exception as e:  # noqa: BLE001 - whatever the backend raises (no credentials, no network)
            raise JoinRefused(f"cannot reach the store at {url} ({type(e).__name__}: "
                              f"{' '.join(str(e).split())[:300]})") from None
    try:
        record = store.get_json(RUN_KEY)
    except ValueError:
        record = None
    if not isinstance(record, dict) or "config" not in record:
        legacy = store.get(PLAN_KEY) is not None
        why = ("a dipaco store from before run records (resume it with dipaco-train)" if legacy
               else "not the store of a dipaco run (no run.json)")
        # no run.json: a store being made (its plan comes first), or one from before run records
        kind = NoRunYet if record is None else JoinRefused
        raise kind(f"{url} is {why}; pass the store of a decoupled run (diloco.decoupled.store_url)")
    check_role(record, url, cfg_dict)
    if to_train and store.get(FINISHED_KEY) is not None:
        fin = store.get_json(FINISHED_KEY) or {}
        raise JoinRefused(f"the run in {url} is finished (checkpoint {fin.get('checkpoint')}): nothing to join; "
                          "score it with dipaco-infer, or start a new run")
    return store, record


__all__ = ["OWNER_KEY", "PLAN_KEY", "RUN_KEY", "FINISHED_KEY", "JoinRefused", "NoRunYet", "check_store", "claim_store",
           "code_version", "config_digest", "write_run_record", "check_role", "open_run"]
