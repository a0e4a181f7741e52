"""Which files of a folder dipaco wrote: one record per folder, one helper every writer uses.

The rule (docs/reliability.md, "A command replaces or deletes only files it wrote"): every
folder a command writes into (an export, a report's folder, a sweep folder, the folder of
``score --out F``) holds :data:`RECORD`, the files dipaco wrote there with their size and
modification time. A command then

* replaces or deletes only files in that record, and only while they are as dipaco left
  them (a recorded file the user has since edited is theirs again);
* refuses, in one line and before any work, a file of the user's that stands where it
  would write (``README.md`` added to an export, a hand-written ``multirun.yaml``);
* leaves every other file of the folder alone (the user's ``eval/`` beside an export);
* never writes through a symbolic link inside the folder, and never into a folder that
  belongs to another dipaco write (``--out EXPORT/path_003`` of a routed export);
* stages a multi-file write in ``FOLDER/.dipaco-partial-<pid>-*`` and moves it in when
  complete; a staging folder left by a killed process is removed by the next write.

One call for a command that writes one file (``score --out``, ``generate --out``,
``eval --out``)::

    write_owned_file(path, text, "score --out", replace=True)

and for a command that writes a set of files (an export)::

    check_owned(out, ["model.safetensors", ...], "export --out", replace=force)  # before any work
    with OwnedWrite(out, "export --out", replace=force) as staging:
        ...                                   # write every file under ``staging``
    # on success the staged files replace the folder's own; on failure nothing changed

``record_written(folder, names, what)`` records files a third party wrote for dipaco once
``check_owned`` allowed them (Hydra's ``multirun.yaml``).

Every such write names itself in :data:`OUTPUTS`, the registry of writers, with the flag
that lets it replace (or continue) its own earlier output; an unregistered ``what`` is a
programming error, and ``tests/test_writers.py`` walks every registered writer through the
same hostile targets. A one-file output (``score --out``, ``eval --out``, ``dipaco-plan
--json``) is checked before any work by :func:`check_out_file`: one rule for all of them.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from types import TracebackType
from typing import Callable, Iterable, Iterator, Optional, Union

from dipaco.storage.atomic import private_temp_dir, publish, temp_file_beside, write_atomically
from dipaco.run.path_guard import check_target
from dipaco.run.run_dir import RunDirError
from dipaco.storage.strict_json import dumps_strict

RECORD = ".dipaco-owned.json"
#: every write into a place the user names → the flag that allows replacing its own earlier
#: output there ("" where it is always regenerated from its inputs: a report of a folder)
OUTPUTS: dict[str, str] = {
    "score --out": "--force", "eval --out": "--force", "generate --out": "--resume", "export --out": "--force",
    "dipaco-plan --json": "--force", "dipaco-plan --plot": "--force", "dipaco-report DIR": "",
    "hydra.sweep.dir": "", "benchmark results": "",
}
STAGING_PREFIX = ".dipaco-partial-"
_VERSION = 1


class OwnershipError(RunDirError):
    """A write that would replace, delete or pass through something dipaco did not write."""


def _stamp(p: Path, by: Optional[str] = None) -> dict:
    st = p.lstat()
    out: dict = {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns}
    if by is not None:
        out["by"] = by
    return out


def read_record(folder: Union[str, os.PathLike]) -> dict[str, Optional[dict]]:
    """The files of ``folder`` that dipaco wrote (relative name → size, modification time
    and the command that wrote it, ``by``); empty when the folder has no record."""
    path = Path(folder) / RECORD
    if path.is_symlink() or not path.is_file():
        return {}
    try:
        files = json.loads(path.read_text(encoding="utf-8"))["files"]
        return {str(k): v for k, v in files.items()} if isinstance(files, dict) else {}
    except (OSError, ValueError, KeyError, TypeError):
        return {}  # an unreadable record vouches for nothing: every file is the user's


def _write_record(folder: Path, files: dict[str, Optional[dict]], what: str) -> None:
    text = dumps_strict({"version": _VERSION, "written_by": what, "files": dict(sorted(files.items()))}, indent=1)
    write_atomically(folder / RECORD, lambda tmp: tmp.write_text(text + "\n", encoding="utf-8"), prefix=RECORD + ".")


def _as_written(p: Path, entry: Optional[dict]) -> bool:
    """Whether ``p`` is still the file dipaco recorded (or, while a write is being moved
    in, the file it replaces: ``was``)."""
    if p.is_symlink() or not p.is_file() or not isinstance(entry, dict):
        return False
    now = _stamp(p)
    return any(isinstance(e, dict) and now == {"bytes": e.get("bytes"), "mtime_ns": e.get("mtime_ns")}
               for e in (entry, entry.get("was")))


def _check_inside(folder: Path, rel: str, what: str) -> Path:
    """``folder/rel`` with no component a symbolic link and no ``..``; else refused."""
    parts = Path(rel).parts
    if Path(rel).is_absolute() or ".." in parts or not parts:
        raise OwnershipError(f"{what}: {rel!r} is not a name inside {folder}")
    p = folder
    for part in parts:
        p = p / part
        if p.is_symlink():
            raise OwnershipError(f"{what}: {p} is a symbolic link; dipaco never writes through a link "
                                 "(remove it or choose another folder)")
    return p


def _enclosing_owner(folder: Path) -> Optional[Path]:
    """The folder above ``folder`` whose record lists files below ``folder`` (it is part of
    another dipaco write), else ``None``."""
    for parent in folder.parents:
        rec = read_record(parent)
        if not rec:
            continue
        inner = folder.relative_to(parent).as_posix() + "/"
        if any(name.startswith(inner) for name in rec):
            return parent
    return None


def sweep_stale_staging(folder: Path) -> None:
    """Remove the staging folders (and temporary files) a killed writer left in ``folder``
    (their process is gone)."""
    if not folder.is_dir():
        return
    for d in folder.glob(STAGING_PREFIX + "*"):
        try:
            pid = int(d.name[len(STAGING_PREFIX):].split("-", 1)[0])
        except ValueError:
            continue
        if d.is_symlink() or _alive(pid):
            continue
        if d.is_dir():
            shutil.rmtree(d, ignore_errors=True)
        elif d.is_file():  # a single-file write's temporary file
            d.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's process: alive
    return True


def registered(what: str) -> str:
    """The flag that lets ``what`` replace its own output (:data:`OUTPUTS`); ``ValueError``
    for a writer that is not registered (every writer is, so the tests walk it)."""
    if what not in OUTPUTS:
        raise ValueError(f"{what!r} is not a registered writer: add it to dipaco.run.owned.OUTPUTS")
    return OUTPUTS[what]


def check_owned(folder: Union[str, os.PathLike], names: Iterable[str], what: str, *,
                replace: bool, again: str = "pass --force to replace it") -> Path:
    """Refuse (:class:`OwnershipError`, one line) a write of ``names`` into ``folder`` that
    would pass a symbolic link, land in another dipaco write, replace a file the user owns,
    or (``replace`` false) replace dipaco's own earlier file; return the resolved folder."""
    registered(what)
    folder = Path(folder).expanduser().resolve()
    owner = _enclosing_owner(folder)
    if owner is not None:
        raise OwnershipError(f"{what} {folder} lies inside {owner}, which another dipaco command wrote "
                             f"(its files are listed in {owner / RECORD}); choose a new folder")
    if folder.exists() and not folder.is_dir():
        raise OwnershipError(f"{what} {folder} is a file, not a folder; choose another")
    record = read_record(folder)
    for rel in names:
        p = _check_inside(folder, rel, what)
        if not os.path.lexists(p):
            continue
        if rel not in record:
            raise OwnershipError(f"{what}: {p} is in the way and dipaco did not write it (it is yours); "
                                 "move it or choose another folder")
        if not _as_written(p, record[rel]):
            raise OwnershipError(f"{what}: {p} was changed since dipaco wrote it, so it is yours now; "
                                 "move it or choose another folder")
        by = record[rel].get("by", what)
        if by != what:  # another command's output (score --out beside an export): not this one's
            raise OwnershipError(f"{what}: {p} was written by {by}, not by {what}; move it or choose another folder")
        if not replace:
            raise OwnershipError(f"{what}: {p} holds an earlier dipaco output; {again}")
    return folder


@contextlib.contextmanager
def _writable(folder: Path, what: str) -> Iterator[None]:
    """A folder that cannot be made or written (read-only, not a folder on the way) is one
    line, before anything is written."""
    try:
        yield
    except OSError as e:
        raise OwnershipError(f"{what}: cannot write into {folder}: {e.strerror or e}; choose a writable folder") \
            from None


def _staged_files(staging: Path) -> list[str]:
    return sorted(p.relative_to(staging).as_posix() for p in staging.rglob("*")
                  if p.is_file() and not p.is_symlink())


class OwnedWrite:
    """Stage a set of files for ``folder`` and move them in when the block succeeds.

    ``with OwnedWrite(out, "export --out", replace=True) as staging:`` gives a fresh staging
    folder inside ``out``; on a clean exit the staged files are checked
    (:func:`check_owned`), moved in (``manifest.json`` last, so a reader sees the old or
    the new manifest), recorded, and dipaco's files of the earlier write that this one did
    not rewrite are removed (with ``replace`` only). On an exception nothing of the folder
    changes and the staging folder is removed; a folder this write created is removed
    again when nothing else is in it.
    """

    def __init__(self, folder: Union[str, os.PathLike], what: str, *, replace: bool,
                 again: str = "pass --force to replace it") -> None:
        self.folder = Path(folder).expanduser().resolve()
        self.what, self.replace, self.again = what, replace, again
        self.staging: Optional[Path] = None
        self._created = False

    def __enter__(self) -> Path:
        check_owned(self.folder, (), self.what, replace=self.replace)
        self._created = not self.folder.exists()
        with _writable(self.folder, self.what):
            self.folder.mkdir(parents=True, exist_ok=True)
            sweep_stale_staging(self.folder)
            self.staging = private_temp_dir(self.folder, f"{STAGING_PREFIX}{os.getpid()}-")
        return self.staging

    def __exit__(self, kind: Optional[type], exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        assert self.staging is not None
        try:
            if kind is None:
                self._publish()
        finally:
            shutil.rmtree(self.staging, ignore_errors=True)
            if kind is not None and self._created and self.folder.is_dir() and not any(self.folder.iterdir()):
                self.folder.rmdir()

    def _publish(self) -> None:
        assert self.staging is not None
        names = _staged_files(self.staging)
        check_owned(self.folder, names, self.what, replace=self.replace, again=self.again)
        old = read_record(self.folder)
        # recorded before the moves (a rename keeps size and mtime), with the file each
        # replaces as "was": a write killed halfway leaves a folder the next write accepts
        record = dict(old)
        for rel in names:
            record[rel] = {**_stamp(self.staging / rel, self.what), "was": old.get(rel)}
        _write_record(self.folder, record, self.what)
        for rel in sorted(names, key=lambda n: (n == "manifest.json", n)):
            dst = _check_inside(self.folder, rel, self.what)
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.replace(self.staging / rel, dst)
            record[rel].pop("was", None)
        stale = [rel for rel, e in old.items() if rel not in names and (e or {}).get("by", self.what) == self.what]
        if self.replace:
            for rel in stale:
                p = self.folder / rel
                try:
                    p = _check_inside(self.folder, rel, self.what)
                except OwnershipError:
                    record.pop(rel, None)
                    continue
                if _as_written(p, old[rel]):
                    p.unlink()
                    _prune_empty(p.parent, self.folder)
                record.pop(rel, None)
        _write_record(self.folder, record, self.what)


def _prune_empty(d: Path, top: Path) -> None:
    """Remove ``d`` and its parents up to ``top`` (excluded) while empty."""
    while d != top and top in d.parents:
        try:
            d.rmdir()
        except OSError:
            return
        d = d.parent


def write_owned_file(path: Union[str, os.PathLike], data: Union[str, bytes], what: str, *,
                     replace: bool = True, again: str = "choose a new path") -> Path:
    """Write one file (``score --out F``) by the rule: refused if a file of the user's is
    there, if a link is on the way, or (``replace`` false) if dipaco's own earlier file is
    there; written to a temporary file and renamed; recorded in its folder's record."""
    path = Path(path).expanduser()
    folder = path.parent.resolve()
    name = path.name
    check_owned(folder, [name], what, replace=replace, again=again)
    with _writable(folder, what):
        folder.mkdir(parents=True, exist_ok=True)
        sweep_stale_staging(folder)
        tmp = temp_file_beside(folder / name, prefix=f"{STAGING_PREFIX}{os.getpid()}-")
    try:
        tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
        publish(tmp, folder / name)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    record = read_record(folder)
    record[name] = _stamp(folder / name, what)
    _write_record(folder, record, what)
    return folder / name


def check_out_file(path: Union[str, os.PathLike], what: str, *, again: bool,
                   own: Optional[Callable[[Path], bool]] = None) -> Path:
    """The one rule of a command's one-file output (``score --out F``), checked before any
    work: not in a run directory nor a special file (:func:`dipaco.run.path_guard.check_target`),
    not a folder, not a symbolic link, not a file of the user's; an earlier output of its own
    is refused unless ``again`` (its flag, :data:`OUTPUTS`: ``--force``, ``--resume``) was
    given. ``own(path)``: whether an existing file is this command's earlier output (default:
    its folder's record says so). Returns the absolute path to write."""
    flag = registered(what)
    given = Path(path).expanduser()
    if given.is_symlink():
        raise OwnershipError(f"{what} {path} is a symbolic link; dipaco never writes through a link (remove it "
                             "or choose another path)")
    out = check_target(path, what, fix=f"choose a {what.split()[-1]} outside every run directory")
    if out.is_dir():
        raise OwnershipError(f"{what} {path} is a directory; name a file in it (e.g. {given / 'out.json'})")
    verb = "continue" if flag == "--resume" else "replace"
    if out.exists() and flag and not again:
        ours = own(out) if own is not None else _as_written(out, read_record(out.parent).get(out.name))
        whose = "an earlier output of this command" if ours else "not a file dipaco wrote"
        raise OwnershipError(f"{what} {path} exists ({whose}): "
                             + (f"pass {flag} to {verb} it, or choose a new path" if whose.startswith("an") else
                                "it is never overwritten; choose a new path"))
    if flag != "--resume":  # a continued file is vouched for by its own job record (cli/generate_job.py)
        check_owned(out.parent, [out.name], what, replace=True)
    return out


def record_written(folder: Union[str, os.PathLike], names: Iterable[str], what: str) -> None:
    """Record ``names``, just written into ``folder`` by a third party on dipaco's behalf
    (Hydra's ``multirun.yaml``, after :func:`check_owned` allowed it), as dipaco's."""
    folder = Path(folder).expanduser().resolve()
    record = read_record(folder)
    for n in names:
        p = _check_inside(folder, n, what)
        if p.is_file():
            record[n] = _stamp(p, what)
    _write_record(folder, record, what)


__all__ = ["OUTPUTS", "OwnedWrite", "OwnershipError", "RECORD", "STAGING_PREFIX", "check_out_file", "check_owned",
           "read_record", "record_written", "registered", "sweep_stale_staging", "write_owned_file"]
