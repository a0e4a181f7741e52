"""What a ``dipaco-infer generate --file F --out O`` job was made with, kept beside O as
``O.job.json``, so that ``--resume`` continues only the same job.

The lines already in O were generated from a model, a prompts file and settings. Resuming
with another checkpoint (the run trained further), another prompts file (line i is then
another prompt) or other settings (``--max-new-tokens``, sampling, ``--fast``, ...) would
append lines made otherwise to lines made before, and nothing in the lines says so. The
record is written when O is started; ``--resume`` compares it with what this command would
do and refuses in one line naming the first difference. A missing record is a refusal,
never a pass (docs/reliability.md: every artefact is verified when read).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Optional

from dipaco.run.run_dir import RunDirError
from dipaco.storage.atomic import write_json
from dipaco.storage.hashing import sha256_file, sha256_json

__all__ = ["JOB_SUFFIX", "check_resume", "describe_job", "job_path", "record_job"]

JOB_SUFFIX = ".job.json"
_KIND = "dipaco-infer generate --file"


def job_path(out: Path) -> Path:
    """Where the record of the job writing ``out`` is kept."""
    return out.with_name(out.name + JOB_SUFFIX)


def describe_job(args: argparse.Namespace, manifest: dict) -> dict[str, Any]:
    """What the lines of this command depend on: the checkpoint's weights (its manifest, so a
    run directory that moved still matches), the prompts file's bytes and every setting that
    changes a generated token. Batch size and loaded paths do not, except under ``--fast``."""
    settings = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_k": args.top_k,
                "top_p": args.top_p, "seed": args.seed, "reroute_every": args.reroute_every,
                "ignore_eos": bool(args.ignore_eos), "text_field": args.text_field, "fast": bool(args.fast)}
    if args.fast:  # one product per layer over the batch: its bits depend on who shares it
        settings["batch_size"] = args.batch_size
    return {"kind": _KIND, "checkpoint_manifest_sha256": sha256_json(manifest),
            "prompts_file": str(args.file), "prompts_sha256": sha256_file(args.file), "settings": settings}


def record_job(out: Path, job: dict[str, Any]) -> None:
    """Write ``out``'s record as its job starts. A file of that name that is not such a
    record is the user's: refused, not replaced."""
    path = job_path(out)
    if path.exists() and _read(path) is None:
        raise RunDirError(f"generate --out {out}: {path} exists and is not a record dipaco wrote; it is never "
                          "replaced: move it, or choose another --out")
    write_json(path, job)


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
