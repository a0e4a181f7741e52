"""Start gloo ranks for multi-process tests, with a bounded wall-clock timeout.

Usage (``fn`` must be importable by the spawned children: a module-level function)::

    from _dist import run_ranks
    run_ranks(my_worker, world_size=4, args=(out_dir,), timeout=60)

Each rank sets ``torch.set_num_threads(1)``, joins a gloo process group (FileStore in a
fresh temporary directory by default, or TCP on a free port with ``init="tcp"``), runs
``fn(rank, world_size, *args)`` and destroys the group. A rank that raises fails the
call with its traceback; a run that outlives ``timeout`` seconds is killed and raises
``TimeoutError`` instead of blocking CI. Collectives also time out after ``timeout``.
"""
from __future__ import annotations

import datetime
import os
import shutil
import socket
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

import torch
import torch.multiprocessing as mp

from dipaco.runtime import process_start

__all__ = ["free_port", "run_ranks"]


def free_port() -> int:
    """A TCP port that was free a moment ago (bind port 0 on localhost)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, fn: Callable[..., Any], world_size: int, init_method: str, timeout: float, args: Sequence[Any],
           handover: process_start.Handover) -> None:
    import torch.distributed as dist

    process_start.enter(handover)  # started as the package starts its ranks (forked from its server)
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout),
    )
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
    # Success: skip interpreter teardown, which takes ~3 s for 4 torch processes on 2
    # cores. Results must already be on disk (torch.save closes its file). On failure
    # we never get here: torch's spawn wrapper reports the traceback and exits non-zero.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    timeout: float = 60.0,
    init: str = "file",
) -> float:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks.

    Returns the wall time in seconds. Raises the first rank's exception, or
    ``TimeoutError`` after ``timeout`` seconds (the ranks are killed).
    """
    tmp = tempfile.mkdtemp(prefix="dipaco_dist_")
    if init == "file":
        init_method = f"file://{os.path.join(tmp, 'store')}"
    elif init == "tcp":
        init_method = f"tcp://127.0.0.1:{free_port()}"
    else:
        raise ValueError(f"init must be 'file' or 'tcp', got {init!r}")
    t0 = time.monotonic()
    ctx = mp.start_processes(
        _entry,
        args=(fn, world_size, init_method, float(timeout), tuple(args), process_start.handover()),
        nprocs=world_size,
        join=False,
        start_method=process_start.start_method(),
    )
    deadline = t0 + timeout
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world_size} ranks still running after {timeout:.0f} s (a hung collective?)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
        shutil.rmtree(tmp, ignore_errors=True)
    return time.monotonic() - t0
