"""What made a run: software versions, source commit, host and devices.

Each accepted launch of a run (the first, and every resume or requeue) appends one JSON
line to ``provenance.jsonl`` in the run directory, so a run resumed on another machine
or another dipaco says so. ``dipaco-report`` shows the lines; every export carries them
(``provenance.json``: the run's lines and the export's own).

Every field is best effort: a library that is not installed is ``null``, and the git
commit is read only when dipaco runs from a checkout (``null`` from an installed wheel);
nothing here can fail a run.
"""
from __future__ import annotations

import datetime
import os
import platform
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Optional

import dipaco
from dipaco.storage.jsonl import append_json_lines, read_json_lines

PROVENANCE = "provenance.jsonl"
# the libraries whose versions change what a run computes or how fast
LIBRARIES = ("torch", "numpy", "faiss-cpu", "faiss-gpu", "tokenizers", "safetensors", "transformers", "hydra-core")


def _version(dist: str) -> Optional[str]:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def git_commit(source: Optional[Path] = None) -> Optional[dict[str, Any]]:
    """``{"commit", "dirty"}`` of the checkout dipaco is imported from, or ``None`` when it
    is not a git checkout (an installed wheel) or git is missing."""
    here = source or Path(__file__).resolve().parents[2]
    if not any((d / ".git").exists() for d in (here, *here.parents)):
        return None
    try:
        def git(*args: str) -> str:
            return subprocess.run(["git", "-C", str(here), *args], capture_output=True, text=True, timeout=10,
                                  check=True).stdout.strip()
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": dirty} if commit else None


def _devices() -> list[str]:
    """Names of the visible accelerators; the CPU model when there is none."""
    names: list[str] = []
    try:
        import torch

        if torch.cuda.is_available():
            names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # a broken driver must not fail the run: the record says none
        names = []
    if names:
        return names
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return [f"cpu: {cpu} ({os.cpu_count()} logical cores)"]


def collect(event: str = "start") -> dict[str, Any]:
    """One provenance record of this process, now (``event``: start, resume, export)."""
    try:
        import torch

        cuda = torch.version.cuda
    except ImportError:
        cuda = None
    faiss = _version("faiss-cpu") or _version("faiss-gpu")
    if faiss is None:
        try:
            import faiss as _faiss  # a conda or source build has no wheel metadata

            faiss = getattr(_faiss, "__version__", None)
        except ImportError:
            faiss = None
    return {
        "event": event,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dipaco": _version("dipaco") or dipaco.__version__,
        "git": git_commit(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "cuda": cuda,
        "faiss": faiss,
        "numpy": _version("numpy"),
        "tokenizers": _version("tokenizers"),
        "libraries": {name: v for name in LIBRARIES if (v := _version(name)) is not None},
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "devices": _devices(),
        "argv": [os.path.basename(sys.argv[0]), *sys.argv[1:]] if sys.argv else [],
    }


def record(run_root: str | os.PathLike, event: str) -> dict[str, Any]:
    """Append this launch's record to ``RUN/provenance.jsonl``; return it."""
    rec = collect(event)
    append_json_lines(Path(run_root) / PROVENANCE, [rec], sort_keys=True)
    return rec


def read(run_root: str | os.PathLike) -> list[dict[str, Any]]:
    """The run's records, oldest first (an unreadable line is skipped; none: ``[]``)."""
    return read_json_lines(Path(run_root) / PROVENANCE)


def one_line(rec: dict[str, Any]) -> str:
    """A record as one human line (``dipaco-report``, a model card)."""
    git = rec.get("git") or {}
    commit = f" git {git.get('commit', '')[:12]}{' (dirty)' if git.get('dirty') else ''}" if git else ""
    devices = ", ".join(rec.get("devices") or []) or "?"

    def v(key: str) -> str:
        return str(rec.get(key) or "not installed")

    cuda = f"CUDA {rec['cuda']}" if rec.get("cuda") else "no CUDA"
    return (f"{rec.get('event', '?')} {rec.get('time', '?')}: dipaco {v('dipaco')}{commit}, "
            f"Python {v('python')}, torch {v('torch')} ({cuda}), faiss {v('faiss')}, numpy {v('numpy')}, "
            f"tokenizers {v('tokenizers')}; host {rec.get('host', '?')}; {devices}")


__all__ = ["PROVENANCE", "collect", "git_commit", "one_line", "read", "record"]
