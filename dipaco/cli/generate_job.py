"""What a ``dipaco-infer generate --file F --out O`` job was made with, kept beside O as
``O.job.json``, so that ``--resume`` continues only the same job.

The lines already in O were generated from a model, a prompts file and settings. Resuming
with another checkpoint (the run trained further), another prompts file (line i is then
another prompt) or other settings (``--max-new-tokens``, sampling, ``--fast``, ...) would
append lines made otherwise to lines made before, and nothing in the lines says so. The
record is written when O is started; ``--resume`` compares it with what this command would
do and refuses in one line naming the first difference. A missing record is a refusal,
never a pass (docs/reliability.md: every artefact is verified when read).

One job writes O at a time: :func:`claim` takes an exclusive lock on O before its record
is written or its lines are counted, so a second command on the same O (a resume started
while the first still runs) is refused instead of appending a second copy of the same
lines between the first one's.
"""
from __future__ import annotations

import argparse
import errno
import fcntl
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from dipaco.run.run_dir import RunDirError
from dipaco.storage.atomic import write_json
from dipaco.storage.hashing import sha256_file, sha256_json

__all__ = ["JOB_SUFFIX", "check_record_name", "check_resume", "claim", "describe_job", "job_path", "read_prompts",
           "record_job"]

JOB_SUFFIX = ".job.json"
_KIND = "dipaco-infer generate --file"


def job_path(out: Path) -> Path:
    """Where the record of the job writing ``out`` is kept."""
    return out.with_name(out.name + JOB_SUFFIX)


# Settings recorded since a later dipaco: a record written before them was made without
# choosing them, and is not refused for lacking them (an interrupted job stays resumable).
_ADDED_SINCE = ("device",)


def describe_job(args: argparse.Namespace, manifest: dict, device: str, prompts_sha256: str) -> dict[str, Any]:
    """What the lines of this command depend on: the checkpoint's weights (its manifest, so a
    run directory that moved still matches), the prompts file's bytes and every setting that
    changes a generated token, the kind of device the models run on included (``cpu`` or
    ``cuda``: their kernels round differently). Batch size and loaded paths do not, except
    under ``--fast``. ``prompts_sha256``: of the bytes the prompts were read from
    (:func:`read_prompts`), not of the file as it is now."""
    settings = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_k": args.top_k,
                "top_p": args.top_p, "seed": args.seed, "reroute_every": args.reroute_every,
                "ignore_eos": bool(args.ignore_eos), "text_field": args.text_field, "fast": bool(args.fast),
                "device": device}
    if args.fast:  # one product per layer over the batch: its bits depend on who shares it
        settings["batch_size"] = args.batch_size
    return {"kind": _KIND, "checkpoint_manifest_sha256": sha256_json(manifest),
            "prompts_file": str(args.file), "prompts_sha256": prompts_sha256, "settings": settings}


def read_prompts(args: argparse.Namespace, read: Callable[[str, str], Any]) -> tuple[Any, str]:
    """``read(args.file, args.text_field)`` and the sha256 of the bytes it read: the file is
    hashed before and after, and one that changed meanwhile (prompts appended while the job
    starts) is refused, so the record never vouches for prompts other than the ones read."""
    before = sha256_file(args.file) if os.path.isfile(args.file) else ""  # read() names what else it is
    out = read(args.file, args.text_field)
    if sha256_file(args.file) != before:
        raise RunDirError(f"--file {args.file} changed while it was read: let whatever writes it finish, "
                          "then run the command again")
    return out, before


def check_record_name(out: Path) -> None:
    """Refuse, before any work, an ``out`` whose record's name holds a file dipaco did not
    write (the user's: never replaced)."""
    path = job_path(out)
    if os.path.lexists(path) and _read(path) is None:
        raise RunDirError(f"generate --out {out}: {path} exists and is not a record dipaco wrote; it is never "
                          "replaced: move it, or choose another --out")


def record_job(out: Path, job: dict[str, Any]) -> None:
    """Write ``out``'s record as its job starts. A file of that name that is not such a
    record is the user's: refused, not replaced."""
    check_record_name(out)
    write_json(job_path(out), job)


def claim(out: Path) -> int:
    """Open ``out`` for appending (created if missing) and lock it for this job alone; the
    descriptor (the lock goes with it, a kill included) is the caller's to close. Another
    job holding it is refused in one line, nothing written."""
    fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)  # never through a link
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunDirError(f"generate --out {out} is being written by another dipaco-infer generate right now: "
                          "wait for it to end (then --resume continues it), or choose another --out") from None
    except OSError as e:
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            os.close(fd)
            raise
        # a file system without locks (some network mounts): the job runs, unguarded, and says so
        print(f"dipaco: note: {out} cannot be locked on this file system ({e.strerror}); run one job on it "
              "at a time", file=sys.stderr)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_resume(out: Path, job: dict[str, Any]) -> None:
    """Refuse (one line) to continue ``out`` unless its record says this very job wrote it."""
    path = job_path(out)
    recorded = _read(path)
    fix = "choose a new --out"
    if recorded is None:
        raise RunDirError(f"generate --resume: {out} has no record of the job that wrote it ({path} is missing or "
                          f"unreadable), so its lines cannot be vouched for; {fix}")
    what = {"checkpoint_manifest_sha256": "another checkpoint than the one this command reads (the run trained "
                                          "further since, or --checkpoint differs)",
            "prompts_sha256": f"another prompts file than {job.get('prompts_file', 'this one')} (or the file "
                              "changed since)"}
    for key in ("checkpoint_manifest_sha256", "prompts_sha256"):
        if recorded.get(key) != job.get(key):
            raise RunDirError(f"generate --resume: {out} was written from {what[key]}; {fix}")
    old, new = recorded.get("settings") or {}, job["settings"]
    for key in [*new, *(k for k in old if k not in new)]:  # --fast before what only --fast records
        if key in _ADDED_SINCE and key not in old:
            continue
        if old.get(key) != new.get(key):
            flag = "--" + key.replace("_", "-")
            raise RunDirError(f"generate --resume: {out} was written with {flag} {old.get(key)!r}, this command has "
                              f"{new.get(key)!r}; pass the same settings to continue it, or {fix}")


def _read(path: Path) -> Optional[dict[str, Any]]:
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return rec if isinstance(rec, dict) and rec.get("kind") == _KIND else None
