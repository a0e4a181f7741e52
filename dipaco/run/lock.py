"""One writer per run directory: a lock file holding the writer's PID and host.

Two runs writing one directory interleave ``metrics.jsonl`` and overwrite each other's
checkpoints and summary, and both exit 0. The lock is taken after every check has passed
(a refused run writes nothing) and removed on exit. A lock left by a process that no
longer exists on this host (a SIGKILLed run) is taken over, with a log line; so is one
left by an earlier attempt of this SLURM job (SLURM ends a job's processes before it
restarts a requeued job, on whatever node: dipaco/runtime/preempt.py).
"""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Callable, Mapping, Optional

from dipaco.run.run_dir import RunDirError
from dipaco.storage.strict_json import dumps_strict


def restart_count(env: Mapping[str, str]) -> int:
    """How many times SLURM has requeued this job (``SLURM_RESTART_COUNT``; 0 the first time)."""
    try:
        return int(env.get("SLURM_RESTART_COUNT") or 0)
    except ValueError:
        return 0


LOCK_NAME = ".dipaco.lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def lock_holder(root: Path) -> Optional[dict]:
    """The live holder of ``root``'s lock (``{"pid", "host"}``), or ``None``. Read-only."""
    path = Path(root) / LOCK_NAME
    try:
        holder = json.loads(path.read_text(encoding="utf-8"))
        pid, host = int(holder["pid"]), str(holder["host"])
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError, OSError):
        return None  # torn or foreign content: treated as stale
    job = os.environ.get("SLURM_JOB_ID")
    earlier = restart_count({"SLURM_RESTART_COUNT": str(holder.get("slurm_restart", 0))})
    if job and holder.get("slurm_job") == job and earlier < restart_count(os.environ):
        return None  # an earlier attempt of this requeued job: SLURM ended it before this one started
    if host != socket.gethostname():
        return holder  # cannot tell whether a process on another host is alive: assume so
    return holder if pid != os.getpid() and _alive(pid) else None


def _refusal(root: Path, holder: dict) -> RunDirError:
    return RunDirError(f"{root} is in use by another dipaco run (PID {holder['pid']} on {holder['host']}); "
                       f"wait for it to finish or use another hydra.run.dir (if that process is gone, "
                       f"delete {Path(root) / LOCK_NAME})")


def check_unlocked(root: Path) -> None:
    """Raise :class:`RunDirError` naming the holder's PID if another run holds ``root``."""
    holder = lock_holder(root)
    if holder is not None:
        raise _refusal(root, holder)


class RunLock:
    """``with RunLock(run_dir): ...`` holds the directory's lock for the block."""

    def __init__(self, root: Path, log: Callable[[str], None] = print) -> None:
        self.path = Path(root) / LOCK_NAME
        self.log = log
        self.held = False

    def __enter__(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        holder = {"pid": os.getpid(), "host": socket.gethostname()}
        if os.environ.get("SLURM_JOB_ID"):  # lets a requeued attempt of this job take the lock over
            holder.update(slurm_job=os.environ["SLURM_JOB_ID"], slurm_restart=restart_count(os.environ))
        body = dumps_strict(holder)
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = lock_holder(self.path.parent)
                if holder is not None:
                    raise _refusal(self.path.parent, holder) from None
                stale = self.path.read_text(encoding="utf-8", errors="replace").strip()
                self.log(f"taking over the stale lock {self.path} ({stale or 'empty'}: that process is gone)")
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(body)
            self.held = True
            return self
        raise RunDirError(f"cannot take the lock {self.path}: another run took it at the same time")

    def __exit__(self, *exc: object) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False
